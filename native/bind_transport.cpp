// Python bindings of the transfer engine (see daemon/_native.pyi for the typed surface).
// The GIL is released while copies are enqueued or run and while waiting on a ticket.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bindings.h"
#include "cuda_ipc_transport.h"
#include "host_transport.h"

namespace py = pybind11;

namespace lmd {
namespace {

std::int64_t to_int64(py::handle item, std::size_t index) {
  long long value = PyLong_AsLongLong(item.ptr());
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error("copy " + std::to_string(index) +
                          ": offsets and lengths must be ints that fit in 64 bits");
  }
  return value;
}

CopyOp make_op(std::int64_t src, std::int64_t dst, std::int64_t length, std::size_t index) {
  if (src < 0 || dst < 0 || length < 0) {
    throw py::value_error("copy " + std::to_string(index) + " (src_offset=" + std::to_string(src) +
                          ", dst_offset=" + std::to_string(dst) + ", length=" +
                          std::to_string(length) + ") has a negative value");
  }
  return CopyOp{static_cast<std::uint64_t>(src), static_cast<std::uint64_t>(dst),
                static_cast<std::uint64_t>(length)};
}

// A sequence of (src_offset, dst_offset, length) tuples, or a C-contiguous int64 buffer
// of shape [N, 3] (a numpy array), which converts without touching each element in Python.
std::vector<CopyOp> to_ops(const py::object& copies) {
  std::vector<CopyOp> ops;
  if (PyObject_CheckBuffer(copies.ptr())) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(copies).request();
    std::string fmt = info.format;
    bool int64 = info.itemsize == 8 && (fmt == "q" || fmt == "l" || fmt == "<q" ||
                                        fmt == "<l" || fmt == "=q" || fmt == "=l");
    if (!int64 || info.ndim != 2 || info.shape[1] != 3 || info.strides[1] != 8 ||
        info.strides[0] != 24) {
      throw py::value_error("copies as an array must be C-contiguous int64 of shape [N, 3]");
    }
    const auto* v = static_cast<const std::int64_t*>(info.ptr);
    ops.reserve(static_cast<std::size_t>(info.shape[0]));
    for (py::ssize_t i = 0; i < info.shape[0]; ++i) {
      auto n = static_cast<std::size_t>(i);
      ops.push_back(make_op(v[3 * i], v[3 * i + 1], v[3 * i + 2], n));
    }
    return ops;
  }
  if (!PySequence_Check(copies.ptr()) || py::isinstance<py::str>(copies) ||
      py::isinstance<py::bytes>(copies)) {
    throw py::type_error("copies must be a sequence of (src_offset, dst_offset, length)");
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(copies);
  ops.reserve(seq.size());
  for (std::size_t i = 0; i < seq.size(); ++i) {
    py::object item = seq[i];
    if (!py::isinstance<py::tuple>(item) && !py::isinstance<py::list>(item)) {
      throw py::type_error("copy " + std::to_string(i) +
                           " must be a (src_offset, dst_offset, length) tuple");
    }
    py::sequence triple = py::reinterpret_borrow<py::sequence>(item);
    if (triple.size() != 3) {
      throw py::value_error("copy " + std::to_string(i) + " has " +
                            std::to_string(triple.size()) + " items, expected 3");
    }
    ops.push_back(make_op(to_int64(triple[0], i), to_int64(triple[1], i),
                          to_int64(triple[2], i), i));
  }
  return ops;
}

// Waits in slices so that Ctrl-C (or any signal handler) still runs during a long wait.
bool wait_ticket(Ticket& ticket, std::optional<double> timeout_s) {
  if (timeout_s && !(*timeout_s >= 0 && std::isfinite(*timeout_s))) {
    throw py::value_error("timeout_s must be a finite number >= 0, or None to wait forever");
  }
  constexpr double kSlice = 0.1;  // seconds between signal checks
  double left = timeout_s.value_or(0);
  for (;;) {
    double step = timeout_s ? std::min(left, kSlice) : kSlice;
    bool done;
    {
      py::gil_scoped_release release;
      done = ticket.wait(step);
    }
    if (done) return true;
    if (timeout_s) {
      left -= step;
      if (left <= 0) return false;
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

py::object enter(py::object self) { return self; }

}  // namespace

void bind_transport(py::module_& m) {
  py::class_<Region, std::shared_ptr<Region>>(m, "Region", py::buffer_protocol(),
                                              "Local memory registered with a transport.")
      .def_property_readonly("transport", &Region::transport)
      .def_property_readonly("device", &Region::device)
      .def_property_readonly("ptr", [](const Region& r) { return r.address(); })
      .def_property_readonly("size", &Region::size)
      .def_property_readonly("closed", &Region::closed)
      .def_property_readonly("exportable", &Region::exportable)
      .def("descriptor", [](const Region& r) { return py::bytes(r.descriptor()); },
           "Opaque bytes a peer passes to Transport.open().")
      .def("close", &Region::close, "Release the memory or registration. Idempotent.")
      .def("__enter__", &enter)
      .def("__exit__", [](Region& r, const py::args&) { r.close(); })
      .def("__repr__",
           [](const Region& r) {
             return "<Region " + r.transport() + " " + r.device() + " " +
                    std::to_string(r.size()) + " bytes" + (r.closed() ? " closed>" : ">");
           })
      .def_buffer([](Region& r) {
        if (r.closed()) throw py::buffer_error("region is closed");
        if (r.device() != "cpu") {
          throw py::buffer_error("a " + r.device() +
                                 " region has no CPU buffer; use the tensor it was registered "
                                 "from");
        }
        return py::buffer_info(reinterpret_cast<void*>(r.address()), 1, "B", 1,
                               {static_cast<py::ssize_t>(r.size())}, {py::ssize_t{1}}, false);
      });

  py::class_<RemoteRegion, std::shared_ptr<RemoteRegion>>(m, "RemoteRegion",
                                                          "A peer's region opened here.")
      .def_property_readonly("transport", &RemoteRegion::transport)
      .def_property_readonly("device", &RemoteRegion::device)
      .def_property_readonly("size", &RemoteRegion::size)
      .def_property_readonly("closed", &RemoteRegion::closed)
      .def("close", &RemoteRegion::close, "Unmap the peer's memory. Idempotent.")
      .def("__enter__", &enter)
      .def("__exit__", [](RemoteRegion& r, const py::args&) { r.close(); })
      .def("__repr__", [](const RemoteRegion& r) {
        return "<RemoteRegion " + r.transport() + " " + r.device() + " " +
               std::to_string(r.size()) + " bytes" + (r.closed() ? " closed>" : ">");
      });

  py::class_<Ticket, std::shared_ptr<Ticket>>(m, "Ticket", "One submitted batch of copies.")
      .def_property_readonly("nbytes", &Ticket::nbytes)
      .def_property_readonly("num_copies", &Ticket::num_copies)
      .def("poll", [](Ticket& t) {
             py::gil_scoped_release release;
             return t.poll();
           },
           "True once every copy finished; RuntimeError if the batch failed.")
      .def("wait", &wait_ticket, py::arg("timeout_s") = py::none(),
           "Block up to timeout_s seconds (None: no limit); True when done.")
      .def("__repr__", [](const Ticket& t) {
        return "<Ticket " + std::to_string(t.nbytes()) + " bytes in " +
               std::to_string(t.num_copies()) + " copies>";
      });

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport",
                                                    "Base of the copy transports.")
      .def_property_readonly("name", &Transport::name)
      .def_property_readonly("closed", &Transport::closed)
      .def("create_region", &Transport::create_region, py::arg("size"),
           py::call_guard<py::gil_scoped_release>())
      .def("register", &Transport::register_region, py::arg("ptr"), py::arg("size"),
           py::arg("device"))
      .def("open", [](Transport& t, const py::bytes& descriptor) {
             std::string bytes(descriptor);
             py::gil_scoped_release release;  // mapping prefaults the whole region
             return t.open(bytes);
           },
           py::arg("descriptor"))
      .def("submit",
           [](Transport& t, const std::shared_ptr<Region>& src,
              const std::shared_ptr<RemoteRegion>& dst, const py::object& copies,
              std::optional<std::uintptr_t> wait_stream) {
             if (!src || !dst) throw py::type_error("src and dst must be regions, not None");
             std::vector<CopyOp> ops = to_ops(copies);
             py::gil_scoped_release release;
             return t.submit(src, dst, ops, wait_stream);
           },
           py::arg("src"), py::arg("dst"), py::arg("copies"), py::arg("wait_stream") = py::none())
      .def("close", &Transport::close, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", &enter)
      .def("__exit__", [](Transport& t, const py::args&) {
        py::gil_scoped_release release;
        t.close();
      });

  py::class_<HostTransport, Transport, std::shared_ptr<HostTransport>>(
      m, "HostTransport", "Copies between shared-memory regions of processes on one machine.")
      .def(py::init<std::size_t>(), py::arg("num_threads") = 0)
      .def_property_readonly("num_threads", &HostTransport::num_threads);

  py::class_<CudaIpcTransport, Transport, std::shared_ptr<CudaIpcTransport>>(
      m, "CudaIpcTransport", "Copies GPU memory into a peer process's GPU memory (CUDA IPC).")
      .def(py::init([](const std::string& device, bool copy_kernel) {
             py::gil_scoped_release release;  // cuInit can take a second
             return std::make_shared<CudaIpcTransport>(device, copy_kernel);
           }),
           py::arg("device"), py::kw_only(), py::arg("copy_kernel") = true)
      .def_property_readonly("device", &CudaIpcTransport::device);
}

}  // namespace lmd

// The single PYBIND11_MODULE of lmd._native. Each transport or helper lives in its
// own file; this one only binds them.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cuda_driver.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "lmd native helpers: the KV transfer engine (host and cuda_ipc transports) and a "
      "CUDA probe";
  m.attr("ABI_VERSION") = 1;

  m.def(
      "probe_cuda",
      [] {
        lmd::CudaProbe probe;
        {
          py::gil_scoped_release release;  // cuInit can take a second on a GPU host
          probe = lmd::probe_cuda();
        }
        py::dict out;
        out["available"] = probe.available;
        out["devices"] = probe.devices;
        out["reason"] = probe.reason;
        return out;
      },
      "Load the CUDA driver at run time and count devices.\n\n"
      "Returns {'available': bool, 'devices': int, 'reason': str}; never raises.");

  lmd::bind_transport(m);
}

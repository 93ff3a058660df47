// Binding entry points, one per noun, called by the single PYBIND11_MODULE in module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace lmd {

// Region, RemoteRegion, Ticket, Transport, HostTransport, CudaIpcTransport.
void bind_transport(pybind11::module_& m);

}  // namespace lmd

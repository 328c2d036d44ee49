// epcomm._backend: the EpcommBackend class for Python, built against the installed torch. Python creates the
// inner backends (gloo, NCCL) with torch's own constructors and hands them in, so this module needs neither
// gloo's nor NCCL's headers.
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include "backend.h"

namespace py = pybind11;
using epcomm_torch::EpcommBackend;

PYBIND11_MODULE(_backend, m) {
  m.doc() = "epcomm's torch.distributed backend (c10d::Backend)";
  m.attr("torch_version") = EPCOMM_TORCH_VERSION;  // the torch it was compiled against
  // c10d::Backend is registered by torch; importing it makes it known as our base class.
  py::module_::import("torch.distributed");
  py::class_<EpcommBackend, c10d::Backend, c10::intrusive_ptr<EpcommBackend>>(m, "EpcommBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const c10::intrusive_ptr<c10d::Backend>& cpu_inner,
                       const std::optional<c10::intrusive_ptr<c10d::Backend>>& cuda_inner) {
             return c10::make_intrusive<EpcommBackend>(store, rank, size, cpu_inner,
                                                       cuda_inner.value_or(c10::intrusive_ptr<c10d::Backend>()));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("cpu_inner"), py::arg("cuda_inner") = py::none())
      .def("all_to_all_v", &EpcommBackend::allToAllV, py::arg("output"), py::arg("input"), py::arg("send_counts"),
           py::arg("recv_counts"), py::arg("async_op") = false, py::call_guard<py::gil_scoped_release>())
      .def("comm_handle", &EpcommBackend::commHandle, py::arg("device"), py::call_guard<py::gil_scoped_release>())
      .def("set_active_ranks", &EpcommBackend::setActiveRanks, py::arg("active"),
           py::call_guard<py::gil_scoped_release>())
      .def("recover", &EpcommBackend::recover, py::call_guard<py::gil_scoped_release>())
      .def("active_ranks", &EpcommBackend::activeRanks, py::call_guard<py::gil_scoped_release>())
      .def("masked_drops", &EpcommBackend::maskedDrops, py::arg("device"), py::call_guard<py::gil_scoped_release>());
}

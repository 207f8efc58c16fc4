// Python bindings of the CPU kernels (cpu_ops.cpp); built by cpu_ext.py.
#include <torch/extension.h>

#include <string>
#include <vector>

void rms_norm(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps, const std::string& isa);
void rope(const at::Tensor& src, at::Tensor& dst, const at::Tensor& cos, const at::Tensor& sin, const std::string& isa);
void swiglu(const at::Tensor& gate_up, at::Tensor& out, const std::string& isa);
std::vector<std::string> isa_names(bool supported_only);
void set_default_isa(const std::string& name);
std::string active_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight (fp32 math)", py::arg("x"), py::arg("out"), py::arg("weight"),
        py::arg("eps"), py::arg("isa") = "auto");
  m.def("rope", &rope, "dst[h, t] = rotate-half RoPE of src[t, h]", py::arg("src"), py::arg("dst"), py::arg("cos"),
        py::arg("sin"), py::arg("isa") = "auto");
  m.def("swiglu", &swiglu, "out = silu(gate) * up", py::arg("gate_up"), py::arg("out"), py::arg("isa") = "auto");
  m.def("supported_isas", [] { return isa_names(true); }, "ISAs this CPU can run, best first");
  m.def("compiled_isas", [] { return isa_names(false); }, "ISAs compiled into this build");
  m.def("set_default_isa", &set_default_isa, "what isa='auto' runs on: 'auto' (the CPU's best), 'avx512' or 'avx2'",
        py::arg("name"));
  m.def("active_isa", &active_isa, "the ISA path an op with isa='auto' runs on now");
}

// Python bindings of the CPU kernels (cpu_ops.cpp); built by cpu_ext.py.
#include <torch/extension.h>

void rms_norm(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps);
void rope(const at::Tensor& src, at::Tensor& dst, const at::Tensor& cos, const at::Tensor& sin);
void swiglu(const at::Tensor& gate_up, at::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight (fp32 math)");
  m.def("rope", &rope, "dst[h, t] = rotate-half RoPE of src[t, h]");
  m.def("swiglu", &swiglu, "out = silu(gate) * up");
}

// Fused per-token ops of the hybrid-prefill layer loop for CPU, float32 or bfloat16.
//
// Why: in torch each of these is several elementwise passes (RMSNorm: copy to fp32, norm, two
// multiplies; RoPE: four strided multiply/addcmul passes over a transposed view), and on CPU in
// bf16 those passes cost about as much as the layer's matmuls (torch profiler, 5.6K-token
// prompt: ~50% of the forward). Here each op is one pass over its rows, math in fp32, rounded
// once to the output dtype, parallel over rows.
//
// ISA safety: this file is compiled for the baseline x86-64 ISA (no -m flags). The op bodies
// (cpu_ops_body.h, our own vector primitives only: no ATen Vectorized, whose width is fixed at
// compile time) are compiled once per instruction set inside a `#pragma GCC target` region and
// namespace (AVX2+FMA; AVX-512F/BW/DQ/VL) and picked at run time from the CPU's flags
// (__builtin_cpu_supports), so one build runs on any x86-64 host and never executes an instruction
// the host lacks. Nothing inside a region includes a header or instantiates a library template:
// the tensor checks and the parallel loop over rows (at::parallel_for) stay out here and call the
// region's plain functions on raw pointers per row range. A CPU with neither ISA: every op raises
// (supported_isas() is empty and cpu_ext.load() returns None, so the ops fall back to torch).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_isa.h"

namespace pfo {

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "cpu_vec_avx2.h"
#include "cpu_ops_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
#include "cpu_vec_avx512.h"
#include "cpu_ops_body.h"
}  // namespace avx512
#pragma GCC pop_options

// -- dispatch ------------------------------------------------------------------------------

struct OpsIsa {
  const char* name;
  const char* flags;  // what the CPU needs, for the error message
  bool (*supported)();
  decltype(&avx2::rms_norm_rows) rms_norm_rows;
  decltype(&avx2::rope_rows) rope_rows;
  decltype(&avx2::swiglu_rows) swiglu_rows;
};

// Fastest first: "auto" takes the first the CPU supports.
const OpsIsa kIsas[] = {
    {"avx512", "avx512f, avx512bw, avx512dq, avx512vl, avx2 and fma", has_avx512, avx512::rms_norm_rows, avx512::rope_rows,
     avx512::swiglu_rows},
    {"avx2", "avx2 and fma", has_avx2, avx2::rms_norm_rows, avx2::rope_rows, avx2::swiglu_rows},
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

// What "auto" means (set_default_isa; cpu_ext.load() sets it from PREFILLONLY_CPU_OPS_ISA):
// kAuto the CPU's best, 0..kNumIsas-1 that entry, kUnknown a name that is none of them.
constexpr int kAuto = -1, kUnknown = -2;
std::atomic<int> g_default{kAuto};
std::mutex g_unknown_mutex;
std::string g_unknown_name;  // the unknown default, for its error message

int find_isa(const std::string& name) {
  for (int i = 0; i < kNumIsas; ++i)
    if (name == kIsas[i].name) return i;
  return kUnknown;
}

[[noreturn]] void unknown_isa(const std::string& name) {
  TORCH_CHECK(false, "cpu ops: unknown ISA '", name, "' (auto, avx512, avx2)");
  __builtin_unreachable();
}

const OpsIsa& checked(const OpsIsa& e) {
  TORCH_CHECK(e.supported(), "cpu ops: this CPU lacks the ", e.name, " instructions (it needs ", e.flags, ")");
  return e;
}

const OpsIsa& pick_isa(const std::string& name) {
  if (name != "auto") {
    const int i = find_isa(name);
    if (i == kUnknown) unknown_isa(name);
    return checked(kIsas[i]);
  }
  const int d = g_default.load(std::memory_order_relaxed);
  if (d >= 0) return checked(kIsas[d]);
  if (d == kUnknown) {
    std::string unknown;
    {
      std::lock_guard<std::mutex> hold(g_unknown_mutex);
      unknown = g_unknown_name;
    }
    unknown_isa(unknown);
  }
  for (const auto& e : kIsas)
    if (e.supported()) return e;
  TORCH_CHECK(false, "cpu ops: the CPU has neither AVX2+FMA nor AVX-512");
  __builtin_unreachable();
}

}  // namespace pfo

// x, out: [..., n] with unit stride in the last dim and one row stride (out may be x).
void rms_norm(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps, const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && weight.scalar_type() == at::kFloat, "rms_norm: dtypes");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.sizes() == out.sizes() && x.stride(1) == 1 && out.stride(1) == 1 &&
                  weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: shapes/strides");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm_impl: float32 or bfloat16 only, got ",
              x.scalar_type());
  const auto& e = pfo::pick_isa(isa);
  if (x.numel() == 0) return;
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const int64_t xs = x.stride(-2), os = out.stride(-2);
  const void* xp = x.data_ptr();
  void* op = out.data_ptr();
  const float* wp = weight.data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) { e.rms_norm_rows(xp, xs, op, os, wp, n, r0, r1, feps, bf16); });
}

// src: [tokens, heads, D] (unit stride in D); dst: [heads, tokens, D] (unit stride in D).
void rope(const at::Tensor& src, at::Tensor& dst, const at::Tensor& cos, const at::Tensor& sin, const std::string& isa) {
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: dtypes");
  TORCH_CHECK(src.dim() == 3 && dst.dim() == 3 && src.size(0) == dst.size(1) && src.size(1) == dst.size(0) &&
                  src.size(2) == dst.size(2) && src.size(2) % 2 == 0 && src.stride(2) == 1 && dst.stride(2) == 1 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == src.size(0) &&
                  cos.size(1) * 2 == src.size(2) && sin.sizes() == cos.sizes(), "rope: shapes/strides");
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16, "rope_impl: float32 or bfloat16 only, got ",
              src.scalar_type());
  const auto& e = pfo::pick_isa(isa);
  const int64_t tokens = src.size(0), heads = src.size(1), d = src.size(2);
  const int64_t s_tok = src.stride(0), s_head = src.stride(1);
  const int64_t d_head = dst.stride(0), d_tok = dst.stride(1);
  const void* sp = src.data_ptr();
  void* dp = dst.data_ptr();
  const float* cp = cos.data_ptr<float>();
  const float* np = sin.data_ptr<float>();
  const bool bf16 = src.scalar_type() == at::kBFloat16;
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    e.rope_rows(sp, s_tok, s_head, dp, d_head, d_tok, cp, np, heads, d, t0, t1, bf16);
  });
}

// gate_up: [rows, 2F], out: [rows, F], unit stride in the last dim.
void swiglu(const at::Tensor& gate_up, at::Tensor& out, const std::string& isa) {
  TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "swiglu: dtypes");
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.stride(1) == 1 && out.stride(1) == 1, "swiglu: shapes/strides");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "swiglu_impl: float32 or bfloat16 only, got ", gate_up.scalar_type());
  const auto& e = pfo::pick_isa(isa);
  const int64_t rows = gate_up.size(0), f = out.size(1);
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  const void* gp = gate_up.data_ptr();
  void* op = out.data_ptr();
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { e.swiglu_rows(gp, gs, op, os, f, r0, r1, bf16); });
}

std::vector<std::string> isa_names(bool supported_only) {
  std::vector<std::string> names;
  for (const auto& e : pfo::kIsas)
    if (!supported_only || e.supported()) names.emplace_back(e.name);
  return names;
}

// What an op's isa="auto" runs on: `name` ("auto": the CPU's best; else that path, an error at
// the op where the CPU lacks it or the name is unknown).
void set_default_isa(const std::string& name) {
  const int i = name == "auto" ? pfo::kAuto : pfo::find_isa(name);
  if (i == pfo::kUnknown) {
    std::lock_guard<std::mutex> hold(pfo::g_unknown_mutex);
    pfo::g_unknown_name = name;
  }
  pfo::g_default.store(i);
}

// The path an op with isa="auto" runs on now (raises as that op would).
std::string active_isa() { return pfo::pick_isa("auto").name; }

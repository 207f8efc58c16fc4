// Fused per-token ops of the hybrid-prefill layer loop for CPU, float32 or bfloat16.
//
// Why: in torch each of these is several elementwise passes (RMSNorm: copy to fp32, norm, two
// multiplies; RoPE: four strided multiply/addcmul passes over a transposed view), and on CPU in
// bf16 those passes cost about as much as the layer's matmuls (torch profiler, 5.6K-token
// prompt: ~50% of the forward). Here each op is one pass over its rows, math in fp32, rounded
// once to the output dtype, parallel over rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// n floats of a row, widened to fp32 (a no-op copy for float rows).
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert<T, float>(src, dst, n);
  }
}

template <typename T>
inline void narrow(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert<float, T>(src, dst, n);
  }
}

inline float sum_of_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of n elements at the given row strides.
template <typename T>
void rms_norm_impl(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const int64_t xs = x.stride(-2), os = out.stride(-2);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(n);
    for (int64_t r = r0; r < r1; ++r) {
      widen(xp + r * xs, row.data(), n);
      const float inv = 1.f / std::sqrt(sum_of_squares(row.data(), n) / n + static_cast<float>(eps));
      at::vec::map2<float>([inv](Vec a, Vec w) { return a * Vec(inv) * w; }, row.data(), row.data(), wp, n);
      narrow(row.data(), op + r * os, n);
    }
  });
}

// dst[h, t, :] = rope(src[t, h, :]) with rotate-half pairs (i, i + D/2); cos/sin: [tokens, D/2] fp32.
template <typename T>
void rope_impl(const at::Tensor& src, at::Tensor& dst, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = src.size(0), heads = src.size(1), d = src.size(2), half = d / 2;
  const int64_t s_tok = src.stride(0), s_head = src.stride(1);
  const int64_t d_head = dst.stride(0), d_tok = dst.stride(1);
  const T* sp = src.data_ptr<T>();
  T* dp = dst.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* np = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> x(d), y(d);
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + t * half;
      const float* s = np + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        widen(sp + t * s_tok + h * s_head, x.data(), d);
        int64_t i = 0;
        for (; i + kW <= half; i += kW) {
          const Vec x1 = Vec::loadu(x.data() + i), x2 = Vec::loadu(x.data() + half + i);
          const Vec vc = Vec::loadu(c + i), vs = Vec::loadu(s + i);
          (x1 * vc - x2 * vs).store(y.data() + i);
          (x2 * vc + x1 * vs).store(y.data() + half + i);
        }
        for (; i < half; ++i) {
          y[i] = x[i] * c[i] - x[half + i] * s[i];
          y[half + i] = x[half + i] * c[i] + x[i] * s[i];
        }
        narrow(y.data(), dp + h * d_head + t * d_tok, d);
      }
    }
  });
}

// bf16 outputs keep 8 bits: the fast exponential is exact enough there; fp32 gets the precise one.
template <typename T>
inline Vec exp_for(Vec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp();
  } else {
    return x.exp_u20();
  }
}

// out[r, :] = silu(gate_up[r, :F]) * gate_up[r, F:].
template <typename T>
void swiglu_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), f = out.size(1);
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> g(f), u(f);
    for (int64_t r = r0; r < r1; ++r) {
      widen(gp + r * gs, g.data(), f);
      widen(gp + r * gs + f, u.data(), f);
      at::vec::map2<float>([](Vec a, Vec b) { return a / (Vec(1.f) + exp_for<T>(a.neg())) * b; }, g.data(), g.data(),
                           u.data(), f);
      narrow(g.data(), op + r * os, f);
    }
  });
}

#define DISPATCH_FLOAT_BF16(dtype, NAME, ...)                                             \
  do {                                                                                     \
    if ((dtype) == at::kFloat) {                                                          \
      NAME<float>(__VA_ARGS__);                                                            \
    } else if ((dtype) == at::kBFloat16) {                                                \
      NAME<at::BFloat16>(__VA_ARGS__);                                                     \
    } else {                                                                               \
      TORCH_CHECK(false, #NAME ": float32 or bfloat16 only, got ", (dtype));               \
    }                                                                                      \
  } while (0)

}  // namespace

// x, out: [..., n] with unit stride in the last dim and one row stride (out may be x).
void rms_norm(const at::Tensor& x, at::Tensor& out, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && weight.scalar_type() == at::kFloat, "rms_norm: dtypes");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.sizes() == out.sizes() && x.stride(1) == 1 && out.stride(1) == 1 &&
                  weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: shapes/strides");
  DISPATCH_FLOAT_BF16(x.scalar_type(), rms_norm_impl, x, out, weight, eps);
}

// src: [tokens, heads, D] (unit stride in D); dst: [heads, tokens, D] (unit stride in D).
void rope(const at::Tensor& src, at::Tensor& dst, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope: dtypes");
  TORCH_CHECK(src.dim() == 3 && dst.dim() == 3 && src.size(0) == dst.size(1) && src.size(1) == dst.size(0) &&
                  src.size(2) == dst.size(2) && src.size(2) % 2 == 0 && src.stride(2) == 1 && dst.stride(2) == 1 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == src.size(0) &&
                  cos.size(1) * 2 == src.size(2) && sin.sizes() == cos.sizes(), "rope: shapes/strides");
  DISPATCH_FLOAT_BF16(src.scalar_type(), rope_impl, src, dst, cos, sin);
}

// gate_up: [rows, 2F], out: [rows, F], unit stride in the last dim.
void swiglu(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "swiglu: dtypes");
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.stride(1) == 1 && out.stride(1) == 1, "swiglu: shapes/strides");
  DISPATCH_FLOAT_BF16(gate_up.scalar_type(), swiglu_impl, gate_up, out);
}

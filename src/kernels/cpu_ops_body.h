// The per-token ops of cpu_ops.cpp (RMSNorm, RoPE, SwiGLU) on rows of float32 or bfloat16,
// math in float32, rounded once to the row's dtype.
//
// Included once per instruction set, inside that ISA's `#pragma GCC target` region and its own
// namespace, after struct V (cpu_vec_avx2.h / cpu_vec_avx512.h). Nothing here includes a header or
// instantiates a library template (only V's intrinsics and our own inline code), so every function
// compiled from this file carries exactly its region's ISA and no other code can pick it up by
// accident. The entry points at the bottom take raw pointers, strides (in elements) and a row range;
// the parallel loop over row ranges and the tensor checks stay in the baseline-compiled dispatcher.
//
// Rows of any length: whole vectors, then one masked vector for the tail. bf16 is widened on load
// and rounded to nearest even on store (NaN stays NaN), as torch converts.

using vf = V::vf;
constexpr int64_t W = V::W;

inline vf ld(const float* p) { return V::load(p); }
inline vf ld(const uint16_t* p) { return V::load_bf16(p); }
inline vf ld_n(const float* p, int64_t n) { return V::load_n(p, static_cast<int>(n)); }  // 0 < n < W, other lanes 0
inline vf ld_n(const uint16_t* p, int64_t n) { return V::load_bf16_n(p, static_cast<int>(n)); }
inline void st(float* p, vf x) { V::store(p, x); }
inline void st(uint16_t* p, vf x) { V::store_bf16(p, x); }
inline void st_n(float* p, vf x, int64_t n) { V::store_n(p, x, static_cast<int>(n)); }
inline void st_n(uint16_t* p, vf x, int64_t n) { V::store_bf16_n(p, x, static_cast<int>(n)); }

// -- RMSNorm: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w ----------------------------------------

template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  vf a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const vf v0 = ld(x + i), v1 = ld(x + i + W), v2 = ld(x + i + 2 * W), v3 = ld(x + i + 3 * W);
    a0 = V::fmadd(v0, v0, a0);
    a1 = V::fmadd(v1, v1, a1);
    a2 = V::fmadd(v2, v2, a2);
    a3 = V::fmadd(v3, v3, a3);
  }
  for (; i + W <= n; i += W) {
    const vf v = ld(x + i);
    a0 = V::fmadd(v, v, a0);
  }
  if (i < n) {
    const vf v = ld_n(x + i, n - i);
    a1 = V::fmadd(v, v, a1);
  }
  return V::reduce_add(V::add(V::add(a0, a1), V::add(a2, a3)));
}

template <typename T>
inline void rms_norm_rows_of(const T* x, int64_t xs, T* out, int64_t os, const float* w, int64_t n, int64_t r0, int64_t r1,
                             float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * xs;
    T* o = out + r * os;  // may be xr itself: each element is read before it is written
    const vf inv = V::set1(1.f / __builtin_sqrtf(sum_of_squares(xr, n) / static_cast<float>(n) + eps));
    int64_t i = 0;
    for (; i + W <= n; i += W) st(o + i, V::mul(V::mul(ld(xr + i), inv), V::load(w + i)));
    if (i < n) st_n(o + i, V::mul(V::mul(ld_n(xr + i, n - i), inv), V::load_n(w + i, static_cast<int>(n - i))), n - i);
  }
}

// -- RoPE: dst[h, t, :] = rotate-half RoPE of src[t, h, :], pairs (i, i + D/2) ---------------------

inline void rotate(vf x1, vf x2, vf c, vf s, vf* y1, vf* y2) {
  *y1 = V::sub(V::mul(x1, c), V::mul(x2, s));
  *y2 = V::add(V::mul(x2, c), V::mul(x1, s));
}

template <typename T>
inline void rope_rows_of(const T* src, int64_t s_tok, int64_t s_head, T* dst, int64_t d_head, int64_t d_tok, const float* cos,
                         const float* sin, int64_t heads, int64_t d, int64_t t0, int64_t t1) {
  const int64_t half = d / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = src + t * s_tok + h * s_head;
      T* y = dst + h * d_head + t * d_tok;
      int64_t i = 0;
      vf y1, y2;
      for (; i + W <= half; i += W) {
        rotate(ld(x + i), ld(x + half + i), V::load(c + i), V::load(s + i), &y1, &y2);
        st(y + i, y1);
        st(y + half + i, y2);
      }
      if (i < half) {
        const int64_t k = half - i;
        rotate(ld_n(x + i, k), ld_n(x + half + i, k), ld_n(c + i, k), ld_n(s + i, k), &y1, &y2);
        st_n(y + i, y1, k);
        st_n(y + half + i, y2, k);
      }
    }
  }
}

// -- SwiGLU: out[r, :] = silu(gate_up[r, :F]) * gate_up[r, F:] --------------------------------------

// e^-a for a in [-88, 87] (the caller clamps): m = round(-a log2(e)), q = a + m ln2 with ln2 in two
// parts (Cody-Waite: q is exact, |q| <= ln2 / 2), e^-q by a polynomial P(-q) (Chebyshev fit of e^r
// on |r| <= ln2 / 2, relative error with float32 rounding < 1e-7 at degree 6, < 4e-6 at degree 4;
// the odd coefficients negated), times 2^m (a normal float over that whole range). Degree 4 is for
// bf16 outputs, whose rounding (2^-9) it stays far below.
template <int Degree>
inline vf exp_neg_clamped(vf a) {
  const vf m = V::round(V::mul(a, V::set1(-1.44269504088896341f)));
  vf q = V::fmadd(m, V::set1(0.693359375f), a);
  q = V::fmadd(m, V::set1(-2.12194440e-4f), q);
  vf p;
  if constexpr (Degree == 6) {
    p = V::set1(0.0013941108481958508f);
    p = V::fmadd(p, q, V::set1(-0.00837512593716383f));
    p = V::fmadd(p, q, V::set1(0.04166635125875473f));
    p = V::fmadd(p, q, V::set1(-0.16666415333747864f));
    p = V::fmadd(p, q, V::set1(0.5f));
    p = V::fmadd(p, q, V::set1(-1.0f));
    p = V::fmadd(p, q, V::set1(1.0f));
  } else {
    static_assert(Degree == 4, "degree 4 or 6");
    p = V::set1(0.04187564551830292f);
    p = V::fmadd(p, q, V::set1(-0.16792142391204834f));
    p = V::fmadd(p, q, V::set1(0.4999937117099762f));
    p = V::fmadd(p, q, V::set1(-0.9999622702598572f));
    p = V::fmadd(p, q, V::set1(1.0f));
  }
  return V::scale_by_pow2(p, m);
}

// silu(a) = a * sigmoid(a), sigmoid = 1 / (1 + e^-a) with a clamped to [-88, 87] for the
// exponential (so e^-a is finite) and sigmoid taken as 0 below a = -87 (where a * sigmoid(a) >
// -1.5e-36): silu(+huge) = a, silu(-huge) = -0, silu(0) = 0; NaN stays NaN.
template <int Degree>
inline vf silu(vf a) {
  const vf lo = V::set1(-87.0f);
  const vf clamped = V::max(V::min(a, V::set1(87.0f)), V::set1(-88.0f));
  const vf sig = V::recip(V::add(V::set1(1.0f), exp_neg_clamped<Degree>(clamped)));
  return V::mul(a, V::mask_and(sig, V::ge_mask(a, lo)));
}

inline vf silu_for(const float*, vf a) { return silu<6>(a); }
inline vf silu_for(const uint16_t*, vf a) { return silu<4>(a); }

inline void swiglu_pairs(const float*, const float*, float*, int64_t, int64_t* i) { (void)i; }
// bf16 rows: 2W elements at a time through load_bf16_2 / store_bf16_2 (fewer conversions)
inline void swiglu_pairs(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t f, int64_t* i) {
  for (; *i + 2 * W <= f; *i += 2 * W) {
    vf g0, g1, u0, u1;
    V::load_bf16_2(g + *i, &g0, &g1);
    V::load_bf16_2(u + *i, &u0, &u1);
    V::store_bf16_2(o + *i, V::mul(silu<4>(g0), u0), V::mul(silu<4>(g1), u1));
  }
}

template <typename T>
inline void swiglu_rows_of(const T* gate_up, int64_t gs, T* out, int64_t os, int64_t f, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gate_up + r * gs;
    const T* u = g + f;
    T* o = out + r * os;
    int64_t i = 0;
    swiglu_pairs(g, u, o, f, &i);
    for (; i + W <= f; i += W) st(o + i, V::mul(silu_for(g, ld(g + i)), ld(u + i)));
    if (i < f) st_n(o + i, V::mul(silu_for(g, ld_n(g + i, f - i)), ld_n(u + i, f - i)), f - i);
  }
}

// -- entry points (called by cpu_ops.cpp's dispatcher per row range; strides in elements) ---------

void rms_norm_rows(const void* x, int64_t xs, void* out, int64_t os, const float* w, int64_t n, int64_t r0, int64_t r1,
                   float eps, bool bf16) {
  if (bf16) {
    rms_norm_rows_of(static_cast<const uint16_t*>(x), xs, static_cast<uint16_t*>(out), os, w, n, r0, r1, eps);
  } else {
    rms_norm_rows_of(static_cast<const float*>(x), xs, static_cast<float*>(out), os, w, n, r0, r1, eps);
  }
}

void rope_rows(const void* src, int64_t s_tok, int64_t s_head, void* dst, int64_t d_head, int64_t d_tok, const float* cos,
               const float* sin, int64_t heads, int64_t d, int64_t t0, int64_t t1, bool bf16) {
  if (bf16) {
    rope_rows_of(static_cast<const uint16_t*>(src), s_tok, s_head, static_cast<uint16_t*>(dst), d_head, d_tok, cos, sin, heads,
                 d, t0, t1);
  } else {
    rope_rows_of(static_cast<const float*>(src), s_tok, s_head, static_cast<float*>(dst), d_head, d_tok, cos, sin, heads, d, t0,
                 t1);
  }
}

void swiglu_rows(const void* gate_up, int64_t gs, void* out, int64_t os, int64_t f, int64_t r0, int64_t r1, bool bf16) {
  if (bf16) {
    swiglu_rows_of(static_cast<const uint16_t*>(gate_up), gs, static_cast<uint16_t*>(out), os, f, r0, r1);
  } else {
    swiglu_rows_of(static_cast<const float*>(gate_up), gs, static_cast<float*>(out), os, f, r0, r1);
  }
}

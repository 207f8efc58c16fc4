// The exponential and the online-softmax bookkeeping shared by both product paths of the CPU
// flash-attention kernel (cpu_attention_body.h: float32 FMAs; cpu_attention_pairs.h: bf16 pair
// dot products). Included inside an ISA region after its struct V; see cpu_attention.cpp.
//
// Layout: query rows of a task are the lanes of every vector, so the softmax state of W rows
// (running max m, sum l, in log2 units) is one vector and needs no horizontal reductions.

using vf = typename V::vf;
using vm = typename V::vm;
constexpr int W = V::W;
constexpr int MR = V::MR;  // broadcast rows of a register tile
constexpr int NV = V::NV;  // vectors of query rows of a register tile

// 2^x for x <= 0 (and -inf): x = n + f, n = round(x), f in [-1/2, 1/2]; 2^f by a degree-5
// polynomial (Chebyshev fit, max relative error 1.7e-7 before float rounding, < 3e-7 measured by
// tests/kernels/test_cpu_attention.py); 2^n added into the exponent bits. Below -125 it returns 0
// (true value < 2.4e-38), which is also how masked (-inf) scores become probability 0.
inline vf exp2_nonpositive(vf x) {
  const vf lo = V::set1(-125.0f);
  const auto keep = V::ge_mask(x, lo);
  x = V::max(x, lo);
  const vf n = V::round(x);
  const vf f = V::sub(x, n);
  vf p = V::set1(0.0013400432653725147f);
  p = V::fmadd(p, f, V::set1(0.009676037356257439f));
  p = V::fmadd(p, f, V::set1(0.05550327152013779f));
  p = V::fmadd(p, f, V::set1(0.2402210682630539f));
  p = V::fmadd(p, f, V::set1(0.6931471824645996f));
  p = V::fmadd(p, f, V::set1(1.0000001192092896f));
  return V::mask_and(V::scale_by_pow2(p, n), keep);
}

// Running max of rows [r, r + W) after a block of nk scores S^T[j][r] (raw, or capped): the
// larger of the old max and the block's, times c (Problem::scale_log2). -inf for a row that has
// seen no visible key yet (a sliding window's edge block can hide every key from later rows):
// neg_max then keeps its exponentials at 0 instead of NaN.
inline vf block_max(const float* st, int64_t nk, int64_t rp, int64_t r, vf c, vf m_old) {
  vf mx = V::set1(-INFINITY);
  for (int64_t j = 0; j < nk; ++j) mx = V::max(mx, V::load(st + j * rp + r));
  return V::max(m_old, V::mul(mx, c));
}

// -m, or 0 where m = -inf (a row with nothing visible yet: its masked scores stay -inf -> 0).
inline vf neg_max(vf m) {
  const vf neg = V::sub(V::zero(), m);
  return V::select(V::gt_mask(m, V::set1(-INFINITY)), V::zero(), neg);
}

// After a block: l = l * alpha + block sum, m = m_new, where alpha = 2^(m_old - m_new) where the
// max grew and exactly 1 where it did not. The output accumulator O^T [d][rp] is rescaled only
// when some row's max grew (rare after the first blocks): exact, since l and O carry the same
// factor and the output is O / l.
inline void update_rows(float* m, float* l, float* ot, int64_t d, int64_t rp, int64_t r, vf m_old, vf m_new, vf sum) {
  const vm grew = V::gt_mask(m_new, m_old);
  V::store(m + r, m_new);
  if (!V::any(grew)) {
    V::store(l + r, V::add(V::load(l + r), sum));
    return;
  }
  const vf alpha = V::select(grew, V::set1(1.0f), exp2_nonpositive(V::sub(m_old, m_new)));  // 0 where m_old = -inf
  V::store(l + r, V::fmadd(V::load(l + r), alpha, sum));
  for (int64_t x = 0; x < d; ++x) V::store(ot + x * rp + r, V::mul(V::load(ot + x * rp + r), alpha));
}

// Key j0 + j is visible to row r (query position t = first_pos + r / g) when j0 + j <= t
// (causal) and, with a window, t - (j0 + j) < window; the other scores become -inf.
inline void mask_hidden_keys(float* st, int64_t nk, int64_t rp, int64_t j0, int64_t first_pos, int64_t g, int64_t window) {
  const int64_t last_pos = first_pos + (rp - 1) / g;  // of the padded rows: masking padding is harmless
  const bool future = j0 + nk - 1 > first_pos, old = window > 0 && last_pos - j0 >= window;
  if (!future && !old) return;
  for (int64_t j = 0; j < nk; ++j) {
    float* row = st + j * rp;
    const int64_t key = j0 + j;
    if (future)  // rows [0, (key - first_pos) g) are before the key
      for (int64_t r = 0, end = imin(rp, (key - first_pos) * g); r < end; ++r) row[r] = -INFINITY;
    if (old)  // rows from (key + window - first_pos) g on are past its window
      for (int64_t r = (key + window - first_pos) * g < 0 ? 0 : (key + window - first_pos) * g; r < rp; ++r) row[r] = -INFINITY;
  }
}

// First key any row of a task starting at first_pos can see (0 without a window), rounded down
// to a multiple of `align` (the pair path's key pairs never straddle it).
inline int64_t first_visible_key(int64_t first_pos, int64_t window, int64_t align) {
  const int64_t first = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
  return first / align * align;
}

// tanh of each lane: (1 - e) / (1 + e) with e = 2^(-2 |x| log2 e) for |x| >= 1/8, the odd series
// x - x^3/3 + 2x^5/15 - 17x^7/315 below (where 1 - e would cancel); relative error < 1e-6.
inline vf tanh_lanes(vf x) {
  const vf zero = V::zero(), one = V::set1(1.0f);
  const vf ax = V::max(x, V::sub(zero, x));
  const vf e = exp2_nonpositive(V::mul(ax, V::set1(-2.8853900817779268f)));
  const vf big = V::mul(V::sub(one, e), V::recip(V::add(one, e)));
  const vf x2 = V::mul(ax, ax);
  vf series = V::set1(-17.0f / 315.0f);
  series = V::fmadd(series, x2, V::set1(2.0f / 15.0f));
  series = V::fmadd(series, x2, V::set1(-1.0f / 3.0f));
  series = V::fmadd(V::mul(series, x2), ax, ax);
  const vf t = V::select(V::ge_mask(ax, V::set1(0.125f)), series, big);
  return V::select(V::gt_mask(zero, x), t, V::sub(zero, t));
}

// Soft-capping of a block of scores (Gemma 2): s -> out * tanh(s * in), before any masking.
inline void soft_cap(float* st, int64_t nk, int64_t rp, float in, float out) {
  const vf vin = V::set1(in), vout = V::set1(out);
  for (int64_t x = 0; x < nk * rp; x += W) V::store(st + x, V::mul(tanh_lanes(V::mul(V::load(st + x), vin)), vout));
}

inline void reset_state(float* ot, float* m, float* l, int64_t d, int64_t rp) {
  for (int64_t x = 0; x < d * rp; ++x) ot[x] = 0.f;
  for (int64_t r = 0; r < rp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
}

// The exponential alone, for its accuracy test.
void exp2_array(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) V::store(y + i, exp2_nonpositive(V::load(x + i)));
  if (i < n) {
    float xin[W], yout[W];
    for (int k = 0; k < W; ++k) xin[k] = i + k < n ? x[i + k] : 0.f;
    V::store(yout, exp2_nonpositive(V::load(xin)));
    for (int64_t k = 0; i + k < n; ++k) y[i + k] = yout[k];
  }
}

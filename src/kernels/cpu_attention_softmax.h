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
// tests/test_cpu_attention.py); 2^n added into the exponent bits. Below -125 it returns 0
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

// Running max of rows [r, r + W) after a block of nk scores S^T[j][r] (raw, unscaled): the
// larger of the old max and the block's, times c = scale * log2(e). Finite: key 0 is visible
// to every row, so the first block always has a finite score.
inline vf block_max(const float* st, int64_t nk, int64_t rp, int64_t r, vf c, vf m_old) {
  vf mx = V::set1(-INFINITY);
  for (int64_t j = 0; j < nk; ++j) mx = V::max(mx, V::load(st + j * rp + r));
  return V::max(m_old, V::mul(mx, c));
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

// causal: key j0 + j is visible to row r when its query position first_pos + r / g >= j0 + j
inline void mask_future_keys(float* st, int64_t nk, int64_t rp, int64_t j0, int64_t first_pos, int64_t g) {
  if (j0 + nk - 1 <= first_pos) return;
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t hidden = imin(rp, (j0 + j - first_pos) * g);  // rows [0, hidden) cannot see key j
    float* row = st + j * rp;
    for (int64_t r = 0; r < hidden; ++r) row[r] = -INFINITY;
  }
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

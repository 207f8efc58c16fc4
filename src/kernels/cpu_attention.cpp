// Causal (bottom-right aligned) flash attention for bf16 on x86 CPUs, built for prefill-only:
// one call per layer over the whole sequence, grouped-query heads processed together.
//
// Why not torch's SDPA: its CPU flash kernel runs each query head on its own, so with GQA every
// key/value block is re-read and re-packed for each head of a group, and its per-block softmax is
// generic. Here one task owns (kv head, query block) and stacks the G query heads of that kv head
// into one M = G * rows matrix: each K/V block is packed once per call (not per head or per query
// block), and each AMX brgemm gets G times more rows.
//
// Math (per task): for every visible key block, S = Q K^T (bf16 x bf16 -> fp32, AMX brgemm via
// ATen's oneDNN wrapper), online softmax in fp32 (running max m, running sum l), O = O * alpha +
// P V with P rounded to bf16 (as every flash kernel does), finally O / l -> bf16.
//
// Mask: query i (0-based in q) sits at key position P + i, P = Lk - Lq, and sees keys 0..P + i.
// `out` may alias `q` (the engine's low-memory mode): a task copies its query rows into a private
// buffer before it writes the same rows of out, and no two tasks share rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// oneDNN's packer writes B in VNNI layout only with a leading dimension of 16/32/48/64, so packed
// operands are cut into column panels of kPanel and multiplied one panel per brgemm.
constexpr int64_t kPanel = 64;

// K^T and V of every kv head, cut into key blocks of `kb` keys (zero-padded at the end) and laid
// out the way brgemm wants its B operand: VNNI-packed panels when AMX is there (and d is a
// multiple of kPanel), plain row-major otherwise.
struct PackedKV {
  int64_t kb, nblocks, d;
  bool vnni;
  std::vector<BFloat16> kt;  // [hkv][nblocks][d x kb]: kb / kPanel panels of [d x kPanel], or plain
  std::vector<BFloat16> v;   // [hkv][nblocks][kb x d]: d / kPanel panels of [kb x kPanel], or plain

  const BFloat16* kt_block(int64_t h, int64_t j) const { return kt.data() + (h * nblocks + j) * d * kb; }
  const BFloat16* v_block(int64_t h, int64_t j) const { return v.data() + (h * nblocks + j) * kb * d; }

  // s[m x kb] = q[m x d] @ K^T of block (h, j)
  void qk(const BFloat16* q, int64_t m, int64_t h, int64_t j, float* s) const {
    if (!vnni) return cpublas::brgemm(m, kb, d, d, kb, kb, false, q, kt_block(h, j), s, false);
    for (int64_t c = 0; c < kb; c += kPanel)
      cpublas::brgemm(m, kPanel, d, d, kPanel, kb, false, q, kt_block(h, j) + c * d, s + c, true);
  }

  // o[m x d] += p[m x kb] @ V of block (h, j)
  void pv(const BFloat16* p, int64_t m, int64_t h, int64_t j, float* o) const {
    if (!vnni) return cpublas::brgemm(m, d, kb, kb, d, d, true, p, v_block(h, j), o, false);
    for (int64_t c = 0; c < d; c += kPanel)
      cpublas::brgemm(m, kPanel, kb, kb, kPanel, d, true, p, v_block(h, j) + c * kb, o + c, true);
  }
};

PackedKV pack_kv(const BFloat16* k, const BFloat16* v, int64_t hkv, int64_t lk, int64_t d, int64_t kb) {
  const bool vnni = cpublas::could_pack(at::kBFloat16) && d % kPanel == 0 && kb % kPanel == 0;
  PackedKV p{kb, (lk + kb - 1) / kb, d, vnni, {}, {}};
  p.kt.resize(hkv * p.nblocks * d * kb);
  p.v.resize(hkv * p.nblocks * kb * d);
  at::parallel_for(0, hkv * p.nblocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<BFloat16> panel(std::max(d, kb) * kPanel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / p.nblocks, j = t % p.nblocks;
      const int64_t j0 = j * kb, n = std::min(kb, lk - j0);
      const BFloat16* ks = k + (h * lk + j0) * d;
      const BFloat16* vs = v + (h * lk + j0) * d;
      BFloat16* kt_out = p.kt.data() + t * d * kb;
      BFloat16* v_out = p.v.data() + t * kb * d;
      if (!vnni) {  // plain K^T [d x kb] and V [kb x d], zero past the last key
        std::fill(kt_out, kt_out + d * kb, BFloat16(0.f));
        std::fill(v_out, v_out + kb * d, BFloat16(0.f));
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < d; ++c) kt_out[c * kb + r] = ks[r * d + c];
        std::memcpy(v_out, vs, n * d * sizeof(BFloat16));
        continue;
      }
      for (int64_t c0 = 0; c0 < kb; c0 += kPanel) {  // K^T panel: keys c0.. as columns
        std::fill(panel.begin(), panel.begin() + d * kPanel, BFloat16(0.f));
        for (int64_t r = c0; r < std::min(n, c0 + kPanel); ++r)
          for (int64_t c = 0; c < d; ++c) panel[c * kPanel + (r - c0)] = ks[r * d + c];
        cpublas::pack(d, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, panel.data(), kt_out + c0 * d);
      }
      for (int64_t c0 = 0; c0 < d; c0 += kPanel) {  // V panel: head dims c0.. as columns
        std::fill(panel.begin(), panel.begin() + kb * kPanel, BFloat16(0.f));
        for (int64_t r = 0; r < n; ++r) std::memcpy(&panel[r * kPanel], vs + r * d + c0, kPanel * sizeof(BFloat16));
        cpublas::pack(kb, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, panel.data(), v_out + c0 * kb);
      }
    }
  });
  return p;
}

// One task's working set, reused across the tasks a thread runs.
struct TaskBuffers {
  std::vector<BFloat16> q, p;  // [m, d], [m, kb]
  std::vector<float> s, o;     // [m, kb], [m, d]
  std::vector<float> row_max, row_sum;
  TaskBuffers(int64_t m, int64_t kb, int64_t d) : q(m * d), p(m * kb), s(m * kb), o(m * d), row_max(m), row_sum(m) {}
};

// Online-softmax step for one row of S over its first `valid` columns (the rest are masked):
// writes P (bf16, zeros past `valid`), rescales the row's O accumulator, updates max and sum.
// Two passes over the row (max; then exp, sum and the bf16 store fused), all in L1/L2.
inline void softmax_row(const float* s, BFloat16* p, float* o, float& row_max, float& row_sum, int64_t valid,
                        int64_t kb, int64_t d, float scale) {
  if (valid <= 0) {
    std::fill(p, p + kb, BFloat16(0.f));
    return;
  }
  constexpr int64_t w = Vec::size();
  Vec vmax_acc(kNegInf);
  int64_t c = 0;
  for (; c + w <= valid; c += w) vmax_acc = at::vec::maximum(vmax_acc, Vec::loadu(s + c));
  float block_max = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax_acc);
  for (; c < valid; ++c) block_max = std::max(block_max, s[c]);
  const float new_max = std::max(row_max, block_max * scale);

  const Vec vscale(scale), vneg_max(-new_max);
  Vec vsum(0.f);
  c = 0;
  for (; c + 2 * w <= valid; c += 2 * w) {
    const Vec e0 = at::vec::fmadd(Vec::loadu(s + c), vscale, vneg_max).exp_u20();
    const Vec e1 = at::vec::fmadd(Vec::loadu(s + c + w), vscale, vneg_max).exp_u20();
    vsum = vsum + e0 + e1;
    at::vec::convert_float_bfloat16(e0, e1).store(p + c);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; c < valid; ++c) {
    const float e = std::exp(s[c] * scale - new_max);
    sum += e;
    p[c] = BFloat16(e);
  }
  std::fill(p + valid, p + kb, BFloat16(0.f));

  const float alpha = row_max == kNegInf ? 0.f : std::exp(row_max - new_max);
  if (alpha != 1.f) {
    int64_t i = 0;
    for (; i + w <= d; i += w) (Vec::loadu(o + i) * Vec(alpha)).store(o + i);
    for (; i < d; ++i) o[i] *= alpha;
  }
  row_sum = row_sum * alpha + sum;
  row_max = new_max;
}

void run_task(const BFloat16* q, BFloat16* out, const PackedKV& kv, TaskBuffers& buf, int64_t h, int64_t group,
              int64_t lq, int64_t offset, int64_t i0, int64_t rows, float scale) {
  const int64_t d = kv.d, kb = kv.kb, m = group * rows;
  // Stack the group's query heads: row g * rows + r is head h * group + g, query i0 + r.
  for (int64_t g = 0; g < group; ++g)
    std::memcpy(buf.q.data() + g * rows * d, q + ((h * group + g) * lq + i0) * d, rows * d * sizeof(BFloat16));
  std::fill(buf.o.begin(), buf.o.begin() + m * d, 0.f);
  std::fill(buf.row_max.begin(), buf.row_max.begin() + m, kNegInf);
  std::fill(buf.row_sum.begin(), buf.row_sum.begin() + m, 0.f);
  const int64_t last_key = offset + i0 + rows - 1;  // the last key any row of this block sees
  for (int64_t j = 0; j * kb <= last_key; ++j) {
    const int64_t j0 = j * kb;
    kv.qk(buf.q.data(), m, h, j, buf.s.data());
    for (int64_t row = 0; row < m; ++row) {
      const int64_t pos = offset + i0 + row % rows;  // this query's key position
      const int64_t valid = std::min(kb, pos - j0 + 1);
      softmax_row(buf.s.data() + row * kb, buf.p.data() + row * kb, buf.o.data() + row * d, buf.row_max[row],
                  buf.row_sum[row], valid, kb, d, scale);
    }
    kv.pv(buf.p.data(), m, h, j, buf.o.data());
  }
  for (int64_t row = 0; row < m; ++row) {
    const int64_t g = row / rows, r = row % rows;
    const float inv = 1.f / buf.row_sum[row];
    const float* o = buf.o.data() + row * d;
    BFloat16* dst = out + ((h * group + g) * lq + i0 + r) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = BFloat16(o[i] * inv);
  }
}

}  // namespace

// q: [Hq, Lq, D], k/v: [Hkv, Lk, D], all bf16 contiguous; out: [Hq, Lq, D] bf16 (may be q).
void causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                           double scale, int64_t query_block, int64_t key_block) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "cpu attention: bf16 tensors only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
              "cpu attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == v.sizes() && out.sizes() == q.sizes(), "cpu attention: bad shapes");
  const int64_t hq = q.size(0), lq = q.size(1), d = q.size(2), hkv = k.size(0), lk = k.size(1);
  TORCH_CHECK(k.size(2) == d && hq % hkv == 0 && lk >= lq && d % 2 == 0 && key_block % 2 == 0 && query_block > 0,
              "cpu attention: bad shapes");
  const int64_t group = hq / hkv, offset = lk - lq;
  const PackedKV kv = pack_kv(k.data_ptr<BFloat16>(), v.data_ptr<BFloat16>(), hkv, lk, d, key_block);

  // Tasks in decreasing order of work (later query blocks see more keys), handed out from a
  // shared counter so that both halves of a causal triangle keep every thread busy.
  const int64_t qblocks = (lq + query_block - 1) / query_block, ntasks = hkv * qblocks;
  std::atomic<int64_t> next{0};
  const BFloat16* qp = q.data_ptr<BFloat16>();
  BFloat16* op = out.data_ptr<BFloat16>();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TaskBuffers buf(group * query_block, key_block, d);
    for (int64_t t; (t = next.fetch_add(1)) < ntasks;) {
      const int64_t qb = qblocks - 1 - t / hkv, h = t % hkv;
      const int64_t i0 = qb * query_block, rows = std::min(query_block, lq - i0);
      run_task(qp, op, kv, buf, h, group, lq, offset, i0, rows, static_cast<float>(scale));
    }
    if (kv.vnni) cpublas::brgemm_release(kv.vnni);
  });
}

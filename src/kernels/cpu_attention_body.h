// The float32-FMA product path of the CPU flash-attention kernel (cpu_attention.cpp): float32
// inputs, and bfloat16 inputs on CPUs without a bf16 dot product (each K/V block widened to
// float32 per task).
//
// Included once per instruction set, inside that ISA's `#pragma GCC target` region and its own
// namespace, after struct V, cpu_attention_softmax.h and cpu_attention_tile.h. Nothing here includes a header or
// instantiates a library template, so every function compiled from this file carries exactly its
// region's ISA and no other code can pick it up by accident.
//
// Layout (all float32, per thread, sized by the dispatcher):
//   qt [D][rp]   Q^T of the task's rows         st [BK][rp]  scores S^T, then probabilities P^T
//   ot [D][rp]   the output accumulator O^T     kf, vf [BK][D] one key block of K, V (bf16 input)
// Both products are `gemm_rows` (product_rows of cpu_attention_tile.h):
//   scores  S^T[j][r] = sum_d K[j][d] Q^T[d][r]   (A = K rows, k = d)
//   output  O^T[d][r] += sum_j V[j][d] P^T[j][r]  (A = V columns, k = j)

// float32 FMAs: A and B elements are floats.
struct FmaProduct {
  using A = float;
  using B = float;
  using Va = vf;
  using Vb = vf;
  static inline Vb load_b(const B* p) { return V::load(p); }
  static inline Va broadcast_a(const A* p) { return V::broadcast(p); }
  static inline vf madd(vf acc, Va a, Vb b) { return V::fmadd(a, b, acc); }
};

inline void gemm_rows(int64_t m, int64_t cols, float* c, int64_t ldc, const float* a, int64_t am, int64_t ak,
                      const float* b, int64_t ldb, int64_t kdim, bool accumulate) {
  product_rows<FmaProduct>(m, cols, c, ldc, a, am, ak, b, ldb, kdim, accumulate);
}

// bf16 rows -> float32 rows (n rows of d values, d a multiple of W).
inline void widen_rows(const uint16_t* src, int64_t src_stride, float* dst, int64_t n, int64_t d) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t x = 0; x < d; x += W) V::store(dst + j * d + x, V::load_bf16(src + j * src_stride + x));
}

// One task: the rows of query block [i0, i0 + nq) of every query head of KV head h.
void run_task(const Problem& p, int64_t h, int64_t i0, int64_t nq, const Scratch& s) {
  const int64_t d = p.d, g = p.group, bk = p.block_k;
  const int64_t rows = nq * g;
  const int64_t rp = (rows + NV * W - 1) / (NV * W) * (NV * W);
  pack_queries(p, h, i0, nq, rp, s.qt);
  reset_state(s.ot, s.m, s.l, d, rp);
  const vf c = V::set1(p.scale_log2);
  const int64_t first_pos = p.offset + i0;            // absolute position of the task's first query
  const int64_t kv_end = imin(p.lk, first_pos + nq);  // keys visible to its last query
  for (int64_t j0 = first_visible_key(first_pos, p.window, 1); j0 < kv_end; j0 += bk) {
    const int64_t nk = imin(bk, kv_end - j0);
    const float *kb, *vb;
    int64_t ks, vs;
    if (p.bf16) {
      widen_rows(static_cast<const uint16_t*>(p.k) + h * p.k_head_stride + j0 * p.k_row_stride, p.k_row_stride, s.kf, nk, d);
      widen_rows(static_cast<const uint16_t*>(p.v) + h * p.v_head_stride + j0 * p.v_row_stride, p.v_row_stride, s.vf, nk, d);
      kb = s.kf, vb = s.vf, ks = d, vs = d;
    } else {  // float32 K/V are read in place
      kb = static_cast<const float*>(p.k) + h * p.k_head_stride + j0 * p.k_row_stride;
      vb = static_cast<const float*>(p.v) + h * p.v_head_stride + j0 * p.v_row_stride;
      ks = p.k_row_stride, vs = p.v_row_stride;
    }
    // S^T[j][r] = K[j] . Q[r]
    gemm_rows(nk, rp, s.st, rp, kb, ks, 1, s.qt, rp, d, false);
    if (p.softcap_out > 0) soft_cap(s.st, nk, rp, p.softcap_in, p.softcap_out);
    mask_hidden_keys(s.st, nk, rp, j0, first_pos, g, p.window);
    // online softmax, W query rows at a time, in log2 units (scores * scale * log2 e)
    for (int64_t r = 0; r < rp; r += W) {
      const vf m_old = V::load(s.m + r);
      const vf m_new = block_max(s.st, nk, rp, r, c, m_old);
      const vf neg_m = neg_max(m_new);
      vf sum = V::zero();
      for (int64_t j = 0; j < nk; ++j) {
        const vf pj = exp2_nonpositive(V::fmadd(V::load(s.st + j * rp + r), c, neg_m));
        V::store(s.st + j * rp + r, pj);
        sum = V::add(sum, pj);
      }
      update_rows(s.m, s.l, s.ot, d, rp, r, m_old, m_new, sum);
    }
    // O^T[x][r] += sum_j V[j][x] P^T[j][r]
    gemm_rows(d, rp, s.ot, rp, vb, 1, vs, s.st, rp, nk, true);
  }
  write_output(p, h, i0, nq, rp, s.ot, s.l);
}

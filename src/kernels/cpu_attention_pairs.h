// The bf16 pair dot-product path of the CPU flash-attention kernel (cpu_attention.cpp), for
// bfloat16 inputs. Each product reduces over pairs: V::dot_pairs(acc, a, b) adds to every fp32
// lane the products of one pair of bf16 values (VDPBF16PS where the CPU has it: twice the
// FLOPs per instruction of a float32 FMA; elsewhere two ordered FMAs with the same semantics).
//
//   scores  S^T[j][r] = sum_x2 K[j](2x2, 2x2+1) . Qp[x2][r]   K read in place (its rows hold the
//           head_dim pairs side by side: a 32-bit broadcast per pair); Q^T packed in pairs per task
//   output  O^T[x][r] += sum_jp Vp[jp][x] . Pp[jp][r]           V packed in key pairs once per call
//           (pack_value_pairs), P^T rounded to bf16 pairs as it is computed (as flash attention
//           does on GPUs); the online-softmax state and O^T stay float32.
//
// Included once per instruction set, inside that ISA's `#pragma GCC target` region and its own
// namespace, after struct V, cpu_attention_softmax.h and cpu_attention_tile.h; nothing here includes a header or
// instantiates a library template.
//
// Per-thread scratch: qp [D/2][rp] words, st [BK][rp] float, pp [BK/2][rp] words, ot [D][rp],
// m, l [rp]. Per call: vp [Hkv][ceil(Lk/2)][D] words (the size of V itself).

// bf16 pair dot products: an A element is the bf16 pair at a + i * am + kk * ak (in bf16
// elements, broadcast as one 32-bit word), a B vector W packed pairs.
struct PairProduct {
  using A = uint16_t;
  using B = uint32_t;
  using Va = typename V::vi;
  using Vb = typename V::vi;
  static inline Vb load_b(const B* p) { return V::load_pairs(p); }
  static inline Va broadcast_a(const A* p) { return V::broadcast_pair(p); }
  static inline vf madd(vf acc, Va a, Vb b) { return V::dot_pairs(acc, a, b); }
};

inline void pair_rows(int64_t m, int64_t cols, float* c, int64_t ldc, const uint16_t* a, int64_t am, int64_t ak,
                      const uint32_t* b, int64_t ldb, int64_t kdim, bool accumulate) {
  product_rows<PairProduct>(m, cols, c, ldc, a, am, ak, b, ldb, kdim, accumulate);
}

// Key pairs [jp0, jp1) of KV head h into p.vp: word (jp, x) = (V[2jp][x], V[2jp+1][x]), the odd
// element 0 past the last key. Exact: packing values that already are bf16 rounds nothing.
void pack_value_pairs(const Problem& p, int64_t h, int64_t jp0, int64_t jp1) {
  const uint16_t* v = static_cast<const uint16_t*>(p.v) + h * p.v_head_stride;
  uint32_t* out = p.vp + h * p.vp_head_stride;
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    const uint16_t* even = v + 2 * jp * p.v_row_stride;
    const bool has_odd = 2 * jp + 1 < p.lk;
    for (int64_t x = 0; x < p.d; x += W) {
      const vf odd = has_odd ? V::load_bf16(even + p.v_row_stride + x) : V::zero();
      V::store_pairs(out + jp * p.d + x, V::pack_pairs(V::load_bf16(even + x), odd));
    }
  }
}

// One task: the rows of query block [i0, i0 + nq) of every query head of KV head h.
void run_task_pairs(const Problem& p, int64_t h, int64_t i0, int64_t nq, const Scratch& s) {
  const int64_t d = p.d, g = p.group, bk = p.block_k;  // bk even (the dispatcher makes it so)
  const int64_t rows = nq * g;
  const int64_t rp = (rows + NV * W - 1) / (NV * W) * (NV * W);
  uint32_t* qp = reinterpret_cast<uint32_t*>(s.qt);
  uint32_t* pp = reinterpret_cast<uint32_t*>(s.pp);
  pack_query_pairs(p, h, i0, nq, rp, qp);
  reset_state(s.ot, s.m, s.l, d, rp);
  const vf c = V::set1(p.scale_log2);
  const uint16_t* k = static_cast<const uint16_t*>(p.k) + h * p.k_head_stride;
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(p.vp + h * p.vp_head_stride);
  const int64_t first_pos = p.offset + i0;            // absolute position of the task's first query
  const int64_t kv_end = imin(p.lk, first_pos + nq);  // keys visible to its last query
  for (int64_t j0 = first_visible_key(first_pos, p.window, 2); j0 < kv_end; j0 += bk) {
    const int64_t nk = imin(bk, kv_end - j0), npairs = (nk + 1) / 2;
    // S^T[j][r] = K[j0 + j] . Q[r], over head_dim pairs
    pair_rows(nk, rp, s.st, rp, k + j0 * p.k_row_stride, p.k_row_stride, 2, qp, rp, d / 2, false);
    if (p.softcap_out > 0) soft_cap(s.st, nk, rp, p.softcap_in, p.softcap_out);
    mask_hidden_keys(s.st, nk, rp, j0, first_pos, g, p.window);
    // online softmax in log2 units, W rows at a time; P^T written as bf16 key pairs
    for (int64_t r = 0; r < rp; r += W) {
      const vf m_old = V::load(s.m + r);
      const vf m_new = block_max(s.st, nk, rp, r, c, m_old);
      const vf neg_m = neg_max(m_new);
      vf sum = V::zero();
      for (int64_t jp = 0; jp < npairs; ++jp) {
        const vf pe = exp2_nonpositive(V::fmadd(V::load(s.st + 2 * jp * rp + r), c, neg_m));
        const vf po = 2 * jp + 1 < nk ? exp2_nonpositive(V::fmadd(V::load(s.st + (2 * jp + 1) * rp + r), c, neg_m)) : V::zero();
        V::store_pairs(pp + jp * rp + r, V::pack_pairs(pe, po));
        sum = V::add(sum, V::add(pe, po));
      }
      update_rows(s.m, s.l, s.ot, d, rp, r, m_old, m_new, sum);
    }
    // O^T[x][r] += sum_jp Vp[j0/2 + jp][x] . P^T pairs[jp][r]
    pair_rows(d, rp, s.ot, rp, vp + j0 * d, 2, 2 * d, pp, rp, npairs, true);
  }
  write_output(p, h, i0, nq, rp, s.ot, s.l);
}

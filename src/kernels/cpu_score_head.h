// The LM head of the rows whose logits become scores (cpu_attention.cpp's score_head): float32
// logits out[m][n] = sum_k x[m][k] * w[n][k] from bfloat16 rows and a bfloat16 weight, the bf16
// products summed in float32 and written in float32. A bf16 GEMM (oneDNN, aten) rounds its
// output to bf16 (8 bits: a step of 0.0625 at a logit of 16), so distinct documents tie; here
// nothing rounds after the products, which are exact in float32.
//
// Both operands are read as they lie ([rows, k], k contiguous): the weight is the model's plain
// [vocab, hidden] matrix (a tied embedding's own rows), never copied or repacked. Each lane of an
// accumulator sums the k pairs that fall on it (V::dot_pairs: VDPBF16PS, or its two ordered FMAs),
// then the lanes are added. That order depends on nothing but k, so a row's logits are the same
// bits whichever rows share the call and however the vocabulary is split between threads.
//
// Included once per instruction set, inside that ISA's `#pragma GCC target` region and its own
// namespace, after struct V; nothing here includes a header or instantiates a library template.

// rows [m0, m0 + MR) x vocab rows [n0, n0 + NR): MR * NR accumulators over the k / 2 pairs
template <int MR, int NR>
inline void score_tile(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, float* out, int64_t os, int64_t pairs) {
  vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V::zero();
  int64_t p = 0;
  for (; p + W <= pairs; p += W) {
    typename V::vi b[NR];
    for (int j = 0; j < NR; ++j) b[j] = V::load_pairs(w + j * ws + p);
    for (int i = 0; i < MR; ++i) {
      const typename V::vi a = V::load_pairs(x + i * xs + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::dot_pairs(acc[i][j], a, b[j]);
    }
  }
  if (p < pairs) {  // the tail: lanes past it load as 0 and add +0 products
    const int n = static_cast<int>(pairs - p);
    typename V::vi b[NR];
    for (int j = 0; j < NR; ++j) b[j] = V::load_pairs_n(w + j * ws + p, n);
    for (int i = 0; i < MR; ++i) {
      const typename V::vi a = V::load_pairs_n(x + i * xs + p, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = V::dot_pairs(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * os + j] = V::reduce_add(acc[i][j]);
}

constexpr int kScoreRows = 4, kScoreVocab = 4;  // the register tile: 16 accumulators, 4 + 1 operands

// rows of the tile's height for the vocabulary rows [n0, n1): full columns of kScoreVocab, then one at a time
template <int MR>
inline void score_rows_of(const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, float* out, int64_t os, int64_t pairs,
                          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kScoreVocab <= n1; n += kScoreVocab) score_tile<MR, kScoreVocab>(x, xs, w + n * ws, ws, out + n, os, pairs);
  for (; n < n1; ++n) score_tile<MR, 1>(x, xs, w + n * ws, ws, out + n, os, pairs);
}

// the last rows < kScoreRows: one tile of their height
template <int MR>
inline void score_remainder(int64_t rows, const uint32_t* x, int64_t xs, const uint32_t* w, int64_t ws, float* out, int64_t os,
                            int64_t pairs, int64_t n0, int64_t n1) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      score_rows_of<MR>(x, xs, w, ws, out, os, pairs, n0, n1);
    } else {
      score_remainder<MR - 1>(rows, x, xs, w, ws, out, os, pairs, n0, n1);
    }
  }
}

// Entry point (cpu_attention.cpp's dispatcher calls it per range of vocabulary rows). x: [m][k]
// bf16 with row stride xs, w: [vocab][k] bf16 with row stride ws, out: [m][vocab] float32 with
// row stride os (strides in bf16 / float elements; k and both bf16 strides even: whole pairs).
// The vocabulary goes in blocks of ~kScoreBlockBytes of weight, each read from memory once and
// kept in L2 while every row runs over it (rows outside would stream the whole weight per row tile).
constexpr int64_t kScoreBlockBytes = 128 << 10;

void score_head_rows(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, float* out, int64_t os, int64_t m,
                     int64_t k, int64_t n0, int64_t n1) {
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const int64_t pairs = k / 2, xps = xs / 2, wps = ws / 2;
  const int64_t block = kScoreBlockBytes / (2 * k) / kScoreVocab * kScoreVocab + kScoreVocab;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
    int64_t r = 0;
    for (; r + kScoreRows <= m; r += kScoreRows)
      score_rows_of<kScoreRows>(xp + r * xps, xps, wp, wps, out + r * os, os, pairs, b0, b1);
    score_remainder<kScoreRows - 1>(m - r, xp + r * xps, xps, wp, wps, out + r * os, os, pairs, b0, b1);
  }
}

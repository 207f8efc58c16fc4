// The register-tiled product both paths of the CPU flash-attention kernel use (cpu_attention.cpp):
// C[i][r] (+)= sum_kk A(i, kk) * B[kk][r], A broadcast from memory, B rows read as vectors, with
// query rows r as the lanes. `Op` says what one A element and one B vector are and how one
// multiply-accumulate goes: FmaProduct (cpu_attention_body.h: float32 FMAs) or PairProduct
// (cpu_attention_pairs.h: bf16 pair dot products). Included inside an ISA region after its
// struct V and cpu_attention_softmax.h.

// One register tile: M rows of C, NV vectors wide. The constant loops unroll into registers.
template <class Op, int M>
inline void product_tile(float* c, int64_t ldc, const typename Op::A* a, int64_t am, int64_t ak, const typename Op::B* b,
                         int64_t ldb, int64_t kdim, bool accumulate) {
  vf acc[M][NV];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) acc[i][n] = accumulate ? V::load(c + i * ldc + n * W) : V::zero();
  for (int64_t kk = 0; kk < kdim; ++kk) {
    typename Op::Vb bv[NV];
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) bv[n] = Op::load_b(b + kk * ldb + n * W);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const typename Op::Va ai = Op::broadcast_a(a + i * am + kk * ak);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) acc[i][n] = Op::madd(acc[i][n], ai, bv[n]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int n = 0; n < NV; ++n) V::store(c + i * ldc + n * W, acc[i][n]);
}

template <class Op, int M>
inline void product_tail(int64_t rem, float* c, int64_t ldc, const typename Op::A* a, int64_t am, int64_t ak,
                         const typename Op::B* b, int64_t ldb, int64_t kdim, bool accumulate) {
  if constexpr (M > 0) {
    if (rem == M) {
      product_tile<Op, M>(c, ldc, a, am, ak, b, ldb, kdim, accumulate);
    } else {
      product_tail<Op, M - 1>(rem, c, ldc, a, am, ak, b, ldb, kdim, accumulate);
    }
  }
}

// C[0:m][0:cols] for cols a multiple of NV * W, in column strips so each strip of B stays in L1.
template <class Op>
inline void product_rows(int64_t m, int64_t cols, float* c, int64_t ldc, const typename Op::A* a, int64_t am, int64_t ak,
                         const typename Op::B* b, int64_t ldb, int64_t kdim, bool accumulate) {
  for (int64_t r = 0; r < cols; r += NV * W) {
    int64_t i = 0;
    for (; i + MR <= m; i += MR) product_tile<Op, MR>(c + i * ldc + r, ldc, a + i * am, am, ak, b + r, ldb, kdim, accumulate);
    product_tail<Op, MR - 1>(m - i, c + i * ldc + r, ldc, a + i * am, am, ak, b + r, ldb, kdim, accumulate);
  }
}

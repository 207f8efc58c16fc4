// The score head on AMX tiles (cpu_attention.cpp's score_head with isa "amx_bf16"): the same float32
// logits as cpu_score_head.h, out[m][n] = sum_k x[m][k] * w[n][k] from bf16 x and w, on TDPBF16PS:
// one instruction multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float32 sums (16x
// the products of an AVX-512 dot product), which is what oneDNN's bf16 GEMM runs on such a CPU.
//
//   A tiles  16 vocabulary rows x 32 k of the weight, loaded in place ([vocab, k] rows, no copy)
//   B tile   32 k x 16 rows of x in k pairs (VNNI): x packed once per call, xp [m / 16][k / 2][16] words
//   C tiles  16 vocabulary rows x 16 rows of x, float32, stored through a 16 x 16 buffer into out
//
// Two A tiles and two C tiles (32 vocabulary rows) per B tile; a k tail (k % 32) runs on tiles of
// its own shape; vocabulary rows past the last whole 32 are left to the caller (the AVX-512 path).
// Each C element accumulates its own row's products only, in an order that depends on k alone:
// a row's logits are the same bits whichever rows share the call.
//
// Included once, inside the AMX `#pragma GCC target` region and its own namespace; the caller
// (baseline code) has requested the OS's permission for the tile state (cpu_attention.cpp's has_amx_bf16).

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kAmxVocab = 32;  // vocabulary rows per block: two A tiles

// tiles: 0, 1 C; 2, 3 A; 4 B; 5, 6 A of the k tail; 7 B of the k tail (tail_pairs rows)
inline void configure_tiles(int64_t tail_pairs) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  if (tail_pairs > 0) {
    cfg.rows[5] = cfg.rows[6] = 16;
    cfg.colsb[5] = cfg.colsb[6] = static_cast<uint16_t>(4 * tail_pairs);
    cfg.rows[7] = static_cast<uint8_t>(tail_pairs);
    cfg.colsb[7] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x rows [m0, m0 + 16) (rows past m zero) -> xp [k / 2][16] words: word (p, j) = pair p of row m0 + j
inline void pack_rows_in_pairs(const uint32_t* x, int64_t xps, int64_t m0, int64_t m, int64_t pairs, uint32_t* xp) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t j = 0; j < 16; ++j) xp[p * 16 + j] = m0 + j < m ? x[(m0 + j) * xps + p] : 0u;
}

// One block of 32 vocabulary rows [n0, n0 + 32) against one group of 16 packed rows, into out.
inline void score_block_amx(const uint16_t* w, int64_t ws, const uint32_t* xp, int64_t k, int64_t n0, int64_t m0, int64_t rows,
                            float* out, int64_t os) {
  const int64_t whole = k / 32 * 32, tail_pairs = (k - whole) / 2;
  const uint16_t* a0 = w + n0 * ws;
  const uint16_t* a1 = a0 + 16 * ws;
  const int64_t stride = 2 * ws;  // bytes between weight rows
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kk = 0; kk < whole; kk += 32) {
    _tile_loadd(4, xp + kk / 2 * 16, 64);
    _tile_loadd(2, a0 + kk, stride);
    _tile_loadd(3, a1 + kk, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  if (tail_pairs > 0) {
    _tile_loadd(7, xp + whole / 2 * 16, 64);
    _tile_loadd(5, a0 + whole, stride);
    _tile_loadd(6, a1 + whole, stride);
    _tile_dpbf16ps(0, 5, 7);
    _tile_dpbf16ps(1, 6, 7);
  }
  alignas(64) float c[2][16][16];  // [A tile][vocabulary row][x row]
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  for (int64_t j = 0; j < rows; ++j) {
    float* o = out + (m0 + j) * os + n0;
    for (int t = 0; t < 2; ++t)
      for (int i = 0; i < 16; ++i) o[t * 16 + i] = c[t][i][j];
  }
}

// Entry point: vocabulary rows [n0, n1) (both multiples of kAmxVocab) of out [m][vocab] for x packed by
// pack_rows_in_pairs (group g at xp + g * k / 2 * 16). Configures this thread's tiles and releases them.
void score_head_rows_amx(const uint32_t* xp, int64_t m, const uint16_t* w, int64_t ws, float* out, int64_t os, int64_t k,
                         int64_t n0, int64_t n1) {
  configure_tiles((k % 32) / 2);
  const int64_t groups = (m + 15) / 16;
  for (int64_t n = n0; n < n1; n += kAmxVocab)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = m - 16 * g < 16 ? m - 16 * g : 16;
      score_block_amx(w, ws, xp + g * (k / 2) * 16, k, n, 16 * g, rows, out, os);
    }
  _tile_release();
}

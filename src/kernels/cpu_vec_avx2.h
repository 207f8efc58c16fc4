// Vector primitives of the AVX2+FMA path (8 float lanes). Included inside that ISA's
// `#pragma GCC target` region and namespace (cpu_attention.cpp, cpu_ops.cpp): everything here is
// inline and compiled with the region's ISA only. No include guard: each region includes it anew.
//
// The bf16 pair primitives follow VDPBF16PS's documented semantics (each fp32 lane accumulates
// the products of one pair of bf16 values: the odd (high) element's product first, then the even
// one's, each an fp32 FMA) so the pair-packed kernel runs, and is tested, on hosts without the
// instruction.
struct V {
  using vf = __m256;
  using vi = __m256i;  // 8 lanes of a bf16 pair each (low half: even element, high half: odd)
  using vm = __m256;   // comparison mask
  static constexpr int W = 8, MR = 4, NV = 3;  // 12 accumulators of 16 registers
  static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static inline vf zero() { return _mm256_setzero_ps(); }
  static inline vf set1(float x) { return _mm256_set1_ps(x); }
  static inline vf broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
  static inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
  static inline vf round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline vm ge_mask(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
  static inline vm gt_mask(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static inline bool any(vm m) { return _mm256_movemask_ps(m) != 0; }
  static inline vf select(vm m, vf if_false, vf if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
  static inline vf mask_and(vf x, vm m) { return _mm256_and_ps(x, m); }
  static inline vf scale_by_pow2(vf x, vf n) {  // x * 2^n for integral n, through the exponent bits
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(x), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
  }
  static inline vf load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  // -- bf16 pairs --
  static inline vi load_pairs(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline vi load_pairs_n(const uint32_t* p, int n) {  // lanes >= n: 0
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), tail_mask(n));
  }
  static inline void store_pairs(uint32_t* p, vi x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static inline vi broadcast_pair(const uint16_t* p) {
    int32_t word;
    std::memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
  }
  // acc + a.odd * b.odd + a.even * b.even per lane, two fp32 FMAs in that order
  static inline vf dot_pairs(vf acc, vi a, vi b) {
    const vi high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
  }
  // two float vectors rounded to bf16 (bf16_bits below) and interleaved: lane r = (even[r], odd[r])
  static inline vi pack_pairs(vf even, vf odd) { return _mm256_or_si256(bf16_bits(even), _mm256_slli_epi32(bf16_bits(odd), 16)); }
  // -- per-token ops -- (cpu_ops_body.h: rows of any length, bf16 rows rounded on store)
  static inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
  static inline float reduce_add(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static inline vi tail_mask(int n) {  // lanes [0, n) set, 0 <= n <= W
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline vf load_n(const float* p, int n) { return _mm256_maskload_ps(p, tail_mask(n)); }  // lanes >= n: 0
  static inline void store_n(float* p, vf x, int n) { _mm256_maskstore_ps(p, tail_mask(n), x); }
  static inline vf load_bf16_n(const uint16_t* p, int n) {
    uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < n; ++k) b[k] = p[k];
    return load_bf16(b);
  }
  // each lane rounded to bf16 (nearest even, as torch rounds; NaN stays NaN, quiet bit set), in its low 16 bits
  static inline vi bf16_bits(vf x) {
    const vi u = _mm256_castps_si256(x), high = _mm256_srli_epi32(u, 16);
    const vi bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
    const vi rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const vi nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static inline __m128i to_bf16(vf x) {
    const vi r = bf16_bits(x);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // values <= 0xffff: no saturation
  }
  static inline void store_bf16(uint16_t* p, vf x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static inline void store_bf16_n(uint16_t* p, vf x, int n) {
    uint16_t b[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), to_bf16(x));
    for (int k = 0; k < n; ++k) p[k] = b[k];
  }
  // 2W bf16 as two float vectors in a lane order of their own (elementwise math only: store_bf16_2
  // puts them back in place); cheaper than two load_bf16 / store_bf16
  static inline void load_bf16_2(const uint16_t* p, vf* lo, vf* hi) {
    const vi x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
  }
  static inline void store_bf16_2(uint16_t* p, vf lo, vf hi) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi)));
  }
  // 1 / x for normal x: the 12-bit estimate and two Newton steps r += r (1 - x r) (~1 ulp, 1 / 1 = 1;
  // results below FLT_MIN flush to 0)
  static inline vf recip(vf x) {
    const vf one = _mm256_set1_ps(1.0f);
    vf r = _mm256_rcp_ps(x);
    r = _mm256_fmadd_ps(r, _mm256_fnmadd_ps(x, r, one), r);
    return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(x, r, one), r);
  }
};

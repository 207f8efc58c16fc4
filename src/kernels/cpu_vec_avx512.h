// Vector primitives of the AVX-512 paths (16 float lanes). Included inside an ISA's
// `#pragma GCC target` region and namespace (cpu_attention.cpp, cpu_ops.cpp): everything here is
// inline and compiled with the region's ISA only. No include guard: each region includes it anew.
//
// PFA_NATIVE_BF16 defined (the avx512_bf16 region only): dot_pairs is the VDPBF16PS instruction.
// Otherwise it follows that instruction's documented semantics with two fp32 FMAs per pair (the
// odd (high) element's product first), so the pair-packed kernel runs, and is tested, on
// AVX-512 hosts without it.
struct V {
  using vf = __m512;
  using vi = __m512i;  // 16 lanes of a bf16 pair each (low half: even element, high half: odd)
  using vm = __mmask16;
  static constexpr int W = 16, MR = 8, NV = 2;  // 16 accumulators of 32 registers
  static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
  static inline vf zero() { return _mm512_setzero_ps(); }
  static inline vf set1(float x) { return _mm512_set1_ps(x); }
  static inline vf broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
  static inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
  static inline vf round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static inline vm ge_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static inline vm gt_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static inline bool any(vm m) { return m != 0; }
  static inline vf select(vm m, vf if_false, vf if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }
  static inline vf mask_and(vf x, vm m) { return _mm512_maskz_mov_ps(m, x); }
  static inline vf scale_by_pow2(vf x, vf n) { return _mm512_scalef_ps(x, n); }
  static inline vf load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  // -- bf16 pairs --
  static inline vi load_pairs(const uint32_t* p) { return _mm512_loadu_si512(p); }
  static inline vi load_pairs_n(const uint32_t* p, int n) { return _mm512_maskz_loadu_epi32(tail_mask(n), p); }  // lanes >= n: 0
  static inline void store_pairs(uint32_t* p, vi x) { _mm512_storeu_si512(p, x); }
  static inline vi broadcast_pair(const uint16_t* p) {
    int32_t word;
    std::memcpy(&word, p, 4);
    return _mm512_set1_epi32(word);
  }
#ifdef PFA_NATIVE_BF16
  static inline vf dot_pairs(vf acc, vi a, vi b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#else
  // acc + a.odd * b.odd + a.even * b.even per lane, two fp32 FMAs in that order
  static inline vf dot_pairs(vf acc, vi a, vi b) {
    const vi high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
  }
#endif
  // two float vectors rounded to bf16 (bf16_bits below) and interleaved: lane r = (even[r], odd[r])
  static inline vi pack_pairs(vf even, vf odd) { return _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32(bf16_bits(odd), 16)); }
  // -- per-token ops -- (cpu_ops_body.h: rows of any length, bf16 rows rounded on store)
  static inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
  static inline float reduce_add(vf x) { return _mm512_reduce_add_ps(x); }
  static inline vm tail_mask(int n) { return static_cast<vm>((1u << n) - 1u); }  // lanes [0, n) set, 0 <= n <= W
  static inline vf load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }  // lanes >= n: 0
  static inline void store_n(float* p, vf x, int n) { _mm512_mask_storeu_ps(p, tail_mask(n), x); }
  static inline vf load_bf16_n(const uint16_t* p, int n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(n), p)), 16));
  }
  // each lane rounded to bf16 (nearest even, as torch rounds; NaN stays NaN, quiet bit set), in its low 16 bits
  static inline vi bf16_bits(vf x) {
    const vi u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
    const vi bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const vi rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_or_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
  }
  static inline void store_bf16(uint16_t* p, vf x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x))); }
  static inline void store_bf16_n(uint16_t* p, vf x, int n) { _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtepi32_epi16(bf16_bits(x))); }
  // 2W bf16 as two float vectors in a lane order of their own (elementwise math only: store_bf16_2
  // puts them back in place); cheaper than two load_bf16 / store_bf16
  static inline void load_bf16_2(const uint16_t* p, vf* lo, vf* hi) {
    const vi x = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
  }
  static inline void store_bf16_2(uint16_t* p, vf lo, vf hi) {
    _mm512_storeu_si512(p, _mm512_packus_epi32(bf16_bits(lo), bf16_bits(hi)));  // values <= 0xffff: no saturation
  }
  // 1 / x for normal x: the 14-bit estimate and one Newton step r += r (1 - x r) (~1 ulp, 1 / 1 = 1)
  static inline vf recip(vf x) {
    const vf r = _mm512_rcp14_ps(x);
    return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(1.0f)), r);
  }
};

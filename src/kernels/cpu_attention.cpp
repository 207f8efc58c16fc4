// Flash attention for CPU: exact causal attention, online softmax, float32 accumulation, for
// float32 and bfloat16 inputs, grouped-query heads, and queries that are the suffix of a longer
// key sequence (cached prefix + fresh K/V) in one pass. Optionally a sliding window (a query at
// position t sees keys (t - window, t] only: key blocks wholly outside it are neither loaded nor
// scored, the edge block is masked) and soft-capped scores (cap * tanh(score / cap), Gemma 2).
//
// Why our own: torch's CPU SDPA runs at ~15-60% of the same host's matmul rate; its softmax
// takes one exact exponential per query-key pair, which bounds it. Here the exponential is a
// degree-5 polynomial in 2^x (cpu_attention_softmax.h, error < 3e-7 relative), and both products
// are register-tiled loops over a layout with query rows as vector lanes, so the online softmax
// state (max, sum, rescale) of W rows is one vector operation.
//
// Two product paths: float32 FMAs (cpu_attention_body.h: float32 inputs; bf16 inputs widened per
// block) and bf16 pair dot products (cpu_attention_pairs.h: bf16 inputs; VDPBF16PS does twice the
// FLOPs of an FMA per instruction, as torch's bf16 matmul does on such CPUs).
//
// ISA safety: this file is compiled for the baseline x86-64 ISA. Each kernel body is compiled
// once per instruction set inside a `#pragma GCC target` region (AVX2+FMA; AVX-512F/BW/DQ/VL;
// AVX-512 + AVX512_BF16) and picked at run time from the CPU's flags (__builtin_cpu_supports),
// so one build runs on any x86-64 host and never executes an instruction the host lacks. Variants
// (IsaEntry below): "avx512_bf16" (native pair dot products), "avx512" and "avx2" (float32 FMAs),
// and "avx512_pairs" / "avx2_pairs", the pair path with the dot product emulated by two FMAs of
// the instruction's documented semantics: the portable reference that tests the pair layout on
// any host and that the Python side compares the native path against before trusting it
// (cpu_ext.attention_isa). No AVX2: the caller falls back to torch SDPA.
//
// Work split: a task is (KV head, block of queries) with all its group's query heads, so each
// K/V block is loaded once for the whole group; tasks run longest-first from a shared counter
// on torch's intra-op threads (causal blocks late in the prompt see more keys).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_isa.h"

namespace pfa {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int64_t q_head_stride, q_row_stride, k_head_stride, k_row_stride;  // in elements
  int64_t v_head_stride, v_row_stride, o_head_stride, o_row_stride;
  int64_t hkv, group, lq, lk, d;
  int64_t offset;      // lk - lq: query i sits at key position offset + i
  int64_t window;      // 0: every earlier key; else a query at t sees keys (t - window, t]
  float softcap_in;    // soft-capping: scaled score s -> softcap_out * tanh(s * softcap_in); 0: none
  float softcap_out;
  uint32_t* vp;        // pair path: V packed in key pairs, [hkv][ceil(lk / 2)][d] words
  int64_t vp_head_stride;
  int64_t block_q;     // queries per task
  int64_t block_k;     // keys per block
  float scale_log2;    // what turns a (capped) score into log2 units: scale * log2(e), or log2(e) when capped
  bool bf16;
};

struct Scratch {  // one thread's float32 buffers; shapes in cpu_attention_body.h
  float* qt;
  float* ot;
  float* st;
  float* kf;
  float* vf;
  float* m;
  float* l;
  float* pp;  // pair path: P^T as bf16 key pairs, [BK / 2][rp] words
};

// Visits the task's rows: row r = i * group + g is query head h * group + g at position i0 + i;
// `at` is that row's element offset in a tensor of the given head and row strides.
template <typename F>
void for_each_task_row(const Problem& p, int64_t h, int64_t i0, int64_t nq, int64_t head_stride, int64_t row_stride, F&& f) {
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t gg = 0; gg < p.group; ++gg) f(i * p.group + gg, (h * p.group + gg) * head_stride + (i0 + i) * row_stride);
}

// Q rows of the task -> Q^T [d][rp], zero columns for the padding rows.
void pack_queries(const Problem& p, int64_t h, int64_t i0, int64_t nq, int64_t rp, float* qt) {
  const int64_t d = p.d;
  for_each_task_row(p, h, i0, nq, p.q_head_stride, p.q_row_stride, [&](int64_t r, int64_t at) {
    if (p.bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(p.q) + at;
      for (int64_t x = 0; x < d; ++x) qt[x * rp + r] = bf16_to_float(src[x]);
    } else {
      const float* src = static_cast<const float*>(p.q) + at;
      for (int64_t x = 0; x < d; ++x) qt[x * rp + r] = src[x];
    }
  });
  for (int64_t r = nq * p.group; r < rp; ++r)
    for (int64_t x = 0; x < d; ++x) qt[x * rp + r] = 0.f;
}

// bf16 Q rows of the task -> Q^T in head_dim pairs, qp [d / 2][rp]: word (x2, r) is the 32-bit
// word (Q[r][2 x2], Q[r][2 x2 + 1]) read as it lies in the row; zero for the padding rows.
void pack_query_pairs(const Problem& p, int64_t h, int64_t i0, int64_t nq, int64_t rp, uint32_t* qp) {
  const int64_t half = p.d / 2;
  for_each_task_row(p, h, i0, nq, p.q_head_stride, p.q_row_stride, [&](int64_t r, int64_t at) {
    const uint16_t* src = static_cast<const uint16_t*>(p.q) + at;
    for (int64_t x2 = 0; x2 < half; ++x2) std::memcpy(qp + x2 * rp + r, src + 2 * x2, 4);
  });
  for (int64_t r = nq * p.group; r < rp; ++r)
    for (int64_t x2 = 0; x2 < half; ++x2) qp[x2 * rp + r] = 0u;
}

// O^T / l -> the output rows of the task (which may be the query rows themselves: they were
// packed before anything was written).
void write_output(const Problem& p, int64_t h, int64_t i0, int64_t nq, int64_t rp, const float* ot, const float* l) {
  const int64_t d = p.d;
  for_each_task_row(p, h, i0, nq, p.o_head_stride, p.o_row_stride, [&](int64_t r, int64_t at) {
    const float inv = 1.f / l[r];
    if (p.bf16) {
      uint16_t* dst = static_cast<uint16_t*>(p.out) + at;
      for (int64_t x = 0; x < d; ++x) dst[x] = float_to_bf16(ot[x * rp + r] * inv);
    } else {
      float* dst = static_cast<float*>(p.out) + at;
      for (int64_t x = 0; x < d; ++x) dst[x] = ot[x * rp + r] * inv;
    }
  });
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "cpu_vec_avx2.h"
#include "cpu_attention_softmax.h"
#include "cpu_attention_tile.h"
#include "cpu_attention_body.h"
#include "cpu_attention_pairs.h"
#include "cpu_score_head.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
#include "cpu_vec_avx512.h"
#include "cpu_attention_softmax.h"
#include "cpu_attention_tile.h"
#include "cpu_attention_body.h"
#include "cpu_attention_pairs.h"
#include "cpu_score_head.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")
namespace avx512_bf16 {
#define PFA_NATIVE_BF16
#include "cpu_vec_avx512.h"
#undef PFA_NATIVE_BF16
#include "cpu_attention_softmax.h"
#include "cpu_attention_tile.h"
#include "cpu_attention_pairs.h"
#include "cpu_score_head.h"
}  // namespace avx512_bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace amx {
#include "cpu_score_head_amx.h"
}  // namespace amx
#pragma GCC pop_options

// -- dispatch ------------------------------------------------------------------------------

struct IsaEntry {
  const char* name;
  int tile_cols;  // NV * W of its register tile: task rows are padded to a multiple of it
  bool pairs;     // the bf16 pair path (bf16 inputs only), else float32 FMAs
  bool (*supported)();
  void (*task)(const Problem&, int64_t, int64_t, int64_t, const Scratch&);
  void (*pack_values)(const Problem&, int64_t, int64_t, int64_t);  // pair path: V -> p.vp, per head and key pairs
  void (*exp2)(const float*, float*, int64_t);
  decltype(&avx2::score_head_rows) score_head_rows;  // the LM head in bf16 pairs (cpu_score_head.h), every entry's ISA
};

bool has_avx512_bf16() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// AMX-BF16 tiles the OS lets this process use: the CPU's flags (CPUID 7.0 EDX bits 22, 24), the OS
// saving the tile state (XCR0 bits 17, 18), and Linux's per-process permission for it, asked once
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; refused, e.g. by a sandbox: no AMX).
bool has_amx_bf16() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!has_avx512() || !__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

constexpr int kTile512 = avx512::V::NV * avx512::V::W, kTile256 = avx2::V::NV * avx2::V::W;

// Fastest first within each path. "auto" picks the first supported float32-FMA entry: the native
// pair path is chosen by the caller (cpu_ext.attention_isa) only after its self-check passed.
const IsaEntry kIsas[] = {
    {"avx512_bf16", kTile512, true, has_avx512_bf16, avx512_bf16::run_task_pairs, avx512_bf16::pack_value_pairs,
     avx512_bf16::exp2_array, avx512_bf16::score_head_rows},
    {"avx512", kTile512, false, has_avx512, avx512::run_task, nullptr, avx512::exp2_array, avx512::score_head_rows},
    {"avx2", kTile256, false, has_avx2, avx2::run_task, nullptr, avx2::exp2_array, avx2::score_head_rows},
    {"avx512_pairs", kTile512, true, has_avx512, avx512::run_task_pairs, avx512::pack_value_pairs, avx512::exp2_array,
     avx512::score_head_rows},
    {"avx2_pairs", kTile256, true, has_avx2, avx2::run_task_pairs, avx2::pack_value_pairs, avx2::exp2_array,
     avx2::score_head_rows},
};

const IsaEntry& pick_isa(const std::string& name) {
  for (const auto& e : kIsas) {
    if (name == "auto" ? (!e.pairs && e.supported()) : name == e.name) {
      TORCH_CHECK(e.supported(), "cpu flash attention: this CPU lacks the ", e.name, " instructions");
      return e;
    }
  }
  TORCH_CHECK(name != "auto", "cpu flash attention: this CPU has neither AVX2+FMA nor AVX-512");
  TORCH_CHECK(false, "cpu flash attention: unknown ISA '", name, "' (auto, avx512_bf16, avx512, avx2, avx512_pairs, avx2_pairs)");
}

// Keys per block and query rows (queries x group) per task, before padding. The pair path's
// products are twice as fast per instruction, so it takes longer key blocks (fewer loads and
// stores of the accumulators per product) and 96-row tasks (a multiple of the 32-lane tile for
// GQA groups 1/2/3/4/8: no padded lanes): 3-7% faster than 64 / 120 on a Zen4 host (SmolLM2's
// heads, causal 4K and 150 over 2K cached).
constexpr int64_t kDefaultBlockK = 64, kDefaultPairBlockK = 128;
constexpr int64_t kDefaultTaskRows = 120, kDefaultPairTaskRows = 96;

int64_t task_rows_of(bool pairs, int64_t task_rows) {
  return task_rows > 0 ? task_rows : pairs ? kDefaultPairTaskRows : kDefaultTaskRows;
}

int64_t queries_per_task(int64_t group, int64_t task_rows) { return task_rows / group > 1 ? task_rows / group : 1; }

int64_t padded_rows(const IsaEntry& e, int64_t rows) { return (rows + e.tile_cols - 1) / e.tile_cols * e.tile_cols; }

// keys per block: the pair path needs an even count (key pairs never straddle two blocks)
int64_t keys_per_block(const IsaEntry& e, int64_t block_k) {
  const int64_t bk = block_k > 0 ? block_k : e.pairs ? kDefaultPairBlockK : kDefaultBlockK;
  return e.pairs ? (bk + 1) / 2 * 2 : bk;
}

// One thread's scratch cut from `base` (nullptr: only the size); rp = padded rows of a full task.
// Returns the number of floats (4-byte words) it takes.
int64_t carve_scratch(const IsaEntry& e, float* base, int64_t d, int64_t rp, int64_t block_k, Scratch* s) {
  const int64_t kv = e.pairs ? 0 : block_k * d, pairs = e.pairs ? block_k / 2 * rp : 0;
  const int64_t sizes[] = {d * rp, d * rp, block_k * rp, kv, kv, rp, rp, pairs};  // qt ot st kf vf m l pp
  float** slots[] = {&s->qt, &s->ot, &s->st, &s->kf, &s->vf, &s->m, &s->l, &s->pp};
  int64_t offset = 0;
  for (int i = 0; i < 8; ++i) {
    if (base != nullptr) *slots[i] = base + offset;
    offset += sizes[i];
  }
  return offset;
}

int64_t scratch_floats_per_thread(const IsaEntry& e, int64_t d, int64_t group, int64_t block_k, int64_t task_rows) {
  Scratch unused{};
  return carve_scratch(e, nullptr, d, padded_rows(e, queries_per_task(group, task_rows) * group), block_k, &unused);
}

// Words of the pair path's packed V of one call (none on the float32 path).
int64_t packed_value_words(const IsaEntry& e, int64_t hkv, int64_t lk, int64_t d) { return e.pairs ? hkv * ((lk + 1) / 2) * d : 0; }

}  // namespace pfa

// q: [Hq, Lq, D]; k, v: [Hkv, Lk, D]; out: [Hq, Lq, D], `q` itself or not overlapping it.
void flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, double scale,
                     const std::string& isa, int64_t block_k, int64_t task_rows, int64_t window, double softcap) {
  using namespace pfa;
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "cpu flash attention: 3-d tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() && q.scalar_type() == out.scalar_type(),
              "cpu flash attention: q, k, v, out must share one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cpu flash attention: float32 or bfloat16");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && out.device().is_cpu(), "cpu flash attention: CPU tensors");
  const int64_t hq = q.size(0), lq = q.size(1), d = q.size(2), hkv = k.size(0), lk = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && out.sizes() == q.sizes(), "cpu flash attention: shapes");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && lk >= lq && lq > 0, "cpu flash attention: need Hq % Hkv == 0 and Lk >= Lq > 0");
  TORCH_CHECK(d % 16 == 0 && d <= 256, "cpu flash attention: head_dim a multiple of 16, at most 256");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1, "cpu flash attention: unit stride in head_dim");
  TORCH_CHECK(out.data_ptr() != q.data_ptr() || out.strides() == q.strides(), "cpu flash attention: out aliases q with other strides");
  TORCH_CHECK(window >= 0 && softcap >= 0, "cpu flash attention: window and softcap are >= 0 (0: none)");
  const IsaEntry& e = pick_isa(isa);
  TORCH_CHECK(!e.pairs || q.scalar_type() == at::kBFloat16, "cpu flash attention: the ", e.name, " path takes bfloat16 inputs only");
  Problem p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.out = out.data_ptr();
  p.q_head_stride = q.stride(0), p.q_row_stride = q.stride(1), p.k_head_stride = k.stride(0), p.k_row_stride = k.stride(1);
  p.v_head_stride = v.stride(0), p.v_row_stride = v.stride(1), p.o_head_stride = out.stride(0), p.o_row_stride = out.stride(1);
  p.hkv = hkv, p.group = hq / hkv, p.lq = lq, p.lk = lk, p.d = d, p.offset = lk - lq;
  p.window = window >= lk ? 0 : window;  // a window as long as the keys hides nothing
  p.block_k = keys_per_block(e, block_k);
  const int64_t rows = task_rows_of(e.pairs, task_rows);
  p.block_q = queries_per_task(p.group, rows);
  p.softcap_in = softcap > 0 ? static_cast<float>(scale / softcap) : 0.f;
  p.softcap_out = static_cast<float>(softcap);
  p.scale_log2 = static_cast<float>((softcap > 0 ? 1.0 : scale) * 1.4426950408889634);
  p.bf16 = q.scalar_type() == at::kBFloat16;

  at::Tensor packed_v;  // the pair path's V in key pairs, once per call (not per task)
  if (e.pairs) {
    packed_v = at::empty({packed_value_words(e, hkv, lk, d)}, q.options().dtype(at::kInt));
    p.vp = reinterpret_cast<uint32_t*>(packed_v.data_ptr<int32_t>());
    p.vp_head_stride = (lk + 1) / 2 * d;
    const int64_t pairs = (lk + 1) / 2, chunk = 256;  // key pairs per packing task
    const int64_t chunks = (pairs + chunk - 1) / chunk;
    at::parallel_for(0, hkv * chunks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) e.pack_values(p, t / chunks, t % chunks * chunk, imin(pairs, (t % chunks + 1) * chunk));
    });
  }
  const int64_t q_blocks = (lq + p.block_q - 1) / p.block_q, tasks = q_blocks * hkv;
  const int64_t threads = imin(at::get_num_threads(), tasks);
  const int64_t per_thread = scratch_floats_per_thread(e, d, p.group, p.block_k, rows);
  at::Tensor scratch = at::empty({threads, per_thread}, q.options().dtype(at::kFloat));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      Scratch s{};
      carve_scratch(e, scratch.data_ptr<float>() + t * per_thread, d, padded_rows(e, p.block_q * p.group), p.block_k, &s);
      for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
        const int64_t qb = q_blocks - 1 - task / hkv, h = task % hkv;  // latest (longest) query blocks first
        const int64_t i0 = qb * p.block_q;
        e.task(p, h, i0, imin(p.block_q, lq - i0), s);
      }
    }
  });
}

// Bytes one call allocates besides its output (the memory prediction's attention term): the
// per-thread scratch and, on the pair path, V packed in key pairs (as large as V).
int64_t scratch_bytes(int64_t head_dim, int64_t group, int64_t kv_heads, int64_t keys, int64_t threads, const std::string& isa,
                      int64_t block_k, int64_t task_rows) {
  const auto& e = pfa::pick_isa(isa);
  const int64_t per_thread = pfa::scratch_floats_per_thread(e, head_dim, group, pfa::keys_per_block(e, block_k),
                                                            pfa::task_rows_of(e.pairs, task_rows));
  return 4 * (threads * per_thread + pfa::packed_value_words(e, kv_heads, keys, head_dim));
}

std::vector<std::string> isa_names(bool supported_only) {
  std::vector<std::string> names;
  for (const auto& e : pfa::kIsas)
    if (!supported_only || e.supported()) names.emplace_back(e.name);
  return names;
}

at::Tensor exp2_nonpositive(const at::Tensor& x, const std::string& isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "exp2: contiguous float32");
  at::Tensor y = at::empty_like(x);
  pfa::pick_isa(isa).exp2(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  return y;
}

// The AMX path of score_head: x packed in k pairs per 16 rows, the vocabulary's whole blocks of 32 rows
// on tiles, the rest (vocab % 32 rows) on the AVX-512 pair path.
void score_head_amx(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, float* out, int64_t os, int64_t m, int64_t k,
                    int64_t vocab) {
  using namespace pfa;
  const int64_t pairs = k / 2, groups = (m + 15) / 16;
  std::vector<uint32_t> xp(static_cast<size_t>(groups * pairs * 16));
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(x);
  for (int64_t g = 0; g < groups; ++g) amx::pack_rows_in_pairs(xw, xs / 2, 16 * g, m, pairs, xp.data() + g * pairs * 16);
  const int64_t blocks = vocab / amx::kAmxVocab, whole = blocks * amx::kAmxVocab;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    amx::score_head_rows_amx(xp.data(), m, w, ws, out, os, k, b0 * amx::kAmxVocab, b1 * amx::kAmxVocab);
  });
  if (whole < vocab) pick_isa(has_avx512_bf16() ? "avx512_bf16" : "avx512").score_head_rows(x, xs, w, ws, out, os, m, k, whole, vocab);
}

// out [m, vocab] float32 = x [m, k] @ w [vocab, k]^T from bfloat16 x and w (cpu_score_head.h): the
// logits of scored rows, never rounded to bf16. `isa` names an entry of kIsas (the avx512 and
// avx512_pairs entries run the same emulated pair products; avx512_bf16 the native instruction), or
// "amx_bf16" (AMX tiles: cpu_score_head_amx.h).
void score_head(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const std::string& isa) {
  using namespace pfa;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kFloat,
              "score head: bfloat16 x and w, float32 out");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "score head: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.size(1) == w.size(1) && out.size(0) == x.size(0) &&
                  out.size(1) == w.size(0), "score head: shapes x [m, k], w [vocab, k], out [m, vocab]");
  const int64_t m = x.size(0), k = x.size(1), vocab = w.size(0);
  TORCH_CHECK(k % 2 == 0 && x.stride(1) == 1 && w.stride(1) == 1 && out.stride(1) == 1 && x.stride(0) % 2 == 0 &&
                  w.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(w.data_ptr()) % 4 == 0,
              "score head: k even, unit stride in k, even row strides, 4-byte aligned rows (whole bf16 pairs)");
  const bool tiles = isa == "amx_bf16";
  TORCH_CHECK(!tiles || has_amx_bf16(), "score head: this CPU (or the OS) gives no AMX-BF16 tiles");
  const IsaEntry* e = tiles ? nullptr : &pick_isa(isa);  // checked before any early return: a bad name is an error
  if (m == 0 || vocab == 0) return;
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(w.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ws = w.stride(0), os = out.stride(0);
  if (tiles) return score_head_amx(xp, xs, wp, ws, op, os, m, k, vocab);
  // 256 vocabulary rows a grain: a block of the weight read once from memory for every row
  at::parallel_for(0, vocab, 256, [&](int64_t n0, int64_t n1) { e->score_head_rows(xp, xs, wp, ws, op, os, m, k, n0, n1); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("score_head", &score_head, "out [m, vocab] float32 = x [m, k] @ w [vocab, k]^T from bfloat16 x, w (float32 sums)",
        py::arg("x"), py::arg("w"), py::arg("out"), py::arg("isa"));
  m.def("flash_attention", &flash_attention, "causal flash attention (bottom-right aligned), out may be q; "
        "window > 0: a query at t sees keys (t - window, t]; softcap > 0: scores capped by softcap * tanh(s / softcap)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("scale"), py::arg("isa"), py::arg("block_k"),
        py::arg("task_rows"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("scratch_bytes", &scratch_bytes, "bytes one flash_attention call allocates besides its output");
  m.def("pair_path", [](const std::string& isa) { return pfa::pick_isa(isa).pairs; }, "whether the ISA entry is a bf16 pair path");
  m.def("supported_isas", [] { return isa_names(true); }, "ISAs this CPU can run, best first");
  m.def("amx_bf16", &pfa::has_amx_bf16, "whether this process may run AMX-BF16 tiles (score_head's isa 'amx_bf16')");
  m.def("compiled_isas", [] { return isa_names(false); }, "ISAs compiled into this build");
  m.def("exp2_nonpositive", &exp2_nonpositive, "the kernel's 2^x for x <= 0 (accuracy tests)");
}

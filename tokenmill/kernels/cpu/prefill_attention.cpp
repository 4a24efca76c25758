// Prompt-chunk attention straight from the paged, head-major KV cache (CPU), flash-attention style.
//
// Each prompt chunk (query rows at positions start .. start + len - 1) attends to its request's
// context 0 .. its own position, read through the block table: no gathered copy of the context and
// no mask tensor. The work is split into tasks of (request, KV head, tile of query positions); the
// G query heads sharing a KV head are rows of the same tile, so every K and V row a tile needs is
// read once for all of them. A task walks the context in tiles of N keys with an online softmax
// (running max and sum per query row, float32), so its working set is a few tiles, whatever the
// context length:
//
//   S^T [N, R]  = K_tile [N, D] . Q^T [D, R]      (scale folded into Q)
//   causal / sliding-window mask by position arithmetic, only on tiles that cross a row's limits
//   m_new = max(m, max_k S), P = exp(S - m_new), l = l * exp(m - m_new) + sum_k P
//   O [R, D]   = O * exp(m - m_new) + P^T . V_tile
//
// Scores are kept transposed (keys as rows, query rows in the vector lanes): the row maxima, the
// exponentials and the sums then run down columns a vector at a time, without a horizontal
// reduction, and both products are small register-blocked GEMMs that broadcast one operand from
// memory (a K element for S, a P element for O) against vectors of the other. bf16 / fp16 K and V
// rows are widened to float32, and float32 rows copied, into contiguous tiles in L1 once per tile
// (every row of the task reuses them; reading float32 rows in place through the block table was
// 10-15% slower). Where the CPU has AVX512-BF16, bf16 queries over a bf16 cache skip the widening:
// both products multiply bf16 pairs with vdpbf16ps (Bf16PairMul, PairedFlashTile), P rounded to bf16
// for the second as PyTorch's own CPU flash attention does. Tasks are handed out from a shared
// counter, longest contexts first.
//
// Cascade attention's shared-prefix pass (cascade_prefix_attention) runs the same tiles with other
// query rows: the decode tokens of many requests whose contexts start with the same physical blocks
// (prefix caching shares them). A task takes one KV head and the query heads of a group of those
// requests as its rows, and walks the shared prefix once for all of them: no mask (every decode
// token comes after the prefix), and out comes each row's normalized partial output and its
// log-sum-exp, which the decode kernel (paged_attention.cpp) merges with the rest of the context.
// Both read an int8 / fp8 cache as stored: each row widened and times its scale as it is packed.
//
// Built for the machine it runs on (vec.h: AVX-512 16 lanes, AVX2 + FMA + F16C 8 lanes); without
// either, or for head sizes that are no whole number of vectors, the same tiling runs scalar loops,
// which are the reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// Keys per tile (N): against 32, a 2,048-token bf16 prompt 8.9 -> 8.0 ms, float32 16.3 -> 15.3; 64 and 256 less.
constexpr int64_t kKeyTile = 128;
// Query rows (positions x G heads) a task aims at by default, in whole vectors of rows, a chunk cut into equal
// tasks (positions_per_task, split_chunk). For G = 3 that is 16 positions, 48 rows, where it was 21 positions: a
// 32-token chunk ran as tasks of 63 and 33 rows, padded to 64 and 48, each walking the whole context. Workload
// C's big prefill step (1,056 tokens from 0 and 63 chunks of 32 after 1,024), bf16, Zen 4, 2 threads, tilings
// alternating in one process: 1.12x with 4 or 3 KV heads, 16 chunks of 32 after 512 1.13-1.20x, prompts from 0
// 0.99-1.13x; for G = 1, 4, 8 the tiling is the same as before (0.98-1.03x). 96 rows: C 1.14-1.15x, but
// G = 8 0.92x on 32 prompts of 128; 128 rows lost on prompts from 0 (0.89-0.95x).
constexpr int64_t kRowsPerTask = 64;
// The cascade's prefix pass: more rows per walk over the prefix (64 requests of G = 3). 64 decodes over a
// 1,024-token prefix, 4 KV heads (tiny100m), Zen 5, 2 threads, against 64 rows: bf16 411 -> 334 us,
// float32 778 -> 616 (3 KV heads, SmolLM2: 318 -> 270, 584 -> 485). The prompt kernel gained nothing.
constexpr int64_t kCascadeRowsPerTask = 192;

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
// Register blocks: S takes KB keys x RV row vectors of accumulators; O takes RR rows x DC head-dim
// vectors. AVX2 has 16 vector registers, AVX-512 32.
constexpr int kSKeys = Vec::kRegisters >= 32 ? 4 : 2;
constexpr int kSRowVecs = 4;
constexpr int kORows = 6;  // o_rows' switch takes the rest: up to kORows - 1
constexpr int kODimVecs = Vec::kRegisters >= 32 ? 4 : 2;

// Pins x to a register: without it gcc folds the load of x into every FMA that uses it, so a Q
// vector shared by KB keys was loaded KB times and the loop waited on the load ports.
inline void in_register(Vec& x) {
#if TOKENMILL_SIMD == 512
  asm("" : "+v"(x.v));
#else
  asm("" : "+x"(x.v));
#endif
}

// How the tiles' two products multiply. FloatMul: float32 operands, one fused multiply-add per
// element (K and V rows widened to float32 as they are packed). Bf16PairMul (AVX512-BF16): the
// operands stay bf16, as pairs of consecutive elements in a uint32, and vdpbf16ps multiplies 16
// pairs and adds both products to 16 float32 sums: half the instructions, and no widening. S pairs
// elements along the head dim (a K row's pair broadcast against the pairs of 16 query rows); O pairs
// two consecutive keys (their P values broadcast against V's rows interleaved by pairs). So bf16
// attention rounds P to bf16 before the PV product, as PyTorch's CPU flash attention and HF's eager
// attention (softmax in float32, then to the values' dtype) do; scores and the softmax stay float32.
struct FloatMul {
  using elem = float;
  static Vec load(const float* p) { return Vec::load(p); }
  static Vec broadcast(float x) { return Vec::set1(x); }
  static Vec madd(Vec a, Vec b, Vec acc) { return fmadd(a, b, acc); }
  static Vec scaled(Vec s, Vec) { return s; }  // the softmax scale is in Q already
};
#if TOKENMILL_BF16_PAIRS
struct Bf16PairMul {
  using elem = uint32_t;
  static Vec load(const uint32_t* p) { return tokenmill_cpu::load_bf16_pairs(p); }
  static Vec broadcast(uint32_t x) { return tokenmill_cpu::broadcast_pair(x); }
  static Vec madd(Vec a, Vec b, Vec acc) { return tokenmill_cpu::dp_bf16(acc, a, b); }
  static Vec scaled(Vec s, Vec scale) { return s * scale; }  // Q stays as the model gave it (bf16)
};
#endif

// S^T[k, r0 .. r0 + RV*W) for KB keys: sum over the steps j (elements, or pairs) of K[k][j] * Qt[j][r].
template <typename Mul, int KB, int RV>
inline void s_block(const typename Mul::elem* const* krows, const typename Mul::elem* qt, int64_t R, int64_t steps, Vec scale,
                    float* s) {
  Vec acc[KB][RV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) acc[k][v] = Vec::zero();
  for (int64_t j = 0; j < steps; ++j) {
    Vec q[RV];
    for (int v = 0; v < RV; ++v) {
      q[v] = Mul::load(qt + j * R + v * W);
      in_register(q[v]);
    }
    for (int k = 0; k < KB; ++k) {
      const Vec kb = Mul::broadcast(krows[k][j]);
      for (int v = 0; v < RV; ++v) acc[k][v] = Mul::madd(kb, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < RV; ++v) store(s + k * R + v * W, Mul::scaled(acc[k][v], scale));
}

template <typename Mul, int KB>
inline void s_keys(const typename Mul::elem* const* krows, const typename Mul::elem* qt, int64_t R, int64_t steps, Vec scale,
                   float* s) {
  int64_t r = 0;
  for (; r + kSRowVecs * W <= R; r += kSRowVecs * W) s_block<Mul, KB, kSRowVecs>(krows, qt + r, R, steps, scale, s + r);
  switch ((R - r) / W) {
    case 1: s_block<Mul, KB, 1>(krows, qt + r, R, steps, scale, s + r); break;
    case 2: s_block<Mul, KB, 2>(krows, qt + r, R, steps, scale, s + r); break;
    case 3: s_block<Mul, KB, 3>(krows, qt + r, R, steps, scale, s + r); break;
    default: break;
  }
}

// S^T [n, R] for the tile's n keys.
template <typename Mul>
inline void s_tile(const typename Mul::elem* const* krows, int64_t n, const typename Mul::elem* qt, int64_t R, int64_t steps,
                   float scale, float* s) {
  const Vec sc = Vec::set1(scale);
  int64_t k = 0;
  for (; k + kSKeys <= n; k += kSKeys) s_keys<Mul, kSKeys>(krows + k, qt, R, steps, sc, s + k * R);
  for (; k < n; ++k) s_keys<Mul, 1>(krows + k, qt, R, steps, sc, s + k * R);
}

// O[r, c0 .. c0 + DC*W) for RR rows: O * alpha[r] + sum over the steps k (keys, or pairs of keys) of
// P^T[k][r] * V[k].
template <typename Mul, int RR, int DC>
inline void o_block(const typename Mul::elem* p, int64_t R, const typename Mul::elem* const* vrows, int64_t n, const float* alpha,
                    float* o, int64_t D) {
  Vec acc[RR][DC];
  for (int r = 0; r < RR; ++r) {
    const Vec a = Vec::set1(alpha[r]);
    for (int c = 0; c < DC; ++c) acc[r][c] = Vec::load(o + r * D + c * W) * a;
  }
  for (int64_t k = 0; k < n; ++k) {
    Vec vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = Mul::load(vrows[k] + c * W);
    for (int r = 0; r < RR; ++r) {
      const Vec pk = Mul::broadcast(p[k * R + r]);
      for (int c = 0; c < DC; ++c) acc[r][c] = Mul::madd(pk, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < DC; ++c) store(o + r * D + c * W, acc[r][c]);
}

template <typename Mul, int DC>
inline void o_rows(const typename Mul::elem* p, int64_t R, const typename Mul::elem* const* vrows, int64_t n, const float* alpha,
                   float* o, int64_t D, int64_t c0, const typename Mul::elem** shifted) {
  // The V row pointers moved to this head-dim slice (o_block reads vrows[k] + c * W).
  for (int64_t k = 0; k < n; ++k) shifted[k] = vrows[k] + c0;
  int64_t r = 0;
  for (; r + kORows <= R; r += kORows) o_block<Mul, kORows, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D);
  switch (R - r) {  // the rows left: one block of their own size
    case 1: o_block<Mul, 1, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D); break;
    case 2: o_block<Mul, 2, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D); break;
    case 3: o_block<Mul, 3, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D); break;
    case 4: o_block<Mul, 4, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D); break;
    case 5: o_block<Mul, 5, DC>(p + r, R, shifted, n, alpha + r, o + r * D + c0, D); break;
    default: break;
  }
}

template <typename Mul>
inline void o_tile(const typename Mul::elem* p, int64_t R, const typename Mul::elem* const* vrows, int64_t n, const float* alpha,
                   float* o, int64_t D, const typename Mul::elem** shifted) {
  const int64_t chunks = D / W;
  if (chunks % kODimVecs == 0) {
    for (int64_t c0 = 0; c0 < D; c0 += kODimVecs * W) o_rows<Mul, kODimVecs>(p, R, vrows, n, alpha, o, D, c0, shifted);
  } else if (chunks % 2 == 0) {
    for (int64_t c0 = 0; c0 < D; c0 += 2 * W) o_rows<Mul, 2>(p, R, vrows, n, alpha, o, D, c0, shifted);
  } else {
    for (int64_t c0 = 0; c0 < D; c0 += W) o_rows<Mul, 1>(p, R, vrows, n, alpha, o, D, c0, shifted);
  }
}

#if TOKENMILL_BF16_PAIRS
// P^T [n, R] float32 to pairs of keys as bf16 (rounded to nearest even): p2[k / 2][r] = (P[k][r], P[k + 1][r]),
// a zero for the missing key of an odd n.
inline void pair_probabilities(const float* p, int64_t n, int64_t R, uint32_t* p2) {
  const __m512i order = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005, 0x160006, 0x170007,
                                          0x180008, 0x190009, 0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d, 0x1e000e, 0x1f000f);
  for (int64_t k = 0; k < n; k += 2)
    for (int64_t r = 0; r < R; r += W) {
      const __m512 first = _mm512_loadu_ps(p + k * R + r);
      const __m512 second = k + 1 < n ? _mm512_loadu_ps(p + (k + 1) * R + r) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(second, first);  // first's 16 values, then second's
      _mm512_storeu_si512(p2 + k / 2 * R + r, _mm512_permutexvar_epi16(order, both));
    }
}
#endif
#endif

// The scalar loops: the reference, and the path for head sizes that are no whole number of vectors.
inline void s_tile_scalar(const float* const* krows, int64_t n, const float* qt, int64_t R, int64_t D, float* s) {
  for (int64_t k = 0; k < n; ++k) {
    float* sk = s + k * R;
    std::fill(sk, sk + R, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float kd = krows[k][d];
      const float* q = qt + d * R;
      for (int64_t r = 0; r < R; ++r) sk[r] += kd * q[r];
    }
  }
}

inline void o_tile_scalar(const float* p, int64_t R, const float* const* vrows, int64_t n, const float* alpha, float* o, int64_t D) {
  for (int64_t r = 0; r < R; ++r) {
    float* orow = o + r * D;
    for (int64_t d = 0; d < D; ++d) orow[d] *= alpha[r];
    for (int64_t k = 0; k < n; ++k) {
      const float pk = p[k * R + r];
      const float* v = vrows[k];
      for (int64_t d = 0; d < D; ++d) orow[d] += pk * v[d];
    }
  }
}

// Masks S^T [n, R] (keys k0 ..) to -inf where a key is after its row's position or outside its window.
inline void mask_tile(float* s, int64_t n, int64_t R, int64_t k0, const float* qpos, int64_t window, bool vec) {
  const float inf = std::numeric_limits<float>::infinity();
  int64_t r_vec = 0;
#if TOKENMILL_SIMD
  if (vec) {
    const Vec minus_inf = Vec::set1(-inf);
    for (int64_t k = 0; k < n; ++k) {
      const Vec kp = Vec::set1(static_cast<float>(k0 + k));
      const Vec kw = Vec::set1(static_cast<float>(k0 + k + window));  // key in window: k + window > qpos
      for (int64_t r = 0; r < R; r += W) {
        const Vec qp = Vec::load(qpos + r);
        Vec x = select(greater(kp, qp), minus_inf, Vec::load(s + k * R + r));
        if (window > 0) x = select(greater(kw, qp), x, minus_inf);
        store(s + k * R + r, x);
      }
    }
    r_vec = R;
  }
#endif
  if (r_vec == R) return;
  for (int64_t k = 0; k < n; ++k)
    for (int64_t r = 0; r < R; ++r) {
      const float kp = static_cast<float>(k0 + k);
      if (kp > qpos[r] || (window > 0 && kp + static_cast<float>(window) <= qpos[r])) s[k * R + r] = -inf;
    }
}

// The online softmax step over a tile: m, l updated; S^T replaced by P^T; alpha[r] = exp(m_old - m_new).
// kInlineExp: vec.h's exp_inline instead of libmvec's call, which spilled the loop's vectors around it
// (with it the bf16 pairs' softmax was a third of their time); for those tiles only, which round P to
// bf16 anyway: the float32 path keeps libmvec's expf.
template <bool kInlineExp = false>
inline void softmax_tile(float* s, int64_t n, int64_t R, float* m, float* l, float* alpha, bool vec) {
  const float inf = std::numeric_limits<float>::infinity();
  int64_t r0 = 0;
#if TOKENMILL_SIMD
  if (vec) {
    const Vec minus_inf = Vec::set1(-inf), zero = Vec::zero();
    for (int64_t r = 0; r < R; r += W) {
      Vec mt = Vec::load(s + r);
      for (int64_t k = 1; k < n; ++k) mt = vmax(mt, Vec::load(s + k * R + r));
      const Vec m_old = Vec::load(m + r);
      const Vec m_new = vmax(m_old, mt);
      // A row with every key so far masked keeps m = -inf: exponents against 0 give 0, not NaN.
      const Vec m_use = select(greater(m_new, minus_inf), m_new, zero);
      auto exp = [](Vec x) {
#if TOKENMILL_BF16_PAIRS
        if constexpr (kInlineExp) return tokenmill_cpu::exp_inline(x);
#endif
        return vexp(x);
      };
      const Vec a = exp(m_old - m_use);
      Vec sum = Vec::zero();
      for (int64_t k = 0; k < n; ++k) {
        const Vec e = exp(Vec::load(s + k * R + r) - m_use);
        store(s + k * R + r, e);
        sum = sum + e;
      }
      store(l + r, fmadd(Vec::load(l + r), a, sum));
      store(m + r, m_new);
      store(alpha + r, a);
    }
    r0 = R;
  }
#endif
  for (int64_t r = r0; r < R; ++r) {
    float mt = -inf;
    for (int64_t k = 0; k < n; ++k) mt = std::max(mt, s[k * R + r]);
    const float m_new = std::max(m[r], mt);
    const float m_use = m_new == -inf ? 0.f : m_new;
    const float a = std::exp(m[r] - m_use);
    float sum = 0.f;
    for (int64_t k = 0; k < n; ++k) {
      const float e = std::exp(s[k * R + r] - m_use);
      s[k * R + r] = e;
      sum += e;
    }
    l[r] = l[r] * a + sum;
    m[r] = m_new;
    alpha[r] = a;
  }
}

// Whether the vector paths run for head size D, and the lanes the query rows are padded to.
inline bool vector_rows(int64_t D, int64_t& lanes) {
#if TOKENMILL_SIMD
  lanes = D % W == 0 ? W : 1;
  return D % W == 0;
#else
  lanes = 1;
  return false;
#endif
}

// The cache row `row` of one head widened to float32 into dst, times `scale` for a quantized cache
// (int8 / fp8: each value times its row's or tensor's scale, one rounding, as the dequantize does).
template <typename cache_t>
inline void pack_row(const cache_t* src, float scale, int64_t D, float* dst) {
  constexpr bool kFloat = std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16> || std::is_same_v<cache_t, c10::Half>;
  int64_t d = 0;
#if TOKENMILL_SIMD
  const Vec s = Vec::set1(scale);
  for (; d + W <= D; d += W) store(dst + d, kFloat ? tokenmill_cpu::load_kv(src + d) : tokenmill_cpu::load_kv(src + d) * s);
#endif
  for (; d < D; ++d) dst[d] = kFloat ? static_cast<float>(src[d]) : static_cast<float>(src[d]) * scale;
}

// One thread's flash-attention state for up to R_max query rows: Q^T, the online softmax's m and l,
// the output accumulator, and the tile's K / V rows. A task calls begin, load_query per row (Q^T with
// the softmax scale folded in), then per tile of keys load_key per key (each row widened to float32
// into kpack / vpack) and step; o / l is then each row's output, m + log(l) its log-sum-exp.
struct FlashTile {
  std::vector<float> qt, s, o, m, l, alpha, kpack, vpack;
  std::vector<const float*> krows, vrows, shifted;
  bool vec;
  float scale;
  FlashTile(int64_t R_max, int64_t D, bool vec, float scale)
      : qt(D * R_max), s(kKeyTile * R_max), o(R_max * D), m(R_max), l(R_max), alpha(R_max), kpack(kKeyTile * D),
        vpack(kKeyTile * D), krows(kKeyTile), vrows(kKeyTile), shifted(kKeyTile), vec(vec), scale(scale) {
    for (int64_t k = 0; k < kKeyTile; ++k) {
      krows[k] = kpack.data() + k * D;
      vrows[k] = vpack.data() + k * D;
    }
  }
  // Padding rows (R0 .. R) keep zero queries; their outputs are dropped.
  void begin(int64_t R, int64_t D) {
    std::fill(qt.begin(), qt.begin() + D * R, 0.f);
    reset_softmax(R, D, m, l, o);
  }
  static void reset_softmax(int64_t R, int64_t D, std::vector<float>& m, std::vector<float>& l, std::vector<float>& o) {
    std::fill(m.begin(), m.begin() + R, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + R, 0.f);
    std::fill(o.begin(), o.begin() + R * D, 0.f);
  }
  template <typename T>
  void load_query(int64_t r, const T* q, int64_t R, int64_t D) {
    for (int64_t d = 0; d < D; ++d) qt[d * R + r] = static_cast<float>(q[d]) * scale;
  }
  template <typename cache_t>
  void load_key(int64_t k, const cache_t* krow, float ks, const cache_t* vrow, float vs, int64_t D) {
    pack_row(krow, ks, D, kpack.data() + k * D);
    pack_row(vrow, vs, D, vpack.data() + k * D);
  }
  // S^T for the tile's n keys, then (after mask(s), when given) the softmax step and O += P^T V.
  template <typename Mask>
  void step(int64_t n, int64_t R, int64_t D, Mask&& mask) {
#if TOKENMILL_SIMD
    if (vec) s_tile<FloatMul>(krows.data(), n, qt.data(), R, D, 1.f, s.data());
    else
#endif
      s_tile_scalar(krows.data(), n, qt.data(), R, D, s.data());
    mask(s.data());
    softmax_tile(s.data(), n, R, m.data(), l.data(), alpha.data(), vec);
#if TOKENMILL_SIMD
    if (vec) o_tile<FloatMul>(s.data(), R, vrows.data(), n, alpha.data(), o.data(), D, shifted.data());
    else
#endif
      o_tile_scalar(s.data(), R, vrows.data(), n, alpha.data(), o.data(), D);
  }
};

#if TOKENMILL_BF16_PAIRS
// FlashTile's interface for bf16 queries over a bf16 cache, multiplying with vdpbf16ps (Bf16PairMul):
// Q^T holds the queries' bf16 pairs as the model gave them (the scale multiplies the scores instead),
// K rows are read in place from the cache, and each tile's V rows are interleaved by pairs of keys.
// SmolLM2's heads, Zen 5, 2 threads (benchmarks/chunk_attention.py), against the float32 tiles: a
// 2,048-token prompt 16.3 -> 8.9 ms, 256 tokens after 768 1.83 -> 0.98, 32 after 1,024 0.32 -> 0.17.
struct PairedFlashTile {
  std::vector<uint32_t> qt, p2, vpairs;
  std::vector<float> s, o, m, l, alpha;
  std::vector<const uint32_t*> krows, vrows, shifted;
  std::vector<const c10::BFloat16*> vsrc;
  std::vector<c10::BFloat16> zero_row;  // the partner of an odd tile's last key
  float scale;
  PairedFlashTile(int64_t R_max, int64_t D, float scale)
      : qt(D / 2 * R_max), p2(kKeyTile / 2 * R_max), vpairs(kKeyTile / 2 * D), s(kKeyTile * R_max), o(R_max * D), m(R_max),
        l(R_max), alpha(R_max), krows(kKeyTile), vrows(kKeyTile / 2), shifted(kKeyTile / 2), vsrc(kKeyTile),
        zero_row(D, c10::BFloat16(0.f)), scale(scale) {
    for (int64_t k = 0; k < kKeyTile / 2; ++k) vrows[k] = vpairs.data() + k * D;
  }
  void begin(int64_t R, int64_t D) {
    std::fill(qt.begin(), qt.begin() + D / 2 * R, 0u);
    FlashTile::reset_softmax(R, D, m, l, o);
  }
  void load_query(int64_t r, const c10::BFloat16* q, int64_t R, int64_t D) {
    uint32_t pair;
    for (int64_t j = 0; j < D / 2; ++j) {
      std::memcpy(&pair, q + 2 * j, sizeof(pair));
      qt[j * R + r] = pair;
    }
  }
  void load_key(int64_t k, const c10::BFloat16* krow, float, const c10::BFloat16* vrow, float, int64_t) {
    krows[k] = reinterpret_cast<const uint32_t*>(krow);
    vsrc[k] = vrow;
  }
  template <typename Mask>
  void step(int64_t n, int64_t R, int64_t D, Mask&& mask) {
    for (int64_t k = 0; k < n; k += 2) {
      const c10::BFloat16* second = k + 1 < n ? vsrc[k + 1] : zero_row.data();
      for (int64_t c0 = 0; c0 < D; c0 += 2 * W) {
        Vec lo, hi;
        tokenmill_cpu::interleave_bf16(vsrc[k] + c0, second + c0, lo, hi);
        store(reinterpret_cast<float*>(vpairs.data() + k / 2 * D + c0), lo);
        store(reinterpret_cast<float*>(vpairs.data() + k / 2 * D + c0 + W), hi);
      }
    }
    s_tile<Bf16PairMul>(krows.data(), n, qt.data(), R, D / 2, scale, s.data());
    mask(s.data());
    softmax_tile<true>(s.data(), n, R, m.data(), l.data(), alpha.data(), true);
    pair_probabilities(s.data(), n, R, p2.data());
    o_tile<Bf16PairMul>(p2.data(), R, vrows.data(), (n + 1) / 2, alpha.data(), o.data(), D, shifted.data());
  }
};
#endif

// f(tile) with one thread's tile for up to R_max rows: the bf16 pairs' where the dtypes and the ISA
// allow it (and D is a whole number of 32-element pairs of vectors), else the float32 one.
template <typename scalar_t, typename cache_t, typename F>
void with_flash_tile(int64_t R_max, int64_t D, bool vec, float scale, F&& f) {
#if TOKENMILL_BF16_PAIRS
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (D % (2 * W) == 0) {
      PairedFlashTile tile(R_max, D, scale);
      f(tile);
      return;
    }
  }
#endif
  FlashTile tile(R_max, D, vec, scale);
  f(tile);
}

struct Task {
  int64_t b, h, i0, rows;  // request, KV head, first query offset in the chunk, query positions
};

// Query positions per task. Asked for (rows_per_task > 0, the tests' tilings): rows_per_task / G, at least one.
// By default: as many as fill kRowsPerTask rows in whole steps of `quantum` positions, the fewest whose G rows
// fill whole vectors of `lanes` (G = 3: 16 positions, 48 rows, on AVX-512), at least one step; where that step
// is over twice kRowsPerTask rows (G = 9: 144; 71 query heads to one KV head: 1,136), positions one by one.
inline int64_t positions_per_task(int64_t rows_per_task, int64_t G, int64_t lanes, int64_t& quantum) {
  quantum = 1;
  if (rows_per_task > 0) return std::max<int64_t>(1, rows_per_task / G);
  const int64_t whole_vectors = lanes / std::gcd(G, lanes);  // the fewest positions whose G rows fill whole vectors
  if (whole_vectors * G <= 2 * kRowsPerTask) quantum = whole_vectors;
  return std::max(quantum, (kRowsPerTask / G + quantum / 2) / quantum * quantum);
}

// A chunk of L positions cut into the fewest tasks of at most M positions, of equal size rounded up to `quantum`
// (the last one takes the rest): 40 positions at M = 32 run as 20 + 20, or as 32 + 8 with a quantum of 16.
inline int64_t split_chunk(int64_t L, int64_t M, int64_t quantum) {
  const int64_t tasks = std::max<int64_t>(1, (L + M - 1) / M);
  const int64_t even = (L + tasks - 1) / tasks;
  return std::min(M, (even + quantum - 1) / quantum * quantum);
}

template <typename scalar_t, typename cache_t>
void prefill_kernel(
    const scalar_t* q, int64_t q_stride,  // [T, Hkv * G, D], rows q_stride apart
    const cache_t* k_cache,               // [Hkv, NB, BS, D]: q's dtype, or int8 / fp8 with scales
    const cache_t* v_cache,
    const float* k_scale, const float* v_scale, int64_t scale_stride,  // as paged_attention.cpp's RowScales
    const int64_t* first_rows,            // [B] row of each chunk's first query token in q / out
    const int64_t* starts,                // [B] position of that token
    const int64_t* lens,                  // [B] query tokens of the chunk
    const int64_t* block_table,           // [B, MB]
    scalar_t* out,                        // [*, Hkv * G, D] contiguous
    int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t NB, int64_t BS, int64_t MB,
    int64_t window, float scale, int64_t rows_per_task) {
  int64_t lanes = 1;
  const bool vec = vector_rows(D, lanes);
  int64_t quantum = 1;
  const int64_t M = positions_per_task(rows_per_task, G, lanes, quantum);  // query positions per task, at most
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t Mb = split_chunk(lens[b], M, quantum);
    for (int64_t i0 = 0; i0 < lens[b]; i0 += Mb)
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, i0, std::min(Mb, lens[b] - i0)});
  }
  // Longest contexts first, so that the last tasks handed out are short ones.
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) {
    return starts[x.b] + x.i0 + x.rows > starts[y.b] + y.i0 + y.rows;
  });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t R_max = (M * G + lanes - 1) / lanes * lanes;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    with_flash_tile<scalar_t, cache_t>(R_max, D, vec, scale, [&](auto& tile) {
      std::vector<float> qpos(R_max);
      for (int64_t t; (t = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
        const Task task = tasks[t];
        const int64_t R0 = task.rows * G, R = (R0 + lanes - 1) / lanes * lanes;
        const int64_t p_min = starts[task.b] + task.i0, p_max = p_min + task.rows - 1;
        // Q^T, rows r = i * G + g; padding rows are zero and take the last row's position.
        tile.begin(R, D);
        for (int64_t i = 0; i < task.rows; ++i) {
          const scalar_t* qrow = q + (first_rows[task.b] + task.i0 + i) * q_stride + task.h * G * D;
          for (int64_t g = 0; g < G; ++g) tile.load_query(i * G + g, qrow + g * D, R, D);
        }
        for (int64_t r = 0; r < R; ++r) qpos[r] = static_cast<float>(r < R0 ? p_min + r / G : p_max);

        const cache_t* k_head = k_cache + task.h * NB * BS * D;
        const cache_t* v_head = v_cache + task.h * NB * BS * D;
        const float* ks = k_scale + scale_stride * task.h * NB * BS;
        const float* vs = v_scale + scale_stride * task.h * NB * BS;
        const int64_t* blocks = block_table + task.b * MB;
        const int64_t k_first = window > 0 ? std::max<int64_t>(0, p_min - window + 1) : 0, k_end = p_max + 1;
        for (int64_t k0 = k_first; k0 < k_end; k0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, k_end - k0);
          for (int64_t k = 0; k < n; ++k) {
            const int64_t pos = k0 + k;
            const int64_t row = blocks[pos / BS] * BS + pos % BS;
            tile.load_key(k, k_head + row * D, ks[row * scale_stride], v_head + row * D, vs[row * scale_stride], D);
          }
          tile.step(n, R, D, [&](float* s) {
            // Only tiles that reach past the first row's position or before the last row's window need a mask.
            if (k0 + n - 1 > p_min || (window > 0 && k0 <= p_max - window)) mask_tile(s, n, R, k0, qpos.data(), window, vec);
          });
        }
        for (int64_t i = 0; i < task.rows; ++i) {
          scalar_t* orow = out + ((first_rows[task.b] + task.i0 + i) * Hkv + task.h) * G * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g;
            const float inv = 1.f / tile.l[r];
            const float* src = tile.o.data() + r * D;
            int64_t d = 0;
  #if TOKENMILL_SIMD
            if (vec) {
              const Vec iv = Vec::set1(inv);
              for (; d < D; d += W) store(orow + g * D + d, Vec::load(src + d) * iv);
            }
  #endif
            for (; d < D; ++d) orow[g * D + d] = static_cast<scalar_t>(src[d] * inv);
          }
        }
      }
    });
  });
}

// out[first_rows[b] + i] = attention of q[first_rows[b] + i] (position starts[b] + i) over request
// b's paged context 0 .. starts[b] + i, for i < lens[b]; other rows untouched. A quantized cache
// (int8 / fp8) comes with its scales (paged_attention.cpp's), its rows dequantized as they are packed.
void paged_prefill_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& first_rows, const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& block_table,
    int64_t window, double scale, int64_t rows_per_task, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.size(1) == q.size(1) && out.size(2) == q.size(2),
              "q and out must be [T, H, D] with the same H and D");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q must have contiguous heads ([T, H, D] rows, any row stride)");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [Hkv, blocks, block_size, D]");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "out and the caches must be contiguous");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "paged_prefill_attention: give both k_scale and v_scale or neither");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (quantized || k_cache.scalar_type() == q.scalar_type()),
              "q, out and the caches must share a dtype (or the caches be quantized, with scales)");
  for (const auto* x : {&first_rows, &starts, &lens, &block_table})
    TORCH_CHECK(x->scalar_type() == at::kLong, "index tensors must be int64");
  const auto rows = first_rows.contiguous(), st = starts.contiguous(), ln = lens.contiguous(), table = block_table.contiguous();
  const int64_t B = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head sizes of q and the caches disagree");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && st.size(0) == B && ln.size(0) == B,
              "block_table / starts / lens must have a row per request");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = st.data_ptr<int64_t>();
  const int64_t* n = ln.data_ptr<int64_t>();
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // a bad row or block would read or write outside the tensors
    TORCH_CHECK(n[b] >= 0 && s[b] >= 0 && r[b] >= 0 && r[b] + n[b] <= q.size(0) && r[b] + n[b] <= out.size(0),
                "paged_prefill_attention: chunk rows out of range");
    TORCH_CHECK(s[b] + n[b] <= table.size(1) * BS, "paged_prefill_attention: context longer than its block table");
    for (int64_t i = 0; i < (s[b] + n[b] + BS - 1) / BS; ++i)
      TORCH_CHECK(tb[b * table.size(1) + i] >= 0 && tb[b * table.size(1) + i] < NB, "paged_prefill_attention: block out of range");
  }
  const auto scales = tokenmill_cpu::kv_scale_pointers(k_cache, k_scale, v_scale, "paged_prefill_attention");
  tokenmill_cpu::dispatch_float_types(q.scalar_type(), "paged_prefill_attention", [&](auto* type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    auto run = [&](auto* cache_tag) {
      using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
      prefill_kernel<scalar_t, cache_t>(
          q.data_ptr<scalar_t>(), q.stride(0), static_cast<const cache_t*>(k_cache.data_ptr()),
          static_cast<const cache_t*>(v_cache.data_ptr()), scales.k, scales.v, scales.stride, r, s, n, tb, out.data_ptr<scalar_t>(),
          B, Hkv, H / Hkv, D, NB, BS, table.size(1), window, static_cast<float>(scale), rows_per_task);
    };
    tokenmill_cpu::dispatch_kv_cache<scalar_t>(quantized, k_cache.scalar_type(), "paged_prefill_attention", run);
  });
}

// For each KV head h and decode request b: the attention of b's G query heads over the shared prefix
// (positions 0 .. P - 1 in the blocks `prefix_blocks`), normalized, into o_out[b, h * G + g] (float32),
// and its log-sum-exp (scores with the softmax scale) into lse_out[b, h * G + g].
template <typename scalar_t, typename cache_t>
void cascade_prefix_kernel(
    const scalar_t* q,            // [T, Hkv * G, D] contiguous
    const cache_t* k_cache,       // [Hkv, NB, BS, D]
    const cache_t* v_cache,
    const float* k_scale, const float* v_scale, int64_t scale_stride,  // as paged_attention.cpp's RowScales
    const int64_t* token_rows,    // [B] row of each decode token in q
    const int64_t* prefix_blocks, // [ceil(P / BS)]
    float* o_out,                 // [B, Hkv * G, D]
    float* lse_out,               // [B, Hkv * G]
    int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t NB, int64_t BS, int64_t P, float scale, int64_t rows_per_task) {
  int64_t lanes = 1;
  const bool vec = vector_rows(D, lanes);
  // Requests per task: up to rows_per_task rows, but at least two tasks per thread when the batch allows,
  // then as many more as fill the vectors the rows are padded to (6 requests of G = 3 are 18 rows, two
  // AVX-512 vectors: 10 requests fill them).
  const int64_t threads = at::get_num_threads();
  const int64_t tiles_wanted = std::max<int64_t>(1, (2 * threads + Hkv - 1) / Hkv);
  int64_t M = std::max<int64_t>(1, std::min(rows_per_task / G, (B + tiles_wanted - 1) / tiles_wanted));
  M = std::max(M, std::min(B, (M * G + lanes - 1) / lanes * lanes / G));
  const int64_t tiles = (B + M - 1) / M, num_tasks = tiles * Hkv;
  const int64_t R_max = (M * G + lanes - 1) / lanes * lanes;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(threads, num_tasks), 1, [&](int64_t, int64_t) {
    with_flash_tile<scalar_t, cache_t>(R_max, D, vec, scale, [&](auto& tile) {
      for (int64_t t; (t = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
        const int64_t h = t % Hkv, b0 = (t / Hkv) * M, nb = std::min(M, B - b0);
        const int64_t R0 = nb * G, R = (R0 + lanes - 1) / lanes * lanes;
        tile.begin(R, D);
        for (int64_t i = 0; i < nb; ++i) {
          const scalar_t* qrow = q + (token_rows[b0 + i] * Hkv + h) * G * D;
          for (int64_t g = 0; g < G; ++g) tile.load_query(i * G + g, qrow + g * D, R, D);
        }
        const cache_t* k_head = k_cache + h * NB * BS * D;
        const cache_t* v_head = v_cache + h * NB * BS * D;
        const float* ks = k_scale + scale_stride * h * NB * BS;
        const float* vs = v_scale + scale_stride * h * NB * BS;
        for (int64_t k0 = 0; k0 < P; k0 += kKeyTile) {
          const int64_t n = std::min(kKeyTile, P - k0);
          for (int64_t k = 0; k < n; ++k) {
            const int64_t pos = k0 + k, row = prefix_blocks[pos / BS] * BS + pos % BS;
            tile.load_key(k, k_head + row * D, ks[row * scale_stride], v_head + row * D, vs[row * scale_stride], D);
          }
          tile.step(n, R, D, [](float*) {});  // every decode token comes after the prefix: nothing to mask
        }
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = i * G + g, col = (b0 + i) * Hkv * G + h * G + g;
            const float inv = 1.f / tile.l[r];
            for (int64_t d = 0; d < D; ++d) o_out[col * D + d] = tile.o[r * D + d] * inv;
            lse_out[col] = tile.m[r] + std::log(tile.l[r]);
          }
      }
    });
  });
}

// (o [B, H, D], lse [B, H]) float32: the decode tokens q[token_rows] attended over the shared prefix
// (positions 0 .. prefix_len - 1, in the blocks prefix_blocks), for paged_decode_attention to merge.
std::tuple<at::Tensor, at::Tensor> cascade_prefix_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& token_rows,
    const at::Tensor& prefix_blocks, int64_t prefix_len, double scale, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, int64_t rows_per_task) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "cascade_prefix_attention: q must be contiguous [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "cascade_prefix_attention: caches must be contiguous [Hkv, blocks, block_size, D] of one dtype");
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "cascade_prefix_attention: give both k_scale and v_scale or neither");
  TORCH_CHECK(quantized || k_cache.scalar_type() == q.scalar_type(),
              "cascade_prefix_attention: the caches must have q's dtype (or be quantized, with scales)");
  TORCH_CHECK(token_rows.scalar_type() == at::kLong && prefix_blocks.scalar_type() == at::kLong && token_rows.dim() == 1 &&
                  prefix_blocks.dim() == 1, "cascade_prefix_attention: token_rows and prefix_blocks must be int64 vectors");
  const auto rows = token_rows.contiguous(), blocks = prefix_blocks.contiguous();
  const int64_t B = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "cascade_prefix_attention: head sizes of q and the caches disagree");
  TORCH_CHECK(prefix_len > 0 && prefix_len <= blocks.size(0) * BS, "cascade_prefix_attention: prefix_len must be in 1 .. blocks * block_size");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* pb = blocks.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r[b] >= 0 && r[b] < q.size(0), "cascade_prefix_attention: token row out of range");
  for (int64_t i = 0; i < blocks.size(0); ++i) TORCH_CHECK(pb[i] >= 0 && pb[i] < NB, "cascade_prefix_attention: block out of range");
  const auto scales = tokenmill_cpu::kv_scale_pointers(k_cache, k_scale, v_scale, "cascade_prefix_attention");
  auto o = at::empty({B, H, D}, q.options().dtype(at::kFloat));
  auto lse = at::empty({B, H}, q.options().dtype(at::kFloat));
  tokenmill_cpu::dispatch_float_types(q.scalar_type(), "cascade_prefix_attention", [&](auto* type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    auto run = [&](auto* cache_tag) {
      using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
      cascade_prefix_kernel<scalar_t, cache_t>(
          q.data_ptr<scalar_t>(), static_cast<const cache_t*>(k_cache.data_ptr()), static_cast<const cache_t*>(v_cache.data_ptr()),
          scales.k, scales.v, scales.stride, r, pb, o.data_ptr<float>(), lse.data_ptr<float>(), B, Hkv, H / Hkv, D, NB, BS,
          prefix_len, static_cast<float>(scale), rows_per_task > 0 ? rows_per_task : kCascadeRowsPerTask);
    };
    tokenmill_cpu::dispatch_kv_cache<scalar_t>(quantized, k_cache.scalar_type(), "cascade_prefix_attention", run);
  });
  return {o, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor first_rows, "
        "Tensor starts, Tensor lens, Tensor block_table, int window, float scale, int rows_per_task, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.def("cascade_prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor token_rows, Tensor prefix_blocks, "
        "int prefix_len, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int rows_per_task=0) -> (Tensor, Tensor)");
  m.impl("cascade_prefix_attention", c10::DispatchKey::CPU, &cascade_prefix_attention);
}

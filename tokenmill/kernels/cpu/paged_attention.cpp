// Decode attention straight from the paged, head-major KV cache (CPU).
//
// One query token per request attends to its request's context, read block by block through
// the block table: no gathered copy of the context is ever made. The work is split over
// (request, KV head) pairs; the G query heads that share a KV head are done together, so each
// K and V row is read once for all of them. Scores and softmax are float32.
//
// Built for the machine it runs on (-march=native, or TOKENMILL_CPU_MARCH): with AVX-512 or AVX2
// (vec.h's Vec, 16 or 8 lanes), bf16/fp16 rows are widened to float32 in registers and the dot
// products, V sums and exponentials run a vector at a time; without either, in scalar loops. With
// AVX512-BF16, a bf16 cache is not widened: both passes multiply bf16 pairs (qk_fixed's kPairs, pv_pairs).
//
// A quantized cache (tokenmill/layers/kv_quant.py) is read as it is stored: int8 rows with one
// float32 scale per (KV head, cache row), or fp8 (e4m3fn / e5m2) rows with one scale per tensor.
// Rows are widened to float32 in registers and the scale is applied once per row, not per
// element: to the dot product's sum for K (q . (s k) = s (q . k)), and to the probability for V
// (p (s v) = (p s) v). write_kv_quantized quantizes each new (token, head) row as it stores it.
//
// Cascade attention: given the decode tokens' attention over a prefix their contexts share
// (prefill_attention.cpp's cascade_prefix_attention: normalized partial outputs and log-sum-exps),
// each token attends only to the rest of its context, prefix_len .. position, and the two parts are
// merged by their log-sum-exps: out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2).
//
// Token trees (speculative decoding, Medusa/EAGLE): a tree node's query row sees the context before
// the tree and its ancestors in the tree only. A request's tree nodes sit in consecutive cache slots
// from tree_start[b] (the position after the tree's root); tree_mask[b] has bit j set when slot
// tree_start[b] + j is visible to row b (its ancestors and itself, so its depth is the mask's bit
// count and positions[b] = tree_start[b] - 1 + depth, the position RoPE saw). The row is computed as
// the plain decode at positions[b] of the chain through its ancestors: positions tree_start[b] ..
// positions[b] are read from the ancestors' slots in depth order (ContextRows' tail), so every sum
// runs over the same values in the same order as that chain's row, and a kept path's tokens are
// bit for bit what decoding without speculation computes (masking the other nodes' slots instead
// shifted the ancestors' lanes and bf16 pairs: SmolLM2's greedy output drifted in bf16). A row with
// mask 0 is a plain decode.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
constexpr int kMaxChunks = 256 / W;  // head sizes up to 256 take the vector paths
using tokenmill_cpu::load_kv;
using tokenmill_cpu::sum_quads;
#endif

// The scale of cache row `row` of a head: scales[row * stride] (stride 1: int8's per-row scales;
// stride 0: a per-tensor scale, or 1 for an unquantized cache).
struct RowScales {
  const float* scales;
  int64_t stride;
  float operator[](int64_t row) const { return scales[row * stride]; }
};

// For each of the G query heads of a KV head: out[g * out_stride] = (q_g . k) * ks. The key row is
// widened to float32 once for all G heads.
template <typename scalar_t>
inline void dot_heads(const float* q, const scalar_t* k, float ks, int64_t G, int64_t D, float* out, int64_t out_stride) {
#if TOKENMILL_SIMD
  if (D % W == 0 && D <= 256) {
    const int64_t chunks = D / W;
    Vec kv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load_kv(k + W * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      Vec s = Vec::load(qg) * kv[0];
      for (int64_t c = 1; c < chunks; ++c) s = fmadd(Vec::load(qg + W * c), kv[c], s);
      out[g * out_stride] = reduce_add(s) * ks;
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[g * D + d] * static_cast<float>(k[d]);
    out[g * out_stride] = s * ks;
  }
}

// For each of the G query heads: acc_g += (p[g * p_stride] * vs) * v, the value row widened once.
template <typename scalar_t>
inline void axpy_heads(float* acc, const float* p, int64_t p_stride, const scalar_t* v, float vs, int64_t G, int64_t D) {
#if TOKENMILL_SIMD
  if (D % W == 0 && D <= 256) {
    const int64_t chunks = D / W;
    Vec vv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) vv[c] = load_kv(v + W * c);
    for (int64_t g = 0; g < G; ++g) {
      const Vec pg = Vec::set1(p[g * p_stride] * vs);
      float* ag = acc + g * D;
      for (int64_t c = 0; c < chunks; ++c) store(ag + W * c, fmadd(pg, vv[c], Vec::load(ag + W * c)));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] += (p[g * p_stride] * vs) * static_cast<float>(v[d]);
}

// max(x[0..n)); std::max_element compiled to a scalar loop through memory, a quarter of the kernel's time.
inline float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if TOKENMILL_SIMD
  if (n >= W) {
    Vec vm = Vec::load(x);
    for (i = W; i + W <= n; i += W) vm = vmax(vm, Vec::load(x + i));
    m = reduce_max(vm);
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] := exp(x[i] - m); returns the sum.
inline float exp_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if TOKENMILL_SIMD
  const Vec mv = Vec::set1(m);
  Vec acc = Vec::zero();
  for (; i + W <= n; i += W) {
    const Vec e = vexp(Vec::load(x + i) - mv);
    store(x + i, e);
    acc = acc + e;
  }
  sum = reduce_add(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

// f(cache row, position) for positions first .. len-1, walking the block table block by block
// (a division per token cost more than the dot products), and asking for the block kPrefetchBlocks
// further on (its BS rows of D values from `head`) as each block starts. Blocks lie anywhere in the
// cache, so the hardware prefetchers cannot run ahead of a block's end; in the engine, where a
// layer's K and V have left the caches by its next step, this took SmolLM2's decode attention at
// 32 x ~190 tokens from 231 to 206 us a layer (bf16) and 199 to 160 (int8), at 64 x 1,000 from 722 to
// 660 and 505 to 438 (per-step alternation in one engine run). The block goes to L2, not L1
// (prefetcht1): a block's 32 or more lines asked for at once into L1 take its few miss buffers from the
// loads that need data now. SmolLM2's 30 layers of bf16 cache, both builds loaded in one process and
// alternated 25 times, Zen 4: 32 x 190 tokens 331-367 -> 282-303 us a layer (1.21x; blocks in random
// order 1.23-1.25x), 64 x 1,000 1.19-1.34x; to L3 only (prefetcht2) the same, non-temporal no gain,
// 3 or 4 blocks ahead within 5% of 2.
//
// An unquantized cache goes further: each pass asks for the whole pass that comes after it (NextPass),
// a row of it with each row it reads, so memory streams without a pause through the softmax, the passes'
// starts and the tasks' ends, and every pass but a thread's first reads from L2. The QK pass asks for
// the task's V rows, the PV pass for the next task's K rows (tasks are claimed one ahead). Its block
// prefetch is then not needed. Both builds in one process, alternated 25 times over SmolLM2's 30 layers
// of cache for 32 requests (Zen 4, five runs): bf16 at 190 tokens 250 -> 209 us a layer (1.16-1.21x;
// blocks in random order 1.16-1.21x), at 1,000 tokens 1.04-1.11x; float32 1.24-1.27x and 1.13-1.28x;
// the AVX2 build's float32 1.22x and 1.06x. Only with four tasks or more a thread (decode_kernel's
// pass_ahead); one request keeps the block prefetch (0.98-0.99x, the same code but for a test a row). A
// quantized cache keeps it too: its kernel waits on its widening and FMAs, not memory, and the extra
// prefetches cost it (int8 at 1,000 tokens 0.91x).
constexpr int64_t kPrefetchBlocks = 2;

// Where a row's context positions lie in the cache: position t in block blocks[t / BS] at t % BS,
// except a token-tree node's last positions, from tail_start on, which are its ancestors' slots:
// cache row tail_rows[t - tail_start] (see the top).
struct ContextRows {
  const int64_t* blocks;
  int64_t BS;
  int64_t tail_start = std::numeric_limits<int64_t>::max();
  const int64_t* tail_rows = nullptr;
};

// The pass that will follow this one, to be asked for into L2 while this one runs: the paged blocks
// first_block .. last_block of its block table, in its head's rows (head nullptr: none).
template <typename T>
struct NextPass {
  const T* head = nullptr;
  const int64_t* blocks = nullptr;
  int64_t first_block = 0, last_block = -1;
};

template <typename T, typename F>
inline void for_each_row(int64_t first, int64_t len, const ContextRows& where, const T* head, int64_t D, F&& f,
                         const NextPass<T>& next = {}) {
  const int64_t* blocks = where.blocks;
  const int64_t BS = where.BS, paged_len = std::min(len, where.tail_start);
  const int64_t last_block = (paged_len - 1) / BS, row_bytes = D * static_cast<int64_t>(sizeof(T)), block_bytes = BS * row_bytes;
  const auto prefetch_block = [&](const T* block) {
    const char* from = reinterpret_cast<const char*>(block);
    for (int64_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(from + off, 0, 2);
  };
  int64_t next_block = next.first_block;  // the next pass's block asked for beside this pass's block i
  for (int64_t i = first / BS, t = first; t < paged_len; ++i) {
    const int64_t base = blocks[i] * BS - i * BS;  // cache row of position t is base + t
    const int64_t stop = std::min(paged_len, (i + 1) * BS);
    const char* to = nullptr;  // the next pass's rows beside this block's: row t % BS with row t, a few lines at a time
    if (next.head == nullptr) {
      if (i + kPrefetchBlocks <= last_block) prefetch_block(head + blocks[i + kPrefetchBlocks] * BS * D);
    } else if (next_block <= next.last_block) {
      to = reinterpret_cast<const char*>(next.head + (next.blocks[next_block++] * BS - i * BS) * D);
    }
    for (; t < stop; ++t) {  // f in one place: inlined once (three copies of a pass's body slowed the int8 one 5-10%)
      if (to != nullptr)
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(to + t * row_bytes + off, 0, 2);
      f(base + t, t);
    }
  }
  for (int64_t t = std::max(first, paged_len); t < len; ++t) f(where.tail_rows[t - where.tail_start], t);
  if (next.head != nullptr)  // the rest of a next pass longer than this one
    for (; next_block <= next.last_block; ++next_block) prefetch_block(next.head + next.blocks[next_block] * BS * D);
}

#if TOKENMILL_SIMD
// The two passes with G and D known at compile time, so that the query heads' vectors (QK) and the
// accumulators (PV) stay in registers: the generic loops kept them in memory, a load and a store
// around every FMA.
//
// The scores are summed W positions at a time: each row's G products are vectors of partial sums,
// which sum4_per_lane folds four rows at a time and sum_quads turns into a vector of W scores, where
// one horizontal sum per row and head (reduce_add) was most of the pass. One layer of SmolLM2 (9 / 3
// heads of 64), AVX-512, median of 7, against that row-at-a-time loop: int8 at 64 x 1,024 tokens 0.95
// -> 0.79 ms, at 32 x 192 0.093 -> 0.077; bf16 (with the block prefetch of for_each_row) 1.03 -> 0.88
// and 0.099 -> 0.089; float32 2.16 -> 2.07 and 0.112 -> 0.107; the AVX2 build's float32 the same within
// 4% (2.58 / 2.57, 0.157 / 0.163), its int8 1.41 -> 1.34 ms.
#if TOKENMILL_BF16_PAIRS
using tokenmill_cpu::dp_bf16;
using tokenmill_cpu::load_bf16_pairs;
// bf16 queries over a bf16 cache multiply by pairs of elements with vdpbf16ps: the query as the model
// gave it (the softmax scale multiplies the scores), the K rows as stored, no widening; the PV pass
// pairs consecutive positions (their probabilities rounded to bf16, as PyTorch's CPU attention and
// HF's eager attention round P to the values' dtype) against V rows interleaved by pairs. SmolLM2's
// heads, 30 layers' caches (out of the CPU caches), Zen 5, 2 threads, against the float32 passes:
// 32 x 190 tokens 210 -> 195 us a layer, 64 x 1,000 2,435 -> 2,109, 114 x 400 1,813 -> 1,600; with
// the caches in L3 95 -> 83 us (the step is mostly waiting for the blocks).
#endif

// kPairs (bf16 only): vdpbf16ps on the raw bf16 query q_bf16 (scaled after, by `scale`) and K rows; else
// fused multiply-adds on the scaled float32 query qf and K rows widened to float32.
template <typename scalar_t, int G, int NC, bool kPairs>
void qk_fixed(const float* qf, const void* q_bf16, float scale, const scalar_t* k_head, RowScales ks, const ContextRows& where,
              int64_t first, int64_t len, float* scores, int64_t n, const NextPass<scalar_t>& next) {
  constexpr int D = W * NC;
  constexpr int QV = kPairs ? NC / 2 : NC;  // vectors per row: 32 bf16 in pairs, or 16 float32
  Vec qv[G][QV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < QV; ++c) {
#if TOKENMILL_BF16_PAIRS
      if constexpr (kPairs) {
        qv[g][c] = load_bf16_pairs(static_cast<const c10::BFloat16*>(q_bf16) + g * D + 2 * W * c);
        continue;
      }
#endif
      qv[g][c] = Vec::load(qf + g * D + W * c);
    }
  const auto dot = [&](const Vec (&kv)[QV], int g) {
#if TOKENMILL_BF16_PAIRS
    if constexpr (kPairs) {
      Vec s = dp_bf16(Vec::zero(), qv[g][0], kv[0]);
      for (int c = 1; c < QV; ++c) s = dp_bf16(s, qv[g][c], kv[c]);
      return s;
    }
#endif
    Vec s = qv[g][0] * kv[0];
    for (int c = 1; c < QV; ++c) s = fmadd(qv[g][c], kv[c], s);
    return s;
  };
  const auto widen = [](const scalar_t* k, Vec (&kv)[QV]) {
#if TOKENMILL_BF16_PAIRS
    if constexpr (kPairs) {
      for (int c = 0; c < QV; ++c) kv[c] = load_bf16_pairs(k + 2 * W * c);
      return;
    }
#endif
    for (int c = 0; c < QV; ++c) kv[c] = load_kv(k + W * c);
  };
  const float score_scale = kPairs ? scale : 1.f;
  const scalar_t* rows[W];
  alignas(64) float row_scale[W];
  alignas(64) float quad_sums[G][W / 4][W];
  int fill = 0;
  for_each_row(first, len, where, k_head, D, [&](int64_t row, int64_t t) {
    rows[fill] = k_head + row * D;
    row_scale[fill] = ks[row] * score_scale;
    if (++fill % 4 != 0) return;
    Vec s[G][4];
    for (int r = 0; r < 4; ++r) {
      Vec kv[QV];  // widened once for the G heads
      widen(rows[fill - 4 + r], kv);
      for (int g = 0; g < G; ++g) s[g][r] = dot(kv, g);
    }
    for (int g = 0; g < G; ++g) store(quad_sums[g][fill / 4 - 1], sum4_per_lane(s[g][0], s[g][1], s[g][2], s[g][3]));
    if (fill == W) {
      const Vec scale = Vec::load(row_scale);
      for (int g = 0; g < G; ++g) store(scores + g * n + (t + 1 - W - first), sum_quads(&quad_sums[g][0][0]) * scale);
      fill = 0;
    }
  }, next);
  for (int i = 0; i < fill; ++i) {  // the last rows, at positions len - fill ..
    Vec kv[QV];
    widen(rows[i], kv);
    for (int g = 0; g < G; ++g) scores[g * n + (len - fill + i - first)] = reduce_add(dot(kv, g)) * row_scale[i];
  }
}

// Chunks of the head the PV pass accumulates per walk over the context: all NC when the G * NC
// accumulators and the NC value chunks fit the ISA's registers, else the largest divisor of NC
// that fits (AVX2 has 16 registers: D = 64 is 8 chunks there, 24 accumulators for G = 3). Each
// walk then reads its slice of every V row, from L1/L2 after the first.
template <int G, int NC>
constexpr int pv_panel() {
  int p = NC;
  while (p > 1 && (NC % p != 0 || (G + 1) * p > Vec::kRegisters - 2)) --p;
  return p;
}

template <typename scalar_t, int G, int NC>
void pv_fixed(const float* scores, int64_t n, const scalar_t* v_head, RowScales vs, const ContextRows& where, int64_t first,
              int64_t len, float* out, const NextPass<scalar_t>& next) {
  constexpr int D = W * NC;
  constexpr int P = pv_panel<G, NC>();
  for (int c0 = 0; c0 < NC; c0 += P) {
    Vec acc[G][P];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) acc[g][c] = Vec::zero();
    for_each_row(first, len, where, v_head, D, [&](int64_t row, int64_t t) {
      const scalar_t* v = v_head + row * D + W * c0;
      Vec vv[P];
      for (int c = 0; c < P; ++c) vv[c] = load_kv(v + W * c);
      const float scale = vs[row];
      for (int g = 0; g < G; ++g) {
        const Vec p = Vec::set1(scores[g * n + (t - first)] * scale);
        for (int c = 0; c < P; ++c) acc[g][c] = fmadd(p, vv[c], acc[g][c]);
      }
    }, c0 == 0 ? next : NextPass<scalar_t>{});  // later walks read from L2
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) store(out + g * D + W * (c0 + c), acc[g][c]);
  }
}

#if TOKENMILL_BF16_PAIRS
// P (normalized, float32 [G][n]) as bf16 pairs of consecutive positions, [G][ceil(n / 2)]; an odd
// n's last pair has a zero second.
inline void pair_probabilities(const float* p, int64_t G, int64_t n, uint32_t* p2) {
  const int64_t pairs = (n + 1) / 2;
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * n;
    uint32_t* out = p2 + g * pairs;
    int64_t i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {  // 32 values: cvtne2ps gives them in order, which are the pairs
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(pg + i + W), _mm512_loadu_ps(pg + i));
      _mm512_storeu_si512(out + i / 2, both);
    }
    for (; i < n; i += 2) {
      const c10::BFloat16 a(pg[i]), b(i + 1 < n ? pg[i + 1] : 0.f);  // c10's rounding: to nearest even, as cvtne2ps
      out[i / 2] = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(b.x) << 16);
    }
  }
}

// acc[g] = sum over positions of P[g][t] * V[t] (unquantized bf16 cache), two positions per vdpbf16ps:
// their V rows interleaved by pairs, their probabilities a broadcast bf16 pair (p2, pair_probabilities).
template <int G, int NC>
void pv_pairs(const uint32_t* p2, int64_t n, const c10::BFloat16* v_head, const ContextRows& where, int64_t first,
              int64_t len, float* out, const NextPass<c10::BFloat16>& next) {
  constexpr int D = W * NC;
  const int64_t pairs = (n + 1) / 2;
  Vec acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = Vec::zero();
  const c10::BFloat16* pending = nullptr;
  const auto add_pair = [&](const c10::BFloat16* a, const c10::BFloat16* b, int64_t i) {
    Vec vv[NC];  // element c of the pair of rows: (a[c], b[c])
    for (int c = 0; c < NC; c += 2) tokenmill_cpu::interleave_bf16(a + W * c, b + W * c, vv[c], vv[c + 1]);
    for (int g = 0; g < G; ++g) {
      const Vec pk = tokenmill_cpu::broadcast_pair(p2[g * pairs + i]);
      for (int c = 0; c < NC; ++c) acc[g][c] = dp_bf16(acc[g][c], pk, vv[c]);
    }
  };
  for_each_row(first, len, where, v_head, D, [&](int64_t row, int64_t t) {
    const c10::BFloat16* v = v_head + row * D;
    if (((t - first) & 1) == 0) {
      pending = v;
    } else {
      add_pair(pending, v, (t - first) / 2);
      pending = nullptr;
    }
  }, next);
  if (pending != nullptr) add_pair(pending, pending, (n - 1) / 2);  // its partner's probability is 0
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) store(out + g * D + W * c, acc[g][c]);
}
#endif

template <typename scalar_t>
using QkFn = void (*)(const float*, const void*, float, const scalar_t*, RowScales, const ContextRows&, int64_t, int64_t,
                      float*, int64_t, const NextPass<scalar_t>&);
template <typename scalar_t>
using PvFn = void (*)(const float*, int64_t, const scalar_t*, RowScales, const ContextRows&, int64_t, int64_t, float*,
                      const NextPass<scalar_t>&);

// The fixed-size passes for G query heads per KV head (1 to 8) and NC vector chunks per head.
template <typename scalar_t, int NC, int G = 1>
void pick_fixed(int64_t g, QkFn<scalar_t>& qk, PvFn<scalar_t>& pv) {
  if (g == G) {
    qk = &qk_fixed<scalar_t, G, NC, false>;
    pv = &pv_fixed<scalar_t, G, NC>;
  } else if constexpr (G < 8) {
    pick_fixed<scalar_t, NC, G + 1>(g, qk, pv);
  }
}
#endif

#if TOKENMILL_BF16_PAIRS
using PvPairsFn = void (*)(const uint32_t*, int64_t, const c10::BFloat16*, const ContextRows&, int64_t, int64_t, float*,
                           const NextPass<c10::BFloat16>&);

// The bf16 pairs' passes for G query heads per KV head (1 to 8) and NC float32 vectors per head.
template <int NC, int G = 1>
void pick_pairs(int64_t g, QkFn<c10::BFloat16>& qk, PvPairsFn& pv) {
  if (g == G) {
    qk = &qk_fixed<c10::BFloat16, G, NC, true>;
    pv = &pv_pairs<G, NC>;
  } else if constexpr (G < 8) {
    pick_pairs<NC, G + 1>(g, qk, pv);
  }
}
#endif

// scalar_t: the query's and output's dtype; cache_t: the cache's (scalar_t, or int8 / fp8 with scales).
template <typename scalar_t, typename cache_t>
void decode_kernel(
    const scalar_t* q,            // [T, Hkv * G, D], rows q_stride apart (heads contiguous within a row)
    int64_t q_stride,
    const cache_t* k_cache,       // [Hkv, NB, BS, D]
    const cache_t* v_cache,       // [Hkv, NB, BS, D]
    const float* k_scale,         // int8: [Hkv, NB, BS]; fp8 or unquantized: one value (scale_stride 0)
    const float* v_scale,
    int64_t scale_stride,         // 1: a scale per cache row; 0: one per tensor
    const int64_t* token_rows,    // [B] row of each request's query token in q / out
    const int64_t* block_table,   // [B, MB]
    const int64_t* positions,     // [B] position of the query token; the context is 0..position
    const int64_t* tree_start,    // [B] first tree slot of each row, or nullptr (no trees)
    const int64_t* tree_mask,     // [B] visible tree slots (bit j: slot tree_start + j); 0: not a tree node
    scalar_t* out,                // [T, Hkv * G, D]
    int64_t B, int64_t Hkv, int64_t G, int64_t D, int64_t NB, int64_t BS, int64_t MB,
    int64_t window, float scale,
    int64_t prefix_len = 0,              // > 0: cascade; positions before it are in prefix_o / prefix_lse
    const float* prefix_o = nullptr,     // [B, Hkv * G, D] normalized attention over the shared prefix
    const float* prefix_lse = nullptr) { // [B, Hkv * G] its log-sum-exp
  // Tasks are handed out one at a time from a shared counter: contexts differ in length, and
  // parallel_for's static halves left one thread idle while the other finished the long ones.
  std::atomic<int64_t> next_task{0};
  const int64_t num_tasks = B * Hkv;
#if TOKENMILL_SIMD
  QkFn<cache_t> qk = nullptr;
  PvFn<cache_t> pv = nullptr;
  if (D == 64) pick_fixed<cache_t, 64 / W>(G, qk, pv);
  if (D == 128) pick_fixed<cache_t, 128 / W>(G, qk, pv);
#endif
#if TOKENMILL_BF16_PAIRS
  PvPairsFn pv_bf16 = nullptr;  // set: both passes multiply bf16 pairs (qk is the pairs' one)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (D == 64) pick_pairs<64 / W>(G, qk, pv_bf16);
    if (D == 128) pick_pairs<128 / W>(G, qk, pv_bf16);
  }
#endif
  // The first context position a request's query attends to (after a shared prefix, or in its window).
  const auto first_position = [&](int64_t b) -> int64_t {
    return prefix_len > 0 ? prefix_len : window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0;
  };
  // The paged blocks of a request's pass over head h's rows of a cache (a tree node's ancestors aside).
  const auto pass_of = [&](const cache_t* cache, int64_t b, int64_t h, int64_t paged_len) {
    const int64_t first = first_position(b);
    return NextPass<cache_t>{cache + h * NB * BS * D, block_table + b * MB, first / BS, paged_len > first ? (paged_len - 1) / BS : -1};
  };
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  // Each pass asks for the next one (see kPrefetchBlocks): an unquantized cache, and tasks enough per
  // thread. Claiming a task ahead can leave a thread idle while another holds two (one request's 2 KV
  // heads on 2 threads ran one after the other: 0.57-0.82x), and a thread's first pass, which nothing
  // asked for, goes without the block prefetch (at one task a thread, 0.90x at 1,000 tokens).
  const bool pass_ahead = std::is_same_v<cache_t, scalar_t> && num_tasks >= 4 * num_threads;
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(G * D), acc(G * D), scores, lse(G);
    std::vector<uint32_t> p2;  // P as bf16 pairs (pv_bf16)
    int64_t ancestor_rows[64];  // a tree node's ancestors' cache rows, root's child first
    // With pass_ahead, the next task is claimed ahead: its K rows are asked for during this task's PV pass.
    int64_t task = next_task.fetch_add(1, std::memory_order_relaxed);
    while (task < num_tasks) {
      const int64_t following = pass_ahead ? next_task.fetch_add(1, std::memory_order_relaxed) : num_tasks;
      const int64_t b = task / Hkv, h = task % Hkv;
      const uint64_t mask = tree_mask != nullptr ? static_cast<uint64_t>(tree_mask[b]) : 0;
      const int64_t len = positions[b] + 1, first = first_position(b), n = len - first;
      scores.resize(G * n);
      const scalar_t* qrow = q + token_rows[b] * q_stride + h * G * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qrow[i]) * scale;
      const cache_t* k_head = k_cache + h * NB * BS * D;
      const cache_t* v_head = v_cache + h * NB * BS * D;
      const RowScales ks{k_scale + scale_stride * h * NB * BS, scale_stride};
      const RowScales vs{v_scale + scale_stride * h * NB * BS, scale_stride};
      const int64_t* blocks = block_table + b * MB;
      ContextRows where{blocks, BS};
      if (mask) {  // a tree node: its ancestors' slots (and its own), in depth order, are its last positions
        int depth = 0;
        for (uint64_t m = mask; m; m &= m - 1) {
          const int64_t slot = tree_start[b] + __builtin_ctzll(m);
          ancestor_rows[depth++] = blocks[slot / BS] * BS + slot % BS;
        }
        where.tail_start = len - depth;
        where.tail_rows = ancestor_rows;
      }
      NextPass<cache_t> v_pass, next_k_pass;  // what the QK pass and the PV pass ask for ahead
      if (pass_ahead) {
        v_pass = pass_of(v_cache, b, h, std::min(len, where.tail_start));
        if (following < num_tasks) next_k_pass = pass_of(k_cache, following / Hkv, following % Hkv, positions[following / Hkv] + 1);
      }

#if TOKENMILL_SIMD
      if (qk != nullptr) {
        qk(qf.data(), qrow, scale, k_head, ks, where, first, len, scores.data(), n, v_pass);
      } else
#endif
      {
        for_each_row(first, len, where, k_head, D, [&](int64_t row, int64_t t) {
          dot_heads(qf.data(), k_head + row * D, ks[row], G, D, scores.data() + (t - first), n);
        }, v_pass);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = row_max(sg, n), sum = exp_sum(sg, n, m), inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
        lse[g] = m + std::log(sum);
      }
#if TOKENMILL_BF16_PAIRS
      if (pv_bf16 != nullptr) {
        p2.resize(G * ((n + 1) / 2));
        pair_probabilities(scores.data(), G, n, p2.data());
        if constexpr (std::is_same_v<cache_t, c10::BFloat16>) pv_bf16(p2.data(), n, v_head, where, first, len, acc.data(), next_k_pass);
      } else
#endif
#if TOKENMILL_SIMD
      if (pv != nullptr) {
        pv(scores.data(), n, v_head, vs, where, first, len, acc.data(), next_k_pass);
      } else
#endif
      {
        std::fill(acc.begin(), acc.end(), 0.f);
        for_each_row(first, len, where, v_head, D, [&](int64_t row, int64_t t) {
          axpy_heads(acc.data(), scores.data() + (t - first), n, v_head + row * D, vs[row], G, D);
        }, next_k_pass);
      }
      if (prefix_len > 0) {  // merge with the prefix's part, weighted by each part's softmax mass
        const float* po = prefix_o + (b * Hkv + h) * G * D;
        const float* plse = prefix_lse + (b * Hkv + h) * G;
        for (int64_t g = 0; g < G; ++g) {
          const float mx = std::max(plse[g], lse[g]);
          const float w1 = std::exp(plse[g] - mx), w2 = std::exp(lse[g] - mx), inv = 1.f / (w1 + w2);
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] = (w1 * po[g * D + d] + w2 * acc[g * D + d]) * inv;
        }
      }
      scalar_t* orow = out + (token_rows[b] * Hkv + h) * G * D;
      for (int64_t i = 0; i < G * D; ++i) orow[i] = static_cast<scalar_t>(acc[i]);
      task = pass_ahead ? following : next_task.fetch_add(1, std::memory_order_relaxed);
    }
  });
}

// out[token_rows] = attention of q[token_rows] over each request's paged context; other rows untouched.
// k_scale / v_scale: given with a quantized (int8 / fp8) cache, absent with a cache in q's dtype.
void paged_decode_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& token_rows, const at::Tensor& block_table, const at::Tensor& positions,
    int64_t window, double scale, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    int64_t prefix_len, const std::optional<at::Tensor>& prefix_o, const std::optional<at::Tensor>& prefix_lse,
    const std::optional<at::Tensor>& tree_start, const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.size(1) == q.size(1) && out.size(2) == q.size(2),
              "q and out must be [T, H, D] with the same H and D");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [Hkv, blocks, block_size, D]");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "out and the caches must be contiguous");
  // q's rows may lie apart (decode_attention_block's view into qkv); its heads must follow each other within a row.
  const at::Tensor qr = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  const bool quantized = k_scale.has_value();
  TORCH_CHECK(quantized == v_scale.has_value(), "paged_decode_attention: give both k_scale and v_scale or neither");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (quantized || k_cache.scalar_type() == q.scalar_type()),
              "q, out and the caches must share a dtype (or the caches be quantized, with scales)");
  TORCH_CHECK(token_rows.scalar_type() == at::kLong && block_table.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong, "index tensors must be int64");
  const auto rows = token_rows.contiguous(), table = block_table.contiguous(), pos = positions.contiguous();
  const int64_t B = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % Hkv == 0, "head sizes of q and the caches disagree");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && pos.size(0) == B, "block_table / positions must have a row per request");
  const int64_t* pos_of = pos.data_ptr<int64_t>();
  if (prefix_len > 0) {
    TORCH_CHECK(window == 0, "paged_decode_attention: a shared prefix (cascade) does not go with a sliding window");
    TORCH_CHECK(prefix_o.has_value() && prefix_lse.has_value() && prefix_o->scalar_type() == at::kFloat &&
                    prefix_lse->scalar_type() == at::kFloat && prefix_o->is_contiguous() && prefix_lse->is_contiguous() &&
                    prefix_o->sizes() == at::IntArrayRef({B, H, D}) && prefix_lse->sizes() == at::IntArrayRef({B, H}),
                "paged_decode_attention: a shared prefix needs prefix_o [B, H, D] and prefix_lse [B, H], contiguous float32");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(pos_of[b] >= prefix_len, "paged_decode_attention: every decode token must come after the shared prefix");
  }
  TORCH_CHECK(tree_start.has_value() == tree_mask.has_value(), "paged_decode_attention: give both tree_start and tree_mask or neither");
  at::Tensor t_start, t_mask;
  if (tree_start.has_value()) {
    t_start = tree_start->contiguous();
    t_mask = tree_mask->contiguous();
    TORCH_CHECK(t_start.scalar_type() == at::kLong && t_mask.scalar_type() == at::kLong && t_start.dim() == 1 &&
                    t_mask.dim() == 1 && t_start.size(0) == B && t_mask.size(0) == B,
                "tree_start / tree_mask must be int64 [B], a value per query row");
    const int64_t* ts = t_start.data_ptr<int64_t>();
    const int64_t* tm = t_mask.data_ptr<int64_t>();
    const int64_t* ps = pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {  // a tree node's slots lie in its block table's range, its depth bits before its position
      const uint64_t m = static_cast<uint64_t>(tm[b]);
      TORCH_CHECK(m == 0 || (ts[b] >= 1 && ts[b] + 64 - __builtin_clzll(m) <= table.size(1) * BS),
                  "paged_decode_attention: a tree row's slots must follow its context, within its block table");
      TORCH_CHECK(m == 0 || ts[b] - 1 + __builtin_popcountll(m) == ps[b],
                  "paged_decode_attention: a tree row's position must be tree_start - 1 + its depth (its mask's bit count)");
    }
  }
  const auto scales = tokenmill_cpu::kv_scale_pointers(k_cache, k_scale, v_scale, "paged_decode_attention");
  tokenmill_cpu::dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto* type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    auto run = [&](auto* cache_tag) {
      using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
      decode_kernel<scalar_t, cache_t>(
          qr.data_ptr<scalar_t>(), qr.stride(0), k_cache.data_ptr<cache_t>(), v_cache.data_ptr<cache_t>(), scales.k, scales.v,
          scales.stride, rows.data_ptr<int64_t>(), table.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
          t_start.defined() ? t_start.data_ptr<int64_t>() : nullptr, t_mask.defined() ? t_mask.data_ptr<int64_t>() : nullptr,
          out.data_ptr<scalar_t>(), B, Hkv, H / Hkv, D, NB, BS, table.size(1), window, static_cast<float>(scale), prefix_len,
          prefix_len > 0 ? prefix_o->data_ptr<float>() : nullptr, prefix_len > 0 ? prefix_lse->data_ptr<float>() : nullptr);
    };
    tokenmill_cpu::dispatch_kv_cache<scalar_t>(quantized, k_cache.scalar_type(), "paged_decode_attention", run);
  });
}

// k_cache[h, slot_mapping[t]] := k[t, h] and the same for V, for every new token t and KV head h.
// index_copy_ into the flattened cache did this at a few hundred MB/s (1.7 ms per layer for a
// 2,048-token chunk); these are plain row copies.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [Hkv, blocks, block_size, D]");
  const int64_t Hkv = k_cache.size(0), slots = k_cache.size(1) * k_cache.size(2), D = k_cache.size(3);
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == Hkv && x->size(2) == D && x->stride(2) == 1 && x->stride(1) == D,
                "k/v must be [T, Hkv, D] with contiguous heads");
    TORCH_CHECK(x->scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                "k/v and the caches must share a dtype");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  v.size(0) == k.size(0), "slot_mapping must be int64 [T]");
  const auto slot = slot_mapping.contiguous();
  const int64_t* slot_of = slot.data_ptr<int64_t>();
  const int64_t T = k.size(0), elem = k.element_size(), row_bytes = D * elem;
  char* caches[2] = {static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr())};
  const char* news[2] = {static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr())};
  const int64_t strides[2] = {k.stride(0) * elem, v.stride(0) * elem};
  // Rows that are whole, aligned cache lines go out as streaming stores: a decode step writes one
  // row per request and head into lines nobody has in cache, and a normal store would read each
  // line from memory first.
  bool stream = false;
#if TOKENMILL_SIMD
  stream = row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(caches[0]) % 64 == 0 && reinterpret_cast<uintptr_t>(caches[1]) % 64 == 0;
#endif
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(slot_of[t] >= 0 && slot_of[t] < slots, "write_kv: slot out of range");
      for (int c = 0; c < 2; ++c)
        for (int64_t h = 0; h < Hkv; ++h) {
          char* dst = caches[c] + (h * slots + slot_of[t]) * row_bytes;
          const char* src = news[c] + t * strides[c] + h * row_bytes;
#if TOKENMILL_SIMD
          if (stream) {
            for (int64_t off = 0; off < row_bytes; off += 64) tokenmill_cpu::stream_line(dst + off, src + off);
            continue;
          }
#endif
          std::memcpy(dst, src, row_bytes);
        }
    }
#if TOKENMILL_SIMD
    if (stream) tokenmill_cpu::stream_fence();  // the streamed rows are visible before attention reads them
#endif
  });
}

// One (token, head) row of D values into a quantized cache row, as tokenmill/layers/kv_quant.py's
// quantize does (the same float32 operations, so the bytes and scales match it exactly).
// int8: scale = max(max|x| * (1/127), 1e-10), q = round-half-even(x / scale) in [-127, 127].
template <typename scalar_t>
inline void quantize_row_int8(const scalar_t* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float s = std::max(amax * (1.f / 127.f), 1e-10f);
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::nearbyint(static_cast<float>(x[d]) / s);
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  *scale = s;
}

// fp8: x / scale clamped to the format's finite range, rounded to nearest even (c10's conversion, as torch's .to()).
template <typename scalar_t, typename fp8_t>
inline void quantize_row_fp8(const scalar_t* x, int64_t D, fp8_t* q, float scale) {
  const float limit = static_cast<float>(std::numeric_limits<fp8_t>::max());
  for (int64_t d = 0; d < D; ++d) {
    const float y = static_cast<float>(x[d]) / scale;
    q[d] = static_cast<fp8_t>(std::min(limit, std::max(-limit, y)));
  }
}

// write_kv into a quantized cache: each new (token, head) row of k / v quantized into its slot;
// int8 also writes the row's scale to k_scale / v_scale [Hkv, blocks, block_size] at the same slot.
void write_kv_quantized(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "caches must be contiguous [Hkv, blocks, block_size, D] of one dtype");
  const int64_t scale_stride = tokenmill_cpu::check_kv_scales(k_cache, k_scale, v_scale, "write_kv_quantized");
  const int64_t Hkv = k_cache.size(0), slots = k_cache.size(1) * k_cache.size(2), D = k_cache.size(3);
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(1) == Hkv && x->size(2) == D && x->stride(2) == 1 && x->stride(1) == D &&
                    x->scalar_type() == k.scalar_type(),
                "k/v must be [T, Hkv, D] of one dtype with contiguous heads");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  v.size(0) == k.size(0), "slot_mapping must be int64 [T]");
  const auto slot = slot_mapping.contiguous();
  const int64_t* slot_of = slot.data_ptr<int64_t>();
  const int64_t T = k.size(0);
  float* scales[2] = {k_scale.data_ptr<float>(), v_scale.data_ptr<float>()};
  tokenmill_cpu::dispatch_float_types(k.scalar_type(), "write_kv_quantized", [&](auto* type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    const scalar_t* news[2] = {k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    const int64_t strides[2] = {k.stride(0), v.stride(0)};
    tokenmill_cpu::dispatch_quantized_cache(k_cache.scalar_type(), "write_kv_quantized", [&](auto* cache_tag) {
      using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
      cache_t* caches[2] = {k_cache.data_ptr<cache_t>(), v_cache.data_ptr<cache_t>()};
      at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          TORCH_CHECK(slot_of[t] >= 0 && slot_of[t] < slots, "write_kv_quantized: slot out of range");
          for (int c = 0; c < 2; ++c)
            for (int64_t h = 0; h < Hkv; ++h) {
              const int64_t row = h * slots + slot_of[t];
              const scalar_t* src = news[c] + t * strides[c] + h * D;
              if constexpr (std::is_same_v<cache_t, int8_t>) {
                quantize_row_int8(src, D, caches[c] + row * D, scales[c] + row * scale_stride);
              } else {
                quantize_row_fp8(src, D, caches[c] + row * D, scales[c][0]);
              }
            }
        }
      });
    });
  });
}

// A layer's attention for a batch of plain decodes, from its fused QKV projection's output qkv [T, (H + 2 Hkv) D]:
// rotary on q and k (in place, pointwise.cpp's op), the new K/V written to their slots (quantized for a quantized
// cache), then paged_decode_attention (a token tree's rows with tree_start / tree_mask); returns [T, H D]. One
// call where the model made six (a split, rotary, write_kv, an empty output, the attention), each a Python-to-C++
// dispatch of ~1-2 us (the decode program, models/llama.py).
at::Tensor decode_attention_block(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor k_cache, at::Tensor v_cache, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, const at::Tensor& slot_mapping, const at::Tensor& token_rows,
                                  const at::Tensor& block_table, const at::Tensor& positions, int64_t window, double scale,
                                  const std::optional<at::Tensor>& tree_start, const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK(k_cache.dim() == 4, "decode_attention_block: caches must be [Hkv, blocks, block_size, D]");
  const int64_t T = qkv.size(0), H = num_heads, Hkv = num_kv_heads, D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * Hkv) * D && k_cache.size(0) == Hkv,
              "decode_attention_block: qkv must be [T, (H + 2 Hkv) D] with contiguous rows, matching the cache's heads");
  TORCH_CHECK(k_scale.has_value() || k_cache.scalar_type() == qkv.scalar_type(),
              "decode_attention_block: an unquantized cache must be in q's dtype");
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  const at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  static const auto rotary = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("tokenmill_cpu::rotary", "")
                                 .typed<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&)>();
  rotary.call(q, k, cos, sin);
  if (k_scale.has_value())
    write_kv_quantized(k_cache, v_cache, *k_scale, *v_scale, k, v, slot_mapping);
  else
    write_kv(k_cache, v_cache, k, v, slot_mapping);
  at::Tensor out = at::empty({T, H, D}, qkv.options());
  // q is read where it lies in qkv's rows, not copied out first: SmolLM2's block at 32 rows x 190 tokens, both builds
  // alternated in one process, 1.01-1.03x (the same outputs).
  paged_decode_attention(out, q, k_cache, v_cache, token_rows, block_table, positions, window, scale, k_scale, v_scale, 0,
                         std::nullopt, std::nullopt, tree_start, tree_mask);
  return out.view({T, H * D});
}

// "avx512", "avx2" or "scalar": the vector code this build runs (vec.h).
std::string vector_isa() { return tokenmill_cpu::vector_isa(); }

}  // namespace

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("vector_isa() -> str", &vector_isa);
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor token_rows, "
        "Tensor block_table, Tensor positions, int window, float scale, Tensor? k_scale=None, Tensor? v_scale=None, "
        "int prefix_len=0, Tensor? prefix_o=None, Tensor? prefix_lse=None, Tensor? tree_start=None, Tensor? tree_mask=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.def("write_kv_quantized(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor k, Tensor v, "
        "Tensor slot_mapping) -> ()");
  m.impl("write_kv_quantized", c10::DispatchKey::CPU, &write_kv_quantized);
  m.def("decode_attention_block(Tensor(a!) qkv, int num_heads, int num_kv_heads, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor slot_mapping, Tensor token_rows, Tensor block_table, "
        "Tensor positions, int window, float scale, Tensor? tree_start=None, Tensor? tree_mask=None) -> Tensor");
  m.impl("decode_attention_block", c10::DispatchKey::CPU, &decode_attention_block);
}

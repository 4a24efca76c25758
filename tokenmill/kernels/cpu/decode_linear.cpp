// Linear layers for the few rows of a decode step (CPU): y = x W^T + b with W a float32, bf16 or
// fp16 weight in x's dtype (`dense_linear`), or weight-only quantized with activations kept in
// float: int8 with a scale per output row (`int8_linear`: W[n, k] = q[n, k] * scale[n]) or per row
// and group of input features (`int8_group_linear`: GGUF's Q8_0, and Q6_K with its two levels of scales), or int4 with a scale and a min per
// row and group (`int4_linear`: W = q * scale + min; `int4_linear_a8`: the same weights against x
// quantized to int8 per block of 32, as llama.cpp computes GGUF's Q4_0 / Q4_1), each packed once
// (`dense_pack`, `int8_pack`, `int4_pack`); and the quantized ones dequantized to the model dtype for long prompt chunks
// (`int8_dequantize`, `int8_group_dequantize`, `int4_dequantize`: one dequantize, then a float GEMM).
//
// A decode step reads every weight once for one to a few rows of x, so its cost is the bytes read
// plus what each call costs besides. oneDNN's prepacked matmul costs about 9 us a call beyond its
// reads (121 calls a token on SmolLM2: ~1 ms); this kernel under 2 us. The weight is packed in
// tiles of kTileN output rows, each tile input feature by input feature: tile t holds, for each k,
// W[t * kTileN .. + kTileN, k] side by side ([ceil(N / kTileN), K, kTileN], zero-padded rows). So
// the lanes of a vector are output rows: a step broadcasts x[m, k] and adds x[m, k] * W[rows, k]
// into the rows' float32 accumulators, with no horizontal sums at the end (on SmolLM2's 576-wide
// rows, summing each row's vector took as many instructions as its dot product), and a task reads
// its weights as one sequential stream, which the hardware prefetchers follow. With AVX512-BF16
// (Zen 4 and later, Cooper Lake, Sapphire Rapids) bf16 weights are packed by pairs of input
// features instead ([tiles, ceil(K / 2), kTileN, 2]) for vdpbf16ps, which multiplies the pairs of
// 16 rows by a broadcast pair of x exactly and adds them into float32 lanes: one instruction per 64
// bytes of weights where widening to float32 takes several. int8 and int4 weights are widened to
// float32 in registers. The work is split over tiles in tasks of at least ~64 KB of weights. The
// Python side chooses between these and the prompt path (layers/quantization/unquantized.py,
// weight_only.py).
//
// Sums accumulate in float32 in another order than torch's GEMMs: results agree with F.linear
// within the rounding of the sums; the quantized ones agree with layers/quantization/quant_utils.py's
// plain PyTorch reference likewise (tests/test_quant_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_rows.h"
#include "vec.h"

namespace {

using tokenmill_cpu::bias_as_float;
using tokenmill_cpu::dispatch_float_types;
using tokenmill_cpu::rows_as_float;

constexpr int kTileN = 32;  // output rows per tile

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
constexpr int kVecs = kTileN / W;  // vectors per tile row: 2 with AVX-512, 4 with AVX2
// Rows of x per pass: kVecs x rows accumulators, the rows' broadcasts and a weight vector within
// the ISA's registers (32 with AVX-512, 16 with AVX2). Up to 8 rows share each weight read: a
// verifying pass of a speculative step (k drafts + 1 rows) or a decode batch of 5-8 then reads
// its weights once, not in two passes of 4 whose second one adds its compute to the first's
// memory time (SmolLM2's layers at 7 rows, bf16, Zen 5: 1.8x the time of one row in two passes).
constexpr int kMaxRows = Vec::kRegisters >= 32 ? 8 : 2;
#else
constexpr int kMaxRows = 4;
#endif

constexpr bool kPairedBf16 = TOKENMILL_BF16_PAIRS;  // vec.h: AVX-512 with AVX512-BF16

// Whether weights of type T are packed by pairs of input features (for vdpbf16ps).
template <typename T>
constexpr bool paired() {
  return kPairedBf16 && std::is_same_v<T, c10::BFloat16>;
}

// How far ahead of its reads a quantized kernel asks for its weights, in bytes (one prefetch per
// step of its loop: 64 bytes of int4, 32 of int8). Those kernels spend several instructions per 64
// bytes of weights (unpacking, widening, scales) where the bf16 one spends one vdpbf16ps, so the
// out-of-order window reaches few bytes ahead and the hardware prefetchers alone leave memory idle
// part of the time. A 1B
// Llama's layers, one row, Zen 5: int4 with int8 activations 47 -> 53 GB/s (AVX2 build: 46 -> 62),
// int4 with bf16 x 43 -> 55, Q8_0 48 -> 60, per-channel int8 49 -> 56; 8 to 32 KB ahead all gave
// the same, 4 KB less. The float kernels lost by it (bf16: 73 -> 68 GB/s) and do without. Into L2
// (prefetcht1), not L1: SmolLM2's 120 layers at one row, both builds in one process alternated 25
// times, Zen 4, the same outputs: int4 (groups of 32) 1.14-1.20x, int8 1.04-1.15x; at 4 rows 0.98-1.02x
// (as decode attention's block prefetch, paged_attention.cpp: L1's miss buffers are the loads').
constexpr int64_t kPrefetchAhead = 16384;
inline void prefetch_ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kPrefetchAhead, 0, 2); }

// The next tile's weights asked into L2 while a tile is computed in several passes of rows (more
// than kMaxRows rows). A tile's first pass streams its weights from memory and the passes after it
// read them from L2, so without this, memory sat idle through those passes and the next tile's first
// pass waited on it: at 32 rows (4 passes, bf16 pairs) a 768-wide tile's 48 KB were asked for at
// twice the rate one core's share of the memory gives. Each pass asks for an equal span of the next
// tile, a little at each step of its loop, every cache line of it (a stride skipping lines stopped
// the hardware prefetchers: 0.7-0.8x). With one pass (up to kMaxRows rows, bound by the memory) it
// asks for none. The 113M Llama's 48 layers and LM head, bf16, Zen 4, in one process alternating
// with and without it (21-31 rounds, median of the rounds' ratios, two runs): 16 rows 1.22x, 32
// rows 1.06-1.15x, 64 rows 0.98-1.01x; SmolLM2's 1.26x, 1.08x, 0.99x. Whole engine runs of 32
// requests (32 prompt, 64 output tokens), alternating: 1.05x on the 113M Llama (1.04x at 16
// requests), 0.98-1.00x on SmolLM2, whose steps spend less of their time in these GEMMs.
struct TilePrefetch {
  const char* from = nullptr;  // where this pass's share of the next tile starts; nullptr: none
  int64_t per_step_q16 = 0;    // bytes of it to ask for per step, in 1/65536ths
  int lines = 1;               // cache lines asked per step: every line of the share, none skipped
  inline void at_step(int64_t step) const {
    if (from)
      for (int j = 0; j < lines; ++j) __builtin_prefetch(from + ((step * per_step_q16) >> 16) + 64 * j, 0, 2);
  }
};

#if TOKENMILL_SIMD
// A vector of weights widened to float32 lanes.
inline Vec load_weights(const int8_t* p) { return tokenmill_cpu::load_int8(p); }
template <typename T>
inline Vec load_weights(const T* p) { return Vec::load(p); }
#endif

#if TOKENMILL_SIMD
// A tile's accumulators for MT rows of x: kVecs vectors of output rows each.
template <int MT>
inline void zero_rows(Vec (&acc)[MT][kVecs]) {
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = Vec::zero();
}
template <int MT>
inline void store_rows(const Vec (&acc)[MT][kVecs], float* out) {
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) store(out + i * kTileN + v * W, acc[i][v]);
}

// A tile's sums for weights with a scale per group of G input features: per group, add(k0, k1,
// part) adds features [k0, k1) into zeroed partial sums, then take(g, part, acc) scales them into
// the totals; out gets the totals (int4_tile_dot, int8_group_tile_dot).
template <int MT, typename Add, typename Take>
inline void by_groups(int64_t K, int64_t G, float* out, Add&& add, Take&& take) {
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t g = 0; g < (K + G - 1) / G; ++g) {
    Vec part[MT][kVecs];
    zero_rows<MT>(part);
    add(g * G, std::min(K, (g + 1) * G), part);
    take(g, part, acc);
  }
  store_rows<MT>(acc, out);
}
#endif

// out[i * kTileN + r] = sum_k x[i * K + k] * W[r, k] for i < MT, r < kTileN: one packed tile of
// float or int8 weights against MT rows of x (float32).
template <typename WT, int MT>
inline void tile_dot(const float* x, int64_t K, const WT* tile, float* out, const TilePrefetch& pf) {
#if TOKENMILL_SIMD
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t k = 0; k < K; ++k) {
    Vec xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = Vec::set1(x[i * K + k]);
    if constexpr (std::is_same_v<WT, int8_t>) prefetch_ahead(tile + k * kTileN);
    pf.at_step(k);
    for (int v = 0; v < kVecs; ++v) {
      const Vec wv = load_weights(tile + k * kTileN + v * W);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(wv, xb[i], acc[i][v]);
    }
  }
  store_rows<MT>(acc, out);
#else
  std::fill(out, out + MT * kTileN, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < kTileN; ++r) {
      const float wk = static_cast<float>(tile[k * kTileN + r]);
      for (int i = 0; i < MT; ++i) out[i * kTileN + r] += x[i * K + k] * wk;
    }
#endif
}

#if TOKENMILL_BF16_PAIRS
// The same for bf16 weights packed by pairs, against MT rows of x as bf16 pairs (ceil(K / 2) of
// them per row, the last one zero-padded when K is odd).
template <int MT>
inline void tile_dot_paired(const uint32_t* x_pairs, int64_t pairs, const c10::BFloat16* tile, float* out, const TilePrefetch& pf) {
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t p = 0; p < pairs; ++p) {
    Vec xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = tokenmill_cpu::broadcast_pair(x_pairs[i * pairs + p]);
    pf.at_step(p);
    for (int v = 0; v < kVecs; ++v) {
      const Vec wv = tokenmill_cpu::load_bf16_pairs(tile + (p * kTileN + v * W) * 2);
      for (int i = 0; i < MT; ++i) acc[i][v] = tokenmill_cpu::dp_bf16(acc[i][v], wv, xb[i]);
    }
  }
  store_rows<MT>(acc, out);
}
#endif

// int4 weights (int4_pack's layout): per tile and quad of input features (k = 4j .. 4j + 3), 64
// bytes read as 16 little-endian uint32 lanes, lane r holding the 8 values of rows r and r + 16 at
// those features: row r + 16 h, feature 4j + c in the 4 bits at int4_shift(c, h). A scale and a min
// per row and group of G input features ([tiles, groups, kTileN] each, float32 or, where they are
// exact in it, fp16: S): W = q * scale + min; a symmetric weight (every min -8 x its scale: GGUF's
// Q4_0, `symmetric` groups) stores no mins (min == nullptr) and takes -8 x scale in registers, 0.5 +
// 2 / G bytes per weight with fp16 scales.
// Sums of q * x accumulate per group, then take the group's scale; the mins multiply each row of
// x's sum over the group (x_sums [MT, groups]).
//
// Why this order: read as 32 16-bit lanes instead, lane 2r + (c & 1) holds rows r and r + 16 at
// features c and c + 2 of the quad, a nibble each, so `(lane >> s) & 0xF | 0x4300` (one shift and
// one ternary logic op) is, as bf16, 128 + q exactly for 16 rows and a pair of features: the operand
// vdpbf16ps wants beside a broadcast pair of x (int4_tile_dot_paired). Four of those per 64 bytes,
// where widening to float32 (int4_tile_dot) takes a shift, a mask and a conversion per 16 weights
// and a multiply-add each. The 128 comes off once per group: sum x (128 + q) - 128 sum x.
constexpr int kQuad = 4;          // input features per quad
constexpr int kQuadBytes = 64;    // bytes per tile and quad
constexpr int kHalfRows = kTileN / 2;
constexpr int int4_shift(int c, int h) { return 16 * (c & 1) + 8 * (c >> 1) + 4 * h; }

#if TOKENMILL_SIMD
// Rows of x per int4 pass: two sets of accumulators (the group's and the total) must fit too.
constexpr int kMaxRowsInt4 = Vec::kRegisters >= 32 ? 4 : 1;
constexpr int kLaneVecs = kHalfRows / W;  // uint32 loads per quad: 1 with AVX-512, 2 with AVX2
#else
constexpr int kMaxRowsInt4 = 4;
#endif

template <int MT, typename S>
inline void int4_tile_dot(const float* x, int64_t K, int64_t G, const uint8_t* tile, const S* scale, const S* min,
                          const float* x_sums, float* out) {
  const int64_t groups = (K + G - 1) / G;
#if TOKENMILL_SIMD
  by_groups<MT>(K, G, out, [&](int64_t k0, int64_t k1, Vec (&part)[MT][kVecs]) {
    for (int64_t j = k0 / kQuad; j < k1 / kQuad; ++j) {
      prefetch_ahead(tile + j * kQuadBytes);
      for (int d = 0; d < kLaneVecs; ++d) {  // lanes d * W..: rows d * W.. and 16 + d * W..
        const tokenmill_cpu::IVec lanes = tokenmill_cpu::load_u32(tile + j * kQuadBytes + d * W * 4);
        for (int c = 0; c < kQuad; ++c) {
          const Vec lo = tokenmill_cpu::nibble_lanes(lanes, int4_shift(c, 0)), hi = tokenmill_cpu::nibble_lanes(lanes, int4_shift(c, 1));
          for (int i = 0; i < MT; ++i) {
            const Vec xb = Vec::set1(x[i * K + j * kQuad + c]);
            part[i][d] = fmadd(lo, xb, part[i][d]);
            part[i][d + kLaneVecs] = fmadd(hi, xb, part[i][d + kLaneVecs]);
          }
        }
      }
    }
  }, [&](int64_t g, const Vec (&part)[MT][kVecs], Vec (&acc)[MT][kVecs]) {
    for (int v = 0; v < kVecs; ++v) {
      const Vec s = Vec::load(scale + g * kTileN + v * W), mn = min ? Vec::load(min + g * kTileN + v * W) : s * Vec::set1(-8.f);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(mn, Vec::set1(x_sums[i * groups + g]), fmadd(part[i][v], s, acc[i][v]));
    }
  });
#else
  std::fill(out, out + MT * kTileN, 0.f);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < kTileN; ++r) {
      const int lane = r % kHalfRows, h = r / kHalfRows;
      for (int i = 0; i < MT; ++i) {
        float part = 0.f;
        for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) {
          uint32_t bits;
          std::memcpy(&bits, tile + (k / kQuad) * kQuadBytes + lane * 4, 4);
          part += static_cast<float>((bits >> int4_shift(static_cast<int>(k % kQuad), h)) & 0xF) * x[i * K + k];
        }
        const float sr = static_cast<float>(scale[g * kTileN + r]), mr = min ? static_cast<float>(min[g * kTileN + r]) : -8.f * sr;
        out[i * kTileN + r] += part * sr + mr * x_sums[i * groups + g];
      }
    }
#endif
}

#if TOKENMILL_BF16_PAIRS
// The same for bf16 x, MT rows as bf16 pairs (K / 2 per row), with vdpbf16ps (see the top of this
// section). Each row keeps four sets of partial sums (rows 0..15 and 16..31, each for the quad's
// first and second pair of features), so consecutive vdpbf16ps do not wait on each other; at one
// or two rows, eight (even and odd quads apart): with four, each quad waited for the previous one's
// vdpbf16ps (6 cycles on Zen 4/5): one row of SmolLM2's 120 int4 layers streamed 35 GB/s, 37 after.
template <int MT, typename S>
inline void int4_tile_dot_paired(const uint32_t* x_pairs, int64_t K, int64_t G, const uint8_t* tile, const S* scale, const S* min,
                                 const float* x_sums, float* out) {
  const int64_t groups = (K + G - 1) / G, pairs = K / 2;
  const __m512i low4 = _mm512_set1_epi16(0xF), bf16_128 = _mm512_set1_epi16(0x4300);
  const __m512 k128 = _mm512_set1_ps(128.f);
  constexpr int kOr = 0xEA;  // ternary logic: (a & b) | c
  constexpr int kSets = MT <= 2 ? 2 : 1;  // sets of four partial sums per row
  __m512 acc[MT][2];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[MT][4 * kSets];
    for (int i = 0; i < MT; ++i)
      for (int p = 0; p < 4 * kSets; ++p) part[i][p] = _mm512_setzero_ps();
    auto quad = [&](int64_t j, int set) {
      prefetch_ahead(tile + j * kQuadBytes);
      const __m512i v = _mm512_loadu_si512(tile + j * kQuadBytes);
      const __m512bh w[4] = {
          (__m512bh)_mm512_ternarylogic_epi32(v, low4, bf16_128, kOr),                         // rows 0..15, first pair
          (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, bf16_128, kOr),   // rows 16..31, first pair
          (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, bf16_128, kOr),   // rows 0..15, second pair
          (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), bf16_128)};                      // rows 16..31, second pair
      for (int i = 0; i < MT; ++i) {
        const __m512bh first = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[i * pairs + 2 * j]));
        const __m512bh second = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[i * pairs + 2 * j + 1]));
        __m512* p = part[i] + 4 * set;
        p[0] = _mm512_dpbf16_ps(p[0], w[0], first);
        p[1] = _mm512_dpbf16_ps(p[1], w[1], first);
        p[2] = _mm512_dpbf16_ps(p[2], w[2], second);
        p[3] = _mm512_dpbf16_ps(p[3], w[3], second);
      }
    };
    const int64_t j1 = std::min(K, (g + 1) * G) / kQuad;
    int64_t j = g * G / kQuad;
    for (; j + kSets <= j1; j += kSets)
      for (int set = 0; set < kSets; ++set) quad(j + set, set);
    for (; j < j1; ++j) quad(j, 0);
    for (int i = 0; i < MT; ++i)
      for (int p = 4; p < 4 * kSets; ++p) part[i][p - 4] = _mm512_add_ps(part[i][p - 4], part[i][p]);
    for (int h = 0; h < 2; ++h) {
      const __m512 s = Vec::load(scale + g * kTileN + h * kHalfRows).v;
      const __m512 mn = min ? Vec::load(min + g * kTileN + h * kHalfRows).v : _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
      for (int i = 0; i < MT; ++i) {
        const __m512 xs = _mm512_set1_ps(x_sums[i * groups + g]);
        const __m512 qx = _mm512_fnmadd_ps(k128, xs, _mm512_add_ps(part[i][h], part[i][h + 2]));  // sum q x
        acc[i][h] = _mm512_fmadd_ps(mn, xs, _mm512_fmadd_ps(qx, s, acc[i][h]));
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + i * kTileN + h * kHalfRows, acc[i][h]);
}
#endif

// int4 weights against x quantized to int8 (int4_linear_a8: GGUF's Q4_0 / Q4_1, computed as
// llama.cpp does, its activations in blocks of kXBlock as its Q8_0): per row and block of 32 input
// features, dx = absmax / 127 and xq = round(x * (1 / dx)) (quantize_rows_a8). The lane bytes of a
// quad hold, in the low nibbles, row r at features 0, 2, 1, 3 (int4_shift), in the high ones row r +
// 16: with xq stored in that order, one 32-bit broadcast of it against `lanes & 0x0F` (and `(lanes >>
// 4) & 0x0F`) is what vpdpbusd multiplies (u8 weights 0..15 x s8 activations, 4 products summed
// into int32 lanes, exactly), or maddubs + madd without VNNI (no pair sum exceeds 2 x 15 x 127: no
// saturation). Each block's int32 sums take dx x the group's scale; the mins (or -8 x scale) take
// the sum over the group of the quantized x (quantize_rows_a8), as in int4_tile_dot. Half the
// instructions of vdpbf16ps per weight (64 products each instead of 32) and a third of widening to
// float32: a 1B Llama's Q4_0 gate-up (8192 x 2048, Zen 5, bf16) 88 against 95 us at one row (the
// bytes bound both), 516 against 696 at 16 rows; in float32 74 against 196 at one row.
constexpr int kXBlock = 32;
constexpr int kXQuadOrder[kQuad] = {0, 2, 1, 3};  // the features of a quad, in the order of its lane bytes

// x [M, K] (float) per row and block of kXBlock: xq [M, K] int8 in kXQuadOrder within each quad, dx
// [M, K / kXBlock] (0 for a block of zeros, whose xq are 0), and x_sums [M, groups of G]: the sums of
// the values xq * dx stand for, so that the mins too multiply the x the int4 values do (W x_q exactly,
// as llama.cpp's Q8_1 sums; x's own sums would leave the error of x_q times q instead of q * scale +
// min, twice as large for Q4_0).
void quantize_rows_a8(const float* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* dx, float* x_sums) {
  const int64_t blocks = K / kXBlock, groups = (K + G - 1) / G;
  for (int64_t m = 0; m < M; ++m) {
    std::fill(x_sums + m * groups, x_sums + (m + 1) * groups, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * kXBlock;
      float amax = 0.f;
      for (int k = 0; k < kXBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      dx[m * blocks + b] = d;
      int8_t* q = xq + m * K + b * kXBlock;
      int32_t v[kXBlock], sum = 0;  // rint (round half to even), in plain loops the compiler vectorizes
      for (int k = 0; k < kXBlock; ++k) v[k] = static_cast<int32_t>(std::rint(xb[k] * inv));
      for (int k = 0; k < kXBlock; ++k) sum += v[k];
      for (int k = 0; k < kXBlock; ++k) q[k / kQuad * kQuad + kXQuadOrder[k % kQuad]] = static_cast<int8_t>(v[k]);
      x_sums[m * groups + b * kXBlock / G] += static_cast<float>(sum) * d;
    }
  }
}

#if TOKENMILL_SIMD == 512
using LaneBytes = __m512i;
inline LaneBytes low_nibbles(LaneBytes v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline LaneBytes high_nibbles(LaneBytes v) { return _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi8(0x0F)); }
// acc + per int32 lane the sum of its 4 products u8 (w) x s8 (x).
inline LaneBytes dot_u8s8(LaneBytes acc, LaneBytes w, LaneBytes x) {
#if defined(__AVX512VNNI__)
  // = _mm512_dpbusd_epi32(acc, w, x), as asm: see int8_gemm.cpp (gcc spills the intrinsic's accumulators).
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "vm"(x));
  return acc;
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}
inline Vec lanes_as_float(LaneBytes a) { return {_mm512_cvtepi32_ps(a)}; }
#elif TOKENMILL_SIMD == 256
using LaneBytes = __m256i;
inline LaneBytes low_nibbles(LaneBytes v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline LaneBytes high_nibbles(LaneBytes v) { return _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi8(0x0F)); }
inline LaneBytes dot_u8s8(LaneBytes acc, LaneBytes w, LaneBytes x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
inline Vec lanes_as_float(LaneBytes a) { return {_mm256_cvtepi32_ps(a)}; }
#endif
#if TOKENMILL_SIMD
// 4 activation bytes in every 32-bit lane.
inline LaneBytes broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return tokenmill_cpu::IVec::set1(v).v;
}
#endif

// MT rows of xq (quantize_rows_a8; K and G multiples of kXBlock) against one tile: out as int4_tile_dot.
template <int MT, typename S>
inline void int4_tile_dot_a8(const int8_t* xq, const float* dx, int64_t K, int64_t G, const uint8_t* tile, const S* scale, const S* min,
                             const float* x_sums, float* out) {
  const int64_t groups = (K + G - 1) / G, blocks = K / kXBlock;
#if TOKENMILL_SIMD
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    Vec s[kVecs];
    for (int v = 0; v < kVecs; ++v) s[v] = Vec::load(scale + g * kTileN + v * W);
    for (int64_t b = g * G / kXBlock; b < std::min(blocks, (g + 1) * G / kXBlock); ++b) {
      LaneBytes sums[MT][kVecs];  // int32 lanes: rows as int4_tile_dot's part
      for (int i = 0; i < MT; ++i)
        for (int v = 0; v < kVecs; ++v) sums[i][v] = LaneBytes{};
      for (int64_t j = b * kXBlock / kQuad; j < (b + 1) * kXBlock / kQuad; ++j) {
        LaneBytes xb[MT];
        for (int i = 0; i < MT; ++i) xb[i] = broadcast4(xq + i * K + j * kQuad);
        prefetch_ahead(tile + j * kQuadBytes);
        for (int d = 0; d < kLaneVecs; ++d) {
          const LaneBytes lanes = tokenmill_cpu::load_u32(tile + j * kQuadBytes + d * W * 4).v;
          const LaneBytes lo = low_nibbles(lanes), hi = high_nibbles(lanes);
          for (int i = 0; i < MT; ++i) {
            sums[i][d] = dot_u8s8(sums[i][d], lo, xb[i]);
            sums[i][d + kLaneVecs] = dot_u8s8(sums[i][d + kLaneVecs], hi, xb[i]);
          }
        }
      }
      for (int i = 0; i < MT; ++i) {
        const Vec d = Vec::set1(dx[i * blocks + b]);
        for (int v = 0; v < kVecs; ++v) acc[i][v] = fmadd(lanes_as_float(sums[i][v]), s[v] * d, acc[i][v]);
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const Vec mn = min ? Vec::load(min + g * kTileN + v * W) : s[v] * Vec::set1(-8.f);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(mn, Vec::set1(x_sums[i * groups + g]), acc[i][v]);
    }
  }
  store_rows<MT>(acc, out);
#else
  std::fill(out, out + MT * kTileN, 0.f);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < kTileN; ++r) {
      const int lane = r % kHalfRows, shift = 4 * (r / kHalfRows);
      const float sr = static_cast<float>(scale[g * kTileN + r]), mr = min ? static_cast<float>(min[g * kTileN + r]) : -8.f * sr;
      for (int i = 0; i < MT; ++i) {
        for (int64_t b = g * G / kXBlock; b < std::min(blocks, (g + 1) * G / kXBlock); ++b) {
          int32_t sum = 0;
          for (int64_t j = b * kXBlock / kQuad; j < (b + 1) * kXBlock / kQuad; ++j)
            for (int byte = 0; byte < kQuad; ++byte)
              sum += ((tile[j * kQuadBytes + lane * 4 + byte] >> shift) & 0xF) * xq[i * K + j * kQuad + byte];
          out[i * kTileN + r] += static_cast<float>(sum) * (sr * dx[i * blocks + b]);
        }
        out[i * kTileN + r] += mr * x_sums[i * groups + g];
      }
    }
#endif
}

// int8 weights with a scale per row and group of G input features (GGUF's Q8_0: G = 32), in
// int8_pack's tiles, the scales [tiles, groups, kTileN] (float32 or fp16: S): W = q * scale. Or two
// levels, as GGUF's Q6_K holds them (S = int8_t): an int8 scale per group of 16 times an fp16 scale
// per `per_super` groups (super [tiles, groups / per_super, kTileN]), multiplied in float32, where
// the product of an fp16 and an int8 is exact: 1.07 bytes a weight where a float32 scale per 16
// takes 1.25. Sums of q * x accumulate per group, then take the group's scale (as int4_tile_dot;
// the same register budget, so kMaxRowsInt4 rows a pass).
#if TOKENMILL_SIMD
template <typename S>
inline Vec group_scale(const S* scale, const c10::Half* super, int64_t per_super, int64_t g, int v) {
  if constexpr (std::is_same_v<S, int8_t>)
    return tokenmill_cpu::load_int8(scale + g * kTileN + v * W) * Vec::load(super + g / per_super * kTileN + v * W);
  else
    return Vec::load(scale + g * kTileN + v * W);
}
#endif
template <typename S>
inline float group_scale_at(const S* scale, const c10::Half* super, int64_t per_super, int64_t g, int r) {
  const float s = static_cast<float>(scale[g * kTileN + r]);
  return super ? s * static_cast<float>(super[g / per_super * kTileN + r]) : s;
}

template <int MT, typename S>
inline void int8_group_tile_dot(const float* x, int64_t K, int64_t G, const int8_t* tile, const S* scale, const c10::Half* super,
                                int64_t per_super, float* out) {
#if TOKENMILL_SIMD
  by_groups<MT>(K, G, out, [&](int64_t k0, int64_t k1, Vec (&part)[MT][kVecs]) {
    for (int64_t k = k0; k < k1; ++k) {
      Vec xb[MT];
      for (int i = 0; i < MT; ++i) xb[i] = Vec::set1(x[i * K + k]);
      prefetch_ahead(tile + k * kTileN);
      for (int v = 0; v < kVecs; ++v) {
        const Vec wv = tokenmill_cpu::load_int8(tile + k * kTileN + v * W);
        for (int i = 0; i < MT; ++i) part[i][v] = fmadd(wv, xb[i], part[i][v]);
      }
    }
  }, [&](int64_t g, const Vec (&part)[MT][kVecs], Vec (&acc)[MT][kVecs]) {
    for (int v = 0; v < kVecs; ++v) {
      const Vec s = group_scale(scale, super, per_super, g, v);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(part[i][v], s, acc[i][v]);
    }
  });
#else
  const int64_t groups = (K + G - 1) / G;
  std::fill(out, out + MT * kTileN, 0.f);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < kTileN; ++r)
      for (int i = 0; i < MT; ++i) {
        float part = 0.f;
        for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) part += static_cast<float>(tile[k * kTileN + r]) * x[i * K + k];
        out[i * kTileN + r] += part * group_scale_at(scale, super, per_super, g, r);
      }
#endif
}

// f(integral_constant<MT>) for the rows of x in one pass (MT <= kMaxRows; rows <= kMaxRowsInt4 for int4).
template <typename F>
inline void with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
#if !TOKENMILL_SIMD || TOKENMILL_SIMD == 512
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
#endif
#if TOKENMILL_SIMD == 512
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
#endif
    default: f(std::integral_constant<int, kMaxRows>{}); break;
  }
}

// The tiled layout of w [N, K] (see the top): [ceil(N / kTileN), K, kTileN], rows padded with zeros.
at::Tensor tiles_of(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + kTileN - 1) / kTileN;
  const at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, tiles * kTileN - N});
  return padded.view({tiles, kTileN, K}).transpose(1, 2).contiguous();
}

// dense_linear's layout of w [N, K]: tiles_of(w), or for paired bf16 [ceil(N / kTileN), ceil(K / 2),
// kTileN, 2], rows and the odd feature padded with zeros.
at::Tensor dense_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "dense_pack: w must be [out_features, in_features]");
  bool pairs = false;
  dispatch_float_types(w.scalar_type(), "dense_pack", [&](auto* tag) { pairs = paired<std::remove_pointer_t<decltype(tag)>>(); });
  if (!pairs) return tiles_of(w);
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + kTileN - 1) / kTileN, pair_count = (K + 1) / 2;
  const at::Tensor padded = at::constant_pad_nd(w, {0, 2 * pair_count - K, 0, tiles * kTileN - N});
  return padded.view({tiles, kTileN, pair_count, 2}).transpose(1, 2).contiguous();
}

// int8_linear's layout of q [N, K] int8: tiles_of(q).
at::Tensor int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8_pack: q must be int8 [out_features, in_features]");
  return tiles_of(q);
}

// int4_linear's layout (see int4_tile_dot) of quant_utils' int4: packed [N, K / 2] bytes (in each block
// of 32 weights, byte j holds weight j and weight j + 16), scale and min [N, groups] (both fp16, or
// else float32). Returns the tiles [ceil(N / kTileN), K / kQuad, kQuadBytes] and the scales and
// mins [tiles, groups, kTileN] in their dtype (padded rows: zeros).
std::vector<at::Tensor> int4_pack(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) % 16 == 0,
              "int4_pack: packed must be uint8 [out_features, in_features / 2] in blocks of 16 bytes");
  const int64_t N = packed.size(0), K = 2 * packed.size(1), tiles = (N + kTileN - 1) / kTileN;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && (min.sizes() == scale.sizes() || min.numel() == 0),
              "int4_pack: scale and min must be [out_features, groups] (min empty: symmetric, -8 x scale)");
  const at::Tensor blocks = packed.contiguous().view({N, K / 32, 1, 16});
  const at::Tensor q = at::cat({blocks.bitwise_and(0xF), blocks.bitwise_right_shift(4)}, 2).view({N, K}).to(at::kLong);
  // [tiles, h, r, quad, c >> 1, c & 1] -> [tiles, quad, r, h, c >> 1, c & 1], each value shifted to
  // int4_shift(c, h) and summed into its lane (as int64, then its low 32 bits).
  const at::Tensor rows = at::constant_pad_nd(q, {0, 0, 0, tiles * kTileN - N}).view({tiles, 2, kHalfRows, K / kQuad, 2, 2});
  std::vector<int64_t> shift_values;
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < kQuad; ++c) shift_values.push_back(int4_shift(c, h));
  const at::Tensor shifts = at::tensor(shift_values, at::kLong).view({2, 2, 2});
  const at::Tensor lanes = rows.permute({0, 3, 2, 1, 4, 5}).bitwise_left_shift(shifts).sum({3, 4, 5}).to(at::kInt);
  const bool symmetric = min.numel() == 0;
  const at::ScalarType scale_type = scale.scalar_type() == at::kHalf && (symmetric || min.scalar_type() == at::kHalf) ? at::kHalf : at::kFloat;
  auto by_tile = [&](const at::Tensor& t) {
    return at::constant_pad_nd(t.to(scale_type), {0, 0, 0, tiles * kTileN - N}).view({tiles, kTileN, t.size(1)}).transpose(1, 2).contiguous();
  };
  return {lanes.contiguous().view(at::kByte).view({tiles, K / kQuad, kQuadBytes}), by_tile(scale),
          symmetric ? at::empty({0}, scale.options().dtype(scale_type)) : by_tile(min)};
}

void check_int4(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t G, int64_t N, const char* op) {
  TORCH_CHECK(G > 0 && G % kQuad == 0, op, ": group size must be a positive multiple of ", kQuad);
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.size(0) == (N + kTileN - 1) / kTileN &&
                  tiles.size(2) == kQuadBytes, op, ": the weight must be int4_pack's layout of ", N, " output rows");
  const int64_t groups = (kQuad * tiles.size(1) + G - 1) / G;
  for (const at::Tensor* t : {&scale, &min}) {
    if (t == &min && min.numel() == 0) continue;  // symmetric: no mins
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) && t->scalar_type() == scale.scalar_type() &&
                    t->is_contiguous() && t->sizes() == at::IntArrayRef({tiles.size(0), groups, kTileN}),
                op, ": scale and min must be int4_pack's [tiles, ", groups, " groups, ", kTileN, "], both float32 or both fp16");
  }
}

// f(S*) for group scales (and int4's mins) held as S (float or c10::Half, as check_int4 and
// check_int8_group allow).
template <typename F>
void with_scale_type(const at::Tensor& scale, F&& f) {
  if (scale.scalar_type() == at::kHalf)
    f(static_cast<c10::Half*>(nullptr));
  else
    f(static_cast<float*>(nullptr));
}

// Where a kernel's tiles lie for TilePrefetch: tile t at weights + t * tile_bytes, read in `steps`
// steps of its loop (weights nullptr: the kernel asks for none).
struct NextTilePlan {
  const void* weights = nullptr;
  int64_t steps = 1;
};

// y [M, N] in T: y[m, n] = out[m, n] * (scale ? scale[n] : 1) + bias[n] (bias empty: none), rounded once, with
// tile(t, m, rows, out, prefetch) computing a tile's sums for `rows` (<= max_rows) rows of x from
// row m into out [rows, kTileN] (and asking for what `prefetch` says). Tiles hold tile_bytes of
// weights each; tasks get at least ~64 KB of them, so a decode step's small layers are not cut into crumbs.
template <typename T, typename Tile>
at::Tensor run_tiles(const at::Tensor& x, int64_t N, int64_t tile_bytes, int max_rows, const float* scale,
                     const std::vector<float>& bias, Tile&& tile, NextTilePlan plan = {}) {
  const int64_t M = x.size(0), tiles = (N + kTileN - 1) / kTileN;
  at::Tensor y = at::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const float* bp = bias.empty() ? nullptr : bias.data();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(tile_bytes, 1));
  // With two passes or more, each pass asks for an equal span of the next tile (TilePrefetch): the
  // same rate for every pass, only where its span starts differs.
  const int64_t passes = (M + max_rows - 1) / max_rows;
  const bool prefetch_next = plan.weights != nullptr && passes >= 2;
  const int64_t span = prefetch_next ? tile_bytes / passes : 0;
  TilePrefetch share;
  share.per_step_q16 = (span << 16) / plan.steps;
  share.lines = static_cast<int>((span / plan.steps + 63) / 64);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kMaxRows * kTileN];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileN;
      const int cols = static_cast<int>(std::min<int64_t>(kTileN, N - n));
      for (int64_t m = 0; m < M; m += max_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(max_rows, M - m));
        TilePrefetch prefetch = share;
        if (prefetch_next && t + 1 < end) prefetch.from = static_cast<const char*>(plan.weights) + (t + 1) * tile_bytes + m / max_rows * span;
        tile(t, m, rows, out, prefetch);
#if TOKENMILL_SIMD
        // Whole tiles in vectors: the scalar loop's conversions were an estimated ~10% of a 768-wide
        // layer's cycles at 32 rows (a gain too small to time apart from the noise on the Zen 4 VM).
        // The same roundings as the scalar loop (a multiply, then an add).
        if (cols == kTileN) {
          for (int i = 0; i < rows; ++i)
            for (int v = 0; v < kTileN; v += W) {
              const Vec sum = Vec::load(out + i * kTileN + v);
              const Vec y = scale ? sum * Vec::load(scale + n + v) : sum;
              store(yp + (m + i) * N + n + v, bp ? y + Vec::load(bp + n + v) : y);
            }
          continue;
        }
#endif
        for (int i = 0; i < rows; ++i)
          for (int r = 0; r < cols; ++r)
            yp[(m + i) * N + n + r] = static_cast<T>(out[i * kTileN + r] * (scale ? scale[n + r] : 1.f) + (bp ? bp[n + r] : 0.f));
      }
    }
  });
  return y;
}

// x [M, K] times W packed in tiles of WT (T itself, or int8; paired: bf16 pairs for vdpbf16ps), then
// run_tiles' epilogue.
template <typename T, typename WT, bool kPaired>
at::Tensor tiled_linear(const at::Tensor& x, const WT* wp, int64_t N, const float* scale, const std::vector<float>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t steps = kPaired ? (K + 1) / 2 : K;  // per tile: input features, or pairs of them
  const int64_t tile_size = steps * kTileN * (kPaired ? 2 : 1);
  // x once per call: float32 for the fused multiply-adds, or bf16 pairs as uint32 for vdpbf16ps.
  std::vector<float> xf;
  std::vector<uint32_t> x_pairs;
  if constexpr (kPaired) {
    const at::Tensor xc = x.contiguous();
    x_pairs.assign(M * steps, 0u);
    for (int64_t m = 0; m < M; ++m) std::memcpy(x_pairs.data() + m * steps, xc.data_ptr<T>() + m * K, K * sizeof(T));
  } else {
    xf = rows_as_float<T>(x);
  }
  // int8 weights ask for their own tile ahead (prefetch_ahead) and take no plan.
  const NextTilePlan plan{std::is_same_v<WT, int8_t> ? nullptr : wp, steps};
  auto tile = [&](int64_t t, int64_t m, int rows, float* out, const TilePrefetch& prefetch) {
    with_rows(rows, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
#if TOKENMILL_BF16_PAIRS
      if constexpr (kPaired) tile_dot_paired<MT>(x_pairs.data() + m * steps, steps, wp + t * tile_size, out, prefetch);
#endif
      if constexpr (!kPaired) tile_dot<WT, MT>(xf.data() + m * K, K, wp + t * tile_size, out, prefetch);
    });
  };
  return run_tiles<T>(x, N, tile_size * static_cast<int64_t>(sizeof(WT)), kMaxRows, scale, bias, tile, plan);
}

void check_packed(const at::Tensor& packed, at::IntArrayRef want, at::ScalarType dtype, int64_t N, int64_t K, const char* op,
                  const char* pack_op) {
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == dtype && packed.sizes() == want, op, ": the weight must be ",
              pack_op, "'s layout of an [", N, ", ", K, "] matrix of ", dtype);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "dense_linear: x must be [rows, in_features]");
  const int64_t N = out_features, K = x.size(1), tiles = (N + kTileN - 1) / kTileN;
  const std::vector<float> b = bias_as_float(bias, N, "dense_linear");
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "dense_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr bool pairs = paired<T>();
    if constexpr (pairs) {
      check_packed(packed, {tiles, (K + 1) / 2, kTileN, 2}, x.scalar_type(), N, K, "dense_linear", "dense_pack");
    } else {
      check_packed(packed, {tiles, K, kTileN}, x.scalar_type(), N, K, "dense_linear", "dense_pack");
    }
    y = tiled_linear<T, T, pairs>(x, packed.data_ptr<T>(), N, nullptr, b);
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int8_linear: x must be [rows, in_features]");
  const int64_t N = out_features, K = x.size(1), tiles = (N + kTileN - 1) / kTileN;
  check_packed(packed, {tiles, K, kTileN}, at::kChar, N, K, "int8_linear", "int8_pack");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_linear: scale must be float32 [N]");
  const std::vector<float> b = bias_as_float(bias, N, "int8_linear");
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    y = tiled_linear<T, int8_t, false>(x, packed.data_ptr<int8_t>(), N, scale.data_ptr<float>(), b);
  });
  return y;
}

// int8 weights with group scales: int8_pack's tiles, the scales [tiles, groups, kTileN] (float32 or fp16;
// or int8 with super [tiles, supers, kTileN] fp16, supers dividing groups). Returns the groups per super scale
// (0 without them).
int64_t check_int8_group(const at::Tensor& tiles, const at::Tensor& scale, const std::optional<at::Tensor>& super, int64_t G, int64_t N,
                         const char* op) {
  TORCH_CHECK(G > 0, op, ": group size must be positive");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kChar && tiles.is_contiguous() && tiles.size(0) == (N + kTileN - 1) / kTileN &&
                  tiles.size(2) == kTileN, op, ": the weight must be int8_pack's layout of ", N, " output rows");
  const int64_t groups = (tiles.size(1) + G - 1) / G;
  const bool two_levels = scale.scalar_type() == at::kChar;
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf || two_levels) && scale.is_contiguous() &&
                  scale.sizes() == at::IntArrayRef({tiles.size(0), groups, kTileN}),
              op, ": scale must be [tiles, ", groups, " groups, ", kTileN, "] float32, fp16 or int8 (with super_scale)");
  TORCH_CHECK(two_levels == super.has_value(), op, ": super_scale goes with int8 scales, and only with them");
  if (!two_levels) return 0;
  const int64_t supers = super->dim() == 3 ? super->size(1) : 0;
  TORCH_CHECK(super->scalar_type() == at::kHalf && super->is_contiguous() && supers > 0 && groups % supers == 0 &&
                  super->sizes() == at::IntArrayRef({tiles.size(0), supers, kTileN}),
              op, ": super_scale must be fp16 [tiles, supers, ", kTileN, "] with supers dividing the ", groups, " groups");
  return groups / supers;
}

// f(S*) for int8_group's scales: float, c10::Half, or int8_t (two levels).
template <typename F>
void with_group_scale_type(const at::Tensor& scale, F&& f) {
  if (scale.scalar_type() == at::kChar)
    f(static_cast<int8_t*>(nullptr));
  else
    with_scale_type(scale, f);
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const std::optional<at::Tensor>& super,
                             int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int8_group_linear: x must be [rows, in_features]");
  const int64_t per_super = check_int8_group(tiles, scale, super, group_size, out_features, "int8_group_linear");
  const int64_t K = x.size(1), G = group_size, groups = (K + G - 1) / G, supers = per_super ? groups / per_super : 0;
  const c10::Half* hp = super ? super->data_ptr<c10::Half>() : nullptr;
  TORCH_CHECK(tiles.size(1) == K, "int8_group_linear: x has ", K, " features, the weight ", tiles.size(1));
  const std::vector<float> b = bias_as_float(bias, out_features, "int8_group_linear");
  const int8_t* wp = tiles.data_ptr<int8_t>();
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int8_group_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const std::vector<float> xf = rows_as_float<T>(x);
    with_group_scale_type(scale, [&](auto* scale_tag) {
      using S = std::remove_pointer_t<decltype(scale_tag)>;
      const S* sp = scale.data_ptr<S>();
      y = run_tiles<T>(x, out_features, K * kTileN, kMaxRowsInt4, nullptr, b, [&](int64_t t, int64_t m, int rows, float* out, const TilePrefetch&) {
        with_rows(rows, [&](auto mt) {
          int8_group_tile_dot<decltype(mt)::value>(xf.data() + m * K, K, G, wp + t * K * kTileN, sp + t * groups * kTileN,
                                                   hp ? hp + t * supers * kTileN : nullptr, per_super, out);
        });
      });
    });
  });
  return y;
}

// Each row of x [M, K] (contiguous) summed over each group of G features: the mins' terms of int4_linear.
template <typename T>
std::vector<float> group_sums(const at::Tensor& x, int64_t G) {
  const int64_t M = x.size(0), K = x.size(1), groups = (K + G - 1) / G;
  std::vector<float> sums(M * groups);
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const T* row = xp + m * K;
      const int64_t k1 = std::min(K, (g + 1) * G);
      int64_t k = g * G;
      float sum = 0.f;
#if TOKENMILL_SIMD
      Vec acc = Vec::zero();
      for (; k + W <= k1; k += W) acc = acc + Vec::load(row + k);
      sum = tokenmill_cpu::reduce_add(acc);
#endif
      for (; k < k1; ++k) sum += static_cast<float>(row[k]);
      sums[m * groups + g] = sum;
    }
  return sums;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                       int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x must be [rows, in_features]");
  check_int4(tiles, scale, min, group_size, out_features, "int4_linear");
  const int64_t M = x.size(0), K = x.size(1), G = group_size, groups = (K + G - 1) / G;
  TORCH_CHECK(kQuad * tiles.size(1) == K, "int4_linear: x has ", K, " features, the weight ", kQuad * tiles.size(1));
  const std::vector<float> b = bias_as_float(bias, out_features, "int4_linear");
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const int64_t tile_bytes = K / kQuad * kQuadBytes;
  const at::Tensor xc = x.contiguous();
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int4_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    // x widened to float32 where the float kernel reads it; bf16 pairs read x as it is.
    const std::vector<float> xf = paired<T>() ? std::vector<float>() : rows_as_float<T>(xc);
    const std::vector<float> x_sums = group_sums<T>(xc, G);
    with_scale_type(scale, [&](auto* scale_tag) {
      using S = std::remove_pointer_t<decltype(scale_tag)>;
      const S *sp = scale.data_ptr<S>(), *mp = min.numel() ? min.data_ptr<S>() : nullptr;
      auto tile_rows = [&](int64_t t, int64_t m, int rows, float* out, const TilePrefetch&) {
        with_rows(rows, [&](auto mt) {
          constexpr int MT = decltype(mt)::value;
#if TOKENMILL_BF16_PAIRS
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            // x's bf16 values, read by pairs of features (K is a multiple of 32).
            const auto* x_pairs = reinterpret_cast<const uint32_t*>(xc.data_ptr<T>()) + m * (K / 2);
            int4_tile_dot_paired<MT>(x_pairs, K, G, wp + t * tile_bytes, sp + t * groups * kTileN, mp ? mp + t * groups * kTileN : nullptr,
                                     x_sums.data() + m * groups, out);
            return;
          }
#endif
          int4_tile_dot<MT>(xf.data() + m * K, K, G, wp + t * tile_bytes, sp + t * groups * kTileN, mp ? mp + t * groups * kTileN : nullptr,
                            x_sums.data() + m * groups, out);
        });
      };
      y = run_tiles<T>(xc, out_features, tile_bytes, kMaxRowsInt4, nullptr, b, tile_rows);
    });
  });
  return y;
}

// int4_linear with x quantized to int8 per row and block of 32 (int4_tile_dot_a8): K and the group
// size multiples of 32.
at::Tensor int4_linear_a8(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                          int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int4_linear_a8: x must be [rows, in_features]");
  check_int4(tiles, scale, min, group_size, out_features, "int4_linear_a8");
  const int64_t M = x.size(0), K = x.size(1), G = group_size, groups = (K + G - 1) / G;
  TORCH_CHECK(kQuad * tiles.size(1) == K, "int4_linear_a8: x has ", K, " features, the weight ", kQuad * tiles.size(1));
  TORCH_CHECK(K % kXBlock == 0 && G % kXBlock == 0, "int4_linear_a8: in_features (", K, ") and group size (", G,
              ") must be multiples of ", kXBlock);
  const std::vector<float> b = bias_as_float(bias, out_features, "int4_linear_a8");
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const int64_t tile_bytes = K / kQuad * kQuadBytes, blocks = K / kXBlock;
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int4_linear_a8", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const std::vector<float> xf = rows_as_float<T>(x);
    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * blocks), x_sums(M * groups);
    quantize_rows_a8(xf.data(), M, K, G, xq.data(), dx.data(), x_sums.data());
    with_scale_type(scale, [&](auto* scale_tag) {
      using S = std::remove_pointer_t<decltype(scale_tag)>;
      const S *sp = scale.data_ptr<S>(), *mp = min.numel() ? min.data_ptr<S>() : nullptr;
      y = run_tiles<T>(x, out_features, tile_bytes, kMaxRowsInt4, nullptr, b, [&](int64_t t, int64_t m, int rows, float* out, const TilePrefetch&) {
        with_rows(rows, [&](auto mt) {
          int4_tile_dot_a8<decltype(mt)::value>(xq.data() + m * K, dx.data() + m * blocks, K, G, wp + t * tile_bytes,
                                                sp + t * groups * kTileN, mp ? mp + t * groups * kTileN : nullptr,
                                                x_sums.data() + m * groups, out);
        });
      });
    });
  });
  return y;
}

// The transposed float weights W^T [K, N] in `like`'s dtype of a quantized weight in tiles, for prompt
// chunks (one dequantize, then a float GEMM, x @ W^T): column(t, k, o) writes W[t * kTileN .. + kTileN, k]
// (as T) to o, kTileN consecutive elements of row k, the last tile's only up to N (o then points into
// a scratch row). Transposed because a tile holds, per input feature, its rows side by side: each row
// of W^T is written contiguously, tile after tile, where W's rows would be written a column at a time
// (ten times slower). The tiles' bytes for one k are reread from cache for the next.
template <typename Column>
at::Tensor dequantize_transposed(int64_t N, int64_t K, int64_t tiles, const at::Tensor& like, const char* op, Column&& column) {
  at::Tensor out = at::empty({K, N}, like.options());
  dispatch_float_types(like.scalar_type(), op, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* op_ = out.data_ptr<T>();
    at::parallel_for(0, K, 8, [&](int64_t begin, int64_t end) {
      T scratch[kTileN];
      for (int64_t k = begin; k < end; ++k)
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t n = t * kTileN, cols = std::min<int64_t>(kTileN, N - n);
          T* o = cols == kTileN ? op_ + k * N + n : scratch;
          column(t, k, o);
          if (cols < kTileN) std::copy(scratch, scratch + cols, op_ + k * N + n);
        }
    });
  });
  return out;
}

// int8 with group scales dequantized, transposed: W^T[k, n] = q[n, k] * scale of row n's group of k.
at::Tensor int8_group_dequantize(const at::Tensor& tiles, const at::Tensor& scale, const std::optional<at::Tensor>& super, int64_t group_size,
                                 int64_t out_features, const at::Tensor& like) {
  const int64_t per_super = check_int8_group(tiles, scale, super, group_size, out_features, "int8_group_dequantize");
  const int64_t N = out_features, K = tiles.size(1), G = group_size, groups = (K + G - 1) / G, supers = per_super ? groups / per_super : 0;
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const c10::Half* hp = super ? super->data_ptr<c10::Half>() : nullptr;
  at::Tensor out;
  with_group_scale_type(scale, [&](auto* scale_tag) {
    using S = std::remove_pointer_t<decltype(scale_tag)>;
    const S* sp = scale.data_ptr<S>();
    out = dequantize_transposed(N, K, tiles.size(0), like, "int8_group_dequantize", [&](int64_t t, int64_t k, auto* o) {
      const int8_t* w = wp + (t * K + k) * kTileN;
      const S* s = sp + t * groups * kTileN;
      const c10::Half* h = hp ? hp + t * supers * kTileN : nullptr;
#if TOKENMILL_SIMD
      for (int v = 0; v < kVecs; ++v) store(o + v * W, tokenmill_cpu::load_int8(w + v * W) * group_scale(s, h, per_super, k / G, v));
#else
      for (int r = 0; r < kTileN; ++r)
        o[r] = static_cast<std::remove_pointer_t<decltype(o)>>(static_cast<float>(w[r]) * group_scale_at(s, h, per_super, k / G, r));
#endif
    });
  });
  return out;
}

// int8_pack's tiles dequantized, transposed: W^T[k, n] = q[n, k] * scale[n], rounded once as
// quant_utils.dequantize_int8 does: int8_group_dequantize with one group of all K features.
at::Tensor int8_dequantize(const at::Tensor& tiles, const at::Tensor& scale, int64_t out_features, const at::Tensor& like) {
  const int64_t N = out_features, K = tiles.dim() == 3 ? tiles.size(1) : 0;
  check_packed(tiles, {(N + kTileN - 1) / kTileN, K, kTileN}, at::kChar, N, K, "int8_dequantize", "int8_pack");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_dequantize: scale must be float32 [N]");
  // The scales padded to whole tiles (the padded rows are never stored), as [tiles, 1 group, kTileN].
  const at::Tensor scale_tiles = at::constant_pad_nd(scale, {0, tiles.size(0) * kTileN - N}).view({tiles.size(0), 1, kTileN});
  return int8_group_dequantize(tiles, scale_tiles, std::nullopt, std::max<int64_t>(K, 1), N, like);
}

// int4_pack's tiles dequantized, transposed: W^T[k, n] = q * scale + min of row n's group of k, rounded
// twice as quant_utils.dequantize_int4 does.
at::Tensor int4_dequantize(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                           int64_t out_features, const at::Tensor& like) {
  check_int4(tiles, scale, min, group_size, out_features, "int4_dequantize");
  const int64_t N = out_features, K = kQuad * tiles.size(1), G = group_size, groups = (K + G - 1) / G;
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  at::Tensor out;
  with_scale_type(scale, [&](auto* scale_tag) {
    using S = std::remove_pointer_t<decltype(scale_tag)>;
    const S *sp = scale.data_ptr<S>(), *mp = min.numel() ? min.data_ptr<S>() : nullptr;
    out = dequantize_transposed(N, K, tiles.size(0), like, "int4_dequantize", [&](int64_t t, int64_t k, auto* o) {
      const uint8_t* quad = wp + (t * K + k) / kQuad * kQuadBytes;
      const int c = static_cast<int>(k % kQuad);
      const S *s = sp + (t * groups + k / G) * kTileN, *mn = mp ? mp + (t * groups + k / G) * kTileN : nullptr;
#if TOKENMILL_SIMD
      for (int d = 0; d < kLaneVecs; ++d) {  // lanes d * W..: rows d * W.. and 16 + d * W..
        const tokenmill_cpu::IVec lanes = tokenmill_cpu::load_u32(quad + d * W * 4);
        for (int h = 0; h < 2; ++h) {
          const int r = h * kHalfRows + d * W;
          const Vec sr = Vec::load(s + r);
          store(o + r, tokenmill_cpu::nibble_lanes(lanes, int4_shift(c, h)) * sr + (mn ? Vec::load(mn + r) : sr * Vec::set1(-8.f)));
        }
      }
#else
      for (int r = 0; r < kTileN; ++r) {
        uint32_t bits;
        std::memcpy(&bits, quad + (r % kHalfRows) * 4, 4);
        const float q = static_cast<float>((bits >> int4_shift(c, r / kHalfRows)) & 0xF);
        const float sr = static_cast<float>(s[r]);
        o[r] = static_cast<std::remove_pointer_t<decltype(o)>>(q * sr + (mn ? static_cast<float>(mn[r]) : -8.f * sr));
      }
#endif
    });
  });
  return out;
}

// Whether bf16 activations multiply by pairs with vdpbf16ps here (dense_linear's paired layout,
// int4_tile_dot_paired): the AVX-512 build on a CPU with AVX512-BF16.
bool bf16_pairs() { return kPairedBf16; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("bf16_pairs() -> bool", &bf16_pairs);
  m.def("dense_pack(Tensor w) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_dequantize(Tensor tiles, Tensor scale, int out_features, Tensor like) -> Tensor");
  m.def("int8_group_linear(Tensor x, Tensor tiles, Tensor scale, Tensor? super_scale, int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_group_dequantize(Tensor tiles, Tensor scale, Tensor? super_scale, int group_size, int out_features, Tensor like) -> Tensor");
  m.def("int4_pack(Tensor packed, Tensor scale, Tensor min) -> Tensor[]");
  m.def("int4_linear(Tensor x, Tensor tiles, Tensor scale, Tensor min, int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("int4_linear_a8(Tensor x, Tensor tiles, Tensor scale, Tensor min, int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor tiles, Tensor scale, Tensor min, int group_size, int out_features, Tensor like) -> Tensor");
  m.impl("dense_pack", c10::DispatchKey::CPU, &dense_pack);
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
  m.impl("int8_pack", c10::DispatchKey::CPU, &int8_pack);
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
  m.impl("int8_group_linear", c10::DispatchKey::CPU, &int8_group_linear);
  m.impl("int8_group_dequantize", c10::DispatchKey::CPU, &int8_group_dequantize);
  m.impl("int4_pack", c10::DispatchKey::CPU, &int4_pack);
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
  m.impl("int4_linear_a8", c10::DispatchKey::CPU, &int4_linear_a8);
  m.impl("int4_dequantize", c10::DispatchKey::CPU, &int4_dequantize);
}

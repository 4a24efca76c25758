// W8A8 linear layers (CPU): y = x W^T + b with W int8 per output channel and x quantized to int8
// per row (token) and group of G input features at run time (G = K: one scale per token), an int8 x
// int8 -> int32 GEMM per group, then y = (sum over groups of acc_g * x_scale[m, g]) * w_scale[n].
//
// Why groups: one scale per token leaves a model with outlier channels few levels for the rest of
// a row (SmolLM2-135M: qkv_proj's input reaches 5-8 in a few channels against a median absmax of
// 0.3-1; +8% perplexity); a scale per 128 channels of a token (vLLM's per-token-group scales, as
// its block-int8 and fp8 methods quantize activations) keeps them apart (+0.3%).
//
// Why not torch._int_mm: on CPU it calls oneDNN only where the CPU has AVX512-VNNI and otherwise
// runs a plain triple loop (ATen's _int_mm_out_cpu), so AVX2-only CPUs would get a scalar GEMM;
// and it returns int32, leaving the rescale to another pass (benchmarks/int8_gemm.py measures it).
//
// Formats (layers/quantization/w8a8.py holds the plain PyTorch reference):
//   weights  q [N, K] int8 in -127..127, scale [N] float32 (quantize_int8, as the `int8` method),
//            repacked once at load by w8a8_pack into panels of kPanel output channels:
//              packed[p][g][c][j] = q[p * kPanel + c][4 g + j]   (zero past N and past K)
//            so one vector load gives 4 consecutive k of kLanes channels, which is what one
//            VNNI / maddubs+madd step multiplies against 4 activation bytes broadcast to every lane.
//            w8a8_pack also returns each channel's sum of q per group of G inputs (for the VNNI
//            offset below), [groups, N] int32.
//   activations  per row and group of G: scale = absmax / 127 (at least FLT_MIN), q =
//            round_half_even(x / scale) clamped to -127..127 (the last group may be shorter); one
//            pass over each group (absmax, then divide and round while it is still in L1), all
//            rows once per call, before the GEMM. G is a multiple of 4 (one quad of k per step).
//
// The integer multiply, by build (vec.h's TOKENMILL_SIMD and the target's macros):
//   AVX512-VNNI  _mm512_dpbusd_epi32 multiplies u8 by s8: activations are stored as q + 128 (1..255)
//                and each channel's sums start at -128 * sum_k q_w[n, k] over the group
//                (the standard trick, exact: VNNI accumulates 4 products into int32 without saturation).
//   AVX512BW, AVX2  _mm_maddubs_epi16 (u8 x s8 -> pairs summed into saturating int16) then
//                _mm_madd_epi16 by ones (-> int32). With |q| <= 127 on both sides, the sign trick
//                (llama.cpp's): multiply |x| by w with x's sign moved onto it; every pair sum is at
//                most 2 * 127 * 127 = 32258 < 32767, so nothing saturates and no bit of the
//                activations is given up (7-bit activations would cost accuracy; this costs one
//                extra op per multiply).
//   scalar       the same packed layout in plain loops (the reference of the layout).
// Every build computes the exact int32 sums per group, and the same float32 arithmetic after them
//   s = 0; for each group g: s = s + float(acc_g) * x_scale[m, g];  y = s * w_scale[n] + bias[n]
// (a rounding per operation, in this order, no fused multiply-adds), rounded once to x's dtype:
// all builds give the same bits, and so does the PyTorch reference.
//
//   (AVX-512F without BW, which no x86-64-v4 CPU is, takes the scalar loops.)
//
// Work split: panels of kPanel channels (and, at prompt sizes, blocks of rows, see row_blocks)
// across threads; inside a task, kMR rows at a time against one panel, accumulators in registers.
// At decode sizes each panel comes from memory once and is read again from the caches for each
// tile of rows; meanwhile the thread prefetches the next panel it will compute into L2 (NextPanel).
// SmolLM2's 30 layers of weights streamed at 32 rows: 7.79 -> 7.15 ms (1.09x), as fast as with the
// weights in cache; at 8 rows 1.03x (a scratch benchmark, alternating in one process, Zen 5).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "norm_rows.h"
#include "vec.h"

namespace {

using tokenmill_cpu::dispatch_float_types;

#if TOKENMILL_SIMD == 512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W8A8_ISA_VNNI512 1
constexpr int kLanes = 16, kVecs = 4, kMR = 6;  // 24 accumulators + 4 weight vectors + 1 broadcast of 32 registers
constexpr int kOffset = 128;                    // u8 activations for dpbusd
constexpr const char* kIsa = "avx512_vnni";
#elif TOKENMILL_SIMD == 512 && defined(__AVX512BW__)
#define W8A8_ISA_MADDUBS512 1
constexpr int kLanes = 16, kVecs = 4, kMR = 4;
constexpr int kOffset = 0;
constexpr const char* kIsa = "avx512bw";
#elif TOKENMILL_SIMD == 256
#define W8A8_ISA_AVX2 1
constexpr int kLanes = 8, kVecs = 2, kMR = 4;  // 8 accumulators, 2 weight vectors and 5 temporaries of 16 registers
                                               // (3 x 2, 2 x 4, 4 x 1, 6 x 1 measured no faster)
constexpr int kOffset = 0;
constexpr const char* kIsa = "avx2";
#else
constexpr int kLanes = 8, kVecs = 2, kMR = 4;
constexpr int kOffset = 0;
constexpr const char* kIsa = "scalar";
#endif
constexpr int kPanel = kLanes * kVecs;  // output channels per packed panel
constexpr int kLinesPerStep = std::max(1, 4 * kPanel / 64);  // cache lines of a panel one step of k (4 inputs) reads

#if defined(W8A8_ISA_VNNI512) || defined(W8A8_ISA_MADDUBS512) || defined(W8A8_ISA_AVX2)
#define W8A8_SIMD 1
using tokenmill_cpu::Vec;
static_assert(Vec::W == kLanes, "the epilogue converts one int32 vector to one float Vec");
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline int32_t load4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- one step of the integer dot products, per ISA -----------------------------------------------

#if defined(W8A8_ISA_VNNI512)
using IVec = __m512i;
struct XBcast {  // 4 activation bytes in every lane
  __m512i x;
};
inline IVec ivec_load(const int8_t* p) { return _mm512_loadu_si512(p); }
inline XBcast xbcast(const uint8_t* p) { return {_mm512_set1_epi32(load4(p))}; }
inline IVec dot4(IVec acc, XBcast x, IVec w) {
  // = _mm512_dpbusd_epi32(acc, x.x, w), written as asm: with the intrinsic, gcc keeps the
  // accumulators of a tile on the stack and copies them around every step (measured 2x slower).
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x.x), "vm"(w));
  return acc;
}
inline Vec to_float(IVec a) { return {_mm512_cvtepi32_ps(a)}; }
#elif defined(W8A8_ISA_MADDUBS512)
using IVec = __m512i;
struct XBcast {
  __m512i abs;    // |x| as u8
  __mmask64 neg;  // the bytes where x < 0
};
inline IVec ivec_load(const int8_t* p) { return _mm512_loadu_si512(p); }
inline XBcast xbcast(const uint8_t* p) {
  const __m512i x = _mm512_set1_epi32(load4(p));
  return {_mm512_abs_epi8(x), _mm512_movepi8_mask(x)};
}
inline IVec dot4(IVec acc, XBcast x, IVec w) {
  // AVX-512 has no vpsignb: negate w where x < 0 with a masked subtract.
  const __m512i signed_w = _mm512_mask_sub_epi8(w, x.neg, _mm512_setzero_si512(), w);
  const __m512i pairs = _mm512_maddubs_epi16(x.abs, signed_w);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
inline Vec to_float(IVec a) { return {_mm512_cvtepi32_ps(a)}; }
#elif defined(W8A8_ISA_AVX2)
using IVec = __m256i;
struct XBcast {
  __m256i abs, x;
};
inline IVec ivec_load(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline XBcast xbcast(const uint8_t* p) {
  const __m256i x = _mm256_set1_epi32(load4(p));
  return {_mm256_abs_epi8(x), x};
}
inline IVec dot4(IVec acc, XBcast x, IVec w) {
  const __m256i pairs = _mm256_maddubs_epi16(x.abs, _mm256_sign_epi8(w, x.x));
  const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  // The add as asm, as VNNI's dot4: with the intrinsic gcc kept 3 of the tile's 8 accumulators on the
  // stack (a load and a store each per step). x86-64-v3 build on the Zen 4, in-process A/B over
  // SmolLM2's four shapes: 1.016-1.029x at 2,048 rows, level at 32 (the same bits).
  asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(quads));
  return acc;
}
inline Vec to_float(IVec a) { return {_mm256_cvtepi32_ps(a)}; }
#endif

#if defined(W8A8_SIMD)
// Where the int32 sums of channels [n, n + kLanes) start for one group: -kOffset * colsum (VNNI's u8
// offset; zeros for the other builds, which take signed activations), lanes past N zero.
inline IVec start_sums(const int32_t* colsum_row, int64_t n, int64_t N) {
#if defined(W8A8_ISA_VNNI512)
  const __mmask16 lanes = n + kLanes <= N ? __mmask16(0xFFFF) : n >= N ? __mmask16(0) : __mmask16((1u << (N - n)) - 1);
  const __m512i sums = _mm512_maskz_loadu_epi32(lanes, colsum_row + n);
  static_assert(kOffset == 128, "the shift below multiplies by kOffset");
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7));
#elif defined(W8A8_ISA_MADDUBS512)
  static_assert(kOffset == 0, "signed activations: the sums start at zero");
  return _mm512_setzero_si512();
#else
  static_assert(kOffset == 0, "signed activations: the sums start at zero");
  return _mm256_setzero_si256();
#endif
}

// kLanes per-channel floats from n, zeros past N (the layer's last channels).
inline Vec load_channels(const float* p, int64_t n, int64_t N) {
  if (n + kLanes <= N) return Vec::load(p + n);
  float tail[kLanes] = {};
  std::copy(p + n, p + N, tail);
  return Vec::load(tail);
}
#endif

// ---- activations: per-row quantize --------------------------------------------------------------

#if defined(W8A8_SIMD)
// W lanes of q = clamp(round_half_even(v), -127, 127) + offset, stored as W bytes.
inline void store_q8(uint8_t* dst, Vec v, int offset) {
#if TOKENMILL_SIMD == 512
  __m512i q = _mm512_cvtps_epi32(v.v);  // rounds to nearest even (the default MXCSR mode), as torch.round
  q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
  q = _mm512_add_epi32(q, _mm512_set1_epi32(offset));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q));  // truncates: the low byte
#else
  __m256i q = _mm256_cvtps_epi32(v.v);
  q = _mm256_min_epi32(_mm256_max_epi32(q, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
  q = _mm256_add_epi32(q, _mm256_set1_epi32(offset));
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  // offset is 0 in the AVX2 build (values -127..127: signed saturation keeps them); with 128, 1..255
  // would need the unsigned pack.
  const __m128i bytes = offset ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), bytes);
#endif
}
#endif

// Quantizes one group of K values into q[0, Kp) (bytes past K hold the quantized zero) and returns its scale.
template <typename T>
float quantize_group(const T* x, int64_t K, int64_t Kp, uint8_t* q, int offset) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(W8A8_SIMD)
  constexpr int W = Vec::W;
  Vec m = Vec::zero();
  for (; k + W <= K; k += W) {
    const Vec v = Vec::load(x + k);
    m = vmax(m, vmax(v, Vec::zero() - v));
  }
  amax = reduce_max(m);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float scale = std::max(amax / 127.f, FLT_MIN);  // an all-zero row quantizes to zeros
  k = 0;
#if defined(W8A8_SIMD)
  const Vec s = Vec::set1(scale);
  for (; k + W <= K; k += W) store_q8(q + k, Vec::load(x + k) / s, offset);  // a division, as the reference
#endif
  for (; k < K; ++k) {
    const float r = std::nearbyint(static_cast<float>(x[k]) / scale);
    q[k] = static_cast<uint8_t>(static_cast<int>(std::min(127.f, std::max(-127.f, r))) + offset);
  }
  for (; k < Kp; ++k) q[k] = static_cast<uint8_t>(offset);
  return scale;
}

// One row x [K] per group of G: q [Kp] (the padding in the last group), scales [groups].
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int64_t G, uint8_t* q, float* scales, int offset) {
  const int64_t groups = (K + G - 1) / G;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * G, k1 = std::min(K, k0 + G);
    scales[g] = quantize_group(x + k0, k1 - k0, (g + 1 == groups ? Kp : k1) - k0, q + k0, offset);
  }
}

// Every row of x [M, K] per group of G: q [M, Kp], scales [M, groups].
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t G, uint8_t* q, float* scales, int offset) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), groups = (K + G - 1) / G;
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, K, Kp, G, q + m * Kp, scales + m * groups, offset);
  });
}

// ---- the GEMM -----------------------------------------------------------------------------------

struct Epilogue {
  const int32_t* colsum;  // [groups, N] sum over the group of q_w[n, k]: each group's int32 sums start at -kOffset
                          // times it, so that they come out as the signed activations' sums
  const float* w_scale;   // [N]
  const float* bias;      // [Np] or nullptr
  const float* x_scale;   // [M, groups]
  int64_t N, Np, G, groups;
};

// y = s * w_scale[n] + bias[n] of the groups' float32 sum s, rounded once to T.
template <typename T>
inline T epilogue_one(float s, int64_t n, const Epilogue& e) {
  float y = s * e.w_scale[n];
  if (e.bias) y = y + e.bias[n];
  return static_cast<T>(y);
}

// The panel a thread computes next, prefetched into L2 while it computes this one (decode sizes,
// where each panel is read once from memory and then again from the caches for each tile of rows):
// each step of a tile also asks for `lines` of the next panel's 4 cache lines at that step, from
// `first_line`, so the tiles of rows between them ask for all 4. panel = nullptr: none.
struct NextPanel {
  const int8_t* panel = nullptr;
  int first_line = 0, lines = 0;
};

// Rows [m, m + MR) of y against one panel (channels [n0, n0 + kPanel)): xq rows of Kp bytes,
// panel Kp * kPanel bytes.
template <int MR, typename T>
inline void tile(const uint8_t* xq, int64_t Kp, const int8_t* panel, int64_t m, int64_t n0, const Epilogue& e, T* y,
                 const NextPanel& next) {
  const int64_t quads = Kp / 4, group_quads = e.G / 4;
#if defined(W8A8_SIMD)
  // The groups' float sums live in L1, not in registers: the int32 accumulators take them all (VNNI:
  // 24 of 32), and they are touched once per group of G / 4 steps.
  alignas(64) float totals[MR][kVecs][kLanes] = {};
  const uint8_t* xr = xq + m * Kp;
  for (int64_t a = 0; a < e.groups; ++a) {
    // The sums start at the group's offset correction rather than at zero: the same exact int32
    // result with no subtraction per accumulator and group (those ran on the ports the dot products
    // use). SmolLM2's 30 layers, Zen 4, alternating in one process: 1.04x at 8 rows, 1.02x at 32,
    // 1.05x at 128, the same bits.
    IVec acc[MR][kVecs];
    for (int v = 0; v < kVecs; ++v) acc[0][v] = start_sums(e.colsum + a * e.N, n0 + v * kLanes, e.N);
    for (int r = 1; r < MR; ++r)
      for (int v = 0; v < kVecs; ++v) acc[r][v] = acc[0][v];
    for (int64_t g = a * group_quads; g < std::min(quads, (a + 1) * group_quads); ++g) {
      const int8_t* wp = panel + g * (4 * kPanel);
      if (next.panel)
        for (int j = 0; j < next.lines; ++j) __builtin_prefetch(next.panel + g * (4 * kPanel) + (next.first_line + j) * 64, 0, 2);
      IVec w[kVecs];
      for (int v = 0; v < kVecs; ++v) w[v] = ivec_load(wp + v * 4 * kLanes);
      for (int r = 0; r < MR; ++r) {
        const XBcast x = xbcast(xr + r * Kp + 4 * g);
        for (int v = 0; v < kVecs; ++v) acc[r][v] = dot4(acc[r][v], x, w[v]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const Vec xs = Vec::set1(e.x_scale[(m + r) * e.groups + a]);
      for (int v = 0; v < kVecs; ++v) store(totals[r][v], Vec::load(totals[r][v]) + to_float(acc[r][v]) * xs);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int64_t n = n0 + v * kLanes;
    if (n >= e.N) break;
    const Vec ws = load_channels(e.w_scale, n, e.N);
    const Vec b = e.bias ? Vec::load(e.bias + n) : Vec::zero();
    for (int r = 0; r < MR; ++r) {
      Vec out = Vec::load(totals[r][v]) * ws;
      if (e.bias) out = out + b;
      T* yr = y + (m + r) * e.N + n;
      if (n + kLanes <= e.N) {
        store(yr, out);
      } else {  // the last channels of the layer
        float tmp[kLanes];
        store(tmp, out);
        for (int64_t j = 0; j < e.N - n; ++j) yr[j] = static_cast<T>(tmp[j]);
      }
    }
  }
#else
  float totals[MR][kPanel] = {};
  for (int64_t a = 0; a < e.groups; ++a) {
    int32_t acc[MR][kPanel];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kPanel; ++c) acc[r][c] = n0 + c < e.N ? -kOffset * e.colsum[a * e.N + n0 + c] : 0;
    for (int64_t g = a * group_quads; g < std::min(quads, (a + 1) * group_quads); ++g) {
      const int8_t* wp = panel + g * (4 * kPanel);
      for (int r = 0; r < MR; ++r) {
        const uint8_t* x = xq + (m + r) * Kp + 4 * g;
        for (int c = 0; c < kPanel; ++c)
          for (int j = 0; j < 4; ++j)
            acc[r][c] += static_cast<int32_t>(static_cast<int8_t>(x[j])) * static_cast<int32_t>(wp[c * 4 + j]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kPanel; ++c)
        totals[r][c] = totals[r][c] + static_cast<float>(acc[r][c]) * e.x_scale[(m + r) * e.groups + a];
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kPanel && n0 + c < e.N; ++c) y[(m + r) * e.N + n0 + c] = epilogue_one<T>(totals[r][c], n0 + c, e);
#endif
}

// tile<rows> for rows = 1..MR (the accumulators stay in registers only with a compile-time row count).
template <int MR, typename T>
inline void tile_rows(int rows, const uint8_t* xq, int64_t Kp, const int8_t* panel, int64_t m, int64_t n0, const Epilogue& e,
                      T* y, const NextPanel& next) {
  if constexpr (MR == 1) {
    tile<1>(xq, Kp, panel, m, n0, e, y, next);
  } else if (rows == MR) {
    tile<MR>(xq, Kp, panel, m, n0, e, y, next);
  } else {
    tile_rows<MR - 1>(rows, xq, Kp, panel, m, n0, e, y, next);
  }
}

// The activation group size: G (a positive multiple of 4), or K for 0 (one scale per token).
int64_t group_of(int64_t G, int64_t K, const char* op) {
  TORCH_CHECK(G >= 0 && G % 4 == 0, op, ": the activation group size must be 0 (one per token) or a positive multiple of 4, got ", G);
  return G == 0 ? std::max<int64_t>(round_up(K, 4), 4) : G;
}

// The weight's arguments of both GEMM ops: w_scale float32 [N], and packed and colsum as w8a8_pack made them
// for N channels of K inputs and activation groups of G.
void check_weight(const at::Tensor& packed, const at::Tensor& colsum, const at::Tensor& w_scale, int64_t K, int64_t G, const char* op) {
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.scalar_type() == at::kFloat, op, ": w_scale must be float32 [N]");
  const int64_t N = w_scale.size(0), panels = (N + kPanel - 1) / kPanel, Kp = round_up(K, 4), groups = (K + G - 1) / G;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(0) == panels &&
                  packed.size(1) == Kp * kPanel,
              op, ": packed weight must be w8a8_pack's output for ", N, " channels of ", K, " inputs (this build packs panels of ",
              kPanel, " channels)");
  TORCH_CHECK(colsum.dim() == 2 && colsum.size(0) == groups && colsum.size(1) == N && colsum.scalar_type() == at::kInt &&
                  colsum.is_contiguous(),
              op, ": colsum must be w8a8_pack's int32 [", groups, ", ", N, "] for activation groups of ", G);
}

// Tasks are (panel, block of rows) pairs, split evenly across threads in contiguous runs. The
// blocks of rows per panel: the fewest that leave the busiest thread within 2% of an even share,
// trying up to 8 (e.g. SmolLM2's 9 panels of 64 channels on 2 threads: 2 blocks at prompt sizes,
// rather than one thread doing 5 panels and the other 4). A block has at least 4 tiles of rows:
// each block streams its panel's weights again, which costs more than the imbalance at decode sizes.
inline int64_t row_blocks(int64_t panels, int64_t row_tiles, int64_t threads) {
  int64_t best = 1;
  double best_cost = 0.0;
  for (int64_t b = 1; b <= std::min<int64_t>(row_tiles / 4, 8); ++b) {
    const int64_t tasks = panels * b, per_thread = (tasks + threads - 1) / threads;
    const double cost = static_cast<double>(per_thread * threads) / static_cast<double>(tasks);  // 1: even
    if (b == 1 || cost < best_cost - 0.02) {
      best = b;
      best_cost = cost;
    }
  }
  return best;
}

// ---- ops ----------------------------------------------------------------------------------------

// The int8 weight [N, K] (-127..127) in this build's panel layout, and each channel's sum per group of G inputs.
std::tuple<at::Tensor, at::Tensor> w8a8_pack(const at::Tensor& w, int64_t group_size) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "w8a8_pack: w must be int8 [N, K]");
  const at::Tensor wc = w.contiguous();
  // -128 would break the sign trick of the maddubs builds (and is no symmetric int8 value).
  TORCH_CHECK(wc.numel() == 0 || wc.min().item<int8_t>() != -128, "w8a8_pack: weights must be in -127..127 (symmetric int8)");
  const int64_t N = wc.size(0), K = wc.size(1), Kp = round_up(K, 4), panels = (N + kPanel - 1) / kPanel;
  const int64_t G = group_of(group_size, K, "w8a8_pack"), groups = (K + G - 1) / G;
  at::Tensor packed = at::zeros({panels, Kp * kPanel}, wc.options());
  at::Tensor colsum = at::zeros({groups, N}, wc.options().dtype(at::kInt));
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = colsum.data_ptr<int32_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int8_t* panel = dst + (n / kPanel) * Kp * kPanel;
      const int64_t c = n % kPanel;
      for (int64_t k = 0; k < K; ++k) {
        const int8_t v = src[n * K + k];
        panel[(k / 4) * 4 * kPanel + c * 4 + k % 4] = v;
        sums[(k / G) * N + n] += v;
      }
    }
  });
  return {packed, colsum};
}

// Symmetric int8 of x [M, K] per row and group of G: (q int8 [M, K], scale float32 [M, groups]), the format the GEMM reads.
std::tuple<at::Tensor, at::Tensor> w8a8_quantize(const at::Tensor& x, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2, "w8a8_quantize: x must be [rows, features]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), G = group_of(group_size, K, "w8a8_quantize");
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, (K + G - 1) / G}, xc.options().dtype(at::kFloat));
  dispatch_float_types(xc.scalar_type(), "w8a8_quantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_rows<T>(xc.data_ptr<T>(), M, K, K, G, reinterpret_cast<uint8_t*>(q.data_ptr<int8_t>()), scale.data_ptr<float>(), 0);
  });
  return {q, scale};
}

// The GEMM of activations already quantized (quantize_rows' format: xq [M, Kp] with this build's
// offset, xs [M, groups]) into y [M, N] of dtype T.
void gemm_quantized(const uint8_t* xq, const float* xs, int64_t M, int64_t Kp, int64_t G, int64_t groups, const at::Tensor& packed,
                    const at::Tensor& colsum, const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, at::Tensor& y,
                    const char* op) {
  const int64_t N = w_scale.size(0), panels = packed.size(0), Np = panels * kPanel;
  // The weight's per-channel vectors are read where they are (the sums' offsets and the scales: no per-call
  // copy, which with its zero fill took ~15% of a one-row call's samples); the bias, in the model dtype,
  // is widened to float32 and padded to whole panels.
  std::vector<float> bs;
  const at::Tensor wsc = w_scale.contiguous();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [out_features]");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    bs.assign(Np, 0.f);
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + N, bs.begin());
  }
  if (M == 0 || N == 0) return;
  dispatch_float_types(y.scalar_type(), op, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const Epilogue e{colsum.data_ptr<int32_t>(), wsc.data_ptr<float>(), bs.empty() ? nullptr : bs.data(), xs, N, Np, G, groups};
    const int64_t row_tiles = (M + kMR - 1) / kMR;
    const int64_t blocks = row_blocks(panels, row_tiles, at::get_num_threads());
    const int64_t rows_per_block = (row_tiles + blocks - 1) / blocks * kMR;
    const int8_t* pw = packed.data_ptr<int8_t>();
    T* yp = y.data_ptr<T>();
    const bool prefetch = blocks == 1;  // decode sizes: one block of rows per panel
    const int lines_per_tile = static_cast<int>((kLinesPerStep + row_tiles - 1) / row_tiles);
    at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = t / blocks, m0 = (t % blocks) * rows_per_block, m1 = std::min(M, m0 + rows_per_block);
        NextPanel next;
        if (prefetch && t + 1 < end) next.panel = pw + (p + 1) * Kp * kPanel;
        for (int64_t m = m0; m < m1; m += kMR) {
          const int i = static_cast<int>((m - m0) / kMR);
          next.first_line = std::min(kLinesPerStep, i * lines_per_tile);
          next.lines = std::min(kLinesPerStep - next.first_line, lines_per_tile);
          tile_rows<kMR>(static_cast<int>(std::min<int64_t>(kMR, m1 - m)), xq, Kp, pw + p * Kp * kPanel, m, p * kPanel, e, yp, next);
        }
      }
    });
  });
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& bias, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2, "w8a8_linear: x must be [rows, in_features]");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), Kp = round_up(K, 4);
  const int64_t G = group_of(group_size, K, "w8a8_linear"), groups = (K + G - 1) / G;
  check_weight(packed, colsum, w_scale, K, G, "w8a8_linear");
  const int64_t N = w_scale.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  std::unique_ptr<uint8_t[]> xq(new uint8_t[M * Kp]);  // every byte is written by quantize_rows
  std::vector<float> xs(M * groups);
  dispatch_float_types(xc.scalar_type(), "w8a8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    quantize_rows<T>(xc.data_ptr<T>(), M, K, Kp, G, xq.get(), xs.data(), kOffset);
  });
  gemm_quantized(xq.get(), xs.data(), M, Kp, G, groups, packed, colsum, w_scale, bias, y, "w8a8_linear");
  return y;
}

// ---- the RMSNorm before a w8a8 layer, with its output quantized (PPL.LLM's fusion) ----------------
//
// w8a8_rms_norm_quant(x, residual, weight, eps, G) is w8a8_linear's quantize of rms_norm(x) (of
// add_rms_norm(residual, x) with a residual, which it updates in place the same way) in one pass per
// row: each row is normalized into a buffer in L1 (norm_rows.h, the plain norm's code: its rounding to
// the model dtype included) and quantized from there, so the norm's output never goes to memory and
// is not read back by the GEMM's quantize. It returns the activations in the GEMM's own format (xq
// [M, Kp] bytes with this build's offset, uint8; xs [M, groups]) for w8a8_linear_quantized, which
// gives exactly w8a8_linear(rms_norm(...)): the same normalized values, quantized by the same code.

std::tuple<at::Tensor, at::Tensor> w8a8_rms_norm_quant(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                       const at::Tensor& weight, double eps, int64_t group_size) {
  const char* op = "w8a8_rms_norm_quant";
  const bool add = residual.has_value() && residual->defined();
  tokenmill_cpu::check_norm_args(x, weight, add ? &*residual : nullptr, op);
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, 4), G = group_of(group_size, K, op), groups = (K + G - 1) / G;
  at::Tensor q = at::empty({M, Kp}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({M, groups}, x.options().dtype(at::kFloat));
  dispatch_float_types(x.scalar_type(), op, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = x.data_ptr<T>();
    T* res = add ? residual->data_ptr<T>() : nullptr;
    const T* w = weight.data_ptr<T>();
    uint8_t* qp = q.data_ptr<uint8_t>();
    float* sp = scales.data_ptr<float>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, M, tokenmill_cpu::norm_grain(K), [&](int64_t begin, int64_t end) {
      // The normalized row, on the stack for the usual widths (a heap buffer measured ~0.3 us a call at one row).
      constexpr int64_t kStackRow = 8192;
      T stack_row[kStackRow];
      std::vector<T> heap_row(K > kStackRow ? K : 0);
      T* normed = K > kStackRow ? heap_row.data() : stack_row;
      for (int64_t m = begin; m < end; ++m) {
        const T* row = xp + m * stride;
        if (add) {
          tokenmill_cpu::add_row(res + m * K, row, K);
          row = res + m * K;
        }
        tokenmill_cpu::rms_norm_row(row, w, normed, K, static_cast<float>(eps));
        quantize_row(normed, K, Kp, G, qp + m * Kp, sp + m * groups, kOffset);
      }
    });
  });
  return {q, scales};
}

at::Tensor w8a8_linear_quantized(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& packed, const at::Tensor& colsum,
                                 const at::Tensor& w_scale, const std::optional<at::Tensor>& bias, int64_t group_size,
                                 at::ScalarType dtype) {
  const char* op = "w8a8_linear_quantized";
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous() && scales.dim() == 2 && scales.size(0) == q.size(0) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              op, ": q and scales must be w8a8_rms_norm_quant's output");
  const int64_t M = q.size(0), Kp = q.size(1), groups = scales.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == Kp * kPanel, op, ": the activations have ", Kp,
              " (padded) features, the packed weight ", packed.size(1) / kPanel);
  // K itself is not in the activations: Kp gives the same groups (a multiple of G is one of 4, so no group
  // boundary falls between K and Kp) and the same checks of the packed weight.
  const int64_t G = group_of(group_size, Kp, op);
  TORCH_CHECK(groups == (Kp + G - 1) / G, op, ": ", groups, " activation scales per row, but groups of ", G, " over ", Kp,
              " features make ", (Kp + G - 1) / G);
  check_weight(packed, colsum, w_scale, Kp, G, op);
  at::Tensor y = at::empty({M, w_scale.size(0)}, q.options().dtype(dtype));
  gemm_quantized(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), M, Kp, G, groups, packed, colsum, w_scale, bias, y, op);
  return y;
}

std::string w8a8_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("w8a8_pack(Tensor w, int group_size) -> (Tensor, Tensor)");
  m.def("w8a8_quantize(Tensor x, int group_size) -> (Tensor, Tensor)");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor colsum, Tensor w_scale, Tensor? bias, int group_size) -> Tensor");
  m.def("w8a8_rms_norm_quant(Tensor x, Tensor(a!)? residual, Tensor weight, float eps, int group_size) -> (Tensor, Tensor)");
  m.def("w8a8_linear_quantized(Tensor q, Tensor scales, Tensor packed, Tensor colsum, Tensor w_scale, Tensor? bias, int group_size, "
        "ScalarType dtype) -> Tensor");
  m.def("w8a8_isa() -> str", &w8a8_isa);
  m.impl("w8a8_pack", c10::DispatchKey::CPU, &w8a8_pack);
  m.impl("w8a8_quantize", c10::DispatchKey::CPU, &w8a8_quantize);
  m.impl("w8a8_linear", c10::DispatchKey::CPU, &w8a8_linear);
  m.impl("w8a8_rms_norm_quant", c10::DispatchKey::CPU, &w8a8_rms_norm_quant);
  m.impl("w8a8_linear_quantized", c10::DispatchKey::CPU, &w8a8_linear_quantized);
}

// Linear layers for the few rows of a decode step (CPU): y = x W^T + b with W a float32, bf16 or
// fp16 weight in x's dtype (`dense_linear`), or weight-only quantized with activations kept in
// float: int8 with a scale per output row (`int8_linear`: W[n, k] = q[n, k] * scale[n]) or int4 with
// a scale and a min per row and group of input features (`int4_linear`: W = q * scale + min), each
// packed once (`dense_pack`, `int8_pack`, `int4_pack`); and the quantized ones dequantized to the
// model dtype for prompt chunks (`int8_dequantize`, `int4_dequantize`: one dequantize, then a float
// GEMM, since a prompt's cost is the multiply, not the bytes).
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
// the ISA's registers (32 with AVX-512, 16 with AVX2).
constexpr int kMaxRows = Vec::kRegisters >= 32 ? 4 : 2;
#else
constexpr int kMaxRows = 4;
#endif

#if TOKENMILL_SIMD == 512 && defined(__AVX512BF16__)
constexpr bool kPairedBf16 = true;
#else
constexpr bool kPairedBf16 = false;
#endif

// Whether weights of type T are packed by pairs of input features (for vdpbf16ps).
template <typename T>
constexpr bool paired() {
  return kPairedBf16 && std::is_same_v<T, c10::BFloat16>;
}

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
#endif

// out[i * kTileN + r] = sum_k x[i * K + k] * W[r, k] for i < MT, r < kTileN: one packed tile of
// float or int8 weights against MT rows of x (float32).
template <typename WT, int MT>
inline void tile_dot(const float* x, int64_t K, const WT* tile, float* out) {
#if TOKENMILL_SIMD
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t k = 0; k < K; ++k) {
    Vec xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = Vec::set1(x[i * K + k]);
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

#if TOKENMILL_SIMD == 512 && defined(__AVX512BF16__)
// The same for bf16 weights packed by pairs, against MT rows of x as bf16 pairs (ceil(K / 2) of
// them per row, the last one zero-padded when K is odd).
template <int MT>
inline void tile_dot_paired(const uint32_t* x_pairs, int64_t pairs, const c10::BFloat16* tile, float* out) {
  __m512 acc[MT][kVecs];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = (__m512bh)_mm512_set1_epi32(static_cast<int>(x_pairs[i * pairs + p]));
    for (int v = 0; v < kVecs; ++v) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(tile + (p * kTileN + v * W) * 2);
      for (int i = 0; i < MT; ++i) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv, xb[i]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(out + i * kTileN + v * W, acc[i][v]);
}
#endif

// int4 weights (decode_linear's int4 layout, see int4_pack): per tile and input feature k, 16 bytes,
// byte r holding row r's 4-bit value in its low nibble and row r + 16's in its high one; a scale and
// a min per row and group of G input features ([tiles, groups, kTileN] float32 each): W = q * scale +
// min. Sums of q * x accumulate per group, then take the group's scale; the mins multiply each
// row of x's sum over the group (x_sums [MT, groups]).
#if TOKENMILL_SIMD
// Rows of x per int4 pass: two sets of accumulators (the group's and the total) must fit too.
constexpr int kMaxRowsInt4 = Vec::kRegisters >= 32 ? 4 : 1;
#else
constexpr int kMaxRowsInt4 = 4;
#endif
constexpr int kNibbleBytes = kTileN / 2;  // bytes per tile and input feature

template <int MT>
inline void int4_tile_dot(const float* x, int64_t K, int64_t G, const uint8_t* tile, const float* scale, const float* min,
                          const float* x_sums, float* out) {
  const int64_t groups = (K + G - 1) / G;
#if TOKENMILL_SIMD
  Vec acc[MT][kVecs];
  zero_rows<MT>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[MT][kVecs];
    zero_rows<MT>(part);
    for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) {
      Vec xb[MT];
      for (int i = 0; i < MT; ++i) xb[i] = Vec::set1(x[i * K + k]);
      for (int h = 0; h < kNibbleBytes / W; ++h) {  // W bytes: rows h * W.. (low nibbles) and 16 + h * W.. (high)
        Vec lo, hi;
        tokenmill_cpu::load_nibbles(tile + k * kNibbleBytes + h * W, lo, hi);
        for (int i = 0; i < MT; ++i) {
          part[i][h] = fmadd(lo, xb[i], part[i][h]);
          part[i][h + kNibbleBytes / W] = fmadd(hi, xb[i], part[i][h + kNibbleBytes / W]);
        }
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const Vec s = Vec::load(scale + g * kTileN + v * W), mn = Vec::load(min + g * kTileN + v * W);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(mn, Vec::set1(x_sums[i * groups + g]), fmadd(part[i][v], s, acc[i][v]));
    }
  }
  store_rows<MT>(acc, out);
#else
  std::fill(out, out + MT * kTileN, 0.f);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < kTileN; ++r) {
      const int byte = r % kNibbleBytes, shift = r < kNibbleBytes ? 0 : 4;
      for (int i = 0; i < MT; ++i) {
        float part = 0.f;
        for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k)
          part += static_cast<float>((tile[k * kNibbleBytes + byte] >> shift) & 0xF) * x[i * K + k];
        out[i * kTileN + r] += part * scale[g * kTileN + r] + min[g * kTileN + r] * x_sums[i * groups + g];
      }
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
// of 32 weights, byte j holds weight j and weight j + 16), scale and min [N, groups]. Returns the
// tiles [ceil(N / kTileN), K, kTileN / 2] and the scales and mins [tiles, groups, kTileN] (padded
// rows: zeros).
std::vector<at::Tensor> int4_pack(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& min) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.size(1) % 16 == 0,
              "int4_pack: packed must be uint8 [out_features, in_features / 2] in blocks of 16 bytes");
  const int64_t N = packed.size(0), K = 2 * packed.size(1), tiles = (N + kTileN - 1) / kTileN;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && min.sizes() == scale.sizes(), "int4_pack: scale and min must be [out_features, groups]");
  const at::Tensor blocks = packed.contiguous().view({N, K / 32, 1, 16});
  const at::Tensor q = at::cat({blocks.bitwise_and(0xF), blocks.bitwise_right_shift(4)}, 2).view({N, K});
  const at::Tensor rows = at::constant_pad_nd(q, {0, 0, 0, tiles * kTileN - N}).view({tiles, kTileN, K});
  const at::Tensor bytes = rows.slice(1, 0, kNibbleBytes).bitwise_or(rows.slice(1, kNibbleBytes, kTileN).bitwise_left_shift(4));
  auto by_tile = [&](const at::Tensor& t) {
    return at::constant_pad_nd(t.to(at::kFloat), {0, 0, 0, tiles * kTileN - N}).view({tiles, kTileN, t.size(1)}).transpose(1, 2).contiguous();
  };
  return {bytes.transpose(1, 2).contiguous(), by_tile(scale), by_tile(min)};
}

void check_int4(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t G, int64_t N, const char* op) {
  TORCH_CHECK(G > 0, op, ": group size must be positive");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.size(0) == (N + kTileN - 1) / kTileN &&
                  tiles.size(2) == kNibbleBytes, op, ": the weight must be int4_pack's layout of ", N, " output rows");
  const int64_t groups = (tiles.size(1) + G - 1) / G;
  for (const at::Tensor* t : {&scale, &min})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == at::IntArrayRef({tiles.size(0), groups, kTileN}), op,
                ": scale and min must be int4_pack's [tiles, ", groups, " groups, ", kTileN, "]");
}

// y [M, N] in T: y[m, n] = out[m, n] * (scale ? scale[n] : 1) + bias[n], rounded once, with
// tile(t, m, rows, out) computing a tile's sums for `rows` (<= max_rows) rows of x from row m into
// out [rows, kTileN]. Tiles hold tile_bytes of weights each; tasks get at least ~64 KB of them, so
// a decode step's small layers are not cut into crumbs.
template <typename T, typename Tile>
at::Tensor run_tiles(const at::Tensor& x, int64_t N, int64_t tile_bytes, int max_rows, const float* scale,
                     const std::vector<float>& bias, Tile&& tile) {
  const int64_t M = x.size(0), tiles = (N + kTileN - 1) / kTileN;
  at::Tensor y = at::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(tile_bytes, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kMaxRows * kTileN];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileN;
      const int cols = static_cast<int>(std::min<int64_t>(kTileN, N - n));
      for (int64_t m = 0; m < M; m += max_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(max_rows, M - m));
        tile(t, m, rows, out);
        for (int i = 0; i < rows; ++i)
          for (int r = 0; r < cols; ++r)
            yp[(m + i) * N + n + r] = static_cast<T>(out[i * kTileN + r] * (scale ? scale[n + r] : 1.f) + bias[n + r]);
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
  return run_tiles<T>(x, N, tile_size * static_cast<int64_t>(sizeof(WT)), kMaxRows, scale, bias, [&](int64_t t, int64_t m, int rows, float* out) {
    with_rows(rows, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
#if TOKENMILL_SIMD == 512 && defined(__AVX512BF16__)
      if constexpr (kPaired) tile_dot_paired<MT>(x_pairs.data() + m * steps, steps, wp + t * tile_size, out);
#endif
      if constexpr (!kPaired) tile_dot<WT, MT>(xf.data() + m * K, K, wp + t * tile_size, out);
    });
  });
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

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                       int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "int4_linear: x must be [rows, in_features]");
  check_int4(tiles, scale, min, group_size, out_features, "int4_linear");
  const int64_t M = x.size(0), K = x.size(1), G = group_size, groups = (K + G - 1) / G;
  TORCH_CHECK(tiles.size(1) == K, "int4_linear: x has ", K, " features, the weight ", tiles.size(1));
  const std::vector<float> b = bias_as_float(bias, out_features, "int4_linear");
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *mp = min.data_ptr<float>();
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int4_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const std::vector<float> xf = rows_as_float<T>(x);
    std::vector<float> x_sums(M * groups, 0.f);  // each row's sum over each group: the mins' terms
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) x_sums[m * groups + k / G] += xf[m * K + k];
    y = run_tiles<T>(x, out_features, K * kNibbleBytes, kMaxRowsInt4, nullptr, b, [&](int64_t t, int64_t m, int rows, float* out) {
      with_rows(rows, [&](auto mt) {
        int4_tile_dot<decltype(mt)::value>(xf.data() + m * K, K, G, wp + t * K * kNibbleBytes, sp + t * groups * kTileN,
                                           mp + t * groups * kTileN, x_sums.data() + m * groups, out);
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

// int8_pack's tiles dequantized, transposed: W^T[k, n] = q[n, k] * scale[n], rounded once as
// quant_utils.dequantize_int8 does.
at::Tensor int8_dequantize(const at::Tensor& tiles, const at::Tensor& scale, int64_t out_features, const at::Tensor& like) {
  const int64_t N = out_features, K = tiles.dim() == 3 ? tiles.size(1) : 0;
  check_packed(tiles, {(N + kTileN - 1) / kTileN, K, kTileN}, at::kChar, N, K, "int8_dequantize", "int8_pack");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_dequantize: scale must be float32 [N]");
  // The scales padded to whole tiles (the padded rows are never stored).
  const at::Tensor scale_tiles = at::constant_pad_nd(scale, {0, tiles.size(0) * kTileN - N});
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const float* sp = scale_tiles.data_ptr<float>();
  return dequantize_transposed(N, K, tiles.size(0), like, "int8_dequantize", [&](int64_t t, int64_t k, auto* o) {
    const int8_t* w = wp + (t * K + k) * kTileN;
    const float* s = sp + t * kTileN;
#if TOKENMILL_SIMD
    for (int v = 0; v < kVecs; ++v) store(o + v * W, tokenmill_cpu::load_int8(w + v * W) * Vec::load(s + v * W));
#else
    for (int r = 0; r < kTileN; ++r) o[r] = static_cast<std::remove_pointer_t<decltype(o)>>(static_cast<float>(w[r]) * s[r]);
#endif
  });
}

// int4_pack's tiles dequantized, transposed: W^T[k, n] = q * scale + min of row n's group of k, rounded
// twice as quant_utils.dequantize_int4 does.
at::Tensor int4_dequantize(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                           int64_t out_features, const at::Tensor& like) {
  check_int4(tiles, scale, min, group_size, out_features, "int4_dequantize");
  const int64_t N = out_features, K = tiles.size(1), G = group_size, groups = (K + G - 1) / G;
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *mp = min.data_ptr<float>();
  return dequantize_transposed(N, K, tiles.size(0), like, "int4_dequantize", [&](int64_t t, int64_t k, auto* o) {
    const uint8_t* w = wp + (t * K + k) * kNibbleBytes;
    const float *s = sp + (t * groups + k / G) * kTileN, *mn = mp + (t * groups + k / G) * kTileN;
#if TOKENMILL_SIMD
    for (int h = 0; h < kNibbleBytes / W; ++h) {  // W bytes: rows h * W.. (low nibbles) and 16 + h * W.. (high)
      Vec lo, hi;
      tokenmill_cpu::load_nibbles(w + h * W, lo, hi);
      store(o + h * W, lo * Vec::load(s + h * W) + Vec::load(mn + h * W));
      store(o + kNibbleBytes + h * W, hi * Vec::load(s + kNibbleBytes + h * W) + Vec::load(mn + kNibbleBytes + h * W));
    }
#else
    for (int r = 0; r < kTileN; ++r) {
      const float q = static_cast<float>((w[r % kNibbleBytes] >> (r < kNibbleBytes ? 0 : 4)) & 0xF);
      o[r] = static_cast<std::remove_pointer_t<decltype(o)>>(q * s[r] + mn[r]);
    }
#endif
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("dense_pack(Tensor w) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_dequantize(Tensor tiles, Tensor scale, int out_features, Tensor like) -> Tensor");
  m.def("int4_pack(Tensor packed, Tensor scale, Tensor min) -> Tensor[]");
  m.def("int4_linear(Tensor x, Tensor tiles, Tensor scale, Tensor min, int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("int4_dequantize(Tensor tiles, Tensor scale, Tensor min, int group_size, int out_features, Tensor like) -> Tensor");
  m.impl("dense_pack", c10::DispatchKey::CPU, &dense_pack);
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
  m.impl("int8_pack", c10::DispatchKey::CPU, &int8_pack);
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
  m.impl("int4_pack", c10::DispatchKey::CPU, &int4_pack);
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
  m.impl("int4_dequantize", c10::DispatchKey::CPU, &int4_dequantize);
}

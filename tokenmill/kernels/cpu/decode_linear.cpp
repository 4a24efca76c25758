// Linear layers for the few rows of a decode step (CPU): y = x W^T + b with W a float32, bf16 or
// fp16 weight in x's dtype (`dense_linear`) or an int8 one with a scale per output row (`int8_linear`,
// weight-only W8A16: W[n, k] = q[n, k] * scale[n]), packed once by `dense_pack` / `int8_pack`.
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
// bytes of weights where widening to float32 takes several. int8 weights are widened to float32 in
// registers. The work is split over tiles in tasks of at least ~64 KB of weights. Prompt chunks
// (many rows) are cheaper in oneDNN's GEMM (the Python side chooses: layers/quantization/
// unquantized.py, weight_only.py).
//
// Sums accumulate in float32 in another order than torch's GEMMs: results agree with F.linear
// within the rounding of the sums (tests/test_quant_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tokenmill_cpu::dispatch_float_types;

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

// out[i * kTileN + r] = sum_k x[i * K + k] * W[r, k] for i < MT, r < kTileN: one packed tile of
// float or int8 weights against MT rows of x (float32).
template <typename WT, int MT>
inline void tile_dot(const float* x, int64_t K, const WT* tile, float* out) {
#if TOKENMILL_SIMD
  Vec acc[MT][kVecs];
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) acc[i][v] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec xb[MT];
    for (int i = 0; i < MT; ++i) xb[i] = Vec::set1(x[i * K + k]);
    for (int v = 0; v < kVecs; ++v) {
      const Vec wv = load_weights(tile + k * kTileN + v * W);
      for (int i = 0; i < MT; ++i) acc[i][v] = fmadd(wv, xb[i], acc[i][v]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int v = 0; v < kVecs; ++v) store(out + i * kTileN + v * W, acc[i][v]);
#else
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < kTileN; ++r) out[i * kTileN + r] = 0.f;
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

// f(integral_constant<MT>) for the rows of x in one pass (MT <= kMaxRows).
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

std::vector<float> bias_as_float(const std::optional<at::Tensor>& bias, int64_t N, const char* op) {
  std::vector<float> out(N, 0.f);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [out_features]");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + N, out.begin());
  }
  return out;
}

// y [M, N] in x's dtype T: y[m, n] = (sum_k x[m, k] W[n, k]) * (scale ? scale[n] : 1) + bias[n], rounded
// once, W packed in tiles of WT (T itself, or int8); paired: bf16 pairs for vdpbf16ps.
template <typename T, typename WT, bool kPaired>
at::Tensor tiled_linear(const at::Tensor& x, const WT* wp, int64_t N, const float* scale, const std::vector<float>& bias) {
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTileN - 1) / kTileN;
  const int64_t steps = kPaired ? (K + 1) / 2 : K;  // per tile: input features, or pairs of them
  at::Tensor y = at::empty({M, N}, x.options());
  // x once per call: float32 for the fused multiply-adds, or bf16 pairs as uint32 for vdpbf16ps.
  const at::Tensor xc = x.contiguous();
  const T* xp = xc.data_ptr<T>();
  std::vector<float> xf;
  std::vector<uint32_t> x_pairs;
  if constexpr (kPaired) {
    x_pairs.assign(M * steps, 0u);
    for (int64_t m = 0; m < M; ++m) std::memcpy(x_pairs.data() + m * steps, xp + m * K, K * sizeof(T));
  } else {
    xf.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  }
  T* yp = y.data_ptr<T>();
  const int64_t tile_size = steps * kTileN * (kPaired ? 2 : 1);
  // A task of at least ~64 KB of weights, so a decode step's small layers are not cut into crumbs.
  const int64_t grain = std::max<int64_t>(1, 65536 / (tile_size * static_cast<int64_t>(sizeof(WT))));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kMaxRows * kTileN];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileN;
      const int cols = static_cast<int>(std::min<int64_t>(kTileN, N - n));
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
        with_rows(rows, [&](auto mt) {
          constexpr int MT = decltype(mt)::value;
#if TOKENMILL_SIMD == 512 && defined(__AVX512BF16__)
          if constexpr (kPaired) tile_dot_paired<MT>(x_pairs.data() + m * steps, steps, wp + t * tile_size, out);
#endif
          if constexpr (!kPaired) tile_dot<WT, MT>(xf.data() + m * K, K, wp + t * tile_size, out);
        });
        for (int i = 0; i < rows; ++i)
          for (int r = 0; r < cols; ++r)
            yp[(m + i) * N + n + r] = static_cast<T>(out[i * kTileN + r] * (scale ? scale[n + r] : 1.f) + bias[n + r]);
      }
    }
  });
  return y;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("dense_pack(Tensor w) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int out_features, Tensor? bias) -> Tensor");
  m.impl("dense_pack", c10::DispatchKey::CPU, &dense_pack);
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
  m.impl("int8_pack", c10::DispatchKey::CPU, &int8_pack);
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}

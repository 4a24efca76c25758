// Full-precision linear layers for the few rows of a decode step (CPU): y = x W^T + b with W a
// plain [N, K] float32, bf16 or fp16 matrix in x's dtype (`dense_linear`).
//
// A decode step reads every weight once for one to a few rows of x, so its cost is the bytes read
// plus what each call costs besides. oneDNN's prepacked matmul costs about 9 us a call beyond its
// reads (121 calls a token on SmolLM2: ~1 ms); this kernel under 2 us. It streams weight rows
// straight into float32 fused multiply-adds: a tile of consecutive weight rows against up to
// kMaxRows rows of x held as float32, a tile's rows x rows accumulators in registers. Half-precision
// tiles are 4 rows, with the next tile's rows prefetched as it goes (a tile's rows are 4 streams,
// which the hardware prefetchers follow badly: the prefetch took a 56 MB bf16 matrix from 37 to
// 55 GB/s on Zen 5); float32 rows fill a cache line per vector and stream fastest one row at a time
// (the prefetchers' one stream; measured on Zen 5). The work is split over output channels in
// tasks of at least ~64 KB of weights. Prompt chunks (many rows) are cheaper in
// oneDNN's GEMM (the Python side chooses: layers/quantization/unquantized.py).
//
// Sums accumulate in float32 in another order than torch's GEMMs: results agree with F.linear
// within the rounding of the sums (tests/test_decode_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "quant_rows.h"
#include "vec.h"

namespace {

using tokenmill_cpu::check_x;
using tokenmill_cpu::dispatch_float_types;
using tokenmill_cpu::rows_as_float;

constexpr int kTileN = 4;  // the most weight rows per tile

// Weight rows per tile for weights of type T (see the top).
template <typename T>
constexpr int tile_rows() {
  return sizeof(T) == 4 ? 1 : kTileN;
}

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
// Rows of x per pass: kTileN x rows accumulators, the rows' vectors of x and a weight vector within
// the ISA's registers (32 with AVX-512, 16 with AVX2).
constexpr int kMaxRows = Vec::kRegisters >= 32 ? 4 : 2;
#else
constexpr int kMaxRows = 4;
#endif

// out[i * kTileN + j] = sum_k x[i * K + k] * w[j * K + k] for i < MT, j < NT: NT weight rows
// against MT rows of x. `next` is the next tile's first row, to prefetch (nullptr: none).
template <typename T, int MT, int NT>
inline void tile_dot(const float* x, int64_t K, const T* w, const T* next, float* out) {
  float sums[MT][NT] = {};
  int64_t k = 0;
#if TOKENMILL_SIMD
  Vec acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = Vec::zero();
  for (; k + W <= K; k += W) {
    Vec xv[MT];
    for (int i = 0; i < MT; ++i) xv[i] = Vec::load(x + i * K + k);
    for (int j = 0; j < NT; ++j) {
      // A prefetch per vector: a line may be asked for twice, which costs less than a branch.
      if (next) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
      const Vec wv = Vec::load(w + j * K + k);
      for (int i = 0; i < MT; ++i) acc[i][j] = fmadd(wv, xv[i], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) sums[i][j] = reduce_add(acc[i][j]);
#endif
  for (; k < K; ++k)
    for (int j = 0; j < NT; ++j) {
      const float wk = static_cast<float>(w[j * K + k]);
      for (int i = 0; i < MT; ++i) sums[i][j] += x[i * K + k] * wk;
    }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[i * kTileN + j] = sums[i][j];
}

// f(integral_constant<MT>, integral_constant<NT>) for the row counts of one tile (MT <= kMaxRows, NT <= NMax).
template <int NMax, typename F>
inline void with_tile(int rows, int cols, F&& f) {
  auto by_cols = [&](auto mt) {
    switch (NMax == 1 ? 1 : cols) {
      case 1: f(mt, std::integral_constant<int, 1>{}); break;
      case 2: f(mt, std::integral_constant<int, 2>{}); break;
      case 3: f(mt, std::integral_constant<int, 3>{}); break;
      default: f(mt, std::integral_constant<int, NMax>{}); break;
    }
  };
  switch (rows) {
    case 1: by_cols(std::integral_constant<int, 1>{}); break;
#if !TOKENMILL_SIMD || TOKENMILL_SIMD == 512
    case 2: by_cols(std::integral_constant<int, 2>{}); break;
    case 3: by_cols(std::integral_constant<int, 3>{}); break;
#endif
    default: by_cols(std::integral_constant<int, kMaxRows>{}); break;
  }
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "dense_linear: w must be a contiguous [N, K] matrix in x's dtype");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K, "dense_linear");
  std::vector<float> bias_f(N, 0.f);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "dense_linear: bias must be [out_features]");
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + N, bias_f.begin());
  }
  at::Tensor y = at::empty({M, N}, x.options());
  dispatch_float_types(x.scalar_type(), "dense_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const std::vector<float> xf = rows_as_float<T>(x);
    const T* wp = w.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    constexpr int tile = tile_rows<T>();
    const int64_t tiles = (N + tile - 1) / tile;
    // A task of at least ~64 KB of weights, so a decode step's small layers are not cut into crumbs.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K * w.element_size() * tile, 1));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      float out[kMaxRows * kTileN];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * tile;
        const int cols = static_cast<int>(std::min<int64_t>(tile, N - n));
        const T* next = tile > 1 && t + 1 < end ? wp + (n + tile) * K : nullptr;
        for (int64_t m = 0; m < M; m += kMaxRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
          with_tile<tile>(rows, cols, [&](auto mt, auto nt) {
            tile_dot<T, decltype(mt)::value, decltype(nt)::value>(xf.data() + m * K, K, wp + n * K, m == 0 ? next : nullptr, out);
          });
          for (int i = 0; i < rows; ++i)
            for (int j = 0; j < cols; ++j) yp[(m + i) * N + n + j] = static_cast<T>(out[i * kTileN + j] + bias_f[n + j]);
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("dense_linear", c10::DispatchKey::CPU, &dense_linear);
}

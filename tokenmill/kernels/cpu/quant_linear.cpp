// Weight-only quantized linear layers (CPU): y = x W^T + b with W held as int4, and the int8 and
// int4 weights dequantized for prompt chunks (int8's decode kernel is decode_linear.cpp's).
//
// Decode is bound by the bytes of the weights read per token, so these kernels read the packed
// weights once per call and widen them to float32 in registers, never to memory; activations stay
// in the model dtype and every product accumulates in float32. Rows of x are taken four at a time,
// so each decoded weight vector serves up to four tokens. Meant for the few rows of a decode step;
// prompt chunks (many rows) are cheaper as one dequantize and a float GEMM (the Python side
// chooses, see layers/quantization/weight_only.py).
//
// Formats (quantized by layers/quantization/quant_utils.py, which also holds the plain PyTorch
// reference these kernels are tested against):
//   int8: w [N, K] int8, scale [N] float32:           W[n, k] = w[n, k] * scale[n]
//   int4: w [N, K / 2] uint8, scale and min [N, ceil(K / G)] float32 (group size G and K multiples
//         of 32; the last group may be shorter): W[n, k] = q * scale[n, k / G] + min[n, k / G],
//         q in 0..15 a nibble of w. In each block
//         of 32 weights (16 bytes), byte j holds weight j in its low nibble and weight j + 16 in
//         its high nibble, so a vector of bytes widens to two vectors of consecutive weights.
//
// With AVX-512 or AVX2 (vec.h's Vec) the loops run a vector at a time; otherwise in scalar loops.

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
using tokenmill_cpu::linear_rows;
using tokenmill_cpu::rows_as_float;
using tokenmill_cpu::with_row_count;

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
#endif

constexpr int kBlock = 32;       // int4 weights per 16-byte block

// sum_j a[j] * b[j] over n floats (the groups' min terms: one per group, so a vector loop pays
// once groups are small).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  int64_t j = 0;
#if TOKENMILL_SIMD
  Vec acc = Vec::zero();
  for (; j + W <= n; j += W) acc = fmadd(Vec::load(a + j), Vec::load(b + j), acc);
  sum = reduce_add(acc);
#endif
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// out[i] = sum_k x[i * K + k] * W[k] for one int4 weight row (see the format above); x_group_sums
// [MT, groups] holds each row's sum of x over each group, for the groups' min terms.
template <int MT>
inline void int4_dot(const float* x, int64_t K, int64_t G, const uint8_t* w, const float* scale, const float* min,
                     const float* x_group_sums, float* out) {
  const int64_t groups = (K + G - 1) / G;
  float sums[MT] = {};
#if TOKENMILL_SIMD
  Vec acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = Vec::zero();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * G / 2;
    const float* xg = x + g * G;
    const int64_t length = std::min(G, K - g * G);
#if TOKENMILL_SIMD
    Vec glo[MT], ghi[MT];
    for (int i = 0; i < MT; ++i) glo[i] = ghi[i] = Vec::zero();
    for (int64_t b = 0; b < length; b += kBlock) {
      for (int c = 0; c < kBlock / 2; c += W) {  // W bytes: weights b + c.. (low) and b + 16 + c.. (high)
        Vec lo, hi;
        tokenmill_cpu::load_nibbles(wg + b / 2 + c, lo, hi);
        for (int i = 0; i < MT; ++i) {
          glo[i] = fmadd(lo, Vec::load(xg + i * K + b + c), glo[i]);
          ghi[i] = fmadd(hi, Vec::load(xg + i * K + b + 16 + c), ghi[i]);
        }
      }
    }
    const Vec s = Vec::set1(scale[g]);
    for (int i = 0; i < MT; ++i) acc[i] = fmadd(glo[i] + ghi[i], s, acc[i]);
#else
    for (int i = 0; i < MT; ++i) {
      float dot = 0.f;
      for (int64_t b = 0; b < length; b += kBlock)
        for (int j = 0; j < kBlock / 2; ++j) {
          const uint8_t byte = wg[b / 2 + j];
          dot += static_cast<float>(byte & 0xF) * xg[i * K + b + j] + static_cast<float>(byte >> 4) * xg[i * K + b + 16 + j];
        }
      sums[i] += dot * scale[g];
    }
#endif
  }
  for (int i = 0; i < MT; ++i) sums[i] += dot_f32(min, x_group_sums + i * groups, groups);
#if TOKENMILL_SIMD
  for (int i = 0; i < MT; ++i) sums[i] += reduce_add(acc[i]);
#endif
  for (int i = 0; i < MT; ++i) out[i] = sums[i];
}

void check_int4(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& min, int64_t G, const char* op) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), op, ": w must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(G > 0 && G % kBlock == 0, op, ": group size must be a multiple of 32");
  const int64_t N = w.size(0), K = 2 * w.size(1);
  TORCH_CHECK(K % kBlock == 0, op, ": in_features ", K, " is not a multiple of 32");
  for (const at::Tensor* t : {&scale, &min})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == (K + G - 1) / G && t->scalar_type() == at::kFloat &&
                t->is_contiguous(), op, ": scale and min must be float32 [N, ceil(K / group_size)]");
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& min,
                       int64_t group_size, const std::optional<at::Tensor>& bias) {
  check_int4(w, scale, min, group_size, "int4_linear");
  const int64_t N = w.size(0), K = 2 * w.size(1), G = group_size, groups = (K + G - 1) / G;
  check_x(x, K, "int4_linear");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = min.data_ptr<float>();
  at::Tensor y;
  dispatch_float_types(x.scalar_type(), "int4_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const std::vector<float> xf = rows_as_float<T>(x);
    // Each row's sum of x over each group: the groups' min terms, computed once for all N channels.
    std::vector<float> group_sums(x.size(0) * groups, 0.f);
    for (int64_t m = 0; m < x.size(0); ++m)
      for (int64_t k = 0; k < K; ++k) group_sums[m * groups + k / G] += xf[m * K + k];
    const float* gs = group_sums.data();
    y = linear_rows<T>(x, xf, N, bias, [&](int64_t n, int64_t m, int rows, const float* xr, float* out) {
      const uint8_t* wr = wp + n * K / 2;
      const float *s = sp + n * groups, *mn = mp + n * groups, *g = gs + m * groups;
      with_row_count(rows, [&](auto mt) { int4_dot<decltype(mt)::value>(xr, K, G, wr, s, mn, g, out); });
    });
  });
  return y;
}

// The float weights [N, K] in `like`'s dtype, for prompt chunks (one dequantize, then a float GEMM).
at::Tensor int8_dequantize(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& like) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "int8_dequantize: w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "int8_dequantize: scale must be float32 [N]");
  at::Tensor out = at::empty({N, K}, like.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  dispatch_float_types(like.scalar_type(), "int8_dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* wr = wp + n * K;
        T* o = op + n * K;
        int64_t k = 0;
#if TOKENMILL_SIMD
        const Vec s = Vec::set1(sp[n]);
        for (; k + W <= K; k += W) store(o + k, tokenmill_cpu::load_int8(wr + k) * s);
#endif
        for (; k < K; ++k) o[k] = static_cast<T>(static_cast<float>(wr[k]) * sp[n]);
      }
    });
  });
  return out;
}

at::Tensor int4_dequantize(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& min, int64_t group_size,
                           const at::Tensor& like) {
  check_int4(w, scale, min, group_size, "int4_dequantize");
  const int64_t N = w.size(0), K = 2 * w.size(1), G = group_size, groups = (K + G - 1) / G;
  at::Tensor out = at::empty({N, K}, like.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = min.data_ptr<float>();
  dispatch_float_types(like.scalar_type(), "int4_dequantize", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n)
        for (int64_t k = 0; k < K; k += kBlock) {
          const uint8_t* block = wp + (n * K + k) / 2;
          const int64_t g = n * groups + k / G;
          T* o = op + n * K + k;
          int j = 0;
#if TOKENMILL_SIMD
          const Vec s = Vec::set1(sp[g]), m = Vec::set1(mp[g]);
          for (; j < kBlock / 2; j += W) {
            Vec lo, hi;
            tokenmill_cpu::load_nibbles(block + j, lo, hi);
            store(o + j, lo * s + m);  // two roundings, as the reference
            store(o + 16 + j, hi * s + m);
          }
#endif
          for (; j < kBlock / 2; ++j) {
            o[j] = static_cast<T>(static_cast<float>(block[j] & 0xF) * sp[g] + mp[g]);
            o[16 + j] = static_cast<T>(static_cast<float>(block[j] >> 4) * sp[g] + mp[g]);
          }
        }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, Tensor min, int group_size, Tensor? bias) -> Tensor");
  m.def("int8_dequantize(Tensor w, Tensor scale, Tensor like) -> Tensor");
  m.def("int4_dequantize(Tensor w, Tensor scale, Tensor min, int group_size, Tensor like) -> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, &int4_linear);
  m.impl("int8_dequantize", c10::DispatchKey::CPU, &int8_dequantize);
  m.impl("int4_dequantize", c10::DispatchKey::CPU, &int4_dequantize);
}

// RMSNorm of one row and the residual add before it, as pointwise.cpp's rms_norm / add_rms_norm and
// int8_gemm.cpp's fused norm + activation quantize (w8a8_rms_norm_quant) compute them: one
// implementation, so the fused op's normalized rows are those of the plain norm, bit for bit.
//
// Rounding is that of the torch code the norms replace (to the tensor dtype after each torch op,
// float32 inside the norm; the build turns off FMA contraction); the one difference is the sum of
// squares, accumulated in another order. The vector loops (vec.h's Vec) and the scalar tails round alike.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "vec.h"

namespace tokenmill_cpu {

// res[i] := to_dtype(res[i] + x[i]) over one row of n.
template <typename T>
inline void add_row(T* res, const T* x, int64_t n) {
  int64_t i = 0;
#if TOKENMILL_SIMD
  for (; i + Vec::W <= n; i += Vec::W) store(res + i, Vec::load(res + i) + Vec::load(x + i));
#endif
  for (; i < n; ++i) res[i] = static_cast<T>(static_cast<float>(res[i]) + static_cast<float>(x[i]));
}

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)) over one row of n, as transformers' LlamaRMSNorm.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#if TOKENMILL_SIMD
  constexpr int W = Vec::W;
  Vec acc = Vec::zero();
  for (; i + W <= n; i += W) {
    const Vec v = Vec::load(x + i);
    acc = acc + v * v;
  }
  ss = reduce_add(acc);
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if TOKENMILL_SIMD
  const Vec vinv = Vec::set1(inv);
  for (; i + W <= n; i += W) store(out + i, Vec::load(weight + i) * round_trip(Vec::load(x + i) * vinv, x));
#endif
  for (; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv)));
}

// A norm's arguments: x [rows, hidden] with contiguous rows, weight [hidden] in x's dtype, and the residual
// stream (nullptr: none) contiguous, shaped and typed like x. op names the caller in the errors.
inline void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* residual, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              op, ": weight must be [hidden] in x's dtype");
  if (residual != nullptr)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() && residual->scalar_type() == x.scalar_type(), op,
                ": residual must be a contiguous tensor shaped and typed like x");
}

// Rows per task, so that a handful of decode rows stays on one thread.
inline int64_t norm_grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1)); }

}  // namespace tokenmill_cpu

// The per-layer elementwise work of a Llama block as single ops (CPU): RMSNorm, residual add +
// RMSNorm, SiLU-and-mul, rotary embedding. Each replaces four to ten eager torch ops, whose
// dispatch cost dominates at decode batch sizes.
//
// Every op rounds where the torch code it replaces rounds (to the tensor dtype after each torch
// op, float32 inside the norm), so bf16 results equal the eager ones bit for bit, and float32
// ones too: the build turns off FMA contraction (-ffp-contract=off) for that reason. The one
// exception is the sum of squares in RMSNorm, accumulated in a different order. The vector loops
// (vec.h's Vec: AVX-512 or AVX2) and the scalar ones round alike, so every ISA gives these results.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "norm_rows.h"
#include "vec.h"

namespace {

using tokenmill_cpu::dispatch_float_types;

#if TOKENMILL_SIMD
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
#endif

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// Grain: rows per task, so that a handful of decode rows stays on one thread.
inline int64_t grain(int64_t row_len) { return tokenmill_cpu::norm_grain(row_len); }

// out[r] = weight * to_dtype(x[r] * rsqrt(mean(x[r]^2) + eps)) (norm_rows.h).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) tokenmill_cpu::rms_norm_row(x + r * x_stride, weight, out + r * n, n, eps);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  tokenmill_cpu::check_norm_args(x, weight, nullptr, "rms_norm");
  auto out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0), x.size(1), eps);
  });
  return out;
}

// residual := to_dtype(residual + x); returns rms_norm(residual). One pass over both.
at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  tokenmill_cpu::check_norm_args(x, weight, &residual, "add_rms_norm");
  auto out = at::empty(x.sizes(), x.options());
  dispatch_float_types(x.scalar_type(), "add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
    T* res = residual.data_ptr<T>();
    const T* xs = x.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) tokenmill_cpu::add_row(res + r * n, xs + r * stride, n);
    });
    rms_norm_rows<T>(res, n, weight.data_ptr<T>(), out.data_ptr<T>(), rows, n, eps);
  });
  return out;
}

#if TOKENMILL_SIMD
// e^x for an activation of type T: inline on AVX-512 where the result is rounded to bf16 / fp16 anyway
// (SiLU of a 2,048 x 4,096 bf16 gate, Zen 5, 2 threads: 1.92 -> 1.69 ms, equal to the eager ops' bits
// on 8.4 M random values), libmvec's expf for float32.
template <typename T>
inline Vec exp_for(Vec x) {
#if TOKENMILL_SIMD == 512
  if constexpr (!std::is_same_v<T, float>) return tokenmill_cpu::exp_inline(x);
#endif
  return vexp(x);
}
#endif

// [rows, 2I] (gate | up) -> [rows, I]: to_dtype(to_dtype(silu(gate)) * up), as F.silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [rows, 2 * intermediate] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({rows, n}, x.options());
  dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xs = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = xs + r * stride;
        const T* up = gate + n;
        int64_t i = 0;
#if TOKENMILL_SIMD
        for (; i + W <= n; i += W) {
          const Vec g = Vec::load(gate + i);
          const Vec act = round_trip(g / (Vec::set1(1.f) + exp_for<T>(Vec::zero() - g)), gate);
          store(o + r * n + i, act * Vec::load(up + i));
        }
#endif
        for (; i < n; ++i) {
          const float g = static_cast<float>(gate[i]);
          const T act = round_to<T>(g / (1.f + std::exp(-g)));
          o[r * n + i] = round_to<T>(static_cast<float>(act) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// In place, for each row t and head: x := x * cos[t] + rotate_half(x) * sin[t] (neox-style halves),
// rounding after each product and after the sum as the eager ops do. x: [T, heads, D], any row
// stride with contiguous heads; cos/sin: [T, D] in x's dtype.
template <typename T>
void rotary_rows(T* x, int64_t row_stride, int64_t heads, int64_t D, const T* cos, const T* sin, int64_t rows) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    std::vector<float> a(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * row_stride + h * D;
#if TOKENMILL_SIMD
        if (half % W == 0) {  // whole vectors swap halves: no shuffles
          for (int64_t i = 0; i < half; i += W) {
            const Vec lo = Vec::load(v + i), hi = Vec::load(v + half + i);
            const Vec p_lo = round_trip(lo * Vec::load(c + i), v);
            const Vec q_lo = round_trip((Vec::zero() - hi) * Vec::load(s + i), v);
            const Vec p_hi = round_trip(hi * Vec::load(c + half + i), v);
            const Vec q_hi = round_trip(lo * Vec::load(s + half + i), v);
            store(v + i, p_lo + q_lo);
            store(v + half + i, p_hi + q_hi);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < D; ++i) a[i] = static_cast<float>(v[i]);
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -a[i + half] : a[i - half];
          const float p = static_cast<float>(round_to<T>(a[i] * static_cast<float>(c[i])));
          const float q = static_cast<float>(round_to<T>(rotated * static_cast<float>(s[i])));
          v[i] = round_to<T>(p + q);
        }
      }
    }
  });
}

void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2), "q/k must be [T, heads, D] with contiguous heads");
    TORCH_CHECK(x->scalar_type() == cos.scalar_type() && x->size(0) == cos.size(0) && x->size(2) == cos.size(1),
                "cos/sin must be [T, D] in q's dtype");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes(), "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  dispatch_float_types(q.scalar_type(), "rotary", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (at::Tensor* x : {&q, &k})
      rotary_rows<T>(x->data_ptr<T>(), x->stride(0), x->size(1), x->size(2), cos.data_ptr<T>(), sin.data_ptr<T>(), x->size(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}

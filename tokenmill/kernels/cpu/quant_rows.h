// What the linear kernels for a decode step's rows (gguf_linear.cpp, decode_linear.cpp) share: x and
// the bias widened to float32 once per call, and (GGUF's) the loop over output channels that runs a
// weight row's dot product against all rows of x, a few at a time, split over threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

namespace tokenmill_cpu {

constexpr int kRowsPerPass = 4;  // rows of x sharing each decoded weight vector

// f(std::integral_constant<int, MT>{}) for MT = rows (1 to kRowsPerPass): the dot kernels take
// their row count as a template argument, so their accumulators stay in registers.
template <typename F>
inline void with_row_count(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// x [M, K] widened to float32 once per call (plain loops: at decode sizes ATen's conversion ops
// cost more in dispatch than the copy itself).
template <typename T>
std::vector<float> rows_as_float(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M * K);
  const T* xp = x.data_ptr<T>();
  if (x.is_contiguous()) {  // one flat loop the compiler vectorizes (a decode row: 1-2 us a call strided)
    for (int64_t i = 0; i < M * K; ++i) out[i] = static_cast<float>(xp[i]);
    return out;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = static_cast<float>(xp[m * x.stride(0) + k * x.stride(1)]);
  return out;
}

// The bias [N] as float32, empty without one (no zeros to allocate and add: an LM head's N is 49,152);
// op names the caller in the error.
inline std::vector<float> bias_as_float(const std::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [out_features]");
  const at::Tensor b = bias->to(at::kFloat).contiguous();
  return std::vector<float>(b.data_ptr<float>(), b.data_ptr<float>() + N);
}

// y[m, n] = row_dot(x rows m.., weight row n) + bias[n], rounded once to T. The work is split over
// output channels; each task runs all rows of x, four at a time.
template <typename T, typename RowDot>
at::Tensor linear_rows(const at::Tensor& x, const std::vector<float>& xf, int64_t N, const std::optional<at::Tensor>& bias,
                       RowDot&& row_dot, const char* op) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = xf.data();
  const std::vector<float> biasf = bias_as_float(bias, N, op);
  const float* bp = biasf.empty() ? nullptr : biasf.data();
  at::Tensor y = at::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  // A task of at least ~64 KB of weights, so a decode step's small layers are not cut into crumbs.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float sums[kRowsPerPass];
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, M - m));
        row_dot(n, m, rows, xp + m * K, sums);
        for (int i = 0; i < rows; ++i) yp[(m + i) * N + n] = static_cast<T>(bp ? sums[i] + bp[n] : sums[i]);
      }
    }
  });
  return y;
}

inline void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in_features]");
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " features, the weight ", K);
}

}  // namespace tokenmill_cpu

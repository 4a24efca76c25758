// GGUF's block-quantized weights kept packed (quantization="gguf"): y = x W^T + b reading the blocks
// as they lie in the file, and their dequantize to float (prompt chunks, embedding rows).
//
// W is [N, K / QK * BYTES] uint8: each row of the GGUF tensor, its K values in blocks of QK values
// stored in BYTES bytes (ggml's layouts; gguf.quants holds the numpy reference):
//   Q8_0 (32, 34)   fp16 d, int8 q[32]                          w = q * d
//   Q4_0 (32, 18)   fp16 d, 16 bytes: q[j] low nibble of byte j, q[j + 16] its high nibble
//                                                               w = d * (q - 8)
//   Q4_1 (32, 20)   fp16 d, fp16 m, nibbles as Q4_0             w = d * q + m
//   Q4_K (256, 144) fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
//                   128 bytes of nibbles (32 bytes per 64 values: low nibbles the first 32, high
//                   nibbles the next 32)                        w = (d * sc) * q - dmin * m
//   Q5_K (256, 176) as Q4_K, plus 32 bytes qh whose bit s is the fifth bit of sub-block s's values
//   Q6_K (256, 210) 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16
//                   values), fp16 d                             w = (d * sc) * (q - 32)
//
// Decode is bound by the bytes read, so the linear kernel reads each block once and dequantizes it
// in registers (vec.h's Vec: AVX-512 or AVX2 + FMA), to the same float32 values as gguf's numpy
// dequantize (the same operations in the same order, one rounding each), then accumulates w * x in
// float32 with fused multiply-adds: against dequantize + a float matmul, only the summation order
// differs. The activations stay float (no int8 requantizing as llama.cpp's dot products do), so a
// model computes the same function as its dequantized copy. Without a vector ISA, each block is
// dequantized to a small float buffer by the scalar reference and dotted from there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <type_traits>

#include "quant_rows.h"
#include "vec.h"

namespace {

using tokenmill_cpu::check_x;
using tokenmill_cpu::dispatch_float_types;
using tokenmill_cpu::linear_rows;
using tokenmill_cpu::rows_as_float;
using tokenmill_cpu::with_row_count;

#if TOKENMILL_SIMD
using tokenmill_cpu::load_int8;
using tokenmill_cpu::load_nibbles;
using tokenmill_cpu::load_u8_bits;
using tokenmill_cpu::Vec;
constexpr int W = Vec::W;
#endif

// ggml's type ids (gguf.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Each block type: QK values in BYTES bytes. dequant(block, out) writes the QK floats (the scalar
// reference); for_each(block, emit) calls emit(offset, v) for each run of W values in registers.
struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static void dequant(const uint8_t* b, float* out) {
    const float d = fp16(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < QK; ++j) out[j] = static_cast<float>(q[j]) * d;
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    const Vec d = Vec::set1(fp16(b));
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int c = 0; c < QK; c += W) emit(c, load_int8(q + c) * d);
  }
#endif
};

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  static void dequant(const uint8_t* b, float* out) {
    const float d = fp16(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
      out[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    const Vec d = Vec::set1(fp16(b)), eight = Vec::set1(8.f);
    for (int c = 0; c < 16; c += W) {
      Vec lo, hi;
      load_nibbles(b + 2 + c, lo, hi);
      emit(c, d * (lo - eight));
      emit(16 + c, d * (hi - eight));
    }
  }
#endif
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20;
  static void dequant(const uint8_t* b, float* out) {
    const float d = fp16(b), m = fp16(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(qs[j] & 0xF) + m;
      out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    const Vec d = Vec::set1(fp16(b)), m = Vec::set1(fp16(b + 2));
    for (int c = 0; c < 16; c += W) {
      Vec lo, hi;
      load_nibbles(b + 4 + c, lo, hi);
      emit(c, d * lo + m);
      emit(16 + c, d * hi + m);
    }
  }
#endif
};

// The K-quants' 8 sub-block scales and mins (6 bits each, packed in 12 bytes), as float32
// d * scale and dmin * min (gguf's Q4_K.get_scale_min).
inline void k_scales(const uint8_t* b, float* dsc, float* dm) {
  const float d = fp16(b), dmin = fp16(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    if (j < 4) {
      sc = s[j] & 63;
      m = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
      m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    dsc[j] = d * static_cast<float>(sc);
    dm[j] = dmin * static_cast<float>(m);
  }
}

struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  static void dequant(const uint8_t* b, float* out) {
    float dsc[8], dm[8];
    k_scales(b, dsc, dm);
    const uint8_t* qs = b + 16;
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l)
        out[32 * s + l] = dsc[s] * static_cast<float>((qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) - dm[s];
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    float dsc[8], dm[8];
    k_scales(b, dsc, dm);
    const uint8_t* qs = b + 16;
    for (int j = 0; j < 4; ++j) {
      const Vec s0 = Vec::set1(dsc[2 * j]), m0 = Vec::set1(dm[2 * j]);
      const Vec s1 = Vec::set1(dsc[2 * j + 1]), m1 = Vec::set1(dm[2 * j + 1]);
      for (int c = 0; c < 32; c += W) {
        Vec lo, hi;
        load_nibbles(qs + 32 * j + c, lo, hi);
        emit(64 * j + c, s0 * lo - m0);
        emit(64 * j + 32 + c, s1 * hi - m1);
      }
    }
  }
#endif
};

struct Q5_K {
  static constexpr int QK = 256, BYTES = 176;
  static void dequant(const uint8_t* b, float* out) {
    float dsc[8], dm[8];
    k_scales(b, dsc, dm);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF) | (((qh[l] >> s) & 1) << 4);
        out[32 * s + l] = dsc[s] * static_cast<float>(q) - dm[s];
      }
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    float dsc[8], dm[8];
    k_scales(b, dsc, dm);
    const uint8_t *qh = b + 16, *qs = b + 48;
    const Vec sixteen = Vec::set1(16.f);
    for (int j = 0; j < 4; ++j) {
      const Vec s0 = Vec::set1(dsc[2 * j]), m0 = Vec::set1(dm[2 * j]);
      const Vec s1 = Vec::set1(dsc[2 * j + 1]), m1 = Vec::set1(dm[2 * j + 1]);
      for (int c = 0; c < 32; c += W) {
        Vec lo, hi;
        load_nibbles(qs + 32 * j + c, lo, hi);
        const Vec h0 = load_u8_bits(qh + c, 2 * j, 1), h1 = load_u8_bits(qh + c, 2 * j + 1, 1);
        emit(64 * j + c, s0 * (lo + h0 * sixteen) - m0);  // the integer sums are exact in float32
        emit(64 * j + 32 + c, s1 * (hi + h1 * sixteen) - m1);
      }
    }
  }
#endif
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static void scales(const uint8_t* b, float* dsc) {
    const float d = fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) dsc[i] = d * static_cast<float>(sc[i]);
  }
  static void dequant(const uint8_t* b, float* out) {
    float dsc[16];
    scales(b, dsc);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l) {
          const int low = (ql[32 * (t % 2) + l] >> (4 * (t / 2))) & 0xF;
          const int q = (low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
          const int v = 128 * h + 32 * t + l;
          out[v] = dsc[v / 16] * static_cast<float>(q);
        }
    }
  }
#if TOKENMILL_SIMD
  template <typename Emit>
  static void for_each(const uint8_t* b, Emit&& emit) {
    float dsc[16];
    scales(b, dsc);
    const Vec sixteen = Vec::set1(16.f), bias = Vec::set1(32.f);
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
      for (int c = 0; c < 32; c += W) {
        Vec low[4];
        load_nibbles(ql + c, low[0], low[2]);
        load_nibbles(ql + 32 + c, low[1], low[3]);
        for (int t = 0; t < 4; ++t) {
          const int v = 128 * h + 32 * t + c;  // a run of W <= 16 values lies in one scale's 16
          const Vec q = (low[t] + load_u8_bits(qh + c, 2 * t, 3) * sixteen) - bias;
          emit(v, Vec::set1(dsc[v / 16]) * q);
        }
      }
    }
  }
#endif
};

// f(Block{}) for the block type of a GGML type id; any other type is an error naming the supported.
template <typename F>
void dispatch_block_type(int64_t type, const char* op, F&& f) {
  switch (type) {
    case kQ8_0: f(Q8_0{}); break;
    case kQ4_0: f(Q4_0{}); break;
    case kQ4_1: f(Q4_1{}); break;
    case kQ4_K: f(Q4_K{}); break;
    case kQ5_K: f(Q5_K{}); break;
    case kQ6_K: f(Q6_K{}); break;
    default:
      TORCH_CHECK(false, op, ": GGML type ", type, " is not computed packed; supported: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), ",
                  "Q5_K (13), Q6_K (14)");
  }
}

template <typename B>
void check_packed(const at::Tensor& w, int64_t K, const char* op) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), op, ": w must be contiguous uint8 [N, row bytes]");
  TORCH_CHECK(K > 0 && K % B::QK == 0, op, ": in_features ", K, " is not a multiple of the block's ", B::QK, " values");
  TORCH_CHECK(w.size(1) == K / B::QK * B::BYTES, op, ": w has ", w.size(1), " bytes per row, ", K, " values take ",
              K / B::QK * B::BYTES);
}

// out[r] = sum_k x[r * K + k] * W[k] for r < MT: one packed weight row against MT rows of x.
template <typename B, int MT>
inline void block_dot(const uint8_t* w, const float* x, int64_t K, float* out) {
  const int64_t blocks = K / B::QK;
#if TOKENMILL_SIMD
  // Two accumulators per row, alternating by run: one chain of fused multiply-adds would wait on its latency.
  Vec acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + i * B::QK;
    B::for_each(w + i * B::BYTES, [&](int off, Vec v) {
      const int a = (off / W) & 1;
      for (int r = 0; r < MT; ++r) acc[r][a] = fmadd(v, Vec::load(xb + r * K + off), acc[r][a]);
    });
  }
  for (int r = 0; r < MT; ++r) out[r] = reduce_add(acc[r][0] + acc[r][1]);
#else
  float values[B::QK];
  float sums[MT] = {};
  for (int64_t i = 0; i < blocks; ++i) {
    B::dequant(w + i * B::BYTES, values);
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < B::QK; ++j) sums[r] += values[j] * x[r * K + i * B::QK + j];
  }
  for (int r = 0; r < MT; ++r) out[r] = sums[r];
#endif
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t K, const std::optional<at::Tensor>& bias) {
  at::Tensor y;
  dispatch_block_type(type, "gguf_linear", [&](auto block) {
    using B = decltype(block);
    check_packed<B>(w, K, "gguf_linear");
    check_x(x, K, "gguf_linear");
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t row_bytes = w.size(1);
    dispatch_float_types(x.scalar_type(), "gguf_linear", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const std::vector<float> xf = rows_as_float<T>(x);
      y = linear_rows<T>(x, xf, w.size(0), bias, [&](int64_t n, int64_t, int rows, const float* xr, float* out) {
        with_row_count(rows, [&](auto mt) { block_dot<B, decltype(mt)::value>(wp + n * row_bytes, xr, K, out); });
      }, "gguf_linear");
    });
  });
  return y;
}

// The float [N, K] weight in `like`'s dtype: gguf's dequantize, value for value.
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t K, const at::Tensor& like) {
  at::Tensor out;
  dispatch_block_type(type, "gguf_dequantize", [&](auto block) {
    using B = decltype(block);
    check_packed<B>(w, K, "gguf_dequantize");
    const int64_t N = w.size(0), row_bytes = w.size(1), blocks = K / B::QK;
    out = at::empty({N, K}, like.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
    dispatch_float_types(like.scalar_type(), "gguf_dequantize", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      T* op = out.data_ptr<T>();
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          for (int64_t i = 0; i < blocks; ++i) {
            const uint8_t* b = wp + n * row_bytes + i * B::BYTES;
            T* o = op + n * K + i * B::QK;
#if TOKENMILL_SIMD
            B::for_each(b, [&](int off, Vec v) { store(o + off, v); });
#else
            float values[B::QK];
            B::dequant(b, values);
            for (int j = 0; j < B::QK; ++j) o[j] = static_cast<T>(values[j]);
#endif
          }
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int type, int in_features, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int type, int in_features, Tensor like) -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
}

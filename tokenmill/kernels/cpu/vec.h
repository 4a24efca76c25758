// What tokenmill's CPU kernels share: the dtype dispatch, and the few AVX-512 primitives (16 lanes
// of float32, loaded from and stored to float32, bf16 or fp16 memory, and libmvec's vector expf).
// Kernels keep a scalar loop for machines without AVX-512 (and for row tails).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

namespace tokenmill_cpu {

// f(static_cast<T*>(nullptr)) for the element type T of a float32, bf16 or fp16 tensor; any other
// dtype is an error naming the op.
template <typename F>
void dispatch_float_types(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16");
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 bits rounded to nearest even at bf16 precision (the top 16 bits hold the bf16), as c10::BFloat16(float).
inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16)));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to T and back: the value a torch op would leave in a T tensor.
inline __m512 round_trip16(__m512 x, const float*) { return x; }
inline __m512 round_trip16(__m512 x, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 round_trip16(__m512 x, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

}  // namespace tokenmill_cpu

#if defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec: 16 expf at once
#endif

// What tokenmill's CPU kernels share: the dtype dispatch (float tensors, quantized KV caches and their
// scales), and one small vector abstraction over
// float32 lanes with an AVX-512 and an AVX2 implementation, so that each kernel is written once.
//
// The build picks the implementation from the target's macros (-march=native by default, or
// TOKENMILL_CPU_MARCH): TOKENMILL_SIMD is
//   512  with AVX-512F: Vec holds 16 floats (__m512);
//   256  with AVX2 + FMA + F16C (x86-64-v3: Zen 2/3, Haswell and later): Vec holds 8 floats (__m256);
//   0    otherwise: no Vec; the kernels run their scalar loops, which stay as the reference and
//        handle the tails of rows that are not a whole number of vectors.
//
// Vec is float32 in registers whatever the memory dtype: Vec::load widens float32, bf16 (the top
// half of a float32: a 16-bit shift) or fp16 (F16C / AVX-512F) rows, store() rounds to nearest
// even as c10::BFloat16(float) / c10::Half(float) do. Arithmetic is one IEEE op per call (the
// build passes -ffp-contract=off, so a * b + c rounds twice, as torch's eager ops do; fmadd() is
// the one fused op, for the kernels that accumulate in float32 anyway). vexp() is glibc's libmvec
// expf at the vector width (_ZGVeN16v_expf, as the AVX-512 code always used, and its AVX2 sibling
// _ZGVdN8v_expf): both within a few ulp of expf, so the two widths agree within the kernel tests'
// tolerances (tests/test_kernel_isa.py compares them).
#pragma once

#include <ATen/ATen.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <optional>

#if defined(__AVX512F__)
#define TOKENMILL_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_SIMD 256
#else
#define TOKENMILL_SIMD 0
#endif

// vdpbf16ps (AVX512-BF16): the attention kernels and dense_linear multiply bf16 pairs without widening them.
#if TOKENMILL_SIMD == 512 && defined(__AVX512BF16__)
#define TOKENMILL_BF16_PAIRS 1
#else
#define TOKENMILL_BF16_PAIRS 0
#endif

#if TOKENMILL_SIMD == 512
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec: 16 expf at once
#elif TOKENMILL_SIMD == 256
extern "C" __m256 _ZGVdN8v_expf(__m256);  // glibc's libmvec: 8 expf at once (AVX2 variant)
#endif

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

// f(static_cast<T*>(nullptr)) for the element type T of a quantized KV cache: int8, fp8 e4m3fn or e5m2.
template <typename F>
inline void dispatch_quantized_cache(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kChar: f(static_cast<int8_t*>(nullptr)); break;
    case at::kFloat8_e4m3fn: f(static_cast<c10::Float8_e4m3fn*>(nullptr)); break;
    case at::kFloat8_e5m2: f(static_cast<c10::Float8_e5m2*>(nullptr)); break;
    default: TORCH_CHECK(false, op, ": a quantized KV cache must be int8, float8_e4m3fn or float8_e5m2");
  }
}

// Checks a quantized cache's scales: int8's [Hkv, NB, BS] float32 (stride 1 per row), fp8's one float32 (stride 0).
inline int64_t check_kv_scales(const at::Tensor& cache, const at::Tensor& k_scale, const at::Tensor& v_scale, const char* op) {
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous(), op, ": KV scales must be contiguous float32");
  if (cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale.dim() == 3 && k_scale.sizes() == cache.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(), op,
                ": int8 KV scales must be [Hkv, blocks, block_size], as the cache's first three dims");
    return 1;
  }
  TORCH_CHECK(k_scale.numel() == 1 && v_scale.numel() == 1, op, ": fp8 KV scales must hold one value each (per tensor)");
  return 0;
}

// A KV cache's scales as the attention kernels read them: row r of head h's K scale at k[(h * NB * BS +
// r) * stride], V's likewise (int8: per row, stride 1; fp8: one value, stride 0; unquantized: 1.0).
struct KVScalePointers {
  const float* k;
  const float* v;
  int64_t stride;
};
inline KVScalePointers kv_scale_pointers(const at::Tensor& cache, const std::optional<at::Tensor>& k_scale,
                                         const std::optional<at::Tensor>& v_scale, const char* op) {
  static const float kOne = 1.f;
  if (!k_scale.has_value()) return {&kOne, &kOne, 0};
  const int64_t stride = check_kv_scales(cache, *k_scale, *v_scale, op);
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>(), stride};
}

// f(static_cast<T*>(nullptr)) for the element type T of a KV cache: scalar_t (the queries' dtype) when
// it is not quantized, else as dispatch_quantized_cache.
template <typename scalar_t, typename F>
inline void dispatch_kv_cache(bool quantized, at::ScalarType type, const char* op, F&& f) {
  if (quantized)
    dispatch_quantized_cache(type, op, f);
  else
    f(static_cast<scalar_t*>(nullptr));
}

// The vector code a build runs, as the kernels' `vector_isa` op reports it (tests check it).
inline const char* vector_isa() {
#if TOKENMILL_SIMD == 512
  return "avx512";
#elif TOKENMILL_SIMD == 256
  return "avx2";
#else
  return "scalar";
#endif
}

#if TOKENMILL_SIMD == 512

// ---- AVX-512: 16 lanes ------------------------------------------------------------------------

struct Mask {
  __mmask16 m;
};
struct IVec {  // 16 int32 lanes (argmax indices, packed int4 weights)
  __m512i v;
  static IVec iota() { return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
  static IVec set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
};
struct Vec {  // 16 float32 lanes
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;  // vector registers of the ISA
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {  // bf16 is the top half of a float32
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
};

inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, rounded once
inline Vec vmax(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec vexp(Vec a) { return {_ZGVeN16v_expf(a.v)}; }
// e^x inline, x clamped to [-87, 88] (so -inf gives ~1.6e-38, not NaN, and nothing overflows): 2^n e^r
// with n = round(x / ln 2), r = x - n ln 2 in two parts, e^r by its Taylor series to degree 6 (relative
// error below 2e-7 for |r| <= ln 2 / 2, about an ulp). For kernels that round the result to bf16 or
// fp16 anyway (vexp's call spills every live vector around it; this one stays in registers).
inline Vec exp_inline(Vec x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return {_mm512_scalef_ps(p, n)};
}
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }

#if TOKENMILL_BF16_PAIRS
// bf16 pairs for vdpbf16ps (the attention kernels, dense_linear): a Vec holding 16 pairs of bf16 (32 bits each, the
// first element in the low half) instead of 16 floats.
// acc[i] += a's pair i . b's pair i (both products, added to float32 acc[i]).
inline Vec dp_bf16(Vec acc, Vec a, Vec b) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_castps_si512(a.v), (__m512bh)_mm512_castps_si512(b.v))};
}
// 32 bf16 values as they lie in memory: the pairs (p[0], p[1]), (p[2], p[3]), ...
inline Vec load_bf16_pairs(const void* p) { return {_mm512_castsi512_ps(_mm512_loadu_si512(p))}; }
// One pair in all 16 lanes.
inline Vec broadcast_pair(uint32_t pair) { return {_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)))}; }
// Two rows' 32 elements interleaved: lo holds the pairs (a[i], b[i]) for i < 16, hi for 16 <= i < 32.
inline void interleave_bf16(const c10::BFloat16* a, const c10::BFloat16* b, Vec& lo, Vec& hi) {
  const __m512i first = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                          0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
  lo = {_mm512_castsi512_ps(_mm512_permutex2var_epi16(x, first, y))};
  hi = {_mm512_castsi512_ps(_mm512_permutex2var_epi16(x, second, y))};
}
#endif
// Horizontal sums of many vectors at once, a few shuffles per vector instead of reduce_add's chain:
// sum4_per_lane(a, b, c, d) has, at 4 l + i of every 128-bit lane l, the sum of the i-th vector's
// elements 4 l .. 4 l + 3; sum_quads(y) of W / 4 such vectors (y: W / 4 x W floats, vectors 4 j ..
// 4 j + 3 in y[j]) has at i the whole sum of vector i.
inline Vec sum4_per_lane(Vec a, Vec b, Vec c, Vec d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c.v, d.v), _mm512_unpackhi_ps(c.v, d.v));
  return {_mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)))};
}
inline Vec sum_quads(const float* y) {
  const auto halves = [](__m512 p, __m512 q) {  // lanes: p's 128-bit lanes 0+1, 2+3, then q's
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return {halves(halves(_mm512_loadu_ps(y), _mm512_loadu_ps(y + 16)), halves(_mm512_loadu_ps(y + 32), _mm512_loadu_ps(y + 48)))};
}

inline Mask greater(Vec a, Vec b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }  // a > b, false for NaN
inline Vec select(Mask m, Vec a, Vec b) { return {_mm512_mask_mov_ps(b.v, m.m, a.v)}; }  // m ? a : b
inline IVec select(Mask m, IVec a, IVec b) { return {_mm512_mask_mov_epi32(b.v, m.m, a.v)}; }
inline IVec operator+(IVec a, IVec b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline void store(int32_t* p, IVec a) { _mm512_storeu_si512(p, a.v); }

// float32 bits rounded to nearest even at bf16 precision (the top 16 bits hold the bf16), as c10::BFloat16(float).
inline __m512i bf16_rounded_bits(Vec x) {
  const __m512i bits = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}

inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x.v); }
inline void store(c10::BFloat16* p, Vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16)));
}
inline void store(c10::Half* p, Vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to T and back: the value a torch op would leave in a T tensor.
inline Vec round_trip(Vec x, const float*) { return x; }
inline Vec round_trip(Vec x, const c10::BFloat16*) {
  return {_mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline Vec round_trip(Vec x, const c10::Half*) {
  return {_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}

// Weight-only quantized rows (decode_linear.cpp, gguf_linear.cpp): W int8 values widened to float32
// lanes; the low and high nibbles of W bytes as two float32 vectors (values 0..15); W little-endian
// uint32 lanes (int4 values, 8 per lane), and one 4-bit field of each as float32.
inline Vec load_int8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void load_nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4))};
}
inline IVec load_u32(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline Vec nibble_lanes(IVec v, int shift) {
  return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v.v, shift), _mm512_set1_epi32(0xF)))};
}
// W bytes' bits [shift, shift + width) as float32 lanes ((p[i] >> shift) & mask): the high bits of
// GGUF's 5- and 6-bit quants (gguf_linear.cpp).
inline Vec load_u8_bits(const uint8_t* p, int shift, int mask) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32(shift)), _mm512_set1_epi32(mask)))};
}

// fp8 rows of a quantized KV cache: the bytes become fp16 bit patterns, which F16C widens exactly
// (fp16 holds every e5m2 and e4m3 value; its subnormals are converted, not flushed). e5m2 is the
// top byte of an fp16. e4m3fn's sign goes to bit 15 and its exponent and mantissa to bits 7..13:
// the fp16 exponent is then e4m3's, biased by 15 instead of 7, so the value is 2^-8 of the true
// one (subnormals included), put right by a multiply. (e4m3fn's NaN bytes are not decoded: the
// cache writes clamp to the finite range.)
inline Vec load_fp8_e5m2(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_cvtph_ps(_mm256_slli_epi16(b, 8))};
}
inline Vec load_fp8_e4m3(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f))};
}

// One 64-byte cache line from src to dst (64-byte aligned) with a streaming store, and the fence
// that makes streamed lines visible before later loads.
inline void stream_line(void* dst, const void* src) {
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_loadu_si512(src));
}
inline void stream_fence() { _mm_sfence(); }

#elif TOKENMILL_SIMD == 256

// ---- AVX2 + FMA + F16C: 8 lanes ---------------------------------------------------------------

struct Mask {
  __m256 m;  // all ones in the lanes where it holds
};
struct IVec {  // 8 int32 lanes (argmax indices, packed int4 weights)
  __m256i v;
  static IVec iota() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)}; }
  static IVec set1(int32_t x) { return {_mm256_set1_epi32(x)}; }
};
struct Vec {  // 8 float32 lanes
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {  // no native bf16 on AVX2: widen by a 16-bit shift
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
};

inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec vexp(Vec a) { return {_ZGVdN8v_expf(a.v)}; }
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// As the AVX-512 ones: 128-bit lane sums of 4 vectors, then the whole sums of W = 8 vectors.
inline Vec sum4_per_lane(Vec a, Vec b, Vec c, Vec d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a.v, b.v), _mm256_unpackhi_ps(a.v, b.v));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c.v, d.v), _mm256_unpackhi_ps(c.v, d.v));
  return {_mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)))};
}
inline Vec sum_quads(const float* y) {
  const __m256 p = _mm256_loadu_ps(y), q = _mm256_loadu_ps(y + 8);
  return {_mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31))};
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline Mask greater(Vec a, Vec b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ)}; }
inline Vec select(Mask m, Vec a, Vec b) { return {_mm256_blendv_ps(b.v, a.v, m.m)}; }
inline IVec select(Mask m, IVec a, IVec b) { return {_mm256_blendv_epi8(b.v, a.v, _mm256_castps_si256(m.m))}; }
inline IVec operator+(IVec a, IVec b) { return {_mm256_add_epi32(a.v, b.v)}; }
inline void store(int32_t* p, IVec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.v); }

inline __m256i bf16_rounded_bits(Vec x) {
  const __m256i bits = _mm256_castps_si256(x.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}

inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x.v); }
inline void store(c10::BFloat16* p, Vec x) {
  const __m256i top = _mm256_srli_epi32(bf16_rounded_bits(x), 16);  // each lane <= 0xFFFF: packus keeps it as is
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}
inline void store(c10::Half* p, Vec x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline Vec round_trip(Vec x, const float*) { return x; }
inline Vec round_trip(Vec x, const c10::BFloat16*) {
  return {_mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_bits(x), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline Vec round_trip(Vec x, const c10::Half*) {
  return {_mm256_cvtph_ps(_mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}

inline Vec load_int8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline void load_nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4))};
}
inline IVec load_u32(const uint8_t* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
inline Vec nibble_lanes(IVec v, int shift) {
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v.v, shift), _mm256_set1_epi32(0xF)))};
}
inline Vec load_u8_bits(const uint8_t* p, int shift, int mask) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(bytes, _mm256_set1_epi32(shift)), _mm256_set1_epi32(mask)))};
}

// fp8 rows of a quantized KV cache, as the AVX-512 versions above (8 bytes at a time).
inline Vec load_fp8_e5m2(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_cvtph_ps(_mm_slli_epi16(b, 8))};
}
inline Vec load_fp8_e4m3(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return {_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f))};
}

inline void stream_line(void* dst, const void* src) {
  const __m256i* s = static_cast<const __m256i*>(src);
  __m256i* d = static_cast<__m256i*>(dst);
  _mm256_stream_si256(d, _mm256_loadu_si256(s));
  _mm256_stream_si256(d + 1, _mm256_loadu_si256(s + 1));
}
inline void stream_fence() { _mm_sfence(); }

#endif

#if TOKENMILL_SIMD
// W values of a KV cache row widened to float32 (unscaled): float types as Vec::load does, int8 and
// fp8 (e4m3fn / e5m2) bytes as above (paged_attention.cpp, prefill_attention.cpp).
template <typename T>
inline Vec load_kv(const T* p) { return Vec::load(p); }
inline Vec load_kv(const int8_t* p) { return load_int8(p); }
inline Vec load_kv(const c10::Float8_e4m3fn* p) { return load_fp8_e4m3(reinterpret_cast<const uint8_t*>(p)); }
inline Vec load_kv(const c10::Float8_e5m2* p) { return load_fp8_e5m2(reinterpret_cast<const uint8_t*>(p)); }
#endif

}  // namespace tokenmill_cpu

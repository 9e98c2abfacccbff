// Vector arithmetic the attention kernels share: a vector type of the target's width,
// e^x for x <= 0, a softmax over whole vectors, and the KV cache's element types
// (float32, bfloat16, float16) read into and written from float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // floats a vector register holds
#else
constexpr int64_t kLanes = 8;
#endif
// The widest vector registers this build's instructions have (Vec is kLanes floats
// anyway: narrower targets split it).
#if defined(__AVX512F__)
constexpr int kVectorBits = 512;
#elif defined(__AVX2__)
constexpr int kVectorBits = 256;
#else
constexpr int kVectorBits = 128;
#endif
// kLanes floats (int32s), loaded and stored unaligned.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t)), aligned(4)));

inline Vec load_vec(const float* p) { return *reinterpret_cast<const Vec*>(p); }

inline void store_vec(float* p, Vec v) { *reinterpret_cast<Vec*>(p) = v; }
inline Vec splat(float x) { return Vec{} + x; }

// A KV cache of bfloat16 (a float32's upper half) or float16 holds half the bytes of a
// float32 one, and decode attention is bound by reading it. Elements are the raw 16
// bits: the same layout as torch's at::BFloat16 and at::Half.
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };
typedef uint16_t HalfBits __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounded to nearest, ties to even, as torch's conversions (a NaN stays a NaN).
inline void store_float(float x, float* dst) { *dst = x; }
inline void store_float(float x, BF16* dst) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  dst->bits = (u & 0x7fffffffu) > 0x7f800000u
                  ? static_cast<uint16_t>((u >> 16) | 0x40u)
                  : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline void store_float(float x, F16* dst) {
#if defined(__F16C__)
  dst->bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
  const _Float16 h = static_cast<_Float16>(x);
  std::memcpy(&dst->bits, &h, sizeof h);
#endif
}
// kLanes elements from p, as floats.
inline Vec load_vec(const BF16* p) {
  HalfBits h;
  std::memcpy(&h, p, sizeof h);
  const IVec wide = __builtin_convertvector(h, IVec) << 16;
  Vec f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}
inline Vec load_vec(const F16* p) {
#if defined(__AVX512F__)
  // GCC 12 converts a _Float16 vector lane by lane; the instruction does 16 at once.
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  Vec v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#elif defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  Vec v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  // Without F16C (x86-64-v2) a _Float16 conversion is a library call per element: the
  // bits instead. Exponent and mantissa shifted into a float's place are the value times
  // 2^-112 (subnormals included), so one multiply rescales them; infinities and NaNs
  // (exponent all ones) get float's all-ones exponent instead.
  HalfBits h;
  std::memcpy(&h, p, sizeof h);
  const IVec bits = __builtin_convertvector(h, IVec);
  const IVec magnitude = (bits & 0x7fff) << 13;
  Vec f;
  std::memcpy(&f, &magnitude, sizeof f);
  f *= 0x1p112f;
  IVec out;
  std::memcpy(&out, &f, sizeof out);
  out = (bits & 0x7fff) >= 0x7c00 ? (magnitude | 0x7f800000) : out;
  out |= (bits & 0x8000) << 16;
  std::memcpy(&f, &out, sizeof f);
  return f;
#endif
}

inline float to_float(F16 x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t magnitude = static_cast<uint32_t>(x.bits & 0x7fff) << 13;
  float f;
  std::memcpy(&f, &magnitude, sizeof f);
  f *= 0x1p112f;
  uint32_t out;
  std::memcpy(&out, &f, sizeof out);
  if ((x.bits & 0x7fff) >= 0x7c00) out = magnitude | 0x7f800000u;
  out |= static_cast<uint32_t>(x.bits & 0x8000) << 16;
  std::memcpy(&f, &out, sizeof f);
  return f;
#endif
}

// dst[0 .. n) = src[0 .. n) as floats: whole vectors, then one at a time.
template <typename C>
inline void widen_row(const C* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vec(dst + i, load_vec(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}
template <typename C>
inline void narrow_row(const float* src, int64_t n, C* dst) {
  for (int64_t i = 0; i < n; ++i) store_float(src[i], dst + i);
}

// n rounded up to whole vectors.
inline int64_t whole_vectors(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// e^x for x <= 0 (a softmax's shifted scores) in every lane, within 1e-7 relative in
// float: 2^(x log2 e) as a power of two times a degree-6 polynomial of the fraction (its
// coefficients least squares of the relative error on [0, 1]); the floor is a truncation
// toward zero, less one where that rounded up (t <= 0). Below -87 it is 0 (float's
// smallest normal is e^-87.3).
inline Vec exp_nonpositive(Vec x) {
  const Vec low = splat(-87.f);
  const Vec t = (x > low ? x : low) * 1.44269504088896341f;
  IVec whole = __builtin_convertvector(t, IVec);
  whole += __builtin_convertvector(whole, Vec) > t;  // -1 where truncation rounded up
  const Vec f = t - __builtin_convertvector(whole, Vec);
  Vec p = splat(2.169062089e-4f);
  p = p * f + 1.244309150e-3f;
  p = p * f + 9.678469698e-3f;
  p = p * f + 5.548352731e-2f;
  p = p * f + 2.402297948e-1f;
  p = p * f + 6.931469872e-1f;
  p = p * f + 1.000000002f;
  const IVec bits = (whole + 127) << 23;
  Vec power;
  std::memcpy(&power, &bits, sizeof power);
  return x < low ? Vec{} : p * power;
}

// p[0 .. len) = softmax(p[0 .. len)) and p[len .. whole_vectors(len)) = 0, a vector at a
// time (a scalar remainder of the exponential, up to 15 elements a row, cost as much as
// the vectorized rest).
inline void softmax_row(float* p, int64_t len) {
  const int64_t n = whole_vectors(len);
  std::fill(p + len, p + n, -std::numeric_limits<float>::infinity());
  Vec top = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += kLanes) {
    const Vec x = load_vec(p + j);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, top[i]);
  Vec total = {};
  for (int64_t j = 0; j < n; j += kLanes) {
    const Vec e = exp_nonpositive(load_vec(p + j) - m);
    store_vec(p + j, e);
    total += e;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += total[i];
  const float inv = 1.f / sum;
  for (int64_t j = 0; j < n; j += kLanes) store_vec(p + j, load_vec(p + j) * inv);
}

}  // namespace

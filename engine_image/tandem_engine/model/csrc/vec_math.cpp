// Vector arithmetic the attention kernels share: a vector type of the target's width,
// e^x for x <= 0 and a softmax over whole vectors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

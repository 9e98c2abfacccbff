// Weight-only int4 / int8 projections for the few rows of a decode step, on CPUs.
//
// A decode step at batch 1 multiplies one row of activations by every weight: the time
// is spent decoding weights, not in arithmetic. Each group of 32 activations is rounded
// to int8 with its own scale (as llama.cpp's Q8 activations), so weights and activations
// meet in integer multiply-adds of bytes, and each group's float scales apply once:
//
//   int4: out[m, n] = sum_g  s[n, g] * dx[m, g] * sum_k q[n, k] * xq[m, k]
//                          + mn[n, g] * xsum[m, g] + s[n, g] * off[m, g]
//         (w = q * s + mn, q 0..15; off = 8 (xsum - dx sum_k xq): exactly the products of
//         q - 8, the signed form, rewritten for unsigned bytes)
//   int8: out[m, n] = s[n] * sum_g dx[m, g] * sum_k q[n, k] * xq[m, k]   (w = q * s)
//
// int4 weights are interleaved by 16 output rows (`kRows`), so that one vector lane is
// one output row and no horizontal sums are needed: block b (rows 16b..16b+15), group g
// is 256 bytes, 4 chunks of 64; chunk c holds for each row r 4 bytes (at 4r), whose low
// nibbles are the row's columns 4c..4c+3 of the group and high nibbles its columns
// 16+4c..16+4c+3. Scales and minimums are float16 (as a GGUF Q4 block's), [N/16, G, 16].
// N is padded to a multiple of 16 with zero rows (model/quant.py packs them). AVX-512
// VNNI takes a chunk in two vpdpbusd; AVX2 in maddubs + madd per 8 rows; other CPUs a
// plain loop. Output blocks are split over ATen's pool (or the caller's, `ForEach`); a
// pass over one block's weights serves `kMaxRows` activation rows, so the same kernels
// run prefill chunks and large batches, 2.5x the float32 matmul of the dequantized weight.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define TANDEM_VNNI 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 16;  // int4 output rows interleaved in a block
constexpr int64_t kMaxRows = 4;  // activation rows one pass over the weights serves
constexpr int64_t kRowKernelRows = 8;  // int8: steps of up to this many rows, a row at a time

// Rows of activations as int8 per group of 32, with what the kernels need per group.
// `precise` adds a second int8 term per value, the first's remainder on its own scale
// (x = dx xq + dx2 xq2, about 14 bits against the group's largest value instead of 7):
// twice the multiply-adds, for prefill chunks, whose keys and values every later token
// reads (one term there cost SmolLM2 0.5% of perplexity and flipped near ties).
struct QuantizedRows {
  bool precise = false;
  std::vector<int8_t> values;   // [M, K] xq
  std::vector<float> scales;    // [M, K / 32] dx
  std::vector<int8_t> values2;  // [M, K] xq2 (precise only)
  std::vector<float> scales2;   // [M, K / 32] dx2 (precise only)
  std::vector<float> sums;      // [M, K / 32] xsum: the float values' sum
  std::vector<float> offsets;   // [M, K / 32] off = 8 (xsum - dx sum xq - dx2 sum xq2)
#if defined(TANDEM_VNNI)
  // For the int8 kernel (`int8_block`): each group's dx (dx2) in 8 lanes, so a vector of
  // 16 lanes scales the two groups of 64 bytes; and off8 = 128 (dx sum xq + dx2 sum xq2),
  // what multiplying weights offset by 128 adds.
  std::vector<float> lane_scales;   // [M, K / 32 * 8]
  std::vector<float> lane_scales2;  // [M, K / 32 * 8] (precise only)
  std::vector<float> offsets8;      // [M, K / 32]
#endif
};

#if defined(__AVX512F__)
// A group's 32 values as two vectors: int8 on the scale of their largest magnitude
// into `out`; returns the scale, adds the values' sum to `isum`, and leaves the
// remainders (value - scale * int8) in `lo`, `hi`.
inline float round_group_avx512(__m512& lo, __m512& hi, int8_t* out, int32_t& isum) {
  const __m512 amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
  const float scale = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
  // round to nearest even, as std::nearbyint in the default mode
  const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(b));
  isum += _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  const __m512 sv = _mm512_set1_ps(scale);
  lo = _mm512_fnmadd_ps(sv, _mm512_cvtepi32_ps(a), lo);
  hi = _mm512_fnmadd_ps(sv, _mm512_cvtepi32_ps(b), hi);
  return scale;
}
#endif

// int8 values of `g` on the scale of its largest magnitude; returns the scale, adds the
// values' sum to `isum`.
inline float round_group(const float* g, int8_t* out, int32_t& isum) {
  float amax = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(g[k]));
  const float scale = amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t k = 0; k < kGroup; ++k) {
    out[k] = static_cast<int8_t>(std::nearbyint(g[k] * inv));
    isum += out[k];
  }
  return scale;
}

// Group i (of 32 activations at x + 32 i) as int8 (two terms where `q.precise`), with
// its scales, sum and offset.
inline void quantize_group(const float* x, int64_t i, QuantizedRows& q) {
  const float* g = x + i * kGroup;
#if defined(__AVX512F__)
  __m512 lo = _mm512_loadu_ps(g), hi = _mm512_loadu_ps(g + 16);
  const float total = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  int32_t n1 = 0, n2 = 0;
  const float s1 = round_group_avx512(lo, hi, q.values.data() + i * kGroup, n1);
  float approx = s1 * static_cast<float>(n1);
  if (q.precise) {
    const float s2 = round_group_avx512(lo, hi, q.values2.data() + i * kGroup, n2);
    q.scales2[i] = s2;
    approx += s2 * static_cast<float>(n2);
  }
  q.scales[i] = s1;
  q.sums[i] = total;
  q.offsets[i] = 8.f * (total - approx);
#if defined(TANDEM_VNNI)
  _mm256_storeu_ps(q.lane_scales.data() + i * 8, _mm256_set1_ps(s1));
  if (q.precise) _mm256_storeu_ps(q.lane_scales2.data() + i * 8, _mm256_set1_ps(q.scales2[i]));
  q.offsets8[i] = 128.f * approx;
#endif
#else
  float sum = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) sum += g[k];
  int32_t isum = 0;
  int8_t* xq = q.values.data() + i * kGroup;
  const float scale = round_group(g, xq, isum);
  float approx = scale * static_cast<float>(isum);
  if (q.precise) {
    float rest[kGroup];
    for (int64_t k = 0; k < kGroup; ++k) rest[k] = g[k] - scale * xq[k];
    int32_t isum2 = 0;
    const float scale2 = round_group(rest, q.values2.data() + i * kGroup, isum2);
    q.scales2[i] = scale2;
    approx += scale2 * static_cast<float>(isum2);
  }
  q.scales[i] = scale;
  q.sums[i] = sum;
  q.offsets[i] = 8.f * (sum - approx);
#endif
}

// One row's RMSNorm: out = w * x / sqrt(mean(x^2) + eps), the mean accumulated in double
// (`out` may be `x`).
inline void norm_row(const float* x, const float* w, int64_t d, float eps, float* out) {
  double sq = 0.0;
  for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(sq / d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One block of 16 int4 output rows times activation rows m0..m0+R-1 (R <= kMaxRows):
// out[r * ld + i] for i < `valid` (the block's real rows). `w`: the block's groups (256
// bytes each); `sh`, `mh`: its scales and minimums [G, 16]. kTwo: `x` is precise. The
// row count is a template argument, so that the per-row sums unroll into registers.
template <bool kTwo, int64_t rows>
void int4_block(const uint8_t* w, const at::Half* sh, const at::Half* mh,
                const QuantizedRows& x, int64_t m0, int64_t groups, float* out, int64_t ld,
                int64_t valid) {
  const int64_t k = groups * kGroup;
#if defined(TANDEM_VNNI)
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * 256;
    __m512i dot[kMaxRows], dot2[kMaxRows];
    for (int64_t r = 0; r < rows; ++r) dot[r] = dot2[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i b = _mm512_loadu_si512(wg + c * 64);
      const __m512i lo = _mm512_and_si512(b, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (m0 + r) * k + g * kGroup;
        const int8_t* xg = x.values.data() + at;
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(load4(xg + 4 * c)));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(load4(xg + 16 + 4 * c)));
        if constexpr (kTwo) {
          const int8_t* xg2 = x.values2.data() + at;
          dot2[r] = _mm512_dpbusd_epi32(dot2[r], lo, _mm512_set1_epi32(load4(xg2 + 4 * c)));
          dot2[r] = _mm512_dpbusd_epi32(dot2[r], hi,
                                        _mm512_set1_epi32(load4(xg2 + 16 + 4 * c)));
        }
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(sh + g * kRows)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(mh + g * kRows)));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = (m0 + r) * groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                               _mm512_mul_ps(s, _mm512_set1_ps(x.scales[i])), acc[r]);
      if constexpr (kTwo) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2[r]),
                                 _mm512_mul_ps(s, _mm512_set1_ps(x.scales2[i])), acc[r]);
      }
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.sums[i]), acc[r]);
      acc[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(x.offsets[i]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ld, keep, acc[r]);
#elif defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // u8 (0..15) x s8 pairs stay within int16: no saturation
  const auto madd = [&](__m256i lo, __m256i hi, const int8_t* xc) {
    return _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xc))),
                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xc + 16)))),
        ones);
  };
  for (int64_t half = 0; half < 2; ++half) {  // rows 0-7, then 8-15 of the block
    __m256 acc[kMaxRows];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + g * 256 + half * 32;
      __m256i dot[kMaxRows], dot2[kMaxRows];
      for (int64_t r = 0; r < rows; ++r) dot[r] = dot2[r] = _mm256_setzero_si256();
      for (int64_t c = 0; c < 4; ++c) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 64));
        const __m256i lo = _mm256_and_si256(b, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = (m0 + r) * k + g * kGroup + 4 * c;
          dot[r] = _mm256_add_epi32(dot[r], madd(lo, hi, x.values.data() + at));
          if constexpr (kTwo) {
            dot2[r] = _mm256_add_epi32(dot2[r], madd(lo, hi, x.values2.data() + at));
          }
        }
      }
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(sh + g * kRows + half * 8)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(mh + g * kRows + half * 8)));
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = (m0 + r) * groups + g;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                 _mm256_mul_ps(s, _mm256_set1_ps(x.scales[i])), acc[r]);
        if constexpr (kTwo) {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2[r]),
                                   _mm256_mul_ps(s, _mm256_set1_ps(x.scales2[i])), acc[r]);
        }
        acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.sums[i]), acc[r]);
        acc[r] = _mm256_fmadd_ps(s, _mm256_set1_ps(x.offsets[i]), acc[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float lanes[8];
      _mm256_storeu_ps(lanes, acc[r]);
      for (int64_t i = 0; i < 8 && half * 8 + i < valid; ++i) {
        out[r * ld + half * 8 + i] = lanes[i];
      }
    }
  }
#else
  for (int64_t r = 0; r < rows; ++r) {
    float acc[kRows] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t i = (m0 + r) * groups + g, at = (m0 + r) * k + g * kGroup;
      for (int64_t row = 0; row < kRows; ++row) {
        int32_t dot = 0, dot2 = 0;
        for (int64_t c = 0; c < 4; ++c) {
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t b = w[g * 256 + c * 64 + row * 4 + j];
            const int64_t l = at + 4 * c + j, h = l + 16;
            dot += (b & 0x0F) * x.values[l] + (b >> 4) * x.values[h];
            if constexpr (kTwo) dot2 += (b & 0x0F) * x.values2[l] + (b >> 4) * x.values2[h];
          }
        }
        const float s = half_to_float(sh[g * kRows + row]);
        const float mn = half_to_float(mh[g * kRows + row]);
        float term = static_cast<float>(dot) * (s * x.scales[i]);
        if constexpr (kTwo) term += static_cast<float>(dot2) * (s * x.scales2[i]);
        acc[row] += term + mn * x.sums[i] + s * x.offsets[i];
      }
    }
    for (int64_t i = 0; i < valid; ++i) out[r * ld + i] = acc[i];
  }
#endif
}

#if defined(TANDEM_VNNI)
// Output rows j0..j0+valid-1 of int8 weights [N, K] (row scales `s8`) times activation
// rows m0..m0+R-1: out[r * ld + j]. vpdpbusd takes one unsigned operand, so the weights
// are offset to unsigned bytes (w ^ 0x80 = w + 128) and 128 times each group's sum comes
// off again (`offsets8`); a 64-byte chunk is two groups, scaled by `lane_scales`.
template <bool kTwo, int64_t R>
void int8_block(const int8_t* w8, const float* s8, const QuantizedRows& x, int64_t m0,
                int64_t k, int64_t j0, int64_t valid, float* out, int64_t ld) {
  const int64_t groups = k / kGroup, chunks = (k + 63) / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  float corr[R];
  for (int64_t r = 0; r < R; ++r) {
    const float* o = x.offsets8.data() + (m0 + r) * groups;
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) total += o[g];
    corr[r] = total;
  }
  for (int64_t j = j0; j < j0 + valid; ++j) {
    const int8_t* wj = w8 + j * k;
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const bool whole = c * 64 + 64 <= k;  // else the last group alone
      const __mmask64 bytes = whole ? ~0ull : 0xFFFFFFFFull;
      const __mmask16 lanes = whole ? 0xFFFF : 0x00FF;
      const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, wj + c * 64), flip);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512i xv = _mm512_maskz_loadu_epi8(bytes, x.values.data() + m * k + c * 64);
        const __m512 sc = _mm512_maskz_loadu_ps(lanes, x.lane_scales.data() +
                                                           m * groups * 8 + c * 16);
        acc[r] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv)), sc,
            acc[r]);
        if constexpr (kTwo) {
          const __m512i xv2 = _mm512_maskz_loadu_epi8(bytes,
                                                      x.values2.data() + m * k + c * 64);
          const __m512 sc2 = _mm512_maskz_loadu_ps(lanes, x.lane_scales2.data() +
                                                              m * groups * 8 + c * 16);
          acc[r] = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv2)), sc2,
              acc[r]);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      out[r * ld + j] = s8[j] * (_mm512_reduce_add_ps(acc[r]) - corr[r]);
    }
  }
}
#endif

// sum_g dx[g] * (w . xq) over one int8 weight row's groups (times nothing: the caller
// scales by the row's scale).
float int8_dot(const int8_t* w, const int8_t* xq, const float* dx, int64_t groups) {
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroup));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * kGroup));
    // maddubs takes one unsigned operand: |w| times x with w's sign
    const __m256i dot = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)),
        _mm256_set1_epi16(1));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[g]), acc);
  }
  return hsum(acc);
#else
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t dot = 0;
    for (int64_t k = 0; k < kGroup; ++k) dot += w[g * kGroup + k] * xq[g * kGroup + k];
    total += dx[g] * static_cast<float>(dot);
  }
  return total;
#endif
}

// Row m of the activations times int8 weight row `w` (scale `s`).
float int8_row(const int8_t* w, float s, const QuantizedRows& x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  float total = int8_dot(w, x.values.data() + m * k, x.scales.data() + m * groups, groups);
  if (x.precise) {
    total += int8_dot(w, x.values2.data() + m * k, x.scales2.data() + m * groups, groups);
  }
  return s * total;
}

void check_rows(const torch::Tensor& x, int64_t cols, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              what, ": activations must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == cols && cols % kGroup == 0, what, ": K=", x.size(1),
              " must equal the weight's ", cols, " and be a multiple of 32");
}

// One projection's packed weight, as the kernels read it.
struct Projection {
  bool int4 = true;
  int64_t n = 0, k = 0;
  const uint8_t* w4 = nullptr;   // int4: [ceil(N/16), G * 256]
  const at::Half* s4 = nullptr;  // int4: [ceil(N/16), G, 16]
  const at::Half* mn4 = nullptr;
  const int8_t* w8 = nullptr;    // int8: [N, K]
  const float* s8 = nullptr;     // int8: [N]
  const float* bias = nullptr;   // [N] or none
};

// int4 (`w` uint8) or int8 (`w` int8) weights of `n` output rows, checked.
Projection projection(const torch::Tensor& w, const torch::Tensor& s, const torch::Tensor& mn,
                      const torch::Tensor& bias, int64_t n, const char* what) {
  Projection p;
  p.n = n;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && s.is_contiguous(), what,
              ": a contiguous 2-D packed weight and contiguous scales");
  if (w.scalar_type() == torch::kUInt8) {
    const int64_t blocks = (n + kRows - 1) / kRows;
    TORCH_CHECK(w.size(0) == blocks && w.size(1) % 256 == 0, what, ": int4 weights of ", n,
                " rows are packed [", blocks, ", K/32 * 256], not ", w.sizes());
    p.k = w.size(1) / 8;
    TORCH_CHECK(s.scalar_type() == torch::kHalf && mn.scalar_type() == torch::kHalf &&
                    mn.is_contiguous() && s.numel() == blocks * (p.k / kGroup) * kRows &&
                    mn.numel() == s.numel(),
                what, ": int4 weights take float16 scales and minimums [N/16, K/32, 16]");
    p.w4 = w.data_ptr<uint8_t>();
    p.s4 = s.data_ptr<at::Half>();
    p.mn4 = mn.data_ptr<at::Half>();
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.size(0) == n &&
                    s.scalar_type() == torch::kFloat32 && s.numel() == n,
                what, ": int8 weights [N, K] take float32 scales [N]");
    p.int4 = false;
    p.k = w.size(1);
    p.w8 = w.data_ptr<int8_t>();
    p.s8 = s.data_ptr<float>();
  }
  TORCH_CHECK(p.k % kGroup == 0, what, ": K=", p.k, " must be a multiple of 32");
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.numel() == n &&
                    bias.is_contiguous(),
                what, ": a float32 bias of N values");
    p.bias = bias.data_ptr<float>();
  }
  return p;
}

// Output rows 16b..16b+15 of `p` for every activation row: out is [rows, p.n].
void project_block(const Projection& p, const QuantizedRows& xq, int64_t rows, int64_t b,
                   float* out) {
  const int64_t k = p.k, first = b * kRows;
  const int64_t valid = std::min(kRows, p.n - first);
  if (p.int4) {
    using Block = void (*)(const uint8_t*, const at::Half*, const at::Half*,
                           const QuantizedRows&, int64_t, int64_t, float*, int64_t, int64_t);
    static constexpr Block kBlocks[2][kMaxRows] = {
        {int4_block<false, 1>, int4_block<false, 2>, int4_block<false, 3>,
         int4_block<false, 4>},
        {int4_block<true, 1>, int4_block<true, 2>, int4_block<true, 3>, int4_block<true, 4>}};
    const int64_t groups = k / kGroup;
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      kBlocks[xq.precise][std::min(kMaxRows, rows - m0) - 1](
          p.w4 + b * groups * 256, p.s4 + b * groups * kRows, p.mn4 + b * groups * kRows, xq,
          m0, groups, out + m0 * p.n + first, p.n, valid);
    }
  } else {
#if defined(TANDEM_VNNI)
    // Up to kRowKernelRows rows: the row kernel below, a weight row (in L1) for every
    // activation row in turn; more: this one, which reads the weights once for 4 of them
    // (SmolLM2's 49,152-row head: 1.1 ms for 1 row; 1.7 against 5.3 for 2, 2.9 against
    // 6.4 for 4, 6.7 against 8.0 for 8; 14.4 against 11.2 for 16. Its int8 decoder layers
    // at 2 rows: 6.9 ms against 20.3)
    const int64_t vnni_rows = rows <= kRowKernelRows ? 0 : rows;
    using Block = void (*)(const int8_t*, const float*, const QuantizedRows&, int64_t,
                           int64_t, int64_t, int64_t, float*, int64_t);
    static constexpr Block kBlocks[2][kMaxRows] = {
        {int8_block<false, 1>, int8_block<false, 2>, int8_block<false, 3>,
         int8_block<false, 4>},
        {int8_block<true, 1>, int8_block<true, 2>, int8_block<true, 3>, int8_block<true, 4>}};
    for (int64_t m0 = 0; m0 < vnni_rows; m0 += kMaxRows) {
      kBlocks[xq.precise][std::min(kMaxRows, vnni_rows - m0) - 1](
          p.w8, p.s8, xq, m0, k, first, valid, out + m0 * p.n, p.n);
    }
#else
    const int64_t vnni_rows = 0;
#endif
    for (int64_t j = first; j < first + valid; ++j) {
      for (int64_t m = vnni_rows; m < rows; ++m) {
        out[m * p.n + j] = int8_row(p.w8 + j * k, p.s8[j], xq, m, k);
      }
    }
  }
  if (p.bias != nullptr) {
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = first; j < first + valid; ++j) out[m * p.n + j] += p.bias[j];
    }
  }
}

// Runs body(i) for i in 0..items-1 on some threads (`parallel_items`: ATen's pool).
using ForEach = std::function<void(int64_t items, const std::function<void(int64_t)>& body)>;

void parallel_items(int64_t items, const std::function<void(int64_t)>& body) {
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) body(i);
  });
}

// outs[i] ([rows, projs[i].n]) = x times each projection (all of the same K), the
// activations quantized once into `xq`; one parallel pass over the 16-row blocks of all,
// a few blocks an item.
void project(const Projection* projs, int count, const float* x, int64_t rows,
             QuantizedRows& xq, float* const* outs, const ForEach& for_each = parallel_items) {
  const int64_t groups = rows * (projs[0].k / kGroup);
  xq.values.resize(groups * kGroup);
  xq.scales.resize(groups);
  if (xq.precise) {
    xq.values2.resize(groups * kGroup);
    xq.scales2.resize(groups);
  }
  xq.sums.resize(groups);
  xq.offsets.resize(groups);
#if defined(TANDEM_VNNI)
  xq.lane_scales.resize(groups * 8);
  if (xq.precise) xq.lane_scales2.resize(groups * 8);
  xq.offsets8.resize(groups);
#endif
  // Activations as int8 once (shared out only where a step has many rows: a prefill chunk)
  constexpr int64_t kQuantizeChunk = 512;  // groups an item
  if (groups <= kQuantizeChunk) {
    for (int64_t i = 0; i < groups; ++i) quantize_group(x, i, xq);
  } else {
    for_each((groups + kQuantizeChunk - 1) / kQuantizeChunk, [&](int64_t item) {
      const int64_t end = std::min(groups, (item + 1) * kQuantizeChunk);
      for (int64_t i = item * kQuantizeChunk; i < end; ++i) quantize_group(x, i, xq);
    });
  }
  int64_t starts[8], total = 0;  // the first block of each projection, in the joint count
  TORCH_CHECK(count <= 7, "project: at most 7 projections at once");
  for (int i = 0; i < count; ++i) {
    starts[i] = total;
    total += (projs[i].n + kRows - 1) / kRows;
  }
  starts[count] = total;
  const int64_t chunk = std::max<int64_t>(1, total / 8);  // few items: each is a shared update
  for_each((total + chunk - 1) / chunk, [&](int64_t item) {
    for (int64_t j = item * chunk; j < std::min(total, (item + 1) * chunk); ++j) {
      int i = 0;
      while (j >= starts[i + 1]) ++i;
      project_block(projs[i], xq, rows, j - starts[i], outs[i]);
    }
  });
}

}  // namespace

// `precise`: activations in two int8 terms (QuantizedRows).
torch::Tensor int4_matvec(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          torch::Tensor mins, int64_t n, bool precise) {
  const Projection p = projection(weight, scales, mins, torch::Tensor(), n, "int4_matvec");
  TORCH_CHECK(p.int4, "int4_matvec: uint8 int4 weights");
  check_rows(x, p.k, "int4_matvec");
  QuantizedRows xq;
  xq.precise = precise;
  auto out = torch::empty({x.size(0), n}, x.options());
  float* o = out.data_ptr<float>();
  project(&p, 1, x.data_ptr<float>(), x.size(0), xq, &o);
  return out;
}

torch::Tensor int8_matvec(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          bool precise) {
  const Projection p = projection(weight, scales, torch::Tensor(), torch::Tensor(),
                                  weight.size(0), "int8_matvec");
  TORCH_CHECK(!p.int4, "int8_matvec: int8 weights");
  check_rows(x, p.k, "int8_matvec");
  QuantizedRows xq;
  xq.precise = precise;
  auto out = torch::empty({x.size(0), p.n}, x.options());
  float* o = out.data_ptr<float>();
  project(&p, 1, x.data_ptr<float>(), x.size(0), xq, &o);
  return out;
}

// RMSNorm of float32 rows in one pass each (the torch form takes ~8 ops a call):
// out = weight * x / sqrt(mean(x^2) + eps), with the mean accumulated in double.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
                  x.is_contiguous() && weight.is_contiguous() && x.size(-1) == weight.numel(),
              "rms_norm: contiguous float32 rows and a float32 weight of their width");
  const int64_t d = weight.numel(), rows = x.numel() / d;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(xp + r * d, wp, d, static_cast<float>(eps), op + r * d);
    }
  });
  return out;
}

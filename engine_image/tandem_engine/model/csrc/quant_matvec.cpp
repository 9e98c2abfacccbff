// Weight-only int4 / int8 projections for the few rows of a decode step, on CPUs.
//
// A decode step at batch 1 multiplies one row of activations by every weight: the time
// is spent decoding weights, not in arithmetic. Each group of 32 activations is rounded
// to int8 with its own scale (as llama.cpp's Q8 activations), so 32 weights and 32
// activations meet in one integer multiply-add of bytes (AVX2: maddubs + madd), and the
// group's float scale is applied once:
//
//   int4: out[m, n] = sum_g  s[n, g] * dx[m, g] * sum_k (q[n, k] - 8) * xq[m, k]
//                          + (mn[n, g] + 8 s[n, g]) * xsum[m, g]   (w = q * s + mn, q 0..15)
//   int8: out[m, n] = s[n] * sum_g dx[m, g] * sum_k q[n, k] * xq[m, k]   (w = q * s)
//
// int4 weights: [N, K/2] bytes, group g's 16 bytes hold columns 32g..32g+15 in their low
// nibbles and 32g+16..32g+31 in their high ones; its scales and minimums are float16 (as
// a GGUF Q4 block's). Output rows are split over ATen's pool.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 32;

// Rows of activations as int8 per group of 32: values, scales, and the float sums.
// AVX-512 VNNI (vpdpbusd): the int4 kernel takes two groups a step, 64 byte products in
// one instruction (int4_rows_vnni).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define TANDEM_VNNI 1
#endif

struct QuantizedRows {
  std::vector<int8_t> values;  // [M, K]
  std::vector<float> scales;   // [M, K / 32]
  std::vector<float> sums;     // [M, K / 32]
#if defined(TANDEM_VNNI)
  // The same values, each pair of groups (g, g + 1) laid out as the int4 weights decode:
  // g's columns 0-15, g+1's 0-15, g's 16-31, g+1's 16-31 (an odd last group as it is).
  std::vector<int8_t> pairs;   // [M, K]
  // 8 * (sum of the group's values - scale * sum of its int8 values): what the int4
  // kernel's unsigned products (q, not q - 8) leave out, per group.
  std::vector<float> offsets;  // [M, K / 32]
#endif
};

// Rows of activations as int8 per group of 32, into `q`'s buffers (reused between calls).
void quantize_into(const float* x, int64_t rows, int64_t cols, QuantizedRows& q) {
  const int64_t groups = cols / kGroup;
  q.values.resize(rows * cols);
  q.scales.resize(rows * groups);
  q.sums.resize(rows * groups);
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* g = x + i * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t k = 0; k < kGroup; ++k) {
      amax = std::max(amax, std::fabs(g[k]));
      sum += g[k];
    }
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t k = 0; k < kGroup; ++k) {
      q.values[i * kGroup + k] = static_cast<int8_t>(std::nearbyint(g[k] * inv));
    }
    q.scales[i] = scale;
    q.sums[i] = sum;
  }
#if defined(TANDEM_VNNI)
  q.pairs.resize(rows * cols);
  q.offsets.resize(rows * groups);
  for (int64_t i = 0; i < rows * groups; ++i) {
    const int8_t* v = q.values.data() + i * kGroup;
    int32_t isum = 0;
    for (int64_t k = 0; k < kGroup; ++k) isum += v[k];
    q.offsets[i] = 8.f * (q.sums[i] - q.scales[i] * static_cast<float>(isum));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* src = q.values.data() + r * cols;
    int8_t* dst = q.pairs.data() + r * cols;
    int64_t g = 0;
    for (; g + 1 < groups; g += 2) {
      const int8_t* a = src + g * kGroup;
      int8_t* out = dst + g * kGroup;
      std::copy_n(a, 16, out);
      std::copy_n(a + kGroup, 16, out + 16);
      std::copy_n(a + 16, 16, out + 32);
      std::copy_n(a + kGroup + 16, 16, out + 48);
    }
    if (g < groups) std::copy_n(src + g * kGroup, kGroup, dst + g * kGroup);
  }
#endif
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t cols) {
  QuantizedRows q;
  quantize_into(x, rows, cols, q);
  return q;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum over 32 columns of u8 weights x s8 activations, as 8 int32 lanes in float
inline __m256 dot32(__m256i w_u8, __m256i x_s8) {
  const __m256i pairs = _mm256_maddubs_epi16(w_u8, x_s8);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// Rows m0..m0+R-1 of the activations times one int4 weight row (R <= kMaxRows): each
// group of weights is decoded once for all R rows.
constexpr int64_t kMaxRows = 4;

inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// One int4 weight row times activation rows m0..m0+R-1 (R <= kMaxRows): each group of
// weights is decoded once for all R rows. `sh`, `mh`: the row's float16 scales and
// minimums (w = q * s + mn, so the zero of q - 8 is mn + 8 s, taken in float32).
[[maybe_unused]] void int4_rows(const uint8_t* w, const at::Half* sh, const at::Half* mh,
               const QuantizedRows& x, int64_t m0, int64_t rows, int64_t groups, float* out) {
  const int64_t k = groups * kGroup;
  float extra[kMaxRows] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i eight = _mm256_set1_epi8(8);
  __m256 acc[kMaxRows] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                          _mm256_setzero_ps()};
#else
  float acc[kMaxRows] = {0.f, 0.f, 0.f, 0.f};
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const float s = half_to_float(sh[g]);
    const float z = half_to_float(mh[g]) + 8.f * s;
    for (int64_t r = 0; r < rows; ++r) extra[r] += z * x.sums[(m0 + r) * groups + g];
#if defined(__AVX2__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i lo = _mm_and_si128(b, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    const __m256i wv = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);  // q - 8
    const __m256i wabs = _mm256_sign_epi8(wv, wv);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.values.data() + m * k + g * kGroup));
      // maddubs takes one unsigned operand: |q - 8| times x with q - 8's sign
      const __m256i dot = _mm256_madd_epi16(
          _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_set1_ps(s * x.scales[m * groups + g]), acc[r]);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = x.values.data() + m * k + g * kGroup;
      int32_t dot = 0;
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t b = w[g * 16 + j];
        dot += ((b & 0x0F) - 8) * xq[j] + ((b >> 4) - 8) * xq[16 + j];
      }
      acc[r] += s * x.scales[m * groups + g] * static_cast<float>(dot);
    }
#endif
  }
#if defined(__AVX2__)
  for (int64_t r = 0; r < rows; ++r) out[r] = hsum(acc[r]) + extra[r];
#else
  for (int64_t r = 0; r < rows; ++r) out[r] = acc[r] + extra[r];
#endif
}

#if defined(TANDEM_VNNI)
// int4_rows with AVX-512 VNNI. Unsigned weights q (0..15) meet the int8 activations in
// vpdpbusd; sum (q - 8) x = sum q x - 8 sum x, and with w = q * s + mn a group adds
// s * dx * sum q xq + mn * xsum + s * offset (offset: QuantizedRows.offsets).
void int4_rows_vnni(const uint8_t* w, const at::Half* sh, const at::Half* mh,
                    const QuantizedRows& x, int64_t m0, int64_t rows, int64_t groups,
                    float* out) {
  const int64_t k = groups * kGroup;
  // Per row the group factors s * dx, each repeated 4 times (a dot lane covers 4 bytes).
  thread_local std::vector<float> factors;
  factors.resize(kMaxRows * groups * 4 + 16);
  const __m512i spread_lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_hi = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  __m512 extra[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float* dx = x.scales.data() + m * groups;
    const float* xsum = x.sums.data() + m * groups;
    const float* off = x.offsets.data() + m * groups;
    float* f = factors.data() + r * groups * 4;
    extra[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 8) {
      const int64_t n = std::min<int64_t>(8, groups - g);
      const __mmask8 mask8 = static_cast<__mmask8>((1u << n) - 1);
      const __m256 s8 = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask8, sh + g));
      const __m256 mn8 = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask8, mh + g));
      const __m256 f8 = _mm256_mul_ps(s8, _mm256_maskz_loadu_ps(mask8, dx + g));
      const __m512 wide = _mm512_castps256_ps512(f8);
      _mm512_storeu_ps(f + g * 4, _mm512_permutexvar_ps(spread_lo, wide));
      _mm512_storeu_ps(f + g * 4 + 16, _mm512_permutexvar_ps(spread_hi, wide));
      const __m256 e = _mm256_fmadd_ps(mn8, _mm256_maskz_loadu_ps(mask8, xsum + g),
                                       _mm256_mul_ps(s8, _mm256_maskz_loadu_ps(mask8, off + g)));
      extra[r] = _mm512_add_ps(extra[r], _mm512_castps256_ps512(e));
    }
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16));
    const __m256i lo = _mm256_and_si256(b, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.pairs.data() + (m0 + r) * k + g * kGroup);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
      const __m512 fac = _mm512_broadcast_f32x8(
          _mm256_loadu_ps(factors.data() + r * groups * 4 + g * 4));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), fac, acc[r]);
    }
  }
  float tail[kMaxRows] = {0.f, 0.f, 0.f, 0.f};
  if (g < groups) {  // an odd last group, 256 bits wide
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask),
                                         _mm_and_si128(b, mask));
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.pairs.data() + (m0 + r) * k + g * kGroup));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
      tail[r] = hsum(_mm256_cvtepi32_ps(dot)) * factors[r * groups * 4 + g * 4];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r] + _mm512_reduce_add_ps(extra[r]);
  }
}
#endif

// One int4 weight row times activation rows m0..m0+R-1: the widest kernel this build has.
inline void int4_dot(const uint8_t* w, const at::Half* sh, const at::Half* mh,
                     const QuantizedRows& x, int64_t m0, int64_t rows, int64_t groups,
                     float* out) {
#if defined(TANDEM_VNNI)
  int4_rows_vnni(w, sh, mh, x, m0, rows, groups, out);
#else
  int4_rows(w, sh, mh, x, m0, rows, groups, out);
#endif
}

float int8_row(const int8_t* w, float s, const int8_t* xq, const float* dx, int64_t groups) {
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
  return s * hsum(acc);
#else
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t dot = 0;
    for (int64_t k = 0; k < kGroup; ++k) dot += w[g * kGroup + k] * xq[g * kGroup + k];
    total += dx[g] * static_cast<float>(dot);
  }
  return s * total;
#endif
}

void check_rows(const torch::Tensor& x, int64_t cols, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              what, ": activations must be contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) == cols && cols % kGroup == 0, what, ": K=", x.size(1),
              " must equal the weight's ", cols, " and be a multiple of 32");
}

}  // namespace

torch::Tensor int4_matvec(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          torch::Tensor mins) {
  const int64_t n = weight.size(0), k = weight.size(1) * 2, groups = k / kGroup;
  check_rows(x, k, "int4_matvec");
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() &&
                  scales.sizes() == mins.sizes() && scales.size(0) == n &&
                  scales.size(1) == groups && scales.is_contiguous() && mins.is_contiguous() &&
                  scales.scalar_type() == torch::kHalf && mins.scalar_type() == torch::kHalf,
              "int4_matvec: weight [N, K/2] uint8 with scales and mins [N, K/32] float16");
  const int64_t rows = x.size(0);
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), rows, k);
  auto out = torch::empty({rows, n}, x.options());
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float part[kMaxRows];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int64_t r = std::min(kMaxRows, rows - m0);
        int4_dot(w + j * (k / 2), s + j * groups, mn + j * groups, xq, m0, r, groups, part);
        for (int64_t i = 0; i < r; ++i) o[(m0 + i) * n + j] = part[i];
      }
    }
  });
  return out;
}

torch::Tensor int8_matvec(torch::Tensor x, torch::Tensor weight, torch::Tensor scales) {
  const int64_t n = weight.size(0), k = weight.size(1), groups = k / kGroup;
  check_rows(x, k, "int8_matvec");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.is_contiguous() &&
                  scales.dim() == 1 && scales.size(0) == n &&
                  scales.scalar_type() == torch::kFloat32,
              "int8_matvec: weight [N, K] int8 with scales [N] float32");
  const int64_t rows = x.size(0);
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), rows, k);
  auto out = torch::empty({rows, n}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t m = 0; m < rows; ++m) {
        o[m * n + j] = int8_row(w + j * k, s[j], xq.values.data() + m * k,
                                xq.scales.data() + m * groups, groups);
      }
    }
  });
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
      const float* row = xp + r * d;
      double sq = 0.0;
      for (int64_t i = 0; i < d; ++i) sq += static_cast<double>(row[i]) * row[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sq / d) + static_cast<float>(eps));
      for (int64_t i = 0; i < d; ++i) op[r * d + i] = wp[i] * (row[i] * inv);
    }
  });
  return out;
}

// The float32 weight of int4 rows (for a step with many rows: one dequantization, then
// oneDNN's float32 matmul, beats decoding the weights again for every row).
torch::Tensor int4_dequantize(torch::Tensor weight, torch::Tensor scales, torch::Tensor mins) {
  const int64_t n = weight.size(0), k = weight.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() &&
                  scales.scalar_type() == torch::kHalf && mins.scalar_type() == torch::kHalf &&
                  scales.size(0) == n && scales.size(1) == groups,
              "int4_dequantize: weight [N, K/2] uint8, scales and mins [N, K/32] float16");
  auto out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  const at::Half* mn = mins.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t g = 0; g < groups; ++g) {
        const float sc = half_to_float(s[j * groups + g]);
        const float lo = half_to_float(mn[j * groups + g]);
        const uint8_t* b = w + j * (k / 2) + g * 16;
        float* row = o + j * k + g * kGroup;
        for (int64_t i = 0; i < 16; ++i) {
          row[i] = (b[i] & 0x0F) * sc + lo;
          row[16 + i] = (b[i] >> 4) * sc + lo;
        }
      }
    }
  });
  return out;
}

torch::Tensor int8_dequantize(torch::Tensor weight, torch::Tensor scales) {
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == torch::kInt8 && weight.is_contiguous() &&
                  scales.scalar_type() == torch::kFloat32 && scales.size(0) == n,
              "int8_dequantize: weight [N, K] int8, scales [N] float32");
  auto out = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t i = 0; i < k; ++i) o[j * k + i] = w[j * k + i] * s[j];
    }
  });
  return out;
}

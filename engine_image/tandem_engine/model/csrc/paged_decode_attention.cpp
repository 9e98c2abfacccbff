// Decode attention straight from the paged KV cache, for CPUs.
//
// One query token per request. Keys and values are read in place from their blocks
// (no gather into a padded copy), once each: a first pass computes every query head's
// scores, a second pass accumulates the values. Requests are split over ATen's
// thread pool. float32 caches take attention_rows.cpp's rows (as the decode stack's),
// bfloat16 and float16 the loop below.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_attention_kernel(const T* q, const T* k_cache, const T* v_cache,
                             const int64_t* block_tables, const int64_t* ctx_lens, T* out,
                             int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * head_dim;  // one position's keys, all KV heads
  const int64_t block_stride = block_size * token_stride;
  // One request per work item: its keys and values are streamed block by block, each
  // position's row (every KV head) used by all query heads while it is in cache.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * head_dim);
    std::vector<float> acc(heads * head_dim);
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = ctx_lens[b];
      const int64_t* table = block_tables + b * table_width;
      const T* qb = q + b * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = to_float(qb[i]) * scale;
      scores.assign(heads * len, 0.0f);
      // Pass 1: scores[head][pos]. Block by block and KV head by query head: no index
      // divided per score (a division cost more than the score's arithmetic).
      for (int64_t pos0 = 0, blk = 0; pos0 < len; pos0 += block_size, ++blk) {
        const T* block = k_cache + table[blk] * block_stride;
        for (int64_t t = 0; t < std::min(block_size, len - pos0); ++t) {
          for (int64_t kv = 0; kv < kv_heads; ++kv) {
            const T* key = block + t * token_stride + kv * head_dim;
            for (int64_t hd = kv * group; hd < (kv + 1) * group; ++hd) {
              const float* qh = qf.data() + hd * head_dim;
              float s = 0.0f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * to_float(key[d]);
              scores[hd * len + pos0 + t] = s;
            }
          }
        }
      }
      // Softmax per query head.
      for (int64_t hd = 0; hd < heads; ++hd) {
        float* sh = scores.data() + hd * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < len; ++pos) m = std::max(m, sh[pos]);
        float total = 0.0f;
        for (int64_t pos = 0; pos < len; ++pos) {
          sh[pos] = std::exp(sh[pos] - m);
          total += sh[pos];
        }
        const float inv = 1.0f / total;
        for (int64_t pos = 0; pos < len; ++pos) sh[pos] *= inv;
      }
      // Pass 2: weighted sum of values.
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t pos0 = 0, blk = 0; pos0 < len; pos0 += block_size, ++blk) {
        const T* block = v_cache + table[blk] * block_stride;
        for (int64_t t = 0; t < std::min(block_size, len - pos0); ++t) {
          for (int64_t kv = 0; kv < kv_heads; ++kv) {
            const T* value = block + t * token_stride + kv * head_dim;
            for (int64_t hd = kv * group; hd < (kv + 1) * group; ++hd) {
              const float p = scores[hd * len + pos0 + t];
              float* ah = acc.data() + hd * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * to_float(value[d]);
            }
          }
        }
      }
      T* dst = out + b * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// q: [B, heads, D]; caches: [num_blocks, block_size, kv_heads, D] (contiguous);
// block_tables: [B, W] int64; ctx_lens: [B] int64. Returns [B, heads, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [B, H, D], caches [N, bs, Hk, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong,
              "paged_decode_attention: block tables and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = torch::empty_like(qc);
  if (qc.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32) {
    attend_rows(qc.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(), tables.size(1),
                lens.data_ptr<int64_t>(), qc.size(0), qc.size(1), k_cache.size(2), qc.size(2),
                k_cache.size(1), static_cast<float>(scale),
                [](int64_t items, const std::function<void(int64_t)>& body) {
                  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
                    for (int64_t i = begin; i < end; ++i) body(i);
                  });
                });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_attention_kernel<scalar_t>(
        qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
        qc.size(0), qc.size(1), k_cache.size(2), qc.size(2), k_cache.size(1), tables.size(1),
        static_cast<float>(scale));
  });
  return out;
}

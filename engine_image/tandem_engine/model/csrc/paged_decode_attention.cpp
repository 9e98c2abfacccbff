// Decode attention straight from the paged KV cache, for CPUs: the eager path's entry to
// attention_rows.cpp (the decode stack's own rows).
//
// One query token per request. Keys and values are read in place from their blocks
// (no gather into a padded copy), once each: a first pass computes every query head's
// scores, a second pass accumulates the values. Work is split over ATen's thread pool.
// Queries are taken as float32 (a bfloat16 or float16 model's are widened, its output
// narrowed back); the cache may be float32, bfloat16 or float16.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <functional>

// q: [B, heads, D]; caches: [num_blocks, block_size, kv_heads, D] (contiguous, D <= 512);
// block_tables: [B, W] int64; ctx_lens: [B] int64. Returns [B, heads, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: q must be [B, H, D], caches [N, bs, Hk, D] of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && ctx_lens.scalar_type() == torch::kLong,
              "paged_decode_attention: block tables and lengths must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) <= kMaxHeadDim,
              "paged_decode_attention: head size at most ", kMaxHeadDim,
              ", the same in q and the caches");
  auto qf = q.to(torch::kFloat32).contiguous();
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = torch::empty_like(qf);
  dispatch_cache(k_cache, "paged_decode_attention", [&](auto element) {
    using C = decltype(element);
    attend_rows(qf.data_ptr<float>(), out.data_ptr<float>(), cache_elements<C>(k_cache),
                cache_elements<C>(v_cache), tables.data_ptr<int64_t>(), tables.size(1),
                lens.data_ptr<int64_t>(), qf.size(0), qf.size(1), k_cache.size(2), qf.size(2),
                k_cache.size(1), static_cast<float>(scale),
                [](int64_t items, const std::function<void(int64_t)>& body) {
                  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
                    for (int64_t i = begin; i < end; ++i) body(i);
                  });
                });
  });
  return out.to(q.scalar_type());
}

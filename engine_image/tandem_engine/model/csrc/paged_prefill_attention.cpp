// Prefill attention straight from the paged KV cache, for CPUs: float32 queries, a
// float32, bfloat16 or float16 cache (its keys widened as they are transposed, its values
// as they are read).
//
// A prefill chunk's L queries (positions start .. start + L - 1 of one request) attend
// causally to the request's keys and values, read from their blocks. torch's
// scaled_dot_product_attention over gathered blocks ran at about a sixth of this CPU's
// float32 peak: its tiles are matrix products with an inner dimension of the head size
// (64), called per tile. Here a work item is a KV head and a tile of 16 query positions,
// whose rows are the tile's positions times the KV head's query heads (for GQA the
// keys are read once for the whole group). The keys are first copied into a transposed
// scratch, where one head-dimension's values for `kLanes` positions are a
// vector, so a vector of scores is D fused multiply-adds, and a register block of rows
// shares each loaded key vector. The softmax is exact per row (all scores are at hand:
// no online rescaling), then the values are accumulated for a block of rows in
// registers, each value row read once per block. The transposed keys are made once per
// call and KV head; items are taken largest first from a shared counter (a causal
// tile's work grows with its position).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kAccVecs = 16;  // value accumulators kept in registers (of 32)
#else
constexpr int64_t kAccVecs = 8;   // (of 16)
#endif
constexpr int64_t kTile = 16;      // query positions a work item
constexpr int64_t kScoreRows = 8;  // rows whose scores share each key vector

struct PrefillShape {
  int64_t start, q_len, heads, kv_heads, group, block_size;
  float scale;
};

struct PrefillScratch {
  std::vector<float> q;       // [rows rounded up][D]: the item's queries, scaled
  std::vector<float> scores;  // [rows rounded up][cp]: scores, then probabilities
};

// keys[h][i][pos] = the cached key of KV head h at position pos, element i; zero from
// ctx to cp (a multiple of kLanes). Every tile of the chunk reads these.
template <int64_t D, typename C>
void transpose_keys(const PrefillShape& s, const C* k_cache, const int64_t* table,
                    int64_t ctx, int64_t cp, int64_t h, float* keys) {
  const int64_t bs = s.block_size, stride = s.kv_heads * D;
  float* kt = keys + h * D * cp;
  for (int64_t pos0 = 0, b = 0; pos0 < ctx; pos0 += bs, ++b) {
    const int64_t n = std::min(bs, ctx - pos0);
    const C* block = k_cache + table[b] * bs * stride + h * D;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < D; ++i) kt[i * cp + pos0 + t] = to_float(block[t * stride + i]);
  }
  for (int64_t i = 0; i < D; ++i) std::fill(kt + i * cp + ctx, kt + (i + 1) * cp, 0.f);
}

template <int64_t D, typename C>
void prefill_item(const PrefillShape& s, const float* q, float* out, const float* keys,
                  int64_t key_stride, const C* v_cache, const int64_t* table, int64_t h,
                  int64_t t0, PrefillScratch& w) {
  constexpr int64_t kVecs = D / kLanes;                        // vectors a row
  constexpr int64_t kValueRows = std::max<int64_t>(1, kAccVecs / kVecs);
  constexpr int64_t kPad = std::max(kScoreRows, kValueRows);  // rows read past the last
  const int64_t bs = s.block_size, stride = s.kv_heads * D, group = s.group;
  const int64_t nt = std::min(kTile, s.q_len - t0), rows = nt * group;
  const int64_t ctx = s.start + t0 + nt;  // keys the tile's last row sees
  const int64_t cp = whole_vectors(ctx);
  w.q.assign((rows + kPad) * D, 0.f);
  w.scores.resize((rows + kPad) * cp);
  const float* kt = keys + h * D * key_stride;
  float* qs = w.q.data();
  float* p = w.scores.data();
  std::fill(p + rows * cp, p + (rows + kPad) * cp, 0.f);
  for (int64_t t = 0; t < nt; ++t) {  // row t * group + g: position t0 + t, query head g
    const float* src = q + ((t0 + t) * s.heads + h * group) * D;
    for (int64_t i = 0; i < group * D; ++i) qs[t * group * D + i] = src[i] * s.scale;
  }

  for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
    const int64_t nr = std::min(kScoreRows, rows - r0);
    const float* qr = qs + r0 * D;
    for (int64_t c = 0; c < cp; c += kLanes) {
      Vec acc[kScoreRows] = {};
      for (int64_t i = 0; i < D; ++i) {
        const Vec key = load_vec(kt + i * key_stride + c);
        for (int64_t r = 0; r < kScoreRows; ++r) acc[r] += qr[r * D + i] * key;
      }
      for (int64_t r = 0; r < nr; ++r) store_vec(p + (r0 + r) * cp + c, acc[r]);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    float* pr = p + r * cp;
    const int64_t len = s.start + t0 + r / group + 1;  // causal: keys up to its position
    softmax_row(pr, len);
    std::fill(pr + whole_vectors(len), pr + cp, 0.f);
  }

  for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
    const int64_t nr = std::min(kValueRows, rows - r0);
    const int64_t upto = s.start + t0 + (r0 + nr - 1) / group + 1;  // the block's last row's
    Vec acc[kValueRows][kVecs] = {};
    for (int64_t pos0 = 0, b = 0; pos0 < upto; pos0 += bs, ++b) {
      const int64_t n = std::min(bs, upto - pos0);
      const C* block = v_cache + table[b] * bs * stride + h * D;
      for (int64_t t = 0; t < n; ++t) {
        Vec value[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) value[c] = load_vec(block + t * stride + c * kLanes);
        for (int64_t r = 0; r < kValueRows; ++r) {
          const float weight = p[(r0 + r) * cp + pos0 + t];
          for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += weight * value[c];
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t t = (r0 + r) / group, g = (r0 + r) % group;
      float* dst = out + ((t0 + t) * s.heads + h * group + g) * D;
      for (int64_t c = 0; c < kVecs; ++c) store_vec(dst + c * kLanes, acc[r][c]);
    }
  }
}

template <int64_t D, typename C>
void prefill_attention(const PrefillShape& s, const float* q, float* out, const C* k_cache,
                       const C* v_cache, const int64_t* table) {
  const int64_t ctx = s.start + s.q_len, cp = whole_vectors(ctx);
  std::vector<float> keys(s.kv_heads * D * cp);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h)
      transpose_keys<D, C>(s, k_cache, table, ctx, cp, h, keys.data());
  });
  const int64_t tiles = (s.q_len + kTile - 1) / kTile, items = tiles * s.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local PrefillScratch scratch;
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t tile = tiles - 1 - i / s.kv_heads;  // the largest first
      prefill_item<D, C>(s, q, out, keys.data(), cp, v_cache, table, i % s.kv_heads,
                      tile * kTile, scratch);
    }
  });
}

}  // namespace

// q: [L, heads, D], the queries of positions start .. start + L - 1 (float32; another
// dtype is widened, and the output narrowed back); caches: [num_blocks, block_size,
// kv_heads, D] float32, bfloat16 or float16 (contiguous), already holding the chunk's
// own keys and values; blocks: the request's block table, int64, covering start + L
// positions. Returns [L, heads, D]. D must be 64 or 128.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor blocks,
                                      int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention: q must be [L, H, D], caches [N, bs, Hk, D]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_prefill_attention: the K and V caches of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill_attention: caches must be contiguous");
  const int64_t d = q.size(2), heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && (d == 64 || d == 128),
              "paged_prefill_attention: head size 64 or 128, the same in q and the caches");
  TORCH_CHECK(heads % kv_heads == 0, "paged_prefill_attention: heads a multiple of KV heads");
  TORCH_CHECK(blocks.scalar_type() == torch::kLong && blocks.dim() == 1,
              "paged_prefill_attention: blocks must be a 1-D int64 block table");
  const int64_t block_size = k_cache.size(1), ctx = start + q.size(0);
  TORCH_CHECK(start >= 0 && blocks.numel() * block_size >= ctx,
              "paged_prefill_attention: the block table must cover ", ctx, " positions");
  auto qc = q.to(torch::kFloat32).contiguous();
  auto table = blocks.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b * block_size < ctx; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < k_cache.size(0), "paged_prefill_attention: block ",
                tp[b], " is outside the KV pool");
  auto out = torch::empty_like(qc);
  const PrefillShape shape{start, q.size(0), heads, kv_heads, heads / kv_heads, block_size,
                           static_cast<float>(scale)};
  dispatch_cache(k_cache, "paged_prefill_attention", [&](auto element) {
    using C = decltype(element);
    auto run = d == 64 ? &prefill_attention<64, C> : &prefill_attention<128, C>;
    run(shape, qc.data_ptr<float>(), out.data_ptr<float>(), cache_elements<C>(k_cache),
        cache_elements<C>(v_cache), tp);
  });
  return out.to(q.scalar_type());
}

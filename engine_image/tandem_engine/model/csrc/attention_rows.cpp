// Attention of single query rows (decodes) over the paged KV cache, for CPUs: each row
// one request's next position, its keys and values read in place from their blocks.
// The decode stack (decode_stack.cpp) runs its rows with these, and so does the eager
// path's paged_decode_attention. Queries and outputs are float32; the cache's elements
// (C) float32, bfloat16 or float16, each key and value row widened to float32 as it is
// read (a 16-bit cache halves the bytes, and the reads are the bound).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

namespace {

// Asks for the cache lines of `count` floats from `p` ahead of their use: a position's
// keys (or values) one block ahead, where the blocks of a context are scattered over the
// pool and the hardware prefetcher stops at each block's end.
template <typename C>
inline void prefetch(const C* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(C)) __builtin_prefetch(p + i);
}

// The head's row `x` as floats: itself for a float32 cache, else widened into `buf`.
template <typename C>
inline const float* as_floats(const C* x, int64_t d, float* buf) {
  if constexpr (std::is_same_v<C, float>) {
    return x;
  } else {
    widen_row(x, d, buf);
    return buf;
  }
}
constexpr int64_t kMaxHeadDim = 512;

struct AttendShape {
  int64_t block_size, kv_width, group, head_dim;
  float scale;
};

// visit(pos, row) for positions 0 .. len of KV head h of one layer's cache `base` (K or
// V), walked block by block: no index is divided per position (a division cost more
// than a score's arithmetic), and a position's next-block counterpart is prefetched (a
// context's blocks are scattered over the pool, and the hardware prefetcher stops at
// each block's end).
template <typename C, typename Visit>
inline void walk_positions(const AttendShape& s, const C* base, int64_t h, int64_t d,
                           const int64_t* table, int64_t len, Visit&& visit) {
  const int64_t bs = s.block_size, stride = s.kv_width;
  for (int64_t pos0 = 0, b = 0; pos0 < len; pos0 += bs, ++b) {
    const int64_t n = std::min(bs, len - pos0);
    const C* block = base + table[b] * bs * stride + h * d;
    const C* next = pos0 + bs < len ? base + table[b + 1] * bs * stride + h * d : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      if (next != nullptr) prefetch(next + t * stride, d);
      visit(pos0 + t, block + t * stride);
    }
  }
}

// The lanes' sum by halves (log2 of the lanes' count dependent adds, not one per lane).
inline float lane_sum(Vec v) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return _mm512_reduce_add_ps(x);
#else
  float half[kLanes];
  std::memcpy(half, &v, sizeof half);
  for (int64_t n = kLanes / 2; n > 0; n /= 2)
    for (int64_t i = 0; i < n; ++i) half[i] += half[i + n];
  return half[0];
#endif
}

// One item: the `kv_n` KV heads from `k`/`v` (already offset to the item's first head)
// and their `kv_n * group` query heads, one KV head at a time: first every query head's
// scores (a row of whole vectors each, `softmax_row`), then the weighted values. With
// the head size and group known at compile time (D, G; 0: the shape's), a key or value
// row is loaded a vector at a time (widened from a 16-bit cache) and used by every
// query head of the group, whose weighted values stay in registers.
template <typename C, int64_t D, int64_t G>
void attend_item(const AttendShape& s, const float* q, float* o, const C* k, const C* v,
                 const int64_t* table, int64_t len, int64_t kv_n, float* scores) {
  const int64_t d = D > 0 ? D : s.head_dim, group = G > 0 ? G : s.group;
  const int64_t cp = whole_vectors(len);
  for (int64_t h = 0; h < kv_n; ++h) {
    const float* qh = q + h * group * d;
    float* oh = o + h * group * d;
    if constexpr (D > 0 && G > 0) {
      constexpr int64_t kVecs = D / kLanes;
      static_assert(D % kLanes == 0, "the head size is whole vectors");
      Vec qv[G][kVecs];  // in registers: the scores' stores could alias q's memory
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < kVecs; ++c) qv[g][c] = load_vec(qh + g * D + c * kLanes);
      walk_positions(s, k, h, d, table, len, [&](int64_t pos, const C* key) {
        Vec acc[G] = {};
        for (int64_t c = 0; c < kVecs; ++c) {
          const Vec x = load_vec(key + c * kLanes);
          for (int64_t g = 0; g < G; ++g) acc[g] += qv[g][c] * x;
        }
        for (int64_t g = 0; g < G; ++g) scores[g * cp + pos] = lane_sum(acc[g]) * s.scale;
      });
      for (int64_t g = 0; g < G; ++g) softmax_row(scores + g * cp, len);
      Vec acc[G][kVecs] = {};
      walk_positions(s, v, h, d, table, len, [&](int64_t pos, const C* value) {
        float p[G];
        for (int64_t g = 0; g < G; ++g) p[g] = scores[g * cp + pos];
        for (int64_t c = 0; c < kVecs; ++c) {
          const Vec x = load_vec(value + c * kLanes);
          for (int64_t g = 0; g < G; ++g) acc[g][c] += p[g] * x;
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < kVecs; ++c) store_vec(oh + g * D + c * kLanes, acc[g][c]);
    } else {
      float row[kMaxHeadDim];
      walk_positions(s, k, h, d, table, len, [&](int64_t pos, const C* key_row) {
        const float* key = as_floats(key_row, d, row);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * key[i];
          scores[g * cp + pos] = dot * s.scale;
        }
      });
      for (int64_t g = 0; g < group; ++g) softmax_row(scores + g * cp, len);
      std::fill_n(oh, group * d, 0.f);
      walk_positions(s, v, h, d, table, len, [&](int64_t pos, const C* value_row) {
        const float* value = as_floats(value_row, d, row);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * cp + pos];
          float* og = oh + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) og[i] += p * value[i];
        }
      });
    }
  }
}

template <typename C>
using AttendFn = void (*)(const AttendShape&, const float*, float*, const C*, const C*,
                          const int64_t*, int64_t, int64_t, float*);

// The item function for this head size and group: unrolled on both for the common
// shapes (head size 64 or 128, up to 8 query heads a KV head), generic otherwise.
template <typename C, int64_t D>
AttendFn<C> attend_fn_for(int64_t group) {
  switch (group) {
    case 1: return &attend_item<C, D, 1>;
    case 2: return &attend_item<C, D, 2>;
    case 3: return &attend_item<C, D, 3>;
    case 4: return &attend_item<C, D, 4>;
    case 5: return &attend_item<C, D, 5>;
    case 6: return &attend_item<C, D, 6>;
    case 7: return &attend_item<C, D, 7>;
    case 8: return &attend_item<C, D, 8>;
    default: return &attend_item<C, D, 0>;
  }
}
template <typename C>
AttendFn<C> attend_fn(int64_t head_dim, int64_t group) {
  return head_dim == 64 ? attend_fn_for<C, 64>(group)
         : head_dim == 128 ? attend_fn_for<C, 128>(group) : &attend_item<C, 0, 0>;
}

// out = softmax(q k^T * scale) v for `rows` query rows (q and out [rows, heads, d]), row
// m over the first lens[m] positions of block table m (tables [rows, width]); caches
// [blocks, block_size, kv_heads, d] of one layer (d <= kMaxHeadDim). A work item is a row (with 4 rows or
// more) or a row and a KV head (fewer rows: the heads share the threads out);
// run(items, body) calls body(i) for every item, on whatever threads it has.
template <typename C, typename Run>
void attend_rows(const float* q, float* out, const C* k_cache, const C* v_cache,
                 const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                 Run&& run) {
  const int64_t group = heads / kv_heads, split = rows >= 4 ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;  // KV heads an item
  const AttendFn<C> item_fn = attend_fn<C>(d, group);
  const AttendShape shape{block_size, kv_heads * d, group, d, scale};
  run(rows * split, [&](int64_t item) {
    thread_local std::vector<float> scores;
    const int64_t m = item / split, kv0 = (item % split) * per_item, len = lens[m];
    scores.resize(per_item * group * whole_vectors(len));
    item_fn(shape, q + (m * heads + kv0 * group) * d, out + (m * heads + kv0 * group) * d,
            k_cache + kv0 * d, v_cache + kv0 * d, tables + m * width, len, per_item,
            scores.data());
  });
}

// The cache's elements as attention_rows.cpp reads them (the same 16 bits as torch's).
template <typename C>
C* cache_elements(const torch::Tensor& cache) {
  return reinterpret_cast<C*>(cache.data_ptr());
}

// body(cache element type) for the cache's dtype; a TORCH_CHECK names the others.
template <typename Body>
void dispatch_cache(const torch::Tensor& cache, const char* who, Body&& body) {
  switch (cache.scalar_type()) {
    case torch::kFloat32: body(float{}); return;
    case torch::kBFloat16: body(BF16{}); return;
    case torch::kHalf: body(F16{}); return;
    default:
      TORCH_CHECK(false, who, ": a KV cache of ", cache.scalar_type(),
                  " is not supported; use float32, bfloat16 or float16");
  }
}

}  // namespace

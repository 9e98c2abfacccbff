// Attention of single query rows (decodes) over the paged KV cache, for CPUs: each row
// one request's next position, its keys and values read in place from their blocks.
// The decode stack (decode_stack.cpp) runs its rows with these, and so does the eager
// path's paged_decode_attention for float32 caches.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace {

// Asks for the cache lines of `count` floats from `p` ahead of their use: a position's
// keys (or values) one block ahead, where the blocks of a context are scattered over the
// pool and the hardware prefetcher stops at each block's end.
inline void prefetch(const float* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) __builtin_prefetch(p + i);
}

struct AttendShape {
  int64_t block_size, kv_width, group, head_dim;
  float scale;
};

// add(g, p, value) for every position's value of KV head h and each of its query
// heads g, p the head's softmax weight of that position.
template <typename Add>
inline void weigh_values(const AttendShape& s, const float* v, int64_t h, int64_t d,
                         const int64_t* table, int64_t len, const float* scores, Add&& add,
                         int64_t group) {
  const int64_t bs = s.block_size, stride = s.kv_width, cp = whole_vectors(len);
  for (int64_t pos0 = 0, b = 0; pos0 < len; pos0 += bs, ++b) {
    const int64_t n = std::min(bs, len - pos0);
    const float* block = v + table[b] * bs * stride + h * d;
    const float* next = pos0 + bs < len ? v + table[b + 1] * bs * stride + h * d : nullptr;
    for (int64_t t = 0; t < n; ++t) {
      const float* value = block + t * stride;
      if (next != nullptr) prefetch(next + t * stride, d);
      for (int64_t g = 0; g < group; ++g) add(g, scores[g * cp + pos0 + t], value);
    }
  }
}

// One item: the `kv_n` KV heads from `k`/`v` (already offset to the item's first head)
// and their `kv_n * group` query heads, one KV head at a time. Positions are walked
// block by block, so no index is divided per score (a division per score cost more
// than the score's arithmetic), and a position's next-block counterpart is prefetched
// (a context's blocks are scattered over the pool, and the hardware prefetcher stops
// at each block's end). The weighted values of a KV head's query heads stay in
// registers (D and G, the head size and group, known at compile time; 0: the
// shape's). Each query head's scores are a row of whole vectors (`softmax_row`).
template <int64_t D, int64_t G>
void attend_item(const AttendShape& s, const float* q, float* o, const float* k,
                 const float* v, const int64_t* table, int64_t len, int64_t kv_n,
                 float* scores) {
  const int64_t d = D > 0 ? D : s.head_dim, group = G > 0 ? G : s.group;
  const int64_t bs = s.block_size, stride = s.kv_width, cp = whole_vectors(len);
  for (int64_t h = 0; h < kv_n; ++h) {
    const float* qh = q + h * group * d;
    float* oh = o + h * group * d;
    for (int64_t pos0 = 0, b = 0; pos0 < len; pos0 += bs, ++b) {
      const int64_t n = std::min(bs, len - pos0);
      const float* block = k + table[b] * bs * stride + h * d;
      const float* next = pos0 + bs < len ? k + table[b + 1] * bs * stride + h * d
                                          : nullptr;
      for (int64_t t = 0; t < n; ++t) {
        const float* key = block + t * stride;
        if (next != nullptr) prefetch(next + t * stride, d);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qh + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * key[i];
          scores[g * cp + pos0 + t] = dot * s.scale;
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) softmax_row(scores + g * cp, len);
    if constexpr (D > 0 && G > 0) {
      float acc[G][D] = {};
      weigh_values(s, v, h, d, table, len, scores, [&](int64_t g, float p, const float* x) {
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[g][i] += p * x[i];
      }, group);
      std::copy_n(&acc[0][0], G * D, oh);
    } else {
      std::fill_n(oh, group * d, 0.f);
      weigh_values(s, v, h, d, table, len, scores, [&](int64_t g, float p, const float* x) {
        float* og = oh + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) og[i] += p * x[i];
      }, group);
    }
  }
}

using AttendFn = void (*)(const AttendShape&, const float*, float*, const float*,
                         const float*, const int64_t*, int64_t, int64_t, float*);

// The item function for this head size and group: unrolled on both for the common
// shapes (head size 64 or 128, up to 8 query heads a KV head), generic otherwise.
template <int64_t D>
AttendFn attend_fn_for(int64_t group) {
  switch (group) {
    case 1: return &attend_item<D, 1>;
    case 2: return &attend_item<D, 2>;
    case 3: return &attend_item<D, 3>;
    case 4: return &attend_item<D, 4>;
    case 5: return &attend_item<D, 5>;
    case 6: return &attend_item<D, 6>;
    case 7: return &attend_item<D, 7>;
    case 8: return &attend_item<D, 8>;
    default: return &attend_item<D, 0>;
  }
}
inline AttendFn attend_fn(int64_t head_dim, int64_t group) {
  return head_dim == 64 ? attend_fn_for<64>(group)
         : head_dim == 128 ? attend_fn_for<128>(group) : &attend_item<0, 0>;
}

// out = softmax(q k^T * scale) v for `rows` query rows (q and out [rows, heads, d]), row
// m over the first lens[m] positions of block table m (tables [rows, width]); caches
// [blocks, block_size, kv_heads, d] of one layer. A work item is a row (with 4 rows or
// more) or a row and a KV head (fewer rows: the heads share the threads out);
// run(items, body) calls body(i) for every item, on whatever threads it has.
template <typename Run>
void attend_rows(const float* q, float* out, const float* k_cache, const float* v_cache,
                 const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                 Run&& run) {
  const int64_t group = heads / kv_heads, split = rows >= 4 ? 1 : kv_heads;
  const int64_t per_item = kv_heads / split;  // KV heads an item
  const AttendFn item_fn = attend_fn(d, group);
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

}  // namespace

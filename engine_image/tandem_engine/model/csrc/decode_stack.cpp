// A Llama-family decoder stack's decode step in one call, for the few rows of a decode
// step on CPUs (model/fused_decode.py).
//
// At batch 1 the eager forward pass spends more time between operations than in them:
// 30 layers x ~20 torch calls, each a Python dispatch and an allocation. Here a step is
// one call: for every layer RMSNorm, the q/k/v projections (one pass over the three
// weights with the activations quantized once), optional per-head q/k norms, RoPE, the
// new keys and values written to their slots, attention over the paged cache, the
// output projection and residual, RMSNorm, gate and up (one pass), SiLU(gate) * up, the
// down projection and residual; then the final norm. Work buffers persist between calls.
//
// Projections are quant_matvec.cpp's (`project`): int4 weights interleaved by 16 rows or
// int8 rows, times activations rounded to int8 per group of 32. Work is shared by
// `WorkPool`, not ATen's OpenMP team: a step makes ~150 parallel passes, and an OpenMP
// barrier waits for every thread of the team. Where the engine shares its cores with a
// router and its own I/O thread, the second thread is often not running, and each pass
// waited for it (a served token took twice as long as in process).

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TANDEM_PAUSE() _mm_pause()
#else
#define TANDEM_PAUSE() std::this_thread::yield()
#endif

namespace {

// Work sharing without a barrier: the caller posts a job of `items`; helpers that are
// running take items from a shared counter and so does the caller, who then waits only
// for items already taken. A helper the OS has not scheduled is never waited for: the
// caller does its share. Helpers spin a while between jobs (a step's passes follow each
// other within microseconds), then sleep until the next one.
class WorkPool {
 public:
  explicit WorkPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { help(); });
  }
  ~WorkPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  void run(int64_t items, const std::function<void(int64_t)>& body) {
    if (threads_.empty() || items <= 1) {
      for (int64_t i = 0; i < items; ++i) body(i);
      return;
    }
    Job job{&body, items};
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(job);
    while (job.done.load() < items) TANDEM_PAUSE();  // items helpers took, still running
    job_.store(nullptr);
    while (inside_.load() != 0) TANDEM_PAUSE();  // nobody holds `job` any more
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* body;
    int64_t items;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  static void work(Job& job) {
    int64_t finished = 0;  // told once: each shared update moves a cache line between cores
    for (int64_t i = job.next.fetch_add(1); i < job.items; i = job.next.fetch_add(1)) {
      (*job.body)(i);
      ++finished;
    }
    if (finished) job.done.fetch_add(finished);
  }

  void help() {
    uint64_t seen = generation_.load();
    while (true) {
      int spins = 0;
      while (generation_.load() == seen && !stop_.load() && spins < kSpins) {
        TANDEM_PAUSE();
        ++spins;
      }
      if (generation_.load() == seen && !stop_.load()) {
        sleeping_.fetch_add(1);
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
        sleeping_.fetch_sub(1);
      }
      if (stop_.load()) return;
      seen = generation_.load();
      inside_.fetch_add(1);
      Job* job = job_.load();
      if (job != nullptr) work(*job);
      inside_.fetch_sub(1);
    }
  }

  static constexpr int kSpins = 20000;  // ~100 us of pause instructions
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> inside_{0};
  std::atomic<int> sleeping_{0};
};

// x * cos + rotate_half(x) * sin over one head of `d` values (transformers' RoPE).
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float rotated[512];
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -x[half + i];
    rotated[half + i] = x[i];
  }
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

struct Layer {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;  // nullptr: no per-head norms
  const float* k_norm;
  Projection qkv[3], o, gate_up[2], down;
};

// One caller at a time (the engine's step thread): the work buffers are the stack's.
class DecodeStack {
 public:
  // `layers`: per layer [input norm, post-attention norm, q norm, k norm (both empty when
  // the family has none), then q, k, v, o, gate, up, down as (weight, scales, minimums,
  // bias) each, minimums empty for int8 and bias empty when absent].
  // `head`: the output head's (weight, scales, minimums, bias) of `vocab` rows, as a
  // projection's; see `logits`.
  DecodeStack(std::vector<std::vector<torch::Tensor>> layers, torch::Tensor final_norm,
              std::vector<torch::Tensor> head, int64_t vocab, int64_t heads,
              int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(static_cast<float>(eps)),
        final_norm_(final_norm),
        pool_(std::make_unique<WorkPool>(std::max(0, at::get_num_threads() - 1))) {
    TORCH_CHECK(head_dim <= 512 && head_dim % 2 == 0 && heads % kv_heads == 0,
                "DecodeStack: head_dim must be even and at most 512, heads a multiple of "
                "kv_heads");
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 4 + 7 * 4, "DecodeStack: a layer is 32 tensors, not ",
                  t.size());
      for (const auto& tensor : t) held_.push_back(tensor);
      Layer l{};
      l.input_norm = t[0].data_ptr<float>();
      l.post_norm = t[1].data_ptr<float>();
      l.q_norm = t[2].numel() ? t[2].data_ptr<float>() : nullptr;
      l.k_norm = t[3].numel() ? t[3].data_ptr<float>() : nullptr;
      Projection* slots[7] = {&l.qkv[0], &l.qkv[1], &l.qkv[2], &l.o, &l.gate_up[0],
                              &l.gate_up[1], &l.down};
      static const char* names[7] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"};
      // Output sizes: int4 weights are padded to 16 rows, so they come from the shapes.
      const int64_t hidden = t[0].numel();
      const int64_t inter = t[4 + 4 * 6].scalar_type() == torch::kUInt8
                                ? t[4 + 4 * 6].size(1) / 8 : t[4 + 4 * 6].size(1);
      const int64_t sizes[7] = {heads * head_dim, kv_heads * head_dim, kv_heads * head_dim,
                                hidden, inter, inter, hidden};
      for (int i = 0; i < 7; ++i) {
        const int b = 4 + 4 * i;
        *slots[i] = projection(t[b], t[b + 1], t[b + 2], t[b + 3], sizes[i], names[i]);
      }
      hidden_ = hidden;
      intermediate_ = inter;
      TORCH_CHECK(l.qkv[0].k == hidden && l.qkv[1].k == hidden && l.qkv[2].k == hidden &&
                      l.o.k == heads * head_dim && l.gate_up[0].k == hidden &&
                      l.gate_up[1].k == hidden,
                  "DecodeStack: projection shapes do not fit the heads and sizes given");
      layers_.push_back(l);
    }
    TORCH_CHECK(final_norm.scalar_type() == torch::kFloat32 && final_norm.numel() == hidden_,
                "DecodeStack: a float32 final norm of the hidden size");
    TORCH_CHECK(head.size() == 4, "DecodeStack: the head is 4 tensors, not ", head.size());
    for (const auto& tensor : head) held_.push_back(tensor);
    head_ = projection(head[0], head[1], head[2], head[3], vocab, "head");
    TORCH_CHECK(head_.k == hidden_, "DecodeStack: the head's K must be the hidden size");
  }

  // Float32 logits [M, vocab] of final-normed hidden states [M, hidden], on this stack's
  // threads (as the model's `logits`).
  torch::Tensor logits(torch::Tensor hidden) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_ &&
                    hidden.scalar_type() == torch::kFloat32 && hidden.is_contiguous(),
                "DecodeStack.logits: contiguous float32 [M, ", hidden_, "]");
    auto out = torch::empty({hidden.size(0), head_.n}, hidden.options());
    float* o = out.data_ptr<float>();
    project(&head_, 1, hidden.data_ptr<float>(), hidden.size(0), xq_, &o, for_each_);
    return out;
  }

  // x [M, hidden] float32 (the embedded tokens); cos, sin [M, head_dim]; kv_cache
  // [layers, 2, blocks, block_size, kv_heads, head_dim] float32, bfloat16 or float16 (new
  // keys and values rounded to it); slots [M] int64;
  // tables [M, W] int64; lens [M] int64 (each row's context, its own token included).
  // Returns the final-normed hidden states [M, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                        torch::Tensor kv_cache, torch::Tensor slots, torch::Tensor tables,
                        torch::Tensor lens, double scale) {
    const int64_t rows = x.size(0), h = hidden_, d = head_dim_;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == h && x.scalar_type() == torch::kFloat32,
                "DecodeStack.forward: x must be float32 [M, ", h, "]");
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 6 && kv_cache.size(0) == (int64_t)layers_.size() &&
                    kv_cache.size(4) == kv_heads_ && kv_cache.size(5) == d,
                "DecodeStack.forward: a contiguous KV pool of this model's shape");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == rows &&
                    cos.size(-1) == d && slots.numel() == rows && lens.numel() == rows &&
                    tables.size(0) == rows && tables.is_contiguous(),
                "DecodeStack.forward: one RoPE row, slot, block table and length per row");
    auto out = x.clone();
    float* res = out.data_ptr<float>();
    const int64_t q_width = heads_ * d, kv_width = kv_heads_ * d, inter = intermediate_;
    normed_.resize(rows * h);
    q_.resize(rows * q_width);
    k_.resize(rows * kv_width);
    v_.resize(rows * kv_width);
    attn_.resize(rows * q_width);
    proj_.resize(rows * h);
    gate_.resize(rows * inter);
    up_.resize(rows * inter);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t blocks = kv_cache.size(2), block_size = kv_cache.size(3);
    const int64_t layer_stride = 2 * blocks * block_size * kv_width;
    const int64_t* table_p = tables.data_ptr<int64_t>();
    const int64_t* len_p = lens.data_ptr<int64_t>();
    for (int64_t m = 0; m < rows; ++m) {
      TORCH_CHECK(slot[m] >= 0 && slot[m] < blocks * block_size,
                  "DecodeStack.forward: slot ", slot[m], " is outside the KV pool");
      TORCH_CHECK(len_p[m] >= 1 && len_p[m] <= tables.size(1) * block_size,
                  "DecodeStack.forward: context length ", len_p[m], " exceeds its block table");
      for (int64_t b = 0; b * block_size < len_p[m]; ++b) {
        const int64_t id = table_p[m * tables.size(1) + b];
        TORCH_CHECK(id >= 0 && id < blocks, "DecodeStack.forward: block ", id,
                    " is outside the KV pool");
      }
    }
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      each_row(rows, [&](int64_t m) {
        norm_row(res + m * h, l.input_norm, h, eps_, normed_.data() + m * h);
      });
      float* qkv_out[3] = {q_.data(), k_.data(), v_.data()};
      project(l.qkv, 3, normed_.data(), rows, xq_, qkv_out, for_each_);
      dispatch_cache(kv_cache, "DecodeStack.forward", [&](auto element) {
        using C = decltype(element);
        C* k_cache = cache_elements<C>(kv_cache) + li * layer_stride;
        C* v_cache = k_cache + blocks * block_size * kv_width;
        each_row(rows, [&](int64_t m) {
          for (int64_t hd = 0; hd < heads_; ++hd) {
            float* head = q_.data() + m * q_width + hd * d;
            if (l.q_norm != nullptr) norm_row(head, l.q_norm, d, eps_, head);
            rope_head(head, cp + m * d, sp + m * d, d);
          }
          for (int64_t hd = 0; hd < kv_heads_; ++hd) {
            float* head = k_.data() + m * kv_width + hd * d;
            if (l.k_norm != nullptr) norm_row(head, l.k_norm, d, eps_, head);
            rope_head(head, cp + m * d, sp + m * d, d);
          }
          narrow_row(k_.data() + m * kv_width, kv_width, k_cache + slot[m] * kv_width);
          narrow_row(v_.data() + m * kv_width, kv_width, v_cache + slot[m] * kv_width);
        });
        attend(k_cache, v_cache, tables, lens, block_size, static_cast<float>(scale), rows);
      });
      float* o_out[1] = {proj_.data()};
      project(&l.o, 1, attn_.data(), rows, xq_, o_out, for_each_);
      each_row(rows, [&](int64_t m) {
        for (int64_t i = m * h; i < (m + 1) * h; ++i) res[i] += proj_[i];
        norm_row(res + m * h, l.post_norm, h, eps_, normed_.data() + m * h);
      });
      float* gu_out[2] = {gate_.data(), up_.data()};
      project(l.gate_up, 2, normed_.data(), rows, xq_, gu_out, for_each_);
      each_row(rows, [&](int64_t m) {
        for (int64_t i = m * inter; i < (m + 1) * inter; ++i) {
          const float g = gate_[i];
          gate_[i] = g / (1.f + std::exp(-g)) * up_[i];
        }
      });
      float* down_out[1] = {proj_.data()};
      project(&l.down, 1, gate_.data(), rows, xq_, down_out, for_each_);
      for (int64_t i = 0; i < rows * h; ++i) res[i] += proj_[i];
    }
    const float* fw = final_norm_.data_ptr<float>();
    each_row(rows, [&](int64_t m) { norm_row(res + m * h, fw, h, eps_, res + m * h); });
    return out;
  }

 private:
  // body(m) for every row m: on the caller alone for a few rows (waking a helper costs
  // more than it saves), shared on the pool for many.
  void each_row(int64_t rows, const std::function<void(int64_t)>& body) {
    if (rows < kSharedRows) {
      for (int64_t m = 0; m < rows; ++m) body(m);
    } else {
      pool_->run(rows, body);
    }
  }
  static constexpr int64_t kSharedRows = 8;

  // attn_ = softmax(q k^T * scale) v per (row, query head), on the pool.
  template <typename C>
  void attend(const C* k_cache, const C* v_cache, const torch::Tensor& tables,
              const torch::Tensor& lens, int64_t block_size, float scale, int64_t rows) {
    const auto on_pool = [this](int64_t items, const std::function<void(int64_t)>& body) {
      pool_->run(items, body);
    };
    attend_rows(q_.data(), attn_.data(), k_cache, v_cache, tables.data_ptr<int64_t>(),
                tables.size(1), lens.data_ptr<int64_t>(), rows, heads_, kv_heads_, head_dim_,
                block_size, scale, on_pool);
  }

  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0, intermediate_ = 0;
  float eps_;
  torch::Tensor final_norm_;
  std::vector<torch::Tensor> held_;  // keeps every weight's storage alive
  std::vector<Layer> layers_;
  Projection head_;
  QuantizedRows xq_;
  std::vector<float> normed_, q_, k_, v_, attn_, proj_, gate_, up_;
  std::unique_ptr<WorkPool> pool_;
  ForEach for_each_ = [this](int64_t items, const std::function<void(int64_t)>& body) {
    pool_->run(items, body);
  };
};

}  // namespace

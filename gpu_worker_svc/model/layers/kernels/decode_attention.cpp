// Decode attention on CPU, read straight from the paged KV cache.
//
// The torch path gathers each decode's context out of the cache into a dense copy and runs
// SDPA on it: a write and a re-read of the whole context, every layer. Here each task, a decode
// and some of its KV heads, walks the decode's slots in place: scores for the query heads that
// share those KV heads, their softmax, and the weighted sum of values.
//
// Every reduction has a fixed order that depends only on the decode's own context length,
// never on its batch-mates or the padding of the step's slot table: a decode's output is
// the same bits however it is batched, which the engine's determinism rests on.
//
// A sliding-window layer (Mistral, Gemma's local layers) attends to each query's last `window`
// keys only, and Gemma 2 caps each score with softcap * tanh(score / softcap) before the softmax.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "vec16.h"

namespace {

using namespace shardline_vec;

constexpr int64_t MAX_DIM = 256;   // head_dim
constexpr int64_t PREFETCH = 16;  // slots ahead to prefetch: the cache's rows come from scattered blocks

// The task's heads [first, first + count) of the cache row at slots[t]; the same heads of the row
// PREFETCH slots on are prefetched, since the rows of consecutive blocks lie apart.
inline const float* row_at(const float* cache, const int64_t* slots, int64_t t, int64_t length, int64_t kv_heads,
                           int64_t first, int64_t count, int64_t dim) {
  if (t + PREFETCH < length) {
    const char* ahead = reinterpret_cast<const char*>(cache + (slots[t + PREFETCH] * kv_heads + first) * dim);
    for (int64_t byte = 0; byte < count * dim * 4; byte += 64) __builtin_prefetch(ahead + byte);
  }
  return cache + (slots[t] * kv_heads + first) * dim;
}

// m[i] lane j becomes m[j] lane i: four rounds of swapping the off-diagonal halves of blocks.
inline void transpose16(v16* m) {
  for (int i = 0; i < 16; i += 2) {
    const v16 a = m[i], b = m[i + 1];
    m[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    m[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int i = 0; i < 16; i += 4)
    for (int k = i; k < i + 2; ++k) {
      const v16 a = m[k], b = m[k + 2];
      m[k] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      m[k + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 16; i += 8)
    for (int k = i; k < i + 4; ++k) {
      const v16 a = m[k], b = m[k + 4];
      m[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      m[k + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int k = 0; k < 8; ++k) {
    const v16 a = m[k], b = m[k + 8];
    m[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    m[k + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

// The scores of R rows against 16 keys, kt[d] holding dimension d of each key: per row, even and
// odd dimensions in two sums, added at the end. R rows at once keep 2R independent chains in flight;
// a row's arithmetic is the same whatever R.
template <int R>
inline void score_rows(const v16* kt, int64_t dim, const float* const* q, float* const* out) {
  v16 even[R], odd[R];
  for (int r = 0; r < R; ++r) {
    even[r] = kt[0] * q[r][0];
    odd[r] = kt[1] * q[r][1];
  }
  for (int64_t d = 2; d < dim; d += 2)
    for (int r = 0; r < R; ++r) {
      even[r] += kt[d] * q[r][d];
      odd[r] += kt[d + 1] * q[r][d + 1];
    }
  for (int r = 0; r < R; ++r) store(out[r], even[r] + odd[r]);
}

// The weighted sum of values for R rows of one head, slot by slot in order; a row's keys past its
// own length weigh exactly 0. Its arithmetic is the same whatever R. V, the vectors per head,
// is a template argument so that the R x V sums stay in registers.
// Slots before `from` weigh 0 for every row (outside all their windows), so they are skipped:
// the sums start at +0 either way, and adding the exact zeros would not change them.
template <int R, int V>
void weigh_rows(const float* v_cache, const int64_t* slots, int64_t from, int64_t longest, int64_t kv_heads,
                int64_t head, bool fetch, const float* const* p, const float* inverse_total, float* const* out) {
  v16 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < V; ++d) acc[r][d] = v16{};
  for (int64_t t = from; t < longest; ++t) {
    // Only a head's first rows prefetch: its later ones find the values in cache.
    const float* v = fetch ? row_at(v_cache, slots, t, longest, kv_heads, head, 1, V * W)
                           : v_cache + (slots[t] * kv_heads + head) * V * W;
    for (int d = 0; d < V; ++d) {
      const v16 vv = load(v + d * W);
      for (int r = 0; r < R; ++r) acc[r][d] += p[r][t] * vv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < V; ++d) store(out[r] + d * W, acc[r][d] * inverse_total[r]);
}

using Weigh = void (*)(const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, bool, const float* const*,
                       const float*, float* const*);

template <int R, size_t... V>
constexpr std::array<Weigh, sizeof...(V)> weigh_table(std::index_sequence<V...>) {
  return {&weigh_rows<R, static_cast<int>(V) + 1>...};
}

// weigh_rows for R rows and dim / W vectors (1 to MAX_DIM / W).
template <int R>
Weigh weigh_for(int64_t vecs) {
  static constexpr auto table = weigh_table<R>(std::make_index_sequence<MAX_DIM / W>{});
  return table[vecs - 1];
}

// One task: decode b's KV heads [first, first + count), each with its `group` query heads, for
// each of the decode's `queries` queries (its token and its drafts, or a piece of a prefill chunk).
// A row is one query head of one query, and attends to the first lengths[query] slots. Keys are
// taken 16 slots at a time and transposed, so that one vector holds 16 keys' scores and the rows of
// a KV head share the transposed block. Every sum runs in an order fixed by the row's own length,
// so a row gives the same bits as that query alone, whatever the other queries of the call.
// `scores` holds a row per query head, the longest length rounded up to W. With a `window` (0: none),
// a query of length n sees slots [n - window, n) only; keys before every query's window are not read.
void attend(const float* q, int64_t q_query_stride, int64_t q_head_stride, int64_t queries, const int64_t* lengths,
            const float* k_cache, const float* v_cache, const int64_t* slots, int64_t kv_heads, int64_t first,
            int64_t count, int64_t group, int64_t heads, int64_t dim, float scale, int64_t window, float softcap,
            float* scores, float* qs, float* out) {
  const int64_t vecs = dim / W, per_query = count * group, rows = queries * per_query;
  const int64_t longest = *std::max_element(lengths, lengths + queries), padded = (longest + W - 1) / W * W;
  auto window_start = [&](int64_t length) { return window > 0 ? std::max<int64_t>(0, length - window) : 0; };
  const int64_t from = window_start(*std::min_element(lengths, lengths + queries)), from_block = from / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = q + r / per_query * q_query_stride + (first * group + r % per_query) * q_head_stride;
    for (int64_t d = 0; d < vecs; ++d) store(qs + r * dim + d * W, load(row + d * W) * scale);
  }
  // The rows of KV head h, in order: each query's `group` query heads.
  std::vector<int64_t> of_head(rows);
  for (int64_t h = 0, i = 0; h < count; ++h)
    for (int64_t query = 0; query < queries; ++query)
      for (int64_t g = 0; g < group; ++g) of_head[i++] = query * per_query + h * group + g;
  const int64_t per_head = queries * group;

  v16 kt[MAX_DIM];
  for (int64_t t0 = from_block; t0 < longest; t0 += W) {
    const int64_t keys = std::min<int64_t>(W, longest - t0);
    const float* key[W];
    for (int64_t i = 0; i < keys; ++i) key[i] = row_at(k_cache, slots, t0 + i, longest, kv_heads, first, count, dim);
    for (int64_t h = 0; h < count; ++h) {
      for (int64_t c = 0; c < vecs; ++c) {  // dimensions [16 c, 16 c + 16) of the block's keys
        v16* m = kt + c * W;
        for (int64_t i = 0; i < W; ++i) m[i] = i < keys ? load(key[i] + h * dim + c * W) : v16{};
        transpose16(m);
      }
      const int64_t* mine = of_head.data() + h * per_head;
      int64_t i = 0;
      for (; i + 4 <= per_head; i += 4) {
        const float* qr[4] = {qs + mine[i] * dim, qs + mine[i + 1] * dim, qs + mine[i + 2] * dim, qs + mine[i + 3] * dim};
        float* sr[4] = {scores + mine[i] * padded + t0, scores + mine[i + 1] * padded + t0,
                        scores + mine[i + 2] * padded + t0, scores + mine[i + 3] * padded + t0};
        score_rows<4>(kt, dim, qr, sr);
      }
      for (; i < per_head; ++i) {
        const float* qr[1] = {qs + mine[i] * dim};
        float* sr[1] = {scores + mine[i] * padded + t0};
        score_rows<1>(kt, dim, qr, sr);
      }
    }
  }
  // Softmax: a row's keys past its own length, or before its window, weigh exactly 0, so its sum is
  // the same bits as that query's alone, whatever the other queries' lengths.
  std::vector<float> inverse_total(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * padded;
    const int64_t length = lengths[r / per_query], start = window_start(length);
    if (softcap > 0)
      for (int64_t t = start; t < length; ++t) row[t] = softcap * std::tanh(row[t] / softcap);
    float top = -INFINITY;
    for (int64_t t = start; t < length; ++t) top = row[t] > top ? row[t] : top;
    for (int64_t t = from_block; t < start; ++t) row[t] = -INFINITY;
    for (int64_t t = length; t < padded; ++t) row[t] = -INFINITY;
    v16 total = {};
    for (int64_t t = from_block; t < padded; t += W) {
      const v16 e = exp_nonpositive(load(row + t) - top);
      store(row + t, e);
      total += e;
    }
    inverse_total[r] = 1.0f / hsum(total);
  }
  const Weigh weigh4 = weigh_for<4>(vecs), weigh1 = weigh_for<1>(vecs);
  for (int64_t h = 0; h < count; ++h) {
    const int64_t* mine = of_head.data() + h * per_head;
    int64_t i = 0;
    auto at = [&](int64_t k) { return out + mine[k] / per_query * heads * dim + (first * group + mine[k] % per_query) * dim; };
    for (; i + 4 <= per_head; i += 4) {
      const float* p[4] = {scores + mine[i] * padded, scores + mine[i + 1] * padded, scores + mine[i + 2] * padded,
                           scores + mine[i + 3] * padded};
      const float inv[4] = {inverse_total[mine[i]], inverse_total[mine[i + 1]], inverse_total[mine[i + 2]],
                            inverse_total[mine[i + 3]]};
      float* o[4] = {at(i), at(i + 1), at(i + 2), at(i + 3)};
      weigh4(v_cache, slots, from, longest, kv_heads, first + h, i == 0, p, inv, o);
    }
    for (; i < per_head; ++i) {
      const float* p[1] = {scores + mine[i] * padded};
      const float inv[1] = {inverse_total[mine[i]]};
      float* o[1] = {at(i)};
      weigh1(v_cache, slots, from, longest, kv_heads, first + h, i < 4, p, inv, o);
    }
  }
}

}  // namespace

namespace shardline_cpu {

// q [B, Hq, D] with lengths [B] -> [B, Hq * D]; or q [B, Q, Hq, D] with lengths [B, Q] -> [B, Q, Hq * D]
// (a decode and its draft tokens). q's rows may be strided; caches [slots, Hkv, D]; slots [B, L].
// window > 0: each query sees its last `window` slots only; softcap > 0: Gemma 2's score capping.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& lengths, double scale, int64_t window,
                                  double softcap) {
  const bool drafts = q.dim() == 4;
  TORCH_CHECK((q.dim() == 3 || drafts) && k_cache.dim() == 3 && v_cache.dim() == 3 && slots.dim() == 2 &&
                  lengths.dim() == q.dim() - 2,
              "paged_decode_attention: q [B, (Q,) Hq, D], caches [slots, Hkv, D], slots [B, L], lengths [B(, Q)]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "paged_decode_attention: int64 slots and lengths");
  const int64_t batch = q.size(0), queries = drafts ? q.size(1) : 1;
  const int64_t heads = q.size(-2), dim = q.size(-1), kv_heads = k_cache.size(1);
  TORCH_CHECK(dim % W == 0 && dim <= MAX_DIM, "paged_decode_attention: head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode_attention: window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.stride(-1) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  lengths.is_contiguous() && slots.size(0) == batch && lengths.size(0) == batch &&
                  (!drafts || lengths.size(1) == queries),
              "paged_decode_attention: layout");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode_attention: k and v caches differ in shape");
  const int64_t group = heads / kv_heads, width = slots.size(1);
  auto out = drafts ? at::empty({batch, queries, heads * dim}, q.options()) : at::empty({batch, heads * dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t q_row = q.stride(0), q_query = drafts ? q.stride(1) : 0, q_head = q.stride(-2);
  // Checked here, not left to the loads: a bad slot would read outside the cache, not raise.
  const int64_t num_slots = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* own = lp + b * queries;
    for (int64_t query = 0; query < queries; ++query)
      TORCH_CHECK(own[query] >= 1 && own[query] <= width, "paged_decode_attention: a length outside [1, L]");
    for (int64_t t = 0, longest = *std::max_element(own, own + queries); t < longest; ++t) {
      const int64_t slot = sp[b * width + t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "paged_decode_attention: a slot outside the cache");
    }
  }
  // A task takes as many of a decode's KV heads as leaves two tasks per thread: whole rows of the
  // cache stream in order, and a small batch still spreads over every thread.
  const int64_t wanted = 2 * at::get_num_threads();
  const int64_t per_task = std::max<int64_t>(1, std::min(kv_heads, (kv_heads * batch) / std::max<int64_t>(wanted, 1)));
  const int64_t tasks_per_decode = (kv_heads + per_task - 1) / per_task;
  at::parallel_for(0, batch * tasks_per_decode, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = queries * per_task * group;
    std::vector<float> scores(rows * ((width + W - 1) / W * W)), qs(rows * dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_decode, first = task % tasks_per_decode * per_task;
      attend(qp + b * q_row, q_query, q_head, queries, lp + b * queries, kp, vp, sp + b * width, kv_heads, first,
             std::min(per_task, kv_heads - first), group, heads, dim, static_cast<float>(scale), window,
             static_cast<float>(softcap), scores.data(), qs.data(), op + b * queries * heads * dim);
    }
  });
  return out;
}

}  // namespace shardline_cpu

TORCH_LIBRARY(shardline_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &shardline_cpu::paged_decode_attention);
}

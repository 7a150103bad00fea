// Rotary embedding of a step's queries and keys, and the write of its keys and values into the
// paged KV cache, as one CPU op in float32 (the callers: model/llama.py, decode_layers.cpp).
//
// In torch these are a dozen small ops a layer (slices, a multiply, a roll, an addcmul, a split
// and two index_copy_), ~25 us a layer at a decode step's few rows. Here one pass reads each
// row of q/k/v once. A row's result depends on that row alone, whatever the row count, so a
// prefill writes the bits a decode of the same token would: the engine's determinism rests on it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

// One head of D values, HF's rotate-half layout: x[d] cos[d] + x[d +- D/2] sin_signed[d], where
// sin_signed has its first half negated (layers/rotary.py).
inline void rotate(const float* x, const float* cos, const float* sin_signed, int64_t dim, float* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin_signed[d];
  for (int64_t d = half; d < dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin_signed[d];
}

}  // namespace

namespace shardline_cpu {

// qkv [T, (Hq + 2 Hkv) D]: each row's queries, keys and values side by side; cos, sin_signed
// [T, 1, D]; slot_mapping [T]; kv_cache [2, blocks, block size, Hkv, D]. Writes each row's rotated
// keys and its values at its slot, and returns its rotated queries [T, Hq, D].
at::Tensor rope_cache_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                            const at::Tensor& slot_mapping, const at::Tensor& kv_cache, int64_t num_heads,
                            int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "rope_cache_write: qkv must be contiguous float32 [T, (Hq + 2 Hkv) D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() &&
                  kv_cache.size(0) == 2 && kv_cache.size(3) == num_kv_heads,
              "rope_cache_write: kv_cache must be contiguous float32 [2, blocks, block size, Hkv, D]");
  const int64_t rows = qkv.size(0), dim = kv_cache.size(4);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "rope_cache_write: qkv's width is not (Hq + 2 Hkv) D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin_signed.is_contiguous() && cos.numel() == rows * dim && sin_signed.numel() == rows * dim,
              "rope_cache_write: cos and sin_signed must be contiguous float32 [T, 1, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == rows,
              "rope_cache_write: slot_mapping must be contiguous int64 [T]");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), kv_row = num_kv_heads * dim;
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)  // checked here: a bad slot would write outside the cache, not raise
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots, "rope_cache_write: a slot outside the cache");
  at::Tensor q = at::empty({rows, num_heads, dim}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sn = sin_signed.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = kv_cache.data_ptr<float>(), *vp = kp + slots * kv_row;
  const int64_t width = qkv.size(1);
  // A decode step's few rows run on the calling thread: waking the pool would cost more.
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *x = xp + t * width, *c = cp + t * dim, *s = sn + t * dim;
      for (int64_t h = 0; h < num_heads; ++h) rotate(x + h * dim, c, s, dim, qp + (t * num_heads + h) * dim);
      const float* k = x + num_heads * dim;
      float* k_out = kp + sp[t] * kv_row;
      for (int64_t h = 0; h < num_kv_heads; ++h) rotate(k + h * dim, c, s, dim, k_out + h * dim);
      const float* v = k + kv_row;
      std::copy(v, v + kv_row, vp + sp[t] * kv_row);
    }
  });
  return q;
}

}  // namespace shardline_cpu

TORCH_LIBRARY_FRAGMENT(shardline_cpu, m) {
  m.def("rope_cache_write(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor slot_mapping, Tensor(a!) kv_cache, "
        "int num_heads, int num_kv_heads) -> Tensor");
  m.impl("rope_cache_write", c10::DispatchKey::CPU, &shardline_cpu::rope_cache_write);
}

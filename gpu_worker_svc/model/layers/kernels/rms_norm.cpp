// RMSNorm with the residual add fused in, on CPU in float32 (the layer: layers/layernorm.py).
//
// torch.rms_norm on CPU is a composite of seven ops, ~25 us a call for a decode step's rows, and a
// decode step runs 61 of them: 1.4 of the default model's 11 ms. One pass here does the add, the
// sum of squares and the scaling. A row's result depends on that row alone, in a fixed order
// (16 lanes, then a fixed tree), whatever the number of rows or threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "cpu_ops.h"
#include "vec16.h"

namespace {

using namespace shardline_vec;

// One row: sum = x + residual (when there is one), out = weight * sum / sqrt(mean(sum^2) + eps).
void norm_row(const float* x, const float* residual, const float* weight, int64_t n, float eps, float* sum,
              float* out) {
  v16 squares = {};
  for (int64_t j = 0; j < n; j += W) {
    v16 h = load(x + j);
    if (residual != nullptr) h += load(residual + j);
    store(sum + j, h);
    squares += h * h;
  }
  const float scale = 1.0f / std::sqrt(hsum(squares) / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; j += W) store(out + j, load(weight + j) * (load(sum + j) * scale));
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be contiguous float32 [T, n]");
  TORCH_CHECK(x.size(1) % W == 0, "rms_norm: the hidden size must be a multiple of 16");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "rms_norm: weight must be contiguous float32 [n]");
}

void norm_rows(const at::Tensor& x, const float* residual, const at::Tensor& weight, double eps, float* sum,
               float* out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // A decode step's few rows run on the calling thread: waking the pool would cost more.
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      norm_row(xp + i * n, residual == nullptr ? nullptr : residual + i * n, wp, n, e, sum + i * n, out + i * n);
  });
}

}  // namespace

namespace shardline_cpu {

// x [T, n], weight [n] -> the norm of x [T, n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  norm_rows(x, nullptr, weight, eps, sum.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// x, residual [T, n], weight [n] -> (the norm of x + residual, x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "rms_norm: residual must be contiguous float32, shaped as x");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  norm_rows(x, residual.data_ptr<float>(), weight, eps, sum.data_ptr<float>(), out.data_ptr<float>());
  return {out, sum};
}

}  // namespace shardline_cpu

TORCH_LIBRARY_FRAGMENT(shardline_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &shardline_cpu::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &shardline_cpu::add_rms_norm);
}

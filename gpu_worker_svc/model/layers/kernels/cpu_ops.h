// The entry points of the CPU ops, for an op that chains them in C++ (decode_layers.cpp): a call
// here costs neither Python nor torch's dispatcher. Each is registered in torch.ops.shardline_cpu
// by the file that defines it.
//
// The kernels include the few ATen headers they use, not <ATen/ATen.h>: every library level is
// compiled from these sources (kernel_build.py), and torch's whole operator set is most of the time
// a source takes to compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <string>
#include <tuple>

namespace shardline_cpu {

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& slots, const at::Tensor& lengths, double scale,
                                  int64_t window = 0, double softcap = 0.0);

// gguf_linear.cpp
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& panels, int64_t type, int64_t out_features,
                       const std::string& isa);

// rotary_cache.cpp
at::Tensor rope_cache_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                            const at::Tensor& slot_mapping, const at::Tensor& kv_cache, int64_t num_heads,
                            int64_t num_kv_heads);

// silu_mul.cpp
at::Tensor silu_mul(const at::Tensor& gate_up);

// rms_norm.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, double eps);

}  // namespace shardline_cpu

// A decode step's Llama decoder layers in one call, on CPU in float32 with GGUF weights (the
// caller: model/fused_decode.py).
//
// A batch-1 decode step of the default model is ~600 small ops over its 30 layers. From Python
// each one costs microseconds of interpreter, argument parsing and module calls around it: ~3 ms
// of a 10 ms step, more than the attention and the norms together. Here the layers' ops run as
// llama.py's CPU path spells them, the same ops with the same arguments in the same order, so
// every result is bitwise the Python layers' (tested), without the interpreter between them.
#include <torch/library.h>

#include <tuple>

#include "cpu_ops.h"

namespace {

constexpr int64_t LINEARS = 4;  // per layer: qkv, o, gate_up, down
constexpr int64_t NORMS = 2;    // per layer: input, post-attention

// x [B, hidden]: the step's embeddings, one decode per row. Per layer l: norms[2l], norms[2l + 1];
// panels[4l + i] with types[4l + i] and out_features[4l + i] (layers/gguf.py); kv_caches[l]
// [2, blocks, block size, Hkv, D]. cos, sin_signed [B, 1, D] (layers/rotary.py); slot_mapping [B],
// where each decode's K/V goes; slots [B, L] and lengths [B], each decode's context (as
// paged_decode_attention takes them). Returns the last layer's output and residual, which the
// model's final norm adds.
std::tuple<at::Tensor, at::Tensor> llama_decode_layers(const at::Tensor& x, at::TensorList norms,
                                                       at::TensorList panels, at::IntArrayRef types,
                                                       at::IntArrayRef out_features, const at::Tensor& cos,
                                                       const at::Tensor& sin_signed, at::TensorList kv_caches,
                                                       const at::Tensor& slot_mapping, const at::Tensor& slots,
                                                       const at::Tensor& lengths, int64_t num_heads,
                                                       int64_t num_kv_heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == NORMS * layers &&
                  static_cast<int64_t>(panels.size()) == LINEARS * layers &&
                  static_cast<int64_t>(types.size()) == LINEARS * layers &&
                  static_cast<int64_t>(out_features.size()) == LINEARS * layers,
              "llama_decode_layers: 2 norms and 4 linear weights per layer, one KV cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && cos.dim() == 3,
              "llama_decode_layers: x [B, hidden] float32, rope tables [B, 1, D]");
  const int64_t dim = cos.size(-1);
  const std::string best;  // the best kernels this CPU runs, as layers/gguf.py asks by default
  at::Tensor hidden = x, residual, h;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t w = LINEARS * l;
    // LlamaDecoderLayer.forward
    if (l == 0) {
      residual = hidden;
      h = shardline_cpu::rms_norm(hidden, norms[0], eps);
    } else {
      std::tie(h, residual) = shardline_cpu::add_rms_norm(hidden, residual, norms[NORMS * l], eps);
    }
    // LlamaAttention.forward: its CPU path, then PagedAttention's decode step
    const at::Tensor qkv = shardline_cpu::gguf_linear(h, panels[w], types[w], out_features[w], best);
    const at::Tensor q =
        shardline_cpu::rope_cache_write(qkv, cos, sin_signed, slot_mapping, kv_caches[l], num_heads, num_kv_heads);
    const std::vector<at::Tensor> caches = kv_caches[l].view({2, -1, num_kv_heads, dim}).unbind(0);
    const at::Tensor attended = shardline_cpu::paged_decode_attention(q, caches[0], caches[1], slots, lengths, scale);
    const at::Tensor o = shardline_cpu::gguf_linear(attended, panels[w + 1], types[w + 1], out_features[w + 1], best);
    std::tie(h, residual) = shardline_cpu::add_rms_norm(o, residual, norms[NORMS * l + 1], eps);
    // LlamaMLP.forward: its CPU path
    const at::Tensor gate_up = shardline_cpu::gguf_linear(h, panels[w + 2], types[w + 2], out_features[w + 2], best);
    hidden = shardline_cpu::gguf_linear(shardline_cpu::silu_mul(gate_up), panels[w + 3], types[w + 3],
                                        out_features[w + 3], best);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardline_cpu, m) {
  m.def(
      "llama_decode_layers(Tensor x, Tensor[] norms, Tensor[] panels, int[] types, int[] out_features, "
      "Tensor cos, Tensor sin_signed, Tensor[] kv_caches, Tensor slot_mapping, Tensor slots, Tensor lengths, "
      "int num_heads, int num_kv_heads, float scale, float eps) -> (Tensor, Tensor)");
  m.impl("llama_decode_layers", c10::DispatchKey::CPU, &llama_decode_layers);
}

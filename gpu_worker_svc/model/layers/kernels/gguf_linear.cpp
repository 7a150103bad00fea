// y = x W^T with W in GGUF's own Q4_0, Q4_1 or Q8_0 blocks, on CPU (the layer: layers/gguf.py).
//
// A batch-1 decode step is bound by the bytes of weight it reads: 4.5 to 8.5 bits a weight here,
// against 32 for fp32. As llama.cpp does, each activation row is quantized to int8 blocks of 32,
// so that a block's dot product is integer and exact, and only the sum over blocks is fp32.
//
// A row's result depends on that row alone: its own quantization, and a sum over blocks in a fixed
// order, whatever the batch, the thread count or the tiling. The engine's determinism rests on it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

struct Isa {
  const char* name;
  bool (*runs_here)();
  void (*tile)(const Tile&);
};

// Best first: the default is the first this CPU runs. Every build is compiled on every machine.
const Isa ISAS[] = {
    {"avx512vnni", [] { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl"); }, tile_avx512vnni},
    {"avx512", [] { return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"); }, tile_avx512},
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c"); }, tile_avx2},
    {"scalar", [] { return true; }, tile_scalar},
};

const Isa& pick(const std::string& name) {
  for (const Isa& isa : ISAS) {
    if ((name.empty() && isa.runs_here()) || name == isa.name) {
      TORCH_CHECK(isa.runs_here(), "gguf_linear: this CPU cannot run the ", isa.name, " kernels");
      return isa;
    }
  }
  TORCH_CHECK(false, "gguf_linear: no kernels named ", name);
}

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "gguf_linear: ggml type ", type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
}

// One row's Q8 blocks: d = absmax / 127, codes = round-half-even(x / d) in [-127, 127], and
// s = d * sum(codes). The same arithmetic in the same order for every row, so codes are the bits
// any other caller of this function gets (the tests' reference reads them from gguf_quantize_rows).
void quantize_row(const float* x, int64_t blocks, int8_t* codes, float* d, float* s) {
  for (int64_t b = 0; b < blocks; ++b, x += QK, codes += QK) {
    float absmax = 0.0f;
    for (int64_t j = 0; j < QK; ++j) absmax = std::fmax(absmax, std::fabs(x[j]));
    const float scale = absmax / 127.0f;
    const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < QK; ++j) {
      codes[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
      sum += codes[j];
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

struct Quantized {
  at::Tensor codes, d, s;
};

Quantized quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "gguf_linear: in_features must be a multiple of 32");
  const int64_t rows = x.size(0), blocks = x.size(1) / QK;
  Quantized q{at::empty({rows, blocks * QK}, x.options().dtype(at::kChar)), at::empty({rows, blocks}, x.options()),
              at::empty({rows, blocks}, x.options())};
  const float* xp = x.data_ptr<float>();
  int8_t* cp = q.codes.data_ptr<int8_t>();
  float *dp = q.d.data_ptr<float>(), *sp = q.s.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * blocks * QK, blocks, cp + i * blocks * QK, dp + i * blocks, sp + i * blocks);
  });
  return q;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type, const std::string& isa) {
  const Isa& kernels = pick(isa);
  const int64_t bytes = block_bytes(type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "gguf_linear: weight must be contiguous uint8 rows of blocks");
  const Quantized q = quantize_rows(x);
  const int64_t rows = x.size(0), n = weight.size(0), blocks = x.size(1) / QK;
  TORCH_CHECK(weight.size(1) == blocks * bytes, "gguf_linear: a weight row holds ", weight.size(1),
              " bytes, but ", x.size(1), " inputs need ", blocks * bytes);
  at::Tensor y = at::empty({rows, n}, x.options());
  Tile tile{static_cast<QType>(type), weight.data_ptr<uint8_t>(), weight.size(1), 0, 0,
            Q8Rows{q.codes.data_ptr<int8_t>(), q.d.data_ptr<float>(), q.s.data_ptr<float>(), blocks}, rows,
            y.data_ptr<float>(), n};
  // Threads split the output features: each streams its own part of the weight once per step.
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    Tile part = tile;
    part.n0 = begin;
    part.n1 = end;
    kernels.tile(part);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_quantize_rows(const at::Tensor& x) {
  Quantized q = quantize_rows(x);
  return {q.codes, q.d, q.s};
}

std::vector<std::string> gguf_kernels() {
  std::vector<std::string> names;
  for (const Isa& isa : ISAS)
    if (isa.runs_here()) names.emplace_back(isa.name);
  return names;
}

}  // namespace
}  // namespace shardline_gguf

TORCH_LIBRARY_FRAGMENT(shardline_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, int type, str isa=\"\") -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &shardline_gguf::gguf_linear);
  m.def("gguf_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.impl("gguf_quantize_rows", c10::DispatchKey::CPU, &shardline_gguf::gguf_quantize_rows);
  m.def("gguf_kernels() -> str[]", &shardline_gguf::gguf_kernels);
}

// y = x W^T with W in GGUF's own Q4_0, Q4_1 or Q8_0 blocks, interleaved into panels of 16 rows
// (gguf_dot.h), on CPU (the layer: layers/gguf.py).
//
// A batch-1 decode step is bound by the bytes of weight it reads: 4.5 to 8.5 bits a weight here,
// against 32 for fp32. As llama.cpp does, each activation row is quantized to int8 blocks of 32,
// so that a block's dot product is integer and exact, and only the sum over blocks is fp32. A
// batch's rows share each block's unpacked weights, so a decode step of 16 or 64 rows, and a
// prefill, are compute-bound on integer products of four (VNNI) rather than on the weights' bytes.
//
// A row's result depends on that row alone: its own quantization, and a sum over blocks in a fixed
// order, whatever the batch, the thread count, the tiling or the instruction set. The engine's
// determinism rests on it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "cpu_ops.h"
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

QType checked_type(int64_t type) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0, "gguf_linear: ggml type ", type,
              " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  return static_cast<QType>(type);
}

// One row's Q8 blocks: d = absmax / 127, codes = round-half-even(x / d) in [-127, 127], and
// sum = the codes' sum, s = d * sum. The same arithmetic in the same order for every row, so codes are the bits
// any other caller of this function gets (the tests' reference reads them from gguf_quantize_rows).
void quantize_row(const float* x, int64_t blocks, int8_t* codes, float* d, float* s, int32_t* sums) {
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
    sums[b] = sum;
  }
}

struct Quantized {
  at::Tensor codes, d, s, sums;
};

Quantized quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "gguf_linear: in_features must be a multiple of 32");
  const int64_t rows = x.size(0), blocks = x.size(1) / QK;
  Quantized q{at::empty({rows, blocks * QK}, x.options().dtype(at::kChar)), at::empty({rows, blocks}, x.options()),
              at::empty({rows, blocks}, x.options()), at::empty({rows, blocks}, x.options().dtype(at::kInt))};
  const float* xp = x.data_ptr<float>();
  int8_t* cp = q.codes.data_ptr<int8_t>();
  float *dp = q.d.data_ptr<float>(), *sp = q.s.data_ptr<float>();
  int32_t* sums = q.sums.data_ptr<int32_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row(xp + i * blocks * QK, blocks, cp + i * blocks * QK, dp + i * blocks, sp + i * blocks,
                   sums + i * blocks);
  });
  return q;
}

}  // namespace
}  // namespace shardline_gguf

namespace shardline_cpu {

using namespace shardline_gguf;

// panels: uint8 [ceil(out_features / 16), blocks * panel bytes], as layers/gguf.py lays them out.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& panels, int64_t type, int64_t out_features,
                       const std::string& isa) {
  const Isa& kernels = pick(isa);
  const QType qtype = checked_type(type);
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte && panels.is_contiguous(),
              "gguf_linear: weight must be contiguous uint8 panels");
  const Quantized q = quantize_rows(x);
  const int64_t rows = x.size(0), groups = panels.size(0), blocks = x.size(1) / QK;
  TORCH_CHECK(groups == (out_features + LANES - 1) / LANES, "gguf_linear: ", groups, " panels of 16 rows cannot hold ",
              out_features, " output features");
  TORCH_CHECK(panels.size(1) == blocks * panel_bytes(qtype), "gguf_linear: a panel row holds ", panels.size(1),
              " bytes, but ", x.size(1), " inputs need ", blocks * panel_bytes(qtype));
  at::Tensor y = at::empty({rows, out_features}, x.options());
  Tile tile{qtype, panels.data_ptr<uint8_t>(), 0, 0, out_features,
            Q8Rows{q.codes.data_ptr<int8_t>(), q.d.data_ptr<float>(), q.s.data_ptr<float>(),
                   q.sums.data_ptr<int32_t>(), blocks},
            rows, y.data_ptr<float>(), out_features};
  // Threads split the panels: each streams its own part of the weight once per row tile.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Tile part = tile;
    part.g0 = begin;
    part.g1 = end;
    kernels.tile(part);
  });
  return y;
}

}  // namespace shardline_cpu

namespace shardline_gguf {
namespace {

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
  m.def("gguf_linear(Tensor x, Tensor panels, int type, int out_features, str isa=\"\") -> Tensor");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &shardline_cpu::gguf_linear);
  m.def("gguf_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.impl("gguf_quantize_rows", c10::DispatchKey::CPU, &shardline_gguf::gguf_quantize_rows);
  m.def("gguf_kernels() -> str[]", &shardline_gguf::gguf_kernels);
}

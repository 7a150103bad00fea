// silu(gate) * up for a gated MLP's fused gate/up projection, on CPU in float32 (the callers:
// model/llama.py, decode_layers.cpp).
//
// torch spells it as a chunk, a silu and a multiply, with a buffer between them. Here one pass
// reads each row once. silu(g) = g / (1 + e^-g) is computed from e = exp(-|g|) <= 1, which never
// overflows: g / (1 + e) for g >= 0, g e / (1 + e) below. A row's result depends on that row
// alone, lane by lane, whatever the row count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_ops.h"
#include "vec16.h"

namespace {

using namespace shardline_vec;

// e^x for x <= 0 to about an ulp, the way Cephes' expf does it: x = n ln 2 + r with |r| <= ln 2 / 2,
// ln 2 split in two so that n ln 2 is exact enough, e^r by a polynomial, times 2^n. (The softmax's
// exp_nonpositive skips the split: its error grows with |x|, to 5e-6 relative at -14, harmless
// for scores less their max but not for silu's tail.) Below -87 it is 0, as float32's expf nearly.
inline v16 exp_accurate(v16 x) {
  const v16 clamped = x < -87.0f ? (v16){} - 87.0f : x;
  v16 n;
  for (int64_t j = 0; j < W; ++j) n[j] = __builtin_nearbyintf(clamped[j] * 1.44269504088896341f);
  v16 r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = (v16){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 power;
  __builtin_memcpy(&power, &bits, sizeof power);
  return x < -87.0f ? (v16){} : p * power;
}

inline v16 silu_times(v16 g, v16 u) {
  const v16 magnitude = g < 0.0f ? -g : g;
  const v16 e = exp_accurate(-magnitude);
  return (g < 0.0f ? g * e : g) / (1.0f + e) * u;
}

}  // namespace

namespace shardline_cpu {

// gate_up [T, 2n]: each row's gate, then its up -> [T, n].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous float32 [T, 2n]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = gp + t * 2 * n, *u = g + n;
      float* o = op + t * n;
      int64_t j = 0;
      for (; j + W <= n; j += W) store(o + j, silu_times(load(g + j), load(u + j)));
      if (j < n) {  // the tail in a padded vector: the same arithmetic as every other lane
        float gt[W] = {}, ut[W] = {}, ot[W];
        std::copy(g + j, g + n, gt);
        std::copy(u + j, u + n, ut);
        store(ot, silu_times(load(gt), load(ut)));
        std::copy(ot, ot + (n - j), o + j);
      }
    }
  });
  return out;
}

}  // namespace shardline_cpu

TORCH_LIBRARY_FRAGMENT(shardline_cpu, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &shardline_cpu::silu_mul);
}

// The GGUF dot products in plain C++: the fallback for a CPU without AVX2, and the plainest
// statement of the arithmetic every build follows lane for lane (gguf_dot.h), so the SIMD builds
// are tested against it bit for bit.
#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

// IEEE half to float, by bits (this file assumes no F16C).
float half_to_float(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise it
    int e = -1;
    uint32_t m = mantissa;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// Lane k's exact integer block sum against one activation block's codes q.
int32_t block_sum(QType type, const uint8_t* codes, int64_t k, const int8_t* q) {
  int32_t sum = 0;
  if (type == Q8_0) {
    for (int c = 0; c < 8; ++c)
      for (int j = 0; j < 4; ++j) sum += static_cast<int8_t>(codes[64 * c + 4 * k + j]) * q[4 * c + j];
    return sum;
  }
  const int zero = type == Q4_0 ? 8 : 0;
  for (int c = 0; c < 4; ++c) {
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = codes[64 * c + 4 * k + j];
      sum += ((byte & 0x0f) - zero) * q[4 * c + j] + ((byte >> 4) - zero) * q[16 + 4 * c + j];
    }
  }
  return sum;
}

}  // namespace

void tile_scalar(const Tile& t) {
  const int64_t bytes = panel_bytes(t.type), blocks = t.x.blocks;
  for (int64_t i = 0; i < t.rows; ++i) {
    const int8_t* q = t.x.codes + i * blocks * QK;
    const float* d = t.x.d + i * blocks;
    const float* s = t.x.s + i * blocks;
    for (int64_t g = t.g0; g < t.g1; ++g) {
      float acc[LANES] = {};
      const uint8_t* panel = t.panels + g * blocks * bytes;
      for (int64_t b = 0; b < blocks; ++b, panel += bytes) {
        const uint8_t* codes = panel + codes_offset(t.type);
        for (int64_t k = 0; k < LANES; ++k) {
          const float scale = half_to_float(panel + 2 * k) * d[b];
          acc[k] = __builtin_fmaf(scale, static_cast<float>(block_sum(t.type, codes, k, q + b * QK)), acc[k]);
          if (t.type == Q4_1) acc[k] = __builtin_fmaf(half_to_float(panel + 32 + 2 * k), s[b], acc[k]);
        }
      }
      for (int64_t k = 0; k < LANES && g * LANES + k < t.out_features; ++k) t.y[i * t.ldy + g * LANES + k] = acc[k];
    }
  }
}

}  // namespace shardline_gguf

// The GGUF dot products in plain C++: the fallback for a CPU without AVX2, and the reference the
// SIMD kernels are tested against (same integer block sums; only the fp32 summation order differs).
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

float dot_q4_0(const uint8_t* w, const int8_t* q, const float* d, int64_t blocks) {
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += 18, q += QK) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += ((w[2 + j] & 0x0f) - 8) * q[j] + ((w[2 + j] >> 4) - 8) * q[j + 16];
    acc += half_to_float(w) * d[b] * static_cast<float>(sum);
  }
  return acc;
}

float dot_q4_1(const uint8_t* w, const int8_t* q, const float* d, const float* s, int64_t blocks) {
  float acc = 0.0f, mins = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += 20, q += QK) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += (w[4 + j] & 0x0f) * q[j] + (w[4 + j] >> 4) * q[j + 16];
    acc += half_to_float(w) * d[b] * static_cast<float>(sum);
    mins += half_to_float(w + 2) * s[b];
  }
  return acc + mins;
}

float dot_q8_0(const uint8_t* w, const int8_t* q, const float* d, int64_t blocks) {
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += 34, q += QK) {
    int32_t sum = 0;
    const int8_t* wq = reinterpret_cast<const int8_t*>(w + 2);
    for (int j = 0; j < 32; ++j) sum += wq[j] * q[j];
    acc += half_to_float(w) * d[b] * static_cast<float>(sum);
  }
  return acc;
}

}  // namespace

void tile_scalar(const Tile& t) {
  for (int64_t i0 = 0; i0 < t.rows; i0 += ROW_TILE) {
    const int64_t i1 = i0 + ROW_TILE < t.rows ? i0 + ROW_TILE : t.rows;
    for (int64_t n = t.n0; n < t.n1; ++n) {
      const uint8_t* w = t.weight + n * t.weight_row_bytes;
      for (int64_t i = i0; i < i1; ++i) {
        const int8_t* q = t.x.codes + i * t.x.blocks * QK;
        const float* d = t.x.d + i * t.x.blocks;
        float v;
        if (t.type == Q4_0) {
          v = dot_q4_0(w, q, d, t.x.blocks);
        } else if (t.type == Q4_1) {
          v = dot_q4_1(w, q, d, t.x.s + i * t.x.blocks, t.x.blocks);
        } else {
          v = dot_q8_0(w, q, d, t.x.blocks);
        }
        t.y[i * t.ldy + n] = v;
      }
    }
  }
}

}  // namespace shardline_gguf

// 16-float vectors for the CPU kernels that are not per instruction set (decode_attention.cpp,
// rms_norm.cpp, silu_mul.cpp): GCC vector extensions, compiled to AVX-512, or to two AVX2 registers.
#pragma once

#include <cstdint>

namespace shardline_vec {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int i16 __attribute__((vector_size(64)));

constexpr int64_t W = 16;  // floats per vector

inline v16 load(const float* p) { v16 r; __builtin_memcpy(&r, p, sizeof r); return r; }
inline void store(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof v); }

// The sum of the 16 lanes as a fixed tree.
inline float hsum(v16 v) {
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (a softmax's scores less their max), vectorized: 2^(x log2 e), split into
// an integer power of two and 2^f for f in [0, 1) by a degree-6 polynomial (relative error
// ~2e-7, that of float32's own expf to within a few ulps). Below -87 it is 0, as float32's.
inline v16 exp_nonpositive(v16 x) {
  v16 t = x * 1.44269504088896341f;
  t = t < -126.0f ? (v16){} - 127.0f : t;  // -inf and underflow: 2^-127 x p, flushed to 0 below
  v16 whole;
  for (int64_t j = 0; j < W; ++j) whole[j] = __builtin_floorf(t[j]);
  const v16 f = t - whole;
  v16 p = (v16){} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const i16 bits = (__builtin_convertvector(whole, i16) + 127) << 23;
  v16 power;
  __builtin_memcpy(&power, &bits, sizeof power);
  const v16 r = p * power;
  return t < -126.0f ? (v16){} : r;
}

}  // namespace shardline_vec

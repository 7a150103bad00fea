// 16-float vectors for the CPU kernels that are not per instruction set (decode_attention.cpp,
// rms_norm.cpp): GCC vector extensions, compiled to AVX-512, or to two AVX2 registers.
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

}  // namespace shardline_vec

// GGUF block formats and the per-instruction-set kernels that multiply them (gguf_linear.cpp
// dispatches between them at run time).
//
// The weights stay in the file's own blocks of 32: Q4_0 (fp16 d, 16 bytes of nibbles: w = d (q - 8)),
// Q4_1 (fp16 d and m, 16 bytes of nibbles: w = d q + m) and Q8_0 (fp16 d, 32 int8: w = d q). In a
// block, element j < 16 is the low nibble of byte j and element j >= 16 the high nibble of byte j - 16.
// Activations are quantized per row to blocks of 32 int8 codes with an fp32 scale d (x = d q, d =
// absmax / 127) and, for Q4_1's m, the block's d * sum(q), as llama.cpp's Q8_1. A dot product is then
// integer within each block, exact, and fp32 across blocks.
//
// Each instruction set has its own source file, compiled for that set alone (a pragma or a target
// attribute), so an AVX-512 build exists, and is tested for compiling, on a CPU that cannot run it.
// Those files include no C++ library or torch header: an inline function they instantiated would be
// compiled with their instructions, and the linker may keep that copy for every caller.
#pragma once

#include <stdint.h>

namespace shardline_gguf {

// ggml's type ids, as GGUF stores them.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

constexpr int64_t QK = 32;  // elements per block, in every format here

// Activation rows quantized to Q8 blocks: codes [rows, blocks * 32], d and s [rows, blocks].
struct Q8Rows {
  const int8_t* codes;
  const float* d;  // per block: x ~= d * code
  const float* s;  // per block: d * the sum of its codes (Q4_1's m multiplies it)
  int64_t blocks;  // blocks per row
};

// y[i * ldy + n] = dot(weight row n, activation row i) for n in [n0, n1) and i in [0, rows).
struct Tile {
  QType type;
  const uint8_t* weight;  // row-major rows of blocks
  int64_t weight_row_bytes;
  int64_t n0, n1;
  Q8Rows x;
  int64_t rows;
  float* y;
  int64_t ldy;
};

void tile_scalar(const Tile& t);
void tile_avx2(const Tile& t);
void tile_avx512(const Tile& t);       // AVX-512 F/BW/VL: 16-bit pair sums, as AVX2, two blocks a vector
void tile_avx512vnni(const Tile& t);   // with VNNI's vpdpbusd: u8 x s8 sums of four straight into int32

// Rows of one activation tile processed against a weight row while it sits in L1.
constexpr int64_t ROW_TILE = 32;

}  // namespace shardline_gguf

// GGUF block formats, the panels the kernels read them as, and the per-instruction-set kernels
// that multiply them (gguf_linear.cpp dispatches between them at run time).
//
// The file stores each weight row as blocks of 32: Q4_0 (fp16 d, 16 bytes of nibbles: w = d (q - 8)),
// Q4_1 (fp16 d and m, 16 bytes of nibbles: w = d q + m) and Q8_0 (fp16 d, 32 int8: w = d q). In a
// block, element j < 16 is the low nibble of byte j and element j >= 16 the high nibble of byte j - 16.
//
// At load (layers/gguf.py) the blocks of 16 rows are interleaved into panels, the same bytes in
// another order: panel (g, b) holds block b of rows 16 g .. 16 g + 15, as
//   16 fp16 d, lane k for row 16 g + k; for Q4_1, then 16 fp16 m;
//   then the codes in 64-byte chunks whose bytes 4k .. 4k + 3 are row k's: for Q4, chunk c holds the
//   row's nibble bytes 4c .. 4c + 3 (elements 4c .. 4c + 3 low, 16 + 4c .. 16 + 4c + 3 high); for
//   Q8_0, chunk c holds its codes 4c .. 4c + 3.
// A vector register then holds 16 rows' four-element groups side by side: one u8 x s8 instruction
// against an activation's four codes, broadcast, gives 16 outputs' partial sums at once, and the
// weights unpacked for a block serve every activation row of the batch.
//
// Activations are quantized per row to blocks of 32 int8 codes in [-127, 127] with an fp32 scale
// d (x = d q, d = absmax / 127), with the block's integer sum of codes and s = d * that sum.
//
// Every build computes each output lane, in block order from 0, as
//   S = the exact integer sum of w_j q_j over the block (Q4_0: w = q - 8; Q4_1 and Q8_0: w = q),
//   acc = fma(d_w * d_x, float(S), acc), and for Q4_1 then acc = fma(m_w, s_x, acc),
// so the scalar, AVX2 and AVX-512 builds give the same bits, and a row's result depends on that
// row alone, whatever the batch, the thread count or the tiling.
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

constexpr int64_t QK = 32;     // elements per block, in every format here
constexpr int64_t LANES = 16;  // weight rows per panel

// Bytes of one panel: 16 rows' blocks, as many bytes as the file's.
constexpr int64_t panel_bytes(QType t) { return t == Q4_0 ? 16 * 18 : t == Q4_1 ? 16 * 20 : 16 * 34; }
// Where a panel's codes begin, after its scales.
constexpr int64_t codes_offset(QType t) { return t == Q4_1 ? 64 : 32; }

// Activation rows quantized to Q8 blocks: codes [rows, blocks * 32], d, s and sums [rows, blocks].
struct Q8Rows {
  const int8_t* codes;
  const float* d;       // per block: x ~= d * code
  const float* s;       // per block: d * the sum of its codes (Q4_1's m multiplies it)
  const int32_t* sums;  // per block: the sum of its codes
  int64_t blocks;       // blocks per row
};

// y[i * ldy + n] = dot(weight row n, activation row i) for the rows n of panel groups [g0, g1)
// below out_features, and i in [0, rows).
struct Tile {
  QType type;
  const uint8_t* panels;  // [groups, blocks, panel bytes]
  int64_t g0, g1;
  int64_t out_features;  // a last group's lanes past it are padding, never stored
  Q8Rows x;
  int64_t rows;
  float* y;
  int64_t ldy;
};

void tile_scalar(const Tile& t);
void tile_avx2(const Tile& t);
void tile_avx512(const Tile& t);      // AVX-512 F/BW/VL: u8 x s8 pairs into int16, as AVX2, 16 lanes a vector
void tile_avx512vnni(const Tile& t);  // with VNNI's vpdpbusd: u8 x s8 sums of four straight into int32

// Activation rows per pass over a thread's panels: the tile's codes stay in L2 while its weights stream.
constexpr int64_t ROW_TILE = 64;

}  // namespace shardline_gguf

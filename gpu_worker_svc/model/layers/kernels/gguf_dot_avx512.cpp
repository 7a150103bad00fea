// The GGUF dot products with AVX-512 F/BW/VL, without VNNI: u8 x s8 pairs into int16 by
// vpmaddubsw, then into int32 by vpmaddwd, as on AVX2 but 16 rows a vector. Compiled for that
// set alone, so it builds (and that build is tested) on a CPU that cannot run it; the dispatcher
// calls it only where the CPU reports AVX-512 BW (gguf_linear.cpp).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

constexpr bool VNNI = false;

}  // namespace

#include "gguf_dot_avx512.inc"

void tile_avx512(const Tile& t) { tile_body(t); }

}  // namespace shardline_gguf

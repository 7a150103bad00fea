// The GGUF dot products with AVX-512 VNNI: vpdpbusd adds four u8 x s8 products straight into
// int32, one instruction where AVX2 needs two. Compiled for that set alone, so it builds on a CPU
// that cannot run it; the dispatcher calls it only where the CPU reports AVX-512 VNNI.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

constexpr bool VNNI = true;

}  // namespace

#include "gguf_dot_avx512.inc"

void tile_avx512vnni(const Tile& t) { tile_body(t); }

}  // namespace shardline_gguf

// The GGUF dot products with AVX-512 F/BW/VL, without VNNI: u8 x s8 pairs into int16 by
// vpmaddubsw, then into int32 by vpmaddwd, as on AVX2 but two blocks a vector. Compiled for that
// set alone, so it builds (and that build is tested) on a CPU that cannot run it; the dispatcher
// calls it only where the CPU reports AVX-512 BW (gguf_linear.cpp).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include <immintrin.h>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

// Pairs into int16 cannot saturate for these codes (see gguf_dot_avx2.cpp).
inline __m512i sum_u8_s8_512(__m512i u, __m512i s) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
}

}  // namespace

#include "gguf_dot_avx512.inc"

void tile_avx512(const Tile& t) { tile_body(t); }

}  // namespace shardline_gguf

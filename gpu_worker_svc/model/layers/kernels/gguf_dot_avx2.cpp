// The GGUF dot products with AVX2 + FMA + F16C: a panel's 16 rows as two vectors of 8 lanes
// (gguf_dot.h), u8 x s8 pairs into int16 by vpmaddubsw and into int32 by vpmaddwd, as llama.cpp's
// AVX2 kernels do.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m256 halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Four activation codes, the same in every lane.
inline __m256i four(const int8_t* q) {
  int32_t v;
  __builtin_memcpy(&v, q, sizeof v);
  return _mm256_set1_epi32(v);
}

// One half's eight four-element groups: group e meets activation codes 4e .. 4e + 3. Q4: the
// nibbles, 0..15; Q8_0: the signed codes, whose sign vpsignb moves onto the activation's.
struct Weights {
  __m256i w[8];
};

template <QType T>
inline void unpack(const uint8_t* codes, Weights& u) {
  if constexpr (T == Q8_0) {
    for (int e = 0; e < 8; ++e) u.w[e] = load256(codes + 64 * e);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load256(codes + 64 * c);
      u.w[c] = _mm256_and_si256(raw, low);
      u.w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
  }
}

// The exact integer block sums of 8 rows against one activation block q.
template <QType T>
inline __m256i block_sums(const Weights& u, const int8_t* q, int32_t code_sum) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (T == Q8_0) {
    // |w| x (+-x) pairs reach 2 * 128 * 127 in int16: taken into int32 group by group.
    __m256i sum = _mm256_setzero_si256();
    for (int e = 0; e < 8; ++e) {
      const __m256i x = four(q + 4 * e);
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(u.w[e], u.w[e]), _mm256_sign_epi8(x, u.w[e]));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
    }
    return sum;
  }
  // Nibbles: all 16 products an int16 lane gathers stay under 16 * 15 * 127 < 32768.
  __m256i pairs = _mm256_maddubs_epi16(u.w[0], four(q));
  for (int e = 1; e < 8; ++e) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u.w[e], four(q + 4 * e)));
  const __m256i sum = _mm256_madd_epi16(pairs, ones);
  return T == Q4_0 ? _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * code_sum)) : sum;
}

// Activation rows i .. i + R - 1 against lanes 8h .. 8h + 7 of one panel group. A row's operations
// are the same whatever R, so its bits are too.
template <QType T, int R>
void rows_of_half(const uint8_t* group, const Tile& t, int64_t i, int64_t g, int h) {
  const int64_t blocks = t.x.blocks, stride = blocks * QK;
  const int8_t* q = t.x.codes + i * stride;
  const float* d = t.x.d + i * blocks;
  const float* s = t.x.s + i * blocks;
  const int32_t* sums = t.x.sums + i * blocks;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  Weights u;
  for (int64_t b = 0; b < blocks; ++b, group += panel_bytes(T), q += QK) {
    unpack<T>(group + codes_offset(T) + 32 * h, u);
    const __m256 dw = halves(group + 16 * h);
    const __m256 mw = T == Q4_1 ? halves(group + 32 + 16 * h) : dw;
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * blocks + b;
      const __m256i sum = block_sums<T>(u, q + r * stride, sums[at]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(d[at])), _mm256_cvtepi32_ps(sum), acc[r]);
      if constexpr (T == Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[at]), acc[r]);
    }
  }
  const int64_t first = g * LANES + 8 * h, lanes = t.out_features - first;
  for (int r = 0; r < R; ++r) {
    float* out = t.y + (i + r) * t.ldy + first;
    if (lanes >= 8) {
      _mm256_storeu_ps(out, acc[r]);
    } else {
      float kept[8];
      _mm256_storeu_ps(kept, acc[r]);
      for (int64_t k = 0; k < lanes; ++k) out[k] = kept[k];
    }
  }
}

constexpr int MAX_ROWS = 3;  // rows a half's unpacked weights serve at once, within 16 registers

template <QType T>
void tile_of(const Tile& t) {
  const int64_t bytes = t.x.blocks * panel_bytes(T);
  for (int64_t i0 = 0; i0 < t.rows; i0 += ROW_TILE) {
    const int64_t i1 = i0 + ROW_TILE < t.rows ? i0 + ROW_TILE : t.rows;
    for (int64_t g = t.g0; g < t.g1; ++g) {
      const uint8_t* group = t.panels + g * bytes;
      for (int h = 0; h < 2 && g * LANES + 8 * h < t.out_features; ++h) {
        int64_t i = i0;
        for (; i + MAX_ROWS <= i1; i += MAX_ROWS) rows_of_half<T, MAX_ROWS>(group, t, i, g, h);
        if (i1 - i == 2) rows_of_half<T, 2>(group, t, i, g, h);
        if (i1 - i == 1) rows_of_half<T, 1>(group, t, i, g, h);
      }
    }
  }
}

}  // namespace

void tile_avx2(const Tile& t) {
  if (t.type == Q4_0) {
    tile_of<Q4_0>(t);
  } else if (t.type == Q4_1) {
    tile_of<Q4_1>(t);
  } else {
    tile_of<Q8_0>(t);
  }
}

}  // namespace shardline_gguf

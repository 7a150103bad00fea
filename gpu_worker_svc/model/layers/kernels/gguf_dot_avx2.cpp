// The GGUF dot products with AVX2 + FMA + F16C: one block of 32 a step, as llama.cpp's
// ggml_vec_dot_q4_1_q8_1 and its siblings do.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gguf_dot.h"

namespace shardline_gguf {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// 16 bytes of nibbles as 32 bytes in block order: low nibbles (elements 0..15) in the low lane,
// high nibbles (16..31) in the high lane, so they line up with the activation's 32 codes.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// Eight int32 partial sums of u8 x s8 products. vpmaddubsw adds adjacent pairs into int16 with
// saturation; the codes here keep a pair under 2 * 15 * 127 (Q4_1) or 2 * 128 * 127 (signed, below),
// so it never saturates, and vpmaddwd then adds pairs of those into int32 exactly.
inline __m256i sum_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The same for two signed operands: vpmaddubsw wants one unsigned, so take |w| and give x w's sign.
inline __m256i sum_s8_s8(__m256i w, __m256i x) { return sum_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

// A fixed tree over the eight lanes, so a dot product rounds alike wherever it is computed.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i codes(const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }

float dot_q4_0(const uint8_t* w, const int8_t* q, const float* d, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += 18, q += QK) {
    const __m256i wq = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
    const __m256 scale = _mm256_set1_ps(half(w) * d[b]);
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum_s8_s8(wq, codes(q))), acc);
  }
  return hsum(acc);
}

float dot_q4_1(const uint8_t* w, const int8_t* q, const float* d, const float* s, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.0f;
  for (int64_t b = 0; b < blocks; ++b, w += 20, q += QK) {
    const __m256 scale = _mm256_set1_ps(half(w) * d[b]);
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum_u8_s8(nibbles(w + 4), codes(q))), acc);
    mins += half(w + 2) * s[b];
  }
  return hsum(acc) + mins;
}

float dot_q8_0(const uint8_t* w, const int8_t* q, const float* d, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, w += 34, q += QK) {
    const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    const __m256 scale = _mm256_set1_ps(half(w) * d[b]);
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sum_s8_s8(wq, codes(q))), acc);
  }
  return hsum(acc);
}

}  // namespace

void tile_avx2(const Tile& t) {
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

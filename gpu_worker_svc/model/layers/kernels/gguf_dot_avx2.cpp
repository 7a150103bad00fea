// The GGUF dot products with AVX2 + FMA + F16C: one block of 32 a step, as llama.cpp's
// ggml_vec_dot_q4_1_q8_1 and its siblings do, for up to four activation rows at once.
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
// saturation; the codes here keep a pair under 2 * 15 * 127 (Q4_1) or 2 * 128 * 127 (|w| times x, see dot_rows),
// so it never saturates, and vpmaddwd then adds pairs of those into int32 exactly.
inline __m256i sum_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A fixed tree over the eight lanes, so a dot product rounds alike wherever it is computed.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i codes(const int8_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }

template <QType T>
constexpr int64_t BLOCK_BYTES = T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34;

// Dot products of one weight row with R activation rows i..i+R-1, into out[0..R). Each block's
// weights are unpacked once for all R rows (a batch's rows share them), and each row's
// accumulation is the same sequence of operations whatever R is: a row's result has the same bits
// alone (R = 1) as in a group of four. mins uses an explicit fma, so no compiler contraction choice
// can differ between the two.
template <QType T, int R>
void dot_rows(const uint8_t* w, const Tile& t, int64_t i, float* out) {
  const int64_t blocks = t.x.blocks;
  // One pointer per array, advanced a block at a time, and each row at a fixed stride from it:
  // a pointer per row and array would not fit in the registers, and the loop would spill them.
  const int64_t code_stride = blocks * QK;
  const int8_t* q = t.x.codes + i * code_stride;
  const float* d = t.x.d + i * blocks;
  const float* s = t.x.s + i * blocks;
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  for (int64_t b = 0; b < blocks; ++b, w += BLOCK_BYTES<T>, q += QK, ++d, ++s) {
    const float dw = half(w);
    __m256i wq;
    if constexpr (T == Q4_0) wq = _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
    if constexpr (T == Q4_1) wq = nibbles(w + 4);
    if constexpr (T == Q8_0) wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    // Signed weights: vpmaddubsw wants one unsigned operand, so |w| here and w's sign on x below.
    const __m256i unsigned_w = T == Q4_1 ? wq : _mm256_sign_epi8(wq, wq);
    const float dm = T == Q4_1 ? half(w + 2) : 0.0f;
    for (int r = 0; r < R; ++r) {
      const __m256i x = codes(q + r * code_stride);
      const __m256i sum = sum_u8_s8(unsigned_w, T == Q4_1 ? x : _mm256_sign_epi8(x, wq));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[r * blocks]), _mm256_cvtepi32_ps(sum), acc[r]);
      if constexpr (T == Q4_1) mins[r] = __builtin_fmaf(dm, s[r * blocks], mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + mins[r];
}

// Rows four at a time, then one at a time: the same bits either way (see dot_rows).
template <QType T>
void tile(const Tile& t) {
  for (int64_t i0 = 0; i0 < t.rows; i0 += ROW_TILE) {
    const int64_t i1 = i0 + ROW_TILE < t.rows ? i0 + ROW_TILE : t.rows;
    for (int64_t n = t.n0; n < t.n1; ++n) {
      const uint8_t* w = t.weight + n * t.weight_row_bytes;
      float out[4];
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4) {
        dot_rows<T, 4>(w, t, i, out);
        for (int r = 0; r < 4; ++r) t.y[(i + r) * t.ldy + n] = out[r];
      }
      for (; i < i1; ++i) {
        dot_rows<T, 1>(w, t, i, out);
        t.y[i * t.ldy + n] = out[0];
      }
    }
  }
}

}  // namespace

void tile_avx2(const Tile& t) {
  if (t.type == Q4_0) {
    tile<Q4_0>(t);
  } else if (t.type == Q4_1) {
    tile<Q4_1>(t);
  } else {
    tile<Q8_0>(t);
  }
}

}  // namespace shardline_gguf

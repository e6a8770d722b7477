// bf16 rounding on 16 lanes, rows scaled in bf16 and a 16×16 transpose, shared by _amx.cpp and _avx512.cpp.
// AVX-512 F/BW: include it inside a target region that allows them (both files do), never at the top of a file
// built for AVX2.
// Internal linkage: each file gets its own copy under its own target attributes.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

// 16 float32 rounded to bf16, nearest even, NaN as the quiet NaN 0x7FC0 (torch's rounding).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// dst's rows [rows, cols] (ldd apart) = src's bf16 rows (lds apart; dst may be src) each scaled by
// bf16(weight[n]), every product rounded to bf16 as torch's bf16 mul rounds it
// (g * weight[:, None].to(torch.bfloat16)).
inline void scale_rows_bf16(const uint16_t* src, int64_t lds, uint16_t* dst, int64_t ldd, const float* weight,
                            int64_t rows, int64_t cols) {
  const auto widened = [](__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  };
  for (int64_t n = 0; n < rows; ++n) {
    const __m512 w = widened(to_bf16(_mm512_set1_ps(weight[n])));
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 lanes = cols - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
      const __m512 v = widened(_mm256_maskz_loadu_epi16(lanes, src + n * lds + c));
      _mm256_mask_storeu_epi16(dst + n * ldd + c, lanes, to_bf16(_mm512_mul_ps(v, w)));
    }
  }
}

// 16 rows of 16 32-bit units, transposed in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4×4 blocks transposed within each 128-bit lane
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // then the 4×4 matrix of lanes
    const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
    t[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

}  // namespace

// bf16 rounding on 16 lanes, shared by _amx.cpp and _avx512.cpp. AVX-512 F/BW: include it inside
// a target region that allows them (both files do), never at the top of a file built for AVX2.
// Internal linkage: each file gets its own copy under its own target attributes.
#pragma once

#include <immintrin.h>

namespace {

// 16 float32 rounded to bf16, nearest even, NaN as the quiet NaN 0x7FC0 (torch's rounding).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

}  // namespace

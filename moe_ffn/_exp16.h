// e^x on 16 lanes and the rounding of torch's bf16 ops, for SwiGLU's elementwise work in bf16:
// shared by _amx.cpp and _avx512.cpp (as _bf16x16.h, which it needs first: to_bf16).
// AVX-512 F/BW/DQ: include it inside a target region that allows them, outside any namespace.
// Internal linkage: each file gets its own copy under its own target attributes.
#pragma once

#include <immintrin.h>

namespace {

// A float32 result as a bf16 op leaves it: rounded to bf16 (to_bf16) and widened back.
inline __m512 rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}

// e^x for 16 floats: the steps of _small_gemm.cpp's exp8 on 16 lanes (the same values; +inf past
// kExpMax, ln(FLT_MAX)).
constexpr float kExpMax = 88.72283935546875f;
inline __m512 exp16(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMax), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i k = _mm512_cvtps_epi32(n), half = _mm512_srai_epi32(k, 1);
  const __m512i bits_a = _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(k, half), _mm512_set1_epi32(127)), 23);
  const __m512i bits_b = _mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23);
  __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(bits_a)), _mm512_castsi512_ps(bits_b));
  e = _mm512_mask_mov_ps(e, over, _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_mov_ps(e, nan, _mm512_set1_ps(__builtin_nanf("")));
}

// Rounding as torch's bf16 ops round, by to_bf16's integer steps: the rounded values' bf16 bits
// (`bits`) and the same widened back to float32 (`rounded`).
struct ExactRound {
  static __m256i bits(__m512 v) { return to_bf16(v); }
  static __m512 rounded(__m512 v) { return ::rounded(v); }
};

inline __m512 widened(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

}  // namespace

// SwiGLU's forward activation on 16 lanes of bf16 values (swiglu16), with AVX512-BF16's
// rounding instruction where it rounds as torch does (NativeRound): shared by _amx.cpp and
// _avx512.cpp. Needs AVX512-BF16 on top of _exp16.h's (included first): include it inside a
// target region that allows it, outside any namespace. Internal linkage, as _exp16.h.
#pragma once

#include <immintrin.h>

namespace {

// ExactRound's rounding by one instruction (vcvtneps2bf16): the same bits on values that are
// neither NaN nor subnormal (see _amx.cpp's ordinary_row), which its callers screen for.
struct NativeRound {  // (only on rows `ordinary_row` passes)
  static __m256i bits(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
  static __m512 rounded(__m512 v) { return widened(bits(v)); }
};

// a = silu(g)·u on 16 lanes of bf16 values g, u (widened), rounded as swiglu_step rounds (the
// forward's part of it): NativeRound where every lane keeps its intermediates normal
// (ordinary_row's bounds, 2^-24 ≤ |g| ≤ 16 and 2^-24 ≤ |u| ≤ 2^24, checked on these lanes;
// NaN fails them), else ExactRound; the same bits either way.
inline __m256i swiglu16(__m512 g, __m512 u) {
  const __m512 ag = _mm512_abs_ps(g), au = _mm512_abs_ps(u), tiny = _mm512_set1_ps(0x1p-24f);
  const __mmask16 ordinary = _mm512_cmp_ps_mask(ag, tiny, _CMP_GE_OQ) & _mm512_cmp_ps_mask(ag, _mm512_set1_ps(16.0f), _CMP_LE_OQ) &
                             _mm512_cmp_ps_mask(au, tiny, _CMP_GE_OQ) & _mm512_cmp_ps_mask(au, _mm512_set1_ps(0x1p24f), _CMP_LE_OQ);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 act = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  if (ordinary == 0xFFFF) return NativeRound::bits(_mm512_mul_ps(NativeRound::rounded(act), u));
  return ExactRound::bits(_mm512_mul_ps(ExactRound::rounded(act), u));
}

}  // namespace

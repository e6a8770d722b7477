// One bf16 value at a time (its bits, uint16_t), as the library's files that convert single
// values share it (_small_gemm.cpp, _decode.cpp): widened to float32 exactly, and a float32
// rounded to bf16 as torch rounds it.
#pragma once

#include <cstdint>
#include <cstring>

namespace moe_ffn_bf16 {

// A bf16 is the top half of the float32 of the same value.
inline float widen(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// A float32 as a bfloat16 (its bits), rounded to nearest, ties to even; NaN as the quiet NaN
// 0x7FC0. The same rounding as torch's float32 → bfloat16 conversion (c10::BFloat16).
inline uint16_t round_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace moe_ffn_bf16

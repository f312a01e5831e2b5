// GGUF's block layouts (the bytes a GGUF file holds, unchanged) and fp16 decoding.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

namespace elk {

constexpr int QK = 32;     // legacy blocks
constexpr int QK_K = 256;  // K-quant super-blocks
constexpr int K_SCALE_SIZE = 12;

struct BlockQ4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[QK / 2]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[QK]; };
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct BlockQ5_K {
  uint16_t d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2];
};
struct BlockQ6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
struct BlockQ8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
// Activations for Q4_1/Q5_1: s = d * sum(qs), the block's min term in one product.
struct BlockQ8_1 { uint16_t d, s; int8_t qs[QK]; };

static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block");
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block");
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block");
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block");
static_assert(sizeof(BlockQ8_K) == 292, "Q8_K block");
static_assert(sizeof(BlockQ8_1) == 36, "Q8_1 block");

// IEEE half to float, exactly (subnormals, infinities and NaN included), with no F16C.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while ((mantissa & 0x400) == 0) { mantissa <<= 1; --exponent; }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Float to IEEE half, rounding to nearest even (as F16C's _cvtss_sh(x, 0) does).
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t magnitude = x & 0x7fffffff;
  if (magnitude >= 0x7f800000) return sign | (magnitude > 0x7f800000 ? 0x7e00 : 0x7c00);
  if (magnitude >= 0x477ff000) return sign | 0x7c00;  // rounds to 65536 or more: infinity
  if (magnitude < 0x38800000) {                        // below 2^-14: a subnormal half
    float a;
    std::memcpy(&a, &magnitude, sizeof(a));
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = (((magnitude >> 23) - 112) << 10) | ((magnitude >> 13) & 0x3ff);
  const uint32_t rest = magnitude & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry moves to the exponent
  return static_cast<uint16_t>(sign | h);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace elk

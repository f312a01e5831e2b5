// NEON kernels (aarch64), shared by neon.cpp (any Armv8-A core: vmull/vpadal) and
// neon_dotprod.cpp (Armv8.2 dotprod: vdotq_s32), through the Dot policy. Like every
// kernel they compute the reference's integer sums exactly, then k_block.
#pragma once

#include <arm_neon.h>

#include "kernels.h"

namespace elk {
namespace neon {

// sum over 16 lanes of w * a into acc, w and a int8 (the bytes of w read as signed: unsigned
// weights <= 63 or signed legacy ones; products fit int16).
struct MullDot {
  static int32x4_t dot(int32x4_t acc, uint8x16_t w, int8x16_t a) {
    const int8x16_t ws = vreinterpretq_s8_u8(w);
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(ws), vget_low_s8(a)));
    return vpadalq_s16(acc, vmull_s8(vget_high_s8(ws), vget_high_s8(a)));
  }
};

template <typename Dot>
float dot_q4_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ4_K *>(vx);
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    __builtin_prefetch(x + i + 1);
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(sub, x[i].scales, &sc1, &m1);
      scale_min_k4(sub + 1, x[i].scales, &sc2, &m2);
      const uint8x16_t q0 = vld1q_u8(q), q1 = vld1q_u8(q + 16);
      int32x4_t lo = Dot::dot(vdupq_n_s32(0), vandq_u8(q0, low4), vld1q_s8(a));
      lo = Dot::dot(lo, vandq_u8(q1, low4), vld1q_s8(a + 16));
      int32x4_t hi = Dot::dot(vdupq_n_s32(0), vshrq_n_u8(q0, 4), vld1q_s8(a + 32));
      hi = Dot::dot(hi, vshrq_n_u8(q1, 4), vld1q_s8(a + 48));
      dots += sc1 * vaddvq_s32(lo) + sc2 * vaddvq_s32(hi);
    }
    sum += k_block(fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].dmin), y[i].d, dots,
                   k_mins(x[i].scales, y[i].bsums));
  }
  return sum;
}

// Q5_K: Q4_K's nibbles plus bit 4 from qh (bit `sub` of qh[l] for the low nibble of weight l,
// bit sub + 1 for the high one): unsigned weights <= 31.
template <typename Dot>
float dot_q5_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ5_K *>(vx);
  const uint8x16_t low4 = vdupq_n_u8(0x0f), bit4 = vdupq_n_u8(0x10);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    const uint8x16_t qh0 = vld1q_u8(x[i].qh), qh1 = vld1q_u8(x[i].qh + 16);
    __builtin_prefetch(x + i + 1);
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(sub, x[i].scales, &sc1, &m1);
      scale_min_k4(sub + 1, x[i].scales, &sc2, &m2);
      const uint8x16_t u1 = vdupq_n_u8(static_cast<uint8_t>(1 << sub));
      const uint8x16_t u2 = vdupq_n_u8(static_cast<uint8_t>(2 << sub));
      const uint8x16_t q0 = vld1q_u8(q), q1 = vld1q_u8(q + 16);
      const uint8x16_t lo0 = vorrq_u8(vandq_u8(q0, low4), vandq_u8(vtstq_u8(qh0, u1), bit4));
      const uint8x16_t lo1 = vorrq_u8(vandq_u8(q1, low4), vandq_u8(vtstq_u8(qh1, u1), bit4));
      const uint8x16_t hi0 = vorrq_u8(vshrq_n_u8(q0, 4), vandq_u8(vtstq_u8(qh0, u2), bit4));
      const uint8x16_t hi1 = vorrq_u8(vshrq_n_u8(q1, 4), vandq_u8(vtstq_u8(qh1, u2), bit4));
      int32x4_t lo = Dot::dot(vdupq_n_s32(0), lo0, vld1q_s8(a));
      lo = Dot::dot(lo, lo1, vld1q_s8(a + 16));
      int32x4_t hi = Dot::dot(vdupq_n_s32(0), hi0, vld1q_s8(a + 32));
      hi = Dot::dot(hi, hi1, vld1q_s8(a + 48));
      dots += sc1 * vaddvq_s32(lo) + sc2 * vaddvq_s32(hi);
    }
    sum += k_block(fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].dmin), y[i].d, dots,
                   k_mins(x[i].scales, y[i].bsums));
  }
  return sum;
}

template <typename Dot>
float dot_q6_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ6_K *>(vx);
  const uint8x16_t low4 = vdupq_n_u8(0x0f), two = vdupq_n_u8(0x03);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *ql = x[i].ql, *qh = x[i].qh;
    const int8_t *sc = x[i].scales, *a = y[i].qs;
    __builtin_prefetch(x + i + 1);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, a += 128) {
      for (int s = 0; s < 2; ++s) {  // weights l = 16 s .. 16 s + 15 of each quarter
        const uint8x16_t l0 = vld1q_u8(ql + 16 * s), l1 = vld1q_u8(ql + 32 + 16 * s);
        const uint8x16_t h = vld1q_u8(qh + 16 * s);
        const uint8x16_t w[4] = {
            vorrq_u8(vandq_u8(l0, low4), vshlq_n_u8(vandq_u8(h, two), 4)),
            vorrq_u8(vandq_u8(l1, low4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), two), 4)),
            vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), two), 4)),
            vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4)),
        };
        for (int quarter = 0; quarter < 4; ++quarter) {
          const int32x4_t d = Dot::dot(vdupq_n_s32(0), w[quarter],
                                       vld1q_s8(a + 32 * quarter + 16 * s));
          dots += sc[2 * quarter + s] * vaddvq_s32(d);
        }
      }
    }
    // The -32 offset of every weight: 32 * scale * (sum of its 16 activations).
    int32_t offset = 0;
    for (int g = 0; g < 16; ++g) offset += x[i].scales[g] * y[i].bsums[g];
    sum += k_block(fp16_to_fp32(x[i].d), 0.0f, y[i].d, dots - 32 * offset, 0);
  }
  return sum;
}

// Legacy types (blocks of 32 x Q8_0 / Q8_1): the block's 32 weights as two int8x16 (any int8:
// vmull_s8 and vdotq_s32 are signed x signed), its exact integer sum, then legacy_term.
namespace legacy {

inline void nibbles(const uint8_t *qs, int8x16_t w[2]) {
  const uint8x16_t bytes = vld1q_u8(qs);
  w[0] = vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0f)));
  w[1] = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
}

// Bit j of a Q5 block's 32 high bits as 0x10 in weight j.
inline void add_high_bits(const uint8_t qh[4], int8x16_t w[2]) {
  static const uint8_t bit_of[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t bits = vld1q_u8(bit_of), bit4 = vdupq_n_u8(0x10);
  const uint8x16_t h0 = vcombine_u8(vdup_n_u8(qh[0]), vdup_n_u8(qh[1]));
  const uint8x16_t h1 = vcombine_u8(vdup_n_u8(qh[2]), vdup_n_u8(qh[3]));
  w[0] = vorrq_s8(w[0], vreinterpretq_s8_u8(vandq_u8(vtstq_u8(h0, bits), bit4)));
  w[1] = vorrq_s8(w[1], vreinterpretq_s8_u8(vandq_u8(vtstq_u8(h1, bits), bit4)));
}

inline void weights(const BlockQ4_0 &x, int8x16_t w[2]) {
  nibbles(x.qs, w);
  w[0] = vsubq_s8(w[0], vdupq_n_s8(8));
  w[1] = vsubq_s8(w[1], vdupq_n_s8(8));
}
inline void weights(const BlockQ4_1 &x, int8x16_t w[2]) { nibbles(x.qs, w); }
inline void weights(const BlockQ5_0 &x, int8x16_t w[2]) {
  nibbles(x.qs, w);
  add_high_bits(x.qh, w);
  w[0] = vsubq_s8(w[0], vdupq_n_s8(16));
  w[1] = vsubq_s8(w[1], vdupq_n_s8(16));
}
inline void weights(const BlockQ5_1 &x, int8x16_t w[2]) {
  nibbles(x.qs, w);
  add_high_bits(x.qh, w);
}
inline void weights(const BlockQ8_0 &x, int8x16_t w[2]) {
  w[0] = vld1q_s8(x.qs);
  w[1] = vld1q_s8(x.qs + 16);
}

template <typename Dot, typename W, typename A>
float dot(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const W *>(vx);
  const auto *y = static_cast<const A *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int8x16_t w[2];
    weights(x[i], w);
    int32x4_t acc = Dot::dot(vdupq_n_s32(0), vreinterpretq_u8_s8(w[0]), vld1q_s8(y[i].qs));
    acc = Dot::dot(acc, vreinterpretq_u8_s8(w[1]), vld1q_s8(y[i].qs + 16));
    sum += legacy_term(x[i], y[i], vaddvq_s32(acc));
  }
  return sum;
}

}  // namespace legacy

// Every kernel of one Dot policy, as a table.
template <typename Dot>
DotKernels table(const char *isa) {
  return DotKernels{isa, dot_q4_K<Dot>, dot_q5_K<Dot>, dot_q6_K<Dot>,
                    legacy::dot<Dot, BlockQ4_0, BlockQ8_0>, legacy::dot<Dot, BlockQ4_1, BlockQ8_1>,
                    legacy::dot<Dot, BlockQ5_0, BlockQ8_0>, legacy::dot<Dot, BlockQ5_1, BlockQ8_1>,
                    legacy::dot<Dot, BlockQ8_0, BlockQ8_0>};
}

}  // namespace neon
}  // namespace elk

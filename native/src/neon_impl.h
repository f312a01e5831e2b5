// NEON kernels (aarch64), shared by neon.cpp (any Armv8-A core: vmull/vpadal) and
// neon_dotprod.cpp (Armv8.2 dotprod: vdotq_s32), through the Dot policy. Like every
// kernel they compute the reference's integer sums exactly, then k_block.
#pragma once

#include <arm_neon.h>

#include "kernels.h"

namespace elk {
namespace neon {

// sum over 16 lanes of w * a into acc; w unsigned <= 63, a int8 (products fit int16).
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

}  // namespace neon
}  // namespace elk

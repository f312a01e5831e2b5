// NEON kernels (aarch64), shared by neon.cpp (any Armv8-A core: vmull/vpadal) and
// neon_dotprod.cpp (Armv8.2 dotprod: vdotq_s32), through the Dot policy. Like every
// kernel they compute the reference's integer sums exactly, then k_block.
#pragma once

#include <arm_neon.h>

#include <type_traits>

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

#if defined(__ARM_FEATURE_DOTPROD)
// Armv8.2 dotprod (neon_dotprod.cpp, neon_i8mm.cpp): vdotq_s32.
struct DotProd {
  static int32x4_t dot(int32x4_t acc, uint8x16_t w, int8x16_t a) {
    return vdotq_s32(acc, vreinterpretq_s8_u8(w), a);
  }
};
#endif

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

// ---- Batches of the K types ------------------------------------------------------------------
// One weight row's super-block is unpacked once (its codes in 16 registers, its scales and mins
// decoded) for every activation row of the call, instead of once per output element. Each
// element gets the single-row dots' integer sums (exact in any order: here the sub-block sums
// are scaled in the vector lanes and reduced once) and the same k_block: the same bits.
constexpr int64_t kGemmRows = 64;  // activation rows a pass (their float sums on the stack)

// The min terms' integer: sum of min_j * (the 32 activations of sub-block j), j < 8.
inline int32_t decoded_mins(const uint8_t mins[8], const int16_t *bsums) {
  const int16x8_t pairs = vpaddq_s16(vld1q_s16(bsums), vld1q_s16(bsums + 8));
  const int16x8_t m = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mins)));
  return vaddvq_s32(vmlal_s16(vmull_s16(vget_low_s16(pairs), vget_low_s16(m)),
                              vget_high_s16(pairs), vget_high_s16(m)));
}

// Q4_K (kQ5 false) or Q5_K (kQ5 true) codes of a super-block: q[4p..4p+1] the low nibbles of
// bytes 32p..32p+31 (sub-block 2p), q[4p+2..4p+3] their high nibbles (2p + 1), plus bit 4.
template <bool kQ5, typename Block>
inline void unpack_k45(const Block &x, uint8x16_t q[16]) {
  const uint8x16_t low4 = vdupq_n_u8(0x0f);
  for (int p = 0; p < 4; ++p) {
    const uint8x16_t q0 = vld1q_u8(x.qs + 32 * p), q1 = vld1q_u8(x.qs + 32 * p + 16);
    q[4 * p] = vandq_u8(q0, low4);
    q[4 * p + 1] = vandq_u8(q1, low4);
    q[4 * p + 2] = vshrq_n_u8(q0, 4);
    q[4 * p + 3] = vshrq_n_u8(q1, 4);
  }
  if constexpr (kQ5) {
    const uint8x16_t bit4 = vdupq_n_u8(0x10);
    const uint8x16_t qh0 = vld1q_u8(x.qh), qh1 = vld1q_u8(x.qh + 16);
    for (int p = 0; p < 4; ++p) {
      const uint8x16_t u1 = vdupq_n_u8(static_cast<uint8_t>(1 << (2 * p)));
      const uint8x16_t u2 = vdupq_n_u8(static_cast<uint8_t>(2 << (2 * p)));
      q[4 * p] = vorrq_u8(q[4 * p], vandq_u8(vtstq_u8(qh0, u1), bit4));
      q[4 * p + 1] = vorrq_u8(q[4 * p + 1], vandq_u8(vtstq_u8(qh1, u1), bit4));
      q[4 * p + 2] = vorrq_u8(q[4 * p + 2], vandq_u8(vtstq_u8(qh0, u2), bit4));
      q[4 * p + 3] = vorrq_u8(q[4 * p + 3], vandq_u8(vtstq_u8(qh1, u2), bit4));
    }
  }
}

template <typename Dot, bool kQ5>
void gemm_k45(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
              int64_t nb, float *out, int64_t ldo) {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  float sum[kGemmRows];
  for (int64_t i0 = 0; i0 < m; i0 += kGemmRows) {
    const int64_t rows = m - i0 < kGemmRows ? m - i0 : kGemmRows;
    const auto *ab = static_cast<const uint8_t *>(a) + i0 * as;
    for (int64_t j = 0; j < n; ++j) {
      const auto *x = reinterpret_cast<const Block *>(static_cast<const uint8_t *>(w) + j * ws);
      for (int64_t i = 0; i < rows; ++i) sum[i] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t sc[8], mins[8];
        for (int sub = 0; sub < 8; ++sub) scale_min_k4(sub, x[b].scales, &sc[sub], &mins[sub]);
        uint8x16_t q[16];
        unpack_k45<kQ5>(x[b], q);
        __builtin_prefetch(x + b + 1);
        const float d = fp16_to_fp32(x[b].d), dmin = fp16_to_fp32(x[b].dmin);
        for (int64_t i = 0; i < rows; ++i) {
          const BlockQ8_K &y = reinterpret_cast<const BlockQ8_K *>(ab + i * as)[b];
          int32x4_t acc = vdupq_n_s32(0);
          for (int p = 0; p < 4; ++p) {
            const int8_t *act = y.qs + 64 * p;
            int32x4_t lo = Dot::dot(vdupq_n_s32(0), q[4 * p], vld1q_s8(act));
            lo = Dot::dot(lo, q[4 * p + 1], vld1q_s8(act + 16));
            int32x4_t hi = Dot::dot(vdupq_n_s32(0), q[4 * p + 2], vld1q_s8(act + 32));
            hi = Dot::dot(hi, q[4 * p + 3], vld1q_s8(act + 48));
            acc = vmlaq_n_s32(acc, lo, sc[2 * p]);
            acc = vmlaq_n_s32(acc, hi, sc[2 * p + 1]);
          }
          sum[i] += k_block(d, dmin, y.d, vaddvq_s32(acc), decoded_mins(mins, y.bsums));
        }
      }
      for (int64_t i = 0; i < rows; ++i) out[(i0 + i) * ldo + j] = sum[i];
    }
  }
}

template <typename Dot>
void gemm_q6_K(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
               int64_t nb, float *out, int64_t ldo) {
  const uint8x16_t low4 = vdupq_n_u8(0x0f), two = vdupq_n_u8(0x03);
  float sum[kGemmRows];
  for (int64_t i0 = 0; i0 < m; i0 += kGemmRows) {
    const int64_t rows = m - i0 < kGemmRows ? m - i0 : kGemmRows;
    const auto *ab = static_cast<const uint8_t *>(a) + i0 * as;
    for (int64_t j = 0; j < n; ++j) {
      const auto *x =
          reinterpret_cast<const BlockQ6_K *>(static_cast<const uint8_t *>(w) + j * ws);
      for (int64_t i = 0; i < rows; ++i) sum[i] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        // Codes 0..63 (the -32 goes with the scales and block sums, as dot_q6_K does it):
        // q[8 half + 4 s + quarter] holds weights 128 half + 32 quarter + 16 s .. + 15.
        uint8x16_t q[16];
        for (int half = 0; half < 2; ++half) {
          const uint8_t *ql = x[b].ql + 64 * half, *qh = x[b].qh + 32 * half;
          for (int s = 0; s < 2; ++s) {
            const uint8x16_t l0 = vld1q_u8(ql + 16 * s), l1 = vld1q_u8(ql + 32 + 16 * s);
            const uint8x16_t h = vld1q_u8(qh + 16 * s);
            uint8x16_t *o = q + 8 * half + 4 * s;
            o[0] = vorrq_u8(vandq_u8(l0, low4), vshlq_n_u8(vandq_u8(h, two), 4));
            o[1] = vorrq_u8(vandq_u8(l1, low4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), two), 4));
            o[2] = vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), two), 4));
            o[3] = vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4));
          }
        }
        __builtin_prefetch(x + b + 1);
        const int8x16_t scales = vld1q_s8(x[b].scales);
        const int16x8_t sc_lo = vmovl_s8(vget_low_s8(scales));
        const int16x8_t sc_hi = vmovl_s8(vget_high_s8(scales));
        const float d = fp16_to_fp32(x[b].d);
        for (int64_t i = 0; i < rows; ++i) {
          const BlockQ8_K &y = reinterpret_cast<const BlockQ8_K *>(ab + i * as)[b];
          int32x4_t acc = vdupq_n_s32(0);
          for (int half = 0; half < 2; ++half) {
            const int8_t *sc = x[b].scales + 8 * half;
            for (int s = 0; s < 2; ++s) {
              for (int quarter = 0; quarter < 4; ++quarter) {
                const int32x4_t dq = Dot::dot(vdupq_n_s32(0), q[8 * half + 4 * s + quarter],
                                              vld1q_s8(y.qs + 128 * half + 32 * quarter + 16 * s));
                acc = vmlaq_n_s32(acc, dq, sc[2 * quarter + s]);
              }
            }
          }
          // The -32 offset of every weight: 32 * scale * (sum of its 16 activations).
          const int32_t offset = vaddvq_s32(vmlal_s16(
              vmull_s16(vget_low_s16(sc_lo), vld1_s16(y.bsums)), vget_high_s16(sc_lo),
              vld1_s16(y.bsums + 4))) + vaddvq_s32(vmlal_s16(
              vmull_s16(vget_low_s16(sc_hi), vld1_s16(y.bsums + 8)), vget_high_s16(sc_hi),
              vld1_s16(y.bsums + 12)));
          sum[i] += k_block(d, 0.0f, y.d, vaddvq_s32(acc) - 32 * offset, 0);
        }
      }
      for (int64_t i = 0; i < rows; ++i) out[(i0 + i) * ldo + j] = sum[i];
    }
  }
}

// A GEMV row keeps the single-row dots (decode as before); batches take the kernels above.
template <DotFn kDot, GemmFn kBatch>
void gemm_or_dots(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
                  int64_t nb, float *out, int64_t ldo) {
  if (m > 1) {
    kBatch(w, ws, n, a, as, m, nb, out, ldo);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    out[j] = kDot(static_cast<const uint8_t *>(w) + j * ws, static_cast<const BlockQ8_K *>(a), nb);
  }
}

// The batched kernels of one Dot policy (legacy types: their dots element by element).
template <typename Dot>
GemmKernels gemm_table(const char *isa) {
  return GemmKernels{isa, gemm_or_dots<dot_q4_K<Dot>, gemm_k45<Dot, false>>,
                     gemm_or_dots<dot_q5_K<Dot>, gemm_k45<Dot, true>>,
                     gemm_or_dots<dot_q6_K<Dot>, gemm_q6_K<Dot>>, nullptr};
}

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

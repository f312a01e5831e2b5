// NEON kernels for Arm cores with the int8 matrix multiply (i8mm: Armv8.6, e.g. Cortex-A710,
// Neoverse V1/N2): batches of the K types through SMMLA, which multiplies a 2 x 8 block of two
// activation rows by 8 weights of two weight rows into a 2 x 2 int32 tile. Single rows and the
// legacy types run the dotprod kernels (every i8mm core has dotprod). Built with +i8mm for this
// file only; dispatch.cpp calls it only when HWCAP2 says so.
//
// Each sub-block's 2 x 2 integer sums are scaled by its two weight rows' scales in the lanes
// (exact integers, in any order), then every element gets kernels.h's k_block from the same
// integers as the single-row dots: the reference's bits.
#include "neon_impl.h"

namespace elk {
namespace {

using neon::DotProd;

// A super-block of two weight rows (x, z) interleaved for SMMLA: chunk c holds weights
// 8c..8c+7 of x, then of z; scale[s] holds sub-block s's scales {x, z, x, z}.
struct PairBlock {
  int8x16_t chunk[32];
  int32x4_t scale[16];
  float d[2], dmin[2];
  uint8_t mins[2][8];       // Q4_K/Q5_K
  const int8_t *scales[2];  // Q6_K: for the -32 offsets
};

inline int8x16_t pair(uint8x8_t x, uint8x8_t z) { return vreinterpretq_s8_u8(vcombine_u8(x, z)); }

// Q4_K / Q5_K: 8 sub-blocks of 32 (4 chunks each).
template <bool kQ5>
struct K45 {
  using Block = typename std::conditional<kQ5, BlockQ5_K, BlockQ4_K>::type;
  static constexpr int kSubs = 8, kChunks = 4;

  static void prepare(const Block &x, const Block &z, PairBlock &out) {
    uint8x16_t q[2][16];
    neon::unpack_k45<kQ5>(x, q[0]);
    neon::unpack_k45<kQ5>(z, q[1]);
    // q[r][4p + h] is 16 weights of sub-block 2p + h / 2 (h 0, 1 low nibbles; 2, 3 high).
    for (int p = 0; p < 4; ++p) {
      for (int h = 0; h < 4; ++h) {
        const uint8x16_t a = q[0][4 * p + h], b = q[1][4 * p + h];
        const int c = 4 * (2 * p + h / 2) + 2 * (h % 2);  // sub-block 2p + h / 2, chunks 2 (h % 2)
        out.chunk[c] = pair(vget_low_u8(a), vget_low_u8(b));
        out.chunk[c + 1] = pair(vget_high_u8(a), vget_high_u8(b));
      }
    }
    uint8_t sc[2][8];
    for (int sub = 0; sub < 8; ++sub) {
      scale_min_k4(sub, x.scales, &sc[0][sub], &out.mins[0][sub]);
      scale_min_k4(sub, z.scales, &sc[1][sub], &out.mins[1][sub]);
      const int32_t v[4] = {sc[0][sub], sc[1][sub], sc[0][sub], sc[1][sub]};
      out.scale[sub] = vld1q_s32(v);
    }
    out.d[0] = fp16_to_fp32(x.d);
    out.d[1] = fp16_to_fp32(z.d);
    out.dmin[0] = fp16_to_fp32(x.dmin);
    out.dmin[1] = fp16_to_fp32(z.dmin);
  }

  static float term(const PairBlock &w, int r, const BlockQ8_K &y, int32_t dots) {
    return k_block(w.d[r], w.dmin[r], y.d, dots, neon::decoded_mins(w.mins[r], y.bsums));
  }
};

// Q6_K: 16 sub-blocks of 16 (2 chunks each), codes 0..63 (the -32 with the block sums).
struct Q6 {
  using Block = BlockQ6_K;
  static constexpr int kSubs = 16, kChunks = 2;

  static void codes(const BlockQ6_K &x, uint8x16_t q[16]) {  // q[sub]: weights 16 sub..+15
    const uint8x16_t low4 = vdupq_n_u8(0x0f), two = vdupq_n_u8(0x03);
    for (int half = 0; half < 2; ++half) {
      const uint8_t *ql = x.ql + 64 * half, *qh = x.qh + 32 * half;
      for (int s = 0; s < 2; ++s) {
        const uint8x16_t l0 = vld1q_u8(ql + 16 * s), l1 = vld1q_u8(ql + 32 + 16 * s);
        const uint8x16_t h = vld1q_u8(qh + 16 * s);
        // Quarter t of the half (weights 128 half + 32 t + 16 s ..) is sub-block 8 half + 2t + s.
        uint8x16_t *o = q + 8 * half + s;
        o[0] = vorrq_u8(vandq_u8(l0, low4), vshlq_n_u8(vandq_u8(h, two), 4));
        o[2] = vorrq_u8(vandq_u8(l1, low4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), two), 4));
        o[4] = vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), two), 4));
        o[6] = vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4));
      }
    }
  }

  static void prepare(const BlockQ6_K &x, const BlockQ6_K &z, PairBlock &out) {
    uint8x16_t q[2][16];
    codes(x, q[0]);
    codes(z, q[1]);
    for (int sub = 0; sub < 16; ++sub) {
      out.chunk[2 * sub] = pair(vget_low_u8(q[0][sub]), vget_low_u8(q[1][sub]));
      out.chunk[2 * sub + 1] = pair(vget_high_u8(q[0][sub]), vget_high_u8(q[1][sub]));
      const int32_t v[4] = {x.scales[sub], z.scales[sub], x.scales[sub], z.scales[sub]};
      out.scale[sub] = vld1q_s32(v);
    }
    out.d[0] = fp16_to_fp32(x.d);
    out.d[1] = fp16_to_fp32(z.d);
    out.scales[0] = x.scales;
    out.scales[1] = z.scales;
  }

  static float term(const PairBlock &w, int r, const BlockQ8_K &y, int32_t dots) {
    const int8x16_t sc = vld1q_s8(w.scales[r]);
    const int16x8_t lo = vmovl_s8(vget_low_s8(sc)), hi = vmovl_s8(vget_high_s8(sc));
    const int32_t offset =
        vaddvq_s32(vmlal_s16(vmull_s16(vget_low_s16(lo), vld1_s16(y.bsums)), vget_high_s16(lo),
                             vld1_s16(y.bsums + 4))) +
        vaddvq_s32(vmlal_s16(vmull_s16(vget_low_s16(hi), vld1_s16(y.bsums + 8)),
                             vget_high_s16(hi), vld1_s16(y.bsums + 12)));
    return k_block(w.d[r], 0.0f, y.d, dots - 32 * offset, 0);
  }
};

// Two weight rows at a time against activation rows in pairs (an odd last one of either is
// paired with itself and the copy's results dropped); blocks of 64 activation rows.
template <class P, DotFn kDot>
void gemm(const void *w, size_t ws, int64_t n, const void *a, size_t as, int64_t m,
          int64_t nb, float *out, int64_t ldo) {
  using Block = typename P::Block;
  const auto *wb = static_cast<const uint8_t *>(w);
  if (m < 2) {
    for (int64_t j = 0; j < n; ++j) {
      out[j] = kDot(wb + j * ws, static_cast<const BlockQ8_K *>(a), nb);
    }
    return;
  }
  constexpr int64_t kRows = neon::kGemmRows;
  float sum[kRows][2];
  PairBlock block;
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    const int64_t rows = m - i0 < kRows ? m - i0 : kRows;
    const auto *ab = static_cast<const uint8_t *>(a) + i0 * as;
    for (int64_t j = 0; j < n; j += 2) {
      const auto *x = reinterpret_cast<const Block *>(wb + j * ws);
      const auto *z = reinterpret_cast<const Block *>(wb + (j + 1 < n ? j + 1 : j) * ws);
      for (int64_t i = 0; i < rows; ++i) sum[i][0] = sum[i][1] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        P::prepare(x[b], z[b], block);
        __builtin_prefetch(x + b + 1);
        __builtin_prefetch(z + b + 1);
        for (int64_t i = 0; i < rows; i += 2) {
          const BlockQ8_K &ya = reinterpret_cast<const BlockQ8_K *>(ab + i * as)[b];
          const BlockQ8_K &yb =
              reinterpret_cast<const BlockQ8_K *>(ab + (i + 1 < rows ? i + 1 : i) * as)[b];
          int32x4_t acc = vdupq_n_s32(0);  // {a x, a z, b x, b z}
          for (int s = 0; s < P::kSubs; ++s) {
            int32x4_t r = vdupq_n_s32(0);
            for (int c = s * P::kChunks; c < (s + 1) * P::kChunks; ++c) {
              const int8x16_t act = vcombine_s8(vld1_s8(ya.qs + 8 * c), vld1_s8(yb.qs + 8 * c));
              r = vmmlaq_s32(r, act, block.chunk[c]);
            }
            acc = vmlaq_s32(acc, r, block.scale[s]);
          }
          sum[i][0] += P::term(block, 0, ya, vgetq_lane_s32(acc, 0));
          sum[i][1] += P::term(block, 1, ya, vgetq_lane_s32(acc, 1));
          if (i + 1 < rows) {
            sum[i + 1][0] += P::term(block, 0, yb, vgetq_lane_s32(acc, 2));
            sum[i + 1][1] += P::term(block, 1, yb, vgetq_lane_s32(acc, 3));
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        out[(i0 + i) * ldo + j] = sum[i][0];
        if (j + 1 < n) out[(i0 + i) * ldo + j + 1] = sum[i][1];
      }
    }
  }
}

}  // namespace

const DotKernels *neon_i8mm_kernels() {
  static const DotKernels kernels = neon::table<DotProd>("neon_i8mm");
  return &kernels;
}

const GemmKernels *neon_i8mm_gemm_kernels() {
  static const GemmKernels kernels{"neon_i8mm",
                                   gemm<K45<false>, neon::dot_q4_K<DotProd>>,
                                   gemm<K45<true>, neon::dot_q5_K<DotProd>>,
                                   gemm<Q6, neon::dot_q6_K<DotProd>>, nullptr};
  return &kernels;
}

}  // namespace elk

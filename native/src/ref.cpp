// Scalar reference: the definition every ISA path must reproduce (see ref.h).
#include "edge_llm_kquant/ref.h"

#include <cmath>
#include <cstring>

#include "blocks.h"
#include "kernels.h"

namespace elk {
namespace {

void dequant_q4_0(const BlockQ4_0 *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = ((x[i].qs[j] & 0xf) - 8) * d;
      y[j + QK / 2] = ((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1 *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = (x[i].qs[j] & 0xf) * d + m;
      y[j + QK / 2] = (x[i].qs[j] >> 4) * d + m;
    }
  }
}

// Bit j of the 32 high bits of a Q5 block, as bit 4 of weight j.
inline int high_bit(const uint8_t qh[4], int j) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  return ((bits >> j) & 1) << 4;
}

void dequant_q5_0(const BlockQ5_0 *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = (((x[i].qs[j] & 0xf) | high_bit(x[i].qh, j)) - 16) * d;
      y[j + QK / 2] = (((x[i].qs[j] >> 4) | high_bit(x[i].qh, j + QK / 2)) - 16) * d;
    }
  }
}

void dequant_q5_1(const BlockQ5_1 *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = ((x[i].qs[j] & 0xf) | high_bit(x[i].qh, j)) * d + m;
      y[j + QK / 2] = ((x[i].qs[j] >> 4) | high_bit(x[i].qh, j + QK / 2)) * d + m;
    }
  }
}

void dequant_q8_0(const BlockQ8_0 *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += QK) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < QK; ++j) y[j] = x[i].qs[j] * d;
  }
}

// Q4_K and Q5_K share their layout of 8 sub-blocks of 32: (d * scale) * q - (dmin * min).
void dequant_q4_K(const BlockQ4_K *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
    const uint8_t *q = x[i].qs;
    for (int sub = 0; sub < 8; sub += 2, q += 32) {
      uint8_t sc, m;
      scale_min_k4(sub, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(sub + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xf) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
    }
  }
}

void dequant_q5_K(const BlockQ5_K *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
    const uint8_t *q = x[i].qs;
    uint8_t u1 = 1, u2 = 2;
    for (int sub = 0; sub < 8; sub += 2, q += 32, u1 <<= 2, u2 <<= 2) {
      uint8_t sc, m;
      scale_min_k4(sub, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(sub + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * ((q[l] & 0xf) + (x[i].qh[l] & u1 ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * ((q[l] >> 4) + (x[i].qh[l] & u2 ? 16 : 0)) - m2;
    }
  }
}

void dequant_q6_K(const BlockQ6_K *x, float *y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const uint8_t *ql = x[i].ql, *qh = x[i].qh;
    const int8_t *sc = x[i].scales;
    for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

// Legacy blocks of 32 against Q8_0 / Q8_1 activations: one integer sum per block, then
// kernels.h's legacy_term: (dx * dy) * sum, plus the weight's min times the activations'
// d * sum for Q4_1/Q5_1; the blocks' terms are added in order.
float dot_q4_0(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const BlockQ4_0 *>(vx);
  const auto *y = static_cast<const BlockQ8_0 *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; ++j) {
      s += ((x[i].qs[j] & 0xf) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + QK / 2];
    }
    sum += legacy_term(x[i], y[i], s);
  }
  return sum;
}

float dot_q4_1(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const BlockQ4_1 *>(vx);
  const auto *y = static_cast<const BlockQ8_1 *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; ++j) {
      s += (x[i].qs[j] & 0xf) * y[i].qs[j] + (x[i].qs[j] >> 4) * y[i].qs[j + QK / 2];
    }
    sum += legacy_term(x[i], y[i], s);
  }
  return sum;
}

float dot_q5_0(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const BlockQ5_0 *>(vx);
  const auto *y = static_cast<const BlockQ8_0 *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; ++j) {
      s += (((x[i].qs[j] & 0xf) | high_bit(x[i].qh, j)) - 16) * y[i].qs[j] +
           (((x[i].qs[j] >> 4) | high_bit(x[i].qh, j + QK / 2)) - 16) * y[i].qs[j + QK / 2];
    }
    sum += legacy_term(x[i], y[i], s);
  }
  return sum;
}

float dot_q5_1(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const BlockQ5_1 *>(vx);
  const auto *y = static_cast<const BlockQ8_1 *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < QK / 2; ++j) {
      s += ((x[i].qs[j] & 0xf) | high_bit(x[i].qh, j)) * y[i].qs[j] +
           ((x[i].qs[j] >> 4) | high_bit(x[i].qh, j + QK / 2)) * y[i].qs[j + QK / 2];
    }
    sum += legacy_term(x[i], y[i], s);
  }
  return sum;
}

float dot_q8_0(const void *vx, const void *vy, int64_t nb) {
  const auto *x = static_cast<const BlockQ8_0 *>(vx);
  const auto *y = static_cast<const BlockQ8_0 *>(vy);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) s += x[i].qs[j] * y[i].qs[j];
    sum += legacy_term(x[i], y[i], s);
  }
  return sum;
}

inline void set_sum(BlockQ8_0 &, float) {}
inline void set_sum(BlockQ8_1 &b, float s) { b.s = fp32_to_fp16(s); }

// Blocks of 32 at amax / 127 (fp16 scale), rounded half away from zero, as ggml does.
template <typename Block>
void quantize_q8_32(const float *x, Block *y, int64_t nb, bool with_sum) {
  for (int64_t i = 0; i < nb; ++i, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      y[i].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
      sum += y[i].qs[j];
    }
    if (with_sum) set_sum(y[i], static_cast<float>(sum) * d);
  }
}

// Dot products against Q8_K activations: integer sums per super-block, then k_block.
float dot_q4_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ4_K *>(vx);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(sub, x[i].scales, &sc1, &m1);
      scale_min_k4(sub + 1, x[i].scales, &sc2, &m2);
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo += (q[l] & 0xf) * a[l];
        hi += (q[l] >> 4) * a[l + 32];
      }
      dots += sc1 * lo + sc2 * hi;
    }
    // The min terms need only the activations' block sums (16 weights each).
    sum += k_block(fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].dmin), y[i].d, dots,
                   k_mins(x[i].scales, y[i].bsums));
  }
  return sum;
}

float dot_q5_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ5_K *>(vx);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *q = x[i].qs;
    const int8_t *a = y[i].qs;
    uint8_t u1 = 1, u2 = 2;
    for (int sub = 0; sub < 8; sub += 2, q += 32, a += 64, u1 <<= 2, u2 <<= 2) {
      uint8_t sc1, m1, sc2, m2;
      scale_min_k4(sub, x[i].scales, &sc1, &m1);
      scale_min_k4(sub + 1, x[i].scales, &sc2, &m2);
      int32_t lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo += ((q[l] & 0xf) + (x[i].qh[l] & u1 ? 16 : 0)) * a[l];
        hi += ((q[l] >> 4) + (x[i].qh[l] & u2 ? 16 : 0)) * a[l + 32];
      }
      dots += sc1 * lo + sc2 * hi;
    }
    sum += k_block(fp16_to_fp32(x[i].d), fp16_to_fp32(x[i].dmin), y[i].d, dots,
                   k_mins(x[i].scales, y[i].bsums));
  }
  return sum;
}

float dot_q6_K(const void *vx, const BlockQ8_K *y, int64_t nb) {
  const auto *x = static_cast<const BlockQ6_K *>(vx);
  float sum = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    int32_t dots = 0;
    const uint8_t *ql = x[i].ql, *qh = x[i].qh;
    const int8_t *sc = x[i].scales, *a = y[i].qs;
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, a += 128) {
      int32_t part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // per 16 weights, scaled below
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        part[is + 0] += (((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32) * a[l];
        part[is + 2] += (((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32) * a[l + 32];
        part[is + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * a[l + 64];
        part[is + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * a[l + 96];
      }
      for (int g = 0; g < 8; ++g) dots += sc[g] * part[g];
    }
    sum += k_block(fp16_to_fp32(x[i].d), 0.0f, y[i].d, dots, 0);
  }
  return sum;
}

}  // namespace

const DotKernels &scalar_kernels() {
  static const DotKernels kernels{"scalar", dot_q4_K, dot_q5_K, dot_q6_K,
                                  dot_q4_0, dot_q4_1, dot_q5_0, dot_q5_1, dot_q8_0};
  return kernels;
}

int elk_vec_dot_with(const DotKernels &k, int type, int64_t n, const void *x, const void *y,
                     float *out) {
  const int per = elk_block_weights(type);
  if (per == 0 || n < 0 || n % per != 0 || elk_activation_type(type) < 0) return -1;
  const int64_t nb = n / per;
  const DotKernels &s = scalar_kernels();
  const auto *a = static_cast<const BlockQ8_K *>(y);
  switch (type) {
    case ELK_Q4_K: *out = k.q4_K(x, a, nb); return 0;
    case ELK_Q5_K: *out = k.q5_K(x, a, nb); return 0;
    case ELK_Q6_K: *out = k.q6_K(x, a, nb); return 0;
    case ELK_Q4_0: *out = (k.q4_0 ? k.q4_0 : s.q4_0)(x, y, nb); return 0;
    case ELK_Q4_1: *out = (k.q4_1 ? k.q4_1 : s.q4_1)(x, y, nb); return 0;
    case ELK_Q5_0: *out = (k.q5_0 ? k.q5_0 : s.q5_0)(x, y, nb); return 0;
    case ELK_Q5_1: *out = (k.q5_1 ? k.q5_1 : s.q5_1)(x, y, nb); return 0;
    case ELK_Q8_0: *out = (k.q8_0 ? k.q8_0 : s.q8_0)(x, y, nb); return 0;
    default: return -1;
  }
}

}  // namespace elk

using namespace elk;

extern "C" int elk_block_weights(int type) {
  switch (type) {
    case ELK_Q4_0: case ELK_Q4_1: case ELK_Q5_0: case ELK_Q5_1: case ELK_Q8_0: case ELK_Q8_1:
      return QK;
    case ELK_Q4_K: case ELK_Q5_K: case ELK_Q6_K: case ELK_Q8_K: return QK_K;
    default: return 0;
  }
}

extern "C" size_t elk_block_bytes(int type) {
  switch (type) {
    case ELK_Q4_0: return sizeof(BlockQ4_0);
    case ELK_Q4_1: return sizeof(BlockQ4_1);
    case ELK_Q5_0: return sizeof(BlockQ5_0);
    case ELK_Q5_1: return sizeof(BlockQ5_1);
    case ELK_Q8_0: return sizeof(BlockQ8_0);
    case ELK_Q4_K: return sizeof(BlockQ4_K);
    case ELK_Q5_K: return sizeof(BlockQ5_K);
    case ELK_Q6_K: return sizeof(BlockQ6_K);
    case ELK_Q8_K: return sizeof(BlockQ8_K);
    case ELK_Q8_1: return sizeof(BlockQ8_1);
    default: return 0;
  }
}

extern "C" int elk_dequantize_row_ref(int type, const void *x, float *y, int64_t k) {
  const int per = elk_block_weights(type);
  if (per == 0 || type == ELK_Q8_K || type == ELK_Q8_1 || k % per != 0) return -1;
  const int64_t nb = k / per;
  switch (type) {
    case ELK_Q4_0: dequant_q4_0(static_cast<const BlockQ4_0 *>(x), y, nb); break;
    case ELK_Q4_1: dequant_q4_1(static_cast<const BlockQ4_1 *>(x), y, nb); break;
    case ELK_Q5_0: dequant_q5_0(static_cast<const BlockQ5_0 *>(x), y, nb); break;
    case ELK_Q5_1: dequant_q5_1(static_cast<const BlockQ5_1 *>(x), y, nb); break;
    case ELK_Q8_0: dequant_q8_0(static_cast<const BlockQ8_0 *>(x), y, nb); break;
    case ELK_Q4_K: dequant_q4_K(static_cast<const BlockQ4_K *>(x), y, nb); break;
    case ELK_Q5_K: dequant_q5_K(static_cast<const BlockQ5_K *>(x), y, nb); break;
    case ELK_Q6_K: dequant_q6_K(static_cast<const BlockQ6_K *>(x), y, nb); break;
    default: return -1;
  }
  return 0;
}

extern "C" void elk_quantize_row_q8_K_ref(const float *x, void *out, int64_t k) {
  BlockQ8_K *y = static_cast<BlockQ8_K *>(out);
  for (int64_t i = 0; i < k / QK_K; ++i, x += QK_K) {
    float max = 0.0f, amax = 0.0f;  // the signed value of largest magnitude, and that magnitude
    for (int j = 0; j < QK_K; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) { amax = ax; max = x[j]; }
    }
    std::memset(&y[i], 0, sizeof(y[i]));
    if (amax == 0.0f) continue;
    // -127 / max, as ggml: the largest weight maps to -127, and the others stay in [-127, 127].
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; ++j) {
      const int v = static_cast<int>(std::nearbyint(iscale * x[j]));
      y[i].qs[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int g = 0; g < QK_K / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += y[i].qs[16 * g + j];
      y[i].bsums[g] = static_cast<int16_t>(sum);
    }
    y[i].d = 1.0f / iscale;
  }
}

extern "C" int elk_vec_dot_q8_K_ref(int type, int64_t n, const void *x, const void *y,
                                    float *out) {
  if (elk_activation_type(type) != ELK_Q8_K) return -1;
  return elk_vec_dot_with(scalar_kernels(), type, n, x, y, out);
}

extern "C" int elk_activation_type(int weight_type) {
  switch (weight_type) {
    case ELK_Q4_0: case ELK_Q5_0: case ELK_Q8_0: return ELK_Q8_0;
    case ELK_Q4_1: case ELK_Q5_1: return ELK_Q8_1;
    case ELK_Q4_K: case ELK_Q5_K: case ELK_Q6_K: return ELK_Q8_K;
    default: return -1;
  }
}

extern "C" int elk_quantize_row_ref(int activation_type, const float *x, void *y, int64_t k) {
  switch (activation_type) {
    case ELK_Q8_0:
      if (k % QK != 0) return -1;
      quantize_q8_32(x, static_cast<BlockQ8_0 *>(y), k / QK, false);
      return 0;
    case ELK_Q8_1:
      if (k % QK != 0) return -1;
      quantize_q8_32(x, static_cast<BlockQ8_1 *>(y), k / QK, true);
      return 0;
    case ELK_Q8_K:
      if (k % QK_K != 0) return -1;
      elk_quantize_row_q8_K_ref(x, y, k);
      return 0;
    default:
      return -1;
  }
}

extern "C" int elk_vec_dot_ref(int weight_type, int64_t n, const void *x, const void *y,
                               float *out) {
  return elk_vec_dot_with(scalar_kernels(), weight_type, n, x, y, out);
}

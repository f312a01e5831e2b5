// The arithmetic both attention files share (attention.cpp's float KV, attention_i8.cpp's
// int8 KV): the softmax's exp, the half-split rotary, the q/k RMSNorm and the window's first
// key. Inline, with internal linkage: each file's clones (target_clones) inline their own copy
// of the same IEEE operations, so both files give a query the same normed, rotated row.
// Compiled as their includers: -ffp-contract=off -fno-trapping-math.
#ifndef EDGE_LLM_KQUANT_ATTENTION_COMMON_H
#define EDGE_LLM_KQUANT_ATTENTION_COMMON_H

#include <cmath>
#include <cstdint>

#include "edge_llm_kquant/attention.h"
#include "edge_llm_kquant/row.h"

namespace {

// exp(x) for a softmax term, x = score - top <= 0 (NaN passes through): Cephes' expf
// polynomial after x = n ln2 + r, then 2^n from its bits. Only plain IEEE operations (no FMA,
// no libm call), so every clone gives the same bits and the loops over it vectorize: a glibc
// expf call per term was about half of a long prompt's attention time. Within 1 ulp of expf
// (checked at every 64th float of [-87, 0]); below -87 (exp < 1.7e-38, nothing beside a
// top term of 1) it is 0.
inline float softmax_exp(float x) {
  const float xc = x >= -87.0f ? x : -87.0f;
  const int32_t n = -static_cast<int32_t>(0.5f - xc * 1.44269504088896341f);  // round(x/ln2)
  const float nf = static_cast<float>(n);
  const float r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = ((p * r) * r + r) + 1.0f;
  // n >= -126: a normal power of two. Selects, not branches (CMakeLists: -fno-trapping-math).
  const float y = e * __builtin_bit_cast(float, (n + 127) << 23);
  const float z = x < -87.0f ? 0.0f : y;
  return x == x ? z : x;
}

// Half-split rotary (GPT-NeoX / llama.cpp's NEOX mode, GQA's rotary_interleaved 0).
inline void rotate(const float *x, const float *cos, const float *sin, int64_t head_dim, float *y) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    y[i] = x1 * cos[i] - x2 * sin[i];
    y[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// ggml_rms_norm, then the weight: the squares summed in double in order, y = (x * scale) * w.
inline const float *head_norm(const float *x, const float *weight, float eps, int64_t d,
                              float *y) {
  if (weight == nullptr) return x;
  double sum = 0.0;
  for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(d));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * scale) * weight[i];
  return y;
}

// The first key position a query at pos sees (the window's start, or 0).
inline int64_t first_key(const elk_attention_shape *shape, int64_t pos) {
  return shape->window > 0 && pos + 1 > shape->window ? pos + 1 - shape->window : 0;
}

// The cos/sin row that rotates token s of `row` (see elk_attention_shape.rope_per_token).
inline int64_t rope_row(const elk_attention_shape *shape, const elk_row *row, int64_t s) {
  return shape->rope_per_token ? row->offset + s : row->start + s;
}

}  // namespace

#endif  // EDGE_LLM_KQUANT_ATTENTION_COMMON_H

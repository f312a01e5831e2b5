// The causal depthwise conv + SiLU over a per-slot conv state (see causal_conv.h): the scalar
// definition, one fixed order per output element (-ffp-contract=off: no fused multiply-adds).
#include "edge_llm_kquant/causal_conv.h"

#include <cmath>

// x86-64: an AVX2 clone next to the baseline one, picked at load time (ifunc). The loops run
// across independent channels, each summed in the same order in either clone: the same bits
// (ELK_GDN_BASELINE builds the baseline alone, for the native checks).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ELK_GDN_BASELINE)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

extern "C" {

ELK_CLONES void elk_causal_conv_rows(int64_t channels, int64_t kernel, const elk_row *row,
                                     int64_t c0, int64_t c1, const float *x_all,
                                     const float *weight, const float *bias,
                                     int64_t state_floats, float *state, float *out_all) {
  constexpr int64_t kBlock = ELK_CONV_CHANNELS;
  const int64_t kept = kernel - 1, n = c1 - c0;
  const bool fresh = row->start == 0;
  float taps[ELK_CONV_MAX_KERNEL][kBlock];
  float window[ELK_CONV_MAX_KERNEL][kBlock];
  float sum[kBlock];
  float b[kBlock];
  for (int64_t j = 0; j < kernel; ++j) {
    for (int64_t c = 0; c < n; ++c) taps[j][c] = weight[(c0 + c) * kernel + j];
  }
  for (int64_t c = 0; c < n; ++c) b[c] = bias != nullptr ? bias[c0 + c] : 0.0f;
  float *row_state = state + row->slot * state_floats + c0;
  for (int64_t j = 0; j < kept; ++j) {
    for (int64_t c = 0; c < n; ++c) window[j][c] = fresh ? 0.0f : row_state[j * channels + c];
  }
  for (int64_t s = 0; s < row->length; ++s) {
    const float *x = x_all + (row->offset + s) * channels + c0;
    for (int64_t c = 0; c < n; ++c) sum[c] = 0.0f;
    for (int64_t j = 0; j < kept; ++j) {
      for (int64_t c = 0; c < n; ++c) sum[c] += window[j][c] * taps[j][c];
    }
    float *out = out_all + (row->offset + s) * channels + c0;
    if (bias != nullptr) {
      for (int64_t c = 0; c < n; ++c) {
        sum[c] += x[c] * taps[kept][c];
        out[c] = silu(sum[c] + b[c]);
      }
    } else {
      for (int64_t c = 0; c < n; ++c) {
        sum[c] += x[c] * taps[kept][c];
        out[c] = silu(sum[c]);
      }
    }
    for (int64_t j = 0; j + 1 < kept; ++j) {
      for (int64_t c = 0; c < n; ++c) window[j][c] = window[j + 1][c];
    }
    if (kept > 0) {
      for (int64_t c = 0; c < n; ++c) window[kept - 1][c] = x[c];
    }
  }
  for (int64_t j = 0; j < kept; ++j) {
    for (int64_t c = 0; c < n; ++c) row_state[j * channels + c] = window[j][c];
  }
}

}  // extern "C"

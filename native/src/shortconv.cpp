// Gated short convolution over a per-slot conv state (see shortconv.h). One fixed order per
// output element (the oldest position's product first, added to 0.0f, as ggml_ssm_conv's
// loop), channels in the inner loops so the compiler may vectorize the independent lanes; it
// may not reorder a sum or fuse a multiply-add (-ffp-contract=off).
#include "edge_llm_kquant/shortconv.h"

// x86-64: an AVX2 clone next to the baseline one, picked at load time (ifunc); both compute
// the same lane-wise IEEE operations in the same order, so they give the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

extern "C" {

ELK_CLONES void elk_shortconv_rows(const elk_shortconv_shape *shape, const elk_row *row,
                                   int64_t c0, int64_t c1, const float *bcx,
                                   const float *weight, float *state, float *y) {
  constexpr int64_t kBlock = ELK_SHORTCONV_CHANNELS;
  const int64_t channels = shape->channels, kernel = shape->kernel;
  const int64_t kept = kernel - 1, n = c1 - c0;
  const bool fresh = row->start == 0;
  // The block's weights by position, and its window of the last kernel - 1 products B * x.
  float taps[ELK_SHORTCONV_MAX_KERNEL][kBlock];
  float window[ELK_SHORTCONV_MAX_KERNEL][kBlock];
  float product[kBlock], sum[kBlock];
  for (int64_t j = 0; j < kernel; ++j) {
    for (int64_t c = 0; c < n; ++c) taps[j][c] = weight[(c0 + c) * kernel + j];
  }
  float *row_state = state + row->slot * kept * channels + c0;
  for (int64_t j = 0; j < kept; ++j) {
    for (int64_t c = 0; c < n; ++c) window[j][c] = fresh ? 0.0f : row_state[j * channels + c];
  }
  for (int64_t s = 0; s < row->length; ++s) {
    const float *in = bcx + (row->offset + s) * 3 * channels + c0;
    const float *gate_b = in, *gate_c = in + channels, *x = in + 2 * channels;
    for (int64_t c = 0; c < n; ++c) {
      product[c] = gate_b[c] * x[c];
      sum[c] = 0.0f;
    }
    for (int64_t j = 0; j < kept; ++j) {
      for (int64_t c = 0; c < n; ++c) sum[c] += window[j][c] * taps[j][c];
    }
    float *out = y + (row->offset + s) * channels + c0;
    for (int64_t c = 0; c < n; ++c) {
      sum[c] += product[c] * taps[kept][c];
      out[c] = gate_c[c] * sum[c];
    }
    for (int64_t j = 0; j + 1 < kept; ++j) {
      for (int64_t c = 0; c < n; ++c) window[j][c] = window[j + 1][c];
    }
    if (kept > 0) {
      for (int64_t c = 0; c < n; ++c) window[kept - 1][c] = product[c];
    }
  }
  for (int64_t j = 0; j < kept; ++j) {
    for (int64_t c = 0; c < n; ++c) row_state[j * channels + c] = window[j][c];
  }
}

}  // extern "C"

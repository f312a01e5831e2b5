// Gated short convolution over a per-slot conv state (the library's ShortConv op: LFM2's
// conv layers, llama.cpp's build_shortconv_block). Each output element is one sum in one fixed
// order (the state's oldest position first, as ggml_ssm_conv), whatever the number of
// positions or rows beside it: a verify pass over k+1 positions gives each the bits of k+1
// single-position calls, and a row's bits do not depend on the batch. Compiled without fused
// multiply-adds; on x86-64 an AVX2 clone, chosen at load, gives the same bits.
// Internal to the op library (hidden): its calls bind inside it, never to another copy.
#ifndef EDGE_LLM_KQUANT_SHORTCONV_H
#define EDGE_LLM_KQUANT_SHORTCONV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Widest conv kernel (positions summed per output) the op takes: LFM2 uses 3.
#define ELK_SHORTCONV_MAX_KERNEL 16
// Channels one call of elk_shortconv_rows handles at most (a task of the op).
#define ELK_SHORTCONV_CHANNELS 64

// One call's shape: rows [batch, seq] of `channels` channels, a conv of `kernel` positions,
// so each row's state holds kernel - 1 positions.
typedef struct {
  int64_t batch, seq, channels, kernel;
} elk_shortconv_shape;

// For batch row b and channels [c0, c1) (at most ELK_SHORTCONV_CHANNELS):
//   bcx [batch, seq, 3 * channels]: the in_proj output, B then C then x per position;
//   weight [channels, kernel]: the depthwise conv, oldest position first;
//   state [batch, kernel - 1, channels]: B * x of the row's last kernel - 1 positions, oldest
//     first (read as zeros when `fresh`: the row starts its sequence);
//   y [batch, seq, channels] = C * sum_j ext[s + j] * weight[:, j], with ext the state's
//     positions then B * x of the call's positions, summed from j = 0 up, from 0.0f.
// The state is then ext's last kernel - 1 positions (written after every read of it).
__attribute__((visibility("hidden"))) void elk_shortconv_rows(
    const elk_shortconv_shape *shape, int64_t b, int64_t c0, int64_t c1, const float *bcx,
    const float *weight, int fresh, float *state, float *y);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_SHORTCONV_H

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

#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// Widest conv kernel (positions summed per output) the op takes: LFM2 uses 3.
#define ELK_SHORTCONV_MAX_KERNEL 16
// Channels one call of elk_shortconv_rows handles at most (a task of the op).
#define ELK_SHORTCONV_CHANNELS 64

// One call's shape: `channels` channels, a conv of `kernel` positions, so each slot's state
// holds kernel - 1 positions.
typedef struct {
  int64_t channels, kernel;
} elk_shortconv_shape;

// For `row` and channels [c0, c1) (at most ELK_SHORTCONV_CHANNELS):
//   bcx [T, 3 * channels]: the in_proj output of the call's packed tokens, B then C then x;
//   weight [channels, kernel]: the depthwise conv, oldest position first;
//   state [N, kernel - 1, channels]: per slot, B * x of its last kernel - 1 positions, oldest
//     first (the row's slot read as zeros when row->start == 0: it starts its sequence);
//   y [T, channels] = C * sum_j ext[s + j] * weight[:, j], with ext the state's positions
//     then B * x of the row's tokens, summed from j = 0 up, from 0.0f.
// The slot's state is then ext's last kernel - 1 positions (written after every read of it).
__attribute__((visibility("hidden"))) void elk_shortconv_rows(
    const elk_shortconv_shape *shape, const elk_row *row, int64_t c0, int64_t c1,
    const float *bcx, const float *weight, float *state, float *y);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_SHORTCONV_H

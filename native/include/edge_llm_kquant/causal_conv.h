// The causal depthwise convolution + SiLU over a per-slot conv state that two ops share:
// GatedDeltaNet (Qwen3.5, no bias) and Mamba2 (Granite 4.0-H, with a bias). Each output
// element is one sum in one fixed order, so a row's bits do not depend on the rows beside it
// or on how its tokens are split into calls.
#ifndef EDGE_LLM_KQUANT_CAUSAL_CONV_H
#define EDGE_LLM_KQUANT_CAUSAL_CONV_H

#include <stdint.h>

#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// Widest conv kernel (positions) and channels per conv task.
#define ELK_CONV_MAX_KERNEL 16
#define ELK_CONV_CHANNELS 64

// Channels [c0, c1) (at most ELK_CONV_CHANNELS) of `row`: x [T, channels] (the call's packed
// tokens), weight [channels, kernel] (oldest position first), bias [channels] or NULL, the
// slot's conv state = its first (kernel - 1) * channels floats of `state` ([N, state_floats],
// oldest position first; read as zeros when row->start == 0). out [T, channels] =
// silu(sum_j ext[s + j] * weight[:, j] + bias), the sum from j = 0 up, from 0.0f, the bias
// added after it. The slot's conv state is then ext's last kernel - 1 positions.
__attribute__((visibility("hidden"))) void elk_causal_conv_rows(
    int64_t channels, int64_t kernel, const elk_row *row, int64_t c0, int64_t c1,
    const float *x, const float *weight, const float *bias, int64_t state_floats,
    float *state, float *out);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_CAUSAL_CONV_H

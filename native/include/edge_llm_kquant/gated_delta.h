// Gated DeltaNet over a per-slot state (the library's GatedDeltaNet op: Qwen3.5's linear
// attention layers, llama.cpp's build_layer_attn_linear after its projections). Two steps per
// call, each a fixed order per output element, so a row's bits do not depend on the rows
// beside it, on how its tokens are split into calls, or on the threads:
//   1. elk_gdn_conv_rows: the causal depthwise conv over each row's conv state, then SiLU;
//   2. elk_gdn_delta_rows: per value head, the q/k L2 norms, the gated delta rule one token
//      at a time (the recurrent form: prefill and decode are the same loop), then the gated
//      RMSNorm of the output (norm(o) * w * silu(z)).
#ifndef EDGE_LLM_KQUANT_GATED_DELTA_H
#define EDGE_LLM_KQUANT_GATED_DELTA_H

#include <stdint.h>

#include "edge_llm_kquant/causal_conv.h"
#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// Widest conv kernel the op takes (Qwen3.5: 4) and channels per conv task (causal_conv.h).
#define ELK_GDN_MAX_KERNEL ELK_CONV_MAX_KERNEL
#define ELK_GDN_CHANNELS ELK_CONV_CHANNELS
// Largest head size (d_k = d_v) the op takes (Qwen3.5: 128).
#define ELK_GDN_MAX_HEAD 256

// k_heads key/query heads and v_heads value heads of head_dim each (v_heads a multiple of
// k_heads; value head h reads key head h % k_heads, as ggml_gated_delta_net); the conv runs
// over channels = (2 * k_heads + v_heads) * head_dim (q, k, v) with `kernel` positions.
// A slot's state is conv_floats() = (kernel - 1) * channels floats of conv inputs, oldest
// position first, then v_heads * head_dim * head_dim floats of delta state, per head S[i][j]
// (i: key dim, j: value dim; ggml keeps its transpose).
typedef struct {
  int64_t k_heads, v_heads, head_dim, kernel;
  float eps;  // the gated RMSNorm's epsilon (and the L2 norms', as llama.cpp passes it)
} elk_gdn_shape;

// Channels [c0, c1) (at most ELK_GDN_CHANNELS) of `row`: qkv [T, channels] (the projection
// of the call's packed tokens), weight [channels, kernel] (oldest position first), state as
// above ([N, state floats], the slot's conv part read as zeros when row->start == 0), conv
// [T, channels] = silu(sum_j ext[s + j] * weight[:, j]) summed from j = 0 up, from 0.0f.
// The slot's conv part is then ext's last kernel - 1 positions.
__attribute__((visibility("hidden"))) void elk_gdn_conv_rows(
    const elk_gdn_shape *shape, const elk_row *row, int64_t c0, int64_t c1, const float *qkv,
    const float *weight, int64_t state_floats, float *state, float *conv);

// Value head h of `row`: conv [T, channels] (step 1's output), z [T, v_heads * head_dim],
// alpha and beta [T, v_heads] (the raw projections), dt_bias and a [v_heads] (a = -exp(A)),
// norm [head_dim]; the slot's delta state (zeros when row->start == 0) is updated token by
// token and y [T, v_heads * head_dim] written.
__attribute__((visibility("hidden"))) void elk_gdn_delta_rows(
    const elk_gdn_shape *shape, const elk_row *row, int64_t h, const float *conv,
    const float *z, const float *alpha, const float *beta, const float *dt_bias,
    const float *a, const float *norm, int64_t state_floats, float *state, float *y);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_GATED_DELTA_H

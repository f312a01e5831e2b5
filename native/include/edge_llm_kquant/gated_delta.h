// Gated DeltaNet over a per-slot state (the library's GatedDeltaNet op: Qwen3.5's linear
// attention layers, llama.cpp's build_layer_attn_linear after its projections). Two steps per
// call, each a fixed order per output element, so a row's bits do not depend on the rows
// beside it, on how its tokens are split into calls, or on the threads:
//   1. elk_gdn_conv_rows: the causal depthwise conv over each row's conv state, then SiLU;
//   2. elk_gdn_delta_rows: per value head, the q/k L2 norms, the gated delta rule in its
//      chunked form, then the gated RMSNorm of the output (norm(o) * w * silu(z)).
//
// The chunked form: chunks are fixed runs of `chunk` positions from position 0 (absolute, so
// not the call's split). The state holds S0, the delta state at the current chunk's first
// position, and the chunk's tokens so far (key, corrected value, cumulative log decay). A
// token at chunk position c reads S0 once (S0^T k and S0^T q, a matrix product over the
// call's tokens of the chunk), solves its corrected value against the chunk's earlier tokens
// (the chunk's triangular system by forward substitution) and forms its output from both;
// the chunk's last token folds the chunk into S0. Prefill and decode run this one
// definition, so a token's bits depend only on its position and inputs, never on whether it
// came alone or with the rest of its chunk.
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
// A slot's state is (kernel - 1) * channels floats of conv inputs, oldest position first,
// then per value head elk_gdn_head_floats(): S0[i][j] (d x d; i: key dim, j: value dim; ggml
// keeps its transpose), the chunk's keys transposed KT[i][c] (d x chunk), its corrected values
// U[c][j] (chunk x d) and cumulative log decays L[c] (chunk); entries past the row's chunk
// position are never read.
typedef struct {
  int64_t k_heads, v_heads, head_dim, kernel;
  float eps;      // the gated RMSNorm's epsilon (and the L2 norms', as llama.cpp passes it)
  int64_t chunk;  // positions per chunk, 1 .. ELK_GDN_MAX_CHUNK
} elk_gdn_shape;

// Longest chunk the op takes.
#define ELK_GDN_MAX_CHUNK 64

// Floats of one value head's part of the state.
static inline int64_t elk_gdn_head_floats(const elk_gdn_shape *shape) {
  const int64_t d = shape->head_dim;
  return d * d + shape->chunk * (2 * d + 1);
}

// Floats of a slot's whole state.
static inline int64_t elk_gdn_state_floats(const elk_gdn_shape *shape) {
  const int64_t channels = (2 * shape->k_heads + shape->v_heads) * shape->head_dim;
  return (shape->kernel - 1) * channels + shape->v_heads * elk_gdn_head_floats(shape);
}

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
// norm [head_dim]; the slot's head state (S0 read as zeros when row->start == 0) is carried
// through the row's tokens in the chunked form and y [T, v_heads * head_dim] written.
__attribute__((visibility("hidden"))) void elk_gdn_delta_rows(
    const elk_gdn_shape *shape, const elk_row *row, int64_t h, const float *conv,
    const float *z, const float *alpha, const float *beta, const float *dt_bias,
    const float *a, const float *norm, int64_t state_floats, float *state, float *y);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_GATED_DELTA_H

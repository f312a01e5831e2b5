// Mamba-2 over a per-slot state (the library's Mamba2 op: Granite 4.0-H's SSM layers,
// llama.cpp's build_mamba2_layer after its input projection). Three steps per call, each a
// fixed order per output element, so a row's bits do not depend on the rows beside it, on
// how its tokens are split into calls, or on the threads:
//   1. elk_causal_conv_rows (causal_conv.h): the depthwise conv over x | B | C, its bias, SiLU;
//   2. elk_mamba2_scan_rows: per head, the selective scan one token at a time (dt =
//      softplus(dt + dt_bias), decay = exp(dt A), S = S decay + B (x dt), y = C S + D x),
//      then the gate silu(z) y;
//   3. elk_mamba2_norm_rows: per group, the grouped RMSNorm times its weight.
#ifndef EDGE_LLM_KQUANT_MAMBA2_H
#define EDGE_LLM_KQUANT_MAMBA2_H

#include <stdint.h>

#include "edge_llm_kquant/causal_conv.h"
#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// Largest head size the op takes (Granite 4.0-H: 64).
#define ELK_MAMBA2_MAX_HEAD 256

// `heads` heads of head_dim each (d_inner = heads * head_dim), `groups` groups of B and C of
// d_state each (heads a multiple of groups; head h reads group h / (heads / groups), as
// ggml_ssm_scan); the conv runs over channels() = d_inner + 2 * groups * d_state (x, B, C)
// with `kernel` positions. A slot's state is (kernel - 1) * channels floats of conv inputs,
// oldest position first, then heads * d_state * head_dim floats of SSM state, per head S[n][p]
// (n: state dim, p: head dim; ggml keeps its transpose).
typedef struct {
  int64_t heads, head_dim, groups, d_state, kernel;
  float eps;  // the grouped RMSNorm's epsilon
} elk_mamba2_shape;

// Head h of `row`: conv [T, channels] (step 1's output), z [T, d_inner] (the gate), dt
// [T, heads] (the raw projection), dt_bias, a (= -exp(A_log), as the GGUF stores it) and d
// [heads]; the slot's SSM state (zeros when row->start == 0) is updated token by token and
// y [T, d_inner] = silu(z) * (C S + D x) written, each C S sum from n = 0 up, from 0.0f.
__attribute__((visibility("hidden"))) void elk_mamba2_scan_rows(
    const elk_mamba2_shape *shape, const elk_row *row, int64_t h, const float *conv,
    const float *z, const float *dt, const float *dt_bias, const float *a, const float *d,
    int64_t state_floats, float *state, float *y);

// Group g of `row`'s tokens in y [T, d_inner], in place: RMSNorm over the group's
// d_inner / groups values (squares summed in double, in order, as ggml_rms_norm) times
// norm [d_inner].
__attribute__((visibility("hidden"))) void elk_mamba2_norm_rows(
    const elk_mamba2_shape *shape, const elk_row *row, int64_t g, const float *norm, float *y);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_MAMBA2_H

// Causal attention over a KV buffer, one query row at a time (the library's CausalAttention
// op). Each query row is computed by the same code in the same order whatever the number of
// rows beside it, so a position's result does not depend on how many positions one call
// runs: a verify pass over k+1 positions gives each the bits k+1 single-position calls give
// (speculative decoding checks drafts on that promise). elk_attention_row is the scalar
// reference, one query; elk_attention_block (what the op runs) does each query's same
// operations in the same order for a block of queries and heads sharing tiles of K and V,
// so it gives the reference's bits (native/tests/attention_check). Compiled without fused
// multiply-adds; on x86-64 an AVX2 clone, chosen at load, gives the same bits.
// Internal to the op library (hidden): its calls bind inside it, never to another copy.
#ifndef EDGE_LLM_KQUANT_ATTENTION_H
#define EDGE_LLM_KQUANT_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "edge_llm_kquant/ref.h"
#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// The shape of one call: num_heads query heads sharing kv_heads KV heads of head_dim values,
// over KV buffers of capacity positions per (slot, kv head).
typedef struct {
  int64_t num_heads, kv_heads, head_dim, capacity;
  float scale;        // multiplies q.k
  int64_t window;     // > 0: a query sees the last `window` keys, itself included; 0: all
  // Per-head RMSNorm weights [head_dim] of the queries and the new keys, applied before the
  // rotary (qwen3's and gemma3's q_norm / k_norm, as llama.cpp's ggml_rms_norm then the
  // weight); nullptr: none. norm_eps is the norm's epsilon.
  const float *q_norm, *k_norm;
  float norm_eps;
  // 0: cos/sin row p rotates KV position p. 1: cos/sin hold one row per packed token of the
  // call (token offset + s), for positions other than the KV index (M-RoPE: the graph
  // gathered each token's t/h/w sections).
  int64_t rope_per_token;
} elk_attention_shape;

// Normalize (k_norm, when set) and rotate the new keys of `row` (half-split rotary from
// cos/sin rows [position, head_dim / 2]) and write them and the values into the buffers'
// slot at its positions, for kv head h (one task: rows x kv_heads of them).
// k, v: packed tokens [T, kv_heads * head_dim] with row stride kv_stride floats (packed QKV
// passes its own); buffers [N, kv_heads, capacity, head_dim].
__attribute__((visibility("hidden"))) void elk_attention_store(
    const elk_attention_shape *shape, const elk_row *row, int64_t h, const float *k,
    const float *v, int64_t kv_stride, const float *cos, const float *sin, float *key_buffer,
    float *value_buffer);

// out[row->offset + s, h * head_dim ..] for the row's token s and head h: q_norm (when set)
// and rotary on q, softmax(q.K^T x scale) over the positions it sees (causal, or its whole
// row when bidirectional; windowed) times V, in position order.
// q: packed tokens [T, ...] with row stride q_stride floats; scratch: capacity floats.
__attribute__((visibility("hidden"))) void elk_attention_row(
    const elk_attention_shape *shape, const elk_row *row, int64_t s, int64_t h,
    const float *q, int64_t q_stride, const float *cos, const float *sin,
    const float *key_buffer, const float *value_buffer, float *scratch, float *out);

// elk_attention_row for the row's tokens s_begin .. s_end - 1 and heads h_begin .. h_end - 1
// of one KV head's group, with the same bits per (token, head), walking the keys and values
// in tiles shared by all of them (a long context's K and V read once per block, not once per
// query). scratch: elk_attention_block_scratch(shape, row, s_begin, s_end, h_end - h_begin)
// floats.
__attribute__((visibility("hidden"))) void elk_attention_block(
    const elk_attention_shape *shape, const elk_row *row, int64_t s_begin, int64_t s_end,
    int64_t h_begin, int64_t h_end, const float *q, int64_t q_stride, const float *cos,
    const float *sin, const float *key_buffer, const float *value_buffer, float *scratch,
    float *out);
__attribute__((visibility("hidden"))) int64_t elk_attention_block_scratch(
    const elk_attention_shape *shape, const elk_row *row, int64_t s_begin, int64_t s_end,
    int64_t heads);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_ATTENTION_H

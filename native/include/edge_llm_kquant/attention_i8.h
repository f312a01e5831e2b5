// Causal attention over an int8 KV buffer (kv.dtype int8, issue 39): each (slot, KV head,
// position) row of head_dim keys or values is int8 with one float32 scale, max|x| / 127 (the
// session snapshots' format: a snapshot is a plain copy of these rows). New keys and values
// are quantized as they are stored. A query row is normed and rotated as attention.h's, then
// quantized the same way (one scale per head row); its scores are exact integer dots q8 . k8
// times (q_scale x scale) x k_scale, its softmax attention.h's, and its output sums
// (p x v_scale) x v8 over positions in ascending order. The integer dots are exact, so every
// instruction set (scalar, AVX2, AVX-512 VNNI, NEON dotprod) gives the same bits, and as in
// attention.h a row's bits do not depend on its batch or chunk (decode equals verify).
// Internal to the op library (hidden), like attention.h.
#ifndef EDGE_LLM_KQUANT_ATTENTION_I8_H
#define EDGE_LLM_KQUANT_ATTENTION_I8_H

#include <stddef.h>
#include <stdint.h>

#include "edge_llm_kquant/attention.h"
#include "edge_llm_kquant/row.h"

#ifdef __cplusplus
extern "C" {
#endif

// The int8 KV buffers: keys and values [N, kv_heads, capacity, head_dim] int8, their scales
// [N, kv_heads, capacity] float32 (one per row).
typedef struct {
  int8_t *keys, *values;
  float *key_scales, *value_scales;
} elk_kv_i8;

// out[j] = a . b_j over n int8 values, for the `count` rows b_j = b + j x n: exact int32 sums
// (|a|, |b| <= 127 and n <= 512: no overflow, no saturation on any path).
typedef void (*elk_i8_dots_fn)(const int8_t *a, const int8_t *b, int64_t n, int64_t count,
                               int32_t *out);

// The dots of an instruction set: "scalar", "avx2", "avx512_vnni", "neon_dotprod"; nullptr
// when this build or CPU lacks it.
__attribute__((visibility("hidden"))) elk_i8_dots_fn elk_i8_dots(const char *isa);
// The best instruction set this CPU has for them (what the op runs unless the library is
// pinned to the scalar kernels).
__attribute__((visibility("hidden"))) const char *elk_i8_dots_best(void);

// Symmetric int8 of n values, one scale: max|x| / 127 (x / scale rounded to nearest even,
// clamped to +-127; a zero row has scale 0 and zeros). NumPy's kv_cache.quantize_int8 bits.
__attribute__((visibility("hidden"))) float elk_quantize_i8(const float *x, int64_t n,
                                                            int8_t *q);

// elk_attention_store into int8 buffers: the normed, rotated keys and the values of `row`,
// quantized per row, for kv head h.
__attribute__((visibility("hidden"))) void elk_attention_store_i8(
    const elk_attention_shape *shape, const elk_row *row, int64_t h, const float *k,
    const float *v, int64_t kv_stride, const float *cos, const float *sin,
    const elk_kv_i8 *kv);

// elk_attention_row over int8 buffers (the per-query reference). scratch: capacity floats
// plus capacity int32 (elk_attention_row_i8_scratch bytes).
__attribute__((visibility("hidden"))) void elk_attention_row_i8(
    const elk_attention_shape *shape, const elk_row *row, int64_t s, int64_t h,
    const float *q, int64_t q_stride, const float *cos, const float *sin,
    const elk_kv_i8 *kv, elk_i8_dots_fn dots, void *scratch, float *out);
__attribute__((visibility("hidden"))) size_t elk_attention_row_i8_scratch(
    const elk_attention_shape *shape);

// elk_attention_row_i8 for tokens s_begin .. s_end - 1 and heads h_begin .. h_end - 1 of one
// KV head's group, walking the keys and values in tiles shared by all of them: the same bits
// per (token, head). scratch: elk_attention_block_i8_scratch bytes.
__attribute__((visibility("hidden"))) void elk_attention_block_i8(
    const elk_attention_shape *shape, const elk_row *row, int64_t s_begin, int64_t s_end,
    int64_t h_begin, int64_t h_end, const float *q, int64_t q_stride, const float *cos,
    const float *sin, const elk_kv_i8 *kv, elk_i8_dots_fn dots, void *scratch, float *out);
__attribute__((visibility("hidden"))) size_t elk_attention_block_i8_scratch(
    const elk_attention_shape *shape, const elk_row *row, int64_t s_begin, int64_t s_end,
    int64_t heads);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_ATTENTION_I8_H

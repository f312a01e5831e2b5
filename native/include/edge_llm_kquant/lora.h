// LoRA adapters applied per row beside the K-quant product (issue 43): y += s * B * (A * x),
// never merged into the weights. Gathered per row, as punica / S-LoRA do: each row of a call
// names its own adapters and scales, and a row's bits depend on its own inputs only.
//
// Two steps per (row, adapter pair): shrink u[q] = sum_i x[i] * At[i][q] (At = A transposed,
// [k, r] row-major) and expand t[j] = sum_q u[q] * Bt[q][j] (Bt = B transposed, [r, n]); the
// row's delta is d[j] += s * t[j], with s llama.cpp's scale (s * alpha / rank, or s without an
// alpha). Each sum runs in index order, one product then one add per step (no fused
// multiply-add), so every ISA path (avx2.cpp, avx512.cpp: lanes across q or j) gives the
// scalar reference's bits. A row with no adapter (or scale 0) is not touched.
//
// A and B are kept in the type the adapter file had when it widens to float32 exactly (F16,
// BF16: half the bytes of float32, and the delta path is bound by reading them); the kernels
// widen each element as they load it (F16C / a 16-bit shift), so the sums see the same floats
// and give the same bits as with float32 storage.
//
// The registry: adapter pairs per op node (the graph's KQuantMatMul name, e.g.
// "layers.3.attn.q_proj"), each a segment of the node's output columns (a fused qkv or
// gate|up node holds one per part); and the current call's table of which rows use which
// adapters (set before a session run, cleared after). The op reads both.
#ifndef EDGE_LLM_KQUANT_LORA_H
#define EDGE_LLM_KQUANT_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "edge_llm_kquant/ref.h"

#ifdef __cplusplus
extern "C" {
#endif

// The element types of At and Bt.
enum { ELK_LORA_F32 = 0, ELK_LORA_F16 = 1, ELK_LORA_BF16 = 2 };

// For every row m < rows with scales[m] != 0: y[m * n + j] += scales[m] * t[j], t the row's
// expand of its shrink (x [rows, k], At [k, r], Bt [r, n]). With the selected kernels
// (elk_select_kernel). Returns 0, or -1 for a bad shape.
// At and Bt are of element type `type` (ELK_LORA_*).
ELK_API int elk_lora_apply_typed(const float *x, int64_t rows, int64_t k, const void *a_t,
                                 int64_t r, const void *b_t, int64_t n, int type,
                                 const float *scales, float *y);

// Register adapter `adapter` (an id the caller chooses, > 0) on op node `node`: At [k, r] and
// Bt [r, n_seg] (copied), for output columns [col, col + n_seg) of the node's W rows; alpha
// and rank give llama.cpp's scale (alpha 0: the goal's scale as is). At and Bt are of
// element type `type` (ELK_LORA_*). Returns 0, or -1 (a bad argument or an unknown type).
ELK_API int elk_lora_add_typed(const char *node, int64_t adapter, int64_t k, int64_t r,
                               const void *a_t, int64_t n_seg, const void *b_t, int64_t col,
                               float alpha, int type);
// Drop every pair of `adapter`; returns how many were dropped.
ELK_API int64_t elk_lora_remove(int64_t adapter);
// Pairs registered, over all nodes and adapters.
ELK_API int64_t elk_lora_pairs(void);

// The next session run's rows: row m (a packed position) uses adapters ids[e] with scales
// scales[e] for e in [offsets[m], offsets[m + 1]). rows 0 clears the table (the base model
// runs untouched). The op refuses a call whose row count differs from a set table's.
ELK_API int elk_lora_set_rows(int64_t rows, const int64_t *offsets, const int64_t *ids,
                              const float *scales);

#ifdef __cplusplus
}
#endif

#endif  // EDGE_LLM_KQUANT_LORA_H

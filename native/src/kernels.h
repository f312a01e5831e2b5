// One dot-product kernel per weight type and instruction set: a row of GGUF blocks times
// the activations ggml pairs it with (Q8_K for the K types, Q8_0 / Q8_1 for the legacy ones).
// Every kernel computes the reference's integer sums exactly and then the same float
// expression per (super-)block, so all ISA paths give the reference's bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "blocks.h"
#include "edge_llm_kquant/attention_i8.h"
#include "edge_llm_kquant/lora.h"

namespace elk {

using DotFn = float (*)(const void *x, const BlockQ8_K *y, int64_t blocks);
// Legacy types: x a row of 32-weight blocks, y its Q8_0 (Q4_0/Q5_0/Q8_0) or Q8_1 (Q4_1/Q5_1)
// activation blocks.
using LegacyDotFn = float (*)(const void *x, const void *y, int64_t blocks);

struct DotKernels {
  const char *isa;
  DotFn q4_K, q5_K, q6_K;
  // A null entry runs the scalar reference's (same bits).
  LegacyDotFn q4_0 = nullptr, q4_1 = nullptr, q5_0 = nullptr, q5_1 = nullptr, q8_0 = nullptr;
};

const DotKernels &scalar_kernels();
// nullptr when the library was built without that file (another architecture).
const DotKernels *avx2_kernels();
const DotKernels *avx512_vnni_kernels();
const DotKernels *amx_kernels();  // avx512_vnni's dots under AMX's name: AMX adds batches only
const DotKernels *neon_kernels();
const DotKernels *neon_dotprod_kernels();
const DotKernels *neon_i8mm_kernels();

// *out = dot of n weights of `type` (row x) and its activations y with the kernels k (a null
// legacy entry runs the reference's). Returns 0, or -1 for another type or partial blocks.
int elk_vec_dot_with(const DotKernels &k, int type, int64_t n, const void *x, const void *y,
                     float *out);

// Many weight rows times many activation rows: out[i * ldo + j] = the DotFn of weight row j
// (w + j * w_stride) and activation row i (a + i * a_stride bytes of Q8_K blocks), i < m,
// j < n. Each element is the DotFn's float expression over the same super-blocks in the same
// order, so its bits do not depend on m, n, the tile a kernel picks or the threads.
using GemmFn = void (*)(const void *w, size_t w_stride, int64_t n, const void *a,
                        size_t a_stride, int64_t m, int64_t blocks, float *out, int64_t ldo);

// Activations to Q8_K blocks, byte for byte elk_quantize_row_q8_K_ref.
using QuantizeFn = void (*)(const float *x, void *y, int64_t k);

// The legacy entries take rows of 32-weight blocks and their Q8_0 / Q8_1 activation rows
// (blocks = K / 32); a null entry runs the ISA's LegacyDotFn element by element.
struct GemmKernels {
  const char *isa;
  GemmFn q4_K, q5_K, q6_K;
  QuantizeFn quantize_q8_K;
  GemmFn q4_0 = nullptr, q4_1 = nullptr, q5_0 = nullptr, q5_1 = nullptr, q8_0 = nullptr;
  // Activations to Q8_0 / Q8_1 blocks, byte for byte elk_quantize_row_ref's (k a multiple
  // of 32); null runs the reference.
  QuantizeFn quantize_q8_0 = nullptr, quantize_q8_1 = nullptr;
};

// The tiled kernels of an ISA, or nullptr where it has none (dispatch.cpp then runs its
// DotKernels element by element: the same bits, without the shared loads).
const GemmKernels *avx2_gemm_kernels();
const GemmKernels *avx512_vnni_gemm_kernels();
const GemmKernels *amx_gemm_kernels();
const GemmKernels *neon_gemm_kernels();
const GemmKernels *neon_dotprod_gemm_kernels();
const GemmKernels *neon_i8mm_gemm_kernels();

// The float part every kernel shares: one super-block's integer sums (as F) to its
// contribution. A template so that a SIMD path runs this very expression on a vector of rows
// (GCC/Clang vector types, lane by lane, unfused under -ffp-contract=off; as legacy_block).
template <typename F>
inline F k_block_lanes(F d, F dmin, F dy, F dots, F mins) {
  return d * dy * dots - dmin * dy * mins;
}

inline float k_block(float d, float dmin, float dy, int32_t dots, int32_t mins) {
  return k_block_lanes(d, dmin, dy, static_cast<float>(dots), static_cast<float>(mins));
}

// The float part of a legacy block of 32: (dx * dy) * sum, with dx, dy its fp16 scales as
// floats and sum the block's exact integer dot. A template so that a SIMD path runs this very
// expression on a vector of blocks (GCC/Clang vector types have * and +, lane by lane, IEEE
// like the scalar ops; -ffp-contract=off keeps it unfused); blocks are then added in order.
template <typename F>
inline F legacy_block(F dx, F dy, F sum) {
  return dx * dy * sum;
}

// Q4_1/Q5_1 x Q8_1: plus the weight's min times the activations' s (= d * sum of their qs).
template <typename F>
inline F legacy_block_min(F dx, F dy, F sum, F m, F s) {
  return dx * dy * sum + m * s;
}

// One legacy block's term from its exact integer sum, in the scalar form (ref.cpp's, and any
// SIMD path's for blocks it does not vectorize): Q8_0 activations, or Q8_1 with the min.
template <typename W>
inline float legacy_term(const W &x, const BlockQ8_0 &y, int32_t sum) {
  return legacy_block(fp16_to_fp32(x.d), fp16_to_fp32(y.d), static_cast<float>(sum));
}

template <typename W>
inline float legacy_term(const W &x, const BlockQ8_1 &y, int32_t sum) {
  return legacy_block_min(fp16_to_fp32(x.d), fp16_to_fp32(y.d), static_cast<float>(sum),
                          fp16_to_fp32(x.m), fp16_to_fp32(y.s));
}

// Sum of min * (activation sums of its 32 weights) over the 8 sub-blocks of a Q4_K/Q5_K block.
inline int32_t k_mins(const uint8_t *scales, const int16_t *bsums) {
  int32_t mins = 0;
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t sc, m;
    scale_min_k4(sub, scales, &sc, &m);
    mins += m * (bsums[2 * sub] + bsums[2 * sub + 1]);
  }
  return mins;
}

}  // namespace elk

// ---- LoRA (edge_llm_kquant/lora.h, lora.cpp) ------------------------------------------------
namespace elk {
// shrink: u[q] = sum_i x[i] * At[i * r + q]; expand: t[j] = sum_q u[q] * Bt[q * ldb + j] for
// j < n (ldb: Bt's row stride in elements, >= n: a block of columns of a wider Bt); each sum
// from 0 in index order, a product then an add: an ISA path runs lanes across q or j, and a
// column's value does not depend on the block it is computed in. At and Bt hold elements of
// `type` (ELK_LORA_F32 / F16 / BF16, lora.h): F16 and BF16 widen to float32 exactly
// (lora_value), so the sums see the same floats whatever the storage.
inline float lora_value(const void *p, int type, int64_t i) {
  if (type == ELK_LORA_F32) return static_cast<const float *>(p)[i];
  const uint16_t h = static_cast<const uint16_t *>(p)[i];
  if (type == ELK_LORA_F16) return fp16_to_fp32(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;  // BF16: float32's upper half
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline size_t lora_type_bytes(int type) { return type == ELK_LORA_F32 ? 4 : 2; }
using LoraShrinkFn = void (*)(const float *x, const void *a_t, int type, int64_t k, int64_t r,
                              float *u);
using LoraExpandFn = void (*)(const float *u, const void *b_t, int type, int64_t r, int64_t n,
                              int64_t ldb, float *t);
struct LoraKernels {
  const char *isa;
  LoraShrinkFn shrink;
  LoraExpandFn expand;
};
const LoraKernels &scalar_lora_kernels();
const LoraKernels *avx2_lora_kernels();    // nullptr: not built (another architecture)
const LoraKernels *avx512_lora_kernels();
const LoraKernels &selected_lora();         // the selected dot kernels' ISA (or the reference)
// Whether the current call's row table names any adapter (the op's base path reads only this).
bool lora_active();
// Runs fn(data, task) for every task < tasks, on any threads (the op's: ONNX Runtime's
// intra-op pool); nullptr runs them in order on the calling thread.
using ParallelForFn = void (*)(void *context, void (*fn)(void *, size_t), size_t tasks,
                               void *data);
// The deltas [rows, n_w] of `node`'s output for this call's rows (used[m]: row m has one).
// Two parallel steps over `parallel_for`: the shrinks (one task per row and pair), then the
// expands by blocks of columns of one row; each value is computed by one task, in the order
// the single-thread run takes, so the bits do not depend on the threads.
// Returns 1 (deltas written), 0 (no row of this call adapts the node), -1 (error set).
int lora_deltas(const char *node, const float *x, int64_t rows, int64_t k, int64_t n_w,
                std::vector<float> *delta, std::vector<uint8_t> *used, std::string *error,
                ParallelForFn parallel_for = nullptr, void *context = nullptr);
// ---- int8 dots of attention over an int8 KV cache (attention_i8.cpp) ---------------------
// The scalar reference (i8_dot.cpp), also the ISA paths' tail; each ISA file's dots, nullptr
// when that file is not built (another architecture).
void i8_dots_scalar(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out);
elk_i8_dots_fn avx2_i8_dots();
elk_i8_dots_fn avx512_vnni_i8_dots();
elk_i8_dots_fn neon_dotprod_i8_dots();

}  // namespace elk

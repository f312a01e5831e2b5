// One dot-product kernel per weight type and instruction set: a row of GGUF blocks times
// Q8_K activations. Every kernel computes the reference's integer sums exactly and then the
// same float expression per super-block, so all ISA paths give the reference's bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "blocks.h"

namespace elk {

using DotFn = float (*)(const void *x, const BlockQ8_K *y, int64_t blocks);

struct DotKernels {
  const char *isa;
  DotFn q4_K, q5_K, q6_K;
};

const DotKernels &scalar_kernels();
// nullptr when the library was built without that file (another architecture).
const DotKernels *avx2_kernels();
const DotKernels *neon_kernels();
const DotKernels *neon_dotprod_kernels();

// Many weight rows times many activation rows: out[i * ldo + j] = the DotFn of weight row j
// (w + j * w_stride) and activation row i (a + i * a_stride bytes of Q8_K blocks), i < m,
// j < n. Each element is the DotFn's float expression over the same super-blocks in the same
// order, so its bits do not depend on m, n, the tile a kernel picks or the threads.
using GemmFn = void (*)(const void *w, size_t w_stride, int64_t n, const void *a,
                        size_t a_stride, int64_t m, int64_t blocks, float *out, int64_t ldo);

// Activations to Q8_K blocks, byte for byte elk_quantize_row_q8_K_ref.
using QuantizeFn = void (*)(const float *x, void *y, int64_t k);

struct GemmKernels {
  const char *isa;
  GemmFn q4_K, q5_K, q6_K;
  QuantizeFn quantize_q8_K;
};

// The tiled kernels of an ISA, or nullptr where it has none (dispatch.cpp then runs its
// DotKernels element by element: the same bits, without the shared loads).
const GemmKernels *avx2_gemm_kernels();

// The float part every kernel shares: one super-block's integer sums to its contribution.
inline float k_block(float d, float dmin, float dy, int32_t dots, int32_t mins) {
  return d * dy * static_cast<float>(dots) - dmin * dy * static_cast<float>(mins);
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

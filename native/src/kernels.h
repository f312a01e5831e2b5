// One dot-product kernel per weight type and instruction set: a row of GGUF blocks times
// Q8_K activations. Every kernel computes the reference's integer sums exactly and then the
// same float expression per super-block, so all ISA paths give the reference's bits.
#pragma once

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

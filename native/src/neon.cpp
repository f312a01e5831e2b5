// NEON kernels for any Armv8-A core (Cortex-A53 and up): vmull_s8 + vpadalq_s16.
#include "neon_impl.h"

namespace elk {

const DotKernels *neon_kernels() {
  static const DotKernels kernels = neon::table<neon::MullDot>("neon");
  return &kernels;
}

const GemmKernels *neon_gemm_kernels() {
  static const GemmKernels kernels = neon::gemm_table<neon::MullDot>("neon");
  return &kernels;
}

}  // namespace elk

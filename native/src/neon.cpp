// NEON kernels for any Armv8-A core (Cortex-A53 and up): vmull_s8 + vpadalq_s16.
#include "neon_impl.h"

namespace elk {

const DotKernels *neon_kernels() {
  // Q5_K has no NEON kernel yet: the reference runs it (same bits, slower).
  static const DotKernels kernels{"neon", neon::dot_q4_K<neon::MullDot>, scalar_kernels().q5_K,
                                  neon::dot_q6_K<neon::MullDot>};
  return &kernels;
}

}  // namespace elk

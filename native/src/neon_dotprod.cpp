// NEON kernels for Armv8.2-A cores with dotprod (Cortex-A76/A78, Neoverse): vdotq_s32.
// Built with +dotprod for this file only; dispatch.cpp calls it only when HWCAP says so.
#include "neon_impl.h"

namespace elk {

using neon::DotProd;

const DotKernels *neon_dotprod_kernels() {
  static const DotKernels kernels = neon::table<DotProd>("neon_dotprod");
  return &kernels;
}

const GemmKernels *neon_dotprod_gemm_kernels() {
  static const GemmKernels kernels = neon::gemm_table<DotProd>("neon_dotprod");
  return &kernels;
}

}  // namespace elk

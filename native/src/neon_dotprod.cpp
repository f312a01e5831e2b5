// NEON kernels for Armv8.2-A cores with dotprod (Cortex-A76/A78, Neoverse): vdotq_s32.
// Built with +dotprod for this file only; dispatch.cpp calls it only when HWCAP says so.
#include "neon_impl.h"

namespace elk {
namespace {

struct DotProd {
  static int32x4_t dot(int32x4_t acc, uint8x16_t w, int8x16_t a) {
    return vdotq_s32(acc, vreinterpretq_s8_u8(w), a);
  }
};

}  // namespace

const DotKernels *neon_dotprod_kernels() {
  static const DotKernels kernels = neon::table<DotProd>("neon_dotprod");
  return &kernels;
}

}  // namespace elk

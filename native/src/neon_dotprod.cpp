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

// ---- int8 dots (attention_i8): vdotq_s32, one key at a time -----------------------------------
namespace {
void i8_dots_dotprod(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
  const int64_t body = n & ~int64_t{15};
  for (int64_t j = 0; j < count; ++j) {
    const int8_t *k = b + j * n;
    int32x4_t acc = vdupq_n_s32(0);
    for (int64_t i = 0; i < body; i += 16) acc = vdotq_s32(acc, vld1q_s8(a + i), vld1q_s8(k + i));
    int32_t sum = vaddvq_s32(acc);
    for (int64_t i = body; i < n; ++i) sum += static_cast<int32_t>(a[i]) * k[i];
    out[j] = sum;
  }
}
}  // namespace

elk_i8_dots_fn neon_dotprod_i8_dots() { return i8_dots_dotprod; }

}  // namespace elk

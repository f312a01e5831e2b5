// Which kernels run: chosen once from the CPU's features at run time (never the build
// machine's), or pinned by name; an unsupported pin is refused, naming what the CPU has.
#include <cstring>
#include <string>

#include "edge_llm_kquant/ref.h"
#include "kernels.h"

namespace elk {
#ifndef ELK_HAVE_AVX2
const DotKernels *avx2_kernels() { return nullptr; }
#endif

namespace {

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const DotKernels *best() {
  if (cpu_has_avx2_fma() && avx2_kernels() != nullptr) return avx2_kernels();
  return &scalar_kernels();
}

const DotKernels *&selected() {
  static const DotKernels *kernels = best();
  return kernels;
}

}  // namespace
}  // namespace elk

using namespace elk;

extern "C" const char *elk_kernel_name(void) { return selected()->isa; }

extern "C" const char *elk_cpu_features(void) {
  static const std::string features = std::string(cpu_has_avx2_fma() ? "avx2 fma" : "");
  return features.c_str();
}

extern "C" int elk_select_kernel(const char *isa) {
  if (std::strcmp(isa, "auto") == 0) {
    selected() = best();
    return 0;
  }
  if (std::strcmp(isa, "scalar") == 0) {
    selected() = &scalar_kernels();
    return 0;
  }
  if (std::strcmp(isa, "avx2") == 0 && avx2_kernels() != nullptr && cpu_has_avx2_fma()) {
    selected() = avx2_kernels();
    return 0;
  }
  return -1;
}

extern "C" int elk_vec_dot_q8_K(int type, int64_t n, const void *x, const void *y, float *out) {
  if (n % QK_K != 0) return -1;
  const auto *a = static_cast<const BlockQ8_K *>(y);
  const DotKernels *k = selected();
  switch (type) {
    case ELK_Q4_K: *out = k->q4_K(x, a, n / QK_K); return 0;
    case ELK_Q5_K: *out = k->q5_K(x, a, n / QK_K); return 0;
    case ELK_Q6_K: *out = k->q6_K(x, a, n / QK_K); return 0;
    default: return -1;
  }
}

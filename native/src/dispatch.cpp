// Which kernels run: chosen once from the CPU's features at run time (never the build
// machine's), or pinned by name; an unsupported pin is refused, naming what the CPU has.
#include <atomic>
#include <cstring>
#include <string>

#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#include "edge_llm_kquant/ref.h"
#include "kernels.h"

namespace elk {
#ifndef ELK_HAVE_AVX2
const DotKernels *avx2_kernels() { return nullptr; }
#endif
#ifndef ELK_HAVE_NEON
const DotKernels *neon_kernels() { return nullptr; }
const DotKernels *neon_dotprod_kernels() { return nullptr; }
#endif

namespace {

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_dotprod() {
#if defined(__aarch64__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return false;
#endif
}

// A kernel set by name, if this build has it and this CPU can run it.
const DotKernels *usable(const char *isa) {
  if (std::strcmp(isa, "scalar") == 0) return &scalar_kernels();
  if (std::strcmp(isa, "avx2") == 0 && cpu_has_avx2_fma()) return avx2_kernels();
  if (std::strcmp(isa, "neon") == 0) return neon_kernels();  // every aarch64 core has NEON
  if (std::strcmp(isa, "neon_dotprod") == 0 && cpu_has_dotprod()) return neon_dotprod_kernels();
  return nullptr;
}

const DotKernels *best() {
  for (const char *isa : {"avx2", "neon_dotprod", "neon"}) {
    if (const DotKernels *k = usable(isa)) return k;
  }
  return &scalar_kernels();
}

// Atomic: a pin from one thread while a session computes on others reads one table or the
// other, never a torn pointer (each table gives the same bits anyway).
std::atomic<const DotKernels *> &selected() {
  static std::atomic<const DotKernels *> kernels{best()};
  return kernels;
}

}  // namespace
}  // namespace elk

using namespace elk;

extern "C" const char *elk_kernel_name(void) { return selected().load()->isa; }

extern "C" const char *elk_cpu_features(void) {
#if defined(__aarch64__)
  static const std::string features = cpu_has_dotprod() ? "neon dotprod" : "neon";
#else
  static const std::string features = cpu_has_avx2_fma() ? "avx2 fma f16c" : "";
#endif
  return features.c_str();
}

extern "C" int elk_select_kernel(const char *isa) {
  const DotKernels *k = std::strcmp(isa, "auto") == 0 ? best() : usable(isa);
  if (k == nullptr) return -1;
  selected().store(k);
  return 0;
}

extern "C" int elk_vec_dot_q8_K(int type, int64_t n, const void *x, const void *y, float *out) {
  if (elk_activation_type(type) != ELK_Q8_K) return -1;
  return elk_vec_dot_with(*selected().load(std::memory_order_relaxed), type, n, x, y, out);
}

extern "C" int elk_vec_dot(int weight_type, int64_t n, const void *x, const void *y,
                           float *out) {
  return elk_vec_dot_with(*selected().load(std::memory_order_relaxed), weight_type, n, x, y,
                          out);
}

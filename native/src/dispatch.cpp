// Which kernels run: chosen once from the CPU's features at run time (never the build
// machine's), or pinned by name; an unsupported pin is refused, naming what the CPU has.
#include <atomic>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

#include "edge_llm_kquant/ref.h"
#include "kernels.h"

namespace elk {
#ifndef ELK_HAVE_AVX2
const DotKernels *avx2_kernels() { return nullptr; }
const GemmKernels *avx2_gemm_kernels() { return nullptr; }
elk_i8_dots_fn avx2_i8_dots() { return nullptr; }
#endif
#ifndef ELK_HAVE_AVX512
const DotKernels *avx512_vnni_kernels() { return nullptr; }
const GemmKernels *avx512_vnni_gemm_kernels() { return nullptr; }
elk_i8_dots_fn avx512_vnni_i8_dots() { return nullptr; }
#endif
#ifndef ELK_HAVE_AMX
const DotKernels *amx_kernels() { return nullptr; }
const GemmKernels *amx_gemm_kernels() { return nullptr; }
#endif
#ifndef ELK_HAVE_NEON
const DotKernels *neon_kernels() { return nullptr; }
const DotKernels *neon_dotprod_kernels() { return nullptr; }
elk_i8_dots_fn neon_dotprod_i8_dots() { return nullptr; }
const GemmKernels *neon_gemm_kernels() { return nullptr; }
const GemmKernels *neon_dotprod_gemm_kernels() { return nullptr; }
const DotKernels *neon_i8mm_kernels() { return nullptr; }
const GemmKernels *neon_i8mm_gemm_kernels() { return nullptr; }
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

// AVX-512 F, BW, VL, DQ with VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later), beside AVX2.
bool cpu_has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// AMX-TILE and AMX-INT8 (Sapphire Rapids and later) beside AVX-512 VNNI and VBMI (every AMX
// CPU has both), and Linux's leave to use the tile state: a process must ask for it
// (arch_prctl ARCH_REQ_XCOMP_PERM, once, for every thread); where the kernel refuses (too old,
// or a VM without the state), no AMX.
bool cpu_has_amx() {
#if defined(__x86_64__)
  static const bool usable = [] {
    if (!cpu_has_avx512_vnni() || !__builtin_cpu_supports("avx512vbmi") ||
        !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
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

// The int8 matrix multiply (SMMLA, Armv8.6), beside dotprod.
bool cpu_has_i8mm() {
#if defined(__aarch64__)
  return cpu_has_dotprod() && (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#else
  return false;
#endif
}

// A kernel set by name, if this build has it and this CPU can run it.
const DotKernels *usable(const char *isa) {
  if (std::strcmp(isa, "scalar") == 0) return &scalar_kernels();
  if (std::strcmp(isa, "avx2") == 0 && cpu_has_avx2_fma()) return avx2_kernels();
  if (std::strcmp(isa, "avx512_vnni") == 0 && cpu_has_avx512_vnni()) {
    return avx512_vnni_kernels();
  }
  if (std::strcmp(isa, "amx") == 0 && cpu_has_amx()) return amx_kernels();
  if (std::strcmp(isa, "neon") == 0) return neon_kernels();  // every aarch64 core has NEON
  if (std::strcmp(isa, "neon_dotprod") == 0 && cpu_has_dotprod()) return neon_dotprod_kernels();
  if (std::strcmp(isa, "neon_i8mm") == 0 && cpu_has_i8mm()) return neon_i8mm_kernels();
  return nullptr;
}

const DotKernels *best() {
  for (const char *isa : {"amx", "avx512_vnni", "avx2", "neon_i8mm", "neon_dotprod", "neon"}) {
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

// The tiled kernels that go with the selected dots, or nullptr: run those dots per element.
// Matched by name: calling another ISA's table function may run that ISA's instructions
// (amx_kernels() builds its table in code compiled for AVX-512), which this CPU may lack:
// with the scalar set pinned on an AVX2-only CPU, comparing against amx_kernels() was SIGILL.
const GemmKernels *selected_gemm() {
  const DotKernels *k = selected();
  if (k == nullptr) return nullptr;
  const char *isa = k->isa;
  if (std::strcmp(isa, "avx2") == 0) return avx2_gemm_kernels();
  if (std::strcmp(isa, "avx512_vnni") == 0) return avx512_vnni_gemm_kernels();
  if (std::strcmp(isa, "amx") == 0) return amx_gemm_kernels();
  if (std::strcmp(isa, "neon") == 0) return neon_gemm_kernels();
  if (std::strcmp(isa, "neon_dotprod") == 0) return neon_dotprod_gemm_kernels();
  if (std::strcmp(isa, "neon_i8mm") == 0) return neon_i8mm_gemm_kernels();
  return nullptr;
}

// Where an ISA has no tiled kernels: one dot per element, the same bits.
template <typename Dot, typename Act>
void gemm_by_dots(Dot dot, const void *w, size_t ws, int64_t n, const void *a, size_t as,
                  int64_t m, int64_t nb, float *out, int64_t ldo) {
  const auto *wb = static_cast<const uint8_t *>(w);
  const auto *ab = static_cast<const uint8_t *>(a);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      out[i * ldo + j] = dot(wb + j * ws, reinterpret_cast<const Act *>(ab + i * as), nb);
    }
  }
}

}  // namespace
}  // namespace elk

using namespace elk;

extern "C" const char *elk_kernel_name(void) { return selected().load()->isa; }

extern "C" const char *elk_cpu_features(void) {
#if defined(__aarch64__)
  static const std::string features = std::string(cpu_has_dotprod() ? "neon dotprod" : "neon") +
                                       (cpu_has_i8mm() ? " i8mm" : "");
#else
  static const std::string features =
      std::string(cpu_has_avx2_fma() ? "avx2 fma f16c" : "") +
      (cpu_has_avx512_vnni() ? " avx512f avx512bw avx512vl avx512dq avx512vnni" : "") +
      (cpu_has_amx() ? " amx_tile amx_int8" : "");
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

extern "C" int elk_gemm(int type, int64_t k, const void *w, size_t w_stride, int64_t n,
                        const void *a, size_t a_stride, int64_t m, float *out, int64_t ldo) {
  const int per = elk_block_weights(type);
  if (per == 0 || elk_activation_type(type) < 0 || k < 0 || k % per != 0 || n < 0 || m < 0 ||
      ldo < n) {
    return -1;
  }
  const int64_t nb = k / per;
  const DotKernels *dots = selected();
  const DotKernels &scalar = scalar_kernels();
  const GemmKernels *tiles = selected_gemm();
  DotFn dot = nullptr;
  LegacyDotFn legacy = nullptr;
  GemmFn gemm = nullptr;
  switch (type) {
    case ELK_Q4_K: dot = dots->q4_K; gemm = tiles ? tiles->q4_K : nullptr; break;
    case ELK_Q5_K: dot = dots->q5_K; gemm = tiles ? tiles->q5_K : nullptr; break;
    case ELK_Q6_K: dot = dots->q6_K; gemm = tiles ? tiles->q6_K : nullptr; break;
    case ELK_Q4_0:
      legacy = dots->q4_0 ? dots->q4_0 : scalar.q4_0; gemm = tiles ? tiles->q4_0 : nullptr;
      break;
    case ELK_Q4_1:
      legacy = dots->q4_1 ? dots->q4_1 : scalar.q4_1; gemm = tiles ? tiles->q4_1 : nullptr;
      break;
    case ELK_Q5_0:
      legacy = dots->q5_0 ? dots->q5_0 : scalar.q5_0; gemm = tiles ? tiles->q5_0 : nullptr;
      break;
    case ELK_Q5_1:
      legacy = dots->q5_1 ? dots->q5_1 : scalar.q5_1; gemm = tiles ? tiles->q5_1 : nullptr;
      break;
    case ELK_Q8_0:
      legacy = dots->q8_0 ? dots->q8_0 : scalar.q8_0; gemm = tiles ? tiles->q8_0 : nullptr;
      break;
    default: return -1;
  }
  if (m == 0 || n == 0) return 0;
  if (gemm != nullptr) {
    gemm(w, w_stride, n, a, a_stride, m, nb, out, ldo);
  } else if (dot != nullptr) {
    gemm_by_dots<DotFn, BlockQ8_K>(dot, w, w_stride, n, a, a_stride, m, nb, out, ldo);
  } else {
    gemm_by_dots<LegacyDotFn, void>(legacy, w, w_stride, n, a, a_stride, m, nb, out, ldo);
  }
  return 0;
}

extern "C" int elk_gemm_q8_K(int type, int64_t k, const void *w, size_t w_stride, int64_t n,
                             const void *a, size_t a_stride, int64_t m, float *out,
                             int64_t ldo) {
  if (elk_activation_type(type) != ELK_Q8_K) return -1;
  return elk_gemm(type, k, w, w_stride, n, a, a_stride, m, out, ldo);
}

extern "C" int elk_quantize_row(int activation_type, const float *x, void *y, int64_t k) {
  const GemmKernels *tiles = selected_gemm();
  QuantizeFn fn = nullptr;
  if (tiles != nullptr && k % QK == 0) {
    if (activation_type == ELK_Q8_0) fn = tiles->quantize_q8_0;
    if (activation_type == ELK_Q8_1) fn = tiles->quantize_q8_1;
  }
  if (activation_type == ELK_Q8_K && k % QK_K == 0) {
    elk_quantize_row_q8_K(x, y, k);
    return 0;
  }
  if (fn == nullptr) return elk_quantize_row_ref(activation_type, x, y, k);
  fn(x, y, k);
  return 0;
}

extern "C" void elk_quantize_row_q8_K(const float *x, void *y, int64_t k) {
  const GemmKernels *tiles = selected_gemm();
  if (tiles != nullptr && tiles->quantize_q8_K != nullptr) {
    tiles->quantize_q8_K(x, y, k);
  } else {
    elk_quantize_row_q8_K_ref(x, y, k);
  }
}

// The int8 dots of attention over an int8 KV cache (attention_i8.h), by instruction set.
extern "C" elk_i8_dots_fn elk_i8_dots(const char *isa) {
  if (std::strcmp(isa, "scalar") == 0) return i8_dots_scalar;
  if (std::strcmp(isa, "avx2") == 0 && cpu_has_avx2_fma()) return avx2_i8_dots();
  if (std::strcmp(isa, "avx512_vnni") == 0 && cpu_has_avx512_vnni()) {
    return avx512_vnni_i8_dots();
  }
  if (std::strcmp(isa, "neon_dotprod") == 0 && cpu_has_dotprod()) return neon_dotprod_i8_dots();
  return nullptr;
}

extern "C" const char *elk_i8_dots_best(void) {
  for (const char *isa : {"avx512_vnni", "avx2", "neon_dotprod"}) {
    if (elk_i8_dots(isa) != nullptr) return isa;
  }
  return "scalar";
}

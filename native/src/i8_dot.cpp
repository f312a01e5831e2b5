// int8 dot products of one query row against consecutive key rows (attention_i8.h's
// elk_i8_dots_fn): a scalar reference and one path per instruction set, each compiled for its
// target alone (function attributes) and picked at run time only on a CPU that has it. The
// sums are exact int32 ones (|x| <= 127, n <= 512), so every path gives the reference's bits.
// Signed x signed on x86: the unsigned x signed instructions take |a| and b with a's sign
// (vpsignb), whose products are a x b; maddubs' pair sums stay below 2 x 127 x 127 < 2^15.
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "edge_llm_kquant/attention_i8.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace {

void dots_scalar(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
  for (int64_t j = 0; j < count; ++j) {
    const int8_t *k = b + j * n;
    int32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<int32_t>(a[i]) * k[i];
    out[j] = sum;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ELK_AVX2 __attribute__((target("avx2")))
#define ELK_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")))

// The four int32 sums of 4 accumulators (exact: integer adds in any order).
ELK_AVX2 inline void sum4(__m256i s0, __m256i s1, __m256i s2, __m256i s3, int32_t *out) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
  const __m128i r = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i *>(out), r);
}

ELK_AVX2 inline __m256i load32(const int8_t *p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
}

// acc += the 8 int32 partial sums of a[0..31] x b[0..31] (ax = |a|).
ELK_AVX2 inline __m256i madd_avx2(__m256i acc, __m256i ax, __m256i a, __m256i b) {
  const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(b, a));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

ELK_VNNI inline __m256i madd_vnni(__m256i acc, __m256i ax, __m256i a, __m256i b) {
  return _mm256_dpbusd_epi32(acc, ax, _mm256_sign_epi8(b, a));
}

// Four keys a pass sharing each query load; the last 32-byte-less tail and the last keys
// take the scalar loop (the same exact sums).
#define ELK_DOTS_BODY(MADD)                                                          \
  const int64_t body = n & ~int64_t{31};                                            \
  int64_t j = 0;                                                                    \
  for (; j + 4 <= count; j += 4) {                                                  \
    const int8_t *k = b + j * n;                                                    \
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;                 \
    for (int64_t i = 0; i < body; i += 32) {                                        \
      const __m256i x = load32(a + i), ax = _mm256_sign_epi8(x, x);                  \
      s0 = MADD(s0, ax, x, load32(k + i));                                          \
      s1 = MADD(s1, ax, x, load32(k + n + i));                                      \
      s2 = MADD(s2, ax, x, load32(k + 2 * n + i));                                  \
      s3 = MADD(s3, ax, x, load32(k + 3 * n + i));                                  \
    }                                                                               \
    sum4(s0, s1, s2, s3, out + j);                                                  \
    for (int64_t i = body; i < n; ++i) {                                            \
      for (int r = 0; r < 4; ++r) out[j + r] += static_cast<int32_t>(a[i]) * k[r * n + i]; \
    }                                                                               \
  }                                                                                 \
  dots_scalar(a, b + j * n, n, count - j, out + j);

ELK_AVX2 void dots_avx2(const int8_t *a, const int8_t *b, int64_t n, int64_t count,
                        int32_t *out) {
  ELK_DOTS_BODY(madd_avx2)
}

ELK_VNNI void dots_vnni(const int8_t *a, const int8_t *b, int64_t n, int64_t count,
                        int32_t *out) {
  ELK_DOTS_BODY(madd_vnni)
}
#undef ELK_DOTS_BODY
#endif

#if defined(__aarch64__) && defined(__GNUC__)
__attribute__((target("arch=armv8.2-a+dotprod"))) void dots_dotprod(
    const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
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
#endif

}  // namespace

extern "C" {

elk_i8_dots_fn elk_i8_dots(const char *isa) {
  if (std::strcmp(isa, "scalar") == 0) return dots_scalar;
#if defined(__x86_64__) && defined(__GNUC__)
  if (std::strcmp(isa, "avx2") == 0 && __builtin_cpu_supports("avx2")) return dots_avx2;
  if (std::strcmp(isa, "avx512_vnni") == 0 && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    return dots_vnni;
  }
#endif
#if defined(__aarch64__) && defined(__GNUC__)
  if (std::strcmp(isa, "neon_dotprod") == 0 && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0) {
    return dots_dotprod;
  }
#endif
  return nullptr;
}

const char *elk_i8_dots_best(void) {
  for (const char *isa : {"avx512_vnni", "avx2", "neon_dotprod"}) {
    if (elk_i8_dots(isa) != nullptr) return isa;
  }
  return "scalar";
}

}  // extern "C"

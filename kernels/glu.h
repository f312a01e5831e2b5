// The gated activations KQuantMatMul applies to a fused gate|up product (its `glu`
// attribute): out[j] = act(gate[j]) * up[j], act SiLU (llama, qwen, phi3) or GELU's tanh form
// (gemma). One source for the CPU library (native/src/glu.cpp, built with -ffp-contract=off)
// and the CUDA kernels (kquant.cu, with round-to-nearest intrinsics that are never fused), so
// both give the same bits. exp is this file's own (libm's and CUDA's expf differ in the last
// bit): Cody-Waite range reduction and a degree-6 polynomial, a few ulp from the true value;
// past float's range it gives inf or 0, so a huge negative gate's activation is -0.
// Both activations are g / (1 + exp(-z)): SiLU with z = g; GELU-tanh too, since
// 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)) with u = sqrt(2/pi) g (1 + 0.044715 g^2).
#pragma once

#include <stdint.h>
#include <string.h>

#include <string>

#if defined(__CUDACC__)
#define ELK_GLU_FN __host__ __device__ __forceinline__
#else
#define ELK_GLU_FN inline
#endif

namespace elk {
namespace glu {

enum Kind { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// The KQuantMatMul glu attribute ("" none, "silu", "gelu_tanh") of a weight of n rows (gate
// rows then as many up rows): its kind, or -1 with *error saying what is wrong (both ops).
inline int kind_of_attribute(const std::string &name, int64_t n, std::string *error) {
  const int kind = name.empty()           ? kNone
                   : name == "silu"       ? kSilu
                   : name == "gelu_tanh"  ? kGeluTanh
                                          : -1;
  if (kind < 0) {
    *error = "glu \"" + name + "\" is not \"silu\", \"gelu_tanh\" or empty: reconvert the model";
  } else if (kind != kNone && n % 2 != 0) {
    *error = "a glu needs gate rows then as many up rows, but N " + std::to_string(n) +
             " is odd: reconvert the model";
    return -1;
  }
  return kind;
}

#if defined(__CUDA_ARCH__)
ELK_GLU_FN float mul(float a, float b) { return __fmul_rn(a, b); }
ELK_GLU_FN float add(float a, float b) { return __fadd_rn(a, b); }
ELK_GLU_FN float sub(float a, float b) { return __fsub_rn(a, b); }
ELK_GLU_FN float div(float a, float b) { return __fdiv_rn(a, b); }
ELK_GLU_FN float from_bits(uint32_t u) { return __uint_as_float(u); }
ELK_GLU_FN uint32_t to_bits(float f) { return __float_as_uint(f); }
#else
ELK_GLU_FN float mul(float a, float b) { return a * b; }
ELK_GLU_FN float add(float a, float b) { return a + b; }
ELK_GLU_FN float sub(float a, float b) { return a - b; }
ELK_GLU_FN float div(float a, float b) { return a / b; }
ELK_GLU_FN float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
ELK_GLU_FN uint32_t to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}
#endif

// e^x: +inf above 88.3, 0 below -87.3 (where 2^n would leave the normal floats), a NaN stays NaN.
ELK_GLU_FN float exp_f32(float in) {
  float x = in < -87.3f ? -87.3f : in;
  x = x > 88.3f ? 88.3f : x;
  // n = round(x / ln 2): adding 1.5 * 2^23 rounds to an integer held in the low mantissa bits.
  const float shifted = add(mul(x, 1.44269504f), 12582912.0f);
  const float n = sub(shifted, 12582912.0f);
  const int32_t ni = static_cast<int32_t>(to_bits(shifted) - to_bits(12582912.0f));
  // r = x - n ln 2 in two parts (0.693359375 has few bits: n * it is exact).
  const float r = sub(sub(x, mul(n, 0.693359375f)), mul(n, -2.12194440e-4f));
  float p = 1.0f / 720.0f;
  p = add(mul(p, r), 1.0f / 120.0f);
  p = add(mul(p, r), 1.0f / 24.0f);
  p = add(mul(p, r), 1.0f / 6.0f);
  p = add(mul(p, r), 0.5f);
  p = add(mul(p, r), 1.0f);
  p = add(mul(p, r), 1.0f);
  const float e = mul(p, from_bits(static_cast<uint32_t>(ni + 127) << 23));
  const float out = in > 88.3f ? from_bits(0x7f800000u) : e;
  return in < -87.3f ? 0.0f : out;
}

// act(g) * u for one element.
template <int K>
ELK_GLU_FN float gated(float g, float u) {
  float z = g;
  if (K == kGeluTanh) {  // 2 u = 2 sqrt(2/pi) g (1 + 0.044715 g^2)
    z = mul(mul(add(mul(mul(g, g), 0.044715f), 1.0f), g), 1.59576912f);
  }
  return mul(div(g, add(1.0f, exp_f32(-z))), u);
}

}  // namespace glu
}  // namespace elk

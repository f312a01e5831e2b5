// Scalar reference of the K-quant matmul library: GGUF block layouts, dequantization,
// 8-bit activation quantization with block sums, and dot products. Every ISA path is
// tested against these, and these against ggml itself (test/test_native_ref.py).
#pragma once

#include <stddef.h>
#include <stdint.h>

// Every function here is exported with default visibility from each library that links the
// kernels (libedge_llm_kquant.so, and libedge_llm_ort_ops.so: Python can ctypes.CDLL the path
// ONNX Runtime loaded and pin or read the kernels that library's ops run), whatever
// -fvisibility a build uses.
#if defined(__GNUC__) || defined(__clang__)
#define ELK_API __attribute__((visibility("default")))
#else
#define ELK_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

// GGML's type ids, as GGUF files store them.
enum elk_type {
  ELK_Q4_0 = 2, ELK_Q4_1 = 3, ELK_Q5_0 = 6, ELK_Q5_1 = 7, ELK_Q8_0 = 8,
  ELK_Q8_1 = 9, ELK_Q4_K = 12, ELK_Q5_K = 13, ELK_Q6_K = 14, ELK_Q8_K = 15,
};

// Weights per block and bytes per block of `type`; 0 for a type this library lacks.
ELK_API int elk_block_weights(int type);
ELK_API size_t elk_block_bytes(int type);

// y[0..k) = the weights of row x (k a multiple of the block size). Returns 0, or -1 for a
// type this library lacks.
ELK_API int elk_dequantize_row_ref(int type, const void *x, float *y, int64_t k);

// Activations to Q8_K blocks (fp32 scale, 256 int8, 16 int16 block sums), as ggml does, so
// the K types' min terms are one multiply per 16 weights.
ELK_API void elk_quantize_row_q8_K_ref(const float *x, void *y, int64_t k);

// *out = dot(row x of `type`, activations y in Q8_K), n weights. Q4_K, Q5_K and Q6_K.
// Returns 0, or -1 for another type.
ELK_API int elk_vec_dot_q8_K_ref(int type, int64_t n, const void *x, const void *y,
                                 float *out);

// The same with the kernels chosen for this CPU (or pinned by elk_select_kernel): equal to
// the reference bit for bit on every path.
ELK_API int elk_vec_dot_q8_K(int type, int64_t n, const void *x, const void *y,
                             float *out);

// out[i * ldo + j] = dot(weight row j, activation row i) for i < m, j < n, with the
// selected kernels: weight row j at w + j * w_stride (bytes), activation row i of Q8_K
// blocks at a + i * a_stride. Every element has the bits elk_vec_dot_q8_K gives it alone,
// whatever m and n (the kernels tile several rows of each per pass). Q4_K, Q5_K and Q6_K;
// k a multiple of 256. Returns 0, or -1.
ELK_API int elk_gemm_q8_K(int type, int64_t k, const void *w, size_t w_stride, int64_t n,
                          const void *a, size_t a_stride, int64_t m, float *out,
                          int64_t ldo);

// The same for every weight type (the 8 of elk_vec_dot): activation rows of the blocks
// elk_activation_type(type) names, k a multiple of the type's block size. Returns 0, or -1.
ELK_API int elk_gemm(int type, int64_t k, const void *w, size_t w_stride, int64_t n,
                     const void *a, size_t a_stride, int64_t m, float *out, int64_t ldo);

// elk_quantize_row_q8_K_ref with the selected kernels: the same bytes.
ELK_API void elk_quantize_row_q8_K(const float *x, void *y, int64_t k);
// elk_quantize_row_ref with the selected kernels (any activation type): the same bytes.
// Returns 0, or -1.
ELK_API int elk_quantize_row(int activation_type, const float *x, void *y, int64_t k);

// The running kernels' ISA ("scalar", "avx2", "neon", "neon_dotprod"), the features found,
// and a pin: "auto" or one of those names. Returns 0, or -1 when this CPU or build lacks that
// ISA. The choice is one per loaded library (each .so that links the kernels has its own).
ELK_API const char *elk_kernel_name(void);
ELK_API const char *elk_cpu_features(void);
ELK_API int elk_select_kernel(const char *isa);

// Every weight type against the activation blocks it pairs with, as ggml pairs them:
// Q4_0/Q5_0/Q8_0 with Q8_0, Q4_1/Q5_1 with Q8_1, the K types with Q8_K.
ELK_API int elk_activation_type(int weight_type);
// Activations of k floats into blocks of `activation_type`. Returns 0, or -1.
ELK_API int elk_quantize_row_ref(int activation_type, const float *x, void *y, int64_t k);
// *out = dot(row x of weight_type, y in its activation type), n weights. Returns 0, or -1.
ELK_API int elk_vec_dot_ref(int weight_type, int64_t n, const void *x, const void *y,
                            float *out);
// The same with the kernels chosen for this CPU (or pinned): every weight type, the K types
// through the same table as elk_vec_dot_q8_K; equal to elk_vec_dot_ref bit for bit.
ELK_API int elk_vec_dot(int weight_type, int64_t n, const void *x, const void *y,
                        float *out);

// The gated activation of a fused gate|up product (KQuantMatMul's `glu`): out[j] =
// act(gate[j]) * up[j] for j < n, act 1 = SiLU, 2 = GELU (tanh form), computed as glu.h
// defines it (the CUDA kernels give the same bits). Returns 0, or -1 for another kind.
ELK_API int elk_glu(int kind, const float *gate, const float *up, float *out, int64_t n);

#ifdef __cplusplus
}
#endif

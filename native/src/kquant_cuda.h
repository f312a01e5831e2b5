// The host entry points of kernels/kquant.cu (the CUDA K-quant matmul): see that file's header
// for the layouts, the launches and why the results are the CPU op's bits.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {

// Bytes of device scratch kquant_cuda_matmul needs for M activation rows of K (0 for a type or
// K it does not take).
size_t kquant_cuda_scratch_bytes(int type, int64_t m, int64_t k);

// Y [M, N] = A [M, K] x W^T (+ bias [N] when not null), W uint8 [N, row bytes] of GGUF blocks
// of type Q8_0 (8), Q4_K (12) or Q6_K (14); every pointer on the device. Queues the work on
// stream; returns 0, -1 for arguments it does not take, or the launch's cudaError_t.
int kquant_cuda_matmul(int type, const float *a, const uint8_t *w, const float *bias, float *y,
                       int64_t m, int64_t n, int64_t k, void *scratch, cudaStream_t stream);

// out [M, H] = act(Y[:, :H]) * Y[:, H:] for Y [M, 2H] (KQuantMatMul's glu: kind 1 SiLU, 2
// GELU-tanh, kernels/glu.h's bits); device pointers. Returns 0, -1 for arguments it does not
// take, or the launch's cudaError_t.
int kquant_cuda_glu(int kind, const float *y, float *out, int64_t m, int64_t half,
                    cudaStream_t stream);

}  // extern "C"

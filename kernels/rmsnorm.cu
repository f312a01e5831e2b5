// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/rmsnorm.cu -o rmsnorm.ptx
//   (sm_87 = Jetson Orin; sm_90 = H100/H200, sm_89 = L4/RTX 40xx, sm_86 = A10/RTX 30xx)
//
// Fused RMSNorm, as onnxruntime's SimplifiedLayerNormalization (rmsnorm_*) and
// SkipSimplifiedLayerNormalization (add_rmsnorm_*) compute it:
//   y = x * rsqrt(mean(x^2) + eps) * weight
//   add_rmsnorm: h = x + residual is written to `sum_out` (the next residual) and
//                y = rmsnorm(h), in one pass over memory instead of three kernels.
// One thread block per row (token); threads stride over the hidden size, the sum of
// squares is reduced with warp shuffles then across warps. fp32 arithmetic.
// Launch: gridDim.x = rows, blockDim.x = 256 (any multiple of 32 up to 1024).
// Reference: edge_llm_ros/bringup/kernel_reference.py rmsnorm() / add_rmsnorm().
#include <cuda_fp16.h>
#include <stdint.h>

namespace edge_llm {

// Storage is float or __half; arithmetic is fp32 (as onnxruntime's CPU kernels).
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ float load_f(const T* p) { return to_f(__ldg(p)); }
template <typename T> __device__ __forceinline__ T store_f(float v);
template <> __device__ __forceinline__ float store_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half store_f<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;  // lane 0 holds the sum
}

// Sum over the thread block, returned to every thread (blockDim.x a multiple of 32).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
    v = warp_sum(v);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

template <typename T>
__device__ void rmsnorm(const T* __restrict__ x, const T* __restrict__ weight,
                        T* __restrict__ y, int hidden, float eps) {
  const T* row = x + (size_t)blockIdx.x * hidden;
  T* out = y + (size_t)blockIdx.x * hidden;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = load_f(row + i);
    sum_sq = fmaf(v, v, sum_sq);
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[i] = store_f<T>(load_f(row + i) * inv_rms * load_f(weight + i));
}

template <typename T>
__device__ void add_rmsnorm(const T* __restrict__ x, const T* __restrict__ residual,
                            const T* __restrict__ weight, T* __restrict__ y,
                            T* __restrict__ sum_out, int hidden, float eps) {
  const size_t base = (size_t)blockIdx.x * hidden;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    // Round h to the storage type before squaring so y matches a separate add + norm.
    const T h = store_f<T>(load_f(x + base + i) + load_f(residual + base + i));
    sum_out[base + i] = h;
    const float v = to_f(h);
    sum_sq = fmaf(v, v, sum_sq);
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq) / (float)hidden + eps);
  // Each thread re-reads only the elements it wrote itself: no barrier needed.
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    y[base + i] = store_f<T>(to_f(sum_out[base + i]) * inv_rms * load_f(weight + i));
}

}  // namespace edge_llm

extern "C" __global__ void rmsnorm_f32(const float* x, const float* weight, float* y, int hidden,
                                       float eps) {
  edge_llm::rmsnorm<float>(x, weight, y, hidden, eps);
}

extern "C" __global__ void rmsnorm_f16(const __half* x, const __half* weight, __half* y,
                                       int hidden, float eps) {
  edge_llm::rmsnorm<__half>(x, weight, y, hidden, eps);
}

extern "C" __global__ void add_rmsnorm_f32(const float* x, const float* residual,
                                           const float* weight, float* y, float* sum_out,
                                           int hidden, float eps) {
  edge_llm::add_rmsnorm<float>(x, residual, weight, y, sum_out, hidden, eps);
}

extern "C" __global__ void add_rmsnorm_f16(const __half* x, const __half* residual,
                                           const __half* weight, __half* y, __half* sum_out,
                                           int hidden, float eps) {
  edge_llm::add_rmsnorm<__half>(x, residual, weight, y, sum_out, hidden, eps);
}

// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/kv_int8.cu -o kv_int8.ptx
//   (sm_87 = Jetson Orin; sm_90 = H100/H200, sm_89 = L4/RTX 40xx, sm_86 = A10/RTX 30xx)
//
// Int8 KV cache: symmetric per-head, per-token quantization of one K or V tensor.
//   cache layout [heads, max_ctx, head_dim] (batch 1, the GroupQueryAttention layout);
//   scales       float [heads, max_ctx]
//   scale = max|x| / 127 over the head_dim values of one (head, token);
//   q = clamp(rint(x / scale), -127, 127) (round half to even, as QuantizeLinear does);
//   a row of zeros gets scale 0 and q 0. Dequantize: x = q * scale.
// Quarter the memory of fp32 (half of fp16) for saved session prefixes; the per-token
// scale keeps an outlier token from flattening its neighbours.
// Tokens [start, start + count) of every head are processed: one warp per (head, token).
// Launch: blockDim.x = 32 * warps_per_block, gridDim.x = ceil(heads * count / warps).
// Reference: edge_llm_ros/bringup/kernel_reference.py kv_quantize() / kv_dequantize().
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

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;  // every lane holds the max
}

template <typename T>
__device__ void kv_quantize(const T* __restrict__ kv, int8_t* __restrict__ q,
                            float* __restrict__ scales, int heads, int max_ctx, int head_dim,
                            int start, int count) {
  const int warps_per_block = blockDim.x >> 5;
  const int row = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= heads * count) return;
  const int head = row / count;
  const size_t token = (size_t)head * max_ctx + start + row % count;
  const T* src = kv + token * head_dim;
  float amax = 0.0f;
  for (int i = lane; i < head_dim; i += 32) amax = fmaxf(amax, fabsf(load_f(src + i)));
  amax = warp_max(amax);
  const float scale = amax / 127.0f;
  int8_t* dst = q + token * head_dim;
  for (int i = lane; i < head_dim; i += 32) {
    const int v = scale > 0.0f ? __float2int_rn(__fdiv_rn(load_f(src + i), scale)) : 0;
    dst[i] = (int8_t)max(-127, min(127, v));
  }
  if (lane == 0) scales[token] = scale;
}

template <typename T>
__device__ void kv_dequantize(const int8_t* __restrict__ q, const float* __restrict__ scales,
                              T* __restrict__ kv, int heads, int max_ctx, int head_dim,
                              int start, int count) {
  const size_t n = (size_t)heads * count * head_dim;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
       idx += (size_t)gridDim.x * blockDim.x) {
    const int d = (int)(idx % head_dim);
    const size_t row = idx / head_dim;
    const size_t token = (row / count) * max_ctx + start + row % count;
    kv[token * head_dim + d] = store_f<T>((float)__ldg(q + token * head_dim + d) * __ldg(scales + token));
  }
}

}  // namespace edge_llm

extern "C" __global__ void kv_quantize_f32(const float* kv, int8_t* q, float* scales, int heads,
                                           int max_ctx, int head_dim, int start, int count) {
  edge_llm::kv_quantize<float>(kv, q, scales, heads, max_ctx, head_dim, start, count);
}

extern "C" __global__ void kv_quantize_f16(const __half* kv, int8_t* q, float* scales, int heads,
                                           int max_ctx, int head_dim, int start, int count) {
  edge_llm::kv_quantize<__half>(kv, q, scales, heads, max_ctx, head_dim, start, count);
}

extern "C" __global__ void kv_dequantize_f32(const int8_t* q, const float* scales, float* kv,
                                             int heads, int max_ctx, int head_dim, int start,
                                             int count) {
  edge_llm::kv_dequantize<float>(q, scales, kv, heads, max_ctx, head_dim, start, count);
}

extern "C" __global__ void kv_dequantize_f16(const int8_t* q, const float* scales, __half* kv,
                                             int heads, int max_ctx, int head_dim, int start,
                                             int count) {
  edge_llm::kv_dequantize<__half>(q, scales, kv, heads, max_ctx, head_dim, start, count);
}

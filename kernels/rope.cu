// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/rope.cu -o rope.ptx
//   (sm_87 = Jetson Orin; sm_90 = H100/H200, sm_89 = L4/RTX 40xx, sm_86 = A10/RTX 30xx)
//
// Rotary position embedding, in place, both layouts onnxruntime's RotaryEmbedding
// contrib op supports (attribute `interleaved`):
//   interleaved = 1 (GPT-J / Meta Llama weights): pairs (2i, 2i+1)
//   interleaved = 0 (GPT-NeoX / HF Llama, Qwen2): pairs (i, i + rot/2)
//   x_a' = x_a * cos[p, i] - x_b * sin[p, i];   x_b' = x_b * cos[p, i] + x_a * sin[p, i]
// x: [seq, heads, head_dim] (q or k of one sequence), positions: int64 [seq],
// cos_cache / sin_cache: [max_position, rot/2] with rot = 2 * cache width <= head_dim;
// dimensions beyond rot pass through unchanged.
// One thread per rotated pair (seq * heads * rot/2 threads, grid-stride loop).
// Launch: blockDim.x = 256, gridDim.x = min(ceil(pairs / 256), 65535).
// Reference: edge_llm_ros/bringup/kernel_reference.py rope().
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

template <typename T>
__device__ void rope(T* __restrict__ x, const int64_t* __restrict__ positions,
                     const T* __restrict__ cos_cache, const T* __restrict__ sin_cache,
                     int seq, int heads, int head_dim, int half_rot, int interleaved) {
  const size_t pairs = (size_t)seq * heads * half_rot;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < pairs;
       idx += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(idx % half_rot);
    const size_t head = idx / half_rot;  // = s * heads + h
    const int s = (int)(head / heads);
    const int64_t p = __ldg(positions + s);
    const float c = load_f(cos_cache + p * half_rot + i);
    const float sn = load_f(sin_cache + p * half_rot + i);
    T* v = x + head * head_dim;
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half_rot;
    const float xa = to_f(v[a]);
    const float xb = to_f(v[b]);
    v[a] = store_f<T>(xa * c - xb * sn);
    v[b] = store_f<T>(xb * c + xa * sn);
  }
}

}  // namespace edge_llm

extern "C" __global__ void rope_f32(float* x, const int64_t* positions, const float* cos_cache,
                                    const float* sin_cache, int seq, int heads, int head_dim,
                                    int half_rot, int interleaved) {
  edge_llm::rope<float>(x, positions, cos_cache, sin_cache, seq, heads, head_dim, half_rot,
                        interleaved);
}

extern "C" __global__ void rope_f16(__half* x, const int64_t* positions, const __half* cos_cache,
                                    const __half* sin_cache, int seq, int heads, int head_dim,
                                    int half_rot, int interleaved) {
  edge_llm::rope<__half>(x, positions, cos_cache, sin_cache, seq, heads, head_dim, half_rot,
                         interleaved);
}

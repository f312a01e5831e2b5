// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/int4_gemv.cu -o int4_gemv.ptx
//   (sm_87 = Jetson Orin; sm_90 = H100/H200, sm_89 = L4/RTX 40xx, sm_86 = A10/RTX 30xx)
//
// INT4 dequant-GEMV for decode (one token): y[n] = sum_k x[k] * (q[n,k] - z[n,b]) * s[n,b],
// b = k / 32. Weights in onnxruntime's MatMulNBits layout (bits=4, block_size=32), so a
// converted model's initializers can be used as they are:
//   b_packed     uint8 [N, K/32, 16]   byte i of a block holds element 2i in its low nibble
//                                      and element 2i+1 in its high nibble
//   scales       T     [N, K/32]
//   zero_points  zp_kind 0: none (8, the symmetric midpoint)
//                zp_kind 1: uint8 [N, ceil((K/32)/2)], two 4-bit points per byte, low first
//                zp_kind 2: T [N, K/32] float zero points (e.g. GGUF Q4_1: z = -min/scale)
// K must be a multiple of 32 (MatMulNBits pads K up to whole blocks).
//
// One warp per output row. Each lane owns whole blocks: one 16-byte load of 32 nibbles,
// so a warp step reads 512 contiguous weight bytes (coalesced), and the block's sum is
// s * (sum q*x - z * sum x): one multiply per element, zero point applied once per block.
// Partial sums are reduced with warp shuffles; accumulation is fp32.
// Launch: blockDim.x = 32 * warps_per_block, gridDim.x = ceil(N / warps_per_block).
// Reference: edge_llm_ros/bringup/kernel_reference.py int4_gemv().
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

template <typename T>
__device__ __forceinline__ float zero_point(const void* zero_points, int zp_kind, int row,
                                            int block, int blocks) {
  if (zp_kind == 1) {
    const uint8_t* zp = static_cast<const uint8_t*>(zero_points);
    const uint8_t byte = zp[(size_t)row * ((blocks + 1) / 2) + block / 2];
    return (float)((block & 1) ? (byte >> 4) : (byte & 0x0F));
  }
  if (zp_kind == 2) return load_f(static_cast<const T*>(zero_points) + (size_t)row * blocks + block);
  return 8.0f;
}

template <typename T>
__device__ void int4_gemv(const T* __restrict__ x, const uint8_t* __restrict__ b_packed,
                          const T* __restrict__ scales, const void* __restrict__ zero_points,
                          int zp_kind, T* __restrict__ y, int n_rows, int k) {
  const int warps_per_block = blockDim.x >> 5;
  const int row = blockIdx.x * warps_per_block + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= n_rows) return;  // whole warp leaves together: the shuffles below stay legal
  const int blocks = k >> 5;
  const uint8_t* row_bytes = b_packed + (size_t)row * blocks * 16;
  float acc = 0.0f;
  for (int block = lane; block < blocks; block += 32) {
    const uint4 packed = *reinterpret_cast<const uint4*>(row_bytes + (size_t)block * 16);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    const T* xb = x + (size_t)block * 32;
    float sum_qx = 0.0f;
    float sum_x = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t byte = (words[w] >> (8 * j)) & 0xFFu;  // little-endian byte 4w+j
        const int e = 8 * w + 2 * j;
        const float x0 = load_f(xb + e);
        const float x1 = load_f(xb + e + 1);
        sum_qx = fmaf((float)(byte & 0x0Fu), x0, sum_qx);
        sum_qx = fmaf((float)(byte >> 4), x1, sum_qx);
        sum_x += x0 + x1;
      }
    }
    const float scale = load_f(scales + (size_t)row * blocks + block);
    const float zero = zero_point<T>(zero_points, zp_kind, row, block, blocks);
    acc = fmaf(scale, sum_qx - zero * sum_x, acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) y[row] = store_f<T>(acc);
}

}  // namespace edge_llm

extern "C" __global__ void int4_gemv_f32(const float* x, const uint8_t* b_packed,
                                         const float* scales, const void* zero_points,
                                         int zp_kind, float* y, int n_rows, int k) {
  edge_llm::int4_gemv<float>(x, b_packed, scales, zero_points, zp_kind, y, n_rows, k);
}

extern "C" __global__ void int4_gemv_f16(const __half* x, const uint8_t* b_packed,
                                         const __half* scales, const void* zero_points,
                                         int zp_kind, __half* y, int n_rows, int k) {
  edge_llm::int4_gemv<__half>(x, b_packed, scales, zero_points, zp_kind, y, n_rows, k);
}

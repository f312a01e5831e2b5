// nvcc -ptx -arch=sm_87 -O3 -std=c++17 kernels/kquant.cu -o kquant.ptx
//   (sm_87 = Jetson Orin, sm_90 = H100/H200; native/CMakeLists.txt builds this file into
//   libedge_llm_ort_ops_cuda.so, the CUDA execution provider's edge_llm_ros.KQuantMatMul)
//
// KQuantMatMul on the GPU: Y[M, N] = A[M, K] x W^T (+ bias[N]), fp32 A and Y, with W the [N, K]
// weight in its GGUF blocks byte for byte: the CPU op's W (uint8 [N, row bytes], row n = the
// K / block-size blocks of weight row n, as the GGUF file holds them). Types here:
//   Q8_0 (ggml type 8):  34-byte blocks of 32: fp16 d, int8 qs[32]            w = d * q
//   Q4_K (12): 144-byte super-blocks of 256: fp16 d, dmin, 12 bytes of 6-bit scales/mins for
//        8 sub-blocks of 32, qs[128] (byte i of pair p: weight 64p+i low, 64p+32+i high)
//                                                 w = (d * sc) * q - (dmin * m)
//   Q6_K (14): 210-byte super-blocks of 256: ql[128], qh[64], int8 scales[16] (one per 16),
//        fp16 d last                              w = d * sc * (q - 32)
// Block starts of Q8_0 and Q6_K are only 2-byte aligned (34, 210): those are read 16 bits at a
// time. K must be a multiple of 32 (Q8_0) or 256 (Q4_K, Q6_K): the CPU op's rule.
//
// The math is the CPU op's (native/src/ref.cpp, which every CPU kernel reproduces bit for bit):
// each activation row is quantized as ggml does (Q8_0 blocks of 32 for Q8_0; Q8_K blocks of 256
// with 16-sums for the K types: kquant_quantize_*, byte-equal to elk_quantize_row_ref), each
// (super-)block's dot is an exact int32 sum (dp4a), its float term is kernels.h's expression
// (k_block: (d*dy)*dots - (dmin*dy)*mins; legacy_block: (dx*dy)*sum) with IEEE round-to-nearest
// operations that are never fused (__fmul_rn/__fsub_rn/__fadd_rn), and the terms of a row are
// added in block order into an fp32 sum that starts at 0, plus the bias last. So the GEMV and
// the GEMM give the CPU op's bits (a row's result does not depend on M or on which kernel ran),
// not merely its values within a tolerance: test/test_native_cuda.py checks exactly that on a
// GPU (tolerance 0), and the dense fp32 product within the activations' quantization error (2%
// of |A| x |W|, as the CPU op's own test). Compiled for sm_87/sm_90 on a machine without a
// GPU: the kernels have not run on a GPU yet (they have on the CPU emulation below).
//
// Device scratch (kquant_cuda_scratch_bytes): the quantized activations, laid out for aligned
// loads, not as GGUF blocks (the values are the blocks'): qs int8 [M, K]; d float [M, K/32]
// (Q8_0: the fp16 scale as a float) or [M, K/256] (Q8_K); Q8_K's 16-sums int16 [M, K/16].
//
// Launches (what kquant_cuda_matmul does, on the caller's stream):
//   kquant_quantize_q8_0 / _q8_K   grid (M, ceil(K/256)), block 256: a thread per value, a warp
//                                  per Q8_0 block, a thread block per Q8_K block
//   kquant_gemv_<type>  (M <= 4)   grid ceil(N/8), block 256: a warp per weight row; a group of
//                                  16 lanes per super-block (4 per Q8_0 block) computes its
//                                  integer sums, so a warp reads 2 super-blocks (8 Q8_0 blocks)
//                                  of contiguous bytes a step; weights stay in registers for
//                                  the M <= 4 activation rows (decode)
//   kquant_glu (kquant_cuda_glu)   grid ceil(M * N/2 / 256), block 256: a thread per output of a
//                                  fused gate|up product's activation (glu.h, as the CPU op)
//   kquant_gemm_<type>  (M > 4)    grid (ceil(N/64), ceil(M/64)), block 256: a 64 x 64 tile of Y
//                                  per block, K in steps of 256: the W tile is unpacked to int8
//                                  with its scales and the A tile copied into shared memory
//                                  (rows padded to 65 words: the 16 W rows a warp reads fall
//                                  in 16 banks), and each thread keeps 4 x 4 outputs, adding
//                                  each (super-)block's term in order (prefill)
//
// The same text also builds as plain C++ with native/tests/cuda_emulation.h (no __CUDACC__): a
// fiber per CUDA thread, barriers for warp shuffles and __syncthreads, so
// native/tests/kquant_emulate.cpp runs these very kernels and the launcher on a CPU against
// ref.cpp, bit for bit.
#include <stddef.h>
#include <stdint.h>

#include "glu.h"  // the gated activation: the CPU op (native/) includes this file too
#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define KQUANT_LAUNCH(kernel, grid, block, stream, ...) \
  kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

namespace kquant {

constexpr int kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;  // ggml type ids
constexpr int QK = 32, QK_K = 256;
constexpr int kQ8_0Bytes = 34, kQ4_KBytes = 144, kQ6_KBytes = 210;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxGemvRows = 4;
constexpr int kGemvWarps = 8;  // warps (weight rows) per GEMV block
constexpr int BM = 64, BN = 64, BK = 256, kWords = BK / 4, kStride = kWords + 1;

// IEEE single operations rounded to nearest even, never contracted into an FMA: the CPU
// reference's expressions (built with -ffp-contract=off) give the same bits.
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }

// kernels.h's k_block and legacy_block.
__device__ __forceinline__ float k_block(float d, float dmin, float dy, int dots, int mins) {
  return sub(mul(mul(d, dy), __int2float_rn(dots)), mul(mul(dmin, dy), __int2float_rn(mins)));
}
__device__ __forceinline__ float legacy_block(float dx, float dy, int sum) {
  return mul(mul(dx, dy), __int2float_rn(sum));
}

__device__ __forceinline__ float half_at(const uint8_t *p) {  // p 2-byte aligned
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t *>(p)));
}
// 4 bytes, little-endian, at a 2-byte aligned address / at a 4-byte aligned address.
__device__ __forceinline__ int word2(const uint8_t *p) {
  const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
  return static_cast<int>(static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16));
}
__device__ __forceinline__ int word4(const void *p) { return *static_cast<const int *>(p); }

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block (blocks.h).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q6_K: 4 weights (q - 32 as int8) of part 0..3 (ref.cpp's q1..q4: ql[l] low, ql[l + 32] low,
// ql[l] high, ql[l + 32] high nibbles) from those 4 ql bytes and their qh bytes.
__device__ __forceinline__ int q6_word(int ql, int qh, int part) {
  const int lo = part >= 2 ? (ql >> 4) & 0x0f0f0f0f : ql & 0x0f0f0f0f;
  int hi;
  switch (part) {
    case 0: hi = (qh << 4) & 0x30303030; break;          // bits 0-1 -> 4-5 (q1)
    case 1: hi = (qh << 2) & 0x30303030; break;          // bits 2-3       (q2)
    case 2: hi = qh & 0x30303030; break;                 // bits 4-5       (q3)
    default: hi = (qh >> 2) & 0x30303030; break;         // bits 6-7       (q4)
  }
  return static_cast<int>(__vsub4(static_cast<unsigned>(lo | hi), 0x20202020u));
}

template <int LANES>
__device__ __forceinline__ int group_sum(int v) {  // over aligned groups of LANES lanes
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// ---- activations -------------------------------------------------------------------------

// Q8_0 as elk_quantize_row_ref: d = amax / 127, q = round(x / d) (half away from zero), the
// fp16 d kept (as a float). grid (M, ceil(K/256)), block 256; K a multiple of 32.
__device__ void quantize_q8_0(const float *__restrict__ x, int8_t *__restrict__ qs,
                              float *__restrict__ d, int k) {
  const size_t row = blockIdx.x;
  const int col = blockIdx.y * 256 + threadIdx.x;
  if (col >= k) return;  // whole warps (whole blocks) leave together
  const float v = x[row * k + col];
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  const float scale = __fdiv_rn(amax, 127.0f);
  const float inverse = scale != 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
  qs[row * k + col] = static_cast<int8_t>(static_cast<int>(roundf(mul(v, inverse))));
  if ((threadIdx.x & 31) == 0) d[row * (k / QK) + col / QK] = __half2float(__float2half_rn(scale));
}

// Q8_K as elk_quantize_row_q8_K_ref: the value of largest magnitude (the first, on ties) maps
// to -127, q = min(127, rint(-127 / max * x)), d = 1 / (-127 / max), 16-sums. grid (M, K/256),
// block 256.
__device__ void quantize_q8_K(const float *__restrict__ x, int8_t *__restrict__ qs,
                              float *__restrict__ d, int16_t *__restrict__ bsums, int k) {
  __shared__ float warp_max[8];
  __shared__ int warp_at[8];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const size_t base = blockIdx.x * static_cast<size_t>(k) + blockIdx.y * QK_K;
  const float v = x[base + t];
  float amax = fabsf(v);
  int at = t;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {  // (largest |x|, then smallest index): the first maximum
    const float other = __shfl_xor_sync(kFull, amax, o);
    const int other_at = __shfl_xor_sync(kFull, at, o);
    if (other > amax || (other == amax && other_at < at)) {
      amax = other;
      at = other_at;
    }
  }
  if (lane == 0) {
    warp_max[warp] = amax;
    warp_at[warp] = at;
  }
  __syncthreads();
  amax = warp_max[0];
  at = warp_at[0];
  for (int w = 1; w < 8; ++w) {
    if (warp_max[w] > amax) {
      amax = warp_max[w];
      at = warp_at[w];
    }
  }
  int q = 0;
  float scale = 0.0f;
  if (amax != 0.0f) {
    const float iscale = __fdiv_rn(-127.0f, x[base + at]);
    q = min(__float2int_rn(mul(iscale, v)), 127);
    scale = __fdiv_rn(1.0f, iscale);
  }
  qs[base + t] = static_cast<int8_t>(q);
  const int sum = group_sum<16>(q);
  if ((t & 15) == 0) bsums[blockIdx.x * static_cast<size_t>(k / 16) + blockIdx.y * 16 + t / 16] =
      static_cast<int16_t>(sum);
  if (t == 0) d[blockIdx.x * static_cast<size_t>(k / QK_K) + blockIdx.y] = scale;
}

// ---- GEMV (decode, M <= 4) -------------------------------------------------------------

// Adds the step's block terms (lane 0, LANES, 2 LANES, ... of the warp hold them, block j0 + g
// for group g) to sum in block order; every lane ends with the same sum.
template <int LANES>
__device__ __forceinline__ float add_in_order(float sum, float term, int j0, int blocks) {
#pragma unroll
  for (int g = 0; g < 32 / LANES; ++g) {
    const float t = __shfl_sync(kFull, term, g * LANES);
    if (j0 + g < blocks) sum = add(sum, t);
  }
  return sum;
}

__device__ __forceinline__ void store_rows(const float *sum, const float *__restrict__ bias,
                                           float *__restrict__ y, int m, int n, int row) {
  if ((threadIdx.x & 31) != 0) return;
#pragma unroll
  for (int r = 0; r < kMaxGemvRows; ++r) {
    if (r < m) y[static_cast<size_t>(r) * n + row] = bias ? add(sum[r], bias[row]) : sum[r];
  }
}

__device__ void gemv_q4_K(const uint8_t *__restrict__ w, const int8_t *__restrict__ aq,
                          const float *__restrict__ ad, const int16_t *__restrict__ sums,
                          const float *__restrict__ bias, float *__restrict__ y, int m, int n,
                          int k) {
  const int row = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (row >= n) return;  // the whole warp: its shuffles stay legal
  const int lane = threadIdx.x & 31, g = lane >> 4, p = (lane >> 2) & 3, c = lane & 3;
  const int blocks = k / QK_K;
  const uint8_t *weights = w + static_cast<size_t>(row) * blocks * kQ4_KBytes;
  float sum[kMaxGemvRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < blocks; j0 += 2) {
    const int j = j0 + g;
    const bool live = j < blocks;
    float dx = 0.0f, dmin = 0.0f;
    int sc1 = 0, m1 = 0, sc2 = 0, m2 = 0, q0 = 0, q1 = 0;
    if (live) {
      const uint8_t *b = weights + static_cast<size_t>(j) * kQ4_KBytes;
      dx = half_at(b);
      dmin = half_at(b + 2);
      scale_min_k4(2 * p, b + 4, &sc1, &m1);
      scale_min_k4(2 * p + 1, b + 4, &sc2, &m2);
      q0 = word4(b + 16 + 32 * p + 8 * c);
      q1 = word4(b + 16 + 32 * p + 8 * c + 4);
    }
#pragma unroll
    for (int r = 0; r < kMaxGemvRows; ++r) {
      if (r >= m) break;
      int dots = 0, mins = 0;
      if (live) {
        const int8_t *a = aq + static_cast<size_t>(r) * k + static_cast<size_t>(j) * QK_K +
                          64 * p + 8 * c;
        const int lo = __dp4a(q0 & 0x0f0f0f0f, word4(a), __dp4a(q1 & 0x0f0f0f0f, word4(a + 4), 0));
        const int hi = __dp4a((q0 >> 4) & 0x0f0f0f0f, word4(a + 32),
                              __dp4a((q1 >> 4) & 0x0f0f0f0f, word4(a + 36), 0));
        dots = sc1 * lo + sc2 * hi;
        if (c == 0) {
          const int16_t *s = sums + static_cast<size_t>(r) * (k / 16) + j * 16 + 4 * p;
          mins = m1 * (s[0] + s[1]) + m2 * (s[2] + s[3]);
        }
      }
      dots = group_sum<16>(dots);
      mins = group_sum<16>(mins);
      const float term = live ? k_block(dx, dmin, ad[static_cast<size_t>(r) * blocks + j], dots,
                                        mins) : 0.0f;
      sum[r] = add_in_order<16>(sum[r], term, j0, blocks);
    }
  }
  store_rows(sum, bias, y, m, n, row);
}

__device__ void gemv_q6_K(const uint8_t *__restrict__ w, const int8_t *__restrict__ aq,
                          const float *__restrict__ ad, const float *__restrict__ bias,
                          float *__restrict__ y, int m, int n, int k) {
  const int row = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const int lane = threadIdx.x & 31, g = lane >> 4, h = (lane >> 3) & 1, c = lane & 7;
  const int is = c >> 2;  // which 16 of the 32 l values: the scale index within the part
  const int blocks = k / QK_K;
  const uint8_t *weights = w + static_cast<size_t>(row) * blocks * kQ6_KBytes;
  float sum[kMaxGemvRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < blocks; j0 += 2) {
    const int j = j0 + g;
    const bool live = j < blocks;
    float dx = 0.0f;
    int q[4] = {0, 0, 0, 0}, sc[4] = {0, 0, 0, 0};
    if (live) {
      const uint8_t *b = weights + static_cast<size_t>(j) * kQ6_KBytes;
      const int ql0 = word2(b + 64 * h + 4 * c), ql1 = word2(b + 64 * h + 32 + 4 * c);
      const int qh = word2(b + 128 + 32 * h + 4 * c);
      q[0] = q6_word(ql0, qh, 0);
      q[1] = q6_word(ql1, qh, 1);
      q[2] = q6_word(ql0, qh, 2);
      q[3] = q6_word(ql1, qh, 3);
      const int8_t *scales = reinterpret_cast<const int8_t *>(b + 192 + 8 * h + is);
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = scales[2 * i];
      dx = half_at(b + 208);
    }
#pragma unroll
    for (int r = 0; r < kMaxGemvRows; ++r) {
      if (r >= m) break;
      int dots = 0;
      if (live) {
        const int8_t *a = aq + static_cast<size_t>(r) * k + static_cast<size_t>(j) * QK_K +
                          128 * h + 4 * c;
#pragma unroll
        for (int i = 0; i < 4; ++i) dots += sc[i] * __dp4a(q[i], word4(a + 32 * i), 0);
      }
      dots = group_sum<16>(dots);
      const float term = live ? k_block(dx, 0.0f, ad[static_cast<size_t>(r) * blocks + j], dots,
                                        0) : 0.0f;
      sum[r] = add_in_order<16>(sum[r], term, j0, blocks);
    }
  }
  store_rows(sum, bias, y, m, n, row);
}

__device__ void gemv_q8_0(const uint8_t *__restrict__ w, const int8_t *__restrict__ aq,
                          const float *__restrict__ ad, const float *__restrict__ bias,
                          float *__restrict__ y, int m, int n, int k) {
  const int row = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int blocks = k / QK;
  const uint8_t *weights = w + static_cast<size_t>(row) * blocks * kQ8_0Bytes;
  float sum[kMaxGemvRows] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j0 = 0; j0 < blocks; j0 += 8) {
    const int j = j0 + g;
    const bool live = j < blocks;
    float dx = 0.0f;
    int q0 = 0, q1 = 0;
    if (live) {
      const uint8_t *b = weights + static_cast<size_t>(j) * kQ8_0Bytes;
      dx = half_at(b);
      q0 = word2(b + 2 + 8 * t);
      q1 = word2(b + 6 + 8 * t);
    }
#pragma unroll
    for (int r = 0; r < kMaxGemvRows; ++r) {
      if (r >= m) break;
      int s = 0;
      if (live) {
        const int8_t *a = aq + static_cast<size_t>(r) * k + static_cast<size_t>(j) * QK + 8 * t;
        s = __dp4a(q0, word4(a), __dp4a(q1, word4(a + 4), 0));
      }
      s = group_sum<4>(s);
      const float term = live ? legacy_block(dx, ad[static_cast<size_t>(r) * blocks + j], s)
                              : 0.0f;
      sum[r] = add_in_order<4>(sum[r], term, j0, blocks);
    }
  }
  store_rows(sum, bias, y, m, n, row);
}

// ---- GEMM (prefill) ----------------------------------------------------------------------

template <int TYPE>
struct Gemm {
  static constexpr bool kK = TYPE != kQ8_0;            // a K type: one term per 256
  static constexpr int kGroup = TYPE == kQ6_K ? 16 : 32;  // weights per integer scale / block
  static constexpr int kGroups = BK / kGroup;
  static constexpr int kGroupWords = kGroup / 4;
  static constexpr int kActScales = kK ? 1 : 8;         // activation scales per 256
};

template <int TYPE>
__device__ void gemm(const uint8_t *__restrict__ w, const int8_t *__restrict__ aq,
                     const float *__restrict__ ad, const int16_t *__restrict__ sums,
                     const float *__restrict__ bias, float *__restrict__ y, int m, int n, int k) {
  using G = Gemm<TYPE>;
  __shared__ int tile_a[BM][kStride];
  __shared__ int tile_w[BN][kStride];
  __shared__ float a_scale[BM][G::kActScales];
  __shared__ int a_sums[TYPE == kQ4_K ? BM : 1][9];  // Q4_K: activation sums per sub-block
  __shared__ int w_scale[G::kK ? BN : 1][G::kGroups + 1];
  __shared__ int w_min[TYPE == kQ4_K ? BN : 1][9];
  __shared__ float w_d[BN][9];  // K types: d (and Q4_K's dmin); Q8_0: d of each block
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int block_weights = G::kK ? QK_K : QK;
  const int blocks = k / block_weights;  // per row
  const size_t row_bytes = static_cast<size_t>(blocks) *
                           (TYPE == kQ4_K ? kQ4_KBytes : TYPE == kQ6_K ? kQ6_KBytes : kQ8_0Bytes);
  const int steps = (k + BK - 1) / BK;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) acc[i][jj] = 0.0f;

  for (int step = 0; step < steps; ++step) {
    const int legacy_blocks = min(8, blocks - 8 * step);  // Q8_0 blocks in this step
    // A tile: 64 rows x 64 words of int8, zeros past M and K.
#pragma unroll 4
    for (int i = 0; i < BM * kWords / 256; ++i) {
      const int idx = tid + 256 * i, r = idx >> 6, word = idx & 63;
      const int row = m0 + r, col = step * BK + 4 * word;
      tile_a[r][word] = row < m && col < k ? word4(aq + static_cast<size_t>(row) * k + col) : 0;
    }
    if constexpr (G::kK) {
      if (tid < BM) {
        const int row = m0 + tid;
        a_scale[tid][0] = row < m ? ad[static_cast<size_t>(row) * blocks + step] : 0.0f;
      }
      if constexpr (TYPE == kQ4_K) {
        for (int idx = tid; idx < BM * 8; idx += 256) {
          const int r = idx >> 3, sub = idx & 7, row = m0 + r;
          int s = 0;
          if (row < m) {
            const int16_t *b = sums + static_cast<size_t>(row) * (k / 16) + step * 16 + 2 * sub;
            s = b[0] + b[1];
          }
          a_sums[r][sub] = s;
        }
      }
    } else {
      for (int idx = tid; idx < BM * 8; idx += 256) {
        const int r = idx >> 3, blk = idx & 7, row = m0 + r;
        a_scale[r][blk] = row < m && blk < legacy_blocks
                              ? ad[static_cast<size_t>(row) * blocks + 8 * step + blk] : 0.0f;
      }
    }
    // W tile: 4 threads per weight row unpack its 256 weights (zeros past N).
    {
      const int r = tid >> 2, part = tid & 3, row = n0 + r;
      const uint8_t *wr = w + static_cast<size_t>(row) * row_bytes;
      if constexpr (TYPE == kQ4_K) {
        const uint8_t *b = wr + static_cast<size_t>(step) * kQ4_KBytes;
        const bool live = row < n;
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // part = pair: sub-blocks 2 part and 2 part + 1
          const int v = live ? word4(b + 16 + 32 * part + 4 * i) : 0;
          tile_w[r][16 * part + i] = v & 0x0f0f0f0f;
          tile_w[r][16 * part + 8 + i] = (v >> 4) & 0x0f0f0f0f;
        }
        int sc = 0, mn = 0;
        if (live) scale_min_k4(2 * part, b + 4, &sc, &mn);
        w_scale[r][2 * part] = sc;
        w_min[r][2 * part] = mn;
        sc = mn = 0;
        if (live) scale_min_k4(2 * part + 1, b + 4, &sc, &mn);
        w_scale[r][2 * part + 1] = sc;
        w_min[r][2 * part + 1] = mn;
        if (part == 0) {
          w_d[r][0] = live ? half_at(b) : 0.0f;
          w_d[r][1] = live ? half_at(b + 2) : 0.0f;
        }
      } else if constexpr (TYPE == kQ6_K) {
        const uint8_t *b = wr + static_cast<size_t>(step) * kQ6_KBytes;
        const bool live = row < n;
        const int h = part >> 1;
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // l = 16 (part & 1) + 4 i: 4 l values, 4 weights each
          const int l = 16 * (part & 1) + 4 * i;
          int ql0 = 0, ql1 = 0, qh = 0;
          if (live) {
            ql0 = word2(b + 64 * h + l);
            ql1 = word2(b + 64 * h + 32 + l);
            qh = word2(b + 128 + 32 * h + l);
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // weights 128 h + 32 q + l .. + 3
            tile_w[r][(128 * h + 32 * q + l) / 4] =
                live ? q6_word(q & 1 ? ql1 : ql0, qh, q) : 0;
          }
        }
        const int8_t *scales = reinterpret_cast<const int8_t *>(b + 192);
#pragma unroll
        for (int i = 0; i < 4; ++i) w_scale[r][4 * part + i] = live ? scales[4 * part + i] : 0;
        if (part == 0) w_d[r][0] = live ? half_at(b + 208) : 0.0f;
      } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // blocks 2 part and 2 part + 1 of the step
          const int blk = 2 * part + i;
          const bool live = row < n && blk < legacy_blocks;
          const uint8_t *b = wr + static_cast<size_t>(8 * step + blk) * kQ8_0Bytes;
#pragma unroll
          for (int word = 0; word < 8; ++word) {
            tile_w[r][8 * blk + word] = live ? word2(b + 2 + 4 * word) : 0;
          }
          w_d[r][blk] = live ? half_at(b) : 0.0f;
        }
      }
    }
    __syncthreads();

    if constexpr (G::kK) {
      int dots[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) dots[i][jj] = 0;
#pragma unroll 1
      for (int grp = 0; grp < G::kGroups; ++grp) {
        int s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) s[i][jj] = 0;
#pragma unroll
        for (int word = 0; word < G::kGroupWords; ++word) {
          const int at = grp * G::kGroupWords + word;
          int a[4], b[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = tile_a[ty + 16 * i][at];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) b[jj] = tile_w[tx + 16 * jj][at];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) s[i][jj] = __dp4a(b[jj], a[i], s[i][jj]);
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int scale = w_scale[tx + 16 * jj][grp];
#pragma unroll
          for (int i = 0; i < 4; ++i) dots[i][jj] += scale * s[i][jj];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int c = tx + 16 * jj;
          int mins = 0;
          if constexpr (TYPE == kQ4_K) {
#pragma unroll
            for (int sub = 0; sub < 8; ++sub) mins += w_min[c][sub] * a_sums[r][sub];
          }
          const float dmin = TYPE == kQ4_K ? w_d[c][1] : 0.0f;
          acc[i][jj] = add(acc[i][jj], k_block(w_d[c][0], dmin, a_scale[r][0], dots[i][jj], mins));
        }
      }
    } else {
#pragma unroll 1
      for (int blk = 0; blk < legacy_blocks; ++blk) {  // terms in block order
        int s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) s[i][jj] = 0;
#pragma unroll
        for (int word = 0; word < 8; ++word) {
          const int at = 8 * blk + word;
          int a[4], b[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = tile_a[ty + 16 * i][at];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) b[jj] = tile_w[tx + 16 * jj][at];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) s[i][jj] = __dp4a(b[jj], a[i], s[i][jj]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            acc[i][jj] = add(acc[i][jj], legacy_block(w_d[tx + 16 * jj][blk],
                                                      a_scale[ty + 16 * i][blk], s[i][jj]));
          }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = m0 + ty + 16 * i;
    if (row >= m) continue;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int col = n0 + tx + 16 * jj;
      if (col < n) y[static_cast<size_t>(row) * n + col] = bias ? add(acc[i][jj], bias[col])
                                                                : acc[i][jj];
    }
  }
}

}  // namespace kquant

// ---- entry points --------------------------------------------------------------------------
// Activations: x fp32 [M, K] -> qs int8 [M, K], d float [M, K/32 or K/256], bsums int16 [M, K/16].
// out[r, j] = act(y[r, j]) * y[r, half + j] for r < m, j < half (act: glu.h's kind).
extern "C" __global__ void kquant_glu(int kind, const float *y, float *out, int m, int half) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(m) * half) return;
  const int64_t r = i / half, j = i % half;
  const float g = y[r * 2 * half + j], u = y[r * 2 * half + half + j];
  out[i] = kind == elk::glu::kGeluTanh ? elk::glu::gated<elk::glu::kGeluTanh>(g, u)
                                       : elk::glu::gated<elk::glu::kSilu>(g, u);
}

extern "C" __global__ void kquant_quantize_q8_0(const float *x, int8_t *qs, float *d, int k) {
  kquant::quantize_q8_0(x, qs, d, k);
}

extern "C" __global__ void kquant_quantize_q8_K(const float *x, int8_t *qs, float *d,
                                                int16_t *bsums, int k) {
  kquant::quantize_q8_K(x, qs, d, bsums, k);
}

// y fp32 [M, N] (+ bias [N], or null) = W (uint8 [N, row bytes] of GGUF blocks) x the
// quantized activations; M <= 4.
extern "C" __global__ void kquant_gemv_q4_K(const uint8_t *w, const int8_t *qs, const float *d,
                                            const int16_t *bsums, const float *bias, float *y,
                                            int m, int n, int k) {
  kquant::gemv_q4_K(w, qs, d, bsums, bias, y, m, n, k);
}

extern "C" __global__ void kquant_gemv_q6_K(const uint8_t *w, const int8_t *qs, const float *d,
                                            const float *bias, float *y, int m, int n, int k) {
  kquant::gemv_q6_K(w, qs, d, bias, y, m, n, k);
}

extern "C" __global__ void kquant_gemv_q8_0(const uint8_t *w, const int8_t *qs, const float *d,
                                            const float *bias, float *y, int m, int n, int k) {
  kquant::gemv_q8_0(w, qs, d, bias, y, m, n, k);
}

// The same for any M (bsums only for Q4_K; Q6_K and Q8_0 take null).
extern "C" __global__ void __launch_bounds__(256) kquant_gemm_q4_K(
    const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, const float *bias,
    float *y, int m, int n, int k) {
  kquant::gemm<kquant::kQ4_K>(w, qs, d, bsums, bias, y, m, n, k);
}

extern "C" __global__ void __launch_bounds__(256) kquant_gemm_q6_K(
    const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, const float *bias,
    float *y, int m, int n, int k) {
  kquant::gemm<kquant::kQ6_K>(w, qs, d, bsums, bias, y, m, n, k);
}

extern "C" __global__ void __launch_bounds__(256) kquant_gemm_q8_0(
    const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, const float *bias,
    float *y, int m, int n, int k) {
  kquant::gemm<kquant::kQ8_0>(w, qs, d, bsums, bias, y, m, n, k);
}

// ---- host side: what the ORT op calls -------------------------------------------------------
namespace kquant {
namespace {

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

struct Scratch {
  int8_t *qs;
  float *d;
  int16_t *bsums;
};

bool valid(int type, int64_t m, int64_t n, int64_t k) {
  const int64_t per = type == kQ8_0 ? QK : QK_K;
  if (type != kQ8_0 && type != kQ4_K && type != kQ6_K) return false;
  // K and N index as int; M rows as grid.x of the quantization and ceil(M/64) as grid.y.
  return m >= 0 && m <= 65535LL * BM && n > 0 && n <= 0x7fffffffLL && k > 0 && k % per == 0 &&
         k <= 0x7fffffffLL && k / QK_K < 65535;
}

Scratch carve(int type, int64_t m, int64_t k, void *scratch) {
  uint8_t *p = static_cast<uint8_t *>(scratch);
  Scratch s{reinterpret_cast<int8_t *>(p), nullptr, nullptr};
  p += round_up(static_cast<size_t>(m * k));
  s.d = reinterpret_cast<float *>(p);
  p += round_up(static_cast<size_t>(m * (k / (type == kQ8_0 ? QK : QK_K))) * sizeof(float));
  if (type != kQ8_0) s.bsums = reinterpret_cast<int16_t *>(p);
  return s;
}

}  // namespace
}  // namespace kquant

extern "C" size_t kquant_cuda_scratch_bytes(int type, int64_t m, int64_t k) {
  using namespace kquant;
  if (!valid(type, m, 1, k)) return 0;
  const bool k_type = type != kQ8_0;
  return round_up(static_cast<size_t>(m * k)) +
         round_up(static_cast<size_t>(m * (k / (k_type ? QK_K : QK))) * sizeof(float)) +
         (k_type ? round_up(static_cast<size_t>(m * (k / 16)) * sizeof(int16_t)) : 0);
}

// Y [M, N] = A [M, K] x W^T (+ bias [N]); every pointer on the device, scratch of
// kquant_cuda_scratch_bytes(type, M, K) bytes. Queues the work on stream and returns 0, -1
// for arguments it does not take (type, K, sizes), or the CUDA error of a launch.
extern "C" int kquant_cuda_matmul(int type, const float *a, const uint8_t *w, const float *bias,
                                  float *y, int64_t m, int64_t n, int64_t k, void *scratch,
                                  cudaStream_t stream) {
  using namespace kquant;
  if (!valid(type, m, n, k)) return -1;
  if (m == 0) return 0;
  const Scratch s = carve(type, m, k, scratch);
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  const dim3 quantize_grid(static_cast<unsigned>(m), static_cast<unsigned>((k + 255) / 256));
  if (type == kQ8_0) {
    KQUANT_LAUNCH(kquant_quantize_q8_0, quantize_grid, 256, stream, a, s.qs, s.d, ki);
  } else {
    KQUANT_LAUNCH(kquant_quantize_q8_K, quantize_grid, 256, stream, a, s.qs, s.d, s.bsums, ki);
  }
  if (m <= kMaxGemvRows) {
    const unsigned grid = static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps);
    const unsigned threads = 32 * kGemvWarps;
    switch (type) {
      case kQ4_K:
        KQUANT_LAUNCH(kquant_gemv_q4_K, grid, threads, stream, w, s.qs, s.d, s.bsums, bias, y,
                      mi, ni, ki);
        break;
      case kQ6_K:
        KQUANT_LAUNCH(kquant_gemv_q6_K, grid, threads, stream, w, s.qs, s.d, bias, y, mi, ni,
                      ki);
        break;
      default:
        KQUANT_LAUNCH(kquant_gemv_q8_0, grid, threads, stream, w, s.qs, s.d, bias, y, mi, ni,
                      ki);
        break;
    }
  } else {
    const dim3 grid(static_cast<unsigned>((n + BN - 1) / BN),
                    static_cast<unsigned>((m + BM - 1) / BM));
    switch (type) {
      case kQ4_K:
        KQUANT_LAUNCH(kquant_gemm_q4_K, grid, 256, stream, w, s.qs, s.d, s.bsums, bias, y, mi,
                      ni, ki);
        break;
      case kQ6_K:
        KQUANT_LAUNCH(kquant_gemm_q6_K, grid, 256, stream, w, s.qs, s.d, nullptr, bias, y, mi,
                      ni, ki);
        break;
      default:
        KQUANT_LAUNCH(kquant_gemm_q8_0, grid, 256, stream, w, s.qs, s.d, nullptr, bias, y, mi,
                      ni, ki);
        break;
    }
  }
  return static_cast<int>(cudaGetLastError());
}

extern "C" int kquant_cuda_glu(int kind, const float *y, float *out, int64_t m, int64_t half,
                               cudaStream_t stream) {
  if ((kind != elk::glu::kSilu && kind != elk::glu::kGeluTanh) || m <= 0 || half <= 0 ||
      m * half > INT32_MAX) {
    return -1;
  }
  const unsigned grid = static_cast<unsigned>((m * half + 255) / 256);
  KQUANT_LAUNCH(kquant_glu, grid, 256, stream, kind, y, out, static_cast<int>(m),
                static_cast<int>(half));
  return static_cast<int>(cudaGetLastError());
}

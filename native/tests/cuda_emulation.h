// A CPU stand-in for the CUDA that kernels/kquant.cu uses, so that its kernels and launcher (the
// same source text, compiled as C++ without __CUDACC__) run on a machine with no GPU:
//   - a launch runs the grid's blocks one after another; each CUDA thread of a block is a fiber
//     on the calling thread, switched only at barriers, so threadIdx and blockIdx
//     are the running fiber's and __shared__ arrays (function statics) are the block's;
//   - __syncthreads is a barrier of the block's threads, and a warp shuffle a barrier of the
//     warp's 32 threads around a slot per lane, so warp-synchronous code runs as on a GPU; a
//     barrier that some threads never reach (divergence) aborts with a message;
//   - the intrinsics are their documented definitions: __dp4a the int32 sum of 4 signed byte
//     products, __vsub4 bytewise wrapping subtraction, __fmul_rn/__fadd_rn/__fsub_rn/__fdiv_rn
//     IEEE single operations rounded to nearest (this file is built with -ffp-contract=off),
//     __float2int_rn round to nearest even, fp16 conversions blocks.h's exact ones.
//   - for the older kernels (int4_gemv, rmsnorm, rope, kv_int8) and the GPU check's harness
//     (gpu_check.cu): __ldg a plain load, __shfl_down_sync, uint4, rsqrtf, and the runtime
//     calls the harness makes (device memory is host memory, events read a steady clock).
// What this cannot check: the real GPU's scheduling, memory model and timing.
#pragma once

#include <ucontext.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "blocks.h"

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using cudaStream_t = void *;
enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char *cudaGetErrorString(cudaError_t e) { return e ? "out of memory" : "no error"; }
enum cudaMemcpyKind { cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
inline cudaError_t cudaMalloc(void **p, size_t bytes) {
  *p = std::malloc(bytes ? bytes : 1);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFree(void *p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void *to, const void *from, size_t bytes, cudaMemcpyKind) {
  std::memcpy(to, from, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void *p, int value, size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
using cudaEvent_t = std::chrono::steady_clock::time_point *;
inline cudaError_t cudaEventCreate(cudaEvent_t *e) {
  *e = new std::chrono::steady_clock::time_point();
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  *e = std::chrono::steady_clock::now();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(*end - *start).count();
  return cudaSuccess;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

// Fiber switches: a few lines of assembly that swap the callee-saved registers and the stack
// pointer (glibc's swapcontext also makes a signal-mask system call each time, which made the
// check minutes long); ucontext on other architectures.
#if defined(__x86_64__) || defined(__aarch64__)
#define EMU_FAST_SWITCH 1
extern "C" void emu_switch(void **save_sp, void *load_sp);
#if defined(__x86_64__)
asm(R"(
  .text
  .globl emu_switch
  .type emu_switch, @function
emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch, .-emu_switch
)");
#else
asm(R"(
  .text
  .globl emu_switch
  .type emu_switch, %function
emu_switch:
  sub sp, sp, #160
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #160
  ret
  .size emu_switch, .-emu_switch
)");
#endif
#endif

namespace emu {

struct Barrier {
  unsigned count, arrived = 0;
  unsigned long long generation = 0;
};

struct Warp {
  Barrier barrier{32};
  uint32_t slot[32] = {};
};

struct Fiber {
#ifdef EMU_FAST_SWITCH
  void *sp = nullptr;
#else
  ucontext_t context;
#endif
  std::vector<char> stack;
  unsigned index = 0;
  bool done = false;
  const Barrier *waiting = nullptr;  // resumes once its generation moves past wait_for
  unsigned long long wait_for = 0;
};

inline dim3 grid_dim, block_dim, thread_idx, block_idx;
#ifdef EMU_FAST_SWITCH
inline void *scheduler_sp = nullptr;
#else
inline ucontext_t scheduler;
#endif
inline Fiber *current = nullptr;
inline Barrier block_barrier{0};
inline std::vector<Warp> warps;
inline const std::function<void()> *body = nullptr;

inline void to_scheduler() {
#ifdef EMU_FAST_SWITCH
  emu_switch(&current->sp, scheduler_sp);
#else
  swapcontext(&current->context, &scheduler);
#endif
}

inline void to_fiber(Fiber &f) {
#ifdef EMU_FAST_SWITCH
  emu_switch(&scheduler_sp, f.sp);
#else
  swapcontext(&scheduler, &f.context);
#endif
}

inline void fiber_entry() {
  (*body)();
  current->done = true;
#ifdef EMU_FAST_SWITCH
  to_scheduler();  // never resumed
  std::abort();
#endif
}  // ucontext: returning resumes the scheduler (uc_link)

inline void start_fiber(Fiber &f) {
#ifdef EMU_FAST_SWITCH
  const uintptr_t top = reinterpret_cast<uintptr_t>(f.stack.data() + f.stack.size()) &
                        ~static_cast<uintptr_t>(15);
  void **sp = reinterpret_cast<void **>(top);
#if defined(__x86_64__)
  *--sp = nullptr;  // fiber_entry's return address: it never returns
  *--sp = reinterpret_cast<void *>(&fiber_entry);
  for (int i = 0; i < 6; ++i) *--sp = nullptr;  // rbp rbx r12-r15
#else
  sp -= 20;  // the 160-byte frame emu_switch restores: x30 (at 88) = fiber_entry
  std::memset(sp, 0, 160);
  sp[11] = reinterpret_cast<void *>(&fiber_entry);
#endif
  f.sp = sp;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack.data();
  f.context.uc_stack.ss_size = f.stack.size();
  f.context.uc_link = &scheduler;
  makecontext(&f.context, fiber_entry, 0);
#endif
  f.done = false;
  f.waiting = nullptr;
}

inline void arrive_and_wait(Barrier &barrier) {
  const unsigned long long generation = barrier.generation;
  if (++barrier.arrived == barrier.count) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  current->waiting = &barrier;
  current->wait_for = generation;
  to_scheduler();
}

template <typename T>
T exchange(T value, int source) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  Warp &warp = warps[thread_idx.x / 32];
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  warp.slot[thread_idx.x & 31] = bits;
  arrive_and_wait(warp.barrier);
  const uint32_t got = warp.slot[source & 31];
  arrive_and_wait(warp.barrier);
  T out;
  std::memcpy(&out, &got, 4);
  return out;
}

// One block: its fibers run until each has finished, switched only at barriers.
inline void run_block(std::vector<Fiber> &fibers, const dim3 &block) {
  block_idx = block;
  block_barrier = Barrier{static_cast<unsigned>(fibers.size())};
  warps.assign(fibers.size() / 32, Warp{});
  for (Fiber &f : fibers) start_fiber(f);
  for (size_t left = fibers.size(); left > 0;) {
    bool moved = false;
    for (Fiber &f : fibers) {
      if (f.done || (f.waiting && f.waiting->generation == f.wait_for)) continue;
      f.waiting = nullptr;
      current = &f;
      thread_idx = dim3(f.index);
      to_fiber(f);
      moved = true;
      if (f.done) --left;
    }
    if (!moved) {
      std::fprintf(stderr, "cuda_emulation: block (%u, %u, %u): %zu threads wait at a barrier "
                   "the others never reach\n", block.x, block.y, block.z, left);
      std::abort();
    }
  }
}

// Runs kernel(args...) over the grid, a block at a time, blockDim.x (a multiple of 32) fibers.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, Args... args) {
  grid_dim = grid;
  block_dim = block;
  const std::function<void()> run = [&] { kernel(args...); };
  body = &run;
  std::vector<Fiber> fibers(block.x);
  for (unsigned t = 0; t < block.x; ++t) {
    fibers[t].index = t;
    fibers[t].stack.resize(64 * 1024);
  }
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) run_block(fibers, dim3(x, y, z));
    }
  }
}

}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define KQUANT_LAUNCH(kernel, grid, block, stream, ...) \
  ((void)(stream), emu::launch(kernel, dim3(grid), dim3(block), __VA_ARGS__))

inline void __syncthreads() { emu::arrive_and_wait(emu::block_barrier); }
template <typename T>
T __shfl_sync(unsigned, T value, int source) { return emu::exchange(value, source); }
template <typename T>
T __shfl_xor_sync(unsigned, T value, int mask) {
  return emu::exchange(value, static_cast<int>(threadIdx.x & 31) ^ mask);
}
// A lane whose source is past lane 31 keeps its own value (CUDA's rule).
template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta) {
  const unsigned source = (threadIdx.x & 31) + delta;
  const T got = emu::exchange(value, static_cast<int>(source & 31));
  return source < 32 ? got : value;
}
template <typename T>
T __ldg(const T *p) { return *p; }
struct uint4 {
  unsigned x, y, z, w;
};
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) {
    c += static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i)) *
         static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i));
  }
  return c;
}
inline unsigned __vsub4(unsigned a, unsigned b) {
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) out |= (((a >> (8 * i)) - (b >> (8 * i))) & 0xffu) << (8 * i);
  return out;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __int2float_rn(int v) { return static_cast<float>(v); }
inline int __float2int_rn(float v) { return static_cast<int>(std::nearbyint(v)); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct __half {
  uint16_t bits;
};
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline float __half2float(__half h) { return elk::fp16_to_fp32(h.bits); }
inline __half __float2half_rn(float f) { return __half{elk::fp32_to_fp16(f)}; }

// The older kernels include <cuda_fp16.h> themselves: built as C++ (gpu_check.cu with -I
// native/tests/cuda_shim, no __CUDACC__), that include is cuda_emulation.h's __half.
#pragma once
#include "../cuda_emulation.h"

// elk_glu (ref.h): the gated activation of glu.h over a row. Built with -fno-trapping-math
// (CMakeLists.txt), which lets the compiler vectorize glu.h's clamps as selects: the values are
// IEEE's either way, lane by lane the same operations as the scalar loop and the CUDA kernel.
#include "edge_llm_kquant/ref.h"
#include "glu.h"

extern "C" int elk_glu(int kind, const float *gate, const float *up, float *out, int64_t n) {
  // Plain loops over glu.h's branch-free element: the compiler vectorizes them, lane by lane
  // the same operations, so every element has the same bits wherever it falls.
  switch (kind) {
    case elk::glu::kSilu:
      for (int64_t j = 0; j < n; ++j) out[j] = elk::glu::gated<elk::glu::kSilu>(gate[j], up[j]);
      return 0;
    case elk::glu::kGeluTanh:
      for (int64_t j = 0; j < n; ++j) {
        out[j] = elk::glu::gated<elk::glu::kGeluTanh>(gate[j], up[j]);
      }
      return 0;
    default:
      return -1;
  }
}

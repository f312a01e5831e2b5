// int8 dot products of one query row against consecutive key rows (attention_i8.h's
// elk_i8_dots_fn): the scalar reference. One path per instruction set lives in that set's
// file (avx2.cpp, avx512.cpp, neon_dotprod.cpp); dispatch.cpp's elk_i8_dots picks one at run
// time, only on a CPU that has it. The sums are exact int32 ones (|x| <= 127, n <= 512), so
// every path gives the reference's bits.
#include <cstdint>

#include "kernels.h"

namespace elk {

void i8_dots_scalar(const int8_t *a, const int8_t *b, int64_t n, int64_t count, int32_t *out) {
  for (int64_t j = 0; j < count; ++j) {
    const int8_t *k = b + j * n;
    int32_t sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<int32_t>(a[i]) * k[i];
    out[j] = sum;
  }
}

}  // namespace elk

// Mamba-2 over a per-slot state (see mamba2.h): the scalar definition. Every output element is
// one sum in one fixed order (-ffp-contract=off: no fused multiply-adds), a row's tokens are
// taken one at a time, so a row's bits do not depend on its batch, on the calls its tokens
// came in, or on the threads.
#include "edge_llm_kquant/mamba2.h"

#include <cmath>
#include <cstring>

// x86-64: an AVX2 clone next to the baseline one, picked at load time (ifunc). Every loop
// below that the compiler may vectorize runs across independent elements (head dims p), each
// summed in the same order in either clone: the same bits (ELK_GDN_BASELINE builds the
// baseline alone: native/tests/mamba2_check.cpp compares the two).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ELK_GDN_BASELINE)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// ggml's softplus (ggml_compute_softplus_f32).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace

extern "C" {

ELK_CLONES void elk_mamba2_scan_rows(const elk_mamba2_shape *shape, const elk_row *row,
                                     int64_t h, const float *conv, const float *z,
                                     const float *dt, const float *dt_bias, const float *a,
                                     const float *d, int64_t state_floats, float *state,
                                     float *y) {
  const int64_t hd = shape->head_dim, nh = shape->heads, ns = shape->d_state;
  const int64_t inner = nh * hd, channels = inner + 2 * shape->groups * ns;
  const int64_t g = h / (nh / shape->groups);
  float *s_mat = state + row->slot * state_floats + (shape->kernel - 1) * channels +
                 h * ns * hd;
  if (row->start == 0) std::memset(s_mat, 0, static_cast<size_t>(ns * hd) * sizeof(float));
  float xdt[ELK_MAMBA2_MAX_HEAD], o[ELK_MAMBA2_MAX_HEAD];
  for (int64_t s = 0; s < row->length; ++s) {
    const int64_t t = row->offset + s;
    const float *in = conv + t * channels;
    const float *x = in + h * hd;
    const float *b = in + inner + g * ns;
    const float *c = in + inner + shape->groups * ns + g * ns;
    const float step = softplus(dt[t * nh + h] + dt_bias[h]);
    const float decay = std::exp(step * a[h]);
    for (int64_t p = 0; p < hd; ++p) {
      xdt[p] = x[p] * step;
      o[p] = 0.0f;
    }
    // One pass over the state (its memory traffic: 32 KiB a head at 64 x 128): S[n][p] =
    // S[n][p] decay + B[n] xdt[p], o[p] += S[n][p] C[n], from n = 0 up.
    for (int64_t n = 0; n < ns; ++n) {
      float *m = s_mat + n * hd;
      const float bn = b[n], cn = c[n];
      for (int64_t p = 0; p < hd; ++p) {
        m[p] = m[p] * decay + bn * xdt[p];
        o[p] += m[p] * cn;
      }
    }
    const float dh = d[h];
    const float *gate = z + t * inner + h * hd;
    float *out = y + t * inner + h * hd;
    for (int64_t p = 0; p < hd; ++p) out[p] = silu(gate[p]) * (o[p] + x[p] * dh);
  }
}

ELK_CLONES void elk_mamba2_norm_rows(const elk_mamba2_shape *shape, const elk_row *row,
                                     int64_t g, const float *norm, float *y) {
  const int64_t inner = shape->heads * shape->head_dim, width = inner / shape->groups;
  for (int64_t s = 0; s < row->length; ++s) {
    float *v = y + (row->offset + s) * inner + g * width;
    const float *w = norm + g * width;
    double sq = 0.0;
    for (int64_t j = 0; j < width; ++j) sq += static_cast<double>(v[j] * v[j]);
    const float mean = static_cast<float>(sq / static_cast<double>(width));
    const float inv = 1.0f / std::sqrt(mean + shape->eps);
    for (int64_t j = 0; j < width; ++j) v[j] = (v[j] * inv) * w[j];
  }
}

}  // extern "C"

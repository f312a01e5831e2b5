// Gated DeltaNet over a per-slot state (see gated_delta.h): the scalar definition. Every
// output element is one sum in one fixed order (-ffp-contract=off: no fused multiply-adds),
// a row's tokens are taken one at a time, so a row's bits do not depend on its batch, on the
// calls its tokens came in, or on the threads.
#include "edge_llm_kquant/gated_delta.h"

#include "edge_llm_kquant/causal_conv.h"

#include <cmath>
#include <cstring>

// x86-64: an AVX2 clone next to the baseline one, picked at load time (ifunc). Every loop
// below that the compiler may vectorize runs across independent elements (value dims j,
// channels), each summed in the same order in either clone: the same bits (ELK_GDN_BASELINE
// builds the baseline alone: native/tests/gated_delta_check.cpp compares the two).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ELK_GDN_BASELINE)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// ggml's op_softplus.
inline float softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// llama.cpp's build_gdn_l2_norm: rms_norm(x, eps / n) / sqrt(n) (the squares summed in
// double, in order), written to y.
void l2_norm(const float *x, int64_t n, float eps, float *y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float fn = static_cast<float>(n);
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps / fn);
  const float root = 1.0f / std::sqrt(fn);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * root;
}

}  // namespace

extern "C" {

void elk_gdn_conv_rows(const elk_gdn_shape *shape, const elk_row *row, int64_t c0, int64_t c1,
                       const float *qkv, const float *weight, int64_t state_floats, float *state,
                       float *conv) {
  const int64_t channels = (2 * shape->k_heads + shape->v_heads) * shape->head_dim;
  elk_causal_conv_rows(channels, shape->kernel, row, c0, c1, qkv, weight, nullptr,
                       state_floats, state, conv);
}

ELK_CLONES void elk_gdn_delta_rows(const elk_gdn_shape *shape, const elk_row *row, int64_t h,
                                   const float *conv, const float *z, const float *alpha,
                                   const float *beta, const float *dt_bias, const float *a,
                                   const float *norm, int64_t state_floats, float *state,
                                   float *y) {
  const int64_t d = shape->head_dim, hk = shape->k_heads, hv = shape->v_heads;
  const int64_t channels = (2 * hk + hv) * d;
  const int64_t kh = h % hk;  // ggml_gated_delta_net: value head h reads key head h % k_heads
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // S [i][j] (i: key dim, j: value dim), so every step below runs across j.
  float *s_mat = state + row->slot * state_floats + (shape->kernel - 1) * channels + h * d * d;
  if (row->start == 0) std::memset(s_mat, 0, static_cast<size_t>(d * d) * sizeof(float));
  float q[ELK_GDN_MAX_HEAD], k[ELK_GDN_MAX_HEAD], delta[ELK_GDN_MAX_HEAD], o[ELK_GDN_MAX_HEAD];
  for (int64_t s = 0; s < row->length; ++s) {
    const int64_t t = row->offset + s;
    const float *in = conv + t * channels;
    l2_norm(in + kh * d, d, shape->eps, q);
    l2_norm(in + (hk + kh) * d, d, shape->eps, k);
    const float *v = in + (2 * hk + h) * d;
    const float decay = std::exp(softplus(alpha[t * hv + h] + dt_bias[h]) * a[h]);
    const float b = sigmoid(beta[t * hv + h]);
    // Two passes over the state (it is the op's memory traffic: 64 KiB a head at d = 128):
    // S *= decay with delta[j] = (v[j] - sum_i S[i][j] k[i]) * b, then S[i][j] += k[i] *
    // delta[j] with o[j] = (sum_i S[i][j] q[i]) * scale; each sum from i = 0 up, from 0.0f.
    for (int64_t j = 0; j < d; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      float *m = s_mat + i * d;
      for (int64_t j = 0; j < d; ++j) {
        m[j] *= decay;
        o[j] += m[j] * k[i];
      }
    }
    for (int64_t j = 0; j < d; ++j) {
      delta[j] = (v[j] - o[j]) * b;
      o[j] = 0.0f;
    }
    for (int64_t i = 0; i < d; ++i) {
      float *m = s_mat + i * d;
      for (int64_t j = 0; j < d; ++j) {
        m[j] += k[i] * delta[j];
        o[j] += m[j] * q[i];
      }
    }
    for (int64_t j = 0; j < d; ++j) o[j] = o[j] * scale;
    // Gated RMSNorm: ggml_rms_norm (squares summed in double), the weight, then silu(z).
    double sq = 0.0;
    for (int64_t j = 0; j < d; ++j) sq += static_cast<double>(o[j] * o[j]);
    const float mean = static_cast<float>(sq / static_cast<double>(d));
    const float inv = 1.0f / std::sqrt(mean + shape->eps);
    const float *gate = z + t * hv * d + h * d;
    float *out = y + t * hv * d + h * d;
    for (int64_t j = 0; j < d; ++j) out[j] = ((o[j] * inv) * norm[j]) * silu(gate[j]);
  }
}

}  // extern "C"

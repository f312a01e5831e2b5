// Gated DeltaNet over a per-slot state (see gated_delta.h): the scalar definition. Every
// output element is one sum in one fixed order (-ffp-contract=off: no fused multiply-adds),
// a row's tokens are taken one at a time, so a row's bits do not depend on its batch, on the
// calls its tokens came in, or on the threads.
//
// The definition (delta_rows_reference, built alone with ELK_GDN_BASELINE) sweeps a head's
// whole state twice a token. The delta rule keeps each value column j of S apart (S[:, j]
// reads only k, q, v[j], the decay and beta), so the op's loop (delta_tile) takes a tile of
// columns at a time through a run of tokens: their state (d x tile floats) stays in the
// first-level cache and their sums in registers, loaded and stored once a token (two sweeps a
// token of the whole 64 KiB state at d = 128 were the op's time), and each element sees the
// definition's operations in its order: the same bits (native/tests/gated_delta_check.cpp
// compares the two builds).
#include "edge_llm_kquant/gated_delta.h"

#include "edge_llm_kquant/causal_conv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// x86-64: AVX-512 and AVX2 clones next to the baseline one, picked at load time (ifunc).
// Every loop below that the compiler may vectorize runs across independent elements (value
// dims j, channels), each summed in the same order in every clone: the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(ELK_GDN_BASELINE)
#define ELK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

// ggml's op_softplus.
inline float softplus(float x) { return x > 20.0f ? x : std::log(1.0f + std::exp(x)); }

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The squares x[r][i] * x[r][i] summed in double from i = 0 up, for `count` vectors of n
// (each sum in its own order; four at a time in registers, so their adds' latencies overlap).
inline void sum_squares(const float *const *x, int64_t count, int64_t n, double *sum) {
  int64_t r = 0;
  for (; r + 4 <= count; r += 4) {
    const float *x0 = x[r], *x1 = x[r + 1], *x2 = x[r + 2], *x3 = x[r + 3];
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      s0 += static_cast<double>(x0[i] * x0[i]);
      s1 += static_cast<double>(x1[i] * x1[i]);
      s2 += static_cast<double>(x2[i] * x2[i]);
      s3 += static_cast<double>(x3[i] * x3[i]);
    }
    sum[r] = s0, sum[r + 1] = s1, sum[r + 2] = s2, sum[r + 3] = s3;
  }
  for (; r < count; ++r) {
    double s0 = 0.0;
    for (int64_t i = 0; i < n; ++i) s0 += static_cast<double>(x[r][i] * x[r][i]);
    sum[r] = s0;
  }
}

// llama.cpp's build_gdn_l2_norm: rms_norm(x, eps / n) / sqrt(n), from x's sum of squares
// (sum_squares), written to y.
inline void l2_norm(const float *x, double sum, int64_t n, float eps, float *y) {
  const float fn = static_cast<float>(n);
  const float mean = static_cast<float>(sum / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps / fn);
  const float root = 1.0f / std::sqrt(fn);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * root;
}

// Gated RMSNorm of one token's head output o (already scaled), from o's sum of squares:
// ggml_rms_norm, the weight, then silu(z). `out` may be `o`.
inline void gated_norm(int64_t d, float eps, const float *o, double sq, const float *norm,
                       const float *gate, float *out) {
  const float mean = static_cast<float>(sq / static_cast<double>(d));
  const float inv = 1.0f / std::sqrt(mean + eps);
  // silu(z) = z / (1 + exp(-z)): the exps apart, so the loop around them vectorizes.
  float e[ELK_GDN_MAX_HEAD];
  for (int64_t j = 0; j < d; ++j) e[j] = std::exp(-gate[j]);
  for (int64_t j = 0; j < d; ++j) out[j] = ((o[j] * inv) * norm[j]) * (gate[j] / (1.0f + e[j]));
}

// One token's inputs: its q and k (before their L2 norms), its values, decay and beta.
struct TokenInputs {
  const float *q, *k, *v;  // the token's heads in the conv output
  float decay, b;
};

inline TokenInputs token_inputs(const elk_gdn_shape *shape, int64_t h, int64_t t,
                                const float *conv, const float *alpha, const float *beta,
                                const float *dt_bias, const float *a) {
  const int64_t d = shape->head_dim, hk = shape->k_heads, hv = shape->v_heads;
  const int64_t channels = (2 * hk + hv) * d;
  const int64_t kh = h % hk;  // ggml_gated_delta_net: value head h reads key head h % k_heads
  const float *in = conv + t * channels;
  return TokenInputs{in + kh * d, in + (hk + kh) * d, in + (2 * hk + h) * d,
                     std::exp(softplus(alpha[t * hv + h] + dt_bias[h]) * a[h]),
                     sigmoid(beta[t * hv + h])};
}

#ifdef ELK_GDN_BASELINE
// The definition: token by token, two passes over the head's state S [i][j] (i: key dim,
// j: value dim): S *= decay with delta[j] = (v[j] - sum_i S[i][j] k[i]) * b, then
// S[i][j] += k[i] * delta[j] with o[j] = (sum_i S[i][j] q[i]) * scale; each sum from i = 0
// up, from 0.0f.
void delta_rows_reference(const elk_gdn_shape *shape, const elk_row *row, int64_t h,
                          const float *conv, const float *z, const float *alpha,
                          const float *beta, const float *dt_bias, const float *a,
                          const float *norm, float *s_mat, float *y) {
  const int64_t d = shape->head_dim, hv = shape->v_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float q[ELK_GDN_MAX_HEAD], k[ELK_GDN_MAX_HEAD], delta[ELK_GDN_MAX_HEAD], o[ELK_GDN_MAX_HEAD];
  for (int64_t s = 0; s < row->length; ++s) {
    const int64_t t = row->offset + s;
    const TokenInputs in = token_inputs(shape, h, t, conv, alpha, beta, dt_bias, a);
    double sum;
    sum_squares(&in.q, 1, d, &sum);
    l2_norm(in.q, sum, d, shape->eps, q);
    sum_squares(&in.k, 1, d, &sum);
    l2_norm(in.k, sum, d, shape->eps, k);
    for (int64_t j = 0; j < d; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      float *m = s_mat + i * d;
      for (int64_t j = 0; j < d; ++j) {
        m[j] *= in.decay;
        o[j] += m[j] * k[i];
      }
    }
    for (int64_t j = 0; j < d; ++j) {
      delta[j] = (in.v[j] - o[j]) * in.b;
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
    const float *o_ptr = o;
    sum_squares(&o_ptr, 1, d, &sum);
    gated_norm(d, shape->eps, o, sum, norm, z + t * hv * d + h * d, y + t * hv * d + h * d);
  }
}
#else
// Tokens a run takes (their q, k, decay and beta computed once).
constexpr int64_t kRun = 32;
// A tile takes two vectors of value columns. Their width is the machine's register: GCC
// lowers a vector wider than the registers lane by lane through the stack (16 floats in the
// AVX2 clone made the op 34 % of a Qwen3.5-2B prefill, against 4 % with 8). Each lane is
// the definition's float expression whatever the width: the same bits.
// The lanes are a template's number, the vector type made inside it: a vector typedef passed
// as a template argument loses its aligned(4), and the state is not 32-byte aligned.
template <int kLanes>
constexpr int64_t tile_cols() { return 2 * kLanes; }

// Columns [j0, j0 + tile_cols) of S through the run's tokens: the definition's two passes per
// token (elementwise vector operations: each lane is the definition's float expression),
// o * scale written to out (the head's output of each token, normed afterwards). A token's
// second pass and the next token's first are one sweep (an element's operations keep their
// order, and the two sums are apart): the state is loaded and stored once a token.
template <int kLanes>
__attribute__((always_inline)) inline void delta_tile(int64_t d, int64_t j0, int64_t run,
                                                      const float *qs, const float *ks,
                                                      const TokenInputs *ins, float scale,
                                                      float *s_mat, float *const *outs) {
  typedef float vcols __attribute__((vector_size(kLanes * sizeof(float)), aligned(4),
                                     may_alias));
  vcols o0 = vcols{}, o1 = vcols{};  // sum_i S[i][j] k[i] of token s (after its decay)
  {
    const float *k = ks;
    const vcols decay = vcols{} + ins[0].decay;
    for (int64_t i = 0; i < d; ++i) {
      vcols *m = reinterpret_cast<vcols *>(s_mat + i * d + j0);
      const vcols m0 = m[0] * decay, m1 = m[1] * decay;
      m[0] = m0;
      m[1] = m1;
      o0 += m0 * k[i];
      o1 += m1 * k[i];
    }
  }
  for (int64_t s = 0; s < run; ++s) {
    const float *q = qs + s * d, *k = ks + s * d;
    const vcols *v = reinterpret_cast<const vcols *>(ins[s].v + j0);
    const vcols delta0 = (v[0] - o0) * ins[s].b, delta1 = (v[1] - o1) * ins[s].b;
    vcols y0 = vcols{}, y1 = vcols{};
    if (s + 1 < run) {
      const float *kn = ks + (s + 1) * d;
      const vcols decay = vcols{} + ins[s + 1].decay;
      o0 = vcols{};
      o1 = vcols{};
      for (int64_t i = 0; i < d; ++i) {
        vcols *m = reinterpret_cast<vcols *>(s_mat + i * d + j0);
        const vcols u0 = m[0] + k[i] * delta0, u1 = m[1] + k[i] * delta1;
        y0 += u0 * q[i];
        y1 += u1 * q[i];
        const vcols m0 = u0 * decay, m1 = u1 * decay;
        m[0] = m0;
        m[1] = m1;
        o0 += m0 * kn[i];
        o1 += m1 * kn[i];
      }
    } else {
      for (int64_t i = 0; i < d; ++i) {
        vcols *m = reinterpret_cast<vcols *>(s_mat + i * d + j0);
        const vcols u0 = m[0] + k[i] * delta0, u1 = m[1] + k[i] * delta1;
        m[0] = u0;
        m[1] = u1;
        y0 += u0 * q[i];
        y1 += u1 * q[i];
      }
    }
    vcols *out = reinterpret_cast<vcols *>(outs[s] + j0);
    out[0] = y0 * scale;
    out[1] = y1 * scale;
  }
}

// The same for one column j (head sizes that are not a multiple of the tile).
__attribute__((always_inline)) inline void delta_column(int64_t d, int64_t j, int64_t run,
                                                        const float *qs, const float *ks,
                                                        const TokenInputs *ins, float scale,
                                                        float *s_mat, float *const *outs) {
  for (int64_t s = 0; s < run; ++s) {
    const float *q = qs + s * d, *k = ks + s * d;
    float o = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      float &m = s_mat[i * d + j];
      m *= ins[s].decay;
      o += m * k[i];
    }
    const float delta = (ins[s].v[j] - o) * ins[s].b;
    o = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      float &m = s_mat[i * d + j];
      m += k[i] * delta;
      o += m * q[i];
    }
    outs[s][j] = o * scale;
  }
}
#endif

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
  float *s_mat = state + row->slot * state_floats + (shape->kernel - 1) * channels + h * d * d;
  if (row->start == 0) std::memset(s_mat, 0, static_cast<size_t>(d * d) * sizeof(float));
#ifdef ELK_GDN_BASELINE
  delta_rows_reference(shape, row, h, conv, z, alpha, beta, dt_bias, a, norm, s_mat, y);
#else
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<float> qk(static_cast<size_t>(2 * kRun * d));
  float *qs = qk.data(), *ks = qk.data() + kRun * d;
  TokenInputs ins[kRun];
  const float *vecs[kRun];
  float *outs[kRun];
  double sums[kRun];
  for (int64_t s0 = 0; s0 < row->length; s0 += kRun) {
    const int64_t run = std::min(kRun, row->length - s0);
    for (int64_t s = 0; s < run; ++s) {
      const int64_t t = row->offset + s0 + s;
      ins[s] = token_inputs(shape, h, t, conv, alpha, beta, dt_bias, a);
      outs[s] = y + t * hv * d + h * d;
    }
    for (int64_t s = 0; s < run; ++s) vecs[s] = ins[s].q;
    sum_squares(vecs, run, d, sums);
    for (int64_t s = 0; s < run; ++s) l2_norm(ins[s].q, sums[s], d, shape->eps, qs + s * d);
    for (int64_t s = 0; s < run; ++s) vecs[s] = ins[s].k;
    sum_squares(vecs, run, d, sums);
    for (int64_t s = 0; s < run; ++s) l2_norm(ins[s].k, sums[s], d, shape->eps, ks + s * d);
    int64_t j = 0;
#if defined(__x86_64__)
    // The AVX-512 clone runs on AVX-512 CPUs only (16-float registers there); the others 8.
    static const bool wide = __builtin_cpu_supports("avx512f");
    if (wide) {
      for (; j + tile_cols<16>() <= d; j += tile_cols<16>()) {
        delta_tile<16>(d, j, run, qs, ks, ins, scale, s_mat, outs);
      }
    }
    for (; j + tile_cols<8>() <= d; j += tile_cols<8>()) {
      delta_tile<8>(d, j, run, qs, ks, ins, scale, s_mat, outs);
    }
#else
    for (; j + tile_cols<4>() <= d; j += tile_cols<4>()) {
      delta_tile<4>(d, j, run, qs, ks, ins, scale, s_mat, outs);
    }
#endif
    for (; j < d; ++j) delta_column(d, j, run, qs, ks, ins, scale, s_mat, outs);
    for (int64_t s = 0; s < run; ++s) vecs[s] = outs[s];
    sum_squares(vecs, run, d, sums);
    for (int64_t s = 0; s < run; ++s) {
      const int64_t t = row->offset + s0 + s;
      gated_norm(d, shape->eps, outs[s], sums[s], norm, z + t * hv * d + h * d, outs[s]);
    }
  }
#endif
}

}  // extern "C"

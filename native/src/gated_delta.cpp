// Gated DeltaNet over a per-slot state (see gated_delta.h): the chunked form. Every output
// element is one sum in one fixed order (-ffp-contract=off: no fused multiply-adds), and a
// token's sums depend only on its chunk position, never on the call it came in, so a row's
// bits do not depend on its batch, on how its tokens were split into calls, or on the threads.
//
// Three steps have a definition, one element at a time (s0_columns, token_columns,
// fold_columns), which the build with ELK_GDN_BASELINE runs alone, and register tiles that the
// clones run over the same operations in the same order: S0^T k and S0^T q of a chunk
// segment's tokens (s0_tiles: two tokens at a time; S0 is read, not written, until the chunk
// ends), a token's delta and output (token_tiles) and the chunk's fold (fold_tiles: four rows
// of S0 at a time). native/tests/gated_delta_check.cpp compares the two builds.

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

// One token's inputs: its q and k (before their L2 norms), its values, log decay and beta.
struct TokenInputs {
  const float *q, *k, *v;  // the token's heads in the conv output
  float log_decay, b;
};

inline TokenInputs token_inputs(const elk_gdn_shape *shape, int64_t h, int64_t t,
                                const float *conv, const float *alpha, const float *beta,
                                const float *dt_bias, const float *a) {
  const int64_t d = shape->head_dim, hk = shape->k_heads, hv = shape->v_heads;
  const int64_t channels = (2 * hk + hv) * d;
  const int64_t kh = h % hk;  // ggml_gated_delta_net: value head h reads key head h % k_heads
  const float *in = conv + t * channels;
  return TokenInputs{in + kh * d, in + (hk + kh) * d, in + (2 * hk + h) * d,
                     softplus(alpha[t * hv + h] + dt_bias[h]) * a[h],
                     sigmoid(beta[t * hv + h])};
}

// A value head's part of a slot's state (gated_delta.h).
struct HeadState {
  float *s0;  // [d][d]: the delta state at the chunk's first position
  float *kt;  // [d][chunk]: the chunk's normed keys, transposed
  float *u;   // [chunk][d]: the chunk's corrected values (the delta rule's deltas)
  float *l;   // [chunk]: the chunk's cumulative log decays
};

// The definition of S0^T k and S0^T q, value dims [j0, d): for each token and dim j,
// sum_i S0[i][j] k[i] from i = 0 up, from 0.0f.
inline void s0_columns(int64_t d, int64_t n, int64_t j0, const float *s0, const float *qs,
                       const float *ks, float *ak, float *aq) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = j0; j < d; ++j) {
      float sk = 0.0f, sq = 0.0f;
      for (int64_t i = 0; i < d; ++i) {
        sk += s0[i * d + j] * ks[t * d + i];
        sq += s0[i * d + j] * qs[t * d + i];
      }
      ak[t * d + j] = sk;
      aq[t * d + j] = sq;
    }
  }
}

#ifndef ELK_GDN_BASELINE
// The same sums over a tile of two vectors of value columns and kTokens tokens (4 kTokens
// sums in registers, two loads of S0 per key dim). The vectors' width is the machine's
// register (a wider one is lowered lane by lane through the stack); each lane is the
// definition's float expression whatever the width. The lanes are a template's number, the
// vector type made inside it: a vector typedef passed as a template argument loses its
// aligned(4).
template <int kLanes, int kTokens>
__attribute__((always_inline)) inline void s0_tile(int64_t d, int64_t t, const float *s0,
                                                   const float *qs, const float *ks, float *ak,
                                                   float *aq, int64_t j0) {
  typedef float vcols __attribute__((vector_size(kLanes * sizeof(float)), aligned(4),
                                     may_alias));
  vcols sk[kTokens][2], sq[kTokens][2];
  for (int r = 0; r < kTokens; ++r) sk[r][0] = sk[r][1] = sq[r][0] = sq[r][1] = vcols{};
  for (int64_t i = 0; i < d; ++i) {
    const vcols *m = reinterpret_cast<const vcols *>(s0 + i * d + j0);
    const vcols m0 = m[0], m1 = m[1];
    for (int r = 0; r < kTokens; ++r) {
      const float k = ks[(t + r) * d + i], q = qs[(t + r) * d + i];
      sk[r][0] += m0 * k;
      sk[r][1] += m1 * k;
      sq[r][0] += m0 * q;
      sq[r][1] += m1 * q;
    }
  }
  for (int r = 0; r < kTokens; ++r) {
    vcols *o = reinterpret_cast<vcols *>(ak + (t + r) * d + j0);
    o[0] = sk[r][0], o[1] = sk[r][1];
    o = reinterpret_cast<vcols *>(aq + (t + r) * d + j0);
    o[0] = sq[r][0], o[1] = sq[r][1];
  }
}

// Tiles of columns from j0 over all n tokens, two at a time: returns the first column not done.
template <int kLanes>
__attribute__((always_inline)) inline int64_t s0_tiles(int64_t d, int64_t n, const float *s0,
                                                       const float *qs, const float *ks,
                                                       float *ak, float *aq, int64_t j0) {
  for (; j0 + 2 * kLanes <= d; j0 += 2 * kLanes) {
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) s0_tile<kLanes, 2>(d, t, s0, qs, ks, ak, aq, j0);
    if (t < n) s0_tile<kLanes, 1>(d, t, s0, qs, ks, ak, aq, j0);
  }
  return j0;
}

__attribute__((always_inline)) inline void s0_products(int64_t d, int64_t n, const float *s0,
                                                       const float *qs, const float *ks,
                                                       float *ak, float *aq) {
  int64_t j = 0;
#if defined(__x86_64__)
  // The AVX-512 clone runs on AVX-512 CPUs only (16-float registers there); the others 8.
  static const bool wide = __builtin_cpu_supports("avx512f");
  if (wide) j = s0_tiles<16>(d, n, s0, qs, ks, ak, aq, j);
  j = s0_tiles<8>(d, n, s0, qs, ks, ak, aq, j);
#else
  j = s0_tiles<4>(d, n, s0, qs, ks, ak, aq, j);
#endif
  s0_columns(d, n, j, s0, qs, ks, ak, aq);  // head sizes that are not a multiple of the tile
}
#endif

// The token at chunk position c (its key in kt's column c, its cumulative log decay in l[c]):
// with g = exp(l[c]) and w[s] = exp(l[c] - l[s]) (the decay from token s to this one),
//   delta[j] = (v[j] - (g * ak[j] + sum_{s < c} (w[s] * (k_s . k)) * u[s][j])) * b,
//   o[j] = (g * aq[j] + sum_{s <= c} (w[s] * (k_s . q)) * u[s][j]) * scale,
// each sum from s = 0 up; delta is stored as u[c]. These are the recurrent form's delta and
// output of this token, S's terms expanded over the chunk (S_t = g S0 + sum w[s] k_s u[s]^T).
struct TokenTerms {
  float g;                             // exp(l[c])
  float ck[ELK_GDN_MAX_CHUNK];         // w[s] * (k_s . k), s < c
  float cq[ELK_GDN_MAX_CHUNK];         // w[s] * (k_s . q), s <= c
};

inline void token_terms(int64_t d, int64_t chunk, int64_t c, const HeadState &hs,
                        const float *q, const float *k, TokenTerms *terms) {
  float kk[ELK_GDN_MAX_CHUNK], qk[ELK_GDN_MAX_CHUNK];
  for (int64_t s = 0; s <= c; ++s) kk[s] = 0.0f, qk[s] = 0.0f;
  for (int64_t i = 0; i < d; ++i) {  // k_s . k and k_s . q, each from i = 0 up
    const float *col = hs.kt + i * chunk;
    const float ki = k[i], qi = q[i];
    for (int64_t s = 0; s <= c; ++s) {
      kk[s] += col[s] * ki;
      qk[s] += col[s] * qi;
    }
  }
  const float lc = hs.l[c];
  terms->g = std::exp(lc);
  for (int64_t s = 0; s <= c; ++s) {
    const float w = std::exp(lc - hs.l[s]);
    terms->ck[s] = w * kk[s];
    terms->cq[s] = w * qk[s];
  }
}

// Value dims [j0, d) of the token's delta and output, one at a time: the definition.
inline void token_columns(int64_t d, int64_t j0, int64_t c, const HeadState &hs,
                          const TokenTerms &terms, const float *ak, const float *aq,
                          const float *v, float b, float scale, float *out) {
  for (int64_t j = j0; j < d; ++j) {
    float x = terms.g * ak[j], o = terms.g * aq[j];
    for (int64_t s = 0; s < c; ++s) {
      const float u = hs.u[s * d + j];
      x += terms.ck[s] * u;
      o += terms.cq[s] * u;
    }
    const float delta = (v[j] - x) * b;
    hs.u[c * d + j] = delta;
    o += terms.cq[c] * delta;
    out[j] = o * scale;
  }
}

// The chunk's last token done: S0[i][j] = g * S0[i][j] + sum_s (w[s] * kt[i][s]) * u[s][j]
// from s = 0 up (g, w as in chunk_token at the last position): the delta state after the
// chunk, the next chunk's S0. coef [d][chunk] holds w[s] * kt[i][s].
inline void fold_coefficients(int64_t d, int64_t chunk, const HeadState &hs, float *g,
                              float *coef) {
  const float last = hs.l[chunk - 1];
  *g = std::exp(last);
  float w[ELK_GDN_MAX_CHUNK];
  for (int64_t s = 0; s < chunk; ++s) w[s] = std::exp(last - hs.l[s]);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t s = 0; s < chunk; ++s) coef[i * chunk + s] = w[s] * hs.kt[i * chunk + s];
  }
}

// Value dims [j0, d) of the fold, one at a time: the definition.
inline void fold_columns(int64_t d, int64_t chunk, int64_t j0, const HeadState &hs, float g,
                         const float *coef) {
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = j0; j < d; ++j) {
      float m = g * hs.s0[i * d + j];
      for (int64_t s = 0; s < chunk; ++s) m += coef[i * chunk + s] * hs.u[s * d + j];
      hs.s0[i * d + j] = m;
    }
  }
}

#ifndef ELK_GDN_BASELINE
// The same, a tile of two vectors of value dims at a time (their sums in registers, each lane
// the definition's float expression): returns the first dim not done.
template <int kLanes>
__attribute__((always_inline)) inline int64_t token_tiles(int64_t d, int64_t c,
                                                          const HeadState &hs,
                                                          const TokenTerms &terms,
                                                          const float *ak, const float *aq,
                                                          const float *v, float b, float scale,
                                                          float *out, int64_t j0) {
  typedef float vcols __attribute__((vector_size(kLanes * sizeof(float)), aligned(4),
                                     may_alias));
  for (; j0 + 2 * kLanes <= d; j0 += 2 * kLanes) {
    const vcols *a = reinterpret_cast<const vcols *>(ak + j0);
    const vcols *q = reinterpret_cast<const vcols *>(aq + j0);
    vcols x0 = terms.g * a[0], x1 = terms.g * a[1];
    vcols o0 = terms.g * q[0], o1 = terms.g * q[1];
    for (int64_t s = 0; s < c; ++s) {
      const vcols *u = reinterpret_cast<const vcols *>(hs.u + s * d + j0);
      const vcols u0 = u[0], u1 = u[1];
      x0 += terms.ck[s] * u0;
      x1 += terms.ck[s] * u1;
      o0 += terms.cq[s] * u0;
      o1 += terms.cq[s] * u1;
    }
    const vcols *vv = reinterpret_cast<const vcols *>(v + j0);
    const vcols delta0 = (vv[0] - x0) * b, delta1 = (vv[1] - x1) * b;
    vcols *uc = reinterpret_cast<vcols *>(hs.u + c * d + j0);
    uc[0] = delta0;
    uc[1] = delta1;
    o0 += terms.cq[c] * delta0;
    o1 += terms.cq[c] * delta1;
    vcols *y = reinterpret_cast<vcols *>(out + j0);
    y[0] = o0 * scale;
    y[1] = o1 * scale;
  }
  return j0;
}

// The fold over four rows of S0 and a tile of two vectors of value dims at a time.
template <int kLanes>
__attribute__((always_inline)) inline int64_t fold_tiles(int64_t d, int64_t chunk,
                                                         const HeadState &hs, float g,
                                                         const float *coef, int64_t j0) {
  typedef float vcols __attribute__((vector_size(kLanes * sizeof(float)), aligned(4),
                                     may_alias));
  for (; j0 + 2 * kLanes <= d; j0 += 2 * kLanes) {
    int64_t i = 0;
    for (; i + 4 <= d; i += 4) {
      vcols *m0 = reinterpret_cast<vcols *>(hs.s0 + i * d + j0);
      vcols *m1 = reinterpret_cast<vcols *>(hs.s0 + (i + 1) * d + j0);
      vcols *m2 = reinterpret_cast<vcols *>(hs.s0 + (i + 2) * d + j0);
      vcols *m3 = reinterpret_cast<vcols *>(hs.s0 + (i + 3) * d + j0);
      vcols a00 = g * m0[0], a01 = g * m0[1], a10 = g * m1[0], a11 = g * m1[1];
      vcols a20 = g * m2[0], a21 = g * m2[1], a30 = g * m3[0], a31 = g * m3[1];
      const float *c0 = coef + i * chunk, *c1 = c0 + chunk, *c2 = c1 + chunk, *c3 = c2 + chunk;
      for (int64_t s = 0; s < chunk; ++s) {
        const vcols *u = reinterpret_cast<const vcols *>(hs.u + s * d + j0);
        const vcols u0 = u[0], u1 = u[1];
        a00 += c0[s] * u0;
        a01 += c0[s] * u1;
        a10 += c1[s] * u0;
        a11 += c1[s] * u1;
        a20 += c2[s] * u0;
        a21 += c2[s] * u1;
        a30 += c3[s] * u0;
        a31 += c3[s] * u1;
      }
      m0[0] = a00, m0[1] = a01, m1[0] = a10, m1[1] = a11;
      m2[0] = a20, m2[1] = a21, m3[0] = a30, m3[1] = a31;
    }
    for (; i < d; ++i) {
      vcols *m = reinterpret_cast<vcols *>(hs.s0 + i * d + j0);
      vcols a0 = g * m[0], a1 = g * m[1];
      for (int64_t s = 0; s < chunk; ++s) {
        const vcols *u = reinterpret_cast<const vcols *>(hs.u + s * d + j0);
        a0 += coef[i * chunk + s] * u[0];
        a1 += coef[i * chunk + s] * u[1];
      }
      m[0] = a0, m[1] = a1;
    }
  }
  return j0;
}
#endif

// A token's delta, output (scaled) and state entries.
__attribute__((always_inline)) inline void chunk_token(int64_t d, int64_t chunk, int64_t c,
                                                       const HeadState &hs, const float *q,
                                                       const float *k, const float *ak,
                                                       const float *aq, const float *v,
                                                       float b, float scale, float *out) {
  TokenTerms terms;
  token_terms(d, chunk, c, hs, q, k, &terms);
  int64_t j = 0;
#ifndef ELK_GDN_BASELINE
#if defined(__x86_64__)
  static const bool wide = __builtin_cpu_supports("avx512f");
  if (wide) j = token_tiles<16>(d, c, hs, terms, ak, aq, v, b, scale, out, j);
  j = token_tiles<8>(d, c, hs, terms, ak, aq, v, b, scale, out, j);
#else
  j = token_tiles<4>(d, c, hs, terms, ak, aq, v, b, scale, out, j);
#endif
#endif
  token_columns(d, j, c, hs, terms, ak, aq, v, b, scale, out);
}

// The fold at the chunk's end; coef: d * chunk floats of scratch.
__attribute__((always_inline)) inline void fold_chunk(int64_t d, int64_t chunk,
                                                      const HeadState &hs, float *coef) {
  float g;
  fold_coefficients(d, chunk, hs, &g, coef);
  int64_t j = 0;
#ifndef ELK_GDN_BASELINE
#if defined(__x86_64__)
  static const bool wide = __builtin_cpu_supports("avx512f");
  if (wide) j = fold_tiles<16>(d, chunk, hs, g, coef, j);
  j = fold_tiles<8>(d, chunk, hs, g, coef, j);
#else
  j = fold_tiles<4>(d, chunk, hs, g, coef, j);
#endif
#endif
  fold_columns(d, chunk, j, hs, g, coef);
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
  const int64_t chunk = shape->chunk, channels = (2 * hk + hv) * d;
  float *head = state + row->slot * state_floats + (shape->kernel - 1) * channels +
                h * elk_gdn_head_floats(shape);
  const HeadState hs{head, head + d * d, head + d * d + d * chunk, head + d * d + 2 * d * chunk};
  if (row->start == 0) std::memset(hs.s0, 0, static_cast<size_t>(d * d) * sizeof(float));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // The segment's normed q and k, S0^T k and S0^T q ([tokens][d] each), the fold's scratch.
  std::vector<float> work(static_cast<size_t>(5 * chunk * d));
  float *qs = work.data(), *ks = qs + chunk * d, *ak = ks + chunk * d, *aq = ak + chunk * d;
  float *coef = aq + chunk * d;
  TokenInputs ins[ELK_GDN_MAX_CHUNK];
  const float *vecs[ELK_GDN_MAX_CHUNK];
  float *outs[ELK_GDN_MAX_CHUNK];
  double sums[ELK_GDN_MAX_CHUNK];
  for (int64_t s0 = 0, n = 0; s0 < row->length; s0 += n) {
    // The row's tokens in one chunk, from chunk position c0.
    const int64_t c0 = (row->start + s0) % chunk;
    n = std::min(chunk - c0, row->length - s0);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t t = row->offset + s0 + s;
      ins[s] = token_inputs(shape, h, t, conv, alpha, beta, dt_bias, a);
      outs[s] = y + t * hv * d + h * d;
    }
    for (int64_t s = 0; s < n; ++s) vecs[s] = ins[s].q;
    sum_squares(vecs, n, d, sums);
    for (int64_t s = 0; s < n; ++s) l2_norm(ins[s].q, sums[s], d, shape->eps, qs + s * d);
    for (int64_t s = 0; s < n; ++s) vecs[s] = ins[s].k;
    sum_squares(vecs, n, d, sums);
    for (int64_t s = 0; s < n; ++s) l2_norm(ins[s].k, sums[s], d, shape->eps, ks + s * d);
    for (int64_t i = 0; i < d; ++i) {
      float *col = hs.kt + i * chunk + c0;
      for (int64_t s = 0; s < n; ++s) col[s] = ks[s * d + i];
    }
    for (int64_t s = 0; s < n; ++s) {
      const int64_t c = c0 + s;
      hs.l[c] = c == 0 ? ins[s].log_decay : hs.l[c - 1] + ins[s].log_decay;
    }
#ifdef ELK_GDN_BASELINE
    s0_columns(d, n, 0, hs.s0, qs, ks, ak, aq);
#else
    s0_products(d, n, hs.s0, qs, ks, ak, aq);
#endif
    for (int64_t s = 0; s < n; ++s) {
      chunk_token(d, chunk, c0 + s, hs, qs + s * d, ks + s * d, ak + s * d, aq + s * d,
                  ins[s].v, ins[s].b, scale, outs[s]);
    }
    for (int64_t s = 0; s < n; ++s) vecs[s] = outs[s];
    sum_squares(vecs, n, d, sums);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t t = row->offset + s0 + s;
      gated_norm(d, shape->eps, outs[s], sums[s], norm, z + t * hv * d + h * d, outs[s]);
    }
    if (c0 + n == chunk) fold_chunk(d, chunk, hs, coef);
  }
}

}  // extern "C"

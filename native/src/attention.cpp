// Causal attention, one query row at a time (see attention.h). Every sum has one fixed
// order: a dot product keeps 8 partial sums (lane d % 8) joined in a fixed tree, softmax
// and the weighted values add positions in ascending order. The compiler may vectorize the
// independent lanes; it may not reorder a sum or fuse a multiply-add (-ffp-contract=off).
#include "edge_llm_kquant/attention.h"

#include "attention_common.h"

#include <cmath>
#include <cstring>

// x86-64: an AVX2 clone of each function next to the baseline one, picked at load time
// (ifunc). Both compute the same lane-wise IEEE operations in the same order (no FMA), so
// they give the same bits; AVX2 only does 8 lanes at once.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

constexpr int kLanes = 8;

inline float dot(const float *a, const float *b, int64_t n) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[d + l] * b[d + l];
  }
  for (int l = 0; d < n; ++d, ++l) acc[l] += a[d] * b[d];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// 8 floats in one vector (GCC's vector extension: one ymm in the AVX2 clone, two xmm in the
// baseline one); its operations are lane-wise IEEE ones, so a lane is dot()'s acc[l].
// The helpers taking and returning it are inlined: no call passes it across an ABI.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t LaneIndex __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load(const float *p) {
  Lanes x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

// dot()'s tree of each of a, b, c, d, into out[0..3]: pairs of lanes (x0 + x1, x2 + x3, ...),
// then pairs of pairs, then the two halves, each sum with dot()'s operands in dot()'s order.
inline void tree4(Lanes a, Lanes b, Lanes c, Lanes d, float *out) {
  const LaneIndex even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
  // [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7], and the same for c, d
  const Lanes ab = __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
  const Lanes cd = __builtin_shuffle(c, d, even) + __builtin_shuffle(c, d, odd);
  // [(a0+a1)+(a2+a3), b.., c.., d.., (a4+a5)+(a6+a7), b.., c.., d..]
  const Lanes sums = __builtin_shuffle(ab, cd, even) + __builtin_shuffle(ab, cd, odd);
  for (int r = 0; r < 4; ++r) out[r] = sums[r] + sums[r + 4];
}

// dot(a, b + r * n, n) for the 4 adjacent keys r = 0..3, each lane for lane dot()'s (the same
// products and sums in the same order, the same tail and tree): the same bits, with 4
// independent chains of adds kept in registers instead of one.
inline void dot4(const float *a, const float *b, int64_t n, float *out) {
  Lanes s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const Lanes x = load(a + d);
    s0 += x * load(b + d);
    s1 += x * load(b + n + d);
    s2 += x * load(b + 2 * n + d);
    s3 += x * load(b + 3 * n + d);
  }
  if (d < n) {  // head_dim not a multiple of 8: dot()'s tail, lane by lane
    for (int64_t i = d, l = 0; i < n; ++i, ++l) {
      s0[l] += a[i] * b[i];
      s1[l] += a[i] * b[n + i];
      s2[l] += a[i] * b[2 * n + i];
      s3[l] += a[i] * b[3 * n + i];
    }
  }
  tree4(s0, s1, s2, s3, out);
}

// dot4 for two queries a and b at once (two heads of one position): each key load serves
// both, 8 chains of adds. Each query's lanes, tail and tree are dot4's: the same bits.
inline void dot4x2(const float *a, const float *b, const float *k, int64_t n, float *out_a,
                   float *out_b) {
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const Lanes x = load(a + d), z = load(b + d);
    Lanes key = load(k + d);
    a0 += x * key;
    b0 += z * key;
    key = load(k + n + d);
    a1 += x * key;
    b1 += z * key;
    key = load(k + 2 * n + d);
    a2 += x * key;
    b2 += z * key;
    key = load(k + 3 * n + d);
    a3 += x * key;
    b3 += z * key;
  }
  if (d < n) {
    for (int64_t i = d, l = 0; i < n; ++i, ++l) {
      a0[l] += a[i] * k[i];
      a1[l] += a[i] * k[n + i];
      a2[l] += a[i] * k[2 * n + i];
      a3[l] += a[i] * k[3 * n + i];
      b0[l] += b[i] * k[i];
      b1[l] += b[i] * k[n + i];
      b2[l] += b[i] * k[2 * n + i];
      b3[l] += b[i] * k[3 * n + i];
    }
  }
  tree4(a0, a1, a2, a3, out_a);
  tree4(b0, b1, b2, b3, out_b);
}

// y += p[r] x v[r] for r = 0..3 in that order, element by element (each product and sum
// rounded as elk_attention_row's y[i] += p x value[i], one position after the other).
inline void accumulate4(float *y, const float *p, const float *v, int64_t n) {
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];  // y's stores may alias p
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes acc = load(y + i);
    acc += p0 * load(v + i);
    acc += p1 * load(v + n + i);
    acc += p2 * load(v + 2 * n + i);
    acc += p3 * load(v + 3 * n + i);
    std::memcpy(y + i, &acc, sizeof(acc));
  }
  for (; i < n; ++i) {
    y[i] += p0 * v[i];
    y[i] += p1 * v[n + i];
    y[i] += p2 * v[2 * n + i];
    y[i] += p3 * v[3 * n + i];
  }
}
// accumulate4 for two queries (two heads of one position): each value load serves both.
inline void accumulate4x2(float *y, float *z, const float *p, const float *q, const float *v,
                          int64_t n) {
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];  // y's stores may alias p, q
  const float q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes acc = load(y + i), bcc = load(z + i), value = load(v + i);
    acc += p0 * value;
    bcc += q0 * value;
    value = load(v + n + i);
    acc += p1 * value;
    bcc += q1 * value;
    value = load(v + 2 * n + i);
    acc += p2 * value;
    bcc += q2 * value;
    value = load(v + 3 * n + i);
    acc += p3 * value;
    bcc += q3 * value;
    std::memcpy(y + i, &acc, sizeof(acc));
    std::memcpy(z + i, &bcc, sizeof(bcc));
  }
  for (; i < n; ++i) {
    for (int r = 0; r < 4; ++r) {
      const float pr = r == 0 ? p0 : r == 1 ? p1 : r == 2 ? p2 : p3;
      const float qr = r == 0 ? q0 : r == 1 ? q1 : r == 2 ? q2 : q3;
      y[i] += pr * v[r * n + i];
      z[i] += qr * v[r * n + i];
    }
  }
}
#pragma GCC diagnostic pop

// Keys per tile of elk_attention_block: 16 KiB of them (half an L1), at least 8.
inline int64_t tile_keys(int64_t d) {
  const int64_t keys = 16384 / (d * static_cast<int64_t>(sizeof(float)));
  return keys < 8 ? 8 : keys;
}

}  // namespace

extern "C" {

ELK_CLONES void elk_attention_store(const elk_attention_shape *shape, const elk_row *row,
                                    int64_t h, const float *k, const float *v,
                                    int64_t kv_stride, const float *cos, const float *sin,
                                    float *key_buffer, float *value_buffer) {
  const int64_t d = shape->head_dim, half = d / 2;
  const int64_t base = (row->slot * shape->kv_heads + h) * shape->capacity * d;
  float normed[512];  // head_dim <= 512, checked by the op
  for (int64_t s = 0; s < row->length; ++s) {
    const int64_t pos = row->start + s;
    const int64_t token = (row->offset + s) * kv_stride + h * d;
    const int64_t r = rope_row(shape, row, s);
    rotate(head_norm(k + token, shape->k_norm, shape->norm_eps, d, normed), cos + r * half,
           sin + r * half, d, key_buffer + base + pos * d);
    std::memcpy(value_buffer + base + pos * d, v + token, static_cast<size_t>(d) * sizeof(float));
  }
}

ELK_CLONES void elk_attention_row(const elk_attention_shape *shape, const elk_row *row,
                                  int64_t s, int64_t h, const float *q, int64_t q_stride,
                                  const float *cos, const float *sin, const float *key_buffer,
                                  const float *value_buffer, float *scratch, float *out) {
  const int64_t d = shape->head_dim, half = d / 2;
  const int64_t kv = h / (shape->num_heads / shape->kv_heads);
  const int64_t pos = row->start + s;
  const int64_t first = first_key(shape, pos);
  const float *keys = key_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  const float *values = value_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  float normed[512], rotated[512];  // head_dim <= 512, checked by the op
  const int64_t r = rope_row(shape, row, s);
  rotate(head_norm(q + (row->offset + s) * q_stride + h * d, shape->q_norm, shape->norm_eps,
                   d, normed),
         cos + r * half, sin + r * half, d, rotated);
  // The last key the query sees: itself, or its row's last position when bidirectional.
  const int64_t last = row->bidirectional ? row->start + row->length - 1 : pos;
  const int64_t n = last + 1 - first;
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    scratch[j] = dot(rotated, keys + (first + j) * d, d) * shape->scale;
    if (scratch[j] > top) top = scratch[j];
  }
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scratch[j] = softmax_exp(scratch[j] - top);
    total += scratch[j];
  }
  float *y = out + (row->offset + s) * shape->num_heads * d + h * d;
  for (int64_t i = 0; i < d; ++i) y[i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = scratch[j];
    const float *value = values + (first + j) * d;
    for (int64_t i = 0; i < d; ++i) y[i] += p * value[i];
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) y[i] *= inv;
}

int64_t elk_attention_block_scratch(const elk_attention_shape *shape, const elk_row *row,
                                    int64_t s_begin, int64_t s_end, int64_t heads) {
  const int64_t lo = first_key(shape, row->start + s_begin);
  const int64_t hi = row->bidirectional ? row->start + row->length - 1 : row->start + s_end - 1;
  return (s_end - s_begin) * heads * (shape->head_dim + 1 + (hi + 1 - lo));
}

// elk_attention_row's arithmetic for every (position, head) of the block, query c = (s -
// s_begin) x heads + (h - h_begin), with the loops turned inside out so each tile of keys
// (then values) is read from memory once for all of them instead of once per query. Each
// query still runs elk_attention_row's operations in its order: dot() lanes and tree per
// score, max then exp and total in ascending position, y += p x value in ascending position
// (4 positions a pass, added one by one), then y x (1 / total). Hence its bits.
ELK_CLONES void elk_attention_block(const elk_attention_shape *shape, const elk_row *row,
                                    int64_t s_begin, int64_t s_end, int64_t h_begin,
                                    int64_t h_end, const float *q, int64_t q_stride,
                                    const float *cos, const float *sin,
                                    const float *key_buffer, const float *value_buffer,
                                    float *scratch, float *out) {
  const int64_t d = shape->head_dim, half = d / 2;
  const int64_t kv = h_begin / (shape->num_heads / shape->kv_heads);
  const int64_t heads = h_end - h_begin, count = (s_end - s_begin) * heads;
  const int64_t lo = first_key(shape, row->start + s_begin);
  const int64_t row_last = row->start + row->length - 1;
  const int64_t hi = row->bidirectional ? row_last : row->start + s_end - 1;
  const int64_t span = hi + 1 - lo, tile = tile_keys(d);
  const float *keys = key_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  const float *values = value_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  // scratch: rotated queries [count, d], 1 / total [count], scores [count, span] (query c's
  // position p at c x span + p - lo).
  float *rotated = scratch, *inv = scratch + count * d, *scores = inv + count;
  float normed[512];  // head_dim <= 512, checked by the op
  for (int64_t c = 0; c < count; ++c) {
    const int64_t s = s_begin + c / heads, h = h_begin + c % heads;
    const int64_t r = rope_row(shape, row, s);
    rotate(head_norm(q + (row->offset + s) * q_stride + h * d, shape->q_norm, shape->norm_eps,
                     d, normed),
           cos + r * half, sin + r * half, d, rotated + c * d);
  }
  // Query c sees positions first_key(pos) .. last (its own, or the row's last when
  // bidirectional); a tile outside them is skipped for that query alone.
  auto range = [&](int64_t c, int64_t t0, int64_t t1, int64_t *b, int64_t *e) {
    const int64_t pos = row->start + s_begin + c / heads;
    const int64_t first = first_key(shape, pos), last = row->bidirectional ? row_last : pos;
    *b = t0 > first ? t0 : first;
    *e = t1 < last + 1 ? t1 : last + 1;
  };
  for (int64_t t0 = lo; t0 <= hi; t0 += tile) {
    const int64_t t1 = t0 + tile < hi + 1 ? t0 + tile : hi + 1;
    for (int64_t c = 0; c < count;) {
      // Two heads of one position see the same keys: a pair shares each key load.
      const int64_t pair = c % heads + 1 < heads ? 2 : 1;
      int64_t j, e;
      range(c, t0, t1, &j, &e);
      float *score = scores + c * span - lo, *score_b = score + span;
      const float *query = rotated + c * d;
      if (pair == 2) {
        for (; j + 4 <= e; j += 4) {
          dot4x2(query, query + d, keys + j * d, d, score + j, score_b + j);
          for (int r = 0; r < 4; ++r) {
            score[j + r] = score[j + r] * shape->scale;
            score_b[j + r] = score_b[j + r] * shape->scale;
          }
        }
        for (; j < e; ++j) {
          score[j] = dot(query, keys + j * d, d) * shape->scale;
          score_b[j] = dot(query + d, keys + j * d, d) * shape->scale;
        }
      } else {
        for (; j + 4 <= e; j += 4) {
          dot4(query, keys + j * d, d, score + j);
          for (int r = 0; r < 4; ++r) score[j + r] = score[j + r] * shape->scale;
        }
        for (; j < e; ++j) score[j] = dot(query, keys + j * d, d) * shape->scale;
      }
      c += pair;
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    int64_t first, end;
    range(c, lo, hi + 1, &first, &end);
    float *score = scores + c * span - lo;
    float top = -INFINITY;
    for (int64_t j = first; j < end; ++j) {
      if (score[j] > top) top = score[j];
    }
    // The exps (a loop that vectorizes), then their total in the same ascending order.
    for (int64_t j = first; j < end; ++j) score[j] = softmax_exp(score[j] - top);
    float total = 0.0f;
    for (int64_t j = first; j < end; ++j) total += score[j];
    inv[c] = 1.0f / total;
    float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
               (h_begin + c % heads) * d;
    for (int64_t i = 0; i < d; ++i) y[i] = 0.0f;
  }
  for (int64_t t0 = lo; t0 <= hi; t0 += tile) {
    const int64_t t1 = t0 + tile < hi + 1 ? t0 + tile : hi + 1;
    for (int64_t c = 0; c < count;) {
      const int64_t pair = c % heads + 1 < heads ? 2 : 1;
      int64_t j, e;
      range(c, t0, t1, &j, &e);
      const float *p = scores + c * span - lo, *p_b = p + span;
      float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
                 (h_begin + c % heads) * d;
      if (pair == 2) {
        for (; j + 4 <= e; j += 4) accumulate4x2(y, y + d, p + j, p_b + j, values + j * d, d);
      } else {
        for (; j + 4 <= e; j += 4) accumulate4(y, p + j, values + j * d, d);
      }
      for (int64_t k = 0; k < pair; ++k) {
        for (int64_t i = j; i < e; ++i) {
          const float pi = p[k * span + i], *value = values + i * d;
          for (int64_t m = 0; m < d; ++m) y[k * d + m] += pi * value[m];
        }
      }
      c += pair;
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
               (h_begin + c % heads) * d;
    for (int64_t i = 0; i < d; ++i) y[i] *= inv[c];
  }
}

}  // extern "C"

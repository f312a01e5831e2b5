// Causal attention over int8 KV buffers (see attention_i8.h). A query's operations and their
// order: norm and rotary (attention_common.h), q8 = its int8 row with scale q_scale; per key j
// score = float(q8 . k8_j) x ((q_scale x scale) x k_scale_j) (the integer dot exact, from
// the dots picked by the caller); top, exp and total over positions in ascending order as
// attention.cpp; y += (p_j x v_scale_j) x float(v8_j) element by element in ascending
// position, then y x (1 / total). elk_attention_block_i8 runs the same operations per query,
// in tiles of keys shared by a block of queries: the same bits (native/tests/attention_check).
#include "edge_llm_kquant/attention_i8.h"

#include <cmath>
#include <cstring>

#include "attention_common.h"

// As attention.cpp: an AVX2 clone beside the baseline, the same lane-wise IEEE operations.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ELK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ELK_CLONES
#endif

namespace {

// Keys a tile of elk_attention_block_i8 holds: 16 KiB of int8 rows, at least 8.
inline int64_t tile_keys_i8(int64_t d) {
  const int64_t keys = 16384 / d;
  return keys < 8 ? 8 : keys;
}

// The first row of (slot, kv head) in the buffers, in rows of head_dim.
inline int64_t head_base(const elk_attention_shape *shape, const elk_row *row, int64_t kv) {
  return (row->slot * shape->kv_heads + kv) * shape->capacity;
}

// y[i] += w[r] x float(v_r[i]) for the positions r = 0 .. count - 1 (count <= 4) in order,
// element by element: each y[i] sees the adds one position after the other.
inline void accumulate_i8(float *y, const float *w, const int8_t *v, int64_t d, int64_t count) {
  if (count == 4) {
    const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    const int8_t *v0 = v, *v1 = v + d, *v2 = v + 2 * d, *v3 = v + 3 * d;
    for (int64_t i = 0; i < d; ++i) {
      float acc = y[i];
      acc += w0 * static_cast<float>(v0[i]);
      acc += w1 * static_cast<float>(v1[i]);
      acc += w2 * static_cast<float>(v2[i]);
      acc += w3 * static_cast<float>(v3[i]);
      y[i] = acc;
    }
    return;
  }
  for (int64_t r = 0; r < count; ++r) {
    const float wr = w[r];
    const int8_t *vr = v + r * d;
    for (int64_t i = 0; i < d; ++i) y[i] += wr * static_cast<float>(vr[i]);
  }
}

// max|x| / 127 per row, rounded to nearest (ties to even); inlined into each caller's clone,
// so the library's own calls bind inside it (a call to the ifunc goes through the PLT).
__attribute__((always_inline)) inline float quantize_row(const float *x, int64_t n,
                                                         int8_t *q) {
  float top = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    top = a > top ? a : top;
  }
  const float scale = top / 127.0f;
  const float safe = scale > 0.0f ? scale : 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    float r = std::nearbyint(x[i] / safe);  // the default rounding: to nearest, ties to even
    r = r < -127.0f ? -127.0f : r;
    r = r > 127.0f ? 127.0f : r;
    q[i] = static_cast<int8_t>(r);
  }
  return scale;
}

// The query of token s, head h: normed, rotated, quantized into q8; returns q_scale x scale.
inline float quantized_query(const elk_attention_shape *shape, const elk_row *row, int64_t s,
                             int64_t h, const float *q, int64_t q_stride, const float *cos,
                             const float *sin, int8_t *q8) {
  const int64_t d = shape->head_dim, half = d / 2, r = rope_row(shape, row, s);
  float normed[512], rotated[512];  // head_dim <= 512, checked by the op
  rotate(head_norm(q + (row->offset + s) * q_stride + h * d, shape->q_norm, shape->norm_eps,
                   d, normed),
         cos + r * half, sin + r * half, d, rotated);
  return quantize_row(rotated, d, q8) * shape->scale;
}

}  // namespace

extern "C" {

ELK_CLONES float elk_quantize_i8(const float *x, int64_t n, int8_t *q) {
  return quantize_row(x, n, q);
}

ELK_CLONES void elk_attention_store_i8(const elk_attention_shape *shape, const elk_row *row,
                                       int64_t h, const float *k, const float *v,
                                       int64_t kv_stride, const float *cos, const float *sin,
                                       const elk_kv_i8 *kv) {
  const int64_t d = shape->head_dim, half = d / 2, base = head_base(shape, row, h);
  float normed[512], rotated[512];  // head_dim <= 512, checked by the op
  for (int64_t s = 0; s < row->length; ++s) {
    const int64_t at = base + row->start + s, r = rope_row(shape, row, s);
    const int64_t token = (row->offset + s) * kv_stride + h * d;
    rotate(head_norm(k + token, shape->k_norm, shape->norm_eps, d, normed), cos + r * half,
           sin + r * half, d, rotated);
    kv->key_scales[at] = quantize_row(rotated, d, kv->keys + at * d);
    kv->value_scales[at] = quantize_row(v + token, d, kv->values + at * d);
  }
}

size_t elk_attention_row_i8_scratch(const elk_attention_shape *shape) {
  return static_cast<size_t>(shape->capacity) * (sizeof(float) + sizeof(int32_t));
}

ELK_CLONES void elk_attention_row_i8(const elk_attention_shape *shape, const elk_row *row,
                                     int64_t s, int64_t h, const float *q, int64_t q_stride,
                                     const float *cos, const float *sin, const elk_kv_i8 *kv,
                                     elk_i8_dots_fn dots, void *scratch, float *out) {
  const int64_t d = shape->head_dim, pos = row->start + s;
  const int64_t kv_head = h / (shape->num_heads / shape->kv_heads);
  const int64_t base = head_base(shape, row, kv_head), first = first_key(shape, pos);
  const int64_t last = row->bidirectional ? row->start + row->length - 1 : pos;
  const int64_t n = last + 1 - first;
  int8_t q8[512];
  const float qk = quantized_query(shape, row, s, h, q, q_stride, cos, sin, q8);
  float *score = static_cast<float *>(scratch);
  int32_t *idot = reinterpret_cast<int32_t *>(score + shape->capacity);
  dots(q8, kv->keys + (base + first) * d, d, n, idot);
  const float *key_scale = kv->key_scales + base + first;
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    score[j] = static_cast<float>(idot[j]) * (qk * key_scale[j]);
    top = score[j] > top ? score[j] : top;
  }
  for (int64_t j = 0; j < n; ++j) score[j] = softmax_exp(score[j] - top);
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) total += score[j];
  const float *value_scale = kv->value_scales + base + first;
  for (int64_t j = 0; j < n; ++j) score[j] = score[j] * value_scale[j];  // the weights
  float *y = out + (row->offset + s) * shape->num_heads * d + h * d;
  for (int64_t i = 0; i < d; ++i) y[i] = 0.0f;
  const int8_t *values = kv->values + (base + first) * d;
  for (int64_t j = 0; j < n; j += 4) {
    accumulate_i8(y, score + j, values + j * d, d, n - j < 4 ? n - j : 4);
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) y[i] *= inv;
}

size_t elk_attention_block_i8_scratch(const elk_attention_shape *shape, const elk_row *row,
                                      int64_t s_begin, int64_t s_end, int64_t heads) {
  const int64_t lo = first_key(shape, row->start + s_begin);
  const int64_t hi = row->bidirectional ? row->start + row->length - 1 : row->start + s_end - 1;
  const int64_t count = (s_end - s_begin) * heads, d = shape->head_dim;
  // floats: q_scale x scale and 1 / total [count], scores [count, span]; int32 dots [tile];
  // int8 queries [count, d] last.
  const int64_t floats = count * (2 + (hi + 1 - lo)) + tile_keys_i8(d);
  return static_cast<size_t>(floats) * sizeof(float) + static_cast<size_t>(count * d);
}

ELK_CLONES void elk_attention_block_i8(const elk_attention_shape *shape, const elk_row *row,
                                       int64_t s_begin, int64_t s_end, int64_t h_begin,
                                       int64_t h_end, const float *q, int64_t q_stride,
                                       const float *cos, const float *sin,
                                       const elk_kv_i8 *kv, elk_i8_dots_fn dots,
                                       void *scratch, float *out) {
  const int64_t d = shape->head_dim;
  const int64_t kv_head = h_begin / (shape->num_heads / shape->kv_heads);
  const int64_t heads = h_end - h_begin, count = (s_end - s_begin) * heads;
  const int64_t lo = first_key(shape, row->start + s_begin);
  const int64_t row_last = row->start + row->length - 1;
  const int64_t hi = row->bidirectional ? row_last : row->start + s_end - 1;
  const int64_t span = hi + 1 - lo, tile = tile_keys_i8(d), base = head_base(shape, row, kv_head);
  float *qk = static_cast<float *>(scratch), *inv = qk + count, *scores = inv + count;
  int32_t *idot = reinterpret_cast<int32_t *>(scores + count * span);
  int8_t *q8 = reinterpret_cast<int8_t *>(idot + tile);
  for (int64_t c = 0; c < count; ++c) {
    qk[c] = quantized_query(shape, row, s_begin + c / heads, h_begin + c % heads, q, q_stride,
                            cos, sin, q8 + c * d);
  }
  auto range = [&](int64_t c, int64_t t0, int64_t t1, int64_t *b, int64_t *e) {
    const int64_t pos = row->start + s_begin + c / heads;
    const int64_t first = first_key(shape, pos), last = row->bidirectional ? row_last : pos;
    *b = t0 > first ? t0 : first;
    *e = t1 < last + 1 ? t1 : last + 1;
  };
  const int8_t *keys = kv->keys + base * d, *values = kv->values + base * d;
  const float *key_scale = kv->key_scales + base, *value_scale = kv->value_scales + base;
  for (int64_t t0 = lo; t0 <= hi; t0 += tile) {
    const int64_t t1 = t0 + tile < hi + 1 ? t0 + tile : hi + 1;
    for (int64_t c = 0; c < count; ++c) {
      int64_t j, e;
      range(c, t0, t1, &j, &e);
      if (j >= e) continue;
      dots(q8 + c * d, keys + j * d, d, e - j, idot);
      float *score = scores + c * span - lo;
      for (int64_t i = j; i < e; ++i) {
        score[i] = static_cast<float>(idot[i - j]) * (qk[c] * key_scale[i]);
      }
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    int64_t first, end;
    range(c, lo, hi + 1, &first, &end);
    float *score = scores + c * span - lo;
    float top = -INFINITY;
    for (int64_t j = first; j < end; ++j) top = score[j] > top ? score[j] : top;
    for (int64_t j = first; j < end; ++j) score[j] = softmax_exp(score[j] - top);
    float total = 0.0f;
    for (int64_t j = first; j < end; ++j) total += score[j];
    for (int64_t j = first; j < end; ++j) score[j] = score[j] * value_scale[j];
    inv[c] = 1.0f / total;
    float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
               (h_begin + c % heads) * d;
    for (int64_t i = 0; i < d; ++i) y[i] = 0.0f;
  }
  // Values: each query's positions in ascending order, 4 a pass from its first one (as
  // elk_attention_row_i8 groups them); a tile's edge may split a group of 4, which changes
  // nothing: accumulate_i8 adds one position after the other either way.
  for (int64_t t0 = lo; t0 <= hi; t0 += tile) {
    const int64_t t1 = t0 + tile < hi + 1 ? t0 + tile : hi + 1;
    for (int64_t c = 0; c < count; ++c) {
      int64_t j, e;
      range(c, t0, t1, &j, &e);
      const float *w = scores + c * span - lo;
      float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
                 (h_begin + c % heads) * d;
      for (; j < e; j += 4) accumulate_i8(y, w + j, values + j * d, d, e - j < 4 ? e - j : 4);
    }
  }
  for (int64_t c = 0; c < count; ++c) {
    float *y = out + (row->offset + s_begin + c / heads) * shape->num_heads * d +
               (h_begin + c % heads) * d;
    for (int64_t i = 0; i < d; ++i) y[i] *= inv[c];
  }
}

}  // extern "C"

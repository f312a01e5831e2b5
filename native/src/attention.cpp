// Causal attention, one query row at a time (see attention.h). Every sum has one fixed
// order: a dot product keeps 8 partial sums (lane d % 8) joined in a fixed tree, softmax
// and the weighted values add positions in ascending order. The compiler may vectorize the
// independent lanes; it may not reorder a sum or fuse a multiply-add (-ffp-contract=off).
#include "edge_llm_kquant/attention.h"

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

// Half-split rotary (GPT-NeoX / llama.cpp's NEOX mode, GQA's rotary_interleaved 0).
inline void rotate(const float *x, const float *cos, const float *sin, int64_t head_dim, float *y) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    y[i] = x1 * cos[i] - x2 * sin[i];
    y[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// ggml_rms_norm, then the weight: the squares summed in double in order, y = (x * scale) * w.
inline const float *head_norm(const float *x, const float *weight, float eps, int64_t d,
                              float *y) {
  if (weight == nullptr) return x;
  double sum = 0.0;
  for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(sum / static_cast<double>(d));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * scale) * weight[i];
  return y;
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
    rotate(head_norm(k + token, shape->k_norm, shape->norm_eps, d, normed), cos + pos * half,
           sin + pos * half, d, key_buffer + base + pos * d);
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
  const int64_t first =
      shape->window > 0 && pos + 1 > shape->window ? pos + 1 - shape->window : 0;
  const float *keys = key_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  const float *values = value_buffer + (row->slot * shape->kv_heads + kv) * shape->capacity * d;
  float normed[512], rotated[512];  // head_dim <= 512, checked by the op
  rotate(head_norm(q + (row->offset + s) * q_stride + h * d, shape->q_norm, shape->norm_eps,
                   d, normed),
         cos + pos * half, sin + pos * half, d, rotated);
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
    scratch[j] = std::exp(scratch[j] - top);
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

}  // extern "C"

// elk_attention_block against elk_attention_row (the per-query reference), bit for bit: random
// queries, keys and values over several head sizes (tails of dot's 8 lanes included), group
// sizes, windows, q/k norms, causal and bidirectional rows starting mid-buffer at a packed
// offset, contexts of one tile and of many (300, 1000 positions), blocks of any size and
// start (crossing tile edges) and any chunk of a group's heads. Each output is memcmp'd, and
// the block may write nothing but its own (position, head) outputs. Exit 1 on a difference.
// The int8 KV entries (attention_i8.h) the same way: elk_attention_block_i8 and
// elk_attention_row_i8 with every int8 dot this CPU has against elk_attention_row_i8 with the
// scalar dots, bit for bit, and elk_attention_store_i8 against elk_attention_store's rows
// quantized by elk_quantize_i8.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "edge_llm_kquant/attention.h"
#include "edge_llm_kquant/attention_i8.h"

namespace {

struct Case {
  int64_t heads, kv_heads, head_dim, capacity, window;
  bool norms;
  elk_row row;
  int64_t rope_per_token;  // 1: cos/sin rows by packed token (M-RoPE), not by position
};

std::vector<float> normal(std::mt19937 &rng, size_t n, float sigma) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> out(n);
  for (auto &x : out) x = dist(rng);
  return out;
}

const char *const kIsas[] = {"scalar", "avx2", "avx512_vnni", "neon_dotprod"};

// The int8 buffers of float keys and values: each row quantized alone.
struct Int8Buffers {
  std::vector<int8_t> keys, values;
  std::vector<float> key_scales, value_scales;
  elk_kv_i8 view() {
    return elk_kv_i8{keys.data(), values.data(), key_scales.data(), value_scales.data()};
  }
};

Int8Buffers quantized(const std::vector<float> &keys, const std::vector<float> &values,
                      int64_t d) {
  Int8Buffers out{std::vector<int8_t>(keys.size()), std::vector<int8_t>(values.size()),
                  std::vector<float>(keys.size() / d), std::vector<float>(values.size() / d)};
  for (size_t r = 0; r < out.key_scales.size(); ++r) {
    out.key_scales[r] = elk_quantize_i8(&keys[r * d], d, &out.keys[r * d]);
    out.value_scales[r] = elk_quantize_i8(&values[r * d], d, &out.values[r * d]);
  }
  return out;
}

// Returns the number of differing blocks (0: all equal).
int check(std::mt19937 &rng, const Case &c, int blocks) {
  const int64_t d = c.head_dim, group = c.heads / c.kv_heads, slots = c.row.slot + 2;
  const int64_t tokens = c.row.offset + c.row.length + 3, q_stride = c.heads * d + 5;
  std::vector<float> q_norm = normal(rng, d, 0.3f), k_norm = normal(rng, d, 0.3f);
  for (auto &x : q_norm) x += 1.0f;
  for (auto &x : k_norm) x += 1.0f;
  elk_attention_shape shape{c.heads, c.kv_heads, d, c.capacity, 0.7f / static_cast<float>(d),
                            c.window, c.norms ? q_norm.data() : nullptr,
                            c.norms ? k_norm.data() : nullptr, 1e-6f, c.rope_per_token};
  // Keys and values all over the buffers (history, and garbage no query may read).
  const size_t buffer = static_cast<size_t>(slots * c.kv_heads * c.capacity * d);
  std::vector<float> keys = normal(rng, buffer, 3.0f), values = normal(rng, buffer, 2.0f);
  std::vector<float> q = normal(rng, static_cast<size_t>(tokens * q_stride), 2.0f);
  std::vector<float> cos(static_cast<size_t>(c.capacity * d / 2)), sin(cos.size());
  for (int64_t p = 0; p < c.capacity; ++p) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double angle = static_cast<double>(p) / std::pow(1e4, 2.0 * i / d);
      cos[p * d / 2 + i] = static_cast<float>(std::cos(angle));
      sin[p * d / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  const size_t out_size = static_cast<size_t>(tokens * c.heads * d);
  std::vector<float> want(out_size, -12345.0f), got(out_size, -12345.0f);
  std::vector<float> row_scratch(static_cast<size_t>(c.capacity));
  Int8Buffers i8_buffers = quantized(keys, values, d);
  const elk_kv_i8 i8 = i8_buffers.view();
  std::vector<char> row_scratch_i8(elk_attention_row_i8_scratch(&shape));
  int failures = 0;
  for (int b = 0; b < blocks; ++b) {
    // Block 0: the whole row and group; then random blocks and head chunks.
    int64_t s_begin = 0, s_end = c.row.length, h_begin = 0, h_end = group;
    if (b > 0) {
      s_begin = static_cast<int64_t>(rng() % c.row.length);
      s_end = s_begin + 1 + static_cast<int64_t>(rng() % std::min<int64_t>(
                                c.row.length - s_begin, b % 2 ? 3 : 40));
      h_begin = static_cast<int64_t>(rng() % group);
      h_end = h_begin + 1 + static_cast<int64_t>(rng() % (group - h_begin));
    }
    const int64_t kv = static_cast<int64_t>(rng() % c.kv_heads);
    std::fill(want.begin(), want.end(), -12345.0f);
    std::fill(got.begin(), got.end(), -12345.0f);
    for (int64_t s = s_begin; s < s_end; ++s) {
      for (int64_t h = kv * group + h_begin; h < kv * group + h_end; ++h) {
        elk_attention_row(&shape, &c.row, s, h, q.data(), q_stride, cos.data(), sin.data(),
                          keys.data(), values.data(), row_scratch.data(), want.data());
      }
    }
    std::vector<float> scratch(static_cast<size_t>(elk_attention_block_scratch(
        &shape, &c.row, s_begin, s_end, h_end - h_begin)));
    elk_attention_block(&shape, &c.row, s_begin, s_end, kv * group + h_begin,
                        kv * group + h_end, q.data(), q_stride, cos.data(), sin.data(),
                        keys.data(), values.data(), scratch.data(), got.data());
    if (std::memcmp(want.data(), got.data(), out_size * sizeof(float)) != 0) {
      size_t i = 0;
      while (std::memcmp(&want[i], &got[i], sizeof(float)) == 0) ++i;
      std::printf("FAILED heads %ld/%ld d %ld window %ld norms %d row (slot %ld start %ld "
                  "length %ld bidirectional %ld) block s %ld..%ld heads %ld..%ld kv %ld: "
                  "output %zu is %.9g, the reference %.9g\n",
                  c.heads, c.kv_heads, d, c.window, c.norms, c.row.slot, c.row.start,
                  c.row.length, c.row.bidirectional, s_begin, s_end - 1, h_begin, h_end - 1,
                  kv, i, got[i], want[i]);
      ++failures;
    }
    // int8: the reference (scalar dots, one query at a time) against each ISA's row and
    // block entries.
    std::fill(want.begin(), want.end(), -12345.0f);
    for (int64_t s = s_begin; s < s_end; ++s) {
      for (int64_t h = kv * group + h_begin; h < kv * group + h_end; ++h) {
        elk_attention_row_i8(&shape, &c.row, s, h, q.data(), q_stride, cos.data(), sin.data(),
                             &i8, elk_i8_dots("scalar"), row_scratch_i8.data(), want.data());
      }
    }
    for (const char *isa : kIsas) {
      const elk_i8_dots_fn dots = elk_i8_dots(isa);
      if (dots == nullptr) continue;
      std::fill(got.begin(), got.end(), -12345.0f);
      std::vector<char> scratch_i8(elk_attention_block_i8_scratch(
          &shape, &c.row, s_begin, s_end, h_end - h_begin));
      elk_attention_block_i8(&shape, &c.row, s_begin, s_end, kv * group + h_begin,
                             kv * group + h_end, q.data(), q_stride, cos.data(), sin.data(),
                             &i8, dots, scratch_i8.data(), got.data());
      std::vector<float> rows(out_size, -12345.0f);
      for (int64_t s = s_begin; s < s_end; ++s) {
        for (int64_t h = kv * group + h_begin; h < kv * group + h_end; ++h) {
          elk_attention_row_i8(&shape, &c.row, s, h, q.data(), q_stride, cos.data(),
                               sin.data(), &i8, dots, row_scratch_i8.data(), rows.data());
        }
      }
      for (const std::vector<float> *result : {&got, &rows}) {
        if (std::memcmp(want.data(), result->data(), out_size * sizeof(float)) != 0) {
          size_t i = 0;
          while (std::memcmp(&want[i], &(*result)[i], sizeof(float)) == 0) ++i;
          std::printf("FAILED int8 %s %s heads %ld/%ld d %ld window %ld row (start %ld length "
                      "%ld) block s %ld..%ld: output %zu is %.9g, the reference %.9g\n",
                      isa, result == &got ? "block" : "row", c.heads, c.kv_heads, d, c.window,
                      c.row.start, c.row.length, s_begin, s_end - 1, i, (*result)[i], want[i]);
          ++failures;
        }
      }
    }
  }
  // elk_attention_store_i8 writes elk_attention_store's rows, quantized.
  std::vector<float> stored_keys(keys), stored_values(values);
  Int8Buffers stored = quantized(keys, values, d);
  elk_kv_i8 stored_view = stored.view();
  for (int64_t h = 0; h < c.kv_heads; ++h) {
    elk_attention_store(&shape, &c.row, h, q.data() + 1, q.data() + 2, q_stride, cos.data(),
                        sin.data(), stored_keys.data(), stored_values.data());
    elk_attention_store_i8(&shape, &c.row, h, q.data() + 1, q.data() + 2, q_stride,
                           cos.data(), sin.data(), &stored_view);
  }
  Int8Buffers expected = quantized(stored_keys, stored_values, d);
  if (expected.keys != stored.keys || expected.values != stored.values ||
      std::memcmp(expected.key_scales.data(), stored.key_scales.data(),
                  expected.key_scales.size() * sizeof(float)) != 0 ||
      std::memcmp(expected.value_scales.data(), stored.value_scales.data(),
                  expected.value_scales.size() * sizeof(float)) != 0) {
    std::printf("FAILED int8 store heads %ld/%ld d %ld: not the float rows quantized\n",
                c.heads, c.kv_heads, d);
    ++failures;
  }
  return failures;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  int failures = 0, cases = 0;
  // heads, kv_heads, head_dim, capacity, window, norms, {slot, start, offset, length, bidir}
  const Case fixed[] = {
      {12, 2, 128, 1000, 0, false, {1, 0, 0, 1000, 0}},    // a 1000-token prefill, group 6
      {12, 2, 128, 1000, 0, false, {0, 700, 5, 300, 0}},   // a 300-token chunk mid-buffer
      {12, 2, 128, 1000, 0, false, {0, 999, 2, 1, 0}},     // a decode step at 1000
      {9, 3, 64, 1000, 0, true, {0, 37, 11, 300, 0}},      // group 3, q/k norms
      {9, 3, 64, 1000, 0, false, {0, 37, 11, 300, 0}, 1},  // rotary rows by token (M-RoPE)
      {9, 3, 64, 1000, 0, false, {1, 400, 3, 150, 1}},     // bidirectional mid-buffer
      {8, 8, 64, 300, 0, false, {0, 0, 0, 300, 0}},        // no grouping (MHA)
      {8, 2, 80, 1000, 100, false, {0, 600, 1, 300, 0}},   // windowed, d 80
      {8, 2, 80, 1000, 700, false, {0, 200, 0, 800, 0}},   // window longer than a block's lead
      {4, 2, 6, 300, 0, false, {0, 3, 2, 200, 0}},         // d 6: dot's tail lanes only
      {4, 1, 20, 300, 5, true, {1, 9, 4, 250, 1}},         // d 20, window 5, bidirectional
      {6, 2, 256, 300, 0, false, {0, 100, 0, 100, 0}},     // d 256: 16-key tiles
      {6, 3, 512, 120, 0, false, {0, 0, 0, 120, 0}},       // d 512 (the op's largest)
  };
  for (const Case &c : fixed) {
    failures += check(rng, c, 12);
    ++cases;
  }
  // Random shapes.
  const int64_t dims[] = {2, 8, 14, 32, 64, 72, 96, 128};
  for (int i = 0; i < 40; ++i) {
    Case c{};
    c.kv_heads = 1 + static_cast<int64_t>(rng() % 3);
    c.heads = c.kv_heads * (1 + static_cast<int64_t>(rng() % 7));
    c.head_dim = dims[rng() % 8];
    c.capacity = 300;
    c.window = rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % 90) : 0;
    c.norms = rng() % 2 == 0;
    c.row.slot = static_cast<int64_t>(rng() % 3);
    c.row.length = 1 + static_cast<int64_t>(rng() % 200);
    c.row.start = static_cast<int64_t>(rng() % (c.capacity - c.row.length + 1));
    c.row.offset = static_cast<int64_t>(rng() % 7);
    c.row.bidirectional = rng() % 4 == 0;
    failures += check(rng, c, 8);
    ++cases;
  }
  if (failures != 0) return 1;
  std::printf("ok attention_block: %d cases equal elk_attention_row bit for bit\n", cases);
  std::printf("ok attention_i8: block and row equal the scalar reference with the int8 dots of");
  for (const char *isa : kIsas) {
    if (elk_i8_dots(isa) != nullptr) std::printf(" %s", isa);
  }
  std::printf("\n");
  return 0;
}

// Every kernel this CPU can run against the scalar reference, bit for bit, on random blocks:
// the K types (x Q8_K) and the legacy types (x Q8_0 / Q8_1), through elk_vec_dot and, for the
// K types, elk_vec_dot_q8_K. Built for the host and cross-built for aarch64 (run under
// qemu-aarch64 with several -cpu models): the test that the ISA files agree with ref.cpp where
// Python cannot load them. Prints the kernels it checked; exit 1 on the first difference.
#include <cstdio>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "edge_llm_kquant/ref.h"

namespace {

// Random blocks with small finite fp16 scales at `scale_offsets`.
std::vector<uint8_t> random_blocks(std::mt19937 &rng, size_t bytes, int blocks,
                                   std::initializer_list<size_t> scale_offsets) {
  std::vector<uint8_t> out(bytes * blocks);
  for (auto &b : out) b = static_cast<uint8_t>(rng() & 0xff);
  for (int i = 0; i < blocks; ++i) {
    for (size_t offset : scale_offsets) {
      const uint16_t half =
          static_cast<uint16_t>(0x2000 + (rng() % 0x0800)) | (rng() & 1 ? 0x8000 : 0);
      std::memcpy(&out[i * bytes + offset], &half, sizeof(half));
    }
  }
  return out;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// elk_gemm over m activation rows x n weight rows (both odd sizes around every tile edge),
// and elk_gemm_q8_K for the K types: each element, and nothing else of out, must be the
// reference's dot bit for bit.
// Weights at random codes, or all at their largest or smallest code (with activations that
// meet them at the sums' bounds).
enum class Extreme { kNone, kLargest, kSmallest };

bool check_gemm(std::mt19937 &rng, const char *isa, int type, size_t bytes,
                std::initializer_list<size_t> scales, const char *name, int m, int n,
                int blocks, Extreme extreme) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int per = elk_block_weights(type), activation = elk_activation_type(type);
  const int k = blocks * per;
  const size_t row = bytes * blocks, arow = blocks * elk_block_bytes(activation) + 8;
  std::vector<uint8_t> w = random_blocks(rng, bytes, blocks * n, scales);
  if (extreme != Extreme::kNone) {  // the sums' bounds (no int16 saturation)
    const uint8_t code = extreme == Extreme::kLargest ? 0xff : 0x00;
    for (size_t i = 0; i < w.size(); ++i) {
      bool scale_byte = false;
      for (size_t offset : scales) {
        scale_byte |= i % bytes == offset || i % bytes == offset + 1;
      }
      if (!scale_byte) {
        w[i] = (type == ELK_Q6_K && i % bytes >= 192) || type == ELK_Q8_0 ? 0x80 : code;
      }
    }
  }
  std::vector<uint8_t> a(arow * m, 0xcd);  // rows padded: a_stride is not the row length
  std::vector<float> x(k);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < k; ++j) {
      // kSmallest: activations 127 but the first of each block (-1 there sets the scale), so
      // that activation + 128 meets Q6_K's code - 32 = -32 everywhere (the interleaved tiles).
      x[j] = extreme == Extreme::kNone      ? normal(rng)
             : extreme == Extreme::kLargest ? (rng() & 1 ? 1.0f : -1.0f)
                                            : (j % per == 0 ? -1.0f : 1.0f);
    }
    elk_quantize_row_ref(activation, x.data(), a.data() + i * arow, k);
  }
  const int ldo = n + 3;
  const float guard = -12345.0f;
  std::vector<float> out(static_cast<size_t>(ldo) * m, guard);
  if (elk_gemm(type, k, w.data(), row, n, a.data(), arow, m, out.data(), ldo) != 0) {
    std::printf("FAILED %s %s gemm m=%d n=%d\n", isa, name, m, n);
    return false;
  }
  if (per == 256) {  // the K types' own entry: the same bits
    std::vector<float> out_k(out.size(), guard);
    if (elk_gemm_q8_K(type, k, w.data(), row, n, a.data(), arow, m, out_k.data(), ldo) != 0 ||
        std::memcmp(out.data(), out_k.data(), out.size() * sizeof(float)) != 0) {
      std::printf("MISMATCH %s %s gemm_q8_K m=%d n=%d\n", isa, name, m, n);
      return false;
    }
  }
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < ldo; ++j) {
      float ref = guard;
      if (j < n) elk_vec_dot_ref(type, k, w.data() + j * row, a.data() + i * arow, &ref);
      if (std::memcmp(&ref, &out[i * ldo + j], sizeof(float)) != 0) {
        std::printf("MISMATCH %s %s gemm m=%d n=%d blocks=%d extreme=%d at (%d, %d): %.9g vs "
                    "reference %.9g\n", isa, name, m, n, blocks, extreme, i, j,
                    out[i * ldo + j], ref);
        return false;
      }
    }
  }
  return true;
}

// elk_quantize_row_q8_K against the reference, byte for byte: normal rows, ties of the
// largest magnitude with both signs, zeros, one-element blocks, infinities and NaNs.
bool check_quantize(std::mt19937 &rng, const char *isa) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int k = 4 * 256;
  std::vector<float> x(k);
  for (int trial = 0; trial < 40; ++trial) {
    for (auto &v : x) v = normal(rng) * (trial % 5 == 0 ? 1e-30f : trial % 7 == 0 ? 1e4f : 1.0f);
    if (trial % 3 == 1) for (auto &v : x) v = std::round(v * 2.0f);        // many ties
    if (trial % 4 == 2) for (int j = 0; j < 256; ++j) x[j] = 0.0f;         // a zero block
    if (trial % 6 == 3) x[rng() % k] = -std::numeric_limits<float>::infinity();
    if (trial % 8 == 5) x[rng() % k] = std::numeric_limits<float>::quiet_NaN();
    if (trial == 9) for (int j = 256; j < 512; ++j) x[j] = j == 300 ? -0.5f : -0.0f;
    std::vector<uint8_t> ref(4 * elk_block_bytes(ELK_Q8_K)), got(ref.size(), 0xcd);
    elk_quantize_row_q8_K_ref(x.data(), ref.data(), k);
    elk_quantize_row_q8_K(x.data(), got.data(), k);
    if (ref != got) {
      std::printf("MISMATCH %s quantize_row_q8_K trial %d\n", isa, trial);
      return false;
    }
    // The same rows in blocks of 32 (Q8_0, and Q8_1 with its sums), and ties at every
    // half step of a block whose largest magnitude is 127 (the scale is then exactly 1).
    if (trial % 2 == 0) {
      for (int j = 512; j < 544; ++j) x[j] = j == 512 ? 127.0f : (j - 528) * 0.5f;
    }
    for (int type : {ELK_Q8_0, ELK_Q8_1}) {
      std::vector<uint8_t> r(k / 32 * elk_block_bytes(type)), g(r.size(), 0xcd);
      elk_quantize_row_ref(type, x.data(), r.data(), k);
      if (elk_quantize_row(type, x.data(), g.data(), k) != 0 || r != g) {
        std::printf("MISMATCH %s quantize_row %s trial %d\n", isa,
                    type == ELK_Q8_0 ? "Q8_0" : "Q8_1", trial);
        return false;
      }
    }
  }
  return true;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  struct Case { int type; size_t bytes; std::initializer_list<size_t> scales; const char *name; };
  const Case cases[] = {
      {ELK_Q4_K, 144, {0, 2}, "Q4_K"}, {ELK_Q5_K, 176, {0, 2}, "Q5_K"},
      {ELK_Q6_K, 210, {208}, "Q6_K"},  {ELK_Q4_0, 18, {0}, "Q4_0"},
      {ELK_Q4_1, 20, {0, 2}, "Q4_1"},  {ELK_Q5_0, 22, {0}, "Q5_0"},
      {ELK_Q5_1, 24, {0, 2}, "Q5_1"},  {ELK_Q8_0, 34, {0}, "Q8_0"}};
  const char *isas[] = {"scalar", "avx2", "avx512_vnni", "amx", "neon", "neon_dotprod", "neon_i8mm"};
  int checked = 0;
  for (const char *isa : isas) {
    if (elk_select_kernel(isa) != 0) continue;
    for (const Case &c : cases) {
      const int per = elk_block_weights(c.type);
      const int activation = elk_activation_type(c.type);
      // Legacy kernels take 8 blocks a step: tails, whole steps and both.
      const std::vector<int> counts = per == 256 ? std::vector<int>{1, 3, 8}
                                                 : std::vector<int>{1, 3, 7, 8, 9, 16, 27, 40};
      for (int blocks : counts) {
        const int n = blocks * per;
        std::vector<uint8_t> w = random_blocks(rng, c.bytes, blocks, c.scales);
        std::vector<float> x(n);
        for (auto &v : x) v = normal(rng);
        if (blocks == 3) for (auto &v : x) v = v < 0 ? -1.0f : 1.0f;  // all +-127
        std::vector<uint8_t> a(static_cast<size_t>(n / elk_block_weights(activation)) *
                               elk_block_bytes(activation));
        elk_quantize_row_ref(activation, x.data(), a.data(), n);
        float ref = 0, got = 0, got_k = 0;
        elk_vec_dot_ref(c.type, n, w.data(), a.data(), &ref);
        if (elk_vec_dot(c.type, n, w.data(), a.data(), &got) != 0) {
          std::printf("REFUSED %s %s blocks=%d\n", isa, c.name, blocks);
          return 1;
        }
        if (per == 256) elk_vec_dot_q8_K(c.type, n, w.data(), a.data(), &got_k);
        if (!same_bits(ref, got) || (per == 256 && !same_bits(ref, got_k))) {
          std::printf("MISMATCH %s %s blocks=%d: %.9g (q8_K entry %.9g) vs reference %.9g\n",
                      isa, c.name, blocks, got, got_k, ref);
          return 1;
        }
        ++checked;
      }
      for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13}) {
        for (int n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 17}) {
          // Legacy kernels take 8 blocks a step: tails and whole steps.
          static const int legacy_blocks[] = {1, 3, 9, 17};
          const int blocks = per == 256 ? 1 + (m + n) % 3 : legacy_blocks[(m + n) % 4];
          if (!check_gemm(rng, isa, c.type, c.bytes, c.scales, c.name, m, n, blocks,
                          Extreme::kNone)) {
            return 1;
          }
          ++checked;
        }
      }
      for (Extreme e : {Extreme::kLargest, Extreme::kSmallest}) {
        if (!check_gemm(rng, isa, c.type, c.bytes, c.scales, c.name, 5, 7, per == 256 ? 2 : 9,
                        e)) {
          return 1;
        }
      }
      // AMX's batches: full and partial 16-row tiles, pairs and a single, 64-row blocks,
      // partial 16-row weight tiles; and its bounds at every largest code.
      for (int m : {8, 15, 16, 17, 31, 32, 33, 48, 65, 100}) {
        for (int n : {1, 15, 16, 17, 33}) {
          if (!check_gemm(rng, isa, c.type, c.bytes, c.scales, c.name, m, n,
                          per == 256 ? 1 + (m + n) % 3 : 3, Extreme::kNone)) {
            return 1;
          }
          ++checked;
        }
      }
      for (Extreme e : {Extreme::kLargest, Extreme::kSmallest}) {
        if (!check_gemm(rng, isa, c.type, c.bytes, c.scales, c.name, 40, 21, per == 256 ? 2 : 9,
                        e)) {
          return 1;
        }
      }
      // Many rows: every tile shape in one call (4-row tiles, then 2 and 1), up to M 600.
      for (int m : {37, 64, 600}) {
        if (!check_gemm(rng, isa, c.type, c.bytes, c.scales, c.name, m, 19, per == 256 ? 1 : 11,
                        Extreme::kNone)) {
          return 1;
        }
        ++checked;
      }
      ++checked;
    }
    if (!check_quantize(rng, isa)) return 1;
    ++checked;
    std::printf("ok %s (cpu: %s)\n", elk_kernel_name(), elk_cpu_features());
  }
  std::printf("checked %d\n", checked);
  return checked > 0 ? 0 : 1;
}

// Every kernel this CPU can run against the scalar reference, bit for bit, on random blocks:
// the K types (x Q8_K) and the legacy types (x Q8_0 / Q8_1), through elk_vec_dot and, for the
// K types, elk_vec_dot_q8_K. Built for the host and cross-built for aarch64 (run under
// qemu-aarch64 with several -cpu models): the test that the ISA files agree with ref.cpp where
// Python cannot load them. Prints the kernels it checked; exit 1 on the first difference.
#include <cstdio>
#include <cstring>
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
  const char *isas[] = {"scalar", "avx2", "neon", "neon_dotprod"};
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
    }
    std::printf("ok %s (cpu: %s)\n", elk_kernel_name(), elk_cpu_features());
  }
  std::printf("checked %d\n", checked);
  return checked > 0 ? 0 : 1;
}

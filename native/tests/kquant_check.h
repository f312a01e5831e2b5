// What the kquant kernels' checks share (kquant_emulate.cpp on the CPU, gpu_check.cu on a
// GPU or the CPU): random GGUF blocks with small finite scales, and the activations that
// kquant_cuda_matmul left in its scratch checked against elk_quantize_row_ref byte for byte.
// Include after edge_llm_kquant/ref.h and blocks.h (cuda_emulation.h, or native/src on -I).
#pragma once

#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

namespace {

std::vector<uint8_t> random_blocks(std::mt19937 &rng, size_t bytes, size_t blocks,
                                   std::initializer_list<size_t> scale_offsets) {
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  std::vector<uint8_t> out(bytes * blocks);
  for (auto &b : out) b = static_cast<uint8_t>(rng() & 0xff);
  for (size_t i = 0; i < blocks; ++i) {
    for (size_t offset : scale_offsets) {
      const uint16_t half = elk::fp32_to_fp16(scale(rng));
      std::memcpy(&out[i * bytes + offset], &half, sizeof(half));
    }
  }
  return out;
}

bool same_bits(const void *a, const void *b, size_t bytes) { return !std::memcmp(a, b, bytes); }

struct Case {
  int type;
  const char *name;
  size_t bytes;
  std::initializer_list<size_t> scales;
  int64_t k, n;
};

// The activations kquant_cuda_matmul left in its scratch against elk_quantize_row_ref's blocks.
int check_activations(const Case &c, const std::vector<float> &a, int64_t m,
                      const uint8_t *scratch) {
  const bool k_type = c.type != ELK_Q8_0;
  const int act = elk_activation_type(c.type), per = elk_block_weights(act);
  const size_t blocks = static_cast<size_t>(c.k / per), bytes = elk_block_bytes(act);
  const size_t qs_bytes = (static_cast<size_t>(m * c.k) + 255) / 256 * 256;
  const size_t d_bytes = (m * blocks * sizeof(float) + 255) / 256 * 256;
  const int8_t *qs = reinterpret_cast<const int8_t *>(scratch);
  const float *d = reinterpret_cast<const float *>(scratch + qs_bytes);
  const int16_t *sums = reinterpret_cast<const int16_t *>(scratch + qs_bytes + d_bytes);
  std::vector<uint8_t> ref(blocks * bytes);
  for (int64_t r = 0; r < m; ++r) {
    elk_quantize_row_ref(act, &a[r * c.k], ref.data(), c.k);
    for (size_t b = 0; b < blocks; ++b) {
      const uint8_t *block = &ref[b * bytes];
      float want_d;
      const int8_t *want_qs;
      if (k_type) {  // BlockQ8_K: float d, qs[256], int16 bsums[16]
        std::memcpy(&want_d, block, 4);
        want_qs = reinterpret_cast<const int8_t *>(block + 4);
        if (!same_bits(block + 4 + 256, &sums[(r * blocks + b) * 16], 32)) return 1;
      } else {  // BlockQ8_0: fp16 d, qs[32]
        uint16_t half;
        std::memcpy(&half, block, 2);
        want_d = elk::fp16_to_fp32(half);
        want_qs = reinterpret_cast<const int8_t *>(block + 2);
      }
      if (!same_bits(&want_d, &d[r * blocks + b], 4) ||
          !same_bits(want_qs, &qs[r * c.k + b * per], per)) {
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace

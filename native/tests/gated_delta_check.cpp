// Prints a hash of GatedDeltaNet's outputs and states over fixed pseudo-random rows (several
// shapes, fresh and continued rows). test_native_gated_delta builds this file twice, with
// the AVX2 clone and with the baseline code alone (-DELK_GDN_BASELINE), and asks for the
// same hash: the two paths (the op's column tiles in the clones, the definition's token-by-token
// sweeps in the baseline) give the same bits.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "edge_llm_kquant/gated_delta.h"

namespace {

uint64_t lcg = 0x9e3779b97f4a7c15ULL;

float next_float() {
  lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return static_cast<float>(static_cast<int32_t>(lcg >> 33) % 20001) / 10000.0f;
}

void fill(std::vector<float> &v, float scale) {
  for (float &x : v) x = next_float() * scale;
}

uint64_t fnv(const std::vector<float> &v, uint64_t h) {
  const unsigned char *p = reinterpret_cast<const unsigned char *>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

}  // namespace

int main() {
  uint64_t hash = 1469598103934665603ULL;
  // Head sizes under, at and over the op's column tile (32), one with a remainder (40);
  // chunks of 32 (the converter's), 8, 5 and 1.
  const int64_t shapes[][5] = {
      {2, 4, 32, 4, 32}, {16, 16, 128, 4, 32}, {1, 3, 24, 3, 5}, {2, 2, 40, 4, 8}, {1, 2, 16, 4, 1}};
  for (const auto &sh : shapes) {
    const elk_gdn_shape shape{sh[0], sh[1], sh[2], sh[3], 1e-6f, sh[4]};
    const int64_t d = sh[2], channels = (2 * sh[0] + sh[1]) * d, value = sh[1] * d;
    const int64_t floats = elk_gdn_state_floats(&shape);
    // Fresh and continued rows, one over several chunks.
    const elk_row rows[] = {{0, 0, 0, 5, 0}, {1, 7, 5, 1, 0}, {2, 3, 6, 3, 0}, {0, 5, 9, 70, 0}};
    const int64_t tokens = 79;
    std::vector<float> qkv(tokens * channels), z(tokens * value), alpha(tokens * sh[1]),
        beta(tokens * sh[1]), weight(channels * sh[3]), dt(sh[1]), a(sh[1]), norm(d),
        state(3 * floats), conv(tokens * channels), y(tokens * value);
    fill(qkv, 1.0f), fill(z, 1.0f), fill(alpha, 1.0f), fill(beta, 1.0f), fill(weight, 0.7f);
    fill(dt, 0.5f), fill(a, 1.0f), fill(norm, 0.1f), fill(state, 0.3f);
    for (float &x : a) x = -1.0f - x * 0.5f;
    for (float &x : norm) x += 1.0f;
    for (const elk_row &row : rows) {
      for (int64_t c0 = 0; c0 < channels; c0 += ELK_GDN_CHANNELS) {
        const int64_t c1 = c0 + ELK_GDN_CHANNELS < channels ? c0 + ELK_GDN_CHANNELS : channels;
        elk_gdn_conv_rows(&shape, &row, c0, c1, qkv.data(), weight.data(), floats,
                          state.data(), conv.data());
      }
      for (int64_t h = 0; h < sh[1]; ++h) {
        elk_gdn_delta_rows(&shape, &row, h, conv.data(), z.data(), alpha.data(), beta.data(),
                           dt.data(), a.data(), norm.data(), floats, state.data(), y.data());
      }
    }
    hash = fnv(y, fnv(state, fnv(conv, hash)));
  }
  std::printf("%016llx\n", static_cast<unsigned long long>(hash));
  return 0;
}

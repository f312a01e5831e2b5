// Prints a hash of Mamba2's outputs and states over fixed pseudo-random rows (several shapes,
// fresh and continued rows). test_native_mamba2 builds this file twice, with the AVX2 clones
// and with the baseline code alone (-DELK_GDN_BASELINE), and asks for the same hash: the two
// paths give the same bits.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "edge_llm_kquant/mamba2.h"

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
  // heads, head_dim, groups, d_state, kernel
  const int64_t shapes[][5] = {{4, 32, 2, 16, 4}, {16, 64, 1, 128, 4}, {3, 24, 3, 8, 3}};
  for (const auto &sh : shapes) {
    const elk_mamba2_shape shape{sh[0], sh[1], sh[2], sh[3], sh[4], 1e-5f};
    const int64_t inner = sh[0] * sh[1], channels = inner + 2 * sh[2] * sh[3];
    const int64_t floats = (sh[4] - 1) * channels + sh[0] * sh[3] * sh[1];
    const elk_row rows[] = {{0, 0, 0, 5, 0}, {1, 7, 5, 1, 0}, {2, 3, 6, 3, 0}};
    const int64_t tokens = 9;
    std::vector<float> xbc(tokens * channels), z(tokens * inner), dt(tokens * sh[0]),
        weight(channels * sh[4]), bias(channels), dt_bias(sh[0]), a(sh[0]), d(sh[0]),
        norm(inner), state(3 * floats), conv(tokens * channels), y(tokens * inner);
    fill(xbc, 1.0f), fill(z, 1.0f), fill(dt, 1.0f), fill(weight, 0.7f), fill(bias, 0.2f);
    fill(dt_bias, 0.5f), fill(a, 1.0f), fill(d, 1.0f), fill(norm, 0.1f), fill(state, 0.3f);
    for (float &x : a) x = -1.0f - x * 0.5f;
    for (float &x : norm) x += 1.0f;
    for (const elk_row &row : rows) {
      for (int64_t c0 = 0; c0 < channels; c0 += ELK_CONV_CHANNELS) {
        const int64_t c1 = c0 + ELK_CONV_CHANNELS < channels ? c0 + ELK_CONV_CHANNELS : channels;
        elk_causal_conv_rows(channels, sh[4], &row, c0, c1, xbc.data(), weight.data(),
                             bias.data(), floats, state.data(), conv.data());
      }
      for (int64_t h = 0; h < sh[0]; ++h) {
        elk_mamba2_scan_rows(&shape, &row, h, conv.data(), z.data(), dt.data(), dt_bias.data(),
                             a.data(), d.data(), floats, state.data(), y.data());
      }
      for (int64_t g = 0; g < sh[2]; ++g) {
        elk_mamba2_norm_rows(&shape, &row, g, norm.data(), y.data());
      }
    }
    hash = fnv(y, fnv(state, fnv(conv, hash)));
  }
  std::printf("%016llx\n", static_cast<unsigned long long>(hash));
  return 0;
}

// kernels/kquant.cu on the CPU: its launcher kquant_cuda_matmul and every kernel it queues
// (activation quantization, GEMV for M <= 4, GEMM above), run by cuda_emulation.h's threads,
// against ref.cpp bit for bit: the quantized activations byte for byte (qs, d, 16-sums) and
// every output the reference dot of that row, plus the bias, for Q8_0, Q4_K and Q6_K at K that
// leave partial GEMV steps and GEMM tiles, N not a multiple of 8 or 64, M 1..4, 5 and 70, and
// rows with a tie for the largest magnitude and all zeros; and kquant_cuda_glu (a fused gate|up
// product's activation) against elk_glu, both kinds, over normal values, the clamp's edges, zeros,
// infinities and a NaN. No GPU: this checks the kernels' index maps, reductions and float
// expressions, not the hardware. Exit 1 on any difference.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_emulation.h"
#include "edge_llm_kquant/ref.h"
#include "../../kernels/kquant.cu"
#include "kquant_check.h"

int main() {
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Case cases[] = {
      {ELK_Q8_0, "Q8_0", 34, {0}, 96, 37},    {ELK_Q8_0, "Q8_0", 34, {0}, 1120, 70},
      {ELK_Q4_K, "Q4_K", 144, {0, 2}, 256, 37}, {ELK_Q4_K, "Q4_K", 144, {0, 2}, 768, 70},
      {ELK_Q6_K, "Q6_K", 210, {208}, 512, 37}, {ELK_Q6_K, "Q6_K", 210, {208}, 768, 70},
  };
  int failures = 0, checked = 0;
  for (const Case &c : cases) {
    const int per = elk_block_weights(c.type);
    const size_t row_bytes = static_cast<size_t>(c.k / per) * c.bytes;
    const std::vector<uint8_t> w = random_blocks(rng, c.bytes, c.n * (c.k / per), c.scales);
    std::vector<float> bias(c.n);
    for (auto &v : bias) v = normal(rng);
    for (int64_t m : {1, 2, 3, 4, 5, 70}) {
      std::vector<float> a(m * c.k);
      for (auto &v : a) v = normal(rng);
      if (m >= 3) {
        std::fill(a.begin() + c.k, a.begin() + 2 * c.k, 0.0f);  // row 1: all zeros
        a[2 * c.k + 5] = 4.0f;                                   // row 2: a tie, + first
        a[2 * c.k + 9] = -4.0f;
      }
      const bool with_bias = m % 2 == 1;
      const int act = elk_activation_type(c.type);
      const size_t act_bytes = static_cast<size_t>(c.k / elk_block_weights(act)) *
                               elk_block_bytes(act);
      std::vector<uint8_t> q(act_bytes);
      std::vector<float> want(m * c.n);
      for (int64_t r = 0; r < m; ++r) {
        elk_quantize_row_ref(act, &a[r * c.k], q.data(), c.k);
        for (int64_t col = 0; col < c.n; ++col) {
          float value;
          elk_vec_dot_ref(c.type, c.k, &w[col * row_bytes], q.data(), &value);
          want[r * c.n + col] = with_bias ? value + bias[col] : value;
        }
      }
      std::vector<uint8_t> scratch(kquant_cuda_scratch_bytes(c.type, m, c.k));
      std::vector<float> got(m * c.n, -1.0f);
      const int status = kquant_cuda_matmul(c.type, a.data(), w.data(),
                                            with_bias ? bias.data() : nullptr, got.data(), m,
                                            c.n, c.k, scratch.data(), nullptr);
      const int bad_acts = check_activations(c, a, m, scratch.data());
      int bad = 0;
      for (size_t i = 0; i < want.size(); ++i) bad += !same_bits(&want[i], &got[i], 4);
      ++checked;
      std::printf("%s K %lld N %lld M %lld (%s%s): %s\n", c.name, static_cast<long long>(c.k),
                  static_cast<long long>(c.n), static_cast<long long>(m),
                  m <= 4 ? "gemv" : "gemm", with_bias ? ", bias" : "",
                  status || bad || bad_acts ? "DIFFERENT" : "bit-equal");
      if (status || bad || bad_acts) {
        ++failures;
        std::printf("  status %d, activations %s, %d of %zu outputs differ\n", status,
                    bad_acts ? "differ" : "equal", bad, want.size());
        for (size_t i = 0, shown = 0; i < want.size() && shown < 5; ++i) {
          if (!same_bits(&want[i], &got[i], 4)) {
            std::printf("  [%zu, %zu] ref %.9g kernel %.9g\n", i / c.n, i % c.n, want[i],
                        got[i]);
            ++shown;
          }
        }
      }
    }
  }
  // The gated activations: M rows of [gate | up] against the CPU's elk_glu, bit for bit.
  for (int kind : {1, 2}) {
    const int64_t m = 3, half = 301;  // more than one block of 256 threads, a partial last
    std::vector<float> y(m * 2 * half);
    std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
    for (size_t i = 0; i < y.size(); ++i) y[i] = i % 3 ? normal(rng) * 4.0f : wide(rng);
    const float edges[] = {0.0f, -0.0f, 87.3f, -87.3f, 88.3f, -88.3f, 1e30f, -1e30f,
                           INFINITY, -INFINITY, NAN, 1e-30f};
    for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); ++e) y[e] = edges[e];
    std::vector<float> got(m * half, -1.0f), want(m * half);
    const int status = kquant_cuda_glu(kind, y.data(), got.data(), m, half, nullptr);
    for (int64_t r = 0; r < m; ++r) {
      elk_glu(kind, &y[r * 2 * half], &y[r * 2 * half + half], &want[r * half], half);
    }
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i) bad += !same_bits(&want[i], &got[i], 4);
    ++checked;
    std::printf("glu kind %d M %lld half %lld: %s\n", kind, static_cast<long long>(m),
                static_cast<long long>(half), status || bad ? "DIFFERENT" : "bit-equal");
    if (status || bad) {
      ++failures;
      std::printf("  status %d, %d of %zu outputs differ\n", status, bad, want.size());
    }
  }
  // Arguments the launcher does not take.
  float y;
  if (kquant_cuda_glu(0, nullptr, &y, 1, 1, nullptr) != -1 ||
      kquant_cuda_glu(3, nullptr, &y, 1, 1, nullptr) != -1) {
    std::printf("the glu launcher took a kind it must refuse\n");
    ++failures;
  }
  if (kquant_cuda_matmul(ELK_Q5_K, nullptr, nullptr, nullptr, &y, 1, 1, 256, nullptr, nullptr)
          != -1 ||
      kquant_cuda_matmul(ELK_Q4_K, nullptr, nullptr, nullptr, &y, 1, 1, 96, nullptr, nullptr)
          != -1 ||
      kquant_cuda_scratch_bytes(ELK_Q6_K, 1, 100) != 0) {
    std::printf("the launcher took arguments it must refuse\n");
    ++failures;
  }
  std::printf("%d cases, %d different\n", checked, failures);
  return failures ? 1 : 0;
}

// One activation row's matmul (a decode step's GEMV) per K-quant type at Qwen3.5-2B's shapes:
// elk_gemm of each library named on the command line (built before / after a change) and,
// with GGML_CPU=path/to/libggml-cpu.so (the llama.cpp peer's), ggml's own dot per row and its
// repacked Q4_K GEMV (random blocks in its 8-row layout: the timing does not depend on them).
// Every round times each variant in turn over the same weights; GB/s of weights per thread
// CPU second, medians over the rounds. The libraries' outputs are compared bit for bit.
//     gemv_rates ROUNDS LIB [LIB ...]
// TYPES=Q4_K,Q6_K picks types; TOTAL_MB (default 384: streamed from DRAM; 12: re-read from
// L3) with INNER=n passes a round. A benchmark tool (dlopen, no test); docs/benchmarks.md.
#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using GemmFn = int (*)(int, int64_t, const void *, size_t, int64_t, const void *, size_t,
                       int64_t, float *, int64_t);
using QuantizeFn = void (*)(const float *, void *, int64_t);
using QuantizeRefFn = int (*)(int, const float *, void *, int64_t);
using GgmlDotFn = void (*)(int, float *, size_t, const void *, size_t, const void *, size_t,
                           int);
using GgmlGemvFn = void (*)(int, float *, size_t, const void *, const void *, int, int);

double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

struct Type {
  const char *name;
  int id;             // ELK_* (= ggml_type)
  int block_bytes, block_weights, d_offset;
  const char *ggml_dot;
};

const Type kTypes[] = {{"Q4_K", 12, 144, 256, 0, "ggml_vec_dot_q4_K_q8_K"},
                       {"Q5_K", 13, 176, 256, 0, "ggml_vec_dot_q5_K_q8_K"},
                       {"Q6_K", 14, 210, 256, 208, "ggml_vec_dot_q6_K_q8_K"},
                       {"Q8_0", 8, 34, 32, 0, "ggml_vec_dot_q8_0_q8_0"}};

// K x N: gate/up (and DeltaNet qkv), down, a slice of the tied head, an L2-sized matrix.
const int64_t kShapes[][2] = {{2048, 6144}, {6144, 2048}, {2048, 31040}, {2048, 256}};

}  // namespace

int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: gemv_rates ROUNDS LIB [LIB ...]\n");
    return 2;
  }
  const int rounds = std::atoi(argv[1]);
  const char *only = std::getenv("TYPES");
  const int inner = std::getenv("INNER") ? std::atoi(std::getenv("INNER")) : 1;
  const size_t total = static_cast<size_t>(
      std::getenv("TOTAL_MB") ? std::atol(std::getenv("TOTAL_MB")) : 384) << 20;
  std::vector<void *> libs;
  for (int i = 2; i < argc; ++i) {
    void *h = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      std::fprintf(stderr, "%s\n", dlerror());
      return 2;
    }
    libs.push_back(h);
  }
  void *ggml = std::getenv("GGML_CPU") ? dlopen(std::getenv("GGML_CPU"), RTLD_NOW | RTLD_LOCAL)
                                       : nullptr;
  std::vector<uint8_t> buf(total + 4096);
  std::mt19937 rng(1);
  for (size_t i = 0; i + 4 <= buf.size(); i += 4) {
    const uint32_t r = rng();
    std::memcpy(&buf[i], &r, 4);
  }
  std::vector<float> x(8192);
  for (float &v : x) v = static_cast<float>(static_cast<int>(rng() % 2000) - 1000) * 1e-3f;
  std::vector<uint8_t> act(8192 / 256 * 292 + 64), act8(8192 / 32 * 34 + 64);
  std::vector<float> out(300000);
  for (const Type &t : kTypes) {
    if (only != nullptr && std::strstr(only, t.name) == nullptr) continue;
    // Finite scales: d (and dmin) fp16 in [2^-6, 2^-5).
    for (size_t off = 0; off + t.block_bytes <= total; off += t.block_bytes) {
      const uint16_t d = static_cast<uint16_t>(0x1400 + (rng() & 0x3ff));
      std::memcpy(&buf[off + t.d_offset], &d, 2);
      if (t.id == 12 || t.id == 13) std::memcpy(&buf[off + 2], &d, 2);
    }
    void *a = t.id == 8 ? static_cast<void *>(act8.data()) : static_cast<void *>(act.data());
    for (const auto &shape : kShapes) {
      const int64_t k = shape[0], n = shape[1];
      const size_t row = static_cast<size_t>(k / t.block_weights) * t.block_bytes;
      const size_t matrix = row * n, matrices = total / matrix;
      if (matrices == 0) continue;
      std::vector<std::pair<std::string, std::function<void(const uint8_t *)>>> variants;
      for (size_t li = 0; li < libs.size(); ++li) {
        auto gemm = reinterpret_cast<GemmFn>(dlsym(libs[li], "elk_gemm"));
        auto q8k = reinterpret_cast<QuantizeFn>(dlsym(libs[li], "elk_quantize_row_q8_K"));
        auto q8 = reinterpret_cast<QuantizeRefFn>(dlsym(libs[li], "elk_quantize_row_ref"));
        variants.push_back({"lib" + std::to_string(li), [=, &x, &out](const uint8_t *w) {
          if (t.id == 8) {
            q8(8, x.data(), a, k);
          } else {
            q8k(x.data(), a, k);
          }
          gemm(t.id, k, w, row, n, a, 0, 1, out.data(), n);
        }});
      }
      if (ggml != nullptr) {
        auto dot = reinterpret_cast<GgmlDotFn>(dlsym(ggml, t.ggml_dot));
        auto quantize = reinterpret_cast<QuantizeFn>(
            dlsym(ggml, t.id == 8 ? "quantize_row_q8_0" : "quantize_row_q8_K"));
        variants.push_back({"ggml_dot", [=, &x, &out](const uint8_t *w) {
          quantize(x.data(), a, k);
          for (int64_t j = 0; j < n; ++j) dot(k, &out[j], 0, w + j * row, 0, a, 0, 1);
        }});
        auto gemv = reinterpret_cast<GgmlGemvFn>(dlsym(ggml, "ggml_gemv_q4_K_8x8_q8_K"));
        if (t.id == 12 && gemv != nullptr) {
          variants.push_back({"ggml_q4_K_8x8", [=, &x, &out](const uint8_t *w) {
            quantize(x.data(), a, k);
            gemv(static_cast<int>(k), out.data(), n, w, a, 1, static_cast<int>(n));
          }});
        }
      }
      std::vector<std::vector<double>> rates(variants.size());
      for (int r = 0; r < rounds; ++r) {
        for (size_t v = 0; v < variants.size(); ++v) {
          const double c0 = cpu_seconds();
          for (int pass = 0; pass < inner; ++pass) {
            for (size_t m = 0; m < matrices; ++m) variants[v].second(buf.data() + m * matrix);
          }
          rates[v].push_back(static_cast<double>(inner) * matrices * matrix /
                             (cpu_seconds() - c0) / 1e9);
        }
      }
      bool same = true;
      std::vector<float> first;
      for (size_t li = 0; li < libs.size(); ++li) {
        variants[li].second(buf.data());
        if (li == 0) {
          first.assign(out.begin(), out.begin() + n);
        } else if (std::memcmp(first.data(), out.data(), n * sizeof(float)) != 0) {
          same = false;
        }
      }
      std::printf("%s K=%lld N=%lld:", t.name, static_cast<long long>(k),
                  static_cast<long long>(n));
      for (size_t v = 0; v < variants.size(); ++v) {
        std::sort(rates[v].begin(), rates[v].end());
        std::printf("  %s %.2f", variants[v].first.c_str(), rates[v][rates[v].size() / 2]);
      }
      std::printf(" GB/s%s\n", same ? "" : "  (libraries' outputs DIFFER)");
      std::fflush(stdout);
    }
  }
  return 0;
}

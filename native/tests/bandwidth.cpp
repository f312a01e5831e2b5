// Memory bandwidth of this machine, for bench/bench_kquant_op.py to set the op's GB/s against:
// a read-only stream (what a GEMV does with its weights) and a STREAM-like triad
// a = b + s * c, on T threads over arrays far larger than the caches. Prints one JSON object:
// the medians of several passes, GB/s (10^9 bytes; the triad counts 2 reads + 1 write, as
// STREAM does). A benchmark tool: plain std::thread is fine here (the op uses ORT's pool).
//     bandwidth [threads=2] [MB per array=256] [passes=9]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Sum of x[begin, end) (8 floats a load, 4 chains): the loads are what is measured.
float read_sum(const float *x, size_t begin, size_t end) {
  __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  for (size_t i = begin; i + 16 <= end; i += 16) {
    for (int c = 0; c < 4; ++c) acc[c] = _mm_add_ps(acc[c], _mm_load_ps(x + i + 4 * c));
  }
  float out[4];
  _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3])));
  return out[0] + out[1] + out[2] + out[3];
}

template <typename Fn>
double timed(int threads, size_t n, Fn fn) {
  std::vector<std::thread> pool;
  const auto start = Clock::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=] { fn(n / threads * t, t + 1 == threads ? n : n / threads * (t + 1)); });
  }
  for (auto &th : pool) th.join();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char **argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t mb = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 256;
  const int passes = argc > 3 ? std::atoi(argv[3]) : 9;
  const size_t n = mb * (1 << 20) / sizeof(float) / 64 * 64;
  const size_t bytes = n * sizeof(float);
  auto *a = static_cast<float *>(std::aligned_alloc(64, bytes));
  auto *b = static_cast<float *>(std::aligned_alloc(64, bytes));
  auto *c = static_cast<float *>(std::aligned_alloc(64, bytes));
  if (a == nullptr || b == nullptr || c == nullptr) return 1;
  // Touch every page on the threads that read it (first touch places the pages).
  timed(threads, n, [=](size_t s, size_t e) {
    for (size_t i = s; i < e; ++i) { a[i] = 0.0f; b[i] = 1.0f; c[i] = 2.0f; }
  });
  std::vector<double> read, triad;
  volatile float sink = 0.0f;
  std::vector<float> partial(threads);
  for (int p = 0; p < passes; ++p) {
    read.push_back(bytes / timed(threads, n, [&](size_t s, size_t e) {
      partial[s * threads / n] = read_sum(b, s, e);
    }) / 1e9);
    sink = sink + partial[0];
    triad.push_back(3.0 * bytes / timed(threads, n, [=](size_t s, size_t e) {
      for (size_t i = s; i < e; ++i) a[i] = b[i] + 3.0f * c[i];
    }) / 1e9);
  }
  std::sort(read.begin(), read.end());
  std::sort(triad.begin(), triad.end());
  std::printf("{\"threads\": %d, \"mb_per_array\": %zu, \"read_gb_s\": %.2f, "
              "\"read_best_gb_s\": %.2f, \"triad_gb_s\": %.2f, \"triad_best_gb_s\": %.2f}\n",
              threads, mb, read[read.size() / 2], read.back(), triad[triad.size() / 2],
              triad.back());
  std::free(a);
  std::free(b);
  std::free(c);
  return 0;
}

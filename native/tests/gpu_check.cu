// The GPU check's harness (scripts/gpu_check.sh, issue 44): every kernel in kernels/ on the GPU
// against its CPU reference, and the K-quant matmul's speed at one model's weight shapes.
//   - kquant.cu through its launcher kquant_cuda_matmul (the activation quantizer, the GEMV for
//     M <= 4, the GEMM above) for Q8_0, Q4_K and Q6_K against native/src/ref.cpp, compiled into
//     this program: every output bit for bit (the CPU op's promise, tolerance 0) and the
//     quantized activations byte for byte; K not a multiple of 256 (Q8_0), N not a multiple of
//     8 or 64, M 1..600, a row of zeros and a tie for the largest magnitude; kquant_cuda_glu
//     against elk_glu, bit for bit.
//   - the older kernels (int4_gemv, rmsnorm, rope, kv_int8): the cases --cases names, which
//     edge_llm_ros/bringup/gpu_check.py writes from cuda_runner.cases() (inputs, launch shape);
//     this program launches them and writes each output next to its input, and the Python
//     compares them with kernel_reference.py within cuda_runner's tolerances.
//   - timings: kquant_cuda_matmul (quantizer included) at each weight shape of --shapes, at M 1
//     (decode) and M --prefill, the median of 5 rounds, the weights cycled over copies of at
//     least --cycle-mb MB so that the L2 cache does not serve them; and a device-to-device copy
//     of 256 MB as the bandwidth roof (2 x bytes / time: read and write, as bandwidthTest).
// A progress line per step on stdout; one JSON object to --json. Exit 1 on any difference in
// the kquant checks (the older kernels' verdict is the Python's), 2 on a usage or CUDA error.
//
//   gpu_check --json out.json [--quick] [--cases manifest] [--shapes file] [--prefill M]
//             [--cycle-mb MB]
//
// Built by nvcc for the GPU the script finds; or as C++ with -I native/tests/cuda_shim, which
// runs the same program on the CPU through cuda_emulation.h: the suite does that with --quick
// (test/test_gpu_check.py), so the harness cannot rot between GPU sessions.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#ifndef __CUDACC__
#include "cuda_emulation.h"
#else
#include <cuda_runtime.h>
#endif
#include <cuda_fp16.h>

#include "blocks.h"
#include "edge_llm_kquant/ref.h"
#include "../../kernels/kquant.cu"
#include "kquant_check.h"

// The older kernels each define their own helpers under the same names (edge_llm::to_f,
// warp_sum, ...): one namespace per file keeps them apart in this one translation unit (their
// headers were included above, so the includes inside are no-ops; the entry names differ).
namespace old_int4_gemv {
#include "../../kernels/int4_gemv.cu"
}
namespace old_rmsnorm {
#include "../../kernels/rmsnorm.cu"
}
namespace old_rope {
#include "../../kernels/rope.cu"
}
namespace old_kv_int8 {
#include "../../kernels/kv_int8.cu"
}

namespace {

void check_cuda(cudaError_t status, const char *what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "gpu_check: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(2);
  }
}

// Device memory freed at scope end.
struct Device {
  void *p = nullptr;
  size_t bytes = 0;
  explicit Device(size_t n) : bytes(n) { check_cuda(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  Device(const void *host, size_t n) : Device(n) { upload(host); }
  ~Device() { cudaFree(p); }
  Device(const Device &) = delete;
  Device &operator=(const Device &) = delete;
  void upload(const void *host) {
    check_cuda(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "copy to the device");
  }
  void download(void *host) const {
    check_cuda(cudaMemcpy(host, p, bytes, cudaMemcpyDeviceToHost), "copy from the device");
  }
  template <typename T>
  T *as() const { return static_cast<T *>(p); }
};

// ---- JSON out --------------------------------------------------------------------------------

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

struct Json {
  std::vector<std::string> checks, timings;
  std::string device, roof;
  bool passed = true;
};

// ---- the kquant checks -----------------------------------------------------------------------

struct TypeInfo {
  int type;
  const char *name;
  size_t bytes;
  std::initializer_list<size_t> scales;
};
const TypeInfo kTypes[] = {{ELK_Q8_0, "Q8_0", 34, {0}},
                           {ELK_Q4_K, "Q4_K", 144, {0, 2}},
                           {ELK_Q6_K, "Q6_K", 210, {208}}};

const TypeInfo *type_named(const std::string &name) {
  for (const TypeInfo &t : kTypes) {
    if (name == t.name) return &t;
  }
  return nullptr;
}

// One kquant_cuda_matmul call on the device against ref.cpp: outputs and activations.
void check_matmul(std::mt19937 &rng, const TypeInfo &t, int64_t k, int64_t n, int64_t m,
                  Json &json) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const Case c{t.type, t.name, t.bytes, t.scales, k, n};
  const int per = elk_block_weights(t.type), act = elk_activation_type(t.type);
  const size_t row_bytes = static_cast<size_t>(k / per) * t.bytes;
  const std::vector<uint8_t> w = random_blocks(rng, t.bytes, n * (k / per), t.scales);
  std::vector<float> bias(n), a(m * k);
  for (auto &v : bias) v = normal(rng);
  for (auto &v : a) v = normal(rng);
  if (m >= 3) {
    std::fill(a.begin() + k, a.begin() + 2 * k, 0.0f);  // row 1: all zeros
    a[2 * k + 5] = 4.0f;                                 // row 2: a tie, + first
    a[2 * k + 9] = -4.0f;
  }
  const bool with_bias = m % 2 == 1;
  std::vector<uint8_t> q(static_cast<size_t>(k / elk_block_weights(act)) * elk_block_bytes(act));
  std::vector<float> want(m * n);
  for (int64_t r = 0; r < m; ++r) {
    elk_quantize_row_ref(act, &a[r * k], q.data(), k);
    for (int64_t col = 0; col < n; ++col) {
      float value;
      elk_vec_dot_ref(t.type, k, &w[col * row_bytes], q.data(), &value);
      want[r * n + col] = with_bias ? value + bias[col] : value;
    }
  }
  Device dw(w.data(), w.size()), da(a.data(), a.size() * 4), db(bias.data(), bias.size() * 4);
  Device dy(want.size() * 4), scratch(kquant_cuda_scratch_bytes(t.type, m, k));
  check_cuda(cudaMemset(dy.p, 0xff, dy.bytes), "cudaMemset");  // NaNs where nothing is written
  const int status = kquant_cuda_matmul(t.type, da.as<float>(), dw.as<uint8_t>(),
                                        with_bias ? db.as<float>() : nullptr, dy.as<float>(), m,
                                        n, k, scratch.p, nullptr);
  check_cuda(cudaDeviceSynchronize(), "kquant_cuda_matmul");
  std::vector<float> got(want.size());
  std::vector<uint8_t> acts(scratch.bytes);
  dy.download(got.data());
  scratch.download(acts.data());
  const bool acts_equal = check_activations(c, a, m, acts.data()) == 0;
  int64_t different = 0;
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!same_bits(&want[i], &got[i], 4)) {
      ++different;
      const double e = std::fabs(static_cast<double>(want[i]) - got[i]);
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    }
  }
  const bool ok = status == 0 && different == 0 && acts_equal;
  json.passed = json.passed && ok;
  const char *path = m <= kquant::kMaxGemvRows ? "gemv" : "gemm";
  std::printf("  kquant %s K %lld N %lld M %lld (%s%s): %s\n", t.name, static_cast<long long>(k),
              static_cast<long long>(n), static_cast<long long>(m), path,
              with_bias ? ", bias" : "", ok ? "bit-equal" : "DIFFERENT");
  if (!ok) {
    std::printf("    status %d, activations %s, %lld of %zu outputs differ, max |err| %g\n",
                status, acts_equal ? "equal" : "differ", static_cast<long long>(different),
                want.size(), worst);
  }
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"kernel\": \"kquant_cuda_matmul\", \"type\": \"%s\", \"path\": \"%s\", "
                "\"k\": %lld, \"n\": %lld, \"m\": %lld, \"bias\": %s, \"status\": %d, "
                "\"activations_equal\": %s, \"different\": %lld, \"max_abs_err\": %s, "
                "\"tolerance\": 0, \"passed\": %s}",
                t.name, path, static_cast<long long>(k), static_cast<long long>(n),
                static_cast<long long>(m), with_bias ? "true" : "false", status,
                acts_equal ? "true" : "false", static_cast<long long>(different),
                json_number(worst).c_str(), ok ? "true" : "false");
  json.checks.push_back(buf);
}

// kquant_cuda_glu against elk_glu, bit for bit: normal values, the clamp's edges, infinities,
// a NaN (NaN outputs compare as bits too: the same operations give the same NaN).
void check_glu(std::mt19937 &rng, int kind, int64_t m, int64_t half, Json &json) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> wide(-120.0f, 120.0f);
  std::vector<float> y(m * 2 * half);
  for (size_t i = 0; i < y.size(); ++i) y[i] = i % 3 ? normal(rng) * 4.0f : wide(rng);
  const float edges[] = {0.0f,     -0.0f,  87.3f,    -87.3f,    88.3f, -88.3f,
                         1e30f,    -1e30f, INFINITY, -INFINITY, NAN,   1e-30f};
  for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); ++e) y[e] = edges[e];
  std::vector<float> got(m * half), want(m * half);
  for (int64_t r = 0; r < m; ++r) {
    elk_glu(kind, &y[r * 2 * half], &y[r * 2 * half + half], &want[r * half], half);
  }
  Device dy(y.data(), y.size() * 4), dout(got.size() * 4);
  const int status = kquant_cuda_glu(kind, dy.as<float>(), dout.as<float>(), m, half, nullptr);
  check_cuda(cudaDeviceSynchronize(), "kquant_cuda_glu");
  dout.download(got.data());
  int64_t different = 0;
  for (size_t i = 0; i < want.size(); ++i) different += !same_bits(&want[i], &got[i], 4);
  const bool ok = status == 0 && different == 0;
  json.passed = json.passed && ok;
  std::printf("  kquant_glu kind %d M %lld half %lld: %s\n", kind, static_cast<long long>(m),
              static_cast<long long>(half), ok ? "bit-equal" : "DIFFERENT");
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "{\"kernel\": \"kquant_cuda_glu\", \"kind\": %d, \"m\": %lld, \"half\": %lld, "
                "\"status\": %d, \"different\": %lld, \"tolerance\": 0, \"passed\": %s}",
                kind, static_cast<long long>(m), static_cast<long long>(half), status,
                static_cast<long long>(different), ok ? "true" : "false");
  json.checks.push_back(buf);
}

// ---- the older kernels: cases from a manifest --------------------------------------------------

// One argument of a case; converts to whatever the kernel's parameter is (pointer, int, float).
struct Arg {
  void *pointer = nullptr;
  int integer = 0;
  float real = 0.0f;
  template <typename T>
  operator T *() const { return static_cast<T *>(pointer); }
  operator int() const { return integer; }
  operator float() const { return real; }
};

using Launcher = void (*)(dim3, dim3, const std::vector<Arg> &);
struct Entry {
  const char *name;
  size_t arity;
  Launcher launch;
};

#define OLD_ARGS5 a[0], a[1], a[2], a[3], a[4]
#define OLD_ARGS7 OLD_ARGS5, a[5], a[6]
#define OLD_ARGS8 OLD_ARGS7, a[7]
#define OLD_ARGS9 OLD_ARGS8, a[8]
#define OLD(space, name, arity)                                          \
  Entry {                                                                \
    #name, arity, [](dim3 g, dim3 b, const std::vector<Arg> &a) {       \
      KQUANT_LAUNCH(space::name, g, b, nullptr, OLD_ARGS##arity);        \
    }                                                                    \
  }

const Entry kEntries[] = {
    OLD(old_int4_gemv, int4_gemv_f32, 8),     OLD(old_int4_gemv, int4_gemv_f16, 8),
    OLD(old_rmsnorm, rmsnorm_f32, 5),         OLD(old_rmsnorm, rmsnorm_f16, 5),
    OLD(old_rmsnorm, add_rmsnorm_f32, 7),     OLD(old_rmsnorm, add_rmsnorm_f16, 7),
    OLD(old_rope, rope_f32, 9),               OLD(old_rope, rope_f16, 9),
    OLD(old_kv_int8, kv_quantize_f32, 8),     OLD(old_kv_int8, kv_quantize_f16, 8),
    OLD(old_kv_int8, kv_dequantize_f32, 8),   OLD(old_kv_int8, kv_dequantize_f16, 8),
};

std::vector<uint8_t> read_file(const std::string &path, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(out.data(), 1, bytes, f) != bytes) {
    std::fprintf(stderr, "gpu_check: cannot read %zu bytes of %s\n", bytes, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return out;
}

void write_file(const std::string &path, const std::vector<uint8_t> &data) {
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data.data(), 1, data.size(), f) != data.size() || std::fclose(f)) {
    std::fprintf(stderr, "gpu_check: cannot write %s\n", path.c_str());
    std::exit(2);
  }
}

// The manifest: per case a line `case ID ENTRY GX GY GZ BX BY BZ NARGS`, then an argument a
// line: `in|out|inout PATH BYTES` (device memory from the file; out and inout come back to
// PATH.got), `null`, `int V` or `float BITS` (the float32's bits as an unsigned integer).
int run_cases(const std::string &manifest) {
  FILE *f = std::fopen(manifest.c_str(), "r");
  if (!f) {
    std::fprintf(stderr, "gpu_check: cannot open %s\n", manifest.c_str());
    return 2;
  }
  char line[4096];
  int ran = 0;
  while (std::fgets(line, sizeof(line), f)) {
    char entry[128];
    int id;
    unsigned g[3], b[3];
    size_t nargs;
    if (std::sscanf(line, "case %d %127s %u %u %u %u %u %u %zu", &id, entry, &g[0], &g[1], &g[2],
                    &b[0], &b[1], &b[2], &nargs) != 9) {
      std::fprintf(stderr, "gpu_check: %s: not a case line: %s", manifest.c_str(), line);
      return 2;
    }
    const Entry *e = nullptr;
    for (const Entry &x : kEntries) {
      if (!std::strcmp(x.name, entry)) e = &x;
    }
    if (!e || e->arity != nargs) {
      std::fprintf(stderr, "gpu_check: case %d: no kernel %s of %zu arguments\n", id, entry,
                   nargs);
      return 2;
    }
    std::vector<Arg> args(nargs);
    std::vector<Device *> buffers;
    std::vector<std::pair<size_t, std::string>> outputs;  // buffer index, file
    for (size_t i = 0; i < nargs; ++i) {
      char kind[16], path[3000];
      size_t bytes = 0;
      unsigned long long value = 0;
      if (!std::fgets(line, sizeof(line), f) || std::sscanf(line, "%15s", kind) != 1) {
        std::fprintf(stderr, "gpu_check: case %d: argument %zu missing\n", id, i);
        return 2;
      }
      const std::string k = kind;
      if (k == "in" || k == "out" || k == "inout") {
        if (std::sscanf(line, "%*s %2999s %zu", path, &bytes) != 2) return 2;
        buffers.push_back(new Device(read_file(path, bytes).data(), bytes));
        args[i].pointer = buffers.back()->p;
        if (k != "in") outputs.emplace_back(buffers.size() - 1, path);
      } else if (k == "int" && std::sscanf(line, "%*s %llu", &value) == 1) {
        args[i].integer = static_cast<int>(static_cast<long long>(value));
      } else if (k == "float" && std::sscanf(line, "%*s %llu", &value) == 1) {
        const uint32_t bits = static_cast<uint32_t>(value);
        std::memcpy(&args[i].real, &bits, 4);
      } else if (k != "null") {
        std::fprintf(stderr, "gpu_check: case %d: bad argument line %s", id, line);
        return 2;
      }
    }
    e->launch(dim3(g[0], g[1], g[2]), dim3(b[0], b[1], b[2]), args);
    check_cuda(cudaGetLastError(), entry);
    check_cuda(cudaDeviceSynchronize(), entry);
    for (const auto &out : outputs) {
      std::vector<uint8_t> host(buffers[out.first]->bytes);
      buffers[out.first]->download(host.data());
      write_file(out.second + ".got", host);
    }
    for (Device *d : buffers) delete d;
    std::printf("  case %d %s: ran\n", id, entry);
    ++ran;
  }
  std::fclose(f);
  return ran > 0 ? 0 : 2;
}

// ---- timings ---------------------------------------------------------------------------------

// Median milliseconds of one call of fn over 5 rounds of `reps` calls (events around a round).
template <typename Fn>
double median_ms(int reps, Fn fn) {
  cudaEvent_t start, end;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&end), "cudaEventCreate");
  std::vector<double> rounds;
  for (int round = 0; round < 5; ++round) {
    check_cuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
    for (int r = 0; r < reps; ++r) fn(r);
    check_cuda(cudaEventRecord(end, nullptr), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(end), "timed calls");
    float ms = 0.0f;
    check_cuda(cudaEventElapsedTime(&ms, start, end), "cudaEventElapsedTime");
    rounds.push_back(static_cast<double>(ms) / reps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

// Enough repetitions for about 20 ms a round (one call timed first; at least 1, at most 2000).
template <typename Fn>
int reps_for(Fn fn, bool quick) {
  if (quick) return 1;
  const double once = median_ms(1, fn);
  return static_cast<int>(std::min(2000.0, std::max(1.0, 20.0 / std::max(once, 1e-3))));
}

void time_roof(size_t bytes, bool quick, Json &json) {
  Device from(bytes), to(bytes);
  check_cuda(cudaMemset(from.p, 1, bytes), "cudaMemset");
  auto copy = [&](int) {
    check_cuda(cudaMemcpy(to.p, from.p, bytes, cudaMemcpyDeviceToDevice), "device copy");
  };
  const double ms = median_ms(reps_for(copy, quick), copy);
  const double gb_s = 2.0 * bytes / (ms * 1e-3) / 1e9;
  std::printf("  roof: device-to-device copy of %.0f MB: %.3f ms, %.1f GB/s (read + write)\n",
              bytes / 1e6, ms, gb_s);
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "{\"what\": \"device-to-device copy\", \"bytes\": %zu, \"ms\": %s, "
                "\"gb_s\": %s}", bytes, json_number(ms).c_str(), json_number(gb_s).c_str());
  json.roof = buf;
}

// kquant_cuda_matmul at one weight shape for M rows; the weights cycled over `copies` copies.
void time_matmul(std::mt19937 &rng, const std::string &name, const TypeInfo &t, int64_t n,
                 int64_t k, const std::vector<int64_t> &ms, size_t cycle_bytes, bool quick,
                 Json &json) {
  const int per = elk_block_weights(t.type);
  const size_t bytes = static_cast<size_t>(n) * (k / per) * t.bytes;
  const size_t copies = std::max<size_t>(1, (cycle_bytes + bytes - 1) / bytes);
  const std::vector<uint8_t> w = random_blocks(rng, t.bytes, n * (k / per), t.scales);
  Device dw(bytes * copies);
  for (size_t c = 0; c < copies; ++c) {
    check_cuda(cudaMemcpy(dw.as<uint8_t>() + c * bytes, w.data(), bytes, cudaMemcpyHostToDevice),
               "copy to the device");
  }
  for (int64_t m : ms) {
    std::vector<float> a(m * k);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto &v : a) v = normal(rng);
    Device da(a.data(), a.size() * 4), dy(static_cast<size_t>(m) * n * 4);
    Device scratch(kquant_cuda_scratch_bytes(t.type, m, k));
    auto call = [&](int r) {
      const int status = kquant_cuda_matmul(t.type, da.as<float>(),
                                            dw.as<uint8_t>() + (r % copies) * bytes, nullptr,
                                            dy.as<float>(), m, n, k, scratch.p, nullptr);
      if (status) {
        std::fprintf(stderr, "gpu_check: kquant_cuda_matmul returned %d\n", status);
        std::exit(2);
      }
    };
    const double ms_call = median_ms(reps_for(call, quick), call);
    const double gb_s = bytes / (ms_call * 1e-3) / 1e9;
    std::printf("  time %-10s %s N %lld K %lld M %lld: %.4f ms, %.1f GB/s of weights\n",
                name.c_str(), t.name, static_cast<long long>(n), static_cast<long long>(k),
                static_cast<long long>(m), ms_call, gb_s);
    char buf[384];
    std::snprintf(buf, sizeof(buf),
                  "{\"name\": \"%s\", \"type\": \"%s\", \"n\": %lld, \"k\": %lld, \"m\": %lld, "
                  "\"weight_bytes\": %zu, \"copies\": %zu, \"ms\": %s, \"gb_s\": %s}",
                  name.c_str(), t.name, static_cast<long long>(n), static_cast<long long>(k),
                  static_cast<long long>(m), bytes, copies, json_number(ms_call).c_str(),
                  json_number(gb_s).c_str());
    json.timings.push_back(buf);
  }
}

std::string device_json() {
#ifdef __CUDACC__
  int device = 0;
  cudaDeviceProp prop;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::string name = prop.name;
  std::replace(name.begin(), name.end(), '"', '\'');
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"name\": \"%s\", \"sm\": \"sm_%d%d\", \"multiprocessors\": %d, "
                "\"memory_bytes\": %zu, \"cuda_runtime\": %d, \"cuda_driver\": %d, "
                "\"emulated\": false}",
                name.c_str(), prop.major, prop.minor, prop.multiProcessorCount,
                static_cast<size_t>(prop.totalGlobalMem), runtime, driver);
  return buf;
#else
  return "{\"name\": \"cuda_emulation.h on the CPU\", \"sm\": null, \"emulated\": true}";
#endif
}

void usage() {
  std::fprintf(stderr, "usage: gpu_check --json OUT [--quick] [--cases MANIFEST] "
                       "[--shapes FILE] [--prefill M] [--cycle-mb MB]\n");
}

}  // namespace

int main(int argc, char **argv) {
  std::string json_path, manifest, shapes;
  bool quick = false;
  int64_t prefill = 512;
  size_t cycle_mb = 256;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--json" && has_value) {
      json_path = argv[++i];
    } else if (arg == "--cases" && has_value) {
      manifest = argv[++i];
    } else if (arg == "--shapes" && has_value) {
      shapes = argv[++i];
    } else if (arg == "--prefill" && has_value) {
      prefill = std::atoll(argv[++i]);
    } else if (arg == "--cycle-mb" && has_value) {
      cycle_mb = std::strtoull(argv[++i], nullptr, 10);
    } else {
      usage();
      return 2;
    }
  }
  if (json_path.empty() || prefill < 1) {
    usage();
    return 2;
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress lines go through a pipe: a line at a time
  Json json;
  json.device = device_json();
  std::printf("gpu_check: device %s\n", json.device.c_str());
  std::fflush(stdout);

  // The kquant checks. Q8_0 takes any K a multiple of 32: K 96 and 1120 are not multiples of
  // 256 (partial GEMV steps and GEMM tiles); the K types need whole super-blocks.
  std::mt19937 rng(44);
  struct Shape { int64_t k, n; };
  const std::vector<std::vector<Shape>> shapes_of = quick
      ? std::vector<std::vector<Shape>>{{{96, 37}}, {{256, 37}}, {{512, 13}}}
      : std::vector<std::vector<Shape>>{{{96, 37}, {1120, 70}, {1536, 129}},
                                        {{256, 37}, {768, 70}, {1536, 129}},
                                        {{512, 37}, {768, 70}, {1536, 129}}};
  const std::vector<int64_t> rows = quick ? std::vector<int64_t>{1, 3, 4, 5, 70}
                                          : std::vector<int64_t>{1, 2, 3, 4, 5, 17, 64, 65,
                                                                 130, 600};
  std::printf("gpu_check: kquant_cuda_matmul against ref.cpp, bit for bit\n");
  for (size_t i = 0; i < 3; ++i) {
    for (const Shape &s : shapes_of[i]) {
      for (int64_t m : rows) check_matmul(rng, kTypes[i], s.k, s.n, m, json);
      std::fflush(stdout);
    }
  }
  for (int kind : {1, 2}) check_glu(rng, kind, 3, 301, json);
  if (!quick) {
    for (int kind : {1, 2}) check_glu(rng, kind, 5, 8960, json);  // an MLP's width
  }

  int cases_status = 0;
  if (!manifest.empty()) {
    std::printf("gpu_check: the older kernels' cases (%s)\n", manifest.c_str());
    cases_status = run_cases(manifest);
  }

  if (!shapes.empty()) {
    std::printf("gpu_check: timings (median of 5 rounds)\n");
    time_roof(quick ? (1u << 20) : (256u << 20), quick, json);
    FILE *f = std::fopen(shapes.c_str(), "r");
    if (!f) {
      std::fprintf(stderr, "gpu_check: cannot open %s\n", shapes.c_str());
      return 2;
    }
    char name[64], type[16];
    long long n, k;
    while (std::fscanf(f, "%63s %15s %lld %lld", name, type, &n, &k) == 4) {
      const TypeInfo *t = type_named(type);
      if (!t || n < 1 || k < 1 || k % elk_block_weights(t->type)) {
        std::fprintf(stderr, "gpu_check: %s: bad shape %s %s %lld %lld\n", shapes.c_str(), name,
                     type, n, k);
        return 2;
      }
      time_matmul(rng, name, *t, n, k, {1, prefill}, quick ? 0 : cycle_mb << 20, quick, json);
      std::fflush(stdout);
    }
    std::fclose(f);
  }

  FILE *out = std::fopen(json_path.c_str(), "w");
  if (!out) {
    std::fprintf(stderr, "gpu_check: cannot write %s\n", json_path.c_str());
    return 2;
  }
  auto list = [&](const std::vector<std::string> &items) {
    std::string s = "[";
    for (size_t i = 0; i < items.size(); ++i) s += (i ? ",\n  " : "\n  ") + items[i];
    return s + "]";
  };
  std::fprintf(out, "{\"device\": %s,\n\"quick\": %s,\n\"passed\": %s,\n\"checks\": %s,\n"
               "\"roof\": %s,\n\"timings\": %s}\n", json.device.c_str(),
               quick ? "true" : "false", json.passed ? "true" : "false",
               list(json.checks).c_str(), json.roof.empty() ? "null" : json.roof.c_str(),
               list(json.timings).c_str());
  std::fclose(out);
  std::printf("gpu_check: kquant checks %s\n", json.passed ? "all bit-equal" : "DIFFERENT");
  if (cases_status) return cases_status;
  return json.passed ? 0 : 1;
}

// LoRA per row (edge_llm_kquant/lora.h): the scalar reference of shrink and expand, the
// registry of adapter pairs per op node, and the current call's row table.
#include "edge_llm_kquant/lora.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "kernels.h"

namespace elk {
#ifndef ELK_HAVE_AVX2
const LoraKernels *avx2_lora_kernels() { return nullptr; }
#endif
#ifndef ELK_HAVE_AVX512
const LoraKernels *avx512_lora_kernels() { return nullptr; }
#endif

namespace {

// u[q] = sum_i x[i] * At[i][q], i in order, a product then an add.
void shrink_ref(const float *x, const float *a_t, int64_t k, int64_t r, float *u) {
  for (int64_t q = 0; q < r; ++q) u[q] = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float xi = x[i];
    const float *row = a_t + i * r;
    for (int64_t q = 0; q < r; ++q) u[q] = u[q] + xi * row[q];
  }
}

// t[j] = sum_q u[q] * Bt[q][j], q in order.
void expand_ref(const float *u, const float *b_t, int64_t r, int64_t n, float *t) {
  for (int64_t j = 0; j < n; ++j) t[j] = 0.0f;
  for (int64_t q = 0; q < r; ++q) {
    const float uq = u[q];
    const float *row = b_t + q * n;
    for (int64_t j = 0; j < n; ++j) t[j] = t[j] + uq * row[j];
  }
}

struct Pair {
  int64_t adapter, k, r, n, col;
  float alpha;
  std::vector<float> a_t, b_t;
};

struct Registry {
  std::shared_mutex mutex;
  std::map<std::string, std::vector<Pair>> nodes;
  // The current call's rows: offsets [rows + 1], ids and scales per use.
  std::vector<int64_t> offsets, ids;
  std::vector<float> scales;
};

Registry &registry() {
  static Registry r;
  return r;
}

// Whether any row of the current call uses an adapter: the op's base path checks only this.
std::atomic<bool> &active() {
  static std::atomic<bool> a{false};
  return a;
}

}  // namespace

const LoraKernels &scalar_lora_kernels() {
  static const LoraKernels kernels{"scalar", shrink_ref, expand_ref};
  return kernels;
}

// The LoRA kernels of the selected dot kernels' ISA (all give the reference's bits).
const LoraKernels &selected_lora() {
  const char *isa = elk_kernel_name();
  const LoraKernels *k = nullptr;
  if (std::strcmp(isa, "avx2") == 0) k = avx2_lora_kernels();
  if (std::strcmp(isa, "avx512_vnni") == 0 || std::strcmp(isa, "amx") == 0) {
    k = avx512_lora_kernels();
  }
  return k != nullptr ? *k : scalar_lora_kernels();
}

bool lora_active() { return active().load(std::memory_order_acquire); }

int lora_deltas(const char *node, const float *x, int64_t rows, int64_t k, int64_t n_w,
                std::vector<float> *delta, std::vector<uint8_t> *used, std::string *error) {
  Registry &reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  auto it = reg.nodes.find(node);
  if (it == reg.nodes.end()) return 0;
  const std::vector<Pair> &pairs = it->second;
  const int64_t table_rows = static_cast<int64_t>(reg.offsets.size()) - 1;
  if (table_rows != rows) {
    *error = std::string("LoRA: node ") + node + " runs " + std::to_string(rows) +
             " rows but the call's adapter table has " + std::to_string(table_rows);
    return -1;
  }
  const LoraKernels &kern = selected_lora();
  bool any = false;
  std::vector<float> u, t;
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t e = reg.offsets[m]; e < reg.offsets[m + 1]; ++e) {
      const float scale = reg.scales[e];
      if (scale == 0.0f) continue;
      for (const Pair &p : pairs) {
        if (p.adapter != reg.ids[e]) continue;
        if (p.k != k || p.col + p.n > n_w) {
          *error = std::string("LoRA: a pair on node ") + node + " is " + std::to_string(p.k) +
                   " -> columns " + std::to_string(p.col) + ".." + std::to_string(p.col + p.n) +
                   ", the node is " + std::to_string(k) + " -> " + std::to_string(n_w);
          return -1;
        }
        if (!any) {
          delta->assign(static_cast<size_t>(rows * n_w), 0.0f);
          used->assign(static_cast<size_t>(rows), 0);
          any = true;
        }
        (*used)[m] = 1;
        u.resize(static_cast<size_t>(p.r));
        t.resize(static_cast<size_t>(p.n));
        kern.shrink(x + m * k, p.a_t.data(), k, p.r, u.data());
        kern.expand(u.data(), p.b_t.data(), p.r, p.n, t.data());
        // llama.cpp's llama_adapter_lora_weight::get_scale.
        const float s = p.alpha != 0.0f ? scale * p.alpha / static_cast<float>(p.r) : scale;
        float *d = delta->data() + m * n_w + p.col;
        for (int64_t j = 0; j < p.n; ++j) d[j] = d[j] + s * t[j];
      }
    }
  }
  return any ? 1 : 0;
}

}  // namespace elk

using namespace elk;

extern "C" int elk_lora_apply(const float *x, int64_t rows, int64_t k, const float *a_t,
                              int64_t r, const float *b_t, int64_t n, const float *scales,
                              float *y) {
  if (rows < 0 || k < 1 || r < 1 || n < 1) return -1;
  const LoraKernels &kern = selected_lora();
  std::vector<float> u(static_cast<size_t>(r)), t(static_cast<size_t>(n));
  for (int64_t m = 0; m < rows; ++m) {
    if (scales[m] == 0.0f) continue;
    kern.shrink(x + m * k, a_t, k, r, u.data());
    kern.expand(u.data(), b_t, r, n, t.data());
    for (int64_t j = 0; j < n; ++j) y[m * n + j] = y[m * n + j] + scales[m] * t[j];
  }
  return 0;
}

extern "C" int elk_lora_add(const char *node, int64_t adapter, int64_t k, int64_t r,
                            const float *a_t, int64_t n_seg, const float *b_t, int64_t col,
                            float alpha) {
  if (node == nullptr || adapter < 1 || k < 1 || r < 1 || n_seg < 1 || col < 0) return -1;
  Pair p{adapter, k, r, n_seg, col, alpha,
         std::vector<float>(a_t, a_t + k * r), std::vector<float>(b_t, b_t + r * n_seg)};
  Registry &reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mutex);
  reg.nodes[node].push_back(std::move(p));
  return 0;
}

extern "C" int64_t elk_lora_remove(int64_t adapter) {
  Registry &reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mutex);
  int64_t dropped = 0;
  for (auto it = reg.nodes.begin(); it != reg.nodes.end();) {
    std::vector<Pair> &pairs = it->second;
    const size_t before = pairs.size();
    pairs.erase(std::remove_if(pairs.begin(), pairs.end(),
                               [adapter](const Pair &p) { return p.adapter == adapter; }),
                pairs.end());
    dropped += static_cast<int64_t>(before - pairs.size());
    it = pairs.empty() ? reg.nodes.erase(it) : std::next(it);
  }
  return dropped;
}

extern "C" int64_t elk_lora_pairs(void) {
  Registry &reg = registry();
  std::shared_lock<std::shared_mutex> lock(reg.mutex);
  int64_t n = 0;
  for (const auto &node : reg.nodes) n += static_cast<int64_t>(node.second.size());
  return n;
}

extern "C" int elk_lora_set_rows(int64_t rows, const int64_t *offsets, const int64_t *ids,
                                 const float *scales) {
  if (rows < 0) return -1;
  Registry &reg = registry();
  std::unique_lock<std::shared_mutex> lock(reg.mutex);
  if (rows == 0) {
    reg.offsets.clear();
    reg.ids.clear();
    reg.scales.clear();
    active().store(false, std::memory_order_release);
    return 0;
  }
  const int64_t uses = offsets[rows];
  if (offsets[0] != 0 || uses < 0) return -1;
  for (int64_t m = 0; m < rows; ++m) {
    if (offsets[m + 1] < offsets[m]) return -1;
  }
  reg.offsets.assign(offsets, offsets + rows + 1);
  reg.ids.assign(ids, ids + uses);
  reg.scales.assign(scales, scales + uses);
  active().store(uses > 0, std::memory_order_release);
  return 0;
}

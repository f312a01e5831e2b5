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
template <int T>
void shrink_ref_t(const float *x, const void *a_t, int64_t k, int64_t r, float *u) {
  for (int64_t q = 0; q < r; ++q) u[q] = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float xi = x[i];
    for (int64_t q = 0; q < r; ++q) u[q] = u[q] + xi * lora_value(a_t, T, i * r + q);
  }
}

// t[j] = sum_q u[q] * Bt[q][j], q in order (Bt's rows ldb apart: a block of its columns).
template <int T>
void expand_ref_t(const float *u, const void *b_t, int64_t r, int64_t n, int64_t ldb,
                  float *t) {
  for (int64_t j = 0; j < n; ++j) t[j] = 0.0f;
  for (int64_t q = 0; q < r; ++q) {
    const float uq = u[q];
    for (int64_t j = 0; j < n; ++j) t[j] = t[j] + uq * lora_value(b_t, T, q * ldb + j);
  }
}

void shrink_ref(const float *x, const void *a_t, int type, int64_t k, int64_t r, float *u) {
  if (type == ELK_LORA_F16) return shrink_ref_t<ELK_LORA_F16>(x, a_t, k, r, u);
  if (type == ELK_LORA_BF16) return shrink_ref_t<ELK_LORA_BF16>(x, a_t, k, r, u);
  shrink_ref_t<ELK_LORA_F32>(x, a_t, k, r, u);
}

void expand_ref(const float *u, const void *b_t, int type, int64_t r, int64_t n, int64_t ldb,
                float *t) {
  if (type == ELK_LORA_F16) return expand_ref_t<ELK_LORA_F16>(u, b_t, r, n, ldb, t);
  if (type == ELK_LORA_BF16) return expand_ref_t<ELK_LORA_BF16>(u, b_t, r, n, ldb, t);
  expand_ref_t<ELK_LORA_F32>(u, b_t, r, n, ldb, t);
}

bool known_type(int type) {
  return type == ELK_LORA_F32 || type == ELK_LORA_F16 || type == ELK_LORA_BF16;
}

}  // namespace

// Bt's columns in panels of kLoraPanel: panel b holds columns [b * kLoraPanel, ..) as
// [r][kLoraPanel], the last one zero-padded. A product task's expand then reads r * kLoraPanel
// contiguous elements per panel, not r short pieces of rows n apart (which the prefetchers
// missed: the expand was 10 % of a 4-adapter decode step). Each column's sum is unchanged.
constexpr int64_t kLoraPanel = 16;

struct LoraPair {
  int64_t adapter, k, r, n, col;
  float alpha;
  int type;                         // ELK_LORA_*: the elements of a_t and b_panels
  std::vector<uint8_t> a_t;         // At [k, r]
  std::vector<uint8_t> b_panels;    // Bt [r, n] in panels of kLoraPanel columns
};

namespace {

using Pair = LoraPair;

struct Registry {
  std::shared_mutex mutex;
  std::map<std::string, std::vector<Pair>, std::less<>> nodes;  // find(const char *)
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

namespace {

// Columns of one expand step inside a product task (a multiple of every ISA's lanes).
constexpr int64_t kExpandColumns = 64;

}  // namespace

void LoraRows::shrink(size_t use_index) {
  const Use &use = uses_[use_index];
  kern_->shrink(x_ + use.row * k_, use.pair->a_t.data(), use.pair->type, k_, use.pair->r,
                u_.data() + use.u_at);
}

int LoraRows::prepare(const char *node, const float *x, int64_t rows, int64_t k, int64_t n_w,
                      std::string *error) {
  Registry &reg = registry();
  // Held until this object goes: the product's tasks read the pairs without locking.
  lock_ = std::shared_lock<std::shared_mutex>(reg.mutex);
  auto it = reg.nodes.find(node);
  if (it == reg.nodes.end()) return 0;
  const std::vector<Pair> &pairs = it->second;
  const int64_t table_rows = static_cast<int64_t>(reg.offsets.size()) - 1;
  if (table_rows != rows) {
    *error = std::string("LoRA: node ") + node + " runs " + std::to_string(rows) +
             " rows but the call's adapter table has " + std::to_string(table_rows);
    return -1;
  }
  kern_ = &selected_lora();
  x_ = x;
  k_ = k;
  uses_.clear();
  row_first_.assign(static_cast<size_t>(rows) + 1, 0);
  size_t u_size = 0;
  for (int64_t m = 0; m < rows; ++m) {
    row_first_[m] = uses_.size();
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
        // llama.cpp's llama_adapter_lora_weight::get_scale.
        const float s = p.alpha != 0.0f ? scale * p.alpha / static_cast<float>(p.r) : scale;
        uses_.push_back(Use{m, &p, s, u_size});
        u_size += static_cast<size_t>(p.r);
      }
    }
  }
  row_first_[rows] = uses_.size();
  if (uses_.empty()) return 0;
  u_.assign(u_size, 0.0f);
  return 1;
}

void LoraRows::add(int64_t m, int64_t first, int64_t cols, float *out) const {
  const size_t e0 = row_first_[m], e1 = row_first_[m + 1];
  if (e0 == e1) return;
  float t[kLoraPanel], d[kExpandColumns];
  for (int64_t j0 = first; j0 < first + cols; j0 += kExpandColumns) {
    const int64_t j1 = std::min(j0 + kExpandColumns, first + cols);
    // d = the row's uses in table order, each s * t added to a sum from 0; then out += d:
    // the order of the single-thread run whatever the task's columns.
    for (int64_t j = j0; j < j1; ++j) d[j - j0] = 0.0f;
    for (size_t e = e0; e < e1; ++e) {
      const Use &use = uses_[e];
      const Pair &p = *use.pair;
      const int64_t lo = std::max(j0, p.col), hi = std::min(j1, p.col + p.n);
      if (lo >= hi) continue;
      const size_t panel_bytes = static_cast<size_t>(p.r * kLoraPanel) * lora_type_bytes(p.type);
      // The panels holding the pair's columns [lo, hi), each expanded whole.
      for (int64_t b = (lo - p.col) / kLoraPanel; b * kLoraPanel < hi - p.col; ++b) {
        kern_->expand(u_.data() + use.u_at, p.b_panels.data() + b * panel_bytes, p.type, p.r,
                      kLoraPanel, kLoraPanel, t);
        const int64_t c0 = p.col + b * kLoraPanel;  // W row of t[0]
        if (c0 >= lo && c0 + kLoraPanel <= hi) {  // the whole panel: a fixed-length loop
          float *dd = d + (c0 - j0);
          for (int64_t j = 0; j < kLoraPanel; ++j) dd[j] = dd[j] + use.scale * t[j];
          continue;
        }
        for (int64_t j = std::max(lo, c0); j < std::min(hi, c0 + kLoraPanel); ++j) {
          d[j - j0] = d[j - j0] + use.scale * t[j - c0];
        }
      }
    }
    float *o = out + (j0 - first);
    for (int64_t j = j0; j < j1; ++j) o[j - j0] = o[j - j0] + d[j - j0];
  }
}

}  // namespace elk

using namespace elk;

extern "C" int elk_lora_apply_typed(const float *x, int64_t rows, int64_t k, const void *a_t,
                                    int64_t r, const void *b_t, int64_t n, int type,
                                    const float *scales, float *y) {
  if (rows < 0 || k < 1 || r < 1 || n < 1 || !known_type(type)) return -1;
  const LoraKernels &kern = selected_lora();
  std::vector<float> u(static_cast<size_t>(r)), t(static_cast<size_t>(n));
  for (int64_t m = 0; m < rows; ++m) {
    if (scales[m] == 0.0f) continue;
    kern.shrink(x + m * k, a_t, type, k, r, u.data());
    kern.expand(u.data(), b_t, type, r, n, n, t.data());
    for (int64_t j = 0; j < n; ++j) y[m * n + j] = y[m * n + j] + scales[m] * t[j];
  }
  return 0;
}

extern "C" int elk_lora_add_typed(const char *node, int64_t adapter, int64_t k, int64_t r,
                                  const void *a_t, int64_t n_seg, const void *b_t, int64_t col,
                                  float alpha, int type) {
  if (node == nullptr || adapter < 1 || k < 1 || r < 1 || n_seg < 1 || col < 0 ||
      !known_type(type)) {
    return -1;
  }
  const size_t bytes = lora_type_bytes(type);
  const uint8_t *a = static_cast<const uint8_t *>(a_t), *b = static_cast<const uint8_t *>(b_t);
  const int64_t panels = (n_seg + kLoraPanel - 1) / kLoraPanel;
  std::vector<uint8_t> b_panels(static_cast<size_t>(panels * r * kLoraPanel) * bytes, 0);
  for (int64_t q = 0; q < r; ++q) {
    for (int64_t pb = 0; pb < panels; ++pb) {
      const int64_t j0 = pb * kLoraPanel, width = std::min(kLoraPanel, n_seg - j0);
      std::memcpy(b_panels.data() + static_cast<size_t>((pb * r + q) * kLoraPanel) * bytes,
                  b + static_cast<size_t>(q * n_seg + j0) * bytes,
                  static_cast<size_t>(width) * bytes);
    }
  }
  Pair p{adapter, k, r, n_seg, col, alpha, type,
         std::vector<uint8_t>(a, a + k * r * bytes), std::move(b_panels)};
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

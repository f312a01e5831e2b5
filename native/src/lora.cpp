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

struct Pair {
  int64_t adapter, k, r, n, col;
  float alpha;
  int type;                        // ELK_LORA_*: the elements of a_t and b_t
  std::vector<uint8_t> a_t, b_t;   // At [k, r], Bt [r, n]
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

namespace {

// Columns of one expand task: a multiple of every ISA's lanes (8, 16).
constexpr int64_t kLoraColumnsPerTask = 64;

// One (row, pair) of a call: its shrink u (at u_at in the call's buffer) and its scale.
struct LoraUse {
  int64_t row;
  const Pair *pair;
  float scale;  // llama.cpp's: the goal's scale * alpha / rank (or the goal's scale)
  size_t u_at;
};

struct LoraCall {
  const LoraKernels *kern;
  const float *x;
  int64_t k, n_w, blocks;  // blocks: column blocks of one row
  std::vector<LoraUse> uses;     // in the single-thread order: row, then table entry, then pair
  std::vector<size_t> row_first;  // [rows + 1]: the uses of row m are row_first[m]..
  std::vector<float> u;
  float *delta;
};

void shrink_task(void *data, size_t task) {
  LoraCall &c = *static_cast<LoraCall *>(data);
  const LoraUse &use = c.uses[task];
  c.kern->shrink(c.x + use.row * c.k, use.pair->a_t.data(), use.pair->type, c.k,
                 use.pair->r, c.u.data() + use.u_at);
}

// Row m's columns [j0, j1): every use of the row in order, d[j] += s * t[j] per column.
void expand_task(void *data, size_t task) {
  LoraCall &c = *static_cast<LoraCall *>(data);
  const int64_t m = static_cast<int64_t>(task) / c.blocks;
  const int64_t j0 = static_cast<int64_t>(task) % c.blocks * kLoraColumnsPerTask;
  const int64_t j1 = std::min(j0 + kLoraColumnsPerTask, c.n_w);
  float t[kLoraColumnsPerTask];
  float *d = c.delta + m * c.n_w;
  for (size_t e = c.row_first[m]; e < c.row_first[m + 1]; ++e) {
    const LoraUse &use = c.uses[e];
    const Pair &p = *use.pair;
    const int64_t lo = std::max(j0, p.col), hi = std::min(j1, p.col + p.n);
    if (lo >= hi) continue;
    c.kern->expand(c.u.data() + use.u_at, p.b_t.data() + (lo - p.col) * lora_type_bytes(p.type),
                   p.type, p.r, hi - lo, p.n, t);
    for (int64_t j = lo; j < hi; ++j) d[j] = d[j] + use.scale * t[j - lo];
  }
}

void run_tasks(ParallelForFn parallel_for, void *context, void (*fn)(void *, size_t),
               size_t tasks, void *data) {
  if (tasks == 0) return;
  if (parallel_for != nullptr && tasks > 1) {
    parallel_for(context, fn, tasks, data);
    return;
  }
  for (size_t i = 0; i < tasks; ++i) fn(data, i);
}

}  // namespace

int lora_deltas(const char *node, const float *x, int64_t rows, int64_t k, int64_t n_w,
                std::vector<float> *delta, std::vector<uint8_t> *used, std::string *error,
                ParallelForFn parallel_for, void *context) {
  Registry &reg = registry();
  // Held through both steps: the tasks read the pairs without locking.
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
  LoraCall call;
  call.kern = &selected_lora();
  call.x = x;
  call.k = k;
  call.n_w = n_w;
  call.blocks = (n_w + kLoraColumnsPerTask - 1) / kLoraColumnsPerTask;
  call.row_first.assign(static_cast<size_t>(rows) + 1, 0);
  size_t u_size = 0;
  for (int64_t m = 0; m < rows; ++m) {
    call.row_first[m] = call.uses.size();
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
        call.uses.push_back(LoraUse{m, &p, s, u_size});
        u_size += static_cast<size_t>(p.r);
      }
    }
  }
  call.row_first[rows] = call.uses.size();
  if (call.uses.empty()) return 0;
  delta->assign(static_cast<size_t>(rows * n_w), 0.0f);
  used->assign(static_cast<size_t>(rows), 0);
  for (const LoraUse &use : call.uses) (*used)[use.row] = 1;
  call.u.assign(u_size, 0.0f);
  call.delta = delta->data();
  run_tasks(parallel_for, context, shrink_task, call.uses.size(), &call);
  run_tasks(parallel_for, context, expand_task, static_cast<size_t>(rows * call.blocks), &call);
  return 1;
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
  Pair p{adapter, k, r, n_seg, col, alpha, type,
         std::vector<uint8_t>(a, a + k * r * bytes), std::vector<uint8_t>(b, b + r * n_seg * bytes)};
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

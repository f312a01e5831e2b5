// ONNX Runtime custom op edge_llm_ros.KQuantMatMul: Y[..., N] = A[..., K] x W^T (+ bias[N]
// when the optional third input is given), with W the [N, K] weight held byte for byte in its
// GGUF blocks (a uint8 initializer [N, row bytes]) of any of the 8 types (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Activations are quantized per row once per Compute in the
// type ggml pairs with the weight's (Q8_0, Q8_1 or Q8_K); each output element is one dot
// product of the kernels dispatch.cpp chose, so a row's result does not depend on the batch.
// With the attribute glu = "silu" or "gelu_tanh", W's rows are a gated MLP's gate rows then
// its up rows (N even) and Y[..., N / 2] = act(gate) * up (elk_glu): the MLP's activation runs
// on the task's own product while it is in cache, and the [..., N] product is never stored.
// edge_llm_ros.KQuantGather: Y[..., K] = the rows ids[...] of the same kind of W [V, row bytes],
// dequantized (token embeddings read from the bytes a tied lm_head's KQuantMatMul reads).
// edge_llm_ros.CausalAttention and edge_llm_ros.ShortConv: see their kernels below.
// Threads: ONNX Runtime's intra-op pool (KernelContext_ParallelFor), never a pool of ours.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "edge_llm_kquant/attention.h"
#include "edge_llm_kquant/attention_i8.h"
#include "edge_llm_kquant/ref.h"
#include "edge_llm_kquant/shortconv.h"
#include "edge_llm_kquant/gated_delta.h"
#include "edge_llm_kquant/mamba2.h"
#include "glu.h"
#include "kernels.h"

namespace {

constexpr const char *kDomain = "edge_llm_ros";
// A task: a block of weight rows (output columns) times a block of activation rows, handed
// whole to elk_gemm, which tiles it so each weight block is unpacked once for several
// activation rows. Consecutive tasks share a column block (its weights stay in cache while
// the threads take its row blocks). A GEMV (up to 4 rows) takes 16..64 columns a task, at
// least 64 tasks where N allows (small N: the threads still share it); batches 32 columns,
// 128 for the legacy types (blocks of 32: each task's elk_gemm works out its activation
// rows' block terms again, at 32 columns 15 % of a Q8_0 batch; 128 columns, single-thread,
// Qwen3-0.6B's shapes at 512 rows: 1.10-1.18x; the K types, 8x the work a block, the same).
constexpr int64_t kColumnsPerTask = 64, kMinColumnsPerTask = 16, kBatchColumnsPerTask = 32;
constexpr int64_t kLegacyBatchColumnsPerTask = 128;
constexpr int64_t kRowsPerTask = 64;
// A batch task's scratch rows are cols + this many floats apart: a stride of a power of two
// (cols 128: 512 bytes) would still crowd the rows' sums into a few L1 sets.
constexpr int64_t kScratchPad = 16;

struct Work {
  const uint8_t *weights;
  const uint8_t *activations;
  const float *bias;  // [n], or nullptr
  float *out;
  int64_t rows, n, k;  // n: the output's columns (with a glu, half of W's rows)
  size_t weight_row_bytes, activation_row_bytes;
  int type, glu;
  int64_t columns_per_task, rows_per_task, row_tasks;
  size_t tasks;
  bool scratch;  // a legacy type's batch: the sums in a task scratch (columns())
  // LoRA (lora.h): this call's deltas [rows, W rows] and which rows have one, or nullptr
  // when no row of the call adapts this node (the base path).
  const float *lora = nullptr;
  const uint8_t *lora_used = nullptr;
};

// The tasks for rows x n outputs.
Work plan(const uint8_t *weights, const uint8_t *activations, const float *bias, float *out,
          int64_t rows, int64_t n, int64_t k, size_t weight_row_bytes,
          size_t activation_row_bytes, int type, int glu) {
  const int64_t rows_per_task = rows < kRowsPerTask ? rows : kRowsPerTask;
  const int64_t gemv_columns = n / 64 / 4 * 4;
  const bool legacy_batch = rows_per_task > 4 && elk_block_weights(type) == 32;
  const int64_t columns_per_task =
      legacy_batch ? kLegacyBatchColumnsPerTask
      : rows_per_task > 4 ? kBatchColumnsPerTask
      : gemv_columns < kMinColumnsPerTask ? kMinColumnsPerTask
      : gemv_columns > kColumnsPerTask ? kColumnsPerTask : gemv_columns;
  const int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  const size_t tasks =
      static_cast<size_t>(row_tasks * ((n + columns_per_task - 1) / columns_per_task));
  return Work{weights, activations, bias, out, rows, n, k, weight_row_bytes,
              activation_row_bytes, type, glu, columns_per_task, rows_per_task, row_tasks,
              tasks, legacy_batch};
}

// A task's product of weight rows [first, first + cols) into out (row stride ldo), bias added.
void product(const Work &w, int64_t first, int64_t cols, int64_t row, int64_t rows,
             float *out, int64_t ldo) {
  elk_gemm(w.type, w.k, w.weights + first * w.weight_row_bytes, w.weight_row_bytes, cols,
           w.activations + row * w.activation_row_bytes, w.activation_row_bytes, rows, out,
           ldo);
  if (w.bias != nullptr) {
    const float *bias = w.bias + first;
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t j = 0; j < cols; ++j) out[m * ldo + j] += bias[j];
    }
  }
}

// Add the LoRA deltas of W rows [first, first + cols) to a task's outputs (rows row..).
void add_lora(const Work &w, int64_t first, int64_t cols, int64_t row, int64_t rows, float *out,
              int64_t ldo) {
  const int64_t n_w = w.glu == elk::glu::kNone ? w.n : 2 * w.n;
  for (int64_t m = 0; m < rows; ++m) {
    if (!w.lora_used[row + m]) continue;
    const float *d = w.lora + (row + m) * n_w + first;
    for (int64_t j = 0; j < cols; ++j) out[m * ldo + j] = out[m * ldo + j] + d[j];
  }
}

void columns(void *data, size_t task) {
  const Work &w = *static_cast<const Work *>(data);
  const int64_t first = static_cast<int64_t>(task) / w.row_tasks * w.columns_per_task;
  const int64_t row = static_cast<int64_t>(task) % w.row_tasks * w.rows_per_task;
  const int64_t cols = first + w.columns_per_task < w.n ? w.columns_per_task : w.n - first;
  const int64_t rows = row + w.rows_per_task < w.rows ? w.rows_per_task : w.rows - row;
  float *out = w.out + row * w.n + first;
  thread_local std::vector<float> scratch;
  if (w.glu == elk::glu::kNone && !w.scratch) {
    product(w, first, cols, row, rows, out, w.n);
    if (w.lora != nullptr) add_lora(w, first, cols, row, rows, out, w.n);
    return;
  }
  if (w.glu == elk::glu::kNone) {
    // A legacy type's batch keeps its running sums in memory between blocks of 32
    // (x86_common.h's tile_in_memory): in a task-sized scratch, its rows cols + kScratchPad
    // floats apart, not in the output, whose rows lie N floats apart (N * 4 bytes a multiple
    // of 4 KB puts every row's sums in one L1 set: Q8_0 at Qwen3-0.6B's shapes, 512 rows,
    // one thread, 1.3-1.45x slower). The same sums, copied out whole.
    const int64_t ldo = cols + kScratchPad;
    scratch.resize(static_cast<size_t>(rows * ldo));
    product(w, first, cols, row, rows, scratch.data(), ldo);
    if (w.lora != nullptr) add_lora(w, first, cols, row, rows, scratch.data(), ldo);
    for (int64_t m = 0; m < rows; ++m) {
      std::memcpy(out + m * w.n, scratch.data() + m * ldo, sizeof(float) * cols);
    }
    return;
  }
  // The gate and up columns of this task (rows first.. and n + first.. of W), then the
  // activation: a task-sized scratch per pool thread, reused.
  scratch.resize(static_cast<size_t>(2 * rows * cols));
  float *gate = scratch.data(), *up = gate + rows * cols;
  product(w, first, cols, row, rows, gate, cols);
  product(w, w.n + first, cols, row, rows, up, cols);
  if (w.lora != nullptr) {
    add_lora(w, first, cols, row, rows, gate, cols);
    add_lora(w, w.n + first, cols, row, rows, up, cols);
  }
  for (int64_t m = 0; m < rows; ++m) {
    elk_glu(w.glu, gate + m * cols, up + m * cols, out + m * w.n, cols);
  }
}

// A string attribute, or "" when the node does not set it.
std::string optional_string(const Ort::ConstKernelInfo &info, const char *name) {
  try {
    return info.GetAttribute<std::string>(name);
  } catch (const Ort::Exception &) {
    return {};
  }
}

const char *type_name(int type) {
  switch (type) {
    case ELK_Q4_0: return "Q4_0";
    case ELK_Q4_1: return "Q4_1";
    case ELK_Q5_0: return "Q5_0";
    case ELK_Q5_1: return "Q5_1";
    case ELK_Q8_0: return "Q8_0";
    case ELK_Q4_K: return "Q4_K";
    case ELK_Q5_K: return "Q5_K";
    case ELK_Q6_K: return "Q6_K";
    default: return nullptr;
  }
}

// The weight type and K of an op's attributes, checked: one of the 8 weight types, K a
// positive multiple of its block size. Returns the bytes of one weight row.
size_t checked_row_bytes(const char *op, int type, int64_t k) {
  if (type_name(type) == nullptr) {
    throw Ort::Exception(std::string(op) + ": quant_type " + std::to_string(type) +
                         " is not a GGUF block type this op knows (Q4_0 2, Q4_1 3, Q5_0 6, "
                         "Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14): reconvert the model",
                         ORT_INVALID_ARGUMENT);
  }
  const int per = elk_block_weights(type);
  if (k <= 0 || k % per != 0) {
    throw Ort::Exception(std::string(op) + ": K " + std::to_string(k) + " is not a positive "
                         "multiple of " + type_name(type) + "'s block size " +
                         std::to_string(per) + ": reconvert the model (another quant type, "
                         "or pad K)", ORT_INVALID_ARGUMENT);
  }
  return static_cast<size_t>(k / per) * elk_block_bytes(type);
}

// An op's Compute as an ORT status: its exceptions become errors, never an abort.
template <typename Kernel>
OrtStatusPtr guarded(Kernel &kernel, OrtKernelContext *context) {
  try {
    kernel.Compute(context);
    return nullptr;
  } catch (const Ort::Exception &e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception &e) {  // bad_alloc
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

template <typename Kernel>
OrtStatusPtr create(const OrtApi &api, const OrtKernelInfo *info, void **kernel) {
  try {
    *kernel = new Kernel(api, info);
    return nullptr;
  } catch (const Ort::Exception &e) {
    return api.CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception &e) {
    return api.CreateStatus(ORT_FAIL, e.what());
  }
}

// Activation rows to the weight type's activation blocks, kQuantizeRows rows a task.
constexpr int64_t kQuantizeRows = 16;

struct Quantize {
  const float *input;
  uint8_t *out;
  int64_t k;
  size_t row_bytes;
  int type;
  int64_t rows;
};

void quantize_rows(void *data, size_t task) {
  const Quantize &q = *static_cast<const Quantize *>(data);
  const int64_t first = static_cast<int64_t>(task) * kQuantizeRows;
  const int64_t last = first + kQuantizeRows < q.rows ? first + kQuantizeRows : q.rows;
  for (int64_t m = first; m < last; ++m) {
    elk_quantize_row(q.type, q.input + m * q.k, q.out + m * q.row_bytes, q.k);
  }
}

// elk::ParallelForFn over an op's KernelContext (lora_deltas' tasks on the intra-op pool).
void ort_parallel_for(void *context, void (*fn)(void *, size_t), size_t tasks, void *data) {
  static_cast<Ort::KernelContext *>(context)->ParallelFor(fn, tasks, 0, data);
}

struct KQuantMatMulKernel {
  KQuantMatMulKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo kernel_info(info);
    type_ = static_cast<int>(kernel_info.GetAttribute<int64_t>("quant_type"));
    k_ = kernel_info.GetAttribute<int64_t>("K");
    n_ = kernel_info.GetAttribute<int64_t>("N");
    row_bytes_ = checked_row_bytes("KQuantMatMul", type_, k_);
    if (n_ <= 0) {
      throw Ort::Exception("KQuantMatMul: N " + std::to_string(n_) + " is not positive",
                           ORT_INVALID_ARGUMENT);
    }
    std::string error;
    glu_ = elk::glu::kind_of_attribute(optional_string(kernel_info, "glu"), n_, &error);
    if (glu_ < 0) throw Ort::Exception("KQuantMatMul: " + error, ORT_INVALID_ARGUMENT);
    name_ = kernel_info.GetNodeName();  // where LoRA pairs are registered (lora.h)
    activation_type_ = elk_activation_type(type_);
    activation_row_bytes_ = static_cast<size_t>(k_ / elk_block_weights(activation_type_)) *
                            elk_block_bytes(activation_type_);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue a = ctx.GetInput(0), w = ctx.GetInput(1);
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> w_shape = w.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k_) {
      throw Ort::Exception("KQuantMatMul: A's last dimension is not K = " + std::to_string(k_),
                           ORT_INVALID_ARGUMENT);
    }
    if (w_shape.size() != 2 || w_shape[0] != n_ ||
        w_shape[1] != static_cast<int64_t>(row_bytes_)) {
      throw Ort::Exception("KQuantMatMul: W is not [N, row bytes] = [" + std::to_string(n_) +
                           ", " + std::to_string(row_bytes_) + "] of GGUF blocks",
                           ORT_INVALID_ARGUMENT);
    }
    const float *bias = nullptr;
    if (ctx.GetInputCount() > 2) {
      const Ort::ConstValue b = ctx.GetInput(2);
      if (static_cast<const OrtValue *>(b) != nullptr) {
        const std::vector<int64_t> b_shape = b.GetTensorTypeAndShapeInfo().GetShape();
        if (b_shape.size() != 1 || b_shape[0] != n_) {
          throw Ort::Exception("KQuantMatMul: bias is not [N] = [" + std::to_string(n_) + "]",
                               ORT_INVALID_ARGUMENT);
        }
        bias = b.GetTensorData<float>();
      }
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    const int64_t out_n = glu_ == elk::glu::kNone ? n_ : n_ / 2;
    shape.back() = out_n;
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (rows == 0) return;
    const float *input = a.GetTensorData<float>();
    // This call's own scratch: ORT may run one session (one kernel object) from several
    // threads at once, so nothing a Compute writes lives in the kernel.
    std::vector<uint8_t> activations(static_cast<size_t>(rows) * activation_row_bytes_);
    // The rows' quantization on the intra-op pool too (it was a serial 10 % of a batched
    // call, the other threads waiting): each row by itself, so the bytes are the same.
    Quantize q{input, activations.data(), k_, activation_row_bytes_, activation_type_, rows};
    const size_t quantize_tasks = static_cast<size_t>((rows + kQuantizeRows - 1) / kQuantizeRows);
    if (quantize_tasks == 1) {
      quantize_rows(&q, 0);
    } else {
      ctx.ParallelFor(quantize_rows, quantize_tasks, 0, &q);
    }
    Work work = plan(w.GetTensorData<uint8_t>(), activations.data(), bias,
                     y.GetTensorMutableData<float>(), rows, out_n, k_, row_bytes_,
                     activation_row_bytes_, type_, glu_);
    std::vector<float> lora_delta;
    std::vector<uint8_t> lora_used;
    if (elk::lora_active()) {  // some row of this call names an adapter
      std::string error;
      // Its shrinks and expands on ONNX Runtime's intra-op pool, as the product's columns.
      const int got = elk::lora_deltas(name_.c_str(), input, rows, k_, n_, &lora_delta,
                                       &lora_used, &error, ort_parallel_for, &ctx);
      if (got < 0) throw Ort::Exception("KQuantMatMul: " + error, ORT_INVALID_ARGUMENT);
      if (got > 0) {
        work.lora = lora_delta.data();
        work.lora_used = lora_used.data();
      }
    }
    ctx.ParallelFor(columns, work.tasks, 0, &work);
  }

 private:
  std::string name_;
  int type_ = 0, activation_type_ = 0, glu_ = elk::glu::kNone;
  int64_t k_ = 0, n_ = 0;
  size_t row_bytes_ = 0, activation_row_bytes_ = 0;  // the kernel holds attributes only
};

struct KQuantMatMulOp : Ort::CustomOpBase<KQuantMatMulOp, KQuantMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<KQuantMatMulKernel>(api, info, kernel);
  }
  const char *GetName() const { return "KQuantMatMul"; }
  // A fp32 [..., K], W uint8 [N, row bytes], and an optional bias fp32 [N].
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

struct GatherWork {
  const uint8_t *weights;
  const int64_t *ids;
  float *out;
  int64_t count, k;
  size_t row_bytes;
  int type;
};

constexpr int64_t kIdsPerTask = 8;

void gather_rows(void *data, size_t task) {
  const GatherWork &w = *static_cast<const GatherWork *>(data);
  const int64_t first = static_cast<int64_t>(task) * kIdsPerTask;
  const int64_t last = first + kIdsPerTask < w.count ? first + kIdsPerTask : w.count;
  for (int64_t i = first; i < last; ++i) {
    elk_dequantize_row_ref(w.type, w.weights + w.ids[i] * w.row_bytes, w.out + i * w.k, w.k);
  }
}

struct KQuantGatherKernel {
  KQuantGatherKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo kernel_info(info);
    type_ = static_cast<int>(kernel_info.GetAttribute<int64_t>("quant_type"));
    k_ = kernel_info.GetAttribute<int64_t>("K");
    row_bytes_ = checked_row_bytes("KQuantGather", type_, k_);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue w = ctx.GetInput(0), ids = ctx.GetInput(1);
    const std::vector<int64_t> w_shape = w.GetTensorTypeAndShapeInfo().GetShape();
    if (w_shape.size() != 2 || w_shape[1] != static_cast<int64_t>(row_bytes_)) {
      throw Ort::Exception("KQuantGather: W is not [V, row bytes] = [V, " +
                           std::to_string(row_bytes_) + "] of GGUF blocks",
                           ORT_INVALID_ARGUMENT);
    }
    const int64_t v = w_shape[0];
    const Ort::TensorTypeAndShapeInfo id_info = ids.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> shape = id_info.GetShape();
    const int64_t count = static_cast<int64_t>(id_info.GetElementCount());
    const int64_t *id = ids.GetTensorData<int64_t>();
    for (int64_t i = 0; i < count; ++i) {  // every id checked before any row is read
      if (id[i] < 0 || id[i] >= v) {
        throw Ort::Exception("KQuantGather: id " + std::to_string(id[i]) +
                             " is outside [0, V) = [0, " + std::to_string(v) + ")",
                             ORT_INVALID_ARGUMENT);
      }
    }
    shape.push_back(k_);
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (count == 0) return;
    GatherWork work{w.GetTensorData<uint8_t>(), id, y.GetTensorMutableData<float>(), count, k_,
                    row_bytes_, type_};
    ctx.ParallelFor(gather_rows, static_cast<size_t>((count + kIdsPerTask - 1) / kIdsPerTask),
                    0, &work);
  }

 private:
  int type_ = 0;
  int64_t k_ = 0;
  size_t row_bytes_ = 0;
};

struct KQuantGatherOp : Ort::CustomOpBase<KQuantGatherOp, KQuantGatherKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<KQuantGatherKernel>(api, info, kernel);
  }
  const char *GetName() const { return "KQuantGather"; }
  // W uint8 [V, row bytes], ids int64 of any shape.
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};
// Both ops below take their rows in one of two forms, and run one code path over a row table
// (elk_row) built from either:
//   batched: input [B, S, ...] and seqlens_k [B]; row b is buffer slot b at positions
//     seqlens_k[b] + 1 - S .. seqlens_k[b], its tokens b * S ..;
//   rows: input [1, T, ...] and rows int32 [R, 4] of (slot, start, length, bidirectional),
//     the rows' tokens packed in table order (T = the lengths' sum): one call mixes a decode
//     row, a prefill chunk and a verify row on any slots, and slots no row names are never
//     read or written (no padding rows).
// A position's arithmetic depends only on its own row, so its bits are the same in either
// form and whatever rows share the call.

// Input `index`, or a null value when the node leaves it out (absent or named '').
Ort::ConstValue optional_input(const Ort::KernelContext &ctx, size_t index) {
  return index < ctx.GetInputCount() ? ctx.GetInput(index) : Ort::ConstValue{};
}

bool given(const Ort::ConstValue &value) {
  return static_cast<const OrtValue *>(value) != nullptr;
}

// The row table `rows` [R, 4] checked against `slots` buffer slots and the input's batch and
// tokens (every check before any buffer is touched; the positions' upper bound is the op's).
std::vector<elk_row> row_table(const char *op, const Ort::ConstValue &rows, int64_t slots,
                               int64_t batch, int64_t tokens) {
  const auto fail = [op](const std::string &what) {
    throw Ort::Exception(std::string(op) + ": " + what, ORT_INVALID_ARGUMENT);
  };
  const std::vector<int64_t> shape = rows.GetTensorTypeAndShapeInfo().GetShape();
  if (shape.size() != 2 || shape[1] != 4) {
    fail("rows is not [R, 4] int32 (slot, start, length, bidirectional)");
  }
  if (batch != 1) {
    fail("with rows the input is [1, T, ...] (the rows' tokens packed), not batch " +
         std::to_string(batch));
  }
  const int32_t *entry = rows.GetTensorData<int32_t>();
  std::vector<elk_row> table(static_cast<size_t>(shape[0]));
  std::vector<int64_t> owner(static_cast<size_t>(slots), -1);
  int64_t offset = 0;
  for (int64_t r = 0; r < shape[0]; ++r, entry += 4) {
    const std::string name = "row " + std::to_string(r);
    const elk_row row{entry[0], entry[1], offset, entry[2], entry[3]};
    if (row.slot < 0 || row.slot >= slots) {
      fail(name + " names slot " + std::to_string(row.slot) + " outside 0.." +
           std::to_string(slots - 1));
    }
    if (owner[row.slot] >= 0) {
      fail("rows " + std::to_string(owner[row.slot]) + " and " + std::to_string(r) +
           " both name slot " + std::to_string(row.slot));
    }
    owner[row.slot] = r;
    if (row.length < 1) fail(name + " has length " + std::to_string(row.length) + " (< 1)");
    if (row.start < 0) fail(name + " starts at position " + std::to_string(row.start));
    if (row.bidirectional != 0 && row.bidirectional != 1) {
      fail(name + "'s bidirectional is " + std::to_string(row.bidirectional) +
           ", not 0 or 1");
    }
    table[r] = row;
    offset += row.length;
  }
  if (offset != tokens) {
    fail("the rows' lengths sum to " + std::to_string(offset) + ", not the input's " +
         std::to_string(tokens) + " tokens");
  }
  return table;
}

// The batched form's table: row b is slot b at positions seqlens_k[b] + 1 - seq.., its tokens
// b * seq...
std::vector<elk_row> batched_table(const char *op, const Ort::ConstValue &seqlens,
                                   int64_t batch, int64_t seq, int64_t bidirectional) {
  const auto fail = [op](const std::string &what) {
    throw Ort::Exception(std::string(op) + ": " + what, ORT_INVALID_ARGUMENT);
  };
  if (static_cast<int64_t>(seqlens.GetTensorTypeAndShapeInfo().GetElementCount()) != batch) {
    fail("seqlens_k does not hold one length per batch row");
  }
  const int32_t *lengths = seqlens.GetTensorData<int32_t>();
  std::vector<elk_row> table;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = static_cast<int64_t>(lengths[b]) + 1 - seq;
    if (start < 0) {
      fail("row " + std::to_string(b) + " starts at position " + std::to_string(start));
    }
    table.push_back(elk_row{b, start, b * seq, seq, bidirectional});
  }
  return table;
}

// Exactly one of seqlens_k (batched) and rows (row table): true for rows.
bool rows_form(const char *op, const Ort::ConstValue &seqlens, const Ort::ConstValue &rows) {
  if (given(seqlens) == given(rows)) {
    throw Ort::Exception(std::string(op) + ": give exactly one of seqlens_k (the batched "
                         "form) and rows (the row table), not " +
                         (given(rows) ? "both" : "neither"), ORT_INVALID_ARGUMENT);
  }
  return given(rows);
}

// edge_llm_ros.CausalAttention: GroupQueryAttention's job for this library's graphs (rotary,
// the new keys and values written into the KV buffers bound as both past and present, causal
// and windowed softmax), with each query row computed alone (attention.h): a position's
// logits are the same bits in a one-position call and in a verify pass over several.
// A task is (row, KV head, a chunk of its group's heads, a block of the row's queries):
// elk_attention_block reads each tile of the KV head's keys and values once for all of them
// (a query of a 4k context otherwise streams 2 x 2 MiB of K and V at head_dim 128). Rows of
// one position (decode steps), and every row when pinned to the scalar reference
// (elk_select_kernel), take tasks (row, head, kQueryRowsPerTask queries) of
// elk_attention_row, the per-query reference the tests compare with.
// int8 KV buffers (kv.dtype int8: past key/value int8 with their per-row float32 scales,
// inputs 11 and 12, outputs 3 and 4) run attention_i8.h's entries in the same tasks, their
// int8 dots the best this CPU has (all give the same bits), the scalar ones when pinned.
constexpr int64_t kMaxHeadDim = 512, kQueryRowsPerTask = 8;
// Queries a block task takes at most, and its scratch (scores of every query over the row's
// keys) at most, in floats: 2 MiB, so a long context takes fewer queries a task.
constexpr int64_t kQueryBlock = 16, kBlockScratchFloats = int64_t{1} << 19;
// Tasks a call wants at least: 2 per CPU this process may run on (ORT's pool has at most
// that many threads). A call of few short rows (a verify pass) splits the groups' heads
// over tasks only until then: every split re-reads the KV head's keys and values.
int64_t min_tasks() {
  static const int64_t tasks = [] {
    cpu_set_t set;
    const int64_t cpus = sched_getaffinity(0, sizeof(set), &set) == 0
                             ? CPU_COUNT(&set)
                             : std::max(1u, std::thread::hardware_concurrency());
    return 2 * cpus;
  }();
  return tasks;
}

struct AttentionWork {
  elk_attention_shape shape;
  const float *q, *k, *v, *cos, *sin;
  int64_t q_stride, kv_stride;
  const elk_row *rows;
  // Query tasks: row r's are first_task[r] .. first_task[r + 1] - 1. The reference: (head,
  // block of kQueryRowsPerTask) in order. Blocks: (KV head, head chunk, block of
  // row_block[r] queries) in order, heads_per_task heads a chunk.
  const int64_t *first_task, *row_block;  // row_block[r] 0: row r runs per query
  int64_t row_count, heads_per_task;
  float *keys, *values, *out;
  bool int8;          // the buffers are int8 (i8; keys and values are then unused)
  elk_kv_i8 i8;
  elk_i8_dots_fn dots;
};

int64_t row_blocks(const elk_row &row) {
  return (row.length + kQueryRowsPerTask - 1) / kQueryRowsPerTask;
}

void store_keys(void *data, size_t task) {
  const AttentionWork &w = *static_cast<const AttentionWork *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.shape.kv_heads;
  const int64_t h = static_cast<int64_t>(task) % w.shape.kv_heads;
  if (w.int8) {
    elk_attention_store_i8(&w.shape, &w.rows[r], h, w.k, w.v, w.kv_stride, w.cos, w.sin,
                           &w.i8);
    return;
  }
  elk_attention_store(&w.shape, &w.rows[r], h, w.k, w.v, w.kv_stride, w.cos, w.sin, w.keys,
                      w.values);
}

int64_t task_row(const AttentionWork &w, int64_t t) {
  return std::upper_bound(w.first_task, w.first_task + w.row_count + 1, t) - w.first_task - 1;
}

void query_rows(void *data, size_t task) {
  const AttentionWork &w = *static_cast<const AttentionWork *>(data);
  const int64_t t = static_cast<int64_t>(task), r = task_row(w, t);
  const elk_row &row = w.rows[r];
  const int64_t blocks = row_blocks(row), local = t - w.first_task[r];
  const int64_t h = local / blocks, block = local % blocks;
  const int64_t last = std::min(row.length, (block + 1) * kQueryRowsPerTask);
  if (w.int8) {
    thread_local std::vector<char> bytes;
    const size_t need = elk_attention_row_i8_scratch(&w.shape);
    if (bytes.size() < need) bytes.resize(need);
    for (int64_t s = block * kQueryRowsPerTask; s < last; ++s) {
      elk_attention_row_i8(&w.shape, &row, s, h, w.q, w.q_stride, w.cos, w.sin, &w.i8, w.dots,
                           bytes.data(), w.out);
    }
    return;
  }
  std::vector<float> scratch(static_cast<size_t>(w.shape.capacity));
  for (int64_t s = block * kQueryRowsPerTask; s < last; ++s) {
    elk_attention_row(&w.shape, &row, s, h, w.q, w.q_stride, w.cos, w.sin, w.keys, w.values,
                      scratch.data(), w.out);
  }
}

void query_blocks(void *data, size_t task) {
  const AttentionWork &w = *static_cast<const AttentionWork *>(data);
  const int64_t t = static_cast<int64_t>(task), r = task_row(w, t);
  const elk_row &row = w.rows[r];
  const int64_t size = w.row_block[r], blocks = (row.length + size - 1) / size;
  const int64_t group = w.shape.num_heads / w.shape.kv_heads;
  const int64_t chunks = (group + w.heads_per_task - 1) / w.heads_per_task;
  const int64_t local = t - w.first_task[r], block = local % blocks;
  const int64_t kv = local / blocks / chunks, chunk = local / blocks % chunks;
  const int64_t h_begin = kv * group + chunk * w.heads_per_task;
  const int64_t h_end = std::min(kv * group + group, h_begin + w.heads_per_task);
  const int64_t s_begin = block * size, s_end = std::min(row.length, s_begin + size);
  // One buffer a pool thread, grown as needed: a fresh one a task would fault its pages in.
  if (w.int8) {
    thread_local std::vector<char> bytes;
    const size_t need =
        elk_attention_block_i8_scratch(&w.shape, &row, s_begin, s_end, h_end - h_begin);
    if (bytes.size() < need) bytes.resize(need);
    elk_attention_block_i8(&w.shape, &row, s_begin, s_end, h_begin, h_end, w.q, w.q_stride,
                           w.cos, w.sin, &w.i8, w.dots, bytes.data(), w.out);
    return;
  }
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(
      elk_attention_block_scratch(&w.shape, &row, s_begin, s_end, h_end - h_begin));
  if (scratch.size() < need) scratch.resize(need);
  elk_attention_block(&w.shape, &row, s_begin, s_end, h_begin, h_end, w.q, w.q_stride, w.cos,
                      w.sin, w.keys, w.values, scratch.data(), w.out);
}

void query_tasks(void *data, size_t task) {
  const AttentionWork &w = *static_cast<const AttentionWork *>(data);
  if (w.row_block[task_row(w, static_cast<int64_t>(task))] == 0) {
    query_rows(data, task);
  } else {
    query_blocks(data, task);
  }
}

// A float-list attribute, or empty when the node does not set it.
std::vector<float> optional_floats(const Ort::ConstKernelInfo &info, const char *name) {
  try {
    return info.GetAttributes<float>(name);
  } catch (const Ort::Exception &) {
    return {};
  }
}

struct CausalAttentionKernel {
  CausalAttentionKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo kernel_info(info);
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    kv_heads_ = kernel_info.GetAttribute<int64_t>("kv_num_heads");
    scale_ = kernel_info.GetAttribute<float>("scale");
    window_ = kernel_info.GetAttribute<int64_t>("window");
    // Optional per-head q/k RMSNorm weights (both or neither) and their epsilon.
    q_norm_ = optional_floats(kernel_info, "q_norm");
    k_norm_ = optional_floats(kernel_info, "k_norm");
    // Optional shared_kv = 1: a layer that reads another layer's keys and values (gemma4's
    // shared-KV layers): no key/value inputs, nothing stored, the present outputs absent; the
    // past inputs are the owner's present outputs (already holding this call's positions).
    // Such a node normalizes its queries only (q_norm without k_norm).
    try {
      shared_ = kernel_info.GetAttribute<int64_t>("shared_kv") != 0;
    } catch (const Ort::Exception &) {
      shared_ = false;
    }
    if (q_norm_.empty() != k_norm_.empty() && !(shared_ && k_norm_.empty())) {
      throw Ort::Exception("CausalAttention: q_norm and k_norm come together: reconvert the "
                           "model", ORT_INVALID_ARGUMENT);
    }
    if (!q_norm_.empty()) norm_eps_ = kernel_info.GetAttribute<float>("norm_epsilon");
    // Optional: 1 when cos/sin hold a row per packed token (M-RoPE graphs), 0 or absent when
    // a row per KV position.
    try {
      rope_per_token_ = kernel_info.GetAttribute<int64_t>("rope_per_token");
    } catch (const Ort::Exception &) {
      rope_per_token_ = 0;
    }
    if (rope_per_token_ != 0 && rope_per_token_ != 1) {
      throw Ort::Exception("CausalAttention: rope_per_token must be 0 or 1: reconvert the "
                           "model", ORT_INVALID_ARGUMENT);
    }
    if (heads_ <= 0 || kv_heads_ <= 0 || heads_ % kv_heads_ != 0 || window_ < 0) {
      throw Ort::Exception("CausalAttention: num_heads " + std::to_string(heads_) +
                           " must be a positive multiple of kv_num_heads " +
                           std::to_string(kv_heads_) + ", window >= 0: reconvert the model",
                           ORT_INVALID_ARGUMENT);
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  static void fail(const std::string &what) {
    throw Ort::Exception("CausalAttention: " + what, ORT_INVALID_ARGUMENT);
  }

  // Whether the KV buffers are int8 (with both scales given) or float32 (with neither).
  static bool kv_int8(const Ort::ConstValue &key, const Ort::ConstValue &value,
                      const Ort::ConstValue &key_scale, const Ort::ConstValue &value_scale) {
    const auto type = key.GetTensorTypeAndShapeInfo().GetElementType();
    if (type != value.GetTensorTypeAndShapeInfo().GetElementType() ||
        (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)) {
      fail("the past key and value buffers must both be float32 or both int8");
    }
    const bool int8 = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    for (const Ort::ConstValue *scale : {&key_scale, &value_scale}) {
      if (given(*scale) != int8) {
        fail(int8 ? "int8 KV buffers need both past key and value scales (inputs 11, 12)"
                  : "float32 KV buffers take no scales (inputs 11, 12 absent)");
      }
      if (int8 && scale->GetTensorTypeAndShapeInfo().GetElementType() !=
                      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        fail("the int8 KV scales must be float32");
      }
    }
    return int8;
  }

  // present = past: a copy unless the engine bound them to the same memory.
  static void start_from(void *present, const void *past, size_t bytes) {
    if (present != past) std::memcpy(present, past, bytes);
  }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue query = ctx.GetInput(0), key = ctx.GetInput(1),
                          value = ctx.GetInput(2), past_key = ctx.GetInput(3),
                          past_value = ctx.GetInput(4), seqlens = ctx.GetInput(5),
                          cos = ctx.GetInput(7), sin = ctx.GetInput(8),
                          flag = optional_input(ctx, 9), rows = optional_input(ctx, 10),
                          past_key_scale = optional_input(ctx, 11),
                          past_value_scale = optional_input(ctx, 12);
    const bool varlen = rows_form("CausalAttention", seqlens, rows);
    const bool int8 = kv_int8(past_key, past_value, past_key_scale, past_value_scale);
    const std::vector<int64_t> q_shape = query.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> kv_shape = past_key.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> rope_shape = cos.GetTensorTypeAndShapeInfo().GetShape();
    if (q_shape.size() != 3 || kv_shape.size() != 4) fail("query is not [B, S, W] or the "
                                                          "KV buffers not [B, kv, L, D]");
    const int64_t batch = q_shape[0], seq = q_shape[1], d = kv_shape[3];
    const bool packed = !given(key) && !shared_;
    if (shared_ && (given(key) || given(value))) fail("a shared_kv node takes no key or value");
    const int64_t width = packed ? (heads_ + 2 * kv_heads_) * d : heads_ * d;
    // With rows the buffers hold any number of slots; batched, one per batch row.
    if ((!varlen && kv_shape[0] != batch) || kv_shape[1] != kv_heads_ ||
        q_shape[2] != width || d % 2 != 0 || d > kMaxHeadDim) {
      fail("query [" + std::to_string(batch) + ", " + std::to_string(seq) + ", " +
           std::to_string(q_shape[2]) + "] does not fit KV buffers of " +
           std::to_string(kv_heads_) + " heads x " + std::to_string(d) + " (even, <= 512)");
    }
    if (rope_shape.size() != 2 || rope_shape[1] != d / 2) fail("cos/sin are not [P, D/2]");
    if (!q_norm_.empty() && (static_cast<int64_t>(q_norm_.size()) != d ||
                             (!shared_ && static_cast<int64_t>(k_norm_.size()) != d))) {
      fail("q_norm / k_norm hold " + std::to_string(q_norm_.size()) + " / " +
           std::to_string(k_norm_.size()) + " weights for heads of " + std::to_string(d));
    }
    // Optional input 9: one int32, nonzero when every row of this call sees all of its keys.
    int64_t bidirectional = 0;
    if (given(flag)) {
      if (flag.GetTensorTypeAndShapeInfo().GetElementCount() != 1) {
        fail("bidirectional is not one int32");
      }
      bidirectional = flag.GetTensorData<int32_t>()[0] != 0 ? 1 : 0;
    }
    const int64_t capacity = kv_shape[2];
    std::vector<elk_row> table;
    if (varlen) {
      if (bidirectional) {
        fail("the bidirectional input must be absent or 0 with rows (each row sets its own)");
      }
      table = row_table("CausalAttention", rows, kv_shape[0], batch, seq);
    } else {
      table = batched_table("CausalAttention", seqlens, batch, seq, bidirectional);
    }
    if (rope_per_token_ && rope_shape[0] != batch * seq) {
      fail("cos/sin hold " + std::to_string(rope_shape[0]) + " rows, not one per token (" +
           std::to_string(batch * seq) + ")");
    }
    for (size_t r = 0; r < table.size(); ++r) {
      const int64_t end = table[r].start + table[r].length;
      if (end > capacity || (!rope_per_token_ && end > rope_shape[0])) {
        fail("row " + std::to_string(r) + " writes positions " +
             std::to_string(table[r].start) + ".." + std::to_string(end - 1) +
             " outside the KV capacity " + std::to_string(capacity) + " or the rotary table");
      }
    }
    void *keys = nullptr, *values = nullptr;
    elk_kv_i8 i8{};
    if (shared_) {
      // Read only: the owner layer's buffers, written by its node earlier in this call.
      if (int8) fail("a shared_kv node reads float32 KV only (int8 KV is not built for it)");
      keys = const_cast<void *>(past_key.GetTensorRawData());
      values = const_cast<void *>(past_value.GetTensorRawData());
    } else {
      Ort::UnownedValue present_key = ctx.GetOutput(1, kv_shape);
      Ort::UnownedValue present_value = ctx.GetOutput(2, kv_shape);
      keys = present_key.GetTensorMutableRawData();
      values = present_value.GetTensorMutableRawData();
      const size_t rows_total = static_cast<size_t>(kv_shape[0] * kv_heads_ * capacity);
      const size_t buffer_bytes = rows_total * d * (int8 ? sizeof(int8_t) : sizeof(float));
      // The engine binds present to past's memory (nothing to copy); otherwise start from
      // past.
      start_from(keys, past_key.GetTensorRawData(), buffer_bytes);
      start_from(values, past_value.GetTensorRawData(), buffer_bytes);
      if (int8) {
        if (ctx.GetOutputCount() < 5) {
          fail("int8 KV buffers need the present scale outputs 3, 4");
        }
        const std::vector<int64_t> scale_shape{kv_shape[0], kv_heads_, capacity, 1};
        for (const Ort::ConstValue *scale : {&past_key_scale, &past_value_scale}) {
          if (scale->GetTensorTypeAndShapeInfo().GetShape() != scale_shape) {
            fail("the int8 KV scales are not [N, kv_heads, L, 1] of the KV buffers");
          }
        }
        float *key_scales = ctx.GetOutput(3, scale_shape).GetTensorMutableData<float>();
        float *value_scales = ctx.GetOutput(4, scale_shape).GetTensorMutableData<float>();
        start_from(key_scales, past_key_scale.GetTensorRawData(), rows_total * sizeof(float));
        start_from(value_scales, past_value_scale.GetTensorRawData(), rows_total * sizeof(float));
        i8 = elk_kv_i8{static_cast<int8_t *>(keys), static_cast<int8_t *>(values), key_scales,
                       value_scales};
      }
    }
    Ort::UnownedValue out = ctx.GetOutput(0, std::vector<int64_t>{batch, seq, heads_ * d});
    const int64_t tokens = batch * seq;
    if (tokens == 0) return;
    const int64_t row_count = static_cast<int64_t>(table.size());
    std::vector<int64_t> first_task(table.size() + 1, 0), row_block(first_task.size(), 0);
    const bool reference = std::strcmp(elk_kernel_name(), "scalar") == 0;
    // A decode step's row (one position) runs per query as well: one query a head shares
    // nothing, and elk_attention_row's single stream of rows reads a long context from
    // memory faster than a block's tiles (op probe, 4k positions: 1.2-1.5x).
    auto per_query = [&](const elk_row &row) { return reference || row.length == 1; };
    const int64_t group = heads_ / kv_heads_;
    int64_t heads_per_task = group;
    for (;;) {
      for (int64_t r = 0; r < row_count; ++r) {
        const elk_row &row = table[r];
        int64_t tasks = heads_ * row_blocks(row);
        if (!per_query(row)) {
          const int64_t keys = d + 1 + row.start + row.length;  // scratch floats a query
          row_block[r] = std::max<int64_t>(
              1, std::min(kQueryBlock, kBlockScratchFloats / (heads_per_task * keys)));
          tasks = kv_heads_ * ((group + heads_per_task - 1) / heads_per_task) *
                  ((row.length + row_block[r] - 1) / row_block[r]);
        }
        first_task[r + 1] = first_task[r] + tasks;
      }
      if (reference || heads_per_task == 1 || first_task[row_count] >= min_tasks()) break;
      heads_per_task = (heads_per_task + 1) / 2;
    }
    const float *q = query.GetTensorData<float>();
    AttentionWork work{};
    work.shape = elk_attention_shape{heads_, kv_heads_, d, capacity, scale_, window_,
                                     q_norm_.empty() ? nullptr : q_norm_.data(),
                                     k_norm_.empty() ? nullptr : k_norm_.data(), norm_eps_,
                                     rope_per_token_};
    work.q = q;
    work.q_stride = width;
    if (shared_) {
      work.k = work.v = nullptr;
      work.kv_stride = 0;
    } else if (packed) {
      work.k = q + heads_ * d;
      work.v = q + (heads_ + kv_heads_) * d;
      work.kv_stride = width;
    } else {
      work.k = key.GetTensorData<float>();
      work.v = value.GetTensorData<float>();
      work.kv_stride = kv_heads_ * d;
    }
    work.cos = cos.GetTensorData<float>();
    work.sin = sin.GetTensorData<float>();
    work.rows = table.data();
    work.first_task = first_task.data();
    work.row_block = row_block.data();
    work.row_count = row_count;
    work.heads_per_task = heads_per_task;
    work.int8 = int8;
    work.i8 = i8;
    work.dots = elk_i8_dots(reference ? "scalar" : elk_i8_dots_best());
    work.keys = int8 ? nullptr : static_cast<float *>(keys);
    work.values = int8 ? nullptr : static_cast<float *>(values);
    work.out = out.GetTensorMutableData<float>();
    // A decode step's few new positions are cheaper written here than handed to the pool.
    const size_t store_tasks = shared_ ? 0 : static_cast<size_t>(row_count * kv_heads_);
    if (tokens <= kQueryRowsPerTask) {
      for (size_t t = 0; t < store_tasks; ++t) store_keys(&work, t);
    } else {
      ctx.ParallelFor(store_keys, store_tasks, 0, &work);
    }
    ctx.ParallelFor(query_tasks, static_cast<size_t>(first_task[row_count]), 0, &work);
  }

 private:
  int64_t heads_ = 0, kv_heads_ = 0, window_ = 0, rope_per_token_ = 0;
  float scale_ = 1.0f, norm_eps_ = 0.0f;
  bool shared_ = false;
  std::vector<float> q_norm_, k_norm_;  // attributes: read-only while Computes run
};

struct CausalAttentionOp : Ort::CustomOpBase<CausalAttentionOp, CausalAttentionKernel, true> {
  // Present key / value (outputs 1, 2) have the past's type and shape (float32 or int8):
  // ORT infers a dynamically typed output from one such input only, so the op says it.
  CausalAttentionOp() { OrtCustomOp::InferOutputShapeFn = present_like_past; }
  static OrtStatusPtr present_like_past(const OrtCustomOp *, OrtShapeInferContext *ctx) {
    const OrtApi &api = Ort::GetApi();
    for (size_t past = 3; past <= 4; ++past) {
      OrtTensorTypeAndShapeInfo *info = nullptr;
      if (OrtStatusPtr status = api.ShapeInferContext_GetInputTypeShape(ctx, past, &info)) {
        return status;
      }
      // info stays the context's (ORT frees it; releasing it here frees it twice).
      if (OrtStatusPtr status = api.ShapeInferContext_SetOutputTypeShape(ctx, past - 2, info)) {
        return status;
      }
    }
    return nullptr;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<CausalAttentionKernel>(api, info, kernel);
  }
  const char *GetName() const { return "CausalAttention"; }
  // 0 query (or packed QKV), 1 key, 2 value (both absent when packed), 3 past key, 4 past
  // value, 5 seqlens_k, 6 total_sequence_length (unread; both optional: absent with rows),
  // 7 cos, 8 sin, 9 bidirectional (optional: graphs of models whose image tokens attend both
  // ways; absent means causal), 10 rows (optional: the row table, instead of seqlens_k),
  // 11 past key scales, 12 past value scales (optional: float32 [N, kv, L, 1], given exactly
  // when the past key and value are int8, kv.dtype int8; otherwise those are float32).
  // Outputs: 0 attention, 1 present key, 2 present value (the past's type), 3 present key
  // scales, 4 present value scales (int8 KV only).
  size_t GetInputTypeCount() const { return 13; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == 3 || index == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    return index == 5 || index == 6 || index == 9 || index == 10
               ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
               : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 0 || index == 3 || index == 4 || index == 7 || index == 8
               ? INPUT_OUTPUT_REQUIRED
               : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index == 1 || index == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED
                                    : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  // The present outputs are absent on a shared_kv node (it stores nothing), the scales on a
  // float32 KV node.
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
};
// edge_llm_ros.ShortConv: LFM2's gated short convolution (llama.cpp's build_shortconv_block
// after in_proj): y = C * conv(B * x) over each row's conv state, which holds B * x of the
// row's last kernel - 1 positions. The state buffer is bound as both past_state and
// present_state (like the KV buffers), so the op updates it in place; a row that starts its
// sequence (start 0) reads zeros instead, as llama.cpp clears a new sequence's state. Each
// output element is one sum in one order (shortconv.h): a row's result does not depend on the
// rows beside it or on the form (batched or rows) of the call.
struct ShortConvWork {
  elk_shortconv_shape shape;
  const elk_row *rows;
  const float *bcx, *weight;
  float *state, *y;
  int64_t blocks;
};

void shortconv_task(void *data, size_t task) {
  const ShortConvWork &w = *static_cast<const ShortConvWork *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.blocks;
  const int64_t c0 = static_cast<int64_t>(task) % w.blocks * ELK_SHORTCONV_CHANNELS;
  const int64_t c1 = std::min(w.shape.channels, c0 + ELK_SHORTCONV_CHANNELS);
  elk_shortconv_rows(&w.shape, &w.rows[r], c0, c1, w.bcx, w.weight, w.state, w.y);
}

struct ShortConvKernel {
  ShortConvKernel(const OrtApi &, const OrtKernelInfo *) {}

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  static void fail(const std::string &what) {
    throw Ort::Exception("ShortConv: " + what + ": reconvert the model",
                         ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue bcx = ctx.GetInput(0), weight = ctx.GetInput(1),
                          past = ctx.GetInput(2), seqlens = optional_input(ctx, 3),
                          rows = optional_input(ctx, 4);
    const bool varlen = rows_form("ShortConv", seqlens, rows);
    const std::vector<int64_t> x_shape = bcx.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> w_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> s_shape = past.GetTensorTypeAndShapeInfo().GetShape();
    if (w_shape.size() != 2 || w_shape[1] < 2 || w_shape[1] > ELK_SHORTCONV_MAX_KERNEL) {
      fail("weight is not [channels, kernel] with a kernel of 2.." +
           std::to_string(ELK_SHORTCONV_MAX_KERNEL) + " positions");
    }
    const int64_t channels = w_shape[0], kernel = w_shape[1];
    if (x_shape.size() != 3 || x_shape[2] != 3 * channels) {
      fail("input is not [batch, seq, 3 x " + std::to_string(channels) + "] (B, C, x)");
    }
    const int64_t batch = x_shape[0], seq = x_shape[1];
    // With rows the state holds any number of slots; batched, one per batch row.
    if (s_shape.size() != 3 || (!varlen && s_shape[0] != batch) || s_shape[1] != kernel - 1 ||
        s_shape[2] != channels) {
      fail("the state is not [" + std::string(varlen ? "slots" : "batch") +
           ", kernel - 1, channels] = [" +
           (varlen ? std::string("N") : std::to_string(batch)) + ", " +
           std::to_string(kernel - 1) + ", " + std::to_string(channels) + "]");
    }
    std::vector<elk_row> table;
    if (varlen) {
      table = row_table("ShortConv", rows, s_shape[0], batch, seq);
    } else {
      table = batched_table("ShortConv", seqlens, batch, seq, 0);
    }
    Ort::UnownedValue present = ctx.GetOutput(1, s_shape);
    float *state = present.GetTensorMutableData<float>();
    // The engine binds present to past's memory (nothing to copy); otherwise start from past.
    if (state != past.GetTensorData<float>()) {
      std::memcpy(state, past.GetTensorData<float>(),
                  static_cast<size_t>(s_shape[0] * (kernel - 1) * channels) * sizeof(float));
    }
    Ort::UnownedValue y = ctx.GetOutput(0, std::vector<int64_t>{batch, seq, channels});
    const int64_t tokens = batch * seq;
    if (tokens == 0) return;
    ShortConvWork work{elk_shortconv_shape{channels, kernel}, table.data(),
                       bcx.GetTensorData<float>(), weight.GetTensorData<float>(), state,
                       y.GetTensorMutableData<float>(),
                       (channels + ELK_SHORTCONV_CHANNELS - 1) / ELK_SHORTCONV_CHANNELS};
    const size_t tasks = table.size() * static_cast<size_t>(work.blocks);
    // A decode step's few products are cheaper done here than handed to the pool.
    if (tokens * channels <= kInlineShortConv) {
      for (size_t t = 0; t < tasks; ++t) shortconv_task(&work, t);
    } else {
      ctx.ParallelFor(shortconv_task, tasks, 0, &work);
    }
  }

 private:
  static constexpr int64_t kInlineShortConv = 1 << 14;
};

struct ShortConvOp : Ort::CustomOpBase<ShortConvOp, ShortConvKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<ShortConvKernel>(api, info, kernel);
  }
  const char *GetName() const { return "ShortConv"; }
  // 0 in_proj output [B, S, 3C] (B, C, x), 1 weight [C, L], 2 past state [B or N, L - 1, C],
  // 3 seqlens_k [B] (optional), 4 rows [R, 4] (optional): exactly one of 3 and 4.
  size_t GetInputTypeCount() const { return 5; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index >= 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // y [B, S, C] and the present state [B or N, L - 1, C].
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};
// edge_llm_ros.GatedDeltaNet: Qwen3.5's linear-attention layer after its projections
// (llama.cpp's build_layer_attn_linear): the causal depthwise conv + SiLU over q, k, v, the
// gated delta rule token by token, the gated RMSNorm (gated_delta.h). One state buffer per
// layer ([N, state floats]: conv inputs, then the delta state), bound as both past_state and
// present_state and updated in place; a row that starts its sequence (start 0) reads zeros.
// Two parallel steps (conv by channel blocks, then the recurrence by value head), each a fixed
// order per element: a row's bits do not depend on the rows beside it or the call's form.
struct GatedDeltaWork {
  elk_gdn_shape shape;
  const elk_row *rows;
  const float *qkv, *weight, *z, *alpha, *beta, *dt_bias, *a, *norm;
  float *state, *conv, *y;
  int64_t state_floats, blocks, channels;
};

void gdn_conv_task(void *data, size_t task) {
  const GatedDeltaWork &w = *static_cast<const GatedDeltaWork *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.blocks;
  const int64_t c0 = static_cast<int64_t>(task) % w.blocks * ELK_GDN_CHANNELS;
  const int64_t c1 = std::min(w.channels, c0 + ELK_GDN_CHANNELS);
  elk_gdn_conv_rows(&w.shape, &w.rows[r], c0, c1, w.qkv, w.weight, w.state_floats, w.state,
                    w.conv);
}

void gdn_delta_task(void *data, size_t task) {
  const GatedDeltaWork &w = *static_cast<const GatedDeltaWork *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.shape.v_heads;
  const int64_t h = static_cast<int64_t>(task) % w.shape.v_heads;
  elk_gdn_delta_rows(&w.shape, &w.rows[r], h, w.conv, w.z, w.alpha, w.beta, w.dt_bias, w.a,
                     w.norm, w.state_floats, w.state, w.y);
}

struct GatedDeltaKernel {
  GatedDeltaKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo i(info);
    k_heads_ = i.GetAttribute<int64_t>("k_heads");
    v_heads_ = i.GetAttribute<int64_t>("v_heads");
    head_dim_ = i.GetAttribute<int64_t>("head_dim");
    eps_ = i.GetAttribute<float>("epsilon");
    // A graph of an older converter has no chunk: its state was the recurrent form's.
    try {
      chunk_ = i.GetAttribute<int64_t>("chunk");
    } catch (const Ort::Exception &) {
      fail("no chunk attribute (a graph written before the chunked form)");
    }
    if (k_heads_ < 1 || v_heads_ < 1 || v_heads_ % k_heads_ != 0 || head_dim_ < 1 ||
        head_dim_ > ELK_GDN_MAX_HEAD || chunk_ < 1 || chunk_ > ELK_GDN_MAX_CHUNK) {
      fail("k_heads " + std::to_string(k_heads_) + ", v_heads " + std::to_string(v_heads_) +
           ", head_dim " + std::to_string(head_dim_) + ", chunk " + std::to_string(chunk_) +
           " (v_heads a multiple of k_heads, head_dim 1.." + std::to_string(ELK_GDN_MAX_HEAD) +
           ", chunk 1.." + std::to_string(ELK_GDN_MAX_CHUNK) + ")");
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  static void fail(const std::string &what) {
    throw Ort::Exception("GatedDeltaNet: " + what + ": reconvert the model",
                         ORT_INVALID_ARGUMENT);
  }

  static std::vector<int64_t> shape_of(const Ort::ConstValue &v) {
    return v.GetTensorTypeAndShapeInfo().GetShape();
  }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue qkv = ctx.GetInput(0), z = ctx.GetInput(1), alpha = ctx.GetInput(2),
                          beta = ctx.GetInput(3), weight = ctx.GetInput(4),
                          dt_bias = ctx.GetInput(5), a = ctx.GetInput(6),
                          norm = ctx.GetInput(7), past = ctx.GetInput(8),
                          seqlens = optional_input(ctx, 9), rows = optional_input(ctx, 10);
    const bool varlen = rows_form("GatedDeltaNet", seqlens, rows);
    const int64_t d = head_dim_, value = v_heads_ * d;
    const int64_t channels = (2 * k_heads_ + v_heads_) * d;
    const std::vector<int64_t> x_shape = shape_of(qkv), w_shape = shape_of(weight),
                               s_shape = shape_of(past);
    if (w_shape.size() != 2 || w_shape[0] != channels || w_shape[1] < 2 ||
        w_shape[1] > ELK_GDN_MAX_KERNEL) {
      fail("the conv weight is not [" + std::to_string(channels) + ", kernel] with a kernel "
           "of 2.." + std::to_string(ELK_GDN_MAX_KERNEL) + " positions");
    }
    const int64_t kernel = w_shape[1];
    if (x_shape.size() != 3 || x_shape[2] != channels) {
      fail("qkv is not [batch, seq, " + std::to_string(channels) + "]");
    }
    const int64_t batch = x_shape[0], seq = x_shape[1];
    const auto check = [&](const Ort::ConstValue &v, const char *name,
                           const std::vector<int64_t> &want) {
      if (shape_of(v) != want) {
        std::string dims;
        for (int64_t n : want) dims += (dims.empty() ? "" : ", ") + std::to_string(n);
        fail(std::string(name) + " is not [" + dims + "]");
      }
    };
    check(z, "z", {batch, seq, value});
    check(alpha, "alpha", {batch, seq, v_heads_});
    check(beta, "beta", {batch, seq, v_heads_});
    check(dt_bias, "dt_bias", {v_heads_});
    check(a, "a", {v_heads_});
    check(norm, "norm", {d});
    const elk_gdn_shape shape{k_heads_, v_heads_, d, kernel, eps_, chunk_};
    const int64_t state_floats = elk_gdn_state_floats(&shape);
    if (s_shape.size() != 2 || (!varlen && s_shape[0] != batch) ||
        s_shape[1] != state_floats) {
      fail("the state is not [" + std::string(varlen ? "slots" : "batch") + ", " +
           std::to_string(state_floats) + "]");
    }
    std::vector<elk_row> table = varlen
        ? row_table("GatedDeltaNet", rows, s_shape[0], batch, seq)
        : batched_table("GatedDeltaNet", seqlens, batch, seq, 0);
    Ort::UnownedValue present = ctx.GetOutput(1, s_shape);
    float *state = present.GetTensorMutableData<float>();
    if (state != past.GetTensorData<float>()) {
      std::memcpy(state, past.GetTensorData<float>(),
                  static_cast<size_t>(s_shape[0] * state_floats) * sizeof(float));
    }
    Ort::UnownedValue y = ctx.GetOutput(0, std::vector<int64_t>{batch, seq, value});
    const int64_t tokens = batch * seq;
    if (tokens == 0) return;
    std::vector<float> conv(static_cast<size_t>(tokens * channels));
    GatedDeltaWork work{shape, table.data(),
                        qkv.GetTensorData<float>(), weight.GetTensorData<float>(),
                        z.GetTensorData<float>(), alpha.GetTensorData<float>(),
                        beta.GetTensorData<float>(), dt_bias.GetTensorData<float>(),
                        a.GetTensorData<float>(), norm.GetTensorData<float>(), state,
                        conv.data(), y.GetTensorMutableData<float>(), state_floats,
                        (channels + ELK_GDN_CHANNELS - 1) / ELK_GDN_CHANNELS, channels};
    const size_t conv_tasks = table.size() * static_cast<size_t>(work.blocks);
    const size_t delta_tasks = table.size() * static_cast<size_t>(v_heads_);
    if (tokens * channels <= kInline) {
      for (size_t t = 0; t < conv_tasks; ++t) gdn_conv_task(&work, t);
    } else {
      ctx.ParallelFor(gdn_conv_task, conv_tasks, 0, &work);
    }
    if (delta_tasks == 1) {
      gdn_delta_task(&work, 0);
    } else {
      ctx.ParallelFor(gdn_delta_task, delta_tasks, 0, &work);
    }
  }

 private:
  static constexpr int64_t kInline = 1 << 14;
  int64_t k_heads_ = 0, v_heads_ = 0, head_dim_ = 0, chunk_ = 0;
  float eps_ = 0.0f;
};

struct GatedDeltaOp : Ort::CustomOpBase<GatedDeltaOp, GatedDeltaKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<GatedDeltaKernel>(api, info, kernel);
  }
  const char *GetName() const { return "GatedDeltaNet"; }
  // 0 qkv [B, S, (2 Hk + Hv) D], 1 z [B, S, Hv D], 2 alpha [B, S, Hv], 3 beta [B, S, Hv],
  // 4 conv weight [(2 Hk + Hv) D, L], 5 dt_bias [Hv], 6 a [Hv], 7 norm [D], 8 past state
  // [B or N, F], 9 seqlens_k [B] (optional), 10 rows [R, 4] (optional): one of 9 and 10.
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index >= 9 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 9 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // y [B, S, Hv D] and the present state [B or N, F].
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};
// edge_llm_ros.Mamba2: Granite 4.0-H's SSM layer after its input projection (llama.cpp's
// build_mamba2_layer): the causal depthwise conv + bias + SiLU over x | B | C, the selective
// scan token by token, the gate silu(z) and the grouped RMSNorm (mamba2.h). One state buffer
// per layer ([N, state floats]: conv inputs, then the SSM state), bound as both past_state and
// present_state and updated in place; a row that starts its sequence (start 0) reads zeros.
// Three steps (conv by channel blocks, the scan by head, the norm by group), each a fixed
// order per element: a row's bits do not depend on the rows beside it or the call's form.
struct Mamba2Work {
  elk_mamba2_shape shape;
  const elk_row *rows;
  const float *xbc, *weight, *bias, *z, *dt, *dt_bias, *a, *d, *norm;
  float *state, *conv, *y;
  int64_t state_floats, blocks, channels;
};

void mamba2_conv_task(void *data, size_t task) {
  const Mamba2Work &w = *static_cast<const Mamba2Work *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.blocks;
  const int64_t c0 = static_cast<int64_t>(task) % w.blocks * ELK_CONV_CHANNELS;
  const int64_t c1 = std::min(w.channels, c0 + ELK_CONV_CHANNELS);
  elk_causal_conv_rows(w.channels, w.shape.kernel, &w.rows[r], c0, c1, w.xbc, w.weight, w.bias,
                       w.state_floats, w.state, w.conv);
}

void mamba2_scan_task(void *data, size_t task) {
  const Mamba2Work &w = *static_cast<const Mamba2Work *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.shape.heads;
  const int64_t h = static_cast<int64_t>(task) % w.shape.heads;
  elk_mamba2_scan_rows(&w.shape, &w.rows[r], h, w.conv, w.z, w.dt, w.dt_bias, w.a, w.d,
                       w.state_floats, w.state, w.y);
}

void mamba2_norm_task(void *data, size_t task) {
  const Mamba2Work &w = *static_cast<const Mamba2Work *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.shape.groups;
  const int64_t g = static_cast<int64_t>(task) % w.shape.groups;
  elk_mamba2_norm_rows(&w.shape, &w.rows[r], g, w.norm, w.y);
}

struct Mamba2Kernel {
  Mamba2Kernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo i(info);
    heads_ = i.GetAttribute<int64_t>("heads");
    head_dim_ = i.GetAttribute<int64_t>("head_dim");
    groups_ = i.GetAttribute<int64_t>("groups");
    d_state_ = i.GetAttribute<int64_t>("d_state");
    eps_ = i.GetAttribute<float>("epsilon");
    if (heads_ < 1 || groups_ < 1 || heads_ % groups_ != 0 || head_dim_ < 1 ||
        head_dim_ > ELK_MAMBA2_MAX_HEAD || d_state_ < 1) {
      fail("heads " + std::to_string(heads_) + ", head_dim " + std::to_string(head_dim_) +
           ", groups " + std::to_string(groups_) + ", d_state " + std::to_string(d_state_) +
           " (heads a multiple of groups, head_dim 1.." + std::to_string(ELK_MAMBA2_MAX_HEAD) +
           ")");
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) { return guarded(*this, context); }

  static void fail(const std::string &what) {
    throw Ort::Exception("Mamba2: " + what + ": reconvert the model", ORT_INVALID_ARGUMENT);
  }

  static std::vector<int64_t> shape_of(const Ort::ConstValue &v) {
    return v.GetTensorTypeAndShapeInfo().GetShape();
  }

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue xbc = ctx.GetInput(0), z = ctx.GetInput(1), dt = ctx.GetInput(2),
                          weight = ctx.GetInput(3), bias = ctx.GetInput(4),
                          dt_bias = ctx.GetInput(5), a = ctx.GetInput(6), d = ctx.GetInput(7),
                          norm = ctx.GetInput(8), past = ctx.GetInput(9),
                          seqlens = optional_input(ctx, 10), rows = optional_input(ctx, 11);
    const bool varlen = rows_form("Mamba2", seqlens, rows);
    const int64_t inner = heads_ * head_dim_, channels = inner + 2 * groups_ * d_state_;
    const std::vector<int64_t> x_shape = shape_of(xbc), w_shape = shape_of(weight),
                               s_shape = shape_of(past);
    if (w_shape.size() != 2 || w_shape[0] != channels || w_shape[1] < 2 ||
        w_shape[1] > ELK_CONV_MAX_KERNEL) {
      fail("the conv weight is not [" + std::to_string(channels) + ", kernel] with a kernel "
           "of 2.." + std::to_string(ELK_CONV_MAX_KERNEL) + " positions");
    }
    const int64_t kernel = w_shape[1];
    if (x_shape.size() != 3 || x_shape[2] != channels) {
      fail("xbc is not [batch, seq, " + std::to_string(channels) + "]");
    }
    const int64_t batch = x_shape[0], seq = x_shape[1];
    const auto check = [&](const Ort::ConstValue &v, const char *name,
                           const std::vector<int64_t> &want) {
      if (shape_of(v) != want) {
        std::string dims;
        for (int64_t n : want) dims += (dims.empty() ? "" : ", ") + std::to_string(n);
        fail(std::string(name) + " is not [" + dims + "]");
      }
    };
    check(z, "z", {batch, seq, inner});
    check(dt, "dt", {batch, seq, heads_});
    check(bias, "the conv bias", {channels});
    check(dt_bias, "dt_bias", {heads_});
    check(a, "a", {heads_});
    check(d, "d", {heads_});
    check(norm, "norm", {inner});
    const int64_t state_floats = (kernel - 1) * channels + heads_ * d_state_ * head_dim_;
    if (s_shape.size() != 2 || (!varlen && s_shape[0] != batch) ||
        s_shape[1] != state_floats) {
      fail("the state is not [" + std::string(varlen ? "slots" : "batch") + ", " +
           std::to_string(state_floats) + "]");
    }
    std::vector<elk_row> table = varlen ? row_table("Mamba2", rows, s_shape[0], batch, seq)
                                        : batched_table("Mamba2", seqlens, batch, seq, 0);
    Ort::UnownedValue present = ctx.GetOutput(1, s_shape);
    float *state = present.GetTensorMutableData<float>();
    if (state != past.GetTensorData<float>()) {
      std::memcpy(state, past.GetTensorData<float>(),
                  static_cast<size_t>(s_shape[0] * state_floats) * sizeof(float));
    }
    Ort::UnownedValue y = ctx.GetOutput(0, std::vector<int64_t>{batch, seq, inner});
    const int64_t tokens = batch * seq;
    if (tokens == 0) return;
    std::vector<float> conv(static_cast<size_t>(tokens * channels));
    Mamba2Work work{elk_mamba2_shape{heads_, head_dim_, groups_, d_state_, kernel, eps_},
                    table.data(), xbc.GetTensorData<float>(), weight.GetTensorData<float>(),
                    bias.GetTensorData<float>(), z.GetTensorData<float>(),
                    dt.GetTensorData<float>(), dt_bias.GetTensorData<float>(),
                    a.GetTensorData<float>(), d.GetTensorData<float>(),
                    norm.GetTensorData<float>(), state, conv.data(),
                    y.GetTensorMutableData<float>(), state_floats,
                    (channels + ELK_CONV_CHANNELS - 1) / ELK_CONV_CHANNELS, channels};
    const size_t conv_tasks = table.size() * static_cast<size_t>(work.blocks);
    const size_t scan_tasks = table.size() * static_cast<size_t>(heads_);
    const size_t norm_tasks = table.size() * static_cast<size_t>(groups_);
    if (tokens * channels <= kInline) {
      for (size_t t = 0; t < conv_tasks; ++t) mamba2_conv_task(&work, t);
    } else {
      ctx.ParallelFor(mamba2_conv_task, conv_tasks, 0, &work);
    }
    ctx.ParallelFor(mamba2_scan_task, scan_tasks, 0, &work);
    if (tokens * inner <= kInline) {
      for (size_t t = 0; t < norm_tasks; ++t) mamba2_norm_task(&work, t);
    } else {
      ctx.ParallelFor(mamba2_norm_task, norm_tasks, 0, &work);
    }
  }

 private:
  static constexpr int64_t kInline = 1 << 14;
  int64_t heads_ = 0, head_dim_ = 0, groups_ = 0, d_state_ = 0;
  float eps_ = 0.0f;
};

struct Mamba2Op : Ort::CustomOpBase<Mamba2Op, Mamba2Kernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<Mamba2Kernel>(api, info, kernel);
  }
  const char *GetName() const { return "Mamba2"; }
  // 0 xbc [B, S, C] (C = H P + 2 G N), 1 z [B, S, H P], 2 dt [B, S, H], 3 conv weight [C, L],
  // 4 conv bias [C], 5 dt_bias [H], 6 a [H], 7 d [H], 8 norm [H P], 9 past state [B or N, F],
  // 10 seqlens_k [B] (optional), 11 rows [R, 4] (optional): one of 10 and 11.
  size_t GetInputTypeCount() const { return 12; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index >= 10 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
                       : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 10 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  // y [B, S, H P] and the present state [B or N, F].
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};
}  // namespace

// SessionOptions.register_custom_ops_library calls this. The library also exports ref.h's
// functions (elk_select_kernel, elk_kernel_name, ...): they act on the kernels its ops run.
extern "C" ELK_API OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options,
                                                              const OrtApiBase *api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static KQuantMatMulOp matmul;
  static KQuantGatherOp gather;
  static CausalAttentionOp attention;
  static ShortConvOp shortconv;
  static GatedDeltaOp gated_delta;
  static Mamba2Op mamba2;
  static Ort::CustomOpDomain *domain = nullptr;  // outlives every session: never freed
  try {
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain(kDomain);
      domain->Add(&matmul);
      domain->Add(&gather);
      domain->Add(&attention);
      domain->Add(&shortconv);
      domain->Add(&gated_delta);
      domain->Add(&mamba2);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception &e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}

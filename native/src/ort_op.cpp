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
#include "edge_llm_kquant/ref.h"
#include "edge_llm_kquant/shortconv.h"
#include "glu.h"
#include "kernels.h"

namespace {

constexpr const char *kDomain = "edge_llm_ros";
// A task: a block of weight rows (output columns) times a block of activation rows, handed
// whole to elk_gemm, which tiles it so each weight block is unpacked once for several
// activation rows. Consecutive tasks share a column block (its weights stay in cache while
// the threads take its row blocks). A GEMV (up to 4 rows) takes 16..64 columns a task, at
// least 64 tasks where N allows (small N: the threads still share it); batches 32 columns.
constexpr int64_t kColumnsPerTask = 64, kMinColumnsPerTask = 16, kBatchColumnsPerTask = 32;
constexpr int64_t kRowsPerTask = 64;

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
  const int64_t columns_per_task =
      rows_per_task > 4 ? kBatchColumnsPerTask
      : gemv_columns < kMinColumnsPerTask ? kMinColumnsPerTask
      : gemv_columns > kColumnsPerTask ? kColumnsPerTask : gemv_columns;
  const int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  const size_t tasks =
      static_cast<size_t>(row_tasks * ((n + columns_per_task - 1) / columns_per_task));
  return Work{weights, activations, bias, out, rows, n, k, weight_row_bytes,
              activation_row_bytes, type, glu, columns_per_task, rows_per_task, row_tasks,
              tasks};
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
  if (w.glu == elk::glu::kNone) {
    product(w, first, cols, row, rows, out, w.n);
    if (w.lora != nullptr) add_lora(w, first, cols, row, rows, out, w.n);
    return;
  }
  // The gate and up columns of this task (rows first.. and n + first.. of W), then the
  // activation: a task-sized scratch per pool thread, reused.
  thread_local std::vector<float> scratch;
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
    for (int64_t m = 0; m < rows; ++m) {
      if (activation_type_ == ELK_Q8_K) {
        elk_quantize_row_q8_K(input + m * k_, activations.data() + m * activation_row_bytes_,
                              k_);
      } else {
        elk_quantize_row_ref(activation_type_, input + m * k_,
                             activations.data() + m * activation_row_bytes_, k_);
      }
    }
    Work work = plan(w.GetTensorData<uint8_t>(), activations.data(), bias,
                     y.GetTensorMutableData<float>(), rows, out_n, k_, row_bytes_,
                     activation_row_bytes_, type_, glu_);
    std::vector<float> lora_delta;
    std::vector<uint8_t> lora_used;
    if (elk::lora_active()) {  // some row of this call names an adapter
      std::string error;
      const int got = elk::lora_deltas(name_.c_str(), input, rows, k_, n_, &lora_delta,
                                       &lora_used, &error);
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
};

int64_t row_blocks(const elk_row &row) {
  return (row.length + kQueryRowsPerTask - 1) / kQueryRowsPerTask;
}

void store_keys(void *data, size_t task) {
  const AttentionWork &w = *static_cast<const AttentionWork *>(data);
  const int64_t r = static_cast<int64_t>(task) / w.shape.kv_heads;
  const int64_t h = static_cast<int64_t>(task) % w.shape.kv_heads;
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
  std::vector<float> scratch(static_cast<size_t>(w.shape.capacity));
  const int64_t last = std::min(row.length, (block + 1) * kQueryRowsPerTask);
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
    if (q_norm_.empty() != k_norm_.empty()) {
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

  void Compute(OrtKernelContext *context) {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue query = ctx.GetInput(0), key = ctx.GetInput(1),
                          value = ctx.GetInput(2), past_key = ctx.GetInput(3),
                          past_value = ctx.GetInput(4), seqlens = ctx.GetInput(5),
                          cos = ctx.GetInput(7), sin = ctx.GetInput(8),
                          flag = optional_input(ctx, 9), rows = optional_input(ctx, 10);
    const bool varlen = rows_form("CausalAttention", seqlens, rows);
    const std::vector<int64_t> q_shape = query.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> kv_shape = past_key.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> rope_shape = cos.GetTensorTypeAndShapeInfo().GetShape();
    if (q_shape.size() != 3 || kv_shape.size() != 4) fail("query is not [B, S, W] or the "
                                                          "KV buffers not [B, kv, L, D]");
    const int64_t batch = q_shape[0], seq = q_shape[1], d = kv_shape[3];
    const bool packed = !given(key);
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
                             static_cast<int64_t>(k_norm_.size()) != d)) {
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
    Ort::UnownedValue present_key = ctx.GetOutput(1, kv_shape);
    Ort::UnownedValue present_value = ctx.GetOutput(2, kv_shape);
    float *keys = present_key.GetTensorMutableData<float>();
    float *values = present_value.GetTensorMutableData<float>();
    const size_t buffer_bytes =
        static_cast<size_t>(kv_shape[0] * kv_heads_ * capacity * d) * sizeof(float);
    // The engine binds present to past's memory (nothing to copy); otherwise start from past.
    if (keys != past_key.GetTensorData<float>()) {
      std::memcpy(keys, past_key.GetTensorData<float>(), buffer_bytes);
    }
    if (values != past_value.GetTensorData<float>()) {
      std::memcpy(values, past_value.GetTensorData<float>(), buffer_bytes);
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
    if (packed) {
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
    work.keys = keys;
    work.values = values;
    work.out = out.GetTensorMutableData<float>();
    // A decode step's few new positions are cheaper written here than handed to the pool.
    const size_t store_tasks = static_cast<size_t>(row_count * kv_heads_);
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
  std::vector<float> q_norm_, k_norm_;  // attributes: read-only while Computes run
};

struct CausalAttentionOp : Ort::CustomOpBase<CausalAttentionOp, CausalAttentionKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create<CausalAttentionKernel>(api, info, kernel);
  }
  const char *GetName() const { return "CausalAttention"; }
  // 0 query (or packed QKV), 1 key, 2 value (both absent when packed), 3 past key, 4 past
  // value, 5 seqlens_k, 6 total_sequence_length (unread; both optional: absent with rows),
  // 7 cos, 8 sin, 9 bidirectional (optional: graphs of models whose image tokens attend both
  // ways; absent means causal), 10 rows (optional: the row table, instead of seqlens_k).
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 5 || index == 6 || index == 9 || index == 10
               ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
               : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 0 || index == 3 || index == 4 || index == 7 || index == 8
               ? INPUT_OUTPUT_REQUIRED
               : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
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
  static Ort::CustomOpDomain *domain = nullptr;  // outlives every session: never freed
  try {
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain(kDomain);
      domain->Add(&matmul);
      domain->Add(&gather);
      domain->Add(&attention);
      domain->Add(&shortconv);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception &e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}

// ONNX Runtime custom op edge_llm_ros.KQuantMatMul: Y[..., N] = A[..., K] x W^T, with W the
// [N, K] weight held byte for byte in its GGUF blocks (a uint8 initializer [N, row bytes]).
// Activations are quantized per row to Q8_K once; each output element is one dot product
// of the kernels dispatch.cpp chose, so a row's result does not depend on the batch.
// Threads: ONNX Runtime's intra-op pool (KernelContext_ParallelFor), never a pool of ours.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <string>
#include <vector>

#include "edge_llm_kquant/ref.h"

namespace {

constexpr const char *kDomain = "edge_llm_ros";
// A task: a block of weight rows (output columns) times a block of activation rows, handed
// whole to elk_gemm_q8_K, which tiles it so each weight block is unpacked once for several
// activation rows. Consecutive tasks share a column block (its weights stay in cache while
// the threads take its row blocks). A GEMV (up to 4 rows) takes 16..64 columns a task, at
// least 64 tasks where N allows (small N: the threads still share it); batches 32 columns.
constexpr int64_t kColumnsPerTask = 64, kMinColumnsPerTask = 16, kBatchColumnsPerTask = 32;
constexpr int64_t kRowsPerTask = 64;

struct Work {
  const uint8_t *weights;
  const uint8_t *activations;
  float *out;
  int64_t rows, n, k;
  size_t weight_row_bytes, activation_row_bytes;
  int type;
  int64_t columns_per_task, rows_per_task, row_tasks;
  size_t tasks;
};

// The tasks for rows x n outputs.
Work plan(const uint8_t *weights, const uint8_t *activations, float *out, int64_t rows,
          int64_t n, int64_t k, size_t weight_row_bytes, size_t activation_row_bytes, int type) {
  const int64_t rows_per_task = rows < kRowsPerTask ? rows : kRowsPerTask;
  const int64_t gemv_columns = n / 64 / 4 * 4;
  const int64_t columns_per_task =
      rows_per_task > 4 ? kBatchColumnsPerTask
      : gemv_columns < kMinColumnsPerTask ? kMinColumnsPerTask
      : gemv_columns > kColumnsPerTask ? kColumnsPerTask : gemv_columns;
  const int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  const size_t tasks =
      static_cast<size_t>(row_tasks * ((n + columns_per_task - 1) / columns_per_task));
  return Work{weights, activations, out, rows, n, k, weight_row_bytes, activation_row_bytes,
              type, columns_per_task, rows_per_task, row_tasks, tasks};
}

void columns(void *data, size_t task) {
  const Work &w = *static_cast<const Work *>(data);
  const int64_t first = static_cast<int64_t>(task) / w.row_tasks * w.columns_per_task;
  const int64_t row = static_cast<int64_t>(task) % w.row_tasks * w.rows_per_task;
  const int64_t cols = first + w.columns_per_task < w.n ? w.columns_per_task : w.n - first;
  const int64_t rows = row + w.rows_per_task < w.rows ? w.rows_per_task : w.rows - row;
  elk_gemm_q8_K(w.type, w.k, w.weights + first * w.weight_row_bytes, w.weight_row_bytes, cols,
                w.activations + row * w.activation_row_bytes, w.activation_row_bytes, rows,
                w.out + row * w.n + first, w.n);
}

struct KQuantMatMulKernel {
  KQuantMatMulKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo kernel_info(info);
    type_ = static_cast<int>(kernel_info.GetAttribute<int64_t>("quant_type"));
    k_ = kernel_info.GetAttribute<int64_t>("K");
    n_ = kernel_info.GetAttribute<int64_t>("N");
    if (type_ != ELK_Q4_K && type_ != ELK_Q5_K && type_ != ELK_Q6_K) {
      throw Ort::Exception("KQuantMatMul: quant_type " + std::to_string(type_) +
                           " is not Q4_K (12), Q5_K (13) or Q6_K (14): reconvert the model",
                           ORT_INVALID_ARGUMENT);
    }
    if (k_ <= 0 || n_ <= 0 || k_ % elk_block_weights(type_) != 0) {
      throw Ort::Exception("KQuantMatMul: K " + std::to_string(k_) + " is not a positive "
                           "multiple of the block size: reconvert the model", ORT_INVALID_ARGUMENT);
    }
    row_bytes_ = static_cast<size_t>(k_ / elk_block_weights(type_)) * elk_block_bytes(type_);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const Ort::Exception &e) {
      return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
    }
  }

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
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = n_;
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (rows == 0) return;
    const float *input = a.GetTensorData<float>();
    const size_t activation_row_bytes =
        static_cast<size_t>(k_ / 256) * elk_block_bytes(ELK_Q8_K);
    activations_.resize(static_cast<size_t>(rows) * activation_row_bytes);
    for (int64_t m = 0; m < rows; ++m) {
      elk_quantize_row_q8_K(input + m * k_, activations_.data() + m * activation_row_bytes,
                            k_);
    }
    Work work = plan(w.GetTensorData<uint8_t>(), activations_.data(),
                     y.GetTensorMutableData<float>(), rows, n_, k_, row_bytes_,
                     activation_row_bytes, type_);
    ctx.ParallelFor(columns, work.tasks, 0, &work);
  }

 private:
  int type_ = 0;
  int64_t k_ = 0, n_ = 0;
  size_t row_bytes_ = 0;
  std::vector<uint8_t> activations_;  // per-kernel scratch: ORT runs one Compute at a time
};

struct KQuantMatMulOp : Ort::CustomOpBase<KQuantMatMulOp, KQuantMatMulKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    try {
      *kernel = new KQuantMatMulKernel(api, info);
      return nullptr;
    } catch (const Ort::Exception &e) {
      return api.CreateStatus(e.GetOrtErrorCode(), e.what());
    }
  }
  const char *GetName() const { return "KQuantMatMul"; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace

// SessionOptions.register_custom_ops_library calls this.
extern "C" OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options,
                                                      const OrtApiBase *api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static KQuantMatMulOp op;
  static Ort::CustomOpDomain *domain = nullptr;  // outlives every session: never freed
  try {
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain(kDomain);
      domain->Add(&op);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception &e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}

// ONNX Runtime custom op edge_llm_ros.KQuantMatMul for the CUDA execution provider
// (libedge_llm_ort_ops_cuda.so): the CPU op's contract (native/src/ort_op.cpp: A fp32 [..., K],
// W uint8 [N, row bytes] of GGUF blocks, optional bias fp32 [N], attributes quant_type/K/N),
// run by kernels/kquant.cu on ORT's GPU compute stream. ORT keeps every input in device memory
// (W, an initializer, is copied to the GPU once, at session creation); activations are quantized
// into stream-ordered scratch of this library's own memory pool. Q4_K, Q6_K and Q8_0 only:
// another quant_type is a session-creation error.
//
// ORT refuses two libraries that register one domain in a session ("Domain already set in
// registry"), so a session registers this library or libedge_llm_ort_ops.so, not both.
// Built only where CMake finds CUDA; cudart is linked statically, so the CPU library never
// needs CUDA and this one needs only the driver.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "glu.h"
#include "kquant_cuda.h"

#define ELK_CUDA_API __attribute__((visibility("default")))

namespace {

constexpr const char *kDomain = "edge_llm_ros";
constexpr int kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

const char *cuda_type_name(int type) {
  switch (type) {
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ6_K: return "Q6_K";
    default: return nullptr;
  }
}

const char *cpu_type_name(int type) {
  switch (type) {
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 13: return "Q5_K";
    default: return nullptr;
  }
}

[[noreturn]] void fail(const std::string &what, OrtErrorCode code = ORT_FAIL) {
  throw Ort::Exception("KQuantMatMul (CUDA): " + what, code);
}

void check(cudaError_t status, const char *call) {
  if (status != cudaSuccess) fail(std::string(call) + ": " + cudaGetErrorString(status));
}

// One pool per device, created on first use and kept (with no release threshold, so freed
// scratch stays for the next call); nullptr where the device has no memory pools.
cudaMemPool_t scratch_pool(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = pools.find(device);
  if (found != pools.end()) return found->second;
  int supported = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) ==
          cudaSuccess && supported) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    } else {
      pool = nullptr;
    }
  }
  cudaGetLastError();  // a refused attribute or pool is not the next launch's error
  pools.emplace(device, pool);
  return pool;
}

struct KQuantMatMulCudaKernel {
  KQuantMatMulCudaKernel(const OrtApi &, const OrtKernelInfo *info) {
    Ort::ConstKernelInfo kernel_info(info);
    type_ = static_cast<int>(kernel_info.GetAttribute<int64_t>("quant_type"));
    k_ = kernel_info.GetAttribute<int64_t>("K");
    n_ = kernel_info.GetAttribute<int64_t>("N");
    if (cuda_type_name(type_) == nullptr) {
      const char *other = cpu_type_name(type_);
      fail("quant_type " + std::to_string(type_) + (other ? std::string(" (") + other + ")" : "") +
           ": the CUDA op holds only Q4_K (12), Q6_K (14) and Q8_0 (8); the CPU execution "
           "provider's op (libedge_llm_ort_ops.so) runs the rest of the GGUF block types: run "
           "this model on CPUExecutionProvider, or reconvert it with those types",
           ORT_INVALID_ARGUMENT);
    }
    const int64_t per = type_ == kQ8_0 ? 32 : 256;
    if (k_ <= 0 || k_ % per != 0) {
      fail("K " + std::to_string(k_) + " is not a positive multiple of " +
           cuda_type_name(type_) + "'s block size " + std::to_string(per) +
           ": reconvert the model (another quant type, or pad K)", ORT_INVALID_ARGUMENT);
    }
    if (n_ <= 0) fail("N " + std::to_string(n_) + " is not positive", ORT_INVALID_ARGUMENT);
    std::string glu;
    try {
      glu = kernel_info.GetAttribute<std::string>("glu");
    } catch (const Ort::Exception &) {
      glu.clear();  // not set
    }
    std::string error;
    glu_ = elk::glu::kind_of_attribute(glu, n_, &error);
    if (glu_ < 0) fail(error, ORT_INVALID_ARGUMENT);
    row_bytes_ = static_cast<size_t>(k_ / per) * (type_ == kQ8_0 ? 34 : type_ == kQ4_K ? 144 : 210);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext *context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const Ort::Exception &e) {
      return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
    } catch (const std::exception &e) {
      return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
    }
  }

  void Compute(OrtKernelContext *context) const {
    Ort::KernelContext ctx(context);
    const Ort::ConstValue a = ctx.GetInput(0), w = ctx.GetInput(1);
    std::vector<int64_t> shape = a.GetTensorTypeAndShapeInfo().GetShape();
    const std::vector<int64_t> w_shape = w.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != k_) {
      fail("A's last dimension is not K = " + std::to_string(k_), ORT_INVALID_ARGUMENT);
    }
    if (w_shape.size() != 2 || w_shape[0] != n_ ||
        w_shape[1] != static_cast<int64_t>(row_bytes_)) {
      fail("W is not [N, row bytes] = [" + std::to_string(n_) + ", " +
           std::to_string(row_bytes_) + "] of GGUF blocks", ORT_INVALID_ARGUMENT);
    }
    const float *bias = nullptr;
    if (ctx.GetInputCount() > 2) {
      const Ort::ConstValue b = ctx.GetInput(2);
      if (static_cast<const OrtValue *>(b) != nullptr) {
        const std::vector<int64_t> b_shape = b.GetTensorTypeAndShapeInfo().GetShape();
        if (b_shape.size() != 1 || b_shape[0] != n_) {
          fail("bias is not [N] = [" + std::to_string(n_) + "]", ORT_INVALID_ARGUMENT);
        }
        bias = b.GetTensorData<float>();
      }
    }
    if (w.GetTensorMemoryInfo().GetDeviceType() != OrtMemoryInfoDeviceType_GPU ||
        a.GetTensorMemoryInfo().GetDeviceType() != OrtMemoryInfoDeviceType_GPU) {
      fail("A and W are not in GPU memory: the op runs on CUDAExecutionProvider only");
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    shape.back() = glu_ == elk::glu::kNone ? n_ : n_ / 2;
    Ort::UnownedValue y = ctx.GetOutput(0, shape);
    if (rows == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    if (stream == nullptr) fail("ONNX Runtime gave no GPU compute stream");
    // This library has its own (static) CUDA runtime: make W's device its current one.
    const int device = w.GetTensorMemoryInfo().GetDeviceId();
    check(cudaSetDevice(device), "cudaSetDevice");
    const size_t matmul_bytes = kquant_cuda_scratch_bytes(type_, rows, k_);
    // With a glu the [rows, N] product goes to scratch after the activations', then
    // kquant_cuda_glu writes the output.
    const size_t product_offset = (matmul_bytes + 255) / 256 * 256;
    const size_t bytes = glu_ == elk::glu::kNone
                             ? matmul_bytes
                             : product_offset + static_cast<size_t>(rows * n_) * sizeof(float);
    if (matmul_bytes == 0) {
      fail(std::to_string(rows) + " rows of K " + std::to_string(k_) + " are more than the "
           "kernels take (M up to 4194240, K/256 below 65535)", ORT_INVALID_ARGUMENT);
    }
    const float *input = a.GetTensorData<float>();
    const uint8_t *weights = w.GetTensorData<uint8_t>();
    float *out = y.GetTensorMutableData<float>();
    void *scratch = nullptr;
    if (cudaMemPool_t pool = scratch_pool(device)) {
      check(cudaMallocFromPoolAsync(&scratch, bytes, pool, stream), "cudaMallocFromPoolAsync");
      const int status = run(input, weights, bias, out, rows, scratch, product_offset, stream);
      check(cudaFreeAsync(scratch, stream), "cudaFreeAsync");  // stream-ordered: after the work
      launched(status, rows);
    } else {
      check(cudaMalloc(&scratch, bytes), "cudaMalloc");
      const int status = run(input, weights, bias, out, rows, scratch, product_offset, stream);
      const cudaError_t done = cudaStreamSynchronize(stream);
      cudaFree(scratch);
      launched(status, rows);
      check(done, "cudaStreamSynchronize");
    }
  }

 private:
  // The product into out, or with a glu into scratch then its activation into out.
  int run(const float *input, const uint8_t *weights, const float *bias, float *out,
          int64_t rows, void *scratch, size_t product_offset, cudaStream_t stream) const {
    if (glu_ == elk::glu::kNone) {
      return kquant_cuda_matmul(type_, input, weights, bias, out, rows, n_, k_, scratch, stream);
    }
    float *product = reinterpret_cast<float *>(static_cast<uint8_t *>(scratch) + product_offset);
    const int status = kquant_cuda_matmul(type_, input, weights, bias, product, rows, n_, k_,
                                          scratch, stream);
    return status != 0 ? status : kquant_cuda_glu(glu_, product, out, rows, n_ / 2, stream);
  }

  void launched(int status, int64_t rows) const {
    if (status == -1) {
      fail("the kernels do not take M " + std::to_string(rows) + ", N " + std::to_string(n_) +
           ", K " + std::to_string(k_), ORT_INVALID_ARGUMENT);
    }
    check(static_cast<cudaError_t>(status), "kquant_cuda_matmul");
  }

  int type_ = 0, glu_ = elk::glu::kNone;
  int64_t k_ = 0, n_ = 0;
  size_t row_bytes_ = 0;  // the kernel holds attributes only: concurrent Computes share nothing
};

OrtStatusPtr create_kernel(const OrtApi &api, const OrtKernelInfo *info, void **kernel) {
  try {
    *kernel = new KQuantMatMulCudaKernel(api, info);
    return nullptr;
  } catch (const Ort::Exception &e) {
    return api.CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception &e) {
    return api.CreateStatus(ORT_FAIL, e.what());
  }
}

struct KQuantMatMulCudaOp
    : Ort::CustomOpBase<KQuantMatMulCudaOp, KQuantMatMulCudaKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi &api, const OrtKernelInfo *info,
                              void **kernel) const {
    return create_kernel(api, info, kernel);
  }
  const char *GetName() const { return "KQuantMatMul"; }
  const char *GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  // A fp32 [..., K], W uint8 [N, row bytes], and an optional bias fp32 [N]: all on the device.
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

}  // namespace

// SessionOptions.register_custom_ops_library calls this (the library's only export).
extern "C" ELK_CUDA_API OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options,
                                                                   const OrtApiBase *api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static KQuantMatMulCudaOp matmul;
  static Ort::CustomOpDomain *domain = nullptr;  // outlives every session: never freed
  try {
    if (domain == nullptr) {
      domain = new Ort::CustomOpDomain(kDomain);
      domain->Add(&matmul);
    }
    Ort::UnownedSessionOptions(options).Add(*domain);
  } catch (const Ort::Exception &e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}

// The three ways of computing the bias gradient, and the choice among them: our kernel (bias_grad.cu), a cuDNN
// reduction graph (bias_reduction.cpp) and ATen's sum. Measured on the H200 (bench/bench_param_grad.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/bias_grad.h"
#include "cuda/bias_reduction.h"
#include "cuda/knobs.h"

namespace convbias::cuda {
namespace {

at::Tensor aten_bias_grad(const at::Tensor& grad_output) {
  const at::ScalarType accumulate = grad_output.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(grad_output, {0, 2, 3}, /*keepdim=*/false, accumulate).to(grad_output.scalar_type());
}

} // namespace

BiasGradWay bias_grad_way(const at::Tensor& grad_output) {
  const std::string& way = knobs().bias_grad;
  BiasGradWay choice{"aten", {}};
  if (way == "kernel") {
    if (bias_grad_kernel_applies(grad_output)) {
      return {"kernel", {}};
    }
    choice.notes.push_back(
        "our kernel takes channels_last grad_output with K a multiple of 16 bytes on a 16-byte aligned base");
  } else if (way == "cudnn") {
    if (bias_reduction_applies(grad_output)) {
      if (bias_grad_cudnn(grad_output)) {
        return {"cudnn", {}};
      }
      choice.notes.push_back("no cuDNN reduction plan builds: " + bias_reduction_failure(grad_output));
    } else {
      choice.notes.push_back(
          "the cuDNN reduction graph takes channels_last float/half/bfloat16 grad_output on a 16-byte aligned base");
    }
  } else {
    choice.notes.push_back("TORCH_CONVBIAS_BIAS_GRAD=" + way);
  }
  return choice;
}

at::Tensor bias_grad(const at::Tensor& grad_output) {
  const std::string& way = knobs().bias_grad;
  if (way == "kernel" && bias_grad_kernel_applies(grad_output)) {
    return bias_grad_channels_last(grad_output);
  }
  if (way == "cudnn" && bias_reduction_applies(grad_output)) {
    if (auto grad_bias = bias_grad_cudnn(grad_output)) {
      return *grad_bias;
    }
  }
  return aten_bias_grad(grad_output);
}

at::Tensor bias_grad_with(const at::Tensor& grad_output, c10::string_view way) {
  TORCH_CHECK_VALUE(
      grad_output.dim() == 4, "convbias._bias_grad: expected a 4-D grad_output, got ", grad_output.dim(), "-D");
  // The kernels, plans and timings run on grad_output's GPU, whichever device is current.
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  if (way == "kernel") {
    TORCH_CHECK_VALUE(
        bias_grad_kernel_applies(grad_output),
        "convbias._bias_grad: the kernel takes channels_last float/half/bfloat16/double grad_output with K a "
        "multiple of 16 bytes and a 16-byte aligned base; got ", grad_output.scalar_type(), " of shape ",
        grad_output.sizes(), " and strides ", grad_output.strides());
    return bias_grad_channels_last(grad_output);
  }
  if (way == "cudnn") {
    TORCH_CHECK_VALUE(
        bias_reduction_applies(grad_output),
        "convbias._bias_grad: the cuDNN reduction graph takes channels_last float/half/bfloat16 grad_output on a "
        "16-byte aligned base; got ", grad_output.scalar_type(), " of shape ", grad_output.sizes(),
        " and strides ", grad_output.strides());
    auto grad_bias = bias_grad_cudnn(grad_output);
    TORCH_CHECK(
        grad_bias.has_value(), "convbias._bias_grad: no cuDNN reduction plan builds for grad_output of shape ",
        grad_output.sizes(), " (", grad_output.scalar_type(), "): ", bias_reduction_failure(grad_output));
    return *grad_bias;
  }
  TORCH_CHECK_VALUE(
      way == "aten", "convbias._bias_grad: way must be 'kernel', 'cudnn' or 'aten', got '", way, "'");
  return aten_bias_grad(grad_output);
}

} // namespace convbias::cuda

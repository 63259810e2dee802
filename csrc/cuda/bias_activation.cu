// bias_activation.h: one TensorIterator pass (ATen's gpu_kernel: every layout, vectorised where it can, the launch
// configuration PyTorch's own pointwise kernels use) over y and the bias broadcast along K.
#include "cuda/bias_activation.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/cuda/Loops.cuh>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/activation_math.cuh"

namespace convbias::cuda {
namespace {

template <typename T>
struct BiasActivation {
  using Acc = at::opmath_type<T>;
  Activation kind;
  Acc negative_slope;

  __device__ T operator()(T value, T bias) const {
    return static_cast<T>(activation_forward<Acc>(kind, static_cast<Acc>(value) + static_cast<Acc>(bias), negative_slope));
  }
};

} // namespace

at::Tensor& bias_activation_(at::Tensor& y, const at::Tensor& bias, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(y.is_cuda() && y.dim() == 4 && bias.dim() == 1 && bias.size(0) == y.size(1));
  TORCH_INTERNAL_ASSERT(bias.scalar_type() == y.scalar_type());
  if (y.numel() == 0) {
    return y;
  }
  const c10::cuda::CUDAGuard device_guard(y.device());
  const at::Tensor bias_view = bias.view({1, -1, 1, 1}); // broadcast along N, H, W
  at::TensorIterator iter = at::TensorIterator::borrowing_binary_op(y, y, bias_view);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "convbias_bias_activation", [&] {
    using Acc = at::opmath_type<scalar_t>;
    at::native::gpu_kernel(
        iter, BiasActivation<scalar_t>{activation.kind, static_cast<Acc>(activation.negative_slope)});
  });
  return y;
}

} // namespace convbias::cuda

// bias_activation.h: one TensorIterator pass (ATen's gpu_kernel: every layout, vectorised where it can, the launch
// configuration PyTorch's own pointwise kernels use) over y and the addend (the bias broadcast along K, or a residual).
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
struct AddActivation {
  using Acc = at::opmath_type<T>;
  Activation kind;
  Acc negative_slope;

  __device__ T operator()(T value, T addend) const {
    // 16-bit results: the cheaper math of activation_math.cuh (this pass is arithmetic-bound for gelu / silu there).
    return static_cast<T>(activation_forward<Acc, kFastMath<T>>(
        kind, static_cast<Acc>(value) + static_cast<Acc>(addend), negative_slope));
  }
};

} // namespace

at::Tensor& add_activation_(at::Tensor& y, const at::Tensor& addend, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(y.is_cuda() && addend.device() == y.device() && addend.scalar_type() == y.scalar_type());
  if (y.numel() == 0) {
    return y;
  }
  const c10::cuda::CUDAGuard device_guard(y.device());
  at::TensorIterator iter = at::TensorIterator::borrowing_binary_op(y, y, addend);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "convbias_add_activation", [&] {
    using Acc = at::opmath_type<scalar_t>;
    at::native::gpu_kernel(
        iter, AddActivation<scalar_t>{activation.kind, static_cast<Acc>(activation.negative_slope)});
  });
  return y;
}

at::Tensor& bias_activation_(at::Tensor& y, const at::Tensor& bias, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(y.dim() == 4 && bias.dim() == 1 && bias.size(0) == y.size(1));
  const at::Tensor bias_view = bias.view({1, -1, 1, 1}); // broadcast along N, H, W
  return add_activation_(y, bias_view, activation);
}

} // namespace convbias::cuda

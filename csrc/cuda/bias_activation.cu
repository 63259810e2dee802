// bias_activation.h: one TensorIterator pass (ATen's gpu_kernel: every layout, vectorised where it can, the launch
// configuration PyTorch's own pointwise kernels use) over y and the addends (the bias broadcast along K, a residual).
#include "cuda/bias_activation.h"

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <ATen/native/cuda/Loops.cuh>
#include <c10/cuda/CUDAGuard.h>

#include "activation.h"
#include "cuda/activation_math.cuh"
#include "reference.h"

namespace convbias::cuda {
namespace {

// act(sum) rounded to T, for the sums of the passes below. 16-bit results: the cheaper math of activation_math.cuh
// (these passes are arithmetic-bound for gelu / silu there).
template <typename T, Activation kKind>
__device__ T activate_sum(at::opmath_type<T> sum, at::opmath_type<T> negative_slope) {
  return static_cast<T>(activation_forward<at::opmath_type<T>, kFastMath<T>>(kKind, sum, negative_slope));
}

// One kernel per activation (kKind a template argument: with_activation_kind).
template <typename T, Activation kKind>
struct AddActivation {
  using Acc = at::opmath_type<T>;
  Acc negative_slope;

  __device__ T operator()(T value, T addend) const {
    return activate_sum<T, kKind>(static_cast<Acc>(value) + static_cast<Acc>(addend), negative_slope);
  }
};

// AddActivation with two addends (a bias and a residual).
template <typename T, Activation kKind>
struct AddTwoActivation {
  using Acc = at::opmath_type<T>;
  Acc negative_slope;

  __device__ T operator()(T value, T bias, T residual) const {
    return activate_sum<T, kKind>(
        static_cast<Acc>(value) + static_cast<Acc>(bias) + static_cast<Acc>(residual), negative_slope);
  }
};

// act(value) of a 16-bit value: AddActivation without the addend, the cheaper float math or ATen's formulas (kFast).
template <typename T, Activation kKind, bool kFast>
struct Activate {
  float negative_slope;

  __device__ T operator()(T value) const {
    return static_cast<T>(activation_forward<float, kFast>(kKind, static_cast<float>(value), negative_slope));
  }
};

bool is_16bit(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16;
}

// gpu_kernel over `iter` (its output y first, then y and the addends) with Op<scalar_t, kKind> for y's dtype and the
// activation (the passes of add_activation_ and bias_residual_activation_).
template <template <typename, Activation> class Op>
void add_activation_pass(at::TensorIterator& iter, const at::Tensor& y, const ActivationSpec& activation) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "convbias_add_activation", [&] {
    using Acc = at::opmath_type<scalar_t>;
    with_activation_kind(activation.kind, [&](auto kind) {
      constexpr Activation kKind = decltype(kind)::value;
      at::native::gpu_kernel(iter, Op<scalar_t, kKind>{static_cast<Acc>(activation.negative_slope)});
    });
  });
}

} // namespace

void activation_16bit(at::Tensor& out, const at::Tensor& in, const ActivationSpec& activation, bool fast) {
  TORCH_CHECK(
      in.is_cuda() && is_16bit(in.scalar_type()) && out.scalar_type() == in.scalar_type(),
      "convbias: our activation pass takes float16 / bfloat16 CUDA tensors, got ", in.scalar_type(), " on ",
      in.device());
  if (in.numel() == 0 || activation.is_identity()) {
    if (!out.is_same(in)) {
      out.copy_(in);
    }
    return;
  }
  const c10::cuda::CUDAGuard device_guard(in.device());
  at::TensorIterator iter = at::TensorIterator::unary_op(out, in);
  const float slope = static_cast<float>(activation.negative_slope);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(in.scalar_type(), "convbias_activation", [&] {
    with_activation_kind(activation.kind, [&](auto kind) {
      constexpr Activation kKind = decltype(kind)::value;
      if (fast) {
        at::native::gpu_kernel(iter, Activate<scalar_t, kKind, true>{slope});
      } else {
        at::native::gpu_kernel(iter, Activate<scalar_t, kKind, false>{slope});
      }
    });
  });
}

at::Tensor& add_activation_(at::Tensor& y, const at::Tensor& addend, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(y.is_cuda() && addend.device() == y.device() && addend.scalar_type() == y.scalar_type());
  if (y.numel() == 0) {
    return y;
  }
  const c10::cuda::CUDAGuard device_guard(y.device());
  at::TensorIterator iter = at::TensorIterator::borrowing_binary_op(y, y, addend);
  add_activation_pass<AddActivation>(iter, y, activation);
  return y;
}

at::Tensor& bias_activation_(at::Tensor& y, const at::Tensor& bias, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(y.dim() == 4 && bias.dim() == 1 && bias.size(0) == y.size(1));
  const at::Tensor bias_view = bias.view({1, -1, 1, 1}); // broadcast along N, H, W
  return add_activation_(y, bias_view, activation);
}

at::Tensor& bias_residual_activation_(
    at::Tensor& y, const at::Tensor& bias, const at::Tensor& residual, const ActivationSpec& activation) {
  TORCH_INTERNAL_ASSERT(
      y.is_cuda() && y.dim() == 4 && bias.dim() == 1 && bias.size(0) == y.size(1) && residual.sizes() == y.sizes());
  TORCH_INTERNAL_ASSERT(bias.scalar_type() == y.scalar_type() && residual.scalar_type() == y.scalar_type());
  if (y.numel() == 0) {
    return y;
  }
  const c10::cuda::CUDAGuard device_guard(y.device());
  const at::Tensor bias_view = bias.view({1, -1, 1, 1}); // broadcast along N, H, W
  at::TensorIterator iter = at::TensorIteratorConfig()
                                .add_output(y)
                                .add_const_input(y)
                                .add_const_input(bias_view)
                                .add_const_input(residual)
                                .build();
  add_activation_pass<AddTwoActivation>(iter, y, activation);
  return y;
}

at::Tensor& activation_after_graph_(at::Tensor& y, const ActivationSpec& activation) {
  if (activation.is_identity() || !is_16bit(y.scalar_type())) {
    return apply_activation_(y, activation);
  }
  activation_16bit(y, y, activation, /*fast=*/true);
  return y;
}

at::Tensor activation_after_graph(const at::Tensor& z, const ActivationSpec& activation, at::MemoryFormat format) {
  if (activation.is_identity() || !is_16bit(z.scalar_type())) {
    return activation_after_preactivation(z, activation, format);
  }
  at::Tensor out = at::empty(z.sizes(), z.options().memory_format(format));
  activation_16bit(out, z, activation, /*fast=*/true);
  return out;
}

const char* activation_pass_name(at::ScalarType dtype) {
  return is_16bit(dtype) ? "our activation pass (16-bit math)" : "ATen's pointwise kernel";
}

} // namespace convbias::cuda

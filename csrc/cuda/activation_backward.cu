// The activation's derivative fused with the bias gradient: the column sum of column_sum.cuh over a source that
// reads grad_output and the saved tensor (the output or the pre-activation, activation.h), computes
// dz = grad_output * act'(saved) in FP32 (FP64 for double) from the widened values, writes dz rounded once to the
// dtype, and adds the rounded values to the column sums. So dz is written once, grad_output and saved are read once,
// and grad_bias is exactly the sum a separate pass over the written dz would compute (same kernel, same order).
//
// The derivatives follow PyTorch's CUDA kernels formula for formula (aten/src/ATen/native/cuda: threshold_backward,
// leaky_relu_backward, gelu_backward with approximate none / tanh, silu_backward, sigmoid_backward, tanh_backward),
// computed in the same opmath type, so that dz agrees with ATen's to the last bit but for contraction into FMAs; for
// float16 / bfloat16 the transcendental ones (gelu, gelu_tanh, silu) use the cheaper math of activation_math.cuh,
// whose error is far below the dtype's rounding (that pass was arithmetic-bound at 2 bytes per element).
#include "cuda/activation_backward.h"
#include "cuda/activation_math.cuh"
#include "cuda/column_sum.cuh"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>

namespace convbias::cuda {
namespace {

using column_sum::Accumulator;
using column_sum::kVectorBytes;
using column_sum::Lanes;

// d(loss)/dz from g = d(loss)/d(act(z)) and the saved value: y = act(z) (output) or z (pre-activation).

// threshold_backward(g, y, 0): g where y > 0, else 0 (NaN outputs pass g, as ATen's `y <= 0 ? 0 : g`).
template <typename Acc>
struct ReluGrad {
  __device__ Acc operator()(Acc g, Acc y) const {
    return y <= Acc(0) ? Acc(0) : g;
  }
};

// leaky_relu_backward: the saved value's sign is the input's (the output for a slope >= 0, else the input).
template <typename Acc>
struct LeakyReluGrad {
  Acc negative_slope;
  __device__ Acc operator()(Acc g, Acc s) const {
    return s > Acc(0) ? g : g * negative_slope;
  }
};

// gelu_backward(approximate="none") from z: g * (Phi(z) + z * phi(z)) (kFast: activation_math.cuh's cheaper math).
template <typename Acc, bool kFast>
struct GeluGrad {
  __device__ Acc operator()(Acc g, Acc x) const {
    const Acc pdf = normal_pdf_as<kFast>(x);
    const Acc cdf = normal_cdf_as<kFast>(x, pdf);
    return g * (cdf + x * pdf);
  }
};

// gelu_backward(approximate="tanh") from z. kFast: with s = sigmoid(2 inner) = (1 + tanh(inner)) / 2, the two halves
// are s and x * 2 s (1 - s) * beta * (1 + 3 kappa x^2) (1 - tanh^2 = 4 s (1 - s)): one __expf, no tanhf.
template <typename Acc, bool kFast>
struct GeluTanhGrad {
  __device__ Acc operator()(Acc g, Acc x) const {
    constexpr Acc kBeta = static_cast<Acc>(M_SQRT2 * M_2_SQRTPI * 0.5);
    constexpr Acc kKappa = static_cast<Acc>(0.044715);
    const Acc x_sq = x * x;
    const Acc x_cube = x_sq * x;
    const Acc inner = kBeta * (x + kKappa * x_cube);
    if constexpr (kFast) {
      const Acc s = sigmoid_as<true>(Acc(2) * inner);
      return g * (s + Acc(2) * x * s * (Acc(1) - s) * kBeta * (Acc(1) + Acc(3) * kKappa * x_sq));
    } else {
      const Acc tanh_inner = tanh_of(inner);
      const Acc left = Acc(0.5) * x;
      const Acc right = Acc(1) + tanh_inner;
      const Acc left_derivative = Acc(0.5) * right;
      const Acc right_derivative =
          left * (Acc(1) - tanh_inner * tanh_inner) * kBeta * (Acc(1) + Acc(3) * kKappa * x_sq);
      return g * (left_derivative + right_derivative);
    }
  }
};

// silu_backward from z: g * s * (1 + z * (1 - s)), s = sigmoid(z).
template <typename Acc, bool kFast>
struct SiluGrad {
  __device__ Acc operator()(Acc g, Acc x) const {
    const Acc s = sigmoid_as<kFast>(x);
    return g * s * (Acc(1) + x * (Acc(1) - s));
  }
};

// sigmoid_backward from y: g * (1 - y) * y.
template <typename Acc>
struct SigmoidGrad {
  __device__ Acc operator()(Acc g, Acc y) const {
    return g * (Acc(1) - y) * y;
  }
};

// tanh_backward from y: g * (1 - y * y).
template <typename Acc>
struct TanhGrad {
  __device__ Acc operator()(Acc g, Acc y) const {
    return g * (Acc(1) - y * y);
  }
};

// The column-sum source (column_sum.cuh): one 16-byte vector of grad_output and one of saved per row, dz written to
// grad_z at the same position and its rounded values summed. Loads are streaming (read once); the store is a plain
// one: the weight gradient reads dz right after, and what of it is still in L2 then is a gain.
template <typename T, typename Derivative>
struct ActivationGradOf {
  using Value = T;
  using Acc = typename Accumulator<T>::type;
  struct Loaded {
    uint4 grad;
    uint4 saved;
  };
  static constexpr int kLoadsPerRow = 2;

  const uint4* grad;
  const uint4* saved;
  uint4* grad_z;
  Derivative derivative;

  __device__ Loaded load(int64_t vector) const {
    return {__ldcs(grad + vector), __ldcs(saved + vector)};
  }
  __device__ void add(const Loaded& loaded, int64_t vector, Acc* sum) const {
    constexpr int kVec = Lanes<T>::kCount;
    Acc g[kVec];
    Acc s[kVec];
    Acc dz[kVec];
    Lanes<T>::widen(loaded.grad, g);
    Lanes<T>::widen(loaded.saved, s);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      dz[i] = derivative(g[i], s[i]);
    }
    const uint4 rounded = Lanes<T>::narrow(dz);
    grad_z[vector] = rounded;
    // The rounded values, as written: grad_bias is the sum of dz as stored.
    Lanes<T>::add(rounded, sum);
  }
};

template <typename T, typename Derivative>
at::Tensor run(
    const Derivative& derivative, const at::Tensor& grad_output, const at::Tensor& saved, at::Tensor& grad_z,
    LaunchConfig config) {
  const int64_t columns = grad_output.size(1);
  const ActivationGradOf<T, Derivative> source{
      static_cast<const uint4*>(grad_output.const_data_ptr()), static_cast<const uint4*>(saved.const_data_ptr()),
      static_cast<uint4*>(grad_z.mutable_data_ptr()), derivative};
  return column_sum::column_sums(source, grad_output.numel() / columns, columns, grad_output.options(), config);
}

template <typename T>
at::Tensor run_activation(
    const ActivationSpec& spec, const at::Tensor& grad_output, const at::Tensor& saved, at::Tensor& grad_z,
    LaunchConfig config) {
  using Acc = typename Accumulator<T>::type;
  switch (spec.kind) {
    case Activation::Relu: return run<T>(ReluGrad<Acc>{}, grad_output, saved, grad_z, config);
    case Activation::LeakyRelu:
      // The slope in the opmath type, as ATen's kernel converts it.
      return run<T>(
          LeakyReluGrad<Acc>{static_cast<Acc>(spec.negative_slope)}, grad_output, saved, grad_z, config);
    // 16-bit results: the cheaper math of activation_math.cuh, whose error is far below their rounding.
    case Activation::Gelu: return run<T>(GeluGrad<Acc, kFastMath<T>>{}, grad_output, saved, grad_z, config);
    case Activation::GeluTanh: return run<T>(GeluTanhGrad<Acc, kFastMath<T>>{}, grad_output, saved, grad_z, config);
    case Activation::Silu: return run<T>(SiluGrad<Acc, kFastMath<T>>{}, grad_output, saved, grad_z, config);
    case Activation::Sigmoid: return run<T>(SigmoidGrad<Acc>{}, grad_output, saved, grad_z, config);
    case Activation::Tanh: return run<T>(TanhGrad<Acc>{}, grad_output, saved, grad_z, config);
    case Activation::Identity: break;
  }
  TORCH_INTERNAL_ASSERT(false, "convbias: no fused activation backward for ", activation_name(spec.kind));
}

at::Tensor launch_for(
    const ActivationSpec& spec, const at::Tensor& grad_output, const at::Tensor& saved, at::Tensor& grad_z,
    LaunchConfig config) {
  switch (grad_output.scalar_type()) {
    case at::kFloat: return run_activation<float>(spec, grad_output, saved, grad_z, config);
    case at::kDouble: return run_activation<double>(spec, grad_output, saved, grad_z, config);
    case at::kHalf: return run_activation<at::Half>(spec, grad_output, saved, grad_z, config);
    case at::kBFloat16: return run_activation<at::BFloat16>(spec, grad_output, saved, grad_z, config);
    default: TORCH_CHECK(false, "convbias: no fused activation backward for ", grad_output.scalar_type());
  }
}

// The launch configuration, timed (writing grad_z) where timing is allowed: one per activation, whose costs differ
// (erf and exp against a compare).
std::pair<LaunchConfig, bool> config_for(
    const ActivationSpec& spec, const at::Tensor& grad_output, const at::Tensor& saved, at::Tensor& grad_z) {
  return column_sum_config(grad_output, kBiasGradKernel + 1 + static_cast<ColumnSumKernel>(spec.kind), [&](LaunchConfig c) {
    (void)launch_for(spec, grad_output, saved, grad_z, c);
  });
}

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % kVectorBytes == 0;
}

} // namespace

std::optional<std::string> fused_activation_backward_refusal(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& spec) {
  if (spec.is_identity()) {
    return "identity has no derivative to fuse";
  }
  if (!grad_output.is_cuda() || !saved.is_cuda()) {
    return "the fused kernel runs on CUDA tensors";
  }
  if (grad_output.numel() == 0) {
    return "empty tensors: nothing to stream";
  }
  const auto dtype = grad_output.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kDouble) {
    return "the fused kernel takes float, half, bfloat16 or double";
  }
  if (!grad_output.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return "the fused kernel takes a channels_last grad_output (NHWC-packed)";
  }
  if (!saved.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return "the fused kernel takes a channels_last saved tensor (NHWC-packed), as grad_output";
  }
  const int64_t vec = kVectorBytes / grad_output.element_size();
  if (grad_output.size(1) % vec != 0) {
    return "the fused kernel takes K a multiple of " + std::to_string(vec) + " (16-byte vectors of " +
        std::string(c10::toString(dtype)) + "), got K = " + std::to_string(grad_output.size(1));
  }
  if (!aligned(grad_output) || !aligned(saved)) {
    return "the fused kernel takes 16-byte aligned grad_output and saved (a storage offset misaligns them)";
  }
  return std::nullopt;
}

std::pair<at::Tensor, at::Tensor> fused_activation_backward(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& spec) {
  TORCH_INTERNAL_ASSERT(!fused_activation_backward_refusal(grad_output, saved, spec));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  at::Tensor grad_z = at::empty(grad_output.sizes(), grad_output.options().memory_format(at::MemoryFormat::ChannelsLast));
  at::Tensor grad_bias = launch_for(spec, grad_output, saved, grad_z, config_for(spec, grad_output, saved, grad_z).first);
  return {std::move(grad_z), std::move(grad_bias)};
}

KernelLaunch fused_activation_backward_launch(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& spec) {
  TORCH_INTERNAL_ASSERT(!fused_activation_backward_refusal(grad_output, saved, spec));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  at::Tensor grad_z = at::empty(grad_output.sizes(), grad_output.options().memory_format(at::MemoryFormat::ChannelsLast));
  const auto [config, timed] = config_for(spec, grad_output, saved, grad_z);
  return {config.blocks_per_sm, config.unroll, config.contiguous, timed};
}

} // namespace convbias::cuda

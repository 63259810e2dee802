// CUDA kernels of the convbias ops. forward runs the cuDNN graph chosen for the problem (fused conv+bias, with the
// activation in its epilogue where that graph builds; conv + bias add; or ATen where no graph builds).
// _forward_with_preactivation: the same, the graph writing the pre-activation too. param_grad:
// the weight gradient on a conv_wgrad graph for channels_last tensors (TORCH_CONVBIAS_PARAM_GRAD=aten forces ATen),
// the bias gradient by our kernel.
// _input_grad: ATen's convolution backward, or with choices timed (TORCH_CONVBIAS_INPUT_GRAD=timed, the default) a
// conv_dgrad graph where it measured faster (cuda/dgrad.h).
// _input_grad_activation: the input gradient times the derivative of the activation below, and its bias gradient,
// in two steps or (timed, where faster) one conv_dgrad graph with the derivative in it (cuda/dgrad_activation.h).
// _activation_backward: the activation's derivative and the bias gradient in one kernel where it applies
// (cuda/activation_backward.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>

#include "activation.h"
#include "conv_args.h"
#include "cuda/activation_backward.h"
#include "cuda/batch_parts.h"
#include "cuda/bias_activation.h"
#include "cuda/bias_grad.h"
#include "cuda/dgrad.h"
#include "cuda/dgrad_activation.h"
#include "cuda/forward_setup.h"
#include "cuda/wgrad.h"
#include "reference.h"

namespace convbias {
namespace {

// `route` (route_forward of these checked arguments) run; `out` as run_fprop takes it (the result is `out` only where
// the graph wrote it).
at::Tensor run_forward_route(
    const cuda::ForwardRoute& route, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const ConvParams& params, const ActivationSpec& spec,
    const at::Tensor& out = at::Tensor()) {
  if (route.aten_reason) {
    // nn.Conv2d's own route
    return forward_reference(input, weight, bias, params.stride, params.padding, params.dilation, params.groups, spec);
  }
  const cuda::PreparedForward& prepared = *route.prepared;
  if (route.plan->path == cuda::FpropPath::Aten) {
    return cuda::run_aten(prepared.problem, input, weight, bias, route.plan->aten_matmul); // as it was measured
  }
  // In the layout F.conv2d returns: the problem's own (channels_last, or NCHW even via channels_last copies). The
  // activation is in the graph's epilogue or applied by run_fprop after it, as the plan says.
  return cuda::run_fprop(*route.plan, prepared.problem, prepared.x, prepared.w, prepared.b, out);
}

// forward's route for checked arguments.
at::Tensor forward_routed(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& spec, const at::Tensor& out = at::Tensor()) {
  const cuda::ForwardRoute route = cuda::route_forward(input, weight, bias, params, spec);
  return run_forward_route(route, input, weight, bias, params, spec, out);
}

// A batch too large for one graph (batch_parts.h): each part routed as a call of its own, written into its slice of
// the output (directly by the graph where it can, else copied).
at::Tensor forward_in_batch_parts(
    int64_t part, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const ConvParams& params, const ActivationSpec& spec) {
  at::Tensor out = at::empty(
      output_size(input, weight, params), input.options().memory_format(output_memory_format(input, weight)));
  cuda::for_each_batch_part(input.size(0), part, [&](int64_t start, int64_t samples) {
    at::Tensor slice = out.narrow(0, start, samples);
    const at::Tensor written = forward_routed(input.narrow(0, start, samples), weight, bias, params, spec, slice);
    if (!written.is_same(slice)) {
      slice.copy_(written);
    }
  });
  return out;
}

at::Tensor forward_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] =
      check_forward_call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (const auto part = cuda::batch_part_size(input, weight, cuda::output_numel(input, weight, params))) {
    return forward_in_batch_parts(*part, input, weight, bias, params, spec);
  }
  return forward_routed(input, weight, bias, params, spec);
}

// act(conv + bias + residual): the residual's graph where its plan has one (channels_last), else forward's route for
// conv + bias, then one pass adding the residual and applying the activation (and adding the bias, where forward's
// route is ATen's convolution: it then runs without it).
at::Tensor forward_residual_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] = check_forward_residual_call(
      input, weight, bias, residual, stride, padding, dilation, groups, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cuda::ResidualRoute route = cuda::route_forward_residual(input, weight, bias, residual, params, spec);
  if (route.plan && route.plan->residual_fused) {
    const cuda::PreparedForward& p = *route.prepared;
    return cuda::run_fprop_residual(*route.plan, p.problem, p.x, p.w, p.b, route.r);
  }
  const ActivationSpec identity;
  if (const auto part = cuda::batch_part_size(input, weight, cuda::output_numel(input, weight, params))) {
    at::Tensor out = forward_in_batch_parts(*part, input, weight, bias, params, identity);
    return cuda::add_activation_(out, residual, spec);
  }
  const cuda::ForwardRoute own = cuda::route_forward(input, weight, bias, params, identity);
  if (cuda::residual_pass_adds_bias(route, own)) {
    return cuda::run_aten_then_residual(params, input, weight, *bias, residual, spec);
  }
  at::Tensor out = run_forward_route(own, input, weight, bias, params, identity);
  return cuda::add_activation_(out, residual, spec);
}

// _forward_with_preactivation's route for checked arguments.
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_routed(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& spec) {
  const cuda::ForwardRoute route = cuda::route_forward(input, weight, bias, params, spec, /*keep_preactivation=*/true);
  if (route.aten_reason || route.plan->path == cuda::FpropPath::Aten) {
    return forward_with_preactivation_reference(
        input, weight, bias, params.stride, params.padding, params.dilation, params.groups, spec);
  }
  const cuda::PreparedForward& prepared = *route.prepared;
  if (!prepared.problem.keep_preactivation) {
    // Identity, or an NCHW problem (route.activation_after): z by conv + bias's plan, the activation after it.
    at::Tensor z = cuda::run_fprop(*route.plan, prepared.problem, prepared.x, prepared.w, prepared.b);
    at::Tensor out = activation_after_preactivation(z, spec, output_memory_format(input, weight));
    return {std::move(out), std::move(z)};
  }
  auto [out, z] = cuda::run_fprop_with_preactivation(*route.plan, prepared.problem, prepared.x, prepared.w, prepared.b);
  return {std::move(out), std::move(z)};
}

// A batch too large for one graph (batch_parts.h): each part routed as a call of its own, its two outputs copied into
// their slices (the graphs writing two outputs do not take slices to write into).
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_in_batch_parts(
    int64_t part, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const ConvParams& params, const ActivationSpec& spec) {
  const auto options = input.options().memory_format(output_memory_format(input, weight));
  at::Tensor out = at::empty(output_size(input, weight, params), options);
  at::Tensor z = at::empty(output_size(input, weight, params), options);
  cuda::for_each_batch_part(input.size(0), part, [&](int64_t start, int64_t samples) {
    const auto [part_out, part_z] =
        forward_with_preactivation_routed(input.narrow(0, start, samples), weight, bias, params, spec);
    out.narrow(0, start, samples).copy_(part_out);
    z.narrow(0, start, samples).copy_(part_z);
  });
  return {std::move(out), std::move(z)};
}

// (act(z), z): channels_last problems run the plan of the graph writing both (or the graph writing z, then ATen's
// activation out of place, where that plan was chosen); NCHW ones conv + bias's own plan, then the activation; ATen
// routes ATen's convolution, then the activation.
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] =
      check_forward_call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (const auto part = cuda::batch_part_size(input, weight, cuda::output_numel(input, weight, params))) {
    return forward_with_preactivation_in_batch_parts(*part, input, weight, bias, params, spec);
  }
  return forward_with_preactivation_routed(input, weight, bias, params, spec);
}

// The weight gradient by its route: the conv_wgrad graph, or ATen's.
at::Tensor weight_grad_routed(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params) {
  const cuda::WeightGradRoute route = cuda::route_weight_grad(grad_output, input, weight, params);
  if (route.runs_graph()) {
    return cuda::run_weight_grad(route, weight);
  }
  return *std::get<0>(param_grad_reference(
      grad_output, input, weight, params.stride, params.padding, params.dilation, params.groups, {true, false}));
}

// A batch too large for one graph (batch_parts.h): each part's weight gradient by its own route, summed in FP32 for
// half-precision weights (as ATen's cuDNN convolution sums its parts), rounded once to the weight's dtype.
at::Tensor weight_grad_in_batch_parts(
    int64_t part, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    const ConvParams& params) {
  const bool half = weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kBFloat16;
  at::Tensor sum = at::zeros_like(weight, weight.options().dtype(half ? at::kFloat : weight.scalar_type()));
  cuda::for_each_batch_part(input.size(0), part, [&](int64_t start, int64_t samples) {
    sum.add_(weight_grad_routed(grad_output.narrow(0, start, samples), input.narrow(0, start, samples), weight, params));
  });
  return half ? sum.to(weight.scalar_type()) : sum;
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask) {
  const ConvParams params = check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  std::optional<at::Tensor> grad_weight, grad_bias;
  if (output_mask[0]) {
    if (const auto part = cuda::batch_part_size(input, weight, grad_output.numel())) {
      grad_weight = weight_grad_in_batch_parts(*part, grad_output, input, weight, params);
    } else {
      grad_weight = weight_grad_routed(grad_output, input, weight, params);
    }
  }
  if (output_mask[1]) {
    // Summed over N, H, W with FP32 accumulation, rounded once to the gradient's dtype.
    grad_bias = cuda::bias_grad(grad_output);
  }
  return {grad_weight, grad_bias};
}

at::Tensor input_grad_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const ConvParams params = check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return cuda::input_grad(grad_output, input, weight, params);
}

std::tuple<at::Tensor, std::optional<at::Tensor>> input_grad_activation_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  const auto [params, spec] = check_input_grad_activation_call(
      grad_output, input, weight, stride, padding, dilation, groups, saved, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return cuda::input_grad_activation(grad_output, input, weight, params, saved, spec, bias_grad);
}

std::tuple<at::Tensor, std::optional<at::Tensor>> activation_backward_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  const ActivationSpec spec = check_activation_backward_call(grad_output, saved, activation, negative_slope);
  return cuda::activation_backward(grad_output, saved, spec, bias_grad);
}

at::Tensor activation_pass_cuda(const at::Tensor& z, c10::string_view activation, double negative_slope, c10::string_view way) {
  const ActivationSpec spec = parse_activation("convbias._activation_pass", activation, negative_slope);
  TORCH_CHECK_VALUE(
      way == "graph" || way == "aten" || way == "fast" || way == "exact",
      "convbias._activation_pass: expected `way` to be 'graph', 'aten', 'fast' or 'exact', got '", std::string(way),
      "'");
  const at::MemoryFormat format = z.suggest_memory_format();
  const c10::cuda::CUDAGuard device_guard(z.device());
  if (way == "graph") {
    return cuda::activation_after_graph(z, spec, format);
  }
  if (way == "aten") {
    return activation_after_preactivation(z, spec, format);
  }
  at::Tensor out = at::empty(z.sizes(), z.options().memory_format(format));
  cuda::activation_16bit(out, z, spec, /*fast=*/way == "fast");
  return out;
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, CUDA, m) {
  m.impl("forward", &forward_cuda);
  m.impl("forward_residual", &forward_residual_cuda);
  m.impl("_forward_with_preactivation", &forward_with_preactivation_cuda);
  m.impl("param_grad", &param_grad_cuda);
  m.impl("_input_grad", &input_grad_cuda);
  m.impl("_input_grad_activation", &input_grad_activation_cuda);
  m.impl("_activation_backward", &activation_backward_cuda);
  m.impl("_bias_grad", &cuda::bias_grad_with);
  m.impl("_activation_pass", &activation_pass_cuda);
}

} // namespace convbias

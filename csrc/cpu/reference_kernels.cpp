#include "reference.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "conv_args.h"
#include "json.h"

namespace convbias {
namespace {

// ATen's CPU convolution (torch 2.14.1) segfaults on some valid problems, found by tests/test_fuzz.py; nn.Conv2d
// crashes on them too. Two kinds, each avoided without changing the result: 16-bit problems (cpu_computable, in
// reference.h), and a dilation > 1 along a kernel axis of size 1 on channels_last tensors (e.g. input 3x3x5x1,
// kernel 3x1, stride (1, 2), padding (0, 1), dilation (1, 2), with bias in float32, without in bfloat16). Along
// such an axis every dilation gives the same convolution, so 1 is passed there.
std::array<int64_t, 2> effective_dilation(const at::Tensor& weight, at::IntArrayRef dilation) {
  return {weight.size(2) == 1 ? 1 : dilation[0], weight.size(3) == 1 ? 1 : dilation[1]};
}

} // namespace

at::Tensor cpu_computable(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return t.is_cpu() && (dtype == at::kHalf || dtype == at::kBFloat16) ? t.to(at::kFloat) : t;
}

at::Tensor forward_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation) {
  const std::optional<at::Tensor> bias_computable =
      bias ? std::optional<at::Tensor>(cpu_computable(*bias)) : std::nullopt;
  at::Tensor out = at::convolution(
      cpu_computable(input), cpu_computable(weight), bias_computable, stride, padding,
      effective_dilation(weight, dilation), false, {0, 0}, groups);
  apply_activation_(out, activation);
  out = out.to(input.scalar_type());
  // ATen's backends agree on this format in the common cases; pin it so that the fake kernel can promise it.
  return with_layout(out, output_memory_format(input, weight));
}

at::Tensor forward_residual_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation) {
  const std::optional<at::Tensor> bias_computable =
      bias ? std::optional<at::Tensor>(cpu_computable(*bias)) : std::nullopt;
  at::Tensor out = at::convolution(
      cpu_computable(input), cpu_computable(weight), bias_computable, stride, padding,
      effective_dilation(weight, dilation), false, {0, 0}, groups);
  out.add_(cpu_computable(residual));
  apply_activation_(out, activation);
  out = out.to(input.scalar_type());
  return with_layout(out, output_memory_format(input, weight));
}

at::Tensor activation_after_preactivation(
    const at::Tensor& z, const ActivationSpec& activation, at::MemoryFormat format) {
  // ATen's pointwise kernels keep a channels_last input's layout; with_layout pins the exact strides.
  const at::Tensor out = activation.is_identity() ? z.clone(format) : activation_of(z, activation);
  return with_layout(out, format);
}

std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const ActivationSpec& activation) {
  at::Tensor z = forward_reference(input, weight, bias, stride, padding, dilation, groups);
  at::Tensor out = activation_after_preactivation(z, activation, output_memory_format(input, weight));
  return {std::move(out), std::move(z)};
}

namespace {

// convbias::forward on the CPU: every call runs the ATen reference.
at::Tensor forward_cpu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const ActivationSpec spec =
      check_forward_call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope).second;
  return forward_reference(input, weight, bias, stride, padding, dilation, groups, spec);
}

// convbias::forward_residual on the CPU: the ATen reference.
at::Tensor forward_residual_cpu(
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
  const ActivationSpec spec = check_forward_residual_call(
                                  input, weight, bias, residual, stride, padding, dilation, groups, activation,
                                  negative_slope)
                                  .second;
  return forward_residual_reference(input, weight, bias, residual, stride, padding, dilation, groups, spec);
}

// convbias::_forward_with_preactivation on the CPU: the ATen reference (z rounded, then the activation of it).
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_cpu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const ActivationSpec spec =
      check_forward_call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope).second;
  return forward_with_preactivation_reference(input, weight, bias, stride, padding, dilation, groups, spec);
}

} // namespace

at::Tensor bias_grad_reference(const at::Tensor& grad_output) {
  // FP32 accumulation for 16-bit types, as ATen's convolution_backward does.
  const at::ScalarType accumulate = grad_output.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::sum(grad_output, {0, 2, 3}, /*keepdim=*/false, accumulate).to(grad_output.scalar_type());
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_reference(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 2> output_mask) {
  check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  if (!output_mask[0] && !output_mask[1]) {
    return {std::nullopt, std::nullopt};
  }
  if (!output_mask[0]) {
    // The bias gradient alone: a sum (the input may be a stand-in, autograd.cpp).
    return {std::nullopt, bias_grad_reference(grad_output).to(weight.scalar_type())};
  }
  const std::vector<int64_t> bias_sizes{weight.size(0)};
  auto [unused_grad_input, grad_weight, grad_bias] = at::convolution_backward(
      cpu_computable(grad_output), cpu_computable(input), cpu_computable(weight), bias_sizes, stride, padding,
      effective_dilation(weight, dilation), /*transposed=*/false, /*output_padding=*/{0, 0}, groups,
      {false, output_mask[0], output_mask[1]});
  std::optional<at::Tensor> weight_result;
  std::optional<at::Tensor> bias_result;
  if (output_mask[0]) {
    weight_result = with_layout(grad_weight.to(weight.scalar_type()), memory_format_of(weight));
  }
  if (output_mask[1]) {
    bias_result = grad_bias.to(weight.scalar_type()).contiguous();
  }
  return {weight_result, bias_result};
}

// On the CPU every call runs the ATen reference; explain says so (after the same argument checks).
std::string explain_cpu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope,
    bool for_backward) {
  const ActivationSpec spec =
      check_forward_call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope).second;
  const bool keeps = for_backward && !spec.is_identity() && !spec.backward_from_output();
  return Json{
      {"path", "aten"},
      {"activation",
       {{"name", activation_name(spec.kind)},
        {"fused", false},
        {"keeps_preactivation", keeps},
        {"how",
         keeps ? "ATen, out of place over the pre-activation rounded to the dtype (both kept)"
               : "ATen, before the result is rounded"},
        {"why", "CPU tensors: no cuDNN graph"}}},
      {"graph_ops", Json::array()},
      {"notes", Json::array({"CPU tensors run ATen's convolution (the reference path)"})}}
      .dump();
}

std::string explain_residual_cpu(
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
  const ActivationSpec spec = check_forward_residual_call(
                                  input, weight, bias, residual, stride, padding, dilation, groups, activation,
                                  negative_slope)
                                  .second;
  return Json{
      {"path", "aten"},
      {"residual",
       {{"fused", false},
        {"bias_in_pass", false},
        {"how", "ATen: added to the convolution's output"},
        {"why", "CPU tensors: no cuDNN graph"}}},
      {"activation",
       {{"name", activation_name(spec.kind)},
        {"fused", false},
        {"how", "ATen, after the residual, before the result is rounded"},
        {"why", "CPU tensors: no cuDNN graph"}}},
      {"graph_ops", Json::array()},
      {"notes", Json::array({"CPU tensors run ATen's convolution (the reference path)"})}}
      .dump();
}

at::Tensor input_grad_reference(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const at::Tensor grad_input = std::get<0>(at::convolution_backward(
      cpu_computable(grad_output), cpu_computable(input), cpu_computable(weight), std::nullopt, stride, padding,
      effective_dilation(weight, dilation), /*transposed=*/false, /*output_padding=*/{0, 0}, groups,
      {true, false, false}));
  // The layout ATen's backends give it (and the fake kernel says): F.conv2d's output rule, input and weight.
  return with_layout(grad_input.to(input.scalar_type()), output_memory_format(input, weight));
}

std::string explain_param_grad_cpu(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const std::string why = "CPU tensors run ATen's convolution backward (the reference path)";
  return Json{
      {"weight_grad", {{"path", "aten"}, {"notes", Json::array({why})}}},
      {"bias_grad", {{"way", "aten"}, {"notes", Json::array({why})}}},
      {"input_grad", {{"path", "aten"}, {"notes", Json::array({why})}}}}
      .dump();
}

TORCH_LIBRARY_IMPL(convbias, CPU, m) {
  m.impl("forward", &forward_cpu);
  m.impl("forward_residual", &forward_residual_cpu);
  m.impl("_forward_with_preactivation", &forward_with_preactivation_cpu);
  m.impl("param_grad", &param_grad_reference);
  m.impl("_input_grad", &input_grad_reference);
  m.impl("_explain", &explain_cpu);
  m.impl("_explain_residual", &explain_residual_cpu);
  m.impl("_explain_param_grad", &explain_param_grad_cpu);
}

} // namespace convbias

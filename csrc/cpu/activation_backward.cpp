// convbias::_activation_backward on the CPU: ATen's pointwise backward, then the sum of what it wrote with FP32
// accumulation (FP64 for double), rounded once - the semantics the fused CUDA kernel reproduces in one pass - and
// its explain; convbias::_input_grad_activation, the input gradient followed by it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation.h"
#include "conv_args.h"
#include "json.h"
#include "reference.h"

namespace convbias {
namespace {

std::tuple<at::Tensor, std::optional<at::Tensor>> activation_backward_cpu(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  const ActivationSpec spec = check_activation_backward_call(grad_output, saved, activation, negative_slope);
  at::Tensor grad_z = at::empty(
      grad_output.sizes(), grad_output.options().memory_format(activation_grad_memory_format(grad_output, saved)));
  activation_backward_out(grad_z, grad_output, saved, spec);
  std::optional<at::Tensor> grad_bias;
  if (bias_grad) {
    grad_bias = bias_grad_reference(grad_z);
  }
  return {std::move(grad_z), std::move(grad_bias)};
}

std::string explain_activation_backward_cpu(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  const ActivationSpec spec = check_activation_backward_call(grad_output, saved, activation, negative_slope);
  const std::string why = "CPU tensors run ATen (the reference path)";
  return Json{
      {"activation", activation_name(spec.kind)},
      {"derivative_from", derivative_source_name(spec)},
      {"way", "aten"},
      {"notes", Json::array({why})},
      {"bias_grad",
       bias_grad ? Json{{"way", "aten"}, {"notes", Json::array({why})}}
                 : Json{{"way", "none"}, {"notes", Json::array({"no bias gradient asked for"})}}}}
      .dump();
}

// The two steps it stands for: the input gradient (input_grad_reference), then the activation's backward above.
std::tuple<at::Tensor, std::optional<at::Tensor>> input_grad_activation_cpu(
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
  (void)check_input_grad_activation_call(
      grad_output, input, weight, stride, padding, dilation, groups, saved, activation, negative_slope);
  const at::Tensor grad_input = input_grad_reference(grad_output, input, weight, stride, padding, dilation, groups);
  return activation_backward_cpu(grad_input, saved, activation, negative_slope, bias_grad);
}

std::string explain_input_grad_activation_cpu(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] = check_input_grad_activation_call(
      grad_output, input, weight, stride, padding, dilation, groups, saved, activation, negative_slope);
  (void)params;
  return Json{
      {"path", "separate"},
      {"activation", activation_name(spec.kind)},
      {"derivative_from", derivative_source_name(spec)},
      {"notes", Json::array({"CPU tensors run ATen (the reference path): the input gradient, then the activation's backward"})}}
      .dump();
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, CPU, m) {
  m.impl("_activation_backward", &activation_backward_cpu);
  m.impl("_explain_activation_backward", &explain_activation_backward_cpu);
  m.impl("_input_grad_activation", &input_grad_activation_cpu);
  m.impl("_explain_input_grad_activation", &explain_input_grad_activation_cpu);
}

} // namespace convbias

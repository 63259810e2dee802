// convbias::_activation_backward on the CPU: ATen's pointwise backward, then the sum of what it wrote with FP32
// accumulation (FP64 for double), rounded once - the semantics the fused CUDA kernel reproduces in one pass - and
// its explain.
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

} // namespace

TORCH_LIBRARY_IMPL(convbias, CPU, m) {
  m.impl("_activation_backward", &activation_backward_cpu);
  m.impl("_explain_activation_backward", &explain_activation_backward_cpu);
}

} // namespace convbias

#include "reference.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include "conv_args.h"
#include "json.h"

namespace convbias {

at::Tensor forward_reference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  at::Tensor out = at::convolution(input, weight, bias, stride, padding, dilation, false, {0, 0}, groups);
  // ATen's backends agree on this format in the common cases; pin it so that the fake kernel can promise it.
  return out.contiguous(output_memory_format(input, weight));
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
  const std::vector<int64_t> bias_sizes{weight.size(0)};
  auto [unused_grad_input, grad_weight, grad_bias] = at::convolution_backward(
      grad_output, input, weight, bias_sizes, stride, padding, dilation, /*transposed=*/false,
      /*output_padding=*/{0, 0}, groups, {false, output_mask[0], output_mask[1]});
  std::optional<at::Tensor> weight_result;
  std::optional<at::Tensor> bias_result;
  if (output_mask[0]) {
    weight_result = grad_weight.contiguous(is_channels_last(weight) ? at::MemoryFormat::ChannelsLast
                                                                    : at::MemoryFormat::Contiguous);
  }
  if (output_mask[1]) {
    bias_result = grad_bias.contiguous();
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
    int64_t groups) {
  check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  return JsonObject().str("path", "aten").strings("notes", {"CPU tensors run ATen's convolution (the reference path)"}).dump();
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
  return JsonObject()
      .raw("weight_grad", JsonObject().str("path", "aten").strings("notes", {why}).dump())
      .raw("bias_grad", JsonObject().str("way", "aten").strings("notes", {why}).dump())
      .dump();
}

TORCH_LIBRARY_IMPL(convbias, CPU, m) {
  m.impl("forward", &forward_reference);
  m.impl("param_grad", &param_grad_reference);
  m.impl("_explain", &explain_cpu);
  m.impl("_explain_param_grad", &explain_param_grad_cpu);
}

} // namespace convbias

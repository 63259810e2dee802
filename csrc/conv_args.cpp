#include "conv_args.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/strides.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace convbias {
namespace {

// Python's spelling of a dtype ("torch.float32"), so that the messages read the same from C++ and Python.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_rank4(const char* op, const char* name, const char* layout, const at::Tensor& t) {
  TORCH_CHECK_VALUE(
      t.dim() == 4, op, ": expected `", name, "` to be a 4-D tensor ", layout, ", got a ", t.dim(),
      "-D tensor of shape ", t.sizes());
}

void check_like_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == input.scalar_type(), op, ": expected `", name, "` to have the dtype of `input` (",
      dtype_name(input.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(
      t.device() == input.device(), op, ": expected `", name, "` on the device of `input` (", input.device(),
      "), got ", t.device());
}

void check_pair(const char* op, const char* name, at::IntArrayRef v, int64_t lowest, const char* what) {
  TORCH_CHECK_VALUE(v.size() == 2, op, ": expected `", name, "` to have 2 elements (height, width), got ", v.size());
  TORCH_CHECK_VALUE(
      v[0] >= lowest && v[1] >= lowest, op, ": expected every `", name, "` element to be ", what, ", got ", v);
}

ConvParams check_conv_args(
    const char* op,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  check_rank4(op, "input", "(N, C, H, W)", input);
  check_rank4(op, "weight", "(out_channels, in_channels / groups, kH, kW)", weight);
  TORCH_CHECK_TYPE(
      is_supported_float(input.scalar_type()), op,
      ": expected `input` to have a floating-point dtype (torch.float16, torch.bfloat16, torch.float32 or "
      "torch.float64), got ",
      dtype_name(input.scalar_type()));
  check_like_input(op, "weight", weight, input);
  check_pair(op, "stride", stride, 1, "positive");
  check_pair(op, "padding", padding, 0, "non-negative");
  check_pair(op, "dilation", dilation, 1, "positive");
  TORCH_CHECK_VALUE(groups > 0, op, ": expected `groups` to be positive, got ", groups);

  const int64_t channels = input.size(1);
  const int64_t out_channels = weight.size(0);
  TORCH_CHECK_VALUE(
      channels % groups == 0, op, ": expected `groups` (", groups, ") to divide the input channels (", channels,
      ")");
  TORCH_CHECK_VALUE(
      out_channels % groups == 0, op, ": expected `groups` (", groups,
      ") to divide the output channels weight.size(0) (", out_channels, ")");
  TORCH_CHECK_VALUE(
      weight.size(1) * groups == channels, op, ": expected `weight`.size(1) to be input channels / groups = ",
      channels, " / ", groups, " = ", channels / groups, ", got ", weight.size(1), " (weight shape ",
      weight.sizes(), ")");
  TORCH_CHECK_VALUE(
      weight.size(2) > 0 && weight.size(3) > 0, op, ": expected `weight` to have a non-empty kernel, got shape ",
      weight.sizes());

  for (int d = 0; d < 2; ++d) {
    const int64_t padded = input.size(2 + d) + 2 * padding[d];
    const int64_t dilated_kernel = dilation[d] * (weight.size(2 + d) - 1) + 1;
    TORCH_CHECK_VALUE(
        dilated_kernel <= padded, op, ": the kernel of `weight` (", weight.size(2), "x", weight.size(3),
        ", dilation ", dilation, ") spans ", dilated_kernel, " along ", d == 0 ? "H" : "W",
        ", more than the padded input (", input.size(2 + d), " + 2 * ", padding[d], " = ", padded, ")");
  }
  return ConvParams{{stride[0], stride[1]}, {padding[0], padding[1]}, {dilation[0], dilation[1]}, groups};
}

} // namespace

ConvParams check_forward_args(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  constexpr const char* op = "convbias.forward";
  ConvParams params = check_conv_args(op, input, weight, stride, padding, dilation, groups);
  if (bias.has_value() && bias->defined()) {
    check_like_input(op, "bias", *bias, input);
    TORCH_CHECK_VALUE(
        bias->dim() == 1 && bias->size(0) == weight.size(0), op, ": expected `bias` of shape [", weight.size(0),
        "] (out_channels = weight.size(0)), got shape ", bias->sizes());
  }
  return params;
}

std::pair<ConvParams, ActivationSpec> check_forward_call(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  ConvParams params = check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  return {params, parse_activation("convbias.forward", activation, negative_slope)};
}

std::pair<ConvParams, ActivationSpec> check_forward_residual_call(
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
  constexpr const char* op = "convbias.forward_residual";
  ConvParams params = check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  check_like_input(op, "residual", residual, input);
  const auto expected = output_size(input, weight, params);
  TORCH_CHECK_VALUE(
      residual.sizes() == at::IntArrayRef(expected), op, ": expected `residual` of shape ", at::IntArrayRef(expected),
      " (the convolution's output shape), got ", residual.sizes());
  return {params, parse_activation(op, activation, negative_slope)};
}

ConvParams check_param_grad_args(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  constexpr const char* op = "convbias.param_grad";
  ConvParams params = check_conv_args(op, input, weight, stride, padding, dilation, groups);
  check_like_input(op, "grad_output", grad_output, input);
  const auto expected = output_size(input, weight, params);
  TORCH_CHECK_VALUE(
      grad_output.sizes() == at::IntArrayRef(expected), op, ": expected `grad_output` of shape ",
      at::IntArrayRef(expected), " (the forward's output shape), got ", grad_output.sizes());
  return params;
}

ActivationSpec check_activation_backward_call(
    const at::Tensor& grad_output, const at::Tensor& saved, c10::string_view activation, double negative_slope) {
  constexpr const char* op = "convbias._activation_backward";
  check_rank4(op, "grad_output", "(N, K, H, W)", grad_output);
  TORCH_CHECK_TYPE(
      is_supported_float(grad_output.scalar_type()), op,
      ": expected `grad_output` to have a floating-point dtype (torch.float16, torch.bfloat16, torch.float32 or "
      "torch.float64), got ",
      dtype_name(grad_output.scalar_type()));
  TORCH_CHECK_TYPE(
      saved.scalar_type() == grad_output.scalar_type(), op, ": expected `saved` to have the dtype of `grad_output` (",
      dtype_name(grad_output.scalar_type()), "), got ", dtype_name(saved.scalar_type()));
  TORCH_CHECK_VALUE(
      saved.device() == grad_output.device(), op, ": expected `saved` on the device of `grad_output` (",
      grad_output.device(), "), got ", saved.device());
  TORCH_CHECK_VALUE(
      saved.sizes() == grad_output.sizes(), op, ": expected `saved` of the shape of `grad_output` (",
      grad_output.sizes(), "), got ", saved.sizes());
  return parse_activation(op, activation, negative_slope);
}

std::pair<ConvParams, ActivationSpec> check_input_grad_activation_call(
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
  constexpr const char* op = "convbias._input_grad_activation";
  const ConvParams params = check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  TORCH_CHECK_TYPE(
      saved.scalar_type() == input.scalar_type(), op, ": expected `saved` to have the dtype of `input` (",
      dtype_name(input.scalar_type()), "), got ", dtype_name(saved.scalar_type()));
  TORCH_CHECK_VALUE(
      saved.device() == input.device(), op, ": expected `saved` on the device of `input` (", input.device(), "), got ",
      saved.device());
  TORCH_CHECK_VALUE(
      saved.sizes() == input.sizes(), op, ": expected `saved` of the shape of `input` (", input.sizes(), "), got ",
      saved.sizes());
  return {params, parse_activation(op, activation, negative_slope)};
}

std::array<int64_t, 4> output_size(const at::Tensor& input, const at::Tensor& weight, const ConvParams& p) {
  std::array<int64_t, 4> out{input.size(0), weight.size(0), 0, 0};
  for (int d = 0; d < 2; ++d) {
    const int64_t dilated_kernel = p.dilation[d] * (weight.size(2 + d) - 1) + 1;
    out[2 + d] = (input.size(2 + d) + 2 * p.padding[d] - dilated_kernel) / p.stride[d] + 1;
  }
  return out;
}

at::MemoryFormat memory_format_of(const at::Tensor& t) {
  return t.dim() == 4 ? t.suggest_memory_format() : at::MemoryFormat::Contiguous;
}

at::MemoryFormat output_memory_format(const at::Tensor& input, const at::Tensor& weight) {
  if (input.is_cuda() && (input.scalar_type() == at::kDouble || !at::globalContext().userEnabledCuDNN())) {
    return at::MemoryFormat::Contiguous;
  }
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  return memory_format_of(input) == cl || memory_format_of(weight) == cl ? cl : at::MemoryFormat::Contiguous;
}

at::Tensor with_layout(const at::Tensor& t, at::MemoryFormat format) {
  const bool channels_last = format == at::MemoryFormat::ChannelsLast && t.dim() == 4;
  const c10::DimVector strides =
      channels_last ? c10::DimVector(c10::get_channels_last_strides_2d(t.sizes())) : c10::contiguous_strides(t.sizes());
  if (t.strides() == at::IntArrayRef(strides)) {
    return t;
  }
  return at::empty(t.sizes(), t.options().memory_format(format)).copy_(t);
}

} // namespace convbias

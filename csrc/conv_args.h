// Argument checking shared by every kernel of the convbias ops (CPU reference and CUDA).
//
// The Python fake kernels (torch_convbias/_validation.py) check the same things with the same messages, so
// that eager calls, torch.compile tracing and meta tensors all reject bad input the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <utility>

#include "activation.h"

namespace convbias {

// Convolution hyper-parameters after validation, in (height, width) order.
struct ConvParams {
  std::array<int64_t, 2> stride;
  std::array<int64_t, 2> padding;
  std::array<int64_t, 2> dilation;
  int64_t groups;
};

// Checks `input`, `weight`, `bias` and the conv parameters of convbias::forward; throws ValueError/TypeError
// (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE) naming the argument on any violation.
ConvParams check_forward_args(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

// check_forward_args, then the activation's (parse_activation): what every kernel of convbias::forward (and its
// explain) starts with.
std::pair<ConvParams, ActivationSpec> check_forward_call(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope);

// check_forward_call, then `residual` (convbias::forward_residual): the input's dtype and device, the convolution's
// output shape.
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
    double negative_slope);

// Checks the arguments of convbias::param_grad: the forward's checks on (input, weight) plus a grad_output of
// the forward's output shape, dtype and device.
ConvParams check_param_grad_args(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

// Checks the arguments of convbias::_activation_backward: a 4-D floating-point grad_output, `saved` of its shape,
// dtype and device, then the activation (parse_activation). Returns the activation.
ActivationSpec check_activation_backward_call(
    const at::Tensor& grad_output, const at::Tensor& saved, c10::string_view activation, double negative_slope);

// Checks the arguments of convbias::_input_grad_activation: param_grad's for grad_output, input, weight and the conv
// parameters, then `saved` of input's shape, dtype and device, then the activation. Returns both.
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
    double negative_slope);

// (N, K, H_out, W_out) of the convolution; arguments must have passed check_forward_args.
std::array<int64_t, 4> output_size(const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

// PyTorch's own reading of a 4-D tensor's layout (Tensor::suggest_memory_format): channels_last when its strides
// are those of channels_last, also where the tensor is contiguous as well (a [K, C, 1, 1] weight with strides
// (C, 1, C, C)); ambiguous strides count as contiguous.
at::MemoryFormat memory_format_of(const at::Tensor& t);

// The memory format F.conv2d gives its output, by ATen's rule (aten/src/ATen/native/ConvUtils.h): channels_last when
// the input or the weight suggests channels_last, except on CUDA for float64 (cuDNN never runs NHWC in double) and
// with torch.backends.cudnn.enabled False (ATen's CUDA kernels without cuDNN write NCHW).
at::MemoryFormat output_memory_format(const at::Tensor& input, const at::Tensor& weight);

// `t` when its strides are those of a new tensor of its sizes in `format`, else a copy with them: the exact strides
// ATen's kernels give their outputs, so that layouts read by suggest_memory_format downstream agree.
at::Tensor with_layout(const at::Tensor& t, at::MemoryFormat format);

} // namespace convbias

// Argument checking shared by every kernel of the convbias ops (CPU reference and CUDA).
//
// The Python fake kernels (torch_convbias/_validation.py) check the same things with the same messages, so
// that eager calls, torch.compile tracing and meta tensors all reject bad input the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>

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

// (N, K, H_out, W_out) of the convolution; arguments must have passed check_forward_args.
std::array<int64_t, 4> output_size(const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

// True when `t` is laid out channels_last and not also plainly contiguous (which a tensor with H = W = 1 is).
bool is_channels_last(const at::Tensor& t);

// The memory format F.conv2d gives its output: channels_last when the input or the weight is channels_last.
at::MemoryFormat output_memory_format(const at::Tensor& input, const at::Tensor& weight);

} // namespace convbias

// The activation applied to conv + bias by convbias::forward (its `activation` argument): parsing and checking the
// name, applying it, and its derivative for the backward. Shared by the CPU and CUDA kernels and the autograd.
//
// What the backward keeps (the cheapest tensor the derivative can be computed from), for an output of
// N*K*H*W elements of s bytes (s = 2 in fp16/bf16, 4 in fp32, 8 in fp64), beyond the input (kept only when the
// weight needs a gradient) and the weight:
//   identity               nothing                                   0 bytes
//   relu, sigmoid, tanh    the output                                0 extra bytes: it is the tensor the layer
//                                                                    returns, which the next layer keeps anyway when
//                                                                    its own weight needs a gradient (else N*K*H*W*s)
//   leaky_relu             the output when negative_slope >= 0 (its sign is the input's), as relu; else the
//                          pre-activation                            N*K*H*W*s
//   gelu, gelu_tanh, silu  the pre-activation                        N*K*H*W*s (written by the forward itself:
//                                                                    convbias::_forward_with_preactivation, on CUDA
//                                                                    the same cuDNN graph as the output)
// The backward then allocates the gradient at the pre-activation, dz (N*K*H*W*s, written once by
// convbias::_activation_backward together with the bias gradient), plus a few KiB of FP32 partial sums; the weight and
// input gradients are taken of dz. (A 1-bit mask for relu, N*K*H*W/8 bytes, would be cheaper only where nothing
// else keeps the output; not built.)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <string>

namespace convbias {

enum class Activation { Identity, Relu, LeakyRelu, Gelu, GeluTanh, Silu, Sigmoid, Tanh };

struct ActivationSpec {
  Activation kind = Activation::Identity;
  double negative_slope = 0.01; // leaky_relu's, ignored by the others

  bool is_identity() const { return kind == Activation::Identity; }
  // Whether the backward computes the derivative from the output (else from the pre-activation).
  bool backward_from_output() const;
};

// The supported names, for messages: "identity, relu, leaky_relu, gelu, gelu_tanh, silu, sigmoid, tanh".
std::string supported_activations();

// `name` and `negative_slope` checked: ValueError naming the argument (an unknown name lists the supported ones; the
// slope must be finite). `op` names the operator in the message.
ActivationSpec parse_activation(const char* op, c10::string_view name, double negative_slope);

const char* activation_name(Activation kind);

// What the derivative is computed from, for explain: "output", "pre-activation" or "nothing" (identity).
const char* derivative_source_name(const ActivationSpec& activation);

// y = act(y), in place; returns y.
at::Tensor& apply_activation_(at::Tensor& y, const ActivationSpec& activation);

// act(z), a new tensor (z itself for identity).
at::Tensor activation_of(const at::Tensor& z, const ActivationSpec& activation);

// grad_output * act'(z), from `saved`: the output or the pre-activation z, as backward_from_output() says.
at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

// activation_backward written into `grad_z` (a tensor of grad_output's shape, dtype and device, in whatever layout):
// ATen's pointwise backward kernels (threshold_backward, leaky_relu_backward, gelu_backward, silu_backward,
// sigmoid_backward, tanh_backward), or a copy for identity.
void activation_backward_out(
    at::Tensor& grad_z, const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

// The layout convbias::_activation_backward gives grad_z: channels_last when grad_output or saved suggests
// channels_last, else contiguous. Normally both have the forward output's layout; grad_output of a reduction
// (out.sum().backward()) is an expanded tensor with no layout of its own, and then saved's layout keeps the weight
// gradient on the channels_last path. torch_convbias/ops.py's fake kernel follows the same rule.
at::MemoryFormat activation_grad_memory_format(const at::Tensor& grad_output, const at::Tensor& saved);

} // namespace convbias

// The activation applied to conv + bias by convbias::forward (its `activation` argument): parsing and checking the
// name, applying it, and its derivative for the backward. Shared by the CPU and CUDA kernels and the autograd.
//
// What the backward keeps (the cheapest tensor the derivative can be computed from):
//   identity               nothing
//   relu, sigmoid, tanh    the output
//   leaky_relu             the output when negative_slope >= 0 (its sign is the input's), else the pre-activation
//   gelu, gelu_tanh, silu  the pre-activation
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

// y = act(y), in place; returns y.
at::Tensor& apply_activation_(at::Tensor& y, const ActivationSpec& activation);

// act(z), a new tensor (z itself for identity).
at::Tensor activation_of(const at::Tensor& z, const ActivationSpec& activation);

// grad_output * act'(z), from `saved`: the output or the pre-activation z, as backward_from_output() says.
at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

} // namespace convbias

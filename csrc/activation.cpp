#include "activation.h"

#include "conv_args.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <utility>

namespace convbias {
namespace {

constexpr std::array<std::pair<Activation, const char*>, 8> kNames = {{
    {Activation::Identity, "identity"},
    {Activation::Relu, "relu"},
    {Activation::LeakyRelu, "leaky_relu"},
    {Activation::Gelu, "gelu"},
    {Activation::GeluTanh, "gelu_tanh"},
    {Activation::Silu, "silu"},
    {Activation::Sigmoid, "sigmoid"},
    {Activation::Tanh, "tanh"},
}};

} // namespace

bool ActivationSpec::backward_from_output() const {
  switch (kind) {
    case Activation::Relu:
    case Activation::Sigmoid:
    case Activation::Tanh:
      return true;
    case Activation::LeakyRelu:
      return negative_slope >= 0;
    default:
      return false;
  }
}

std::string supported_activations() {
  std::string names;
  for (const auto& [kind, name] : kNames) {
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  return names;
}

const char* activation_name(Activation kind) {
  for (const auto& [k, name] : kNames) {
    if (k == kind) {
      return name;
    }
  }
  return "?";
}

const char* derivative_source_name(const ActivationSpec& a) {
  return a.is_identity() ? "nothing" : a.backward_from_output() ? "output" : "pre-activation";
}

ActivationSpec parse_activation(const char* op, c10::string_view name, double negative_slope) {
  ActivationSpec spec;
  bool known = false;
  for (const auto& [kind, known_name] : kNames) {
    if (name == known_name) {
      spec.kind = kind;
      known = true;
    }
  }
  TORCH_CHECK_VALUE(
      known, op, ": expected `activation` to be one of ", supported_activations(), ", got '", std::string(name), "'");
  TORCH_CHECK_VALUE(
      std::isfinite(negative_slope), op, ": expected `negative_slope` to be a finite number, got ", negative_slope);
  spec.negative_slope = negative_slope;
  return spec;
}

at::Tensor& apply_activation_(at::Tensor& y, const ActivationSpec& a) {
  switch (a.kind) {
    case Activation::Identity: return y;
    case Activation::Relu: return at::relu_(y);
    case Activation::LeakyRelu: return at::leaky_relu_(y, a.negative_slope);
    case Activation::Gelu: return at::gelu_(y, "none");
    case Activation::GeluTanh: return at::gelu_(y, "tanh");
    case Activation::Silu: return at::silu_(y);
    case Activation::Sigmoid: return at::sigmoid_(y);
    case Activation::Tanh: return at::tanh_(y);
  }
  return y;
}

at::Tensor activation_of(const at::Tensor& z, const ActivationSpec& a) {
  switch (a.kind) {
    case Activation::Identity: return z;
    case Activation::Relu: return at::relu(z);
    case Activation::LeakyRelu: return at::leaky_relu(z, a.negative_slope);
    case Activation::Gelu: return at::gelu(z, "none");
    case Activation::GeluTanh: return at::gelu(z, "tanh");
    case Activation::Silu: return at::silu(z);
    case Activation::Sigmoid: return at::sigmoid(z);
    case Activation::Tanh: return at::tanh(z);
  }
  return z;
}

at::Tensor activation_backward(const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& a) {
  switch (a.kind) {
    case Activation::Identity: return grad_output;
    case Activation::Relu: return at::threshold_backward(grad_output, saved, 0);
    case Activation::LeakyRelu:
      return at::leaky_relu_backward(grad_output, saved, a.negative_slope, /*self_is_result=*/a.backward_from_output());
    case Activation::Gelu: return at::gelu_backward(grad_output, saved, "none");
    case Activation::GeluTanh: return at::gelu_backward(grad_output, saved, "tanh");
    case Activation::Silu: return at::silu_backward(grad_output, saved);
    case Activation::Sigmoid: return at::sigmoid_backward(grad_output, saved);
    case Activation::Tanh: return at::tanh_backward(grad_output, saved);
  }
  return grad_output;
}

void activation_backward_out(
    at::Tensor& grad_z, const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& a) {
  switch (a.kind) {
    case Activation::Identity: grad_z.copy_(grad_output); return;
    case Activation::Relu: at::threshold_backward_out(grad_z, grad_output, saved, 0); return;
    case Activation::LeakyRelu:
      at::leaky_relu_backward_out(grad_z, grad_output, saved, a.negative_slope, a.backward_from_output());
      return;
    case Activation::Gelu: at::gelu_backward_out(grad_z, grad_output, saved, "none"); return;
    case Activation::GeluTanh: at::gelu_backward_out(grad_z, grad_output, saved, "tanh"); return;
    case Activation::Silu: at::silu_backward_out(grad_z, grad_output, saved); return;
    case Activation::Sigmoid: at::sigmoid_backward_out(grad_z, grad_output, saved); return;
    case Activation::Tanh: at::tanh_backward_out(grad_z, grad_output, saved); return;
  }
}

at::MemoryFormat activation_grad_memory_format(const at::Tensor& grad_output, const at::Tensor& saved) {
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  return memory_format_of(grad_output) == cl || memory_format_of(saved) == cl ? cl : at::MemoryFormat::Contiguous;
}

} // namespace convbias

// Autograd of the convbias ops, in C++ so that no call pays for Python:
// - forward: the weight and bias gradients come from convbias::param_grad in one call, the input gradient
//   (ATen's convolution backward) only when the input requires grad, which it never does in layer-by-layer
//   training where inputs are detached. An activation whose derivative needs the pre-activation runs
//   convbias::_forward_with_preactivation (both tensors from one call) and keeps the pre-activation. With an
//   activation, convbias::_activation_backward first gives the gradient at the convolution's output (dz) and, in the
//   same pass, the bias gradient; param_grad then computes the weight gradient of dz alone;
// - forward_residual: as forward, the residual's gradient being the gradient at the sum (ForwardResidualFunction);
// - param_grad and _activation_backward: not differentiable; when their inputs require grad (create_graph=True
//   through forward) their outputs get a backward that raises NotImplementedError, rather than silently wrong
//   second-order gradients.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "activation.h"
#include "conv_args.h"
#include "convbias.h"
#include "reference.h"

namespace convbias {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The input gradient: convbias::_input_grad (ATen's convolution backward, or on CUDA a cuDNN conv_dgrad graph where
// one measured faster: cuda/dgrad.h). With create_graph=True (grad mode on in the backward, a tensor recording
// history) ATen's differentiable convolution backward directly, so that second-order gradients through the input
// gradient keep working. On the CPU 16-bit problems run in float32, rounded once (cpu_computable in reference.h).
at::Tensor input_gradient(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    const c10::SymInt& groups) {
  const bool records = c10::GradMode::is_enabled() && (grad_output.requires_grad() || weight.requires_grad());
  if (!records) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("convbias::_input_grad", "")
                               .typed<at::Tensor(
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                                   c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymInt)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd; // no autograd kernel: nothing to record
    return op.call(grad_output, input, weight, stride, padding, dilation, groups);
  }
  const at::Tensor grad_input = std::get<0>(at::convolution_backward_symint(
      cpu_computable(grad_output), cpu_computable(input), cpu_computable(weight), std::nullopt, stride, padding,
      dilation, /*transposed=*/false, c10::SymIntArrayRef({c10::SymInt(0), c10::SymInt(0)}), groups,
      {true, false, false}));
  return grad_input.to(input.scalar_type());
}

// A tensor of `input`'s shape, dtype and device over a single uninitialised element (stride 0): what param_grad needs
// of the input when only the bias gradient is asked for (its checks read shapes; no kernel reads the data, so no fill
// kernel is launched for it).
at::Tensor input_stand_in(const at::Tensor& input) {
  return at::empty({}, input.options()).expand_symint(input.sym_sizes());
}

using ActivationBackwardResult = std::tuple<at::Tensor, std::optional<at::Tensor>>;

// convbias::_activation_backward through the dispatcher (its autograd, then the device's kernel).
ActivationBackwardResult activation_backward_call(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("convbias::_activation_backward", "")
                             .typed<ActivationBackwardResult(
                                 const at::Tensor&, const at::Tensor&, c10::string_view, double, bool)>();
  return op.call(grad_output, saved, activation, negative_slope, bias_grad);
}

// convbias::_forward_with_preactivation through the dispatcher (below autograd: it has no autograd kernel):
// (act(z), z) in one call, on CUDA one cuDNN graph writing both.
std::tuple<at::Tensor, at::Tensor> forward_with_preactivation_call(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    const c10::SymInt& groups,
    c10::string_view activation,
    double negative_slope) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("convbias::_forward_with_preactivation", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymInt,
                                 c10::string_view, double)>();
  return op.call(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
}

// What conv_backward reads back: the conv parameters, whether there is a bias, the activation.
void save_conv_args(
    AutogradContext* ctx, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    const c10::SymInt& groups, bool has_bias, c10::string_view activation, double negative_slope) {
  ctx->saved_data["stride"] = stride;
  ctx->saved_data["padding"] = padding;
  ctx->saved_data["dilation"] = dilation;
  ctx->saved_data["groups"] = groups;
  ctx->saved_data["has_bias"] = has_bias;
  ctx->saved_data["activation"] = std::string(activation);
  ctx->saved_data["negative_slope"] = negative_slope;
}

// The gradients of act(conv + bias [+ residual]) for the forward saved in `ctx` (input or its stand-in, weight, what
// the activation's derivative needs; the conv parameters and the activation in saved_data): z, the gradient at the
// sum, by _activation_backward (the bias gradient in the same pass), then the input gradient of z when needed and
// the weight (and, where not done yet, bias) gradient by param_grad.
struct ConvGrads {
  at::Tensor input, weight, bias, z;
};

ConvGrads conv_backward(
    AutogradContext* ctx, at::Tensor grad_output, bool needs_input, bool needs_weight, bool needs_bias) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& input = saved[0];
  const at::Tensor& weight = saved[1];
  const std::string& activation = ctx->saved_data["activation"].toStringRef();
  const double negative_slope = ctx->saved_data["negative_slope"].toDouble();
  const ActivationSpec spec = parse_activation("convbias.forward", activation, negative_slope);
  const auto stride = ctx->saved_data["stride"].toSymIntVector();
  const auto padding = ctx->saved_data["padding"].toSymIntVector();
  const auto dilation = ctx->saved_data["dilation"].toSymIntVector();
  const c10::SymInt groups = ctx->saved_data["groups"].toSymInt();

  ConvGrads g;
  g.z = std::move(grad_output);
  bool bias_done = false;
  if (!spec.is_identity()) {
    auto [grad_z, fused_grad_bias] = activation_backward_call(g.z, saved[2], activation, negative_slope, needs_bias);
    g.z = std::move(grad_z);
    if (fused_grad_bias.has_value()) {
      g.bias = std::move(*fused_grad_bias);
      bias_done = true;
    }
  }
  if (needs_input) {
    g.input = input_gradient(g.z, input, weight, stride, padding, dilation, groups);
  }
  const bool param_bias = needs_bias && !bias_done;
  if (needs_weight || param_bias) {
    // Through the dispatcher: with create_graph=True param_grad's autograd marks the results as not differentiable
    // further; otherwise it goes straight to the kernel.
    auto [w, b] = param_grad_symint(g.z, input, weight, stride, padding, dilation, groups, {needs_weight, param_bias});
    g.weight = w.value_or(at::Tensor());
    if (param_bias) {
      g.bias = b.value_or(at::Tensor());
    }
  }
  return g;
}

class ForwardFunction : public torch::autograd::Function<ForwardFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias,
      c10::SymIntArrayRef stride,
      c10::SymIntArrayRef padding,
      c10::SymIntArrayRef dilation,
      const c10::SymInt& groups,
      c10::string_view activation,
      double negative_slope) {
    const ActivationSpec spec = parse_activation("convbias.forward", activation, negative_slope);
    save_conv_args(ctx, stride, padding, dilation, groups, bias.has_value() && bias->defined(), activation, negative_slope);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor output;
    at::Tensor for_derivative; // what the activation's derivative is computed from (activation.h)
    if (spec.is_identity() || spec.backward_from_output()) {
      output = forward_symint(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
      for_derivative = spec.is_identity() ? at::Tensor() : output;
    } else {
      // The derivative needs the pre-activation z = conv + bias: one call returns act(z) and z (on CUDA channels_last
      // one cuDNN graph writing both).
      std::tie(output, for_derivative) = forward_with_preactivation_call(
          input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
    }
    // The input is needed for the weight gradient only: a frozen weight's layer keeps no activation alive. Without
    // it, param_grad (bias gradient alone) gets a stand-in of the input's shape that owns one element.
    ctx->save_for_backward({weight.requires_grad() ? input : input_stand_in(input), weight, for_derivative});
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // needs_input_grad indexes the tensor inputs that were given: input, weight, then bias if any.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const ConvGrads g = conv_backward(
        ctx, grad_outputs[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2));
    // One entry per forward argument; the conv parameters and the activation get none.
    return {g.input, g.weight, g.bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// forward_residual: act(conv + bias + residual). The residual's gradient is the gradient at the sum, dz, which the
// parameter and input gradients are taken of too. An activation whose derivative needs the pre-activation runs the
// op without it (z = conv + bias + residual, kept) and ATen's activation out of place after it.
class ForwardResidualFunction : public torch::autograd::Function<ForwardResidualFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias,
      const at::Tensor& residual,
      c10::SymIntArrayRef stride,
      c10::SymIntArrayRef padding,
      c10::SymIntArrayRef dilation,
      const c10::SymInt& groups,
      c10::string_view activation,
      double negative_slope) {
    const ActivationSpec spec = parse_activation("convbias.forward_residual", activation, negative_slope);
    save_conv_args(ctx, stride, padding, dilation, groups, bias.has_value() && bias->defined(), activation, negative_slope);
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor output;
    at::Tensor for_derivative;
    if (spec.is_identity() || spec.backward_from_output()) {
      output = forward_residual_symint(
          input, weight, bias, residual, stride, padding, dilation, groups, activation, negative_slope);
      for_derivative = spec.is_identity() ? at::Tensor() : output;
    } else {
      for_derivative = forward_residual_symint(input, weight, bias, residual, stride, padding, dilation, groups);
      output = activation_after_preactivation(for_derivative, spec, output_memory_format(input, weight));
    }
    ctx->save_for_backward({weight.requires_grad() ? input : input_stand_in(input), weight, for_derivative});
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // needs_input_grad indexes the tensor inputs that were given: input, weight, bias if any, residual.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const ConvGrads g = conv_backward(
        ctx, grad_outputs[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2));
    // The residual's gradient is the gradient at the sum.
    const at::Tensor grad_residual = ctx->needs_input_grad(has_bias ? 3 : 2) ? g.z : at::Tensor();
    return {g.input,      g.weight,     g.bias,       grad_residual, at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),  at::Tensor()};
  }
};

constexpr const char* kNoDoubleBackward =
    "convbias: double backward (gradients of convbias.param_grad or convbias._activation_backward, e.g. "
    "autograd.grad(..., create_graph=True) through convbias.forward) is not implemented; use "
    "torch.nn.functional.conv2d for higher-order gradients";

// param_grad with autograd history: its outputs (the defined ones, in order) get a backward that refuses to run.
class ParamGradFunction : public torch::autograd::Function<ParamGradFunction> {
 public:
  static variable_list forward(
      AutogradContext* /*ctx*/,
      const at::Tensor& grad_output,
      const at::Tensor& input,
      const at::Tensor& weight,
      c10::SymIntArrayRef stride,
      c10::SymIntArrayRef padding,
      c10::SymIntArrayRef dilation,
      const c10::SymInt& groups,
      std::array<bool, 2> output_mask) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_weight, grad_bias] =
        param_grad_symint(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
    variable_list outputs;
    for (auto* grad : {&grad_weight, &grad_bias}) {
      if (grad->has_value()) {
        outputs.push_back(**grad);
      }
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kNoDoubleBackward);
  }
};

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> param_grad_autograd(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    std::array<bool, 2> output_mask) {
  const bool records = c10::GradMode::is_enabled() &&
      (grad_output.requires_grad() || input.requires_grad() || weight.requires_grad());
  if (!records || (!output_mask[0] && !output_mask[1])) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return param_grad_symint(grad_output, input, weight, stride, padding, dilation, std::move(groups), output_mask);
  }
  variable_list outputs =
      ParamGradFunction::apply(grad_output, input, weight, stride, padding, dilation, groups, output_mask);
  std::optional<at::Tensor> grad_weight, grad_bias;
  size_t next = 0;
  if (output_mask[0]) {
    grad_weight = outputs.at(next++);
  }
  if (output_mask[1]) {
    grad_bias = outputs.at(next++);
  }
  return {grad_weight, grad_bias};
}

// _activation_backward with autograd history: its outputs (the defined ones) get a backward that refuses to run.
class ActivationBackwardFunction : public torch::autograd::Function<ActivationBackwardFunction> {
 public:
  static variable_list forward(
      AutogradContext* /*ctx*/,
      const at::Tensor& grad_output,
      const at::Tensor& saved,
      c10::string_view activation,
      double negative_slope,
      bool bias_grad) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_z, grad_bias] = activation_backward_call(grad_output, saved, activation, negative_slope, bias_grad);
    variable_list outputs{grad_z};
    if (grad_bias.has_value()) {
      outputs.push_back(*grad_bias);
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kNoDoubleBackward);
  }
};

ActivationBackwardResult activation_backward_autograd(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool bias_grad) {
  const bool records = c10::GradMode::is_enabled() && (grad_output.requires_grad() || saved.requires_grad());
  if (!records) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return activation_backward_call(grad_output, saved, activation, negative_slope, bias_grad);
  }
  variable_list outputs = ActivationBackwardFunction::apply(grad_output, saved, activation, negative_slope, bias_grad);
  std::optional<at::Tensor> grad_bias;
  if (bias_grad) {
    grad_bias = outputs.at(1);
  }
  return {outputs.at(0), grad_bias};
}

at::Tensor forward_autograd(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation,
    double negative_slope) {
  // Nothing to differentiate (inference, frozen layers, torch.no_grad): no autograd node, nothing saved.
  const bool records = c10::GradMode::is_enabled() &&
      (input.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->defined() && bias->requires_grad()));
  if (!records) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_symint(input, weight, bias, stride, padding, dilation, std::move(groups), activation, negative_slope);
  }
  return ForwardFunction::apply(input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
}

at::Tensor forward_residual_autograd(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation,
    double negative_slope) {
  const bool records = c10::GradMode::is_enabled() &&
      (input.requires_grad() || weight.requires_grad() || residual.requires_grad() ||
       (bias.has_value() && bias->defined() && bias->requires_grad()));
  if (!records) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_residual_symint(
        input, weight, bias, residual, stride, padding, dilation, std::move(groups), activation, negative_slope);
  }
  return ForwardResidualFunction::apply(
      input, weight, bias, residual, stride, padding, dilation, groups, activation, negative_slope);
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("forward_residual", &forward_residual_autograd);
  m.impl("param_grad", &param_grad_autograd);
  m.impl("_activation_backward", &activation_backward_autograd);
}

} // namespace convbias

// Autograd of convbias::forward, in C++ so that a differentiable call pays no Python: the weight and bias
// gradients come from convbias::param_grad in one call, the input gradient (ATen's convolution backward) only
// when the input requires grad, which it never does in layer-by-layer training where inputs are detached.
//
// convbias::param_grad keeps its autograd registration in Python (torch_convbias/ops.py): it raises
// NotImplementedError when differentiated, so create_graph=True through forward fails loudly instead of
// silently returning wrong second-order gradients.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "convbias.h"

namespace convbias {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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
      const c10::SymInt& groups) {
    ctx->save_for_backward({input, weight});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_symint(input, weight, bias, stride, padding, dilation, groups);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad_output = grad_outputs[0];
    const auto stride = ctx->saved_data["stride"].toSymIntVector();
    const auto padding = ctx->saved_data["padding"].toSymIntVector();
    const auto dilation = ctx->saved_data["dilation"].toSymIntVector();
    const c10::SymInt groups = ctx->saved_data["groups"].toSymInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // needs_input_grad indexes the tensor inputs that were given: input, weight, then bias if any.
    const bool needs_input = ctx->needs_input_grad(0);
    const bool needs_weight = ctx->needs_input_grad(1);
    const bool needs_bias = has_bias && ctx->needs_input_grad(2);

    at::Tensor grad_input, grad_weight, grad_bias;
    if (needs_input) {
      grad_input = std::get<0>(at::convolution_backward_symint(
          grad_output, input, weight, std::nullopt, stride, padding, dilation, /*transposed=*/false,
          c10::SymIntArrayRef({c10::SymInt(0), c10::SymInt(0)}), groups, {true, false, false}));
    }
    if (needs_weight || needs_bias) {
      std::optional<at::Tensor> w, b;
      if (c10::GradMode::is_enabled()) {
        // create_graph=True: through param_grad's autograd, which refuses to be differentiated.
        std::tie(w, b) = param_grad_symint(
            grad_output, input, weight, stride, padding, dilation, groups, {needs_weight, needs_bias});
      } else {
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        std::tie(w, b) = param_grad_symint(
            grad_output, input, weight, stride, padding, dilation, groups, {needs_weight, needs_bias});
      }
      grad_weight = w.value_or(at::Tensor());
      grad_bias = b.value_or(at::Tensor());
    }
    // One entry per forward argument; the conv parameters get none.
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor forward_autograd(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups) {
  return ForwardFunction::apply(input, weight, bias, stride, padding, dilation, groups);
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, Autograd, m) {
  m.impl("forward", &forward_autograd);
}

} // namespace convbias

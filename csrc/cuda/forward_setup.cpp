#include "cuda/forward_setup.h"

#include <ATen/ATen.h>

#include <c10/util/accumulate.h>

#include <array>
#include <limits>

namespace convbias::cuda {

int64_t output_numel(const at::Tensor& input, const at::Tensor& weight, const ConvParams& params) {
  return c10::multiply_integers(output_size(input, weight, params));
}

std::optional<std::string> aten_only_setting_reason(const at::Tensor& input, const at::Tensor& weight) {
  if (knobs().path == "aten") {
    return "TORCH_CONVBIAS_PATH=aten";
  }
  if (!at::globalContext().userEnabledCuDNN()) {
    return "torch.backends.cudnn.enabled is False: ATen's convolution without cuDNN, as nn.Conv2d";
  }
  if (input.scalar_type() == at::kDouble) {
    return "float64: cuDNN graphs have no float64 convolution engines";
  }
  if (input.numel() == 0 || weight.numel() == 0) {
    return "empty tensor: nothing for cuDNN to run";
  }
  return std::nullopt;
}

std::optional<std::string> aten_only_reason(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel) {
  if (auto reason = aten_only_setting_reason(input, weight)) {
    return reason;
  }
  constexpr int64_t int32_max = std::numeric_limits<int32_t>::max();
  if (input.numel() > int32_max || weight.numel() > int32_max || output_numel > int32_max) {
    // cuDNN's engines index with 32 bits; ATen's convolution splits such a batch into parts that fit (forward and
    // param_grad split it themselves first where they can: batch_parts.h).
    return "more than 2^31 - 1 elements in one tensor (input, weight or output)";
  }
  return std::nullopt;
}

PreparedForward prepare_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& activation, bool keep_preactivation) {
  PreparedForward p;
  const at::MemoryFormat format = output_memory_format(input, weight);
  // Graphs take fully packed tensors in one layout; others are copied once here.
  p.converted_input = !input.is_contiguous(format) || !weight.is_contiguous(format);
  p.x = aligned_for_cudnn(input.contiguous(format), format, &p.realigned);
  p.w = aligned_for_cudnn(weight.contiguous(format), format, &p.realigned);
  if (bias.has_value() && bias->defined()) {
    p.b = aligned_for_cudnn(bias->contiguous(), at::MemoryFormat::Contiguous, &p.realigned);
  }
  p.problem = make_problem(
      p.x, p.w, p.b, output_size(input, weight, params), params, format == at::MemoryFormat::ChannelsLast, activation);
  p.problem.keep_preactivation = keep_preactivation && !activation.is_identity();
  return p;
}

ForwardRoute route_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& activation, bool keep_preactivation) {
  ForwardRoute route;
  route.aten_reason = aten_only_reason(input, weight, output_numel(input, weight, params));
  if (route.aten_reason) {
    return route;
  }
  const bool keep = keep_preactivation && !activation.is_identity();
  route.activation_after = keep && output_memory_format(input, weight) != at::MemoryFormat::ChannelsLast;
  route.prepared = route.activation_after ? prepare_forward(input, weight, bias, params, ActivationSpec{})
                                          : prepare_forward(input, weight, bias, params, activation, keep);
  const PreparedForward& p = *route.prepared;
  route.plan = fprop_plan(p.problem, p.x, p.w, p.b, &route.was_cached, &route.build_seconds);
  return route;
}

ResidualRoute route_forward_residual(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& residual, const ConvParams& params, const ActivationSpec& activation) {
  ResidualRoute route;
  route.why_not = aten_only_reason(input, weight, output_numel(input, weight, params));
  if (route.why_not) {
    return route;
  }
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  if (output_memory_format(input, weight) != cl) {
    route.why_not = "NCHW tensors: the residual's graph is built for channels_last (NHWC) tensors only";
    return route;
  }
  route.prepared = prepare_forward(input, weight, bias, params, activation);
  route.r = aligned_for_cudnn(residual.contiguous(cl), cl);
  PreparedForward& p = *route.prepared;
  p.problem.has_residual = true;
  p.problem.residual_alignment = pointer_alignment(route.r);
  route.plan = fprop_residual_plan(p.problem, p.x, p.w, p.b, route.r, &route.was_cached, &route.build_seconds);
  return route;
}

bool residual_pass_adds_bias(const ResidualRoute& route, const ForwardRoute& own) {
  if (route.plan) {
    return route.plan->residual_bias_in_pass;
  }
  return !own.aten_reason && bias_joins_residual_pass(*own.plan, own.prepared->problem);
}

} // namespace convbias::cuda

#include "cuda/forward_setup.h"

#include <ATen/ATen.h>

#include <limits>

namespace convbias::cuda {

std::optional<std::string> aten_only_reason(const at::Tensor& input, const at::Tensor& weight) {
  if (knobs().path == "aten") {
    return "TORCH_CONVBIAS_PATH=aten";
  }
  if (input.scalar_type() == at::kDouble) {
    return "float64: cuDNN graphs have no float64 convolution engines";
  }
  if (input.numel() == 0 || weight.numel() == 0) {
    return "empty tensor: nothing for cuDNN to run";
  }
  constexpr int64_t int32_max = std::numeric_limits<int32_t>::max();
  if (input.numel() > int32_max || weight.numel() > int32_max) {
    return "more than 2^31 - 1 elements in one tensor";
  }
  return std::nullopt;
}

PreparedForward prepare_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params) {
  PreparedForward p;
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  // The fusion engines take fully packed NHWC only; other layouts are copied once here.
  p.converted_input = !input.is_contiguous(cl) || !weight.is_contiguous(cl);
  p.x = input.contiguous(cl);
  p.w = weight.contiguous(cl);
  if (bias.has_value() && bias->defined()) {
    p.b = bias->contiguous();
  }
  p.x = aligned_for_cudnn(p.x, cl, &p.realigned);
  p.w = aligned_for_cudnn(p.w, cl, &p.realigned);
  if (p.b) {
    p.b = aligned_for_cudnn(*p.b, at::MemoryFormat::Contiguous, &p.realigned);
  }
  const auto size = output_size(input, weight, params);
  p.y = at::empty(size, input.options().memory_format(cl));
  p.problem = make_problem(p.x, p.w, p.b, p.y, params);
  return p;
}

ForwardRoute route_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params) {
  ForwardRoute route;
  route.aten_reason = aten_only_reason(input, weight);
  if (route.aten_reason) {
    return route;
  }
  route.prepared = prepare_forward(input, weight, bias, params);
  const PreparedForward& p = *route.prepared;
  route.plan = fprop_plan(p.problem, p.x, p.w, p.b, p.y, &route.was_cached, &route.build_seconds);
  return route;
}

} // namespace convbias::cuda

#include "cuda/dgrad.h"

#include <ATen/ATen.h>

#include "cuda/forward_setup.h"
#include "cuda/knobs.h"
#include "cuda/plan_store.h"
#include "reference.h"

#include <sstream>

namespace convbias::cuda {
namespace {

constexpr int64_t kDY = 1, kW = 2, kDX = 3;

// dx = conv_dgrad(dy, w): FLOAT accumulation, written once in the I/O dtype, channels_last.
std::shared_ptr<fe::graph::Graph> make_graph(const DgradProblem& p, cudnnHandle_t handle, std::string* why) {
  auto graph = new_graph(p.dtype);
  auto dy = packed_tensor(*graph, "dy", kDY, p.dy_dims, /*channels_last=*/true, p.alignments[0]);
  auto w = packed_tensor(*graph, "w", kW, p.w_dims, /*channels_last=*/true, p.alignments[1]);
  auto dx = graph->conv_dgrad(dy, w, with_conv_params(fe::graph::Conv_dgrad_attributes().set_name("dgrad"), p.params));
  dx->set_output(true)
      .set_uid(kDX)
      .set_data_type(to_frontend_dtype(p.dtype))
      .set_dim(as_vector(p.x_dims))
      .set_stride(channels_last_strides(p.x_dims))
      .set_alignment(p.alignments[2]);
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

VariantPack variant_pack(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
  return {{kDY, dy.data_ptr()}, {kW, w.data_ptr()}, {kDX, dx.data_ptr()}};
}

// ATen's input gradient, what nn.Conv2d's backward runs (`dx` stands in for the input: only its shape is read).
at::Tensor aten_input_grad(const DgradProblem& p, const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
  const ConvParams& c = p.params;
  return std::get<0>(at::convolution_backward(
      dy, dx, w, std::nullopt, c.stride, c.padding, c.dilation, /*transposed=*/false, {0, 0}, c.groups,
      {true, false, false}));
}

std::shared_ptr<const DgradPlan> build_plan(
    const DgradProblem& p, const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
  auto plan = std::make_shared<DgradPlan>();
  const SelectionPolicy policy = default_policy(p.dtype, p.flags);
  plan->timed = policy.time_candidates();
  const bool forced = knobs().input_grad == "graph";
  if (!policy.time_candidates() && !forced) {
    // Untimed (also during CUDA graph capture): the graph is only ever chosen by measurement against ATen's.
    plan->notes.push_back("choices untimed: ATen's input gradient (nn.Conv2d's), as without cudnn.benchmark");
    return plan;
  }
  GraphAttempt attempt = build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(p, handle, why); }, policy,
      variant_pack(dy, w, dx), dy.device(), [&] { return "conv_dgrad graph for " + p.describe(); });
  if (!attempt.failure.empty()) {
    plan->notes.push_back("conv_dgrad graph rejected: " + attempt.failure + "; running ATen's convolution backward");
    plan->transient = attempt.engine.transient;
    return plan;
  }
  if (forced) {
    plan->notes.push_back("TORCH_CONVBIAS_INPUT_GRAD=graph: the conv_dgrad graph, unmeasured");
    plan->graph = attempt.graph;
    plan->engine = attempt.engine;
    return plan;
  }
  const at::Tensor workspace = try_workspace(attempt.engine.workspace_bytes, dy.options());
  if (!workspace.defined()) {
    plan->notes.push_back("the conv_dgrad graph's workspace could not be allocated: ATen's input gradient");
    plan->transient = true;
    return plan;
  }
  VariantPack pack = variant_pack(dy, w, dx);
  plan->graph_ms = time_on_stream([&] {
    execute_graph(*attempt.graph, attempt.engine.plan_index, workspace.data_ptr(), pack, [&] {
      return "conv_dgrad graph for " + p.describe();
    });
  });
  plan->aten_ms = time_on_stream([&] { (void)aten_input_grad(p, dy, w, dx); });
  if (plan->aten_ms <= plan->graph_ms) {
    plan->notes.push_back("ATen's input gradient measured faster than the conv_dgrad graph");
    return plan;
  }
  plan->graph = attempt.graph;
  plan->engine = attempt.engine;
  return plan;
}

plan_store::ExpectedTensors expected_tensors(const DgradProblem& p) {
  return {
      {kDY, {as_vector(p.dy_dims), channels_last_strides(p.dy_dims)}},
      {kW, {as_vector(p.w_dims), channels_last_strides(p.w_dims)}},
      {kDX, {as_vector(p.x_dims), channels_last_strides(p.x_dims)}}};
}

} // namespace

PlanKey DgradProblem::key() const {
  // The groups follow from the dims (input channels against the weight's).
  return gradient_plan_key(/*kind=*/4, dtype, device, {dy_dims, w_dims, x_dims}, params, alignments, flags);
}

std::string DgradProblem::describe() const {
  std::ostringstream s;
  s << "grad_output " << at::IntArrayRef(dy_dims) << ", weight " << at::IntArrayRef(w_dims) << ", input "
    << at::IntArrayRef(x_dims) << " (all channels_last), " << dtype << ", stride " << at::IntArrayRef(params.stride)
    << ", padding " << at::IntArrayRef(params.padding) << ", dilation " << at::IntArrayRef(params.dilation)
    << ", groups " << params.groups;
  return s.str();
}

PlanCaches<DgradPlan>& dgrad_cache() {
  static PlanCaches<DgradPlan> caches(knobs().cache_size);
  return caches;
}

InputGradRoute route_input_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params) {
  InputGradRoute route;
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  const MathFlags flags = current_math_flags();
  const std::string& knob = knobs().input_grad;
  if (knob == "aten") {
    route.aten_reason = "TORCH_CONVBIAS_INPUT_GRAD=aten: ATen's input gradient";
  } else if (auto reason = aten_only_reason(input, weight, grad_output.numel())) {
    route.aten_reason = *reason;
  } else if (output_memory_format(input, weight) != cl) {
    route.aten_reason = "NCHW input and weight: ATen's input gradient (nn.Conv2d's path)";
  } else if (knob == "timed" && requested_tuning(flags) == Tuning::Untimed) {
    route.aten_reason = "choices untimed (cudnn.benchmark off): ATen's input gradient, as nn.Conv2d's";
  }
  if (route.aten_reason) {
    return route;
  }
  route.dy = aligned_for_cudnn(grad_output.contiguous(cl), cl);
  route.w = aligned_for_cudnn(weight.contiguous(cl), cl);
  route.dx = at::empty(input.sizes(), route.dy.options().memory_format(cl));
  DgradProblem& p = route.problem;
  p.dtype = route.dy.scalar_type();
  p.device = route.dy.device().index();
  for (int i = 0; i < 4; ++i) {
    p.dy_dims[i] = route.dy.size(i);
    p.w_dims[i] = route.w.size(i);
    p.x_dims[i] = input.size(i);
  }
  p.params = params;
  p.alignments = {pointer_alignment(route.dy), pointer_alignment(route.w), pointer_alignment(route.dx)};
  p.flags = flags;
  route.plan = lookup_plan<DgradPlan>(
      dgrad_cache(), "input_grad", p.key(), /*timed=*/knob == "timed",
      [&](const plan_store::Json& r) { return gradient_plan_from_record(r, expected_tensors(p)); },
      [&] { return build_plan(p, route.dy, route.w, route.dx); }, &gradient_plan_record, &route.build_seconds,
      &route.was_cached);
  return route;
}

at::Tensor run_input_grad(const InputGradRoute& route) {
  TORCH_INTERNAL_ASSERT(route.runs_graph());
  VariantPack pack = variant_pack(route.dy, route.w, route.dx);
  execute_plan(*route.plan->graph, route.plan->engine, pack, route.dy.options(), [&] {
    return "conv_dgrad graph for " + route.problem.describe();
  });
  return route.dx;
}

at::Tensor input_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params) {
  {
    // Scoped: a route that does not run the graph frees its copies and dx before ATen allocates its own result.
    const InputGradRoute route = route_input_grad(grad_output, input, weight, params);
    if (route.runs_graph()) {
      return run_input_grad(route);
    }
  }
  const ConvParams& c = params;
  return input_grad_reference(grad_output, input, weight, c.stride, c.padding, c.dilation, c.groups);
}

} // namespace convbias::cuda

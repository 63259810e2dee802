#include "cuda/wgrad.h"

#include <ATen/ATen.h>

#include "cuda/forward_setup.h"
#include "cuda/knobs.h"
#include "cuda/plan_store.h"

#include <sstream>

namespace convbias::cuda {
namespace {

constexpr int64_t kX = 1, kDY = 2, kDW = 3;

// dw = conv_wgrad(dy, x): FLOAT accumulation, written once in the I/O dtype, KRSC (channels_last) layout.
std::shared_ptr<fe::graph::Graph> make_graph(const WgradProblem& p, cudnnHandle_t handle, std::string* why) {
  auto graph = new_graph(p.dtype);
  auto x = packed_tensor(*graph, "x", kX, p.x_dims, /*channels_last=*/true, p.alignments[0]);
  auto dy = packed_tensor(*graph, "dy", kDY, p.dy_dims, /*channels_last=*/true, p.alignments[1]);
  auto dw = graph->conv_wgrad(dy, x, with_conv_params(fe::graph::Conv_wgrad_attributes().set_name("wgrad"), p.params));
  dw->set_output(true)
      .set_uid(kDW)
      .set_data_type(to_frontend_dtype(p.dtype))
      .set_dim(as_vector(p.w_dims))
      .set_stride(channels_last_strides(p.w_dims))
      .set_alignment(p.alignments[2]);
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

VariantPack variant_pack(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw) {
  return {{kX, x.data_ptr()}, {kDY, dy.data_ptr()}, {kDW, dw.data_ptr()}};
}

std::shared_ptr<const WgradPlan> build_plan(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw) {
  auto plan = std::make_shared<WgradPlan>();
  const SelectionPolicy policy = default_policy(p.dtype, p.flags);
  plan->timed = policy.time_candidates();
  GraphAttempt attempt = build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(p, handle, why); }, policy,
      variant_pack(x, dy, dw), x.device(), [&] { return "conv_wgrad graph for " + p.describe(); });
  if (!attempt.failure.empty()) {
    plan->notes.push_back("conv_wgrad graph rejected: " + attempt.failure + "; running ATen's convolution backward");
    plan->transient = attempt.engine.transient;
    return plan;
  }
  plan->graph = attempt.graph;
  plan->engine = attempt.engine;
  // ATen's weight gradient (nn.Conv2d's, on cuDNN's legacy API) is sometimes the faster one: measure both once
  // per key and keep the faster, so that this path is never slower than nn.Conv2d's backward (unmeasured, the
  // graph, when its workspace cannot be allocated now).
  const at::Tensor workspace =
      policy.time_candidates() ? try_workspace(plan->engine.workspace_bytes, x.options()) : at::Tensor();
  if (workspace.defined()) {
    VariantPack pack = variant_pack(x, dy, dw);
    plan->graph_ms = time_on_stream([&] {
      execute_graph(*plan->graph, plan->engine.plan_index, workspace.data_ptr(), pack, [&] {
        return "conv_wgrad graph for " + p.describe();
      });
    });
    const ConvParams& c = p.params;
    plan->aten_ms = time_on_stream([&] {
      (void)at::convolution_backward(
          dy, x, dw, std::nullopt, c.stride, c.padding, c.dilation, /*transposed=*/false, {0, 0}, c.groups,
          {false, true, false});
    });
    if (plan->aten_ms < plan->graph_ms) {
      plan->graph.reset();
      plan->notes.push_back("ATen's weight gradient measured faster than the conv_wgrad graph");
    }
  }
  return plan;
}

std::optional<plan_store::Json> plan_record(const WgradPlan& plan) {
  plan_store::Json r{{"graph_ms", plan.graph_ms}, {"aten_ms", plan.aten_ms}, {"notes", plan.notes}};
  return plan_store::put_graph(r, plan.graph, plan.engine) ? std::optional(r) : std::nullopt;
}

std::shared_ptr<const WgradPlan> plan_from_record(const plan_store::Json& r, const WgradProblem& p) {
  auto plan = std::make_shared<WgradPlan>();
  std::string why;
  const plan_store::ExpectedTensors expected{
      {kX, {as_vector(p.x_dims), channels_last_strides(p.x_dims)}},
      {kDY, {as_vector(p.dy_dims), channels_last_strides(p.dy_dims)}},
      {kDW, {as_vector(p.w_dims), channels_last_strides(p.w_dims)}}};
  if (!plan_store::take_graph(r, expected, plan->graph, plan->engine, &why)) {
    return nullptr;
  }
  plan->timed = true;
  plan->graph_ms = r.at("graph_ms").get<float>();
  plan->aten_ms = r.at("aten_ms").get<float>();
  plan->notes = r.at("notes").get<std::vector<std::string>>();
  plan->notes.push_back("loaded from the persistent plan cache");
  return plan;
}

} // namespace

PlanKey WgradProblem::key() const {
  PlanKey key;
  auto& f = key.fields;
  f.reserve(36);
  f.push_back(2); // graph kind: weight gradient
  f.push_back(static_cast<int64_t>(dtype));
  f.push_back(device); // fields[2]: the device (plan_store::load leaves it out)
  for (const auto* dims : {&x_dims, &dy_dims, &w_dims}) {
    f.insert(f.end(), dims->begin(), dims->end());
  }
  for (int d = 0; d < 2; ++d) {
    f.push_back(params.stride[d]);
    f.push_back(params.padding[d]);
    f.push_back(params.dilation[d]);
  }
  f.insert(f.end(), alignments.begin(), alignments.end());
  f.push_back(flags.allow_tf32 && dtype == at::kFloat);
  f.push_back(flags.deterministic);
  f.push_back(flags.benchmark);
  return key;
}

std::string WgradProblem::describe() const {
  std::ostringstream s;
  s << "input " << at::IntArrayRef(x_dims) << ", grad_output " << at::IntArrayRef(dy_dims) << ", weight "
    << at::IntArrayRef(w_dims) << " (all channels_last), " << dtype << ", stride " << at::IntArrayRef(params.stride)
    << ", padding " << at::IntArrayRef(params.padding) << ", dilation " << at::IntArrayRef(params.dilation)
    << ", groups " << params.groups;
  return s.str();
}

PlanCaches<WgradPlan>& wgrad_cache() {
  static PlanCaches<WgradPlan> caches(knobs().cache_size);
  return caches;
}

WeightGradRoute route_weight_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params) {
  WeightGradRoute route;
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  if (knobs().param_grad != "cudnn") {
    route.aten_reason = "TORCH_CONVBIAS_PARAM_GRAD=" + knobs().param_grad;
  } else if (auto reason = aten_only_reason(input, weight, grad_output.numel())) {
    route.aten_reason = *reason;
  } else if (output_memory_format(input, weight) != cl) {
    // The conv_wgrad graph takes channels_last dy and x: NCHW tensors go to ATen (nn.Conv2d's own path) rather
    // than through full-size channels_last copies that nn.Conv2d's backward would not make.
    route.aten_reason = "NCHW input and weight: ATen's weight gradient (nn.Conv2d's path), no channels_last copies";
  }
  if (route.aten_reason) {
    return route;
  }
  route.dy = aligned_for_cudnn(grad_output.contiguous(cl), cl);
  route.x = aligned_for_cudnn(input.contiguous(cl), cl);
  route.dw = at::empty(weight.sizes(), weight.options().memory_format(cl));
  WgradProblem& p = route.problem;
  p.dtype = route.x.scalar_type();
  p.device = route.x.device().index();
  for (int i = 0; i < 4; ++i) {
    p.x_dims[i] = route.x.size(i);
    p.dy_dims[i] = route.dy.size(i);
    p.w_dims[i] = weight.size(i);
  }
  p.params = params;
  p.alignments = {pointer_alignment(route.x), pointer_alignment(route.dy), pointer_alignment(route.dw)};
  p.flags = current_math_flags();
  const PlanKey key = p.key();
  route.plan = lookup_plan<WgradPlan>(
      wgrad_cache(), "weight_grad", key, requested_tuning(p.flags) != Tuning::Untimed,
      [&](const plan_store::Json& r) { return plan_from_record(r, p); },
      [&] { return build_plan(p, route.x, route.dy, route.dw); }, &plan_record, &route.build_seconds,
      &route.was_cached);
  return route;
}

at::Tensor run_weight_grad(const WeightGradRoute& route, const at::Tensor& weight) {
  TORCH_INTERNAL_ASSERT(route.runs_graph());
  VariantPack pack = variant_pack(route.x, route.dy, route.dw);
  execute_plan(*route.plan->graph, route.plan->engine, pack, route.x.options(), [&] {
    return "conv_wgrad graph for " + route.problem.describe();
  });
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  return with_layout(route.dw, memory_format_of(weight));
}

} // namespace convbias::cuda

#include "cuda/dgrad_activation.h"

#include <ATen/ATen.h>

#include <cstring>
#include <sstream>

#include "cuda/activation_backward.h"
#include "cuda/bias_grad.h"
#include "cuda/epilogue.h"
#include "cuda/forward_setup.h"
#include "cuda/knobs.h"
#include "cuda/plan_store.h"

namespace convbias::cuda {
namespace {

constexpr int64_t kDY = 1, kW = 2, kSaved = 3, kDZ = 4;

// dz = conv_dgrad(dy, w) * act'(saved): the derivative applied to the FLOAT dgrad result, dz written once in the I/O
// dtype, channels_last.
std::shared_ptr<fe::graph::Graph> make_graph(const DgradActivationProblem& p, cudnnHandle_t handle, std::string* why) {
  const std::optional<fe::graph::Pointwise_attributes> derivative = derivative_attributes(p.activation);
  TORCH_INTERNAL_ASSERT(derivative.has_value());
  const DgradProblem& c = p.conv;
  auto graph = new_graph(c.dtype);
  auto dy = packed_tensor(*graph, "dy", kDY, c.dy_dims, /*channels_last=*/true, c.alignments[0]);
  auto w = packed_tensor(*graph, "w", kW, c.w_dims, /*channels_last=*/true, c.alignments[1]);
  auto saved = packed_tensor(*graph, "saved", kSaved, c.x_dims, /*channels_last=*/true, p.saved_alignment);
  auto dx = graph->conv_dgrad(dy, w, with_conv_params(fe::graph::Conv_dgrad_attributes().set_name("dgrad"), c.params));
  dx->set_dim(as_vector(c.x_dims)).set_stride(channels_last_strides(c.x_dims));
  auto dz = graph->pointwise(dx, saved, *derivative);
  dz->set_output(true)
      .set_uid(kDZ)
      .set_data_type(to_frontend_dtype(c.dtype))
      .set_dim(as_vector(c.x_dims))
      .set_stride(channels_last_strides(c.x_dims))
      .set_alignment(c.alignments[2]);
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

VariantPack variant_pack(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& saved, const at::Tensor& dz) {
  return {{kDY, dy.data_ptr()}, {kW, w.data_ptr()}, {kSaved, saved.data_ptr()}, {kDZ, dz.data_ptr()}};
}

// The separate way: the input gradient as convbias::_input_grad computes it, then convbias::_activation_backward's.
std::tuple<at::Tensor, std::optional<at::Tensor>> separate(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params,
    const at::Tensor& saved, const ActivationSpec& activation, bool bias_grad) {
  const at::Tensor grad_input = input_grad(grad_output, input, weight, params);
  return activation_backward(grad_input, saved, activation, bias_grad);
}

// The graph way's dz (channels_last, allocated here) and the bias gradient of it by param_grad's way.
std::tuple<at::Tensor, std::optional<at::Tensor>> run_graph(
    fe::graph::Graph& graph, const EngineChoice& engine, const DgradActivationProblem& p, const at::Tensor& dy,
    const at::Tensor& w, const at::Tensor& saved, bool bias_grad) {
  at::Tensor dz = at::empty(saved.sizes(), dy.options().memory_format(at::MemoryFormat::ChannelsLast));
  VariantPack pack = variant_pack(dy, w, saved, dz);
  execute_plan(graph, engine, pack, dy.options(), [&] { return "conv_dgrad + derivative graph for " + p.describe(); });
  std::optional<at::Tensor> grad_bias;
  if (bias_grad) {
    grad_bias = cuda::bias_grad(dz);
  }
  return {std::move(dz), std::move(grad_bias)};
}

std::shared_ptr<const DgradActivationPlan> build_plan(
    const DgradActivationProblem& p, const at::Tensor& dy, const at::Tensor& input, const at::Tensor& w,
    const at::Tensor& saved) {
  auto plan = std::make_shared<DgradActivationPlan>();
  const SelectionPolicy policy = default_policy(p.conv.dtype, p.conv.flags);
  plan->timed = policy.time_candidates();
  const bool forced = knobs().input_grad == "graph";
  if (!policy.time_candidates() && !forced) {
    plan->notes.push_back("choices untimed: the input gradient and the activation's backward separately");
    return plan;
  }
  const at::Tensor dz = at::empty(saved.sizes(), dy.options().memory_format(at::MemoryFormat::ChannelsLast));
  const auto what = [&] { return "conv_dgrad + derivative graph for " + p.describe(); };
  GraphAttempt attempt = build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(p, handle, why); }, policy,
      variant_pack(dy, w, saved, dz), dy.device(), what);
  if (!attempt.failure.empty()) {
    plan->notes.push_back(
        "conv_dgrad + derivative graph rejected: " + attempt.failure +
        "; the input gradient and the activation's backward separately");
    plan->transient = attempt.engine.transient;
    return plan;
  }
  if (forced) {
    plan->notes.push_back("TORCH_CONVBIAS_INPUT_GRAD=graph: the conv_dgrad + derivative graph, unmeasured");
    plan->graph = attempt.graph;
    plan->engine = attempt.engine;
    return plan;
  }
  // The graph is timed on a workspace allocated here: where it cannot be, the choice waits (transient) rather than
  // timing execute_plan's fallback engine under the chosen one's name.
  const at::Tensor workspace = try_workspace(attempt.engine.workspace_bytes, dy.options());
  if (!workspace.defined()) {
    plan->notes.push_back(
        "the conv_dgrad + derivative graph's workspace could not be allocated: the input gradient and the activation's "
        "backward separately");
    plan->transient = true;
    return plan;
  }
  // Both ways whole, as calls run them: the bias gradient (here always asked for: the key leaves bias_grad out, and
  // its cost is the same pass either way in kind) and the allocations included.
  const ConvParams& c = p.conv.params;
  plan->graph_ms = time_on_stream([&] {
    const at::Tensor out = at::empty(saved.sizes(), dy.options().memory_format(at::MemoryFormat::ChannelsLast));
    VariantPack pack = variant_pack(dy, w, saved, out);
    execute_graph(*attempt.graph, attempt.engine.plan_index, workspace.data_ptr(), pack, what);
    (void)cuda::bias_grad(out);
  });
  plan->aten_ms = time_on_stream([&] { (void)separate(dy, input, w, c, saved, p.activation, true); });
  if (plan->aten_ms <= plan->graph_ms) {
    plan->notes.push_back("the input gradient and the activation's backward separately measured faster than the graph");
    return plan;
  }
  plan->graph = attempt.graph;
  plan->engine = attempt.engine;
  return plan;
}

plan_store::ExpectedTensors expected_tensors(const DgradActivationProblem& p) {
  const DgradProblem& c = p.conv;
  return {
      {kDY, {as_vector(c.dy_dims), channels_last_strides(c.dy_dims)}},
      {kW, {as_vector(c.w_dims), channels_last_strides(c.w_dims)}},
      {kSaved, {as_vector(c.x_dims), channels_last_strides(c.x_dims)}},
      {kDZ, {as_vector(c.x_dims), channels_last_strides(c.x_dims)}}};
}

// Why the graph way is not tried for these tensors (the first reason found), or nullopt.
std::optional<std::string> separate_reason(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& saved,
    const ActivationSpec& activation, const MathFlags& flags) {
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  const std::string& knob = knobs().input_grad;
  if (knob == "aten") {
    return std::string("TORCH_CONVBIAS_INPUT_GRAD=aten: the input gradient and the activation's backward separately");
  }
  if (activation.is_identity()) {
    return std::string("identity: no derivative to put in the graph; the input gradient and its copy and sum separately");
  }
  if (!derivative_attributes(activation)) {
    return std::string("no cuDNN derivative node reads what ") + activation_name(activation.kind) +
        "'s backward keeps: the input gradient and the activation's backward separately";
  }
  if (auto reason = aten_only_reason(input, weight, grad_output.numel())) {
    return *reason;
  }
  if (output_memory_format(input, weight) != cl || !saved.is_contiguous(cl)) {
    return std::string("NCHW tensors (the graph takes channels_last input, weight and saved): separately");
  }
  if (knob == "timed" && requested_tuning(flags) == Tuning::Untimed) {
    return std::string("choices untimed (cudnn.benchmark off): the input gradient and the activation's backward separately");
  }
  return std::nullopt;
}

} // namespace

PlanKey DgradActivationProblem::key() const {
  PlanKey key = gradient_plan_key(
      /*kind=*/5, conv.dtype, conv.device, {conv.dy_dims, conv.w_dims, conv.x_dims}, conv.params, conv.alignments,
      conv.flags);
  int64_t slope_bits = 0;
  static_assert(sizeof(slope_bits) == sizeof(activation.negative_slope));
  std::memcpy(&slope_bits, &activation.negative_slope, sizeof(slope_bits));
  key.fields.push_back(static_cast<int64_t>(activation.kind));
  key.fields.push_back(activation.kind == Activation::LeakyRelu ? slope_bits : 0);
  key.fields.push_back(saved_alignment);
  return key;
}

std::string DgradActivationProblem::describe() const {
  std::ostringstream s;
  s << conv.describe() << ", the derivative of " << activation_name(activation.kind);
  if (activation.kind == Activation::LeakyRelu) {
    s << " (negative_slope " << activation.negative_slope << ")";
  }
  s << " from its " << derivative_source_name(activation);
  return s.str();
}

PlanCaches<DgradActivationPlan>& dgrad_activation_cache() {
  static PlanCaches<DgradActivationPlan> caches(knobs().cache_size);
  return caches;
}

InputGradActivationRoute route_input_grad_activation(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params,
    const at::Tensor& saved, const ActivationSpec& activation) {
  InputGradActivationRoute route;
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  const MathFlags flags = current_math_flags();
  route.separate_reason = separate_reason(grad_output, input, weight, saved, activation, flags);
  if (route.separate_reason) {
    return route;
  }
  route.dy = aligned_for_cudnn(grad_output.contiguous(cl), cl);
  route.w = aligned_for_cudnn(weight.contiguous(cl), cl);
  route.saved = aligned_for_cudnn(saved, cl);
  DgradActivationProblem& p = route.problem;
  DgradProblem& c = p.conv;
  c.dtype = route.dy.scalar_type();
  c.device = route.dy.device().index();
  for (int i = 0; i < 4; ++i) {
    c.dy_dims[i] = route.dy.size(i);
    c.w_dims[i] = route.w.size(i);
    c.x_dims[i] = input.size(i);
  }
  c.params = params;
  // dz is allocated fresh by the caching allocator for every call: 16-byte aligned (and more).
  c.alignments = {pointer_alignment(route.dy), pointer_alignment(route.w), 16};
  c.flags = flags;
  p.activation = activation;
  p.saved_alignment = pointer_alignment(route.saved);
  route.plan = lookup_plan<DgradActivationPlan>(
      dgrad_activation_cache(), "input_grad_activation", p.key(), /*timed=*/knobs().input_grad == "timed",
      [&](const plan_store::Json& r) { return gradient_plan_from_record(r, expected_tensors(p)); },
      [&] { return build_plan(p, route.dy, input, route.w, route.saved); }, &gradient_plan_record,
      &route.build_seconds, &route.was_cached);
  return route;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> input_grad_activation(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params,
    const at::Tensor& saved, const ActivationSpec& activation, bool bias_grad) {
  {
    // Scoped: a route that does not run the graph frees its copies before the two steps allocate theirs.
    const InputGradActivationRoute route =
        route_input_grad_activation(grad_output, input, weight, params, saved, activation);
    if (route.runs_graph()) {
      return run_graph(*route.plan->graph, route.plan->engine, route.problem, route.dy, route.w, route.saved, bias_grad);
    }
  }
  return separate(grad_output, input, weight, params, saved, activation, bias_grad);
}

} // namespace convbias::cuda

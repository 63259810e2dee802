// Diagnostics of the CUDA path: convbias::_explain, _explain_param_grad and _explain_activation_backward on CUDA
// tensors, and the plan cache's statistics.
#include "diagnostics.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "activation.h"
#include "conv_args.h"
#include "cuda/activation_backward.h"
#include "cuda/batch_parts.h"
#include "cuda/bias_activation.h"
#include "cuda/forward_setup.h"
#include "cuda/bias_grad.h"
#include "cuda/bias_reduction.h"
#include "cuda/epilogue.h"
#include "cuda/pad_channels.h"
#include "cuda/plan_store.h"
#include "cuda/space_to_depth.h"
#include "cuda/dgrad.h"
#include "cuda/dgrad_activation.h"
#include "cuda/wgrad.h"
#include "json.h"

namespace convbias {
namespace {

// Milliseconds as JSON numbers. Every float goes through this: the nlohmann::json the cuDNN frontend ships writes
// floats as hexadecimal strings of their bits (measured: -1.0f became "BF800000"); doubles stay numbers.
double number(float ms) {
  return static_cast<double>(ms);
}

// [[name, ms], ...]
Json timings_json(const std::vector<std::pair<std::string, float>>& named) {
  Json timings = Json::array();
  for (const auto& [name, ms] : named) {
    timings.push_back(Json::array({name, number(ms)}));
  }
  return timings;
}

// How the tensors run: channels_last (as given or copied), NCHW through a graph over NCHW strides, NCHW through
// channels_last copies, or NCHW through ATen.
std::string layout_name(const cuda::PreparedForward& prepared, const cuda::FpropPlan& plan) {
  if (prepared.problem.channels_last) {
    return prepared.converted_input ? "copied to channels_last" : "channels_last";
  }
  if (plan.via_channels_last) {
    return "nchw via channels_last copies";
  }
  return plan.path == cuda::FpropPath::Aten ? "nchw (aten)" : "nchw graph";
}

// The input channel count the convolution ran with when the plan pads the channels (the padded-channels way, taken
// directly or by the channels_last plan behind NCHW copies), else null.
Json padded_channels_json(const cuda::PreparedForward& prepared, const cuda::FpropPlan& plan) {
  // (A plan via channels_last copies is a copy of the channels_last plan, its via_padded_channels included.)
  if (plan.via_channels_last) {
    return plan.via_channels_last->via_padded_channels ? Json(prepared.problem.as_channels_last().padded_channels()) : Json();
  }
  return plan.via_padded_channels ? Json(prepared.problem.padded_channels()) : Json();
}

// The regrouping a strided stem ran with when the plan took the space-to-depth way (space_to_depth.h): directly, by
// the channels_last plan behind NCHW copies, or by the plan of the zero-padded problem (float32 C=3 padded to 4 may
// run regrouped); its blocks, the regrouped channels and kernel, and the channel count of the regrouped problem's own
// padded way where it took one; else null. (run_plan follows the plans in this order.)
Json space_to_depth_json(const cuda::PreparedForward& prepared, const cuda::FpropPlan& plan) {
  cuda::FpropProblem problem = prepared.problem;
  const cuda::FpropPlan* own = &plan;
  if (own->via_channels_last) {
    problem = problem.as_channels_last();
    own = own->via_channels_last.get();
  }
  if (own->via_padded_channels) {
    problem = problem.with_padded_channels();
    own = own->via_padded_channels.get();
  }
  const auto g = problem.space_to_depth();
  if (!own->via_space_to_depth || !g) {
    return Json();
  }
  const cuda::FpropProblem regrouped = problem.with_space_to_depth();
  return Json{
      {"blocks", {g->block[0], g->block[1]}},
      {"patches", g->patches},
      {"channels", g->channels(problem.x_dims[1])},
      {"kernel", {g->kernel_blocks[0], g->kernel_blocks[1]}},
      {"padded_channels",
       own->via_space_to_depth->via_padded_channels ? Json(regrouped.padded_channels()) : Json()}};
}

Json engine_json(const cuda::EngineChoice& e) {
  return Json{
      {"name", e.engine},
      {"workspace_bytes", e.workspace_bytes},
      {"runtime_compiled", e.runtime_compiled},
      {"from_disk", e.from_disk},
      {"build_seconds", e.build_seconds},
      {"measured_ms", number(e.measured_ms)},
      {"heuristic_candidates", e.heuristic_candidates},
      {"swept", e.swept},
      {"built", e.built},
      {"runtime_compiled_built", e.runtime_compiled_built},
      {"execution_failures", e.execution_failures},
      {"timings", timings_json(e.timings)},
      {"rejected", e.rejected},
      {"fallback",
       e.fallback_plan_index < 0 ? Json()
                                 : Json{{"name", e.fallback_engine}, {"workspace_bytes", e.fallback_workspace_bytes}}}};
}

Json math_json() {
  const cuda::MathFlags flags = cuda::current_math_flags();
  return Json{
      {"allow_tf32", flags.allow_tf32},
      {"deterministic", flags.deterministic},
      {"benchmark", flags.benchmark},
      {"cudnn_enabled", at::globalContext().userEnabledCuDNN()},
      {"tuning", cuda::tuning_name(cuda::requested_tuning(flags))}};
}

Json launch_json(const cuda::KernelLaunch& launch) {
  return Json{
      {"blocks_per_sm", launch.blocks_per_sm},
      {"loads_in_flight", launch.loads_in_flight},
      {"bands", launch.contiguous_bands ? "contiguous" : "interleaved"},
      {"timed", launch.timed}};
}

// The bias gradient of grad_output as param_grad computes it: way, notes, and the kernel's launch.
Json bias_grad_json(const at::Tensor& grad_output) {
  const cuda::BiasGradWay way = cuda::bias_grad_way(grad_output);
  Json bias_grad{{"way", way.way}, {"notes", way.notes}};
  if (way.way == "kernel") {
    bias_grad["launch"] = launch_json(cuda::bias_grad_kernel_launch(grad_output));
  }
  return bias_grad;
}

// Where the activation runs: fused (the graph's last node), or a pass after the graph (ours for 16-bit dtypes,
// ATen's otherwise: activation_pass_name) or after ATen's convolution, and why (`plan` null: ATen before any graph, for `aten_reason`). `keeps`: the call keeps the
// pre-activation (explain's for_backward, the autograd's _forward_with_preactivation); `after`: the plan is conv +
// bias alone and the activation runs after it (an NCHW problem keeping the pre-activation).
Json activation_json(
    const ActivationSpec& spec, at::ScalarType dtype, bool has_bias, const cuda::FpropPlan* plan,
    const std::string& aten_reason, bool keeps = false, bool after = false) {
  const bool fused = plan != nullptr && plan->activation_fused && !after;
  Json j{
      {"name", activation_name(spec.kind)},
      {"fused", fused},
      {"keeps_preactivation", keeps},
      // The graph writes both the pre-activation and the activation: one graph, two outputs.
      {"preactivation_output", fused && plan->preactivation_output},
      {"how", "none"},
      {"why", ""},
      {"epilogue_ms", number(plan != nullptr ? plan->epilogue_ms : -1.0f)},
      {"separate_ms", number(plan != nullptr ? plan->separate_activation_ms : -1.0f)}};
  if (spec.is_identity()) {
    return j;
  }
  const std::string kept = keeps ? ", out of place over the pre-activation (both kept)" : "";
  if (plan != nullptr && plan->path == cuda::FpropPath::Aten && plan->aten_matmul) {
    j["how"] = cuda::matmul_relu_epilogue(has_bias, spec)
        ? "in cuBLAS's epilogue: matmul -> bias add -> relu"
        : std::string(cuda::activation_pass_name(dtype)) + " over the matmul's output";
    j["why"] = plan->activation_why.empty() ? "one matrix multiply measured fastest (see notes)" : plan->activation_why;
  } else if (plan != nullptr && plan->path == cuda::FpropPath::Aten && has_bias && !keeps) {
    j["how"] = "one pass adding the bias and applying the activation over ATen's convolution's output"; // run_aten
    j["why"] = plan->activation_why.empty() ? "ATen's convolution measured fastest (see notes)" : plan->activation_why;
  } else if (plan == nullptr || plan->path == cuda::FpropPath::Aten) {
    j["how"] = "ATen's pointwise kernel after ATen's convolution" + kept;
    const std::string why = plan == nullptr ? aten_reason : plan->activation_why;
    j["why"] = why.empty() ? "ATen's convolution runs this problem (see notes)" : why;
  } else if (after) {
    j["how"] = "ATen's pointwise kernel over the conv + bias plan's output" + kept;
    j["why"] = "NCHW tensors keeping the pre-activation run conv + bias's own plan, then the activation";
  } else if (fused) {
    j["how"] = std::string("in the cuDNN graph's epilogue: ") +
        (plan->path == cuda::FpropPath::Fused ? "conv -> bias add" : "conv") + " -> " + cuda::epilogue_operation(spec) +
        ", FP32, " +
        (plan->preactivation_output ? "two output writes (the pre-activation, then the activation)"
                                    : "one output write");
    j["why"] = plan->activation_why;
  } else if (plan->path == cuda::FpropPath::ConvThenBiasAdd && !keeps) {
    j["how"] = "one pass adding the bias and applying the activation over the conv graph's output";
    j["why"] = plan->activation_why.empty() ? "the graph without the activation was chosen" : plan->activation_why;
  } else {
    j["how"] = std::string(cuda::activation_pass_name(dtype)) + " over the cuDNN graph's output" + kept;
    j["why"] = plan->activation_why.empty() ? "the graph without the activation was chosen" : plan->activation_why;
  }
  return j;
}

Json graph_outputs_json(const cuda::FpropPlan& plan) {
  if (!plan.graph) {
    return Json::array();
  }
  return plan.preactivation_output ? Json::array({"output", "preactivation"}) : Json::array({"output"});
}

// A gradient route's explanation (weight or input gradient): ATen and why, or the plan chosen (a cuDNN graph, or
// ATen's kernel where it measured faster) with both measurements and the engine.
template <typename Route>
Json gradient_route_json(const Route& route) {
  if (route.aten_reason) {
    return {{"path", "aten"}, {"notes", Json::array({*route.aten_reason})}};
  }
  const cuda::GradGraphPlan& plan = *route.plan;
  Json j{
      {"path", route.runs_graph() ? "cudnn graph" : "aten"},
      {"problem", route.problem.describe()},
      {"cached", route.was_cached},
      {"plan_build_seconds", route.build_seconds},
      {"graph_ms", number(plan.graph_ms)},
      {"aten_ms", number(plan.aten_ms)},
      {"notes", plan.notes}};
  if (plan.graph) {
    j["engine"] = engine_json(plan.engine);
  }
  return j;
}

std::string explain_param_grad_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const ConvParams params = check_param_grad_args(grad_output, input, weight, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  // A batch run in parts (batch_parts.h) is explained by its first part.
  const auto part = cuda::batch_part_size(input, weight, grad_output.numel());
  const at::Tensor first_dy = part ? grad_output.narrow(0, 0, *part) : grad_output;
  const at::Tensor first_x = part ? input.narrow(0, 0, *part) : input;
  const cuda::WeightGradRoute weight_route = cuda::route_weight_grad(first_dy, first_x, weight, params);
  Json weight_grad = gradient_route_json(weight_route);
  if (!weight_route.aten_reason) {
    // The weight gradient alone may run on zero-padded input channels (pad_channels.h).
    const cuda::WgradPlan& plan = *weight_route.plan;
    weight_grad["padded_channels"] = plan.via_padded_channels ? Json(weight_route.problem.padded_channels()) : Json();
    weight_grad["padded_ms"] = number(plan.padded_ms);
    weight_grad["as_is_ms"] = number(plan.as_is_ms);
    // Or, a strided stem's, as the regrouped problem (space_to_depth.h).
    const auto g = plan.via_space_to_depth ? weight_route.problem.space_to_depth() : std::nullopt;
    weight_grad["space_to_depth"] = g ? Json{{"blocks", {g->block[0], g->block[1]}},
                                             {"patches", g->patches},
                                             {"channels", g->channels(weight_route.problem.x_dims[1])},
                                             {"kernel", {g->kernel_blocks[0], g->kernel_blocks[1]}}}
                                      : Json();
    weight_grad["space_to_depth_ms"] = number(plan.space_to_depth_ms);
    weight_grad["own_way_ms"] = number(plan.own_way_ms);
  }
  if (part) {
    weight_grad["notes"].insert(weight_grad["notes"].begin(), cuda::batch_parts_note(input.size(0), *part));
    weight_grad["batch_parts"] = {{"samples", *part}, {"count", cuda::batch_part_count(input.size(0), *part)}};
  }
  const Json input_grad = gradient_route_json(cuda::route_input_grad(grad_output, input, weight, params));
  return Json{
      {"math", math_json()},
      {"weight_grad", weight_grad},
      {"bias_grad", bias_grad_json(grad_output)},
      {"input_grad", input_grad}}
      .dump();
}

// How _activation_backward computes grad_z and grad_bias: "fused kernel" (with its launch) or "aten" with the notes
// saying why, and then the bias gradient's own way over grad_z (as param_grad would take it).
std::string explain_activation_backward_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope,
    bool with_bias_grad) {
  const ActivationSpec spec = check_activation_backward_call(grad_output, saved, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(grad_output.device());
  const cuda::ActivationBackwardWay way = cuda::activation_backward_way(grad_output, saved, spec, with_bias_grad);
  Json out{
      {"math", math_json()},
      {"activation", activation_name(spec.kind)},
      {"derivative_from", derivative_source_name(spec)},
      {"way", way.fused ? "fused kernel" : "aten"},
      {"notes", way.notes}};
  if (way.fused) {
    out["launch"] = launch_json(cuda::fused_activation_backward_launch(grad_output, saved, spec));
    out["bias_grad"] = {{"way", "fused"}, {"notes", Json::array()}};
  } else if (with_bias_grad) {
    // grad_z as the call allocates it: what the bias gradient is then taken of.
    const at::Tensor grad_z = at::empty(
        grad_output.sizes(), grad_output.options().memory_format(activation_grad_memory_format(grad_output, saved)));
    out["bias_grad"] = bias_grad_json(grad_z);
  } else {
    out["bias_grad"] = {{"way", "none"}, {"notes", Json::array({"no bias gradient asked for"})}};
  }
  return out.dump();
}

// How _input_grad_activation computes its results: "cudnn graph" (conv_dgrad with the derivative in it) or
// "separate" (the input gradient's route, then _activation_backward's way), why, and what was measured.
std::string explain_input_grad_activation_cuda(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& saved,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] = check_input_grad_activation_call(
      grad_output, input, weight, stride, padding, dilation, groups, saved, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cuda::InputGradActivationRoute route =
      cuda::route_input_grad_activation(grad_output, input, weight, params, saved, spec);
  Json out{
      {"math", math_json()},
      {"activation", activation_name(spec.kind)},
      {"derivative_from", derivative_source_name(spec)},
      {"path", route.runs_graph() ? "cudnn graph" : "separate"}};
  if (route.separate_reason) {
    out["notes"] = Json::array({*route.separate_reason});
    return out.dump();
  }
  const cuda::DgradActivationPlan& plan = *route.plan;
  out["problem"] = route.problem.describe();
  out["cached"] = route.was_cached;
  out["plan_build_seconds"] = route.build_seconds;
  out["graph_ms"] = number(plan.graph_ms);
  out["separate_ms"] = number(plan.aten_ms);
  out["notes"] = plan.notes;
  if (plan.graph) {
    out["engine"] = engine_json(plan.engine);
  }
  return out.dump();
}

std::string explain_cuda(
    const at::Tensor& whole_input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope,
    bool for_backward) {
  const auto [params, spec] =
      check_forward_call(whole_input, weight, bias, stride, padding, dilation, groups, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(whole_input.device());
  Json out{{"math", math_json()}};
  // Under autograd, forward runs _forward_with_preactivation for these activations (csrc/autograd.cpp).
  const bool keeps = for_backward && !spec.is_identity() && !spec.backward_from_output();
  // A batch run in parts (batch_parts.h) is explained by its first part.
  const auto part = cuda::batch_part_size(whole_input, weight, cuda::output_numel(whole_input, weight, params));
  const at::Tensor input = part ? whole_input.narrow(0, 0, *part) : whole_input;
  if (part) {
    out["batch_parts"] = {{"samples", *part}, {"count", cuda::batch_part_count(whole_input.size(0), *part)}};
  }
  const cuda::ForwardRoute route = cuda::route_forward(input, weight, bias, params, spec, keeps);
  if (route.aten_reason) {
    out["path"] = "aten";
    out["notes"] = Json::array({*route.aten_reason});
    out["activation"] = activation_json(spec, input.scalar_type(), bias.has_value(), nullptr, *route.aten_reason, keeps);
    return out.dump();
  }
  const cuda::PreparedForward& prepared = *route.prepared;
  const auto& plan = route.plan;
  const auto& a = prepared.problem.alignments;
  out.update(Json{
      {"path", cuda::path_name(plan->path)},
      {"problem", prepared.problem.describe()},
      {"layout", layout_name(prepared, *plan)},
      {"converted_input", prepared.converted_input},
      {"layout_timings", timings_json(plan->layout_timings)},
      {"realigned", prepared.realigned},
      {"padded_channels", padded_channels_json(prepared, *plan)},
      {"space_to_depth", space_to_depth_json(prepared, *plan)},
      {"output", output_memory_format(input, weight) == at::MemoryFormat::ChannelsLast ? "channels_last" : "NCHW"},
      {"cached", route.was_cached},
      {"plan_build_seconds", route.build_seconds},
      {"tuned", plan->tuned},
      {"fused_ms", number(plan->fused_ms)},
      {"unfused_ms", number(plan->unfused_ms)},
      {"graph_ms", number(plan->graph_ms)},
      {"aten_ms", number(plan->aten_ms)},
      // The ATen path as one matrix multiply (fprop.h: matmul_fits), and that way's time where it was measured.
      {"matmul", plan->path == cuda::FpropPath::Aten && plan->aten_matmul},
      {"matmul_ms", number(plan->matmul_ms)},
      {"alignment", {{"input", a[0]}, {"weight", a[1]}, {"bias", a[2]}, {"output", a[3]}}},
      {"graph_ops", plan->graph_ops},
      // The tensors the graph writes: "output", and "preactivation" when the epilogue graph keeps it.
      {"graph_outputs", graph_outputs_json(*plan)},
      {"activation", activation_json(
           spec, prepared.problem.dtype, prepared.problem.has_bias, plan.get(), "", keeps, route.activation_after)},
      {"notes", plan->notes}});
  if (plan->path != cuda::FpropPath::Aten) {
    out["engine"] = engine_json(plan->engine);
  }
  if (part) {
    out["notes"].insert(out["notes"].begin(), cuda::batch_parts_note(whole_input.size(0), *part));
  }
  return out.dump();
}

// forward_residual's path: the residual's graph (the `residual` entry fused), or forward's route for conv + bias
// (explained as explain_cuda does, identity) followed by one pass adding the residual (and the bias: bias_in_pass)
// and applying the activation.
std::string explain_residual_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    double negative_slope) {
  const auto [params, spec] = check_forward_residual_call(
      input, weight, bias, residual, stride, padding, dilation, groups, activation, negative_slope);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cuda::ResidualRoute route = cuda::route_forward_residual(input, weight, bias, residual, params, spec);
  const auto& plan = route.plan;
  if (plan && plan->residual_fused) {
    const cuda::PreparedForward& prepared = *route.prepared;
    const std::string node = spec.is_identity() ? "" : " -> " + cuda::epilogue_operation(spec);
    const std::string how = std::string("in the cuDNN graph: conv -> residual add") +
        (plan->path == cuda::FpropPath::Fused ? " -> bias add" : "") + node + ", FP32, one output write";
    Json out{
        {"math", math_json()},
        {"path", cuda::path_name(plan->path)},
        {"problem", prepared.problem.describe()},
        {"layout", "channels_last"},
        {"converted_input", prepared.converted_input},
        {"output", "channels_last"},
        {"cached", route.was_cached},
        {"plan_build_seconds", route.build_seconds},
        {"tuned", plan->tuned},
        {"graph_ops", plan->graph_ops},
        {"graph_outputs", Json::array({"output"})},
        {"residual",
         {{"fused", true},
          {"bias_in_pass", false},
          {"how", how},
          {"why", plan->notes.empty() ? "" : plan->notes.back()},
          {"graph_ms", number(plan->epilogue_ms)},
          {"separate_ms", number(plan->separate_activation_ms)}}},
        {"activation",
         {{"name", activation_name(spec.kind)},
          {"fused", !spec.is_identity()},
          {"how", spec.is_identity() ? "none" : how},
          {"why", plan->notes.empty() ? "" : plan->notes.back()}}},
        {"notes", plan->notes},
        {"engine", engine_json(plan->engine)}};
    return out.dump();
  }
  // Forward's route for conv + bias, then the pass: explained as forward explains it.
  Json out = Json::parse(explain_cuda(input, weight, bias, stride, padding, dilation, groups, "identity", 0.01, false));
  std::string why = route.why_not ? *route.why_not : "";
  if (plan) {
    out["cached"] = route.was_cached;
    out["plan_build_seconds"] = route.build_seconds;
    why = plan->notes.empty() ? "" : plan->notes.back();
  }
  const bool bias_in_pass = !cuda::batch_part_size(input, weight, cuda::output_numel(input, weight, params)) &&
      cuda::residual_pass_adds_bias(route, cuda::route_forward(input, weight, bias, params, ActivationSpec{}));
  if (bias_in_pass && (out["path"] != "aten" || out.value("matmul", false))) {
    // The residual's plan measured ATen's convolution without the bias faster than forward's own route (a graph, or
    // the matmul way, which reports path "aten" too).
    out["path"] = "aten";
    out["matmul"] = false;
    out["graph_ops"] = Json::array();
    out["graph_outputs"] = Json::array();
    out.erase("engine");
    out["notes"].push_back(why);
  }
  const std::string pass = std::string("one pass after forward's route: ") +
      (bias_in_pass ? "the bias (ATen's convolution ran without it) and the residual added" : "the residual added") +
      (spec.is_identity() ? "" : ", then the activation");
  out["residual"] = {
      {"fused", false},
      {"bias_in_pass", bias_in_pass},
      {"how", pass},
      {"why", why},
      {"graph_ms", number(plan ? plan->epilogue_ms : -1.0f)},
      {"separate_ms", number(plan ? plan->separate_activation_ms : -1.0f)}};
  out["activation"] = {
      {"name", activation_name(spec.kind)}, {"fused", false}, {"how", spec.is_identity() ? "none" : pass}, {"why", why}};
  return out.dump();
}

} // namespace

std::string math_flags() {
  return math_json().dump();
}

void inject_execution_failures(int64_t count) {
  cuda::inject_execution_failures(count);
}

void inject_epilogue_rejections(int64_t count) {
  cuda::inject_epilogue_rejections(count);
}

void inject_aten_preferences(int64_t count) {
  cuda::inject_aten_preferences(count);
}

void inject_matmul_preferences(int64_t count) {
  cuda::inject_matmul_preferences(count);
}

void inject_padded_way_failures(int64_t count, bool out_of_memory) {
  cuda::inject_padded_way_failures(count, out_of_memory);
}

std::optional<int64_t> batch_part_size(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel) {
  return cuda::batch_part_size(input, weight, output_numel);
}

std::vector<at::Tensor> space_to_depth(
    const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride, at::IntArrayRef padding,
    at::IntArrayRef dilation, int64_t groups) {
  const ConvParams params = check_forward_args(input, weight, std::nullopt, stride, padding, dilation, groups);
  const auto dims = [](const at::Tensor& t) { return std::array<int64_t, 4>{t.size(0), t.size(1), t.size(2), t.size(3)}; };
  const auto g = cuda::space_to_depth_of(
      dims(input), dims(weight), output_size(input, weight, params), params, input.element_size());
  if (!g) {
    return {};
  }
  return {cuda::space_to_depth_input(input, *g), cuda::space_to_depth_weight(weight, *g)};
}

at::Tensor space_to_depth_weight_grad(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
    at::IntArrayRef padding) {
  const ConvParams params = check_forward_args(input, weight, std::nullopt, stride, padding, {1, 1}, 1);
  const auto dims = [](const at::Tensor& t) { return std::array<int64_t, 4>{t.size(0), t.size(1), t.size(2), t.size(3)}; };
  const auto g = cuda::space_to_depth_of(
      dims(input), dims(weight), output_size(input, weight, params), params, input.element_size());
  TORCH_CHECK_VALUE(g, "_space_to_depth_weight_grad: the space-to-depth way does not apply to these arguments");
  const auto regrouped = g->weight_dims(dims(weight));
  TORCH_CHECK_VALUE(
      grad.dim() == 4 && grad.sizes() == at::IntArrayRef(regrouped), "_space_to_depth_weight_grad: grad must have the ",
      "regrouped weight's shape ", at::IntArrayRef(regrouped), ", got ", grad.sizes());
  return cuda::weight_grad_from_space_to_depth(grad, *g, {weight.size(2), weight.size(3)});
}

std::string plan_cache_stats() {
  // Forward and weight-gradient plans live in two caches of the same capacity (each); reported together.
  cuda::CacheStats s = cuda::fprop_cache().eager.stats();
  const cuda::CacheStats forward = s;
  const cuda::CacheStats w = cuda::wgrad_cache().eager.stats();
  const cuda::CacheStats d = cuda::dgrad_cache().eager.stats();
  const cuda::CacheStats da = cuda::dgrad_activation_cache().eager.stats();
  const int64_t capture_plans = cuda::fprop_cache().capture.stats().size + cuda::wgrad_cache().capture.stats().size +
      cuda::dgrad_cache().capture.stats().size + cuda::dgrad_activation_cache().capture.stats().size;
  const cuda::CacheStats r = cuda::bias_reduction_cache_stats();
  const cuda::plan_store::StoreStats disk = cuda::plan_store::stats();
  for (const cuda::CacheStats* other : {&w, &d, &da, &r}) {
    s.hits += other->hits;
    s.misses += other->misses;
    s.evictions += other->evictions;
    s.size += other->size;
    s.build_seconds += other->build_seconds;
  }
  return Json{
      {"hits", s.hits},
      {"misses", s.misses},
      {"evictions", s.evictions},
      {"size", s.size},
      {"forward_plans", forward.size},
      {"weight_grad_plans", w.size},
      {"input_grad_plans", d.size},
      {"input_grad_activation_plans", da.size},
      {"bias_grad_plans", r.size},
      {"capture_plans", capture_plans},
      {"capacity", s.capacity},
      {"build_seconds", s.build_seconds},
      {"workspace_fallbacks", cuda::workspace_fallbacks()},
      {"disk_enabled", cuda::plan_store::enabled()},
      {"disk_hits", disk.hits},
      {"disk_misses", disk.misses},
      {"disk_writes", disk.writes},
      {"disk_rejected", disk.rejected},
      {"disk_last_rejection", disk.last_rejection}}
      .dump();
}

void plan_cache_clear() {
  cuda::fprop_cache().clear();
  cuda::wgrad_cache().clear();
  cuda::dgrad_cache().clear();
  cuda::dgrad_activation_cache().clear();
  cuda::bias_reduction_cache_clear();
}

TORCH_LIBRARY_IMPL(convbias, CUDA, m) {
  m.impl("_explain", &explain_cuda);
  m.impl("_explain_residual", &explain_residual_cuda);
  m.impl("_explain_param_grad", &explain_param_grad_cuda);
  m.impl("_explain_activation_backward", &explain_activation_backward_cuda);
  m.impl("_explain_input_grad_activation", &explain_input_grad_activation_cuda);
}

} // namespace convbias

#include "cuda/wgrad.h"

#include <ATen/ATen.h>

#include "cuda/forward_setup.h"
#include "cuda/knobs.h"
#include "cuda/pad_channels.h"
#include "cuda/padded_choice.h"
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

// dw of the padded problem for `dw` ([K, C, R, S] channels_last): [K, channels, R, S] channels_last, uninitialised.
at::Tensor padded_dw(const at::Tensor& dw, int64_t channels) {
  return at::empty({dw.size(0), channels, dw.size(2), dw.size(3)}, dw.options().memory_format(at::MemoryFormat::ChannelsLast));
}

std::shared_ptr<const WgradPlan> wgrad_plan(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw, bool* was_cached,
    double* build_seconds);

// The plan for the problem as it is: the conv_wgrad graph, or ATen's weight gradient where no graph builds or (timed)
// ATen measured faster.
std::shared_ptr<WgradPlan> build_plan_as_is(
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

plan_store::ExpectedTensors expected_tensors(const WgradProblem& p) {
  return {
      {kX, {as_vector(p.x_dims), channels_last_strides(p.x_dims)}},
      {kDY, {as_vector(p.dy_dims), channels_last_strides(p.dy_dims)}},
      {kDW, {as_vector(p.w_dims), channels_last_strides(p.w_dims)}}};
}

// As the forward's (fprop.cpp): a problem with padded_channels() also runs on a zero-padded copy of x into a padded
// dw, the first C channels kept; under timed choices both ways are measured (the copies included) and the faster kept;
// untimed, as it is; TORCH_CONVBIAS_PAD_CHANNELS=on / off: always (where its graph builds) / never.
std::shared_ptr<const WgradPlan> consider_padded_channels(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw,
    std::shared_ptr<WgradPlan> own) {
  const int64_t channels = p.padded_channels();
  if (!padded_way_tried(channels, p.flags, own->transient)) {
    return own;
  }
  const std::string note = padded_way_note(p.x_dims[1], channels);
  return padded_or_own<WgradPlan>(own, note, [&]() -> std::shared_ptr<const WgradPlan> {
    const WgradProblem q = p.with_padded_channels();
    const at::Tensor dw_padded = padded_dw(dw, channels);
    const std::shared_ptr<const WgradPlan> padded = wgrad_plan(q, pad_channels(x, channels), dy, dw_padded, nullptr, nullptr);
    if (!padded->graph) {
      // ATen's weight gradient needs no copies of ours: on the padded problem it is no way of its own.
      own->notes.push_back(
          note + " not taken: that problem's plan is ATen's weight gradient (" +
          (padded->aten_ms >= 0 ? "measured faster than its conv_wgrad graph" : "no conv_wgrad graph runs it") + ")");
      return own;
    }
    // Both complete ways, as calls run them: the padded one with the copy of x and the copy out of the padded dw.
    const ConvParams& c = p.params;
    const auto time_own = [&] {
      return time_on_stream([&] {
        if (own->graph) {
          VariantPack pack = variant_pack(x, dy, dw);
          execute_plan(*own->graph, own->engine, pack, x.options(), [&] { return "conv_wgrad graph for " + p.describe(); });
        } else {
          (void)at::convolution_backward(
              dy, x, dw, std::nullopt, c.stride, c.padding, c.dilation, /*transposed=*/false, {0, 0}, c.groups,
              {false, true, false});
        }
      });
    };
    const auto time_padded = [&] {
      return time_on_stream([&] {
        const at::Tensor x_padded = pad_channels(x, channels); // alive while the graph runs
        VariantPack pack = variant_pack(x_padded, dy, dw_padded);
        execute_plan(*padded->graph, padded->engine, pack, x.options(), [&] { return "conv_wgrad graph for " + q.describe(); });
        (void)with_layout(dw_padded.narrow(1, 0, p.w_dims[1]), at::MemoryFormat::ChannelsLast);
      });
    };
    return keep_padded_or_own<WgradPlan>(
        own, padded, note, time_own, time_padded, [](WgradPlan& plan, float own_ms, float padded_ms) {
          plan.as_is_ms = own_ms;
          plan.padded_ms = padded_ms;
        });
  });
}

// dw of the regrouped problem q: channels_last, uninitialised.
at::Tensor regrouped_dw(const WgradProblem& q, const at::Tensor& dw) {
  return at::empty(q.w_dims, dw.options().memory_format(at::MemoryFormat::ChannelsLast));
}

// One weight gradient of `p` the way `plan` runs it, as a call does (copies included): the graph as it is, on padded
// copies, on the regrouped problem, or ATen's. For timing one way against another.
void run_way(const WgradPlan& plan, const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw) {
  const auto describe = [](const WgradProblem& q) { return [&q] { return "conv_wgrad graph for " + q.describe(); }; };
  if (plan.via_padded_channels) {
    const int64_t channels = p.padded_channels();
    const WgradProblem q = p.with_padded_channels();
    const at::Tensor x_padded = pad_channels(x, channels), dw_padded = padded_dw(dw, channels);
    VariantPack pack = variant_pack(x_padded, dy, dw_padded);
    execute_plan(*plan.graph, plan.engine, pack, x.options(), describe(q));
    (void)with_layout(dw_padded.narrow(1, 0, p.w_dims[1]), at::MemoryFormat::ChannelsLast);
  } else if (plan.via_space_to_depth) {
    const auto g = p.space_to_depth();
    TORCH_INTERNAL_ASSERT(g);
    const WgradProblem q = p.with_space_to_depth();
    const at::Tensor x_regrouped = space_to_depth_input(x, *g), dw_regrouped = regrouped_dw(q, dw);
    VariantPack pack = variant_pack(x_regrouped, dy, dw_regrouped);
    execute_plan(*plan.graph, plan.engine, pack, x.options(), describe(q));
    (void)weight_grad_from_space_to_depth(dw_regrouped, *g, {p.w_dims[2], p.w_dims[3]});
  } else if (plan.graph) {
    VariantPack pack = variant_pack(x, dy, dw);
    execute_plan(*plan.graph, plan.engine, pack, x.options(), describe(p));
  } else {
    const ConvParams& c = p.params;
    (void)at::convolution_backward(
        dy, x, dw, std::nullopt, c.stride, c.padding, c.dilation, /*transposed=*/false, {0, 0}, c.groups,
        {false, true, false});
  }
}

// As the forward's (fprop.cpp): a strided stem's weight gradient also runs as the regrouped problem's (the regrouped
// x, dw regrouped back); timed, both complete ways are measured and the faster kept; untimed, its own way;
// TORCH_CONVBIAS_SPACE_TO_DEPTH=on / off: always (where its graph builds) / never. Whatever stops the regrouped way
// leaves the problem its own way, with the reason in the notes.
std::shared_ptr<const WgradPlan> consider_space_to_depth(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw,
    std::shared_ptr<const WgradPlan> chosen) {
  const auto g = p.space_to_depth();
  const std::string& knob = knobs().space_to_depth;
  if (!g || knob == "off" || (knob != "on" && (current_tuning(p.flags) == Tuning::Untimed || chosen->transient))) {
    return chosen;
  }
  const std::string note = space_to_depth_note(*g, p.x_dims[1]);
  auto own = std::make_shared<WgradPlan>(*chosen);
  return optional_way_or_own<WgradPlan>(own, note, "regrouped copies", [&]() -> std::shared_ptr<const WgradPlan> {
    const WgradProblem q = p.with_space_to_depth();
    const std::shared_ptr<const WgradPlan> regrouped =
        wgrad_plan(q, space_to_depth_input(x, *g), dy, regrouped_dw(q, dw), nullptr, nullptr);
    if (!regrouped->graph) {
      own->notes.push_back(note + " not taken: that problem's plan is ATen's weight gradient");
      return own;
    }
    auto plan = std::make_shared<WgradPlan>(*regrouped);
    plan->via_space_to_depth = regrouped;
    plan->via_padded_channels = nullptr;
    if (knob == "on") {
      plan->notes.push_back(note + " (TORCH_CONVBIAS_SPACE_TO_DEPTH=on)");
      return plan;
    }
    const float own_ms = time_on_stream([&] { run_way(*own, p, x, dy, dw); });
    const float regrouped_ms = time_on_stream([&] { run_way(*plan, p, x, dy, dw); });
    std::ostringstream measured;
    measured << regrouped_ms << " ms against " << own_ms << " ms";
    auto& kept = regrouped_ms < own_ms ? plan : own;
    kept->notes.push_back(note + (kept == plan ? ": measured faster, " : " measured slower: ") + measured.str());
    kept->space_to_depth_ms = regrouped_ms;
    kept->own_way_ms = own_ms;
    return kept;
  });
}

std::shared_ptr<const WgradPlan> build_plan(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw) {
  return consider_space_to_depth(p, x, dy, dw, consider_padded_channels(p, x, dy, dw, build_plan_as_is(p, x, dy, dw)));
}

std::optional<plan_store::Json> plan_record(const WgradPlan& plan) {
  plan_store::Json r{
      {"graph_ms", plan.graph_ms}, {"aten_ms", plan.aten_ms}, {"notes", plan.notes},
      {"via_padded_channels", plan.via_padded_channels != nullptr}, {"padded_ms", plan.padded_ms},
      {"as_is_ms", plan.as_is_ms}, {"via_space_to_depth", plan.via_space_to_depth != nullptr},
      {"space_to_depth_ms", plan.space_to_depth_ms}, {"own_way_ms", plan.own_way_ms}};
  // A plan run on padded or regrouped copies stores its choice only: the plan it runs is stored under its own key.
  const bool own_graph = !plan.via_padded_channels && !plan.via_space_to_depth;
  return plan_store::put_graph(r, own_graph ? plan.graph : nullptr, plan.engine) ? std::optional(r) : std::nullopt;
}

// The plan a record describes, or null when it does not fit (a padded choice looks up, loads or builds the padded
// problem's plan on copies of these tensors).
std::shared_ptr<const WgradPlan> plan_from_record(
    const plan_store::Json& r, const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw) {
  std::shared_ptr<WgradPlan> plan;
  if (r.at("via_padded_channels").get<bool>()) {
    const int64_t channels = p.padded_channels();
    if (channels == 0) {
      return nullptr;
    }
    auto via = wgrad_plan(p.with_padded_channels(), pad_channels(x, channels), dy, padded_dw(dw, channels), nullptr, nullptr);
    if (!via->graph) {
      return nullptr;
    }
    plan = std::make_shared<WgradPlan>(*via);
    plan->via_padded_channels = via;
  } else if (r.at("via_space_to_depth").get<bool>()) {
    const auto g = p.space_to_depth();
    if (!g) {
      return nullptr;
    }
    const WgradProblem q = p.with_space_to_depth();
    auto via = wgrad_plan(q, space_to_depth_input(x, *g), dy, regrouped_dw(q, dw), nullptr, nullptr);
    if (!via->graph) {
      return nullptr;
    }
    plan = std::make_shared<WgradPlan>(*via);
    plan->via_space_to_depth = via;
    plan->via_padded_channels = nullptr;
  } else {
    plan = std::make_shared<WgradPlan>();
    std::string why;
    if (!plan_store::take_graph(r, expected_tensors(p), plan->graph, plan->engine, &why)) {
      return nullptr;
    }
  }
  plan->timed = true;
  plan->graph_ms = r.at("graph_ms").get<float>();
  plan->aten_ms = r.at("aten_ms").get<float>();
  plan->padded_ms = r.at("padded_ms").get<float>();
  plan->as_is_ms = r.at("as_is_ms").get<float>();
  plan->space_to_depth_ms = r.at("space_to_depth_ms").get<float>();
  plan->own_way_ms = r.at("own_way_ms").get<float>();
  plan->notes = r.at("notes").get<std::vector<std::string>>();
  plan->notes.push_back("loaded from the persistent plan cache");
  return plan;
}

std::shared_ptr<const WgradPlan> wgrad_plan(
    const WgradProblem& p, const at::Tensor& x, const at::Tensor& dy, const at::Tensor& dw, bool* was_cached,
    double* build_seconds) {
  return lookup_plan<WgradPlan>(
      wgrad_cache(), "weight_grad", p.key(), requested_tuning(p.flags) != Tuning::Untimed,
      [&](const plan_store::Json& r) { return plan_from_record(r, p, x, dy, dw); },
      [&] { return build_plan(p, x, dy, dw); }, &plan_record, build_seconds, was_cached);
}

} // namespace

PlanKey WgradProblem::key() const {
  return gradient_plan_key(/*kind=*/2, dtype, device, {x_dims, dy_dims, w_dims}, params, alignments, flags);
}

std::string WgradProblem::describe() const {
  std::ostringstream s;
  s << "input " << at::IntArrayRef(x_dims) << ", grad_output " << at::IntArrayRef(dy_dims) << ", weight "
    << at::IntArrayRef(w_dims) << " (all channels_last), " << dtype << ", stride " << at::IntArrayRef(params.stride)
    << ", padding " << at::IntArrayRef(params.padding) << ", dilation " << at::IntArrayRef(params.dilation)
    << ", groups " << params.groups;
  return s.str();
}

int64_t WgradProblem::padded_channels() const {
  return padded_channel_count(dtype, x_dims[1], params.groups, x_dims[0] * x_dims[2] * x_dims[3]);
}

WgradProblem WgradProblem::with_padded_channels() const {
  const int64_t channels = padded_channels();
  TORCH_INTERNAL_ASSERT(channels > 0);
  WgradProblem p = *this;
  p.x_dims[1] = channels;
  p.w_dims[1] = channels;
  p.alignments[0] = 16;
  p.alignments[2] = 16;
  return p;
}

std::optional<SpaceToDepth> WgradProblem::space_to_depth() const {
  const int64_t size = c10::elementSize(dtype);
  auto g = space_to_depth_of(x_dims, w_dims, dy_dims, params, size);
  if (!g || (x_dims[1] * size) % 16 == 0 || (g->channels(x_dims[1]) * size) % 16 != 0) {
    return std::nullopt;
  }
  return g;
}

WgradProblem WgradProblem::with_space_to_depth() const {
  const auto g = space_to_depth();
  TORCH_INTERNAL_ASSERT(g);
  return regrouped_problem(*this, *g, 0, 2);
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
  route.plan = wgrad_plan(p, route.x, route.dy, route.dw, &route.was_cached, &route.build_seconds);
  if (route.plan->via_padded_channels) {
    const int64_t channels = p.padded_channels();
    route.x = pad_channels(route.x, channels);
    route.dw = padded_dw(route.dw, channels);
  } else if (route.plan->via_space_to_depth) {
    const auto g = p.space_to_depth();
    TORCH_INTERNAL_ASSERT(g);
    route.x = space_to_depth_input(route.x, *g);
    route.dw = regrouped_dw(p.with_space_to_depth(), route.dw);
  }
  return route;
}

at::Tensor run_weight_grad(const WeightGradRoute& route, const at::Tensor& weight) {
  TORCH_INTERNAL_ASSERT(route.runs_graph());
  VariantPack pack = variant_pack(route.x, route.dy, route.dw);
  execute_plan(*route.plan->graph, route.plan->engine, pack, route.x.options(), [&] {
    return "conv_wgrad graph for " + route.problem.describe();
  });
  // On padded copies the gradient is the first C channels of the padded dw (the others belong to the zeros of x); on
  // the regrouped problem, its dw regrouped back.
  if (route.plan->via_space_to_depth) {
    const auto g = route.problem.space_to_depth();
    TORCH_INTERNAL_ASSERT(g);
    return with_layout(
        weight_grad_from_space_to_depth(route.dw, *g, {weight.size(2), weight.size(3)}), memory_format_of(weight));
  }
  const at::Tensor dw = route.plan->via_padded_channels ? route.dw.narrow(1, 0, weight.size(1)) : route.dw;
  return with_layout(dw, memory_format_of(weight));
}

} // namespace convbias::cuda

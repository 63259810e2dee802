// Diagnostics of the CUDA path: convbias::_explain on CUDA tensors and the plan cache's statistics.
#include "diagnostics.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "conv_args.h"
#include "cuda/forward_setup.h"
#include "cuda/bias_grad.h"
#include "cuda/bias_reduction.h"
#include "cuda/plan_store.h"
#include "cuda/wgrad.h"
#include "json.h"

namespace convbias {
namespace {

// [[name, ms], ...]
std::string timings_json(const std::vector<std::pair<std::string, float>>& named) {
  std::string timings = "[";
  for (size_t i = 0; i < named.size(); ++i) {
    std::ostringstream ms;
    ms << named[i].second;
    timings += (i ? ", [" : "[") + json_string(named[i].first) + ", " + ms.str() + "]";
  }
  return timings + "]";
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

std::string engine_json(const cuda::EngineChoice& e) {
  return JsonObject()
      .str("name", e.engine)
      .num("workspace_bytes", e.workspace_bytes)
      .boolean("runtime_compiled", e.runtime_compiled)
      .boolean("from_disk", e.from_disk)
      .num("build_seconds", e.build_seconds)
      .num("measured_ms", e.measured_ms)
      .num("heuristic_candidates", e.heuristic_candidates)
      .num("swept", e.swept)
      .num("built", e.built)
      .raw("timings", timings_json(e.timings))
      .strings("rejected", e.rejected)
      .raw(
          "fallback",
          e.fallback_plan_index < 0
              ? "null"
              : JsonObject().str("name", e.fallback_engine).num("workspace_bytes", e.fallback_workspace_bytes).dump())
      .dump();
}

std::string math_json() {
  const cuda::MathFlags flags = cuda::current_math_flags();
  return JsonObject()
      .boolean("allow_tf32", flags.allow_tf32)
      .boolean("deterministic", flags.deterministic)
      .boolean("benchmark", flags.benchmark)
      .dump();
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
  JsonObject weight_grad;
  const cuda::WeightGradRoute route = cuda::route_weight_grad(grad_output, input, weight, params);
  if (route.aten_reason) {
    weight_grad.str("path", "aten").strings("notes", {*route.aten_reason});
  } else {
    const cuda::WgradPlan& plan = *route.plan;
    weight_grad.str("path", route.runs_graph() ? "cudnn graph" : "aten")
        .str("problem", route.problem.describe())
        .boolean("cached", route.was_cached)
        .num("plan_build_seconds", route.build_seconds)
        .num("graph_ms", plan.graph_ms)
        .num("aten_ms", plan.aten_ms)
        .strings("notes", plan.notes);
    if (plan.graph) {
      weight_grad.raw("engine", engine_json(plan.engine));
    }
  }
  const cuda::BiasGradWay way = cuda::bias_grad_way(grad_output);
  JsonObject bias_grad;
  bias_grad.str("way", way.way).strings("notes", way.notes);
  if (way.way == "kernel") {
    const cuda::BiasKernelLaunch launch = cuda::bias_grad_kernel_launch(grad_output);
    bias_grad.raw(
        "launch",
        JsonObject()
            .num("blocks_per_sm", launch.blocks_per_sm)
            .num("loads_in_flight", launch.loads_in_flight)
            .str("bands", launch.contiguous_bands ? "contiguous" : "interleaved")
            .boolean("timed", launch.timed)
            .dump());
  }
  return JsonObject()
      .raw("math", math_json())
      .raw("weight_grad", weight_grad.dump())
      .raw("bias_grad", bias_grad.dump())
      .dump();
}

std::string explain_cuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const ConvParams params = check_forward_args(input, weight, bias, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard device_guard(input.device());
  JsonObject out;
  out.raw("math", math_json());
  const cuda::ForwardRoute route = cuda::route_forward(input, weight, bias, params);
  if (route.aten_reason) {
    return out.str("path", "aten").strings("notes", {*route.aten_reason}).dump();
  }
  const cuda::PreparedForward& prepared = *route.prepared;
  const auto& plan = route.plan;
  const auto& a = prepared.problem.alignments;
  out.str("path", cuda::path_name(plan->path))
      .str("problem", prepared.problem.describe())
      .str("layout", layout_name(prepared, *plan))
      .boolean("converted_input", prepared.converted_input)
      .raw("layout_timings", timings_json(plan->layout_timings))
      .boolean("realigned", prepared.realigned)
      .str("output", output_memory_format(input, weight) == at::MemoryFormat::ChannelsLast ? "channels_last" : "NCHW")
      .boolean("cached", route.was_cached)
      .num("plan_build_seconds", route.build_seconds)
      .boolean("tuned", plan->tuned)
      .num("fused_ms", plan->fused_ms)
      .num("unfused_ms", plan->unfused_ms)
      .num("graph_ms", plan->graph_ms)
      .num("aten_ms", plan->aten_ms)
      .raw("alignment", JsonObject().num("input", a[0]).num("weight", a[1]).num("bias", a[2]).num("output", a[3]).dump())
      .strings("notes", plan->notes);
  if (plan->path != cuda::FpropPath::Aten) {
    out.raw("engine", engine_json(plan->engine));
  }
  return out.dump();
}

} // namespace

std::string plan_cache_stats() {
  // Forward and weight-gradient plans live in two caches of the same capacity (each); reported together.
  cuda::CacheStats s = cuda::fprop_cache().stats();
  const cuda::CacheStats forward = s;
  const cuda::CacheStats w = cuda::wgrad_cache().stats();
  const cuda::CacheStats r = cuda::bias_reduction_cache_stats();
  const cuda::plan_store::StoreStats disk = cuda::plan_store::stats();
  for (const cuda::CacheStats* other : {&w, &r}) {
    s.hits += other->hits;
    s.misses += other->misses;
    s.evictions += other->evictions;
    s.size += other->size;
    s.build_seconds += other->build_seconds;
  }
  return JsonObject()
      .num("hits", s.hits)
      .num("misses", s.misses)
      .num("evictions", s.evictions)
      .num("size", s.size)
      .num("forward_plans", forward.size)
      .num("weight_grad_plans", w.size)
      .num("bias_grad_plans", r.size)
      .num("capacity", s.capacity)
      .num("build_seconds", s.build_seconds)
      .num("workspace_fallbacks", cuda::workspace_fallbacks())
      .boolean("disk_enabled", cuda::plan_store::enabled())
      .num("disk_hits", disk.hits)
      .num("disk_misses", disk.misses)
      .num("disk_writes", disk.writes)
      .num("disk_rejected", disk.rejected)
      .dump();
}

void plan_cache_clear() {
  cuda::fprop_cache().clear();
  cuda::wgrad_cache().clear();
  cuda::bias_reduction_cache_clear();
}

TORCH_LIBRARY_IMPL(convbias, CUDA, m) {
  m.impl("_explain", &explain_cuda);
  m.impl("_explain_param_grad", &explain_param_grad_cuda);
}

} // namespace convbias

#include "cuda/fprop.h"

#include <ATen/ATen.h>

#include <sstream>

namespace convbias::cuda {
namespace {

constexpr int64_t kX = 1, kW = 2, kB = 3, kY = 4;

// The graph: conv_fprop (-> FLOAT intermediate) -> pointwise ADD of the bias [1,K,1,1] -> y, or conv alone.
// Returns nullptr and the reason when cuDNN does not accept the graph itself.
std::shared_ptr<fe::graph::Graph> make_graph(
    const FpropProblem& p, bool with_bias, cudnnHandle_t handle, std::string* why) {
  auto graph = new_graph(p.dtype);
  auto x = nhwc_tensor(*graph, "x", kX, p.x_dims, p.alignments[0]);
  auto w = nhwc_tensor(*graph, "w", kW, p.w_dims, p.alignments[1]);
  auto conv = graph->conv_fprop(x, w, with_conv_params(fe::graph::Conv_fprop_attributes().set_name("conv"), p.params));
  std::shared_ptr<fe::graph::Tensor_attributes> y = conv;
  if (with_bias) {
    conv->set_data_type(fe::DataType_t::FLOAT).set_dim(as_vector(p.y_dims)).set_stride(channels_last_strides(p.y_dims));
    const int64_t k = p.w_dims[0];
    auto b = graph->tensor(fe::graph::Tensor_attributes()
                               .set_name("bias")
                               .set_uid(kB)
                               .set_dim({1, k, 1, 1})
                               .set_stride({k, 1, k, k})
                               .set_alignment(p.alignments[2]));
    y = graph->pointwise(
        conv, b,
        fe::graph::Pointwise_attributes()
            .set_name("bias_add")
            .set_mode(fe::PointwiseMode_t::ADD)
            .set_compute_data_type(fe::DataType_t::FLOAT));
  }
  y->set_output(true)
      .set_uid(kY)
      .set_data_type(to_frontend_dtype(p.dtype))
      .set_dim(as_vector(p.y_dims))
      .set_stride(channels_last_strides(p.y_dims))
      .set_alignment(p.alignments[3]);
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

VariantPack variant_pack(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y,
    bool with_bias) {
  VariantPack pack{{kX, x.data_ptr()}, {kW, w.data_ptr()}, {kY, y.data_ptr()}};
  if (with_bias) {
    pack.emplace(kB, b->data_ptr());
  }
  return pack;
}

const char* graph_name(bool with_bias) {
  return with_bias ? "fused conv+bias graph" : "conv graph";
}

void execute(
    fe::graph::Graph& graph, int64_t plan_index, void* workspace, VariantPack& pack, const FpropProblem& problem,
    bool with_bias) {
  execute_graph(graph, plan_index, workspace, pack, [&] { return std::string(graph_name(with_bias)) + " for " + problem.describe(); });
}

GraphAttempt attempt(
    const FpropProblem& p, bool with_bias, const SelectionPolicy& policy, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& y) {
  return build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(p, with_bias, handle, why); }, policy,
      variant_pack(x, w, b, y, with_bias), x.device(),
      [&] { return std::string(graph_name(with_bias)) + " for " + p.describe(); });
}

std::string layout_hint(const FpropProblem& p) {
  const int64_t element = c10::elementSize(p.dtype);
  std::ostringstream hint;
  hint << "inputs run as channels_last (NHWC)";
  if (p.x_dims[1] * element % 16 != 0 || p.w_dims[0] * element % 16 != 0) {
    hint << "; channel counts whose rows are not 16-byte multiples (C=" << p.x_dims[1] << ", K=" << p.w_dims[0]
         << ", " << element << "-byte " << p.dtype << ") leave few engines";
  }
  if (*std::min_element(p.alignments.begin(), p.alignments.end()) < 16) {
    hint << "; a data pointer is only " << *std::min_element(p.alignments.begin(), p.alignments.end())
         << "-byte aligned";
  }
  return hint.str();
}

std::shared_ptr<const FpropPlan> build_plan(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& y) {
  auto plan = std::make_shared<FpropPlan>();
  const auto& k = knobs();
  const SelectionPolicy policy = default_policy(p.dtype, p.flags);
  plan->tuned = policy.time_candidates && policy.max_candidates > 1;

  std::optional<GraphAttempt> fused;
  if (p.has_bias && k.path != "unfused") {
    fused = attempt(p, /*with_bias=*/true, policy, x, w, b, y);
    if (!fused->failure.empty()) {
      plan->notes.push_back("fused conv+bias graph rejected: " + fused->failure);
      TORCH_CHECK(
          k.path != "fused", "convbias: TORCH_CONVBIAS_PATH=fused but cuDNN rejected the fused conv+bias graph for ",
          p.describe(), ": ", fused->failure, ". Hint: ", layout_hint(p));
    }
  }
  const bool fused_ok = fused && fused->failure.empty();
  // Conv alone (then a bias add): needed without bias, when the fused graph failed, when forced, and when
  // measuring whether fusion pays for this key.
  const bool measure_both = fused_ok && exhaustive_tuning(p.flags) && k.path == "auto";
  std::optional<GraphAttempt> unfused;
  if (!fused_ok || measure_both) {
    unfused = attempt(p, /*with_bias=*/false, policy, x, w, b, y);
    if (!unfused->failure.empty()) {
      plan->notes.push_back("conv graph rejected: " + unfused->failure);
    }
  }
  const bool unfused_ok = unfused && unfused->failure.empty();

  auto take = [&](GraphAttempt& a, FpropPath path) {
    plan->path = path;
    plan->graph = a.graph;
    plan->engine = a.engine;
  };
  if (fused_ok && unfused_ok) {
    // Time both complete paths on these tensors: fused graph vs conv graph + ATen bias add.
    at::Tensor workspace = at::empty(
        {std::max(fused->engine.workspace_bytes, unfused->engine.workspace_bytes)}, x.options().dtype(at::kByte));
    auto fused_pack = variant_pack(x, w, b, y, true);
    auto conv_pack = variant_pack(x, w, b, y, false);
    const at::Tensor bias_view = b->view({1, -1, 1, 1});
    plan->fused_ms = time_on_stream(
        [&] { execute(*fused->graph, fused->engine.plan_index, workspace.data_ptr(), fused_pack, p, true); });
    plan->unfused_ms = time_on_stream([&] {
      execute(*unfused->graph, unfused->engine.plan_index, workspace.data_ptr(), conv_pack, p, false);
      y.add_(bias_view);
    });
    if (plan->unfused_ms < plan->fused_ms) {
      take(*unfused, FpropPath::ConvThenBiasAdd);
      plan->notes.push_back("conv graph + bias add measured faster than the fused graph");
    } else {
      take(*fused, FpropPath::Fused);
    }
  } else if (fused_ok) {
    take(*fused, FpropPath::Fused);
  } else if (unfused_ok) {
    take(*unfused, p.has_bias ? FpropPath::ConvThenBiasAdd : FpropPath::Conv);
  } else {
    TORCH_CHECK(
        k.path == "auto", "convbias: TORCH_CONVBIAS_PATH=", k.path, " but cuDNN rejected the graph for ",
        p.describe(), ": ", plan->notes.empty() ? "" : plan->notes.back(), ". Hint: ", layout_hint(p));
    plan->path = FpropPath::Aten;
    plan->notes.push_back("no cuDNN graph builds for this problem; running ATen's convolution. Hint: " + layout_hint(p));
  }
  return plan;
}

} // namespace

const char* path_name(FpropPath path) {
  switch (path) {
    case FpropPath::Fused: return "fused";
    case FpropPath::Conv: return "conv";
    case FpropPath::ConvThenBiasAdd: return "conv+bias_add";
    case FpropPath::Aten: return "aten";
  }
  return "?";
}

PlanKey FpropProblem::key() const {
  PlanKey key;
  auto& f = key.fields;
  f.reserve(40);
  f.push_back(1); // graph kind: forward
  f.push_back(static_cast<int64_t>(dtype));
  f.push_back(device);
  for (const auto* dims : {&x_dims, &w_dims, &y_dims}) {
    f.insert(f.end(), dims->begin(), dims->end());
  }
  for (int d = 0; d < 2; ++d) {
    f.push_back(params.stride[d]);
    f.push_back(params.padding[d]);
    f.push_back(params.dilation[d]);
  }
  f.push_back(has_bias);
  f.insert(f.end(), alignments.begin(), alignments.end());
  f.push_back(flags.allow_tf32 && dtype == at::kFloat);
  f.push_back(flags.deterministic);
  f.push_back(flags.benchmark);
  return key;
}

std::string FpropProblem::describe() const {
  std::ostringstream s;
  s << "input " << at::IntArrayRef(x_dims) << ", weight " << at::IntArrayRef(w_dims) << ", output "
    << at::IntArrayRef(y_dims) << " (all channels_last), " << dtype << (has_bias ? ", with bias" : ", no bias")
    << ", stride " << at::IntArrayRef(params.stride) << ", padding " << at::IntArrayRef(params.padding)
    << ", dilation " << at::IntArrayRef(params.dilation) << ", groups " << params.groups << ", alignment "
    << at::IntArrayRef(alignments) << " bytes";
  return s.str();
}

PlanCache<FpropPlan>& fprop_cache() {
  static PlanCache<FpropPlan> cache(knobs().cache_size);
  return cache;
}

FpropProblem make_problem(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y,
    const ConvParams& params) {
  FpropProblem p;
  p.dtype = x.scalar_type();
  p.device = x.device().index();
  for (int i = 0; i < 4; ++i) {
    p.x_dims[i] = x.size(i);
    p.w_dims[i] = w.size(i);
    p.y_dims[i] = y.size(i);
  }
  p.params = params;
  p.has_bias = b.has_value() && b->defined();
  p.alignments = {pointer_alignment(x), pointer_alignment(w), p.has_bias ? pointer_alignment(*b) : 16,
                  pointer_alignment(y)};
  p.flags = current_math_flags();
  return p;
}

std::shared_ptr<const FpropPlan> fprop_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& y, bool* was_cached, double* build_seconds) {
  auto& cache = fprop_cache();
  const PlanKey key = problem.key();
  if (was_cached != nullptr) {
    *was_cached = cache.peek(key) != nullptr;
  }
  return cache.get_or_build(key, [&] { return build_plan(problem, x, w, b, y); }, build_seconds);
}

void run_fprop(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& y) {
  TORCH_INTERNAL_ASSERT(plan.path != FpropPath::Aten && plan.graph);
  const bool fused_bias = plan.path == FpropPath::Fused;
  auto pack = variant_pack(x, w, b, y, fused_bias);
  at::Tensor workspace = at::empty({plan.engine.workspace_bytes}, x.options().dtype(at::kByte));
  execute(*plan.graph, plan.engine.plan_index, workspace.data_ptr(), pack, problem, fused_bias);
  if (plan.path == FpropPath::ConvThenBiasAdd) {
    y.add_(b->view({1, -1, 1, 1}));
  }
}

} // namespace convbias::cuda

#include "cuda/bias_reduction.h"

#include <ATen/ATen.h>

#include <limits>
#include <sstream>

#include "cuda/graph_common.h"
#include "cuda/plan_lookup.h"
#include "cuda/plan_store.h"

namespace convbias::cuda {
namespace {

constexpr int64_t kDY = 1, kDB = 2;

struct ReductionPlan {
  std::shared_ptr<fe::graph::Graph> graph; // null: no plan builds
  EngineChoice engine;
  std::string failure;
  bool transient = false; // no plan because of a workspace that could not be allocated: neither cached nor stored
};

PlanCaches<ReductionPlan>& cache() {
  static PlanCaches<ReductionPlan> plans(knobs().cache_size);
  return plans;
}

std::array<int64_t, 4> dims_of(const at::Tensor& t) {
  return {t.size(0), t.size(1), t.size(2), t.size(3)};
}

std::string describe(const at::Tensor& dy) {
  std::ostringstream s;
  s << "bias-gradient reduction graph for grad_output " << dy.sizes() << " (channels_last), " << dy.scalar_type();
  return s.str();
}

// db[1, K, 1, 1] (FLOAT) = sum of dy over N, H, W.
std::shared_ptr<fe::graph::Graph> make_graph(const at::Tensor& dy, cudnnHandle_t handle, std::string* why) {
  auto graph = new_graph(dy.scalar_type());
  const auto dims = dims_of(dy);
  const int64_t k = dims[1];
  auto input = packed_tensor(*graph, "dy", kDY, dims, /*channels_last=*/true, pointer_alignment(dy));
  auto db = graph->reduction(
      input,
      fe::graph::Reduction_attributes()
          .set_name("bias_grad")
          .set_mode(fe::ReductionMode_t::ADD)
          .set_compute_data_type(fe::DataType_t::FLOAT));
  db->set_output(true).set_uid(kDB).set_data_type(fe::DataType_t::FLOAT).set_dim({1, k, 1, 1}).set_stride({k, 1, k, k});
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

PlanKey key_of(const at::Tensor& dy, const MathFlags& flags) {
  PlanKey key;
  key.fields = {3, // graph kind: bias-gradient reduction
                static_cast<int64_t>(dy.scalar_type()),
                dy.device().index(), // fields[2]: the device (plan_store::load leaves it out)
                dy.size(0),
                dy.size(1),
                dy.size(2),
                dy.size(3),
                pointer_alignment(dy),
                flags.deterministic,
                flags.benchmark};
  return key;
}

std::optional<plan_store::Json> plan_record(const ReductionPlan& plan) {
  plan_store::Json r{{"failure", plan.failure}};
  return plan_store::put_graph(r, plan.graph, plan.engine) ? std::optional(r) : std::nullopt;
}

std::shared_ptr<const ReductionPlan> plan_from_record(const plan_store::Json& r, const at::Tensor& dy) {
  auto plan = std::make_shared<ReductionPlan>();
  plan->failure = r.at("failure").get<std::string>();
  const auto dims = dims_of(dy);
  const int64_t k = dims[1];
  const plan_store::ExpectedTensors expected{
      {kDY, {as_vector(dims), channels_last_strides(dims)}}, {kDB, {{1, k, 1, 1}, {k, 1, k, k}}}};
  return plan_store::take_graph(r, expected, plan->graph, plan->engine, &plan->failure) ? plan : nullptr;
}

std::shared_ptr<const ReductionPlan> build_plan(const at::Tensor& dy, const MathFlags& flags) {
  auto plan = std::make_shared<ReductionPlan>();
  SelectionPolicy policy = default_policy(dy.scalar_type(), flags);
  // The one engine that takes the graph notes TENSOR_CORE; for a reduction that is not TF32 rounding.
  policy.float32_io = false;
  const at::Tensor db = at::empty({dy.size(1)}, dy.options().dtype(at::kFloat));
  GraphAttempt attempt = build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(dy, handle, why); }, policy,
      VariantPack{{kDY, dy.data_ptr()}, {kDB, db.data_ptr()}}, dy.device(), [&] { return describe(dy); });
  plan->graph = attempt.graph;
  plan->engine = attempt.engine;
  plan->failure = attempt.failure;
  plan->transient = !plan->graph && attempt.engine.transient;
  return plan;
}

std::shared_ptr<const ReductionPlan> plan_for(const at::Tensor& dy) {
  const MathFlags flags = current_math_flags();
  const PlanKey key = key_of(dy, flags);
  return lookup_plan<ReductionPlan>(
      cache(), "bias_grad", key, requested_tuning(flags) != Tuning::Untimed,
      [&](const plan_store::Json& r) { return plan_from_record(r, dy); }, [&] { return build_plan(dy, flags); },
      &plan_record, nullptr, nullptr);
}

} // namespace

bool bias_reduction_applies(const at::Tensor& grad_output) {
  const auto dtype = grad_output.scalar_type();
  // torch.backends.cudnn.enabled = False: no cuDNN at all, as for ATen's own ops.
  return at::globalContext().userEnabledCuDNN() && grad_output.dim() == 4 && grad_output.is_cuda() && grad_output.numel() > 0 &&
      grad_output.is_contiguous(at::MemoryFormat::ChannelsLast) && pointer_alignment(grad_output) >= 16 &&
      (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) &&
      grad_output.numel() <= std::numeric_limits<int32_t>::max();
}

std::optional<at::Tensor> bias_grad_cudnn(const at::Tensor& grad_output) {
  TORCH_INTERNAL_ASSERT(bias_reduction_applies(grad_output));
  const auto plan = plan_for(grad_output);
  if (!plan->graph) {
    return std::nullopt;
  }
  at::Tensor db = at::empty({grad_output.size(1)}, grad_output.options().dtype(at::kFloat));
  VariantPack pack{{kDY, grad_output.data_ptr()}, {kDB, db.data_ptr()}};
  execute_plan(*plan->graph, plan->engine, pack, grad_output.options(), [&] { return describe(grad_output); });
  return db.to(grad_output.scalar_type());
}

std::string bias_reduction_failure(const at::Tensor& grad_output) {
  const auto plan = plan_for(grad_output);
  return plan->failure;
}

CacheStats bias_reduction_cache_stats() {
  return cache().eager.stats();
}

void bias_reduction_cache_clear() {
  cache().clear();
}

} // namespace convbias::cuda

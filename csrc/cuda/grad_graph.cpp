#include "cuda/grad_graph.h"

namespace convbias::cuda {

PlanKey gradient_plan_key(
    int64_t kind, at::ScalarType dtype, c10::DeviceIndex device, const std::array<std::array<int64_t, 4>, 3>& dims,
    const ConvParams& params, const std::array<int64_t, 3>& alignments, const MathFlags& flags) {
  PlanKey key;
  auto& f = key.fields;
  f.reserve(36);
  f.push_back(kind);
  f.push_back(static_cast<int64_t>(dtype));
  f.push_back(device);
  for (const auto& d : dims) {
    f.insert(f.end(), d.begin(), d.end());
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

std::optional<plan_store::Json> gradient_plan_record(const GradGraphPlan& plan) {
  plan_store::Json r{{"graph_ms", plan.graph_ms}, {"aten_ms", plan.aten_ms}, {"notes", plan.notes}};
  return plan_store::put_graph(r, plan.graph, plan.engine) ? std::optional(r) : std::nullopt;
}

std::shared_ptr<const GradGraphPlan> gradient_plan_from_record(
    const plan_store::Json& record, const plan_store::ExpectedTensors& expected) {
  auto plan = std::make_shared<GradGraphPlan>();
  std::string why;
  if (!plan_store::take_graph(record, expected, plan->graph, plan->engine, &why)) {
    return nullptr;
  }
  plan->timed = true;
  plan->graph_ms = record.at("graph_ms").get<float>();
  plan->aten_ms = record.at("aten_ms").get<float>();
  plan->notes = record.at("notes").get<std::vector<std::string>>();
  plan->notes.push_back("loaded from the persistent plan cache");
  return plan;
}

} // namespace convbias::cuda

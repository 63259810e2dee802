// The opt-in persistent plan cache (TORCH_CONVBIAS_PLAN_CACHE_DIR): the plans one process chose (engine, path,
// and cuDNN's own serialization of the execution plans) written to disk, so that a later process with the same
// GPU model, cuDNN and frontend loads them instead of querying heuristics, building and timing candidates again.
//
// Nothing read back is trusted blindly: a record is used only when its file's magic and checksum, format version,
// environment (GPU name, compute capability, multiprocessor count, cuDNN and frontend versions), the TORCH_CONVBIAS_*
// knobs that shape choices, plan kind and full key all match, the graph stored with the plan has the problem's
// tensor shapes and strides (and, for forward plans, the operations its record says it runs: the activation's node),
// and cuDNN rebuilds its execution plans for this device with the workspace recorded.
// Anything else counts as rejected and the plan is built afresh (and the file rewritten). Only timed choices are
// written: an untimed one (heuristics' first plan) costs little to make again, and a choice made while memory was
// short (a candidate skipped for its workspace) is not a final one. Errors other than "this record does not fit"
// (a broken CUDA context, say) are raised, not taken for a rejected record.
//
// The directory must be trusted: plans are loaded into cuDNN from it. Files and directories are created private to
// the user (0600 / 0700); temporary files left by a process that died while writing are removed.
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/graph_common.h"
#include "cuda/plan_cache.h"

namespace convbias::cuda::plan_store {

using Json = nlohmann::json;

// Whether TORCH_CONVBIAS_PLAN_CACHE_DIR names a directory (read once, with the other knobs).
bool enabled();

// The stored record of plan `kind` ("forward", "weight_grad", "bias_grad") for `key` on the current device, or
// nullopt when there is none or it is rejected (see above). `key.fields[2]` must be the device index: it is left
// out on disk, since a plan built on one GPU runs on any GPU of the same model.
std::optional<Json> load(const char* kind, const PlanKey& key);

// Writes `record` for `key` (atomically: a temporary file renamed into place). Failures (a read-only directory, a
// full disk) warn once and are otherwise ignored: the in-memory plan is unaffected.
void save(const char* kind, const PlanKey& key, const Json& record);

// The dims and strides (NCHW-ordered) of a graph's tensor, by uid: what a loaded plan must have been built for.
struct TensorShape {
  std::vector<int64_t> dims, strides;
};
using ExpectedTensors = std::map<int64_t, TensorShape>;

// record["graph"]: `engine`'s plan of `graph` (and its lower-workspace fallback) with the engine's description, as
// cuDNN serializes execution plans together with the frontend's description of the graph, or null without a
// graph; false when cuDNN cannot serialize the plan (the plan is then not stored).
bool put_graph(Json& record, const std::shared_ptr<fe::graph::Graph>& graph, const EngineChoice& engine);

// record["graph"] rebuilt into `graph` and `engine` (left empty when it is null) for the current device, after
// checking that the stored graph's tensors with the uids of `expected` have those dims and strides and, when
// `expected_operations` is not empty, that its operations (graph_operations) are those; false (and why) when they
// differ or cuDNN does not rebuild the plan with the workspace recorded.
bool take_graph(
    const Json& record, const ExpectedTensors& expected, std::shared_ptr<fe::graph::Graph>& graph,
    EngineChoice& engine, std::string* why, const std::vector<std::string>& expected_operations = {});

// (name, ms) timings as stored.
Json timings_json(const std::vector<std::pair<std::string, float>>& timings);
std::vector<std::pair<std::string, float>> timings_from(const Json& j);

// Counted by load_or_build: a record turned into a plan, or one refused by its kind.
void count_hit();
void count_rejected();

// Why the latest record was rejected (StoreStats::last_rejection).
void note_rejection(const std::string& why);

// The plan of `kind` for `key`: from its stored record (`from_record`, which returns null, or throws a json error,
// to refuse it), else built by `build` and stored (`to_record`; nullopt: not storable) when it was `timed` and is not
// transient. Without a directory, or when the choice is not `timed`: `build()`.
template <typename Plan>
std::shared_ptr<const Plan> load_or_build(
    const char* kind,
    const PlanKey& key,
    bool timed,
    const std::function<std::shared_ptr<const Plan>(const Json&)>& from_record,
    const std::function<std::shared_ptr<const Plan>()>& build,
    const std::function<std::optional<Json>(const Plan&)>& to_record) {
  if (!enabled() || !timed) {
    return build();
  }
  if (auto record = load(kind, key)) {
    std::shared_ptr<const Plan> plan;
    try {
      plan = from_record(*record);
    } catch (const Json::exception&) {
      plan = nullptr; // a field missing or of the wrong type
    }
    if (plan) {
      count_hit();
      return plan;
    }
    count_rejected();
  }
  std::shared_ptr<const Plan> plan = build();
  if (plan->transient) {
    return plan;
  }
  std::optional<Json> record;
  try {
    record = to_record(*plan);
  } catch (const Json::exception&) {
    record = std::nullopt;
  }
  if (record) {
    save(kind, key, *record);
  }
  return plan;
}

struct StoreStats {
  int64_t hits = 0; // records loaded and used
  int64_t misses = 0; // no record for a key
  int64_t writes = 0; // records written
  int64_t rejected = 0; // records found but not used (see above)
  std::string last_rejection; // why the latest one was rejected
};
StoreStats stats();

} // namespace convbias::cuda::plan_store

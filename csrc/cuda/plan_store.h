// The opt-in persistent plan cache (TORCH_CONVBIAS_PLAN_CACHE_DIR): the plans one process chose (engine, path,
// and cuDNN's own serialization of the execution plans) written to disk, so that a later process with the same
// GPU model, cuDNN and frontend loads them instead of querying heuristics, building and timing candidates again.
//
// Nothing read back is trusted blindly: a record is used only when its file's magic and checksum, format version,
// environment (GPU name, compute capability, multiprocessor count, cuDNN and frontend versions), plan kind and
// full key all match, and cuDNN rebuilds its execution plans for this device with the workspace and engine name
// recorded. Anything else counts as rejected and the plan is built afresh (and the file rewritten).
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

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

// `engine`'s plan of `graph` (and its lower-workspace fallback) with the engine's description, as cuDNN serializes
// execution plans; nullopt when cuDNN cannot serialize the plan (the plan is then not stored).
std::optional<Json> graph_record(fe::graph::Graph& graph, const EngineChoice& engine);

// The graph and engine a graph_record describes, rebuilt by cuDNN for the current device; nullopt (and why)
// when cuDNN refuses it or it differs from what was recorded.
struct LoadedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  EngineChoice engine;
};
std::optional<LoadedGraph> load_graph(const Json& record, std::string* why);

// record["graph"] = graph_record(*graph, engine), or null without a graph; false when it cannot be serialized.
bool put_graph(Json& record, const std::shared_ptr<fe::graph::Graph>& graph, const EngineChoice& engine);

// record["graph"] rebuilt into `graph` and `engine` (left empty when it is null); false when cuDNN does not
// rebuild it (`why` says so).
bool take_graph(
    const Json& record, std::shared_ptr<fe::graph::Graph>& graph, EngineChoice& engine, std::string* why);

// (name, ms) timings as stored.
Json timings_json(const std::vector<std::pair<std::string, float>>& timings);
std::vector<std::pair<std::string, float>> timings_from(const Json& j);

// Counted by load_or_build: a record turned into a plan, or one refused by its kind.
void count_hit();
void count_rejected();

// The plan of `kind` for `key`: from its stored record (`from_record`, which returns null, or throws, to refuse
// it), else built by `build` and stored (`to_record`; nullopt: not storable). Without a directory: `build()`.
template <typename Plan>
std::shared_ptr<const Plan> load_or_build(
    const char* kind,
    const PlanKey& key,
    const std::function<std::shared_ptr<const Plan>(const Json&)>& from_record,
    const std::function<std::shared_ptr<const Plan>()>& build,
    const std::function<std::optional<Json>(const Plan&)>& to_record) {
  if (!enabled()) {
    return build();
  }
  if (auto record = load(kind, key)) {
    std::shared_ptr<const Plan> plan;
    try {
      plan = from_record(*record);
    } catch (const std::exception&) {
      plan = nullptr; // a field missing or of the wrong type: json's exceptions
    }
    if (plan) {
      count_hit();
      return plan;
    }
    count_rejected();
  }
  std::shared_ptr<const Plan> plan = build();
  std::optional<Json> record;
  try {
    record = to_record(*plan);
  } catch (const std::exception&) {
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
};
StoreStats stats();

} // namespace convbias::cuda::plan_store

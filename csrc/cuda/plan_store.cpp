#include "cuda/plan_store.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cudnn/Handle.h>
#include <c10/util/Exception.h>
#include <cudnn_frontend_version.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "cuda/knobs.h"

namespace convbias::cuda::plan_store {
namespace {

namespace fs = std::filesystem;

// Bumped whenever a record's layout or the meaning of a key's fields changes: older files are then rejected.
constexpr int64_t kFormatVersion = 1;
constexpr char kMagic[8] = {'C', 'V', 'B', 'P', 'L', 'A', 'N', '1'};

std::atomic<int64_t> hit_count{0}, miss_count{0}, write_count{0}, reject_count{0};

// FNV-1a, 64 bits: catches truncated and corrupted files (not a defence against a forger, who could write any
// file the process can read anyway).
uint64_t checksum(const std::vector<uint8_t>& bytes) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (const uint8_t b : bytes) {
    hash = (hash ^ b) * 0x100000001b3ULL;
  }
  return hash;
}

// What a stored plan is valid for: the GPU model (name, compute capability, multiprocessor count) and the cuDNN
// and frontend versions the process runs with.
Json environment() {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return Json{
      {"gpu", prop->name},
      {"compute_capability", prop->major * 10 + prop->minor},
      {"multiprocessors", prop->multiProcessorCount},
      {"cudnn", static_cast<int64_t>(cudnnGetVersion())},
      {"cudnn_frontend", static_cast<int64_t>(CUDNN_FRONTEND_VERSION)},
      {"format", kFormatVersion}};
}

// A directory name for the environment: readable, one per GPU model and library versions.
std::string environment_dir(const Json& env) {
  std::ostringstream name;
  name << env["gpu"].get<std::string>() << "-sm" << env["compute_capability"].get<int64_t>() << "-"
       << env["multiprocessors"].get<int64_t>() << "sm-cudnn" << env["cudnn"].get<int64_t>() << "-fe"
       << env["cudnn_frontend"].get<int64_t>() << "-v" << kFormatVersion;
  std::string safe = name.str();
  for (char& c : safe) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') {
      c = '_';
    }
  }
  return safe;
}

std::vector<int64_t> disk_key(const PlanKey& key) {
  std::vector<int64_t> fields = key.fields;
  TORCH_INTERNAL_ASSERT(fields.size() > 2);
  fields[2] = 0; // the device index: any GPU of the model runs the plan
  return fields;
}

fs::path record_path(const char* kind, const std::vector<int64_t>& fields, const Json& env) {
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(PlanKeyHash{}(PlanKey{fields})));
  return fs::path(knobs().plan_cache_dir) / environment_dir(env) / (std::string(kind) + "-" + hash + ".plan");
}

std::optional<std::vector<uint8_t>> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return std::nullopt;
  }
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The record inside a file's bytes, or why it is not usable.
std::optional<Json> parse(
    const std::vector<uint8_t>& bytes, const char* kind, const std::vector<int64_t>& fields, const Json& env,
    std::string* why) {
  constexpr size_t header = sizeof(kMagic) + sizeof(uint64_t);
  if (bytes.size() < header || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    *why = "not a torch_convbias plan file";
    return std::nullopt;
  }
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + sizeof(kMagic), sizeof(stored));
  const std::vector<uint8_t> body(bytes.begin() + header, bytes.end());
  if (checksum(body) != stored) {
    *why = "checksum mismatch (truncated or corrupted)";
    return std::nullopt;
  }
  Json j = Json::from_cbor(body, /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    *why = "unreadable contents";
    return std::nullopt;
  }
  if (j.value("environment", Json()) != env) {
    *why = "written for another GPU, cuDNN, frontend or format";
    return std::nullopt;
  }
  if (j.value("kind", std::string()) != kind || j.value("key", Json()) != Json(fields)) {
    *why = "written for another problem";
    return std::nullopt;
  }
  if (!j.contains("record") || !j["record"].is_object()) {
    *why = "no record";
    return std::nullopt;
  }
  return j["record"];
}

void warn_once(const std::string& message) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    TORCH_WARN("convbias: persistent plan cache (TORCH_CONVBIAS_PLAN_CACHE_DIR=", knobs().plan_cache_dir, "): ", message);
  }
}

std::vector<uint8_t> as_bytes(const Json& binary) {
  return binary.get_binary();
}

std::optional<std::vector<uint8_t>> serialize_plan(fe::graph::Graph& graph, int64_t index) {
  try {
    // serialize() writes the graph's current candidate: building the (already built) plan at `index` again
    // makes it the candidate without rebuilding it.
    if (graph.build_plan_at_index(index).is_bad()) {
      return std::nullopt;
    }
    std::vector<uint8_t> data;
    if (graph.serialize(data, /*serialize_structure=*/false).is_bad()) {
      return std::nullopt;
    }
    return data;
  } catch (const std::exception&) {
    return std::nullopt; // the frontend may throw where the backend cannot describe a plan
  }
}

std::shared_ptr<fe::graph::Graph> deserialize_plan(const std::vector<uint8_t>& data, std::string* why) {
  auto graph = std::make_shared<fe::graph::Graph>();
  try {
    auto status = graph->deserialize(
        at::native::getCudnnHandle(), data, /*enforce_precompiled=*/false, /*run_warmup=*/false);
    if (status.is_bad()) {
      *why = "cuDNN did not rebuild the plan: " + status.get_message();
      return nullptr;
    }
  } catch (const std::exception& e) {
    *why = std::string("cuDNN did not rebuild the plan: ") + e.what();
    return nullptr;
  }
  return graph;
}

} // namespace

bool enabled() {
  return !knobs().plan_cache_dir.empty();
}

std::optional<Json> load(const char* kind, const PlanKey& key) {
  if (!enabled()) {
    return std::nullopt;
  }
  const Json env = environment();
  const std::vector<int64_t> fields = disk_key(key);
  const fs::path path = record_path(kind, fields, env);
  const auto bytes = read_file(path);
  if (!bytes) {
    ++miss_count;
    return std::nullopt;
  }
  std::string why;
  auto record = parse(*bytes, kind, fields, env, &why);
  if (!record) {
    ++reject_count;
    warn_once("ignored " + path.string() + ": " + why);
    return std::nullopt;
  }
  return record;
}

void save(const char* kind, const PlanKey& key, const Json& record) {
  if (!enabled()) {
    return;
  }
  const Json env = environment();
  const std::vector<int64_t> fields = disk_key(key);
  const fs::path path = record_path(kind, fields, env);
  const std::vector<uint8_t> body = Json::to_cbor(Json{{"environment", env}, {"kind", kind}, {"key", fields}, {"record", record}});
  const uint64_t sum = checksum(body);
  std::ostringstream tmp_name;
  tmp_name << path.filename().string() << ".tmp." << getpid() << "." << std::this_thread::get_id();
  const fs::path tmp = path.parent_path() / tmp_name.str();
  std::error_code error;
  fs::create_directories(path.parent_path(), error);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(kMagic, sizeof(kMagic));
    out.write(reinterpret_cast<const char*>(&sum), sizeof(sum));
    out.write(reinterpret_cast<const char*>(body.data()), static_cast<std::streamsize>(body.size()));
    if (!out) {
      warn_once("cannot write " + tmp.string() + (error ? " (" + error.message() + ")" : "") + "; plans are not stored");
      fs::remove(tmp, error);
      return;
    }
  }
  // rename() replaces atomically: a reader sees the old file or the new one, never half of one.
  fs::rename(tmp, path, error);
  if (error) {
    warn_once("cannot rename " + tmp.string() + " to " + path.string() + " (" + error.message() + ")");
    fs::remove(tmp, error);
    return;
  }
  ++write_count;
}

Json timings_json(const std::vector<std::pair<std::string, float>>& timings) {
  Json j = Json::array();
  for (const auto& [name, ms] : timings) {
    j.push_back(Json::array({name, ms}));
  }
  return j;
}

std::vector<std::pair<std::string, float>> timings_from(const Json& j) {
  std::vector<std::pair<std::string, float>> timings;
  for (const auto& entry : j) {
    timings.emplace_back(entry.at(0).get<std::string>(), entry.at(1).get<float>());
  }
  return timings;
}

std::optional<Json> graph_record(fe::graph::Graph& graph, const EngineChoice& e) {
  std::optional<std::vector<uint8_t>> fallback;
  if (e.fallback_plan_index >= 0 && !e.fallback_graph) {
    fallback = serialize_plan(graph, e.fallback_plan_index);
  }
  const auto plan = serialize_plan(graph, e.plan_index); // last: the graph's candidate stays the chosen plan
  if (!plan) {
    return std::nullopt;
  }
  return Json{
      {"plan", Json::binary(*plan)},
      {"fallback", fallback ? Json::binary(*fallback) : Json()},
      {"engine",
       {{"name", e.engine},
        {"workspace_bytes", e.workspace_bytes},
        {"runtime_compiled", e.runtime_compiled},
        {"build_seconds", e.build_seconds},
        {"measured_ms", e.measured_ms},
        {"heuristic_candidates", e.heuristic_candidates},
        {"swept", e.swept},
        {"built", e.built},
        {"rejected", e.rejected},
        {"timings", timings_json(e.timings)},
        {"fallback_engine", e.fallback_engine},
        {"fallback_workspace_bytes", e.fallback_workspace_bytes}}}};
}

std::optional<LoadedGraph> load_graph(const Json& record, std::string* why) {
  const auto start = std::chrono::steady_clock::now();
  LoadedGraph loaded;
  loaded.graph = deserialize_plan(as_bytes(record.at("plan")), why);
  if (!loaded.graph) {
    return std::nullopt;
  }
  const Json& e = record.at("engine");
  EngineChoice& engine = loaded.engine;
  engine.plan_index = 0; // a deserialized graph holds one plan
  // Its name comes from the record: a deserialized graph has an execution plan but no engine configuration,
  // which is what the frontend reads plan names from. The workspace comes from the rebuilt plan itself.
  engine.engine = e.at("name").get<std::string>();
  if (loaded.graph->get_workspace_size_plan_at_index(0, engine.workspace_bytes).is_bad() ||
      engine.workspace_bytes != e.at("workspace_bytes").get<int64_t>()) {
    *why = "the rebuilt plan needs " + std::to_string(engine.workspace_bytes) + " bytes of workspace, not the " +
        std::to_string(e.at("workspace_bytes").get<int64_t>()) + " recorded";
    return std::nullopt;
  }
  engine.runtime_compiled = e.at("runtime_compiled").get<bool>();
  engine.measured_ms = e.at("measured_ms").get<float>();
  engine.heuristic_candidates = e.at("heuristic_candidates").get<int64_t>();
  engine.swept = e.at("swept").get<int64_t>();
  engine.built = e.at("built").get<int64_t>();
  engine.rejected = e.at("rejected").get<std::vector<std::string>>();
  engine.timings = timings_from(e.at("timings"));
  engine.from_disk = true;
  if (record.at("fallback").is_binary()) {
    std::string fallback_why;
    if (auto fallback = deserialize_plan(as_bytes(record.at("fallback")), &fallback_why)) {
      int64_t bytes = 0;
      if (fallback->get_workspace_size_plan_at_index(0, bytes).is_good() && bytes < engine.workspace_bytes) {
        engine.fallback_graph = fallback;
        engine.fallback_plan_index = 0;
        engine.fallback_workspace_bytes = bytes;
        engine.fallback_engine = e.at("fallback_engine").get<std::string>();
      }
    }
  }
  engine.build_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return loaded;
}

bool put_graph(Json& record, const std::shared_ptr<fe::graph::Graph>& graph, const EngineChoice& engine) {
  record["graph"] = nullptr;
  if (!graph) {
    return true;
  }
  auto stored = graph_record(*graph, engine);
  if (!stored) {
    return false;
  }
  record["graph"] = std::move(*stored);
  return true;
}

bool take_graph(
    const Json& record, std::shared_ptr<fe::graph::Graph>& graph, EngineChoice& engine, std::string* why) {
  if (record.at("graph").is_null()) {
    return true;
  }
  auto loaded = load_graph(record.at("graph"), why);
  if (!loaded) {
    return false;
  }
  graph = loaded->graph;
  engine = loaded->engine;
  return true;
}

StoreStats stats() {
  return StoreStats{hit_count.load(), miss_count.load(), write_count.load(), reject_count.load()};
}

void count_hit() {
  ++hit_count;
}

void count_rejected() {
  ++reject_count;
}

} // namespace convbias::cuda::plan_store

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

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <set>

#include "cuda/knobs.h"

namespace convbias::cuda::plan_store {
namespace {

namespace fs = std::filesystem;

// Bumped whenever a record's layout or the meaning of a key's fields changes: older files are then rejected.
// 2: the knobs and "timed" in every file, the graph's description stored with its plan.
// 3: the activation in forward keys and records (its epilogue checked in the stored graph), the ACTIVATION knob.
// 4: keep_preactivation in forward keys, "preactivation_output" in forward records (the second output checked).
// 5: the residual (forward_residual) in forward keys, "residual_fused" in forward records.
// 6: the routes behind forward records changed (16-bit activation passes after a graph are ours; "aten" with a bias and
//    an activation is ATen's convolution + our bias and activation pass): choices timed before compared other routes.
// 7: "via_padded_channels" in forward and weight-gradient records (a plan run on zero-padded input channels; the
//    weight gradient's also "padded_ms" / "as_is_ms"), the PAD_CHANNELS knob.
// 8: engines that down-convert their inputs are never chosen (graph_common.cpp): a float32 plan chosen under TF32
//    before may be one.
// 9: "via_space_to_depth" in forward and weight-gradient records (a strided stem run over its regrouped input; the
//    weight gradient's also "space_to_depth_ms" / "own_way_ms"), the SPACE_TO_DEPTH knob.
// 10: "via_space_to_depth" also for stride-1 stems (run as a 1x1 convolution over their unfolded patches): choices
//    timed before never measured that way.
// 11: "residual_bias_in_pass" in forward records (a residual problem's ATen path measured against ATen's convolution
//     without its bias + one pass adding both).
// 12: residual graphs add the residual before the bias (ATen's order): engines chosen for the old graph may not run.
constexpr int64_t kFormatVersion = 12;
constexpr char kMagic[8] = {'C', 'V', 'B', 'P', 'L', 'A', 'N', '1'};

std::atomic<int64_t> hit_count{0}, miss_count{0}, write_count{0}, reject_count{0};
std::mutex rejection_mutex;
std::string last_rejection_reason;

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

// The TORCH_CONVBIAS_* knobs that shape a choice: a record made under other values is not used.
Json knob_values() {
  const Knobs& k = knobs();
  return Json{
      {"path", k.path},
      {"activation", k.activation},
      {"nchw", k.nchw},
      {"pad_channels", k.pad_channels},
      {"space_to_depth", k.space_to_depth},
      {"autotune", k.autotune},
      {"no_runtime_compilation", !k.allow_runtime_compiled},
      {"time_runtime_compiled", k.time_runtime_compiled},
      {"param_grad", k.param_grad},
      {"input_grad", k.input_grad},
      {"bias_grad", k.bias_grad}};
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
  if (j.value("knobs", Json()) != knob_values()) {
    *why = "written under other TORCH_CONVBIAS_* knobs (" + j.value("knobs", Json()).dump() + ", now " +
        knob_values().dump() + ")";
    return std::nullopt;
  }
  if (j.value("kind", std::string()) != kind || j.value("key", Json()) != Json(fields)) {
    *why = "written for another problem";
    return std::nullopt;
  }
  if (j.value("timed", false) != true) {
    *why = "an untimed choice";
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
    // With the graph's structure: its tensors' dims and strides are checked against the problem on load.
    if (graph.serialize(data, /*serialize_structure=*/true).is_bad()) {
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
    // The frontend throws where the backend refuses the plan; a broken CUDA context is not a refusal.
    raise_if_context_broken();
    *why = std::string("cuDNN did not rebuild the plan: ") + e.what();
    return nullptr;
  }
  return graph;
}

// Whether the graph stored with a plan (serialize_plan) has the expected tensors and (when given) operations.
bool structure_matches(
    const std::vector<uint8_t>& data, const ExpectedTensors& expected, const std::vector<std::string>& operations,
    std::string* why) {
  const Json j = Json::from_ubjson(data, /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("tensors") || !j["tensors"].is_array()) {
    *why = "the stored plan has no graph description";
    return false;
  }
  std::map<int64_t, TensorShape> stored;
  for (const auto& t : j["tensors"]) {
    if (t.contains("uid") && t.contains("dim") && t.contains("stride")) {
      stored[t["uid"].get<int64_t>()] = {t["dim"].get<std::vector<int64_t>>(), t["stride"].get<std::vector<int64_t>>()};
    }
  }
  for (const auto& [uid, shape] : expected) {
    auto it = stored.find(uid);
    if (it == stored.end() || it->second.dims != shape.dims || it->second.strides != shape.strides) {
      std::ostringstream s;
      s << "the stored plan's tensor " << uid << " is "
        << (it == stored.end() ? std::string("missing")
                               : "dims " + Json(it->second.dims).dump() + " strides " + Json(it->second.strides).dump())
        << ", the problem's dims " << Json(shape.dims).dump() << " strides " << Json(shape.strides).dump();
      *why = s.str();
      return false;
    }
  }
  if (!operations.empty()) {
    const std::vector<std::string> stored_operations = graph_operations(j.value("nodes", Json::array()));
    if (stored_operations != operations) {
      *why = "the stored plan's graph runs " + Json(stored_operations).dump() + ", the problem needs " +
          Json(operations).dump();
      return false;
    }
  }
  return true;
}

// Creates the missing directories of `dir`, each private to the user (0700); false when one cannot be created.
bool create_private_directories(const fs::path& dir) {
  std::error_code error;
  fs::path prefix;
  for (const auto& part : dir) {
    prefix /= part;
    if (fs::exists(prefix, error)) {
      continue;
    }
    if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return false;
    }
  }
  return fs::is_directory(dir, error);
}

// Removes temporary files (`<name>.tmp.<pid>.<thread>`) of processes that no longer exist, and any older than an
// hour, from `dir`: once per directory and process.
void remove_stale_temporaries(const fs::path& dir) {
  static std::mutex mutex;
  static std::set<std::string> swept;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (!swept.insert(dir.string()).second) {
      return;
    }
  }
  std::error_code error;
  const auto now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    const size_t tmp = name.find(".tmp.");
    if (tmp == std::string::npos) {
      continue;
    }
    const long pid = std::strtol(name.c_str() + tmp + 5, nullptr, 10);
    const bool writer_gone = pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    std::error_code time_error;
    const auto written = fs::last_write_time(it->path(), time_error);
    const bool old = !time_error && now - written > std::chrono::hours(1);
    if (writer_gone || old) {
      std::error_code remove_error;
      fs::remove(it->path(), remove_error);
    }
  }
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
  remove_stale_temporaries(path.parent_path());
  const auto bytes = read_file(path);
  if (!bytes) {
    ++miss_count;
    return std::nullopt;
  }
  std::string why;
  auto record = parse(*bytes, kind, fields, env, &why);
  if (!record) {
    ++reject_count;
    note_rejection(why);
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
  const std::vector<uint8_t> body = Json::to_cbor(Json{
      {"environment", env}, {"knobs", knob_values()}, {"kind", kind}, {"key", fields}, {"timed", true},
      {"record", record}});
  const uint64_t sum = checksum(body);
  std::ostringstream tmp_name;
  tmp_name << path.filename().string() << ".tmp." << getpid() << "." << std::this_thread::get_id();
  const fs::path tmp = path.parent_path() / tmp_name.str();
  std::error_code error;
  if (!create_private_directories(path.parent_path())) {
    warn_once("cannot create " + path.parent_path().string() + " (" + std::strerror(errno) + "); plans are not stored");
    return;
  }
  remove_stale_temporaries(path.parent_path());
  {
    // Private to the user whatever the umask: plans are loaded into cuDNN from here.
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    bool written = fd >= 0 && ::fchmod(fd, 0600) == 0;
    auto write_all = [&](const void* data, size_t size) {
      const char* p = static_cast<const char*>(data);
      while (written && size > 0) {
        const ssize_t n = ::write(fd, p, size);
        if (n < 0 && errno == EINTR) {
          continue;
        }
        written = n > 0;
        p += written ? n : 0;
        size -= written ? static_cast<size_t>(n) : size;
      }
    };
    write_all(kMagic, sizeof(kMagic));
    write_all(&sum, sizeof(sum));
    write_all(body.data(), body.size());
    const int saved_errno = errno;
    if (fd >= 0 && ::close(fd) != 0) {
      written = false;
    }
    if (!written) {
      warn_once("cannot write " + tmp.string() + " (" + std::strerror(saved_errno) + "); plans are not stored");
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

namespace {

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
        {"runtime_compiled_built", e.runtime_compiled_built},
        {"rejected", e.rejected},
        {"timings", timings_json(e.timings)},
        {"fallback_engine", e.fallback_engine},
        {"fallback_workspace_bytes", e.fallback_workspace_bytes}}}};
}

struct LoadedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  EngineChoice engine;
};

std::optional<LoadedGraph> load_graph(
    const Json& record, const ExpectedTensors& expected, const std::vector<std::string>& operations, std::string* why) {
  const auto start = std::chrono::steady_clock::now();
  LoadedGraph loaded;
  const std::vector<uint8_t> plan = as_bytes(record.at("plan"));
  if (!structure_matches(plan, expected, operations, why)) {
    return std::nullopt;
  }
  loaded.graph = deserialize_plan(plan, why);
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
  engine.runtime_compiled_built = e.value("runtime_compiled_built", int64_t{0}); // not in records before it
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

} // namespace

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
    const Json& record, const ExpectedTensors& expected, std::shared_ptr<fe::graph::Graph>& graph,
    EngineChoice& engine, std::string* why, const std::vector<std::string>& expected_operations) {
  if (record.at("graph").is_null()) {
    return true;
  }
  auto loaded = load_graph(record.at("graph"), expected, expected_operations, why);
  if (!loaded) {
    note_rejection(*why);
    return false;
  }
  graph = loaded->graph;
  engine = loaded->engine;
  return true;
}

void note_rejection(const std::string& why) {
  const std::lock_guard<std::mutex> lock(rejection_mutex);
  last_rejection_reason = why;
}

StoreStats stats() {
  const std::lock_guard<std::mutex> lock(rejection_mutex);
  return StoreStats{hit_count.load(), miss_count.load(), write_count.load(), reject_count.load(), last_rejection_reason};
}

void count_hit() {
  ++hit_count;
}

void count_rejected() {
  ++reject_count;
}

} // namespace convbias::cuda::plan_store

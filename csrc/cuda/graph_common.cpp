#include "cuda/graph_common.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cudnn/Handle.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <unordered_map>
#include <sstream>

#include "cuda/test_hook.h"

namespace convbias::cuda {

fe::DataType_t to_frontend_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return fe::DataType_t::HALF;
    case at::kBFloat16: return fe::DataType_t::BFLOAT16;
    case at::kFloat: return fe::DataType_t::FLOAT;
    case at::kDouble: return fe::DataType_t::DOUBLE;
    default: TORCH_CHECK(false, "convbias: no cuDNN data type for ", t);
  }
}

int64_t pointer_alignment(const at::Tensor& t) {
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t alignment = 16;
  while (alignment > 1 && address % alignment != 0) {
    alignment /= 2;
  }
  return alignment;
}

at::Tensor aligned_for_cudnn(const at::Tensor& t, at::MemoryFormat format, bool* copied) {
  if (pointer_alignment(t) >= 16) {
    return t;
  }
  if (copied != nullptr) {
    *copied = true;
  }
  return t.clone(format);
}

std::string last_cudnn_error() {
  char message[1024] = {0};
  cudnnGetLastErrorString(message, sizeof(message));
  return message;
}

void throw_graph_error(const std::string& what, fe::error_t status, const std::string& hint) {
  const std::string cudnn_message = last_cudnn_error();
  TORCH_CHECK(
      false, "convbias: cuDNN rejected ", what, ": ", status.get_message(),
      cudnn_message.empty() ? "" : " (cuDNN: " + cudnn_message + ")", hint.empty() ? "" : ". Hint: " + hint);
}

namespace {

using Clock = std::chrono::steady_clock;

// A bound on one key's plan selection when many candidates are timed (the engine sweep under cudnn.benchmark):
// a model's first iteration builds a few plans per conv shape and must not take minutes. Heuristics'
// candidates come first in the list, the swept engines after them, so the budget cuts the long tail.
constexpr double kTimingBudgetSeconds = 2.0; // named in the rejection note below

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool is_runtime_compiled(fe::graph::Graph& graph, int64_t index) {
  std::vector<fe::BehaviorNote_t> notes;
  if (graph.get_behavior_notes_for_plan_at_index(index, notes).is_bad()) {
    return false;
  }
  return std::find(notes.begin(), notes.end(), fe::BehaviorNote_t::RUNTIME_COMPILATION) != notes.end();
}

void note_rejection(EngineChoice& choice, const std::string& why) {
  if (choice.rejected.size() < 8) {
    choice.rejected.push_back(why);
  }
}

// Appends a plan for every engine of the operation graph that heuristics did not offer, with the engine's
// default knobs. Engines that do not take the graph fail here and are skipped; the caller's note filters apply to
// the added plans as to the others.
void add_unoffered_engines(fe::graph::Graph& graph, EngineChoice& choice) {
  std::set<int64_t> offered;
  for (int64_t i = 0; i < graph.get_execution_plan_count(); ++i) {
    int64_t engine_id = -1;
    std::unordered_map<fe::KnobType_t, int64_t> knobs;
    if (graph.get_engine_and_knobs_at_index(i, engine_id, knobs).is_good()) {
      offered.insert(engine_id);
    }
  }
  int64_t engines = 0;
  if (graph.get_engine_count(engines).is_bad()) {
    note_rejection(choice, "engine sweep: the engine count is unavailable");
    return;
  }
  for (int64_t engine_id = 0; engine_id < engines; ++engine_id) {
    if (offered.count(engine_id) == 0 && graph.create_execution_plan(engine_id, {}).is_good()) {
      ++choice.swept;
    }
  }
}

// The lower-workspace plan for `choice` (see EngineChoice::fallback_plan_index): the built plan needing the least
// workspace, or, when every built one needs some, the first further precompiled candidate that builds needing none
// (precompiled plans build in microseconds; a few are tried, never runtime-compiled ones, which cost seconds).
void choose_fallback(
    fe::graph::Graph& graph,
    EngineChoice& choice,
    const std::vector<int64_t>& built,
    const std::function<int64_t(int64_t)>& workspace_of) {
  constexpr int kFurtherCandidates = 16;
  int64_t best = -1;
  int64_t best_bytes = choice.workspace_bytes;
  for (const int64_t index : built) {
    if (const int64_t bytes = workspace_of(index); bytes < best_bytes) {
      best = index;
      best_bytes = bytes;
    }
  }
  const int64_t count = graph.get_execution_plan_count();
  int tried = 0;
  for (int64_t i = 0; (best < 0 || best_bytes > 0) && i < count && tried < kFurtherCandidates; ++i) {
    if (std::find(built.begin(), built.end(), i) != built.end() || is_runtime_compiled(graph, i)) {
      continue;
    }
    ++tried;
    if (graph.build_plan_at_index(i).is_good() && workspace_of(i) < best_bytes) {
      best = i;
      best_bytes = workspace_of(i);
    }
  }
  if (best >= 0) {
    choice.fallback_plan_index = best;
    choice.fallback_workspace_bytes = best_bytes;
    (void)graph.get_plan_name_at_index(best, choice.fallback_engine);
  }
}

std::atomic<int64_t> workspace_fallback_count{0};
TestHookCountdown injected_execution_failures; // inject_execution_failures

} // namespace

void inject_execution_failures(int64_t count) {
  injected_execution_failures.arm(count);
}

int64_t workspace_fallbacks() {
  return workspace_fallback_count.load();
}

at::Tensor try_workspace(int64_t bytes, const at::TensorOptions& options) {
  try {
    return at::empty({bytes}, options.dtype(at::kByte));
  } catch (const c10::OutOfMemoryError&) {
    return at::Tensor();
  }
}

bool stream_is_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

namespace {

// Two CUDA events, destroyed on every path (also when the timed function throws).
class EventPair {
 public:
  EventPair() {
    C10_CUDA_CHECK(cudaEventCreate(&start_));
    const cudaError_t status = cudaEventCreate(&stop_);
    if (status != cudaSuccess) {
      (void)cudaEventDestroy(start_);
      C10_CUDA_CHECK(status);
    }
  }
  ~EventPair() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;

  void record_start(cudaStream_t stream) { C10_CUDA_CHECK(cudaEventRecord(start_, stream)); }
  void record_stop(cudaStream_t stream) { C10_CUDA_CHECK(cudaEventRecord(stop_, stream)); }
  float elapsed_ms() {
    C10_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

} // namespace

float time_on_stream(const std::function<void()>& fn, float give_up_above_ms) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  EventPair events;
  // The warm-up run is timed too: a candidate already far slower than the best one is not run again.
  events.record_start(stream);
  fn();
  events.record_stop(stream);
  float ms = events.elapsed_ms();
  if (ms <= give_up_above_ms) {
    // Then the steady state of a training loop: calls queued back to back, about a millisecond of them. One call
    // runs ahead of the start event so that the GPU is busy while the timed calls are enqueued: the time per call is
    // then the GPU's, or the host's where the host cannot keep up - not GPU time plus the host's launch latency,
    // which would favour whichever candidate has less host work (a graph over ATen) on small problems.
    const int calls = std::clamp(static_cast<int>(std::ceil(1.0f / std::max(ms, 1e-3f))), 3, 20);
    fn();
    events.record_start(stream);
    for (int i = 0; i < calls; ++i) {
      fn();
    }
    events.record_stop(stream);
    ms = events.elapsed_ms() / static_cast<float>(calls);
  }
  return ms;
}

// After a candidate's execution threw: a non-sticky error left by the failed launch is cleared (the next candidate
// may run), a sticky one (the context is broken: an illegal address, a device-side assert) is raised, since no other
// candidate could run either. Never during capture, where stream queries would invalidate the capture.
void raise_if_context_broken() {
  (void)cudaGetLastError();
  const cudaError_t status = cudaStreamQuery(c10::cuda::getCurrentCUDAStream());
  if (status != cudaSuccess && status != cudaErrorNotReady) {
    C10_CUDA_CHECK(status);
  }
}

namespace {

enum class Trial { Ran, Failed, NoMemory };

// Runs candidate `index` of `graph` with a workspace of its own: timed (time_on_stream, `*ms`) or once. A failing
// execution or workspace allocation is noted in `choice` and reported, never thrown (but see raise_if_context_broken).
Trial try_candidate(
    fe::graph::Graph& graph,
    int64_t index,
    int64_t workspace_bytes,
    const std::function<void(int64_t, void*)>& run,
    c10::Device device,
    bool timed,
    float give_up,
    EngineChoice& choice,
    float* ms) {
  std::string name;
  (void)graph.get_plan_name_at_index(index, name);
  at::Tensor workspace;
  try {
    workspace = at::empty({workspace_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  } catch (const c10::OutOfMemoryError&) {
    note_rejection(choice, name + ": workspace of " + std::to_string(workspace_bytes) + " bytes: out of memory");
    choice.transient = true;
    return Trial::NoMemory;
  }
  void* workspace_ptr = workspace.data_ptr();
  try {
    if (timed) {
      *ms = time_on_stream([&] { run(index, workspace_ptr); }, give_up);
    } else {
      run(index, workspace_ptr);
    }
  } catch (const c10::OutOfMemoryError&) {
    note_rejection(choice, name + ": out of memory while running");
    choice.transient = true;
    return Trial::NoMemory;
  } catch (const c10::Error& e) {
    raise_if_context_broken();
    ++choice.execution_failures;
    note_rejection(choice, name + ": built but failed to execute: " + e.what_without_backtrace());
    return Trial::Failed;
  }
  return Trial::Ran;
}

} // namespace

EngineChoice select_engine(
    fe::graph::Graph& graph,
    cudnnHandle_t handle,
    const SelectionPolicy& policy,
    const std::function<void(int64_t, void*)>& run,
    c10::Device device) {
  const auto start = Clock::now();
  EngineChoice choice;
  if (auto status = graph.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); status.is_bad()) {
    note_rejection(choice, "heuristics: " + status.get_message());
    choice.build_seconds = seconds_since(start);
    return choice;
  }
  if (policy.sweep_engines()) {
    add_unoffered_engines(graph, choice);
  }
  // Filters as PyTorch applies them (ATen's filterEngineConfigs, Conv_v8.cpp), per graph: engines that down-convert
  // their inputs are never taken, whatever the dtype or TF32 setting (on the H100 a float32 weight gradient under TF32
  // chose one running an f16 kernel: half's 5-bit exponent flushes what TF32 keeps); TF32 engines carry TENSOR_CORE
  // on FLOAT graphs and go when TF32 is off. Reductions in reduced precision are never taken: the graphs promise FP32
  // accumulation for every I/O dtype.
  std::vector<fe::NumericalNote_t> excluded{
      fe::NumericalNote_t::REDUCED_PRECISION_REDUCTION, fe::NumericalNote_t::DOWN_CONVERT_INPUTS};
  if (policy.float32_io && !policy.flags.allow_tf32) {
    excluded.push_back(fe::NumericalNote_t::TENSOR_CORE);
  }
  if (policy.flags.deterministic) {
    excluded.push_back(fe::NumericalNote_t::NONDETERMINISTIC);
  }
  graph.deselect_numeric_notes(excluded);
  if (!policy.allow_runtime_compiled) {
    graph.deselect_behavior_notes({fe::BehaviorNote_t::RUNTIME_COMPILATION});
  }

  const int64_t count = graph.get_execution_plan_count();
  choice.heuristic_candidates = count;
  auto workspace_of = [&](int64_t index) {
    int64_t bytes = 0;
    (void)graph.get_workspace_size_plan_at_index(index, bytes);
    return bytes;
  };
  const int max_candidates = policy.max_candidates();
  const bool timed = policy.time_candidates();
  std::vector<int64_t> built;
  // Precompiled engines first: they build in microseconds, while runtime-compiled ones take 0.05-5 s and
  // were never the fastest fused engine on the H200; they are tried only when no precompiled one builds (and runs),
  // or, timed, beside them where TORCH_CONVBIAS_RUNTIME_COMPILATION=timed asks for it.
  const bool time_runtime_compiled = timed && policy.time_runtime_compiled && policy.allow_runtime_compiled;
  for (int pass = 0; pass < 2 && static_cast<int>(built.size()) < max_candidates; ++pass) {
    if (pass == 1 && !built.empty() && !time_runtime_compiled) {
      break;
    }
    for (int64_t i = 0; i < count && static_cast<int>(built.size()) < max_candidates; ++i) {
      if (is_runtime_compiled(graph, i) != (pass == 1)) {
        continue;
      }
      auto status = graph.build_plan_at_index(i);
      if (status.is_bad()) {
        std::string name;
        (void)graph.get_plan_name_at_index(i, name);
        note_rejection(choice, (name.empty() ? "plan " + std::to_string(i) : name) + ": " + status.get_message());
        continue;
      }
      // An untimed choice runs once before it is accepted; timed candidates run while they are timed, below.
      if (!timed && policy.verify_by_running &&
          try_candidate(graph, i, workspace_of(i), run, device, /*timed=*/false, 0, choice, nullptr) != Trial::Ran) {
        continue;
      }
      built.push_back(i);
      if (pass == 1) {
        ++choice.runtime_compiled_built;
      }
    }
  }
  choice.built = static_cast<int64_t>(built.size());

  if (timed && policy.verify_by_running) {
    float best = std::numeric_limits<float>::infinity();
    std::vector<int64_t> ran; // the candidates that executed: the only ones the fallback may be chosen from
    // The budget is for timing: runtime-compiled builds (seconds) must not leave it spent before the first run.
    const auto timing_start = time_runtime_compiled ? Clock::now() : start;
    for (const int64_t index : built) {
      if (seconds_since(timing_start) > kTimingBudgetSeconds && !std::isinf(best)) {
        // Always recorded (note_rejection keeps only the first few reasons).
        choice.rejected.push_back("timing budget of 2 s spent: the remaining candidates were not timed");
        break;
      }
      // Abandoned after its first run when that was over 3x (and 5 ms more than) the best so far: slow engines
      // (150 ms for eng0 on an N=1024 fp32 problem) would otherwise dominate the cold first call. The margin
      // covers a new plan's one-off first-execution cost (~2 ms).
      const float give_up = std::isinf(best) ? best : std::max(3 * best, best + 5.0f);
      float ms = 0;
      if (try_candidate(graph, index, workspace_of(index), run, device, /*timed=*/true, give_up, choice, &ms) !=
          Trial::Ran) {
        continue;
      }
      ran.push_back(index);
      std::string name;
      (void)graph.get_plan_name_at_index(index, name);
      choice.timings.emplace_back(name, ms);
      if (ms < best) {
        best = ms;
        choice.plan_index = index;
        choice.measured_ms = ms;
      }
    }
    built = std::move(ran);
  } else if (!built.empty()) {
    choice.plan_index = built.front();
  }
  if (choice.plan_index < 0) {
    choice.build_seconds = seconds_since(start);
    return choice;
  }
  (void)graph.get_plan_name_at_index(choice.plan_index, choice.engine);
  choice.workspace_bytes = workspace_of(choice.plan_index);
  if (choice.workspace_bytes > 0) {
    choose_fallback(graph, choice, built, workspace_of);
  }
  choice.runtime_compiled = is_runtime_compiled(graph, choice.plan_index);
  choice.build_seconds = seconds_since(start);
  return choice;
}

void execute_graph(
    fe::graph::Graph& graph,
    int64_t plan_index,
    void* workspace,
    VariantPack& pack,
    const std::function<std::string()>& what) {
  if (injected_execution_failures.take()) {
    throw_graph_error(
        "executing the " + what(), fe::error_t{fe::error_code_t::CUDNN_BACKEND_API_FAILED, "injected failure (test hook)"},
        "");
  }
  auto status = graph.execute_plan_at_index(at::native::getCudnnHandle(), pack, workspace, plan_index);
  if (status.is_bad()) {
    throw_graph_error("executing the " + what(), status, "");
  }
}

void execute_plan(
    fe::graph::Graph& graph,
    const EngineChoice& engine,
    VariantPack& pack,
    const at::TensorOptions& options,
    const std::function<std::string()>& what) {
  if (engine.workspace_bytes == 0) {
    execute_graph(graph, engine.plan_index, nullptr, pack, what);
    return;
  }
  std::string allocator_message;
  try {
    at::Tensor workspace = at::empty({engine.workspace_bytes}, options.dtype(at::kByte));
    execute_graph(graph, engine.plan_index, workspace.data_ptr(), pack, what);
    return;
  } catch (const c10::OutOfMemoryError& e) {
    allocator_message = e.what_without_backtrace();
  }
  const bool has_fallback = engine.fallback_plan_index >= 0;
  // Under determinism the plan chosen for the key is the one that runs: another engine would round differently.
  const bool deterministic = current_math_flags().deterministic;
  TORCH_CHECK_WITH(
      OutOfMemoryError, has_fallback && knobs().workspace_fallback && !deterministic,
      "convbias: out of memory allocating the ", engine.workspace_bytes, "-byte workspace of the ", what(),
      " (engine ", engine.engine, "), and ",
      !has_fallback ? "no plan needing less workspace builds for it"
          : deterministic
          ? "torch.backends.cudnn.deterministic or torch.use_deterministic_algorithms(True) is set, so its "
            "lower-workspace plan (" + engine.fallback_engine + ", another engine with other rounding) is not substituted"
          : "TORCH_CONVBIAS_WORKSPACE_FALLBACK=off forbids running its lower-workspace plan",
      ". Free GPU memory (or use smaller tensors) and call again. The allocator said: ", allocator_message);
  fe::graph::Graph& fallback_graph = engine.fallback_graph ? *engine.fallback_graph : graph;
  at::Tensor workspace;
  if (engine.fallback_workspace_bytes > 0) {
    try {
      workspace = at::empty({engine.fallback_workspace_bytes}, options.dtype(at::kByte));
    } catch (const c10::OutOfMemoryError& e) {
      TORCH_CHECK_WITH(
          OutOfMemoryError, false, "convbias: out of memory allocating the workspace of the ", what(), ": neither the ",
          engine.workspace_bytes, " bytes of its engine (", engine.engine, ") nor the ", engine.fallback_workspace_bytes,
          " bytes of its lowest-workspace plan (", engine.fallback_engine,
          ") could be allocated. Free GPU memory (or use smaller tensors) and call again. The allocator said: ",
          e.what_without_backtrace());
    }
  }
  ++workspace_fallback_count;
  execute_graph(
      fallback_graph, engine.fallback_plan_index, workspace.defined() ? workspace.data_ptr() : nullptr, pack, what);
}

GraphAttempt build_graph_plan(
    const std::function<std::shared_ptr<fe::graph::Graph>(cudnnHandle_t, std::string*)>& make,
    const SelectionPolicy& policy,
    VariantPack pack,
    c10::Device device,
    const std::function<std::string()>& what) {
  GraphAttempt result;
  cudnnHandle_t handle = at::native::getCudnnHandle();
  result.graph = make(handle, &result.failure);
  if (!result.graph) {
    return result;
  }
  auto run = [&](int64_t index, void* workspace) { execute_graph(*result.graph, index, workspace, pack, what); };
  result.engine = select_engine(*result.graph, handle, policy, run, device);
  if (result.engine.plan_index < 0) {
    std::ostringstream why;
    why << "no engine built a plan (" << result.engine.heuristic_candidates << " offered by heuristics after filters";
    for (const auto& r : result.engine.rejected) {
      why << "; " << r;
    }
    why << ")";
    result.failure = why.str();
    result.graph.reset();
  }
  return result;
}

std::vector<int64_t> channels_last_strides(const std::array<int64_t, 4>& d) {
  return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]};
}

std::vector<int64_t> packed_strides(const std::array<int64_t, 4>& d, bool channels_last) {
  if (channels_last) {
    return channels_last_strides(d);
  }
  return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1};
}

std::vector<int64_t> as_vector(const std::array<int64_t, 4>& dims) {
  return {dims.begin(), dims.end()};
}

std::shared_ptr<fe::graph::Graph> new_graph(at::ScalarType io_dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(to_frontend_dtype(io_dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

std::shared_ptr<fe::graph::Tensor_attributes> packed_tensor(
    fe::graph::Graph& graph,
    const char* name,
    int64_t uid,
    const std::array<int64_t, 4>& dims,
    bool channels_last,
    int64_t alignment) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(as_vector(dims))
                          .set_stride(packed_strides(dims, channels_last))
                          .set_alignment(alignment));
}

std::string operation_name(const std::string& mode, float lower_clip_slope) {
  if (lower_clip_slope == 0.0f) {
    return mode;
  }
  // Nine significant digits: every float reads back as itself, so a graph's slope and a problem's compare exactly.
  char slope[32];
  std::snprintf(slope, sizeof(slope), "%.9g", static_cast<double>(lower_clip_slope));
  return mode + "(lower_clip_slope=" + slope + ")";
}

std::vector<std::string> graph_operations(const nlohmann::json& nodes) {
  std::vector<std::string> operations;
  if (!nodes.is_array()) {
    return operations;
  }
  for (const auto& node : nodes) {
    const std::string tag = node.value("tag", std::string("?"));
    if (tag != "POINTWISE" || !node.contains("mode") || !node["mode"].is_string()) {
      operations.push_back(tag);
      continue;
    }
    float slope = 0.0f;
    if (node.contains("relu_lower_clip_slope") && !node["relu_lower_clip_slope"].is_null()) {
      // The frontend writes floats as hexadecimal strings of their bits and reads them back the same way.
      const auto& value = node["relu_lower_clip_slope"];
      slope = value.is_string() ? value.get<float>() : static_cast<float>(value.get<double>());
    }
    operations.push_back(operation_name(node["mode"].get<std::string>(), slope));
  }
  return operations;
}

std::vector<std::string> graph_operations(const fe::graph::Graph& graph) {
  try {
    nlohmann::json description;
    graph.serialize(description);
    return graph_operations(description.value("nodes", nlohmann::json::array()));
  } catch (const std::exception&) {
    return {}; // a description is for diagnostics only
  }
}

bool finalize_graph(fe::graph::Graph& graph, cudnnHandle_t handle, std::string* why) {
  if (auto status = graph.validate(); status.is_bad()) {
    *why = "validate: " + status.get_message();
    return false;
  }
  if (auto status = graph.build_operation_graph(handle); status.is_bad()) {
    const std::string cudnn_message = last_cudnn_error();
    *why = "build_operation_graph: " + status.get_message() + (cudnn_message.empty() ? "" : " (cuDNN: " + cudnn_message + ")");
    return false;
  }
  return true;
}

int SelectionPolicy::max_candidates() const {
  switch (tuning) {
    case Tuning::Untimed: return 1;
    case Tuning::Quick: return 3;
    case Tuning::Exhaustive: return 128;
  }
  return 1;
}

SelectionPolicy default_policy(at::ScalarType dtype, const MathFlags& flags) {
  const bool capturing = stream_is_capturing();
  const Tuning requested = requested_tuning(flags);
  return SelectionPolicy{
      /*float32_io=*/dtype == at::kFloat,
      flags,
      /*tuning=*/capturing ? Tuning::Untimed : requested,
      /*allow_runtime_compiled=*/knobs().allow_runtime_compiled && !capturing,
      /*verify_by_running=*/!capturing,
      /*time_runtime_compiled=*/knobs().time_runtime_compiled};
}

} // namespace convbias::cuda

// Pieces shared by every cuDNN graph this extension builds (fused forward now, parameter gradients next):
// dtype mapping, pointer alignment, error translation, environment knobs, and engine selection with
// numerical-note filters and optional timing of the top candidates.
#pragma once

#include <ATen/core/Tensor.h>
#include <cudnn_frontend.h>

#include "conv_args.h"
#include "cuda/knobs.h"
#include "cuda/math_flags.h"
#include "cuda/timing.h"

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace convbias::cuda {

namespace fe = cudnn_frontend;

// cuDNN frontend data type of a torch dtype (float16, bfloat16, float32).
fe::DataType_t to_frontend_dtype(at::ScalarType t);

// Largest power of two (at most 16 bytes) dividing the tensor's data pointer. Graphs declare it and it is part
// of their cache key; cuDNN 9.19 still rejects pointers below 16 bytes at execution, so callers realign first.
int64_t pointer_alignment(const at::Tensor& t);

// `t` itself when its data pointer is 16-byte aligned, else a copy in `format`: cuDNN 9.19 rejects pointers
// below 16 bytes at execution (BAD_PARAM_MISALIGNED_POINTER) even when the graph declares less.
at::Tensor aligned_for_cudnn(const at::Tensor& t, at::MemoryFormat format, bool* copied = nullptr);

// cuDNN's own description of its last error (cudnnGetLastErrorString), or "" when it has none.
std::string last_cudnn_error();


// The plan picked for a graph, and how it was picked.
struct EngineChoice {
  int64_t plan_index = -1;
  std::string engine; // cuDNN's plan name: engine id and knob choices
  int64_t workspace_bytes = 0;
  bool runtime_compiled = false;
  bool from_disk = false; // loaded from the persistent plan cache (then build_seconds is the load's time)
  double build_seconds = 0; // heuristics query and plan builds
  float measured_ms = -1; // best timing, when candidates were timed
  int64_t heuristic_candidates = 0; // engine configs offered: heuristics' and the sweep's (before note filters)
  int64_t swept = 0; // of which added by the engine sweep (engines heuristics did not offer)
  int64_t built = 0; // plans that built
  int64_t runtime_compiled_built = 0; // of which runtime-compiled (NVRTC) engines
  std::vector<std::string> rejected; // why candidates were dropped (first few)
  std::vector<std::pair<std::string, float>> timings; // (engine, ms) of each timed candidate
  int64_t execution_failures = 0; // candidates that built but failed to execute (skipped, as ATen's own graph code does)
  // A candidate was skipped because its workspace could not be allocated: the choice is not final (never stored on
  // disk; when no plan was chosen, not cached either).
  bool transient = false;
  // The plan run instead when the chosen plan's workspace cannot be allocated (execute_plan): the precompiled
  // plan needing the least workspace, less than the chosen one's. Index -1: none (the chosen plan needs no
  // workspace, or no plan needing less builds). `fallback_graph` holds it when it is not in the chosen plan's
  // graph (a plan loaded from disk: one plan per deserialized graph).
  int64_t fallback_plan_index = -1;
  int64_t fallback_workspace_bytes = 0;
  std::string fallback_engine;
  std::shared_ptr<fe::graph::Graph> fallback_graph;
};

struct SelectionPolicy {
  bool float32_io; // FLOAT graph: TENSOR_CORE notes mean TF32
  MathFlags flags;
  Tuning tuning;
  bool allow_runtime_compiled;
  // Run an untimed choice once before accepting it (a plan that builds may still fail to execute). Off during CUDA
  // graph capture, where nothing may run outside the captured work.
  bool verify_by_running;
  // Timed choices also build and time the runtime-compiled engines beside the precompiled ones
  // (TORCH_CONVBIAS_RUNTIME_COMPILATION=timed); otherwise those are built only where no precompiled engine builds.
  bool time_runtime_compiled = false;

  // Plans to build (and time, unless Untimed): 1, 3, or every engine that builds.
  int max_candidates() const;
  bool time_candidates() const { return tuning != Tuning::Untimed; }
  // Also every engine the heuristics did not offer, with its default knobs (Exhaustive): the engine sweep on the
  // H200 found engines 10-40% faster than nn.Conv2d's convolution that heuristics rank low or not at all.
  bool sweep_engines() const { return tuning == Tuning::Exhaustive; }
};

// Heuristics (mode A, then FALLBACK), numerical-note filters, then builds plans in heuristic order, preferring
// precompiled engines, until `max_candidates` built; times them with `run` and keeps the fastest, or (Untimed) runs
// the first once. A candidate whose execution fails is skipped and the next one tried, so a returned plan has
// executed successfully (except during capture). Returns plan_index -1 (and the reasons in `rejected`) when no plan
// builds and runs.
EngineChoice select_engine(
    fe::graph::Graph& graph,
    cudnnHandle_t handle,
    const SelectionPolicy& policy,
    const std::function<void(int64_t plan_index, void* workspace)>& run,
    c10::Device device);

// Fully packed strides of NCHW-ordered dims: NHWC (channels_last, the layout the fusion engines take) or NCHW.
std::vector<int64_t> channels_last_strides(const std::array<int64_t, 4>& dims);
std::vector<int64_t> packed_strides(const std::array<int64_t, 4>& dims, bool channels_last);
std::vector<int64_t> as_vector(const std::array<int64_t, 4>& dims);

// An empty graph with `io_dtype` inputs/outputs, FLOAT intermediates and FLOAT compute.
std::shared_ptr<fe::graph::Graph> new_graph(at::ScalarType io_dtype);

// Conv_fprop/Conv_wgrad attributes with `params` (symmetric pre/post padding, stride, dilation) and FLOAT compute.
template <typename ConvAttributes>
ConvAttributes with_conv_params(ConvAttributes attributes, const ConvParams& c) {
  attributes.set_pre_padding({c.padding[0], c.padding[1]})
      .set_post_padding({c.padding[0], c.padding[1]})
      .set_stride({c.stride[0], c.stride[1]})
      .set_dilation({c.dilation[0], c.dilation[1]})
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return attributes;
}

// A graph tensor of NCHW-ordered `dims`, fully packed channels_last (NHWC) or NCHW.
std::shared_ptr<fe::graph::Tensor_attributes> packed_tensor(
    fe::graph::Graph& graph,
    const char* name,
    int64_t uid,
    const std::array<int64_t, 4>& dims,
    bool channels_last,
    int64_t alignment);

// The operations of a graph in order, from the frontend's JSON description of its nodes (the "nodes" of
// Graph::serialize, also stored with a persisted plan): a node's tag ("CONV_FPROP"), for a pointwise node its mode
// ("ADD", "RELU_FWD"), written by operation_name. What explain reports and the plan store checks a stored graph by.
std::vector<std::string> graph_operations(const nlohmann::json& nodes);

// graph_operations of a graph made here; empty when the frontend cannot describe it (explain then shows none).
std::vector<std::string> graph_operations(const fe::graph::Graph& graph);

// A pointwise mode with its non-zero relu_lower_clip_slope, if any: "RELU_FWD(lower_clip_slope=0.2)".
std::string operation_name(const std::string& mode, float lower_clip_slope);

// validate() and build_operation_graph(); false with the reason (cuDNN's too) when cuDNN refuses the graph.
bool finalize_graph(fe::graph::Graph& graph, cudnnHandle_t handle, std::string* why);

// The selection policy for a graph of `dtype` under `flags`, the environment knobs and capture state
// (current_tuning; runtime-compiled engines and verification runs are off during capture).
SelectionPolicy default_policy(at::ScalarType dtype, const MathFlags& flags);

// Tensor uid -> data pointer, as the graphs' execute takes them.
using VariantPack = std::unordered_map<int64_t, void*>;

// A graph with its chosen plan, or the reason there is none.
struct GraphAttempt {
  std::shared_ptr<fe::graph::Graph> graph; // null on failure
  EngineChoice engine;
  std::string failure; // empty when a plan was chosen
};

// Makes a graph with `make` (which returns nullptr and the reason when cuDNN refuses the graph itself), then
// selects its plan with `policy`, timing candidates on the buffers of `pack`. `what` names the graph and its
// problem in error messages.
GraphAttempt build_graph_plan(
    const std::function<std::shared_ptr<fe::graph::Graph>(cudnnHandle_t, std::string*)>& make,
    const SelectionPolicy& policy,
    VariantPack pack,
    c10::Device device,
    const std::function<std::string()>& what);

// Runs plan `plan_index` of `graph` on the current stream with PyTorch's cuDNN handle; throws naming the graph
// (`what` is only called on failure, keeping the hot path free of string building).
void execute_graph(
    fe::graph::Graph& graph,
    int64_t plan_index,
    void* workspace,
    VariantPack& pack,
    const std::function<std::string()>& what);

// Runs `engine`'s plan of `graph` like execute_graph, with a workspace of the plan's size from the caching
// allocator (none when the plan needs none): what every per-call execution does. When that allocation fails, the
// engine's lower-workspace fallback plan runs instead (counted in workspace_fallbacks()); without one, with
// TORCH_CONVBIAS_WORKSPACE_FALLBACK=off, or under determinism (cudnn.deterministic / use_deterministic_algorithms:
// another engine rounds differently) it raises c10::OutOfMemoryError (torch.OutOfMemoryError) naming the graph, the
// engine, the bytes asked for and why no other plan ran.
void execute_plan(
    fe::graph::Graph& graph,
    const EngineChoice& engine,
    VariantPack& pack,
    const at::TensorOptions& options,
    const std::function<std::string()>& what);

// How many calls ran their engine's lower-workspace fallback plan because a workspace allocation failed.
int64_t workspace_fallbacks();

// Test hook (convbias::_inject_execution_failures): the next `count` graph executions fail as a failing cuDNN
// execute would, before reaching cuDNN. 0 clears it.
void inject_execution_failures(int64_t count);

// A workspace of `bytes` for timing candidates, or an undefined tensor when the allocation fails (out of memory):
// a measurement is skipped rather than failing the call that builds the plan.
at::Tensor try_workspace(int64_t bytes, const at::TensorOptions& options);

// After a cuDNN call threw: clears a non-sticky CUDA error it left (so that the next candidate may run) and raises a
// sticky one (the context is broken: an illegal address, a device-side assert), which no other candidate survives.
// Not during CUDA graph capture (it queries the stream).
void raise_if_context_broken();

// Throws a c10::Error describing `what` (which graph, its shapes) with the frontend's and cuDNN's messages.
[[noreturn]] void throw_graph_error(const std::string& what, fe::error_t status, const std::string& hint);

} // namespace convbias::cuda

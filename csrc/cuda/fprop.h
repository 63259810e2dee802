// The fused conv+bias(+activation) forward on cuDNN graphs: which path a problem takes (fused graph, conv-only graph
// plus a bias add, or ATen; the activation in the graph's epilogue or as a pass after it), the cached plan for
// it, and running it.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conv_args.h"
#include "cuda/graph_common.h"
#include "cuda/plan_lookup.h"
#include "cuda/space_to_depth.h"

namespace convbias::cuda {

// Fused: the conv+bias graph; Conv: the conv graph of a call without bias; ConvThenBiasAdd: the conv graph
// followed by ATen's bias add; Aten: ATen's convolution (no cuDNN graph builds for the problem). Fused and Conv
// graphs end with the activation node when FpropPlan::activation_fused says so.
enum class FpropPath { Fused, Conv, ConvThenBiasAdd, Aten };
const char* path_name(FpropPath path);

// Everything that decides the plan. x, w and y are fully packed by the time they get here: all channels_last
// (NHWC), or all NCHW when that is the layout F.conv2d would return (NCHW input and weight).
struct FpropProblem {
  at::ScalarType dtype;
  c10::DeviceIndex device;
  bool channels_last = true;
  std::array<int64_t, 4> x_dims, w_dims, y_dims;
  ConvParams params;
  bool has_bias;
  std::array<int64_t, 4> alignments; // x, w, bias, y in bytes (y is always ours: allocated 16-byte aligned)
  MathFlags flags;
  // Applied to conv + bias: in the graph's epilogue (FpropPlan::activation_fused) or by ATen after the graph.
  ActivationSpec activation;
  // The pre-activation z = conv + bias is an output too (convbias::_forward_with_preactivation, for the backward of
  // an activation whose derivative needs it). The epilogue graph then writes both z and act(z), one graph; without
  // the epilogue the graph writes z and the activation pass runs out of place. Only with an activation.
  bool keep_preactivation = false;
  // convbias::forward_residual: a residual of y's shape (packed like y) is added before the activation. Its plan is
  // the graph conv -> residual ADD -> [bias ADD] -> [activation] where that runs (FpropPlan::residual_fused), else
  // the ATen path, meaning: forward's own plan for conv + bias, then the add and the activation (cuda_kernels.cpp).
  // Never with keep_preactivation.
  bool has_residual = false;
  int64_t residual_alignment = 16;
  // Whether the matmul way (matmul_fits) may run the problem: not for the copies the other ways run (channels_last,
  // padded, regrouped), whose plans must be graphs to be taken. Not part of the key: a direct call of the same key
  // may cache either kind of plan first, and a way whose problem's plan is ATen's is not taken.
  bool matmul_way = true;

  PlanKey key() const;
  std::string describe() const; // shapes, layout, dtype, parameters and activation, for messages
  FpropProblem as_channels_last() const; // the same problem on channels_last copies (fresh, 16-byte aligned)
  // The input channel count the problem runs with on zero-padded copies of x and w (pad_channels.h), or 0 where that
  // way does not apply: channels_last, one group, no residual, float16 / bfloat16 / float32, and channel rows that
  // are not 16-byte multiples.
  int64_t padded_channels() const;
  FpropProblem with_padded_channels() const; // the same problem on those copies (fresh, 16-byte aligned)
  // The regrouping that runs the problem as a stride-1 convolution (space_to_depth.h), or nullopt where that way does
  // not apply: channels_last, no residual, and space_to_depth_of's conditions (a strided stem of at most 4 channels).
  std::optional<SpaceToDepth> space_to_depth() const;
  FpropProblem with_space_to_depth() const; // the regrouped problem (fresh, 16-byte aligned copies; the same output)
};

struct FpropPlan {
  FpropPath path = FpropPath::Aten;
  std::shared_ptr<fe::graph::Graph> graph; // the fused or conv-only graph; null on the ATen path
  EngineChoice engine;
  bool tuned = false; // candidates (and fused vs unfused) were timed
  // ATen, or the graph without the activation's epilogue, because no candidate's workspace could be allocated now:
  // neither cached nor stored (the next call chooses again).
  bool transient = false;
  float fused_ms = -1; // measured, when both paths were timed
  float unfused_ms = -1;
  float graph_ms = -1; // channels_last under cudnn.benchmark: the chosen graph path ...
  float aten_ms = -1; // ... and ATen's convolution + bias add, measured; the faster one is kept
  // The ATen path as one matrix multiply (cuBLAS over the channels_last tensors: matmul_fits) rather than ATen's
  // convolution: measured faster than both under cudnn.benchmark (matmul_ms), or taken by the test hook.
  bool aten_matmul = false;
  float matmul_ms = -1;
  std::vector<std::string> notes; // why this path: what was rejected and why
  std::vector<std::string> graph_ops; // the graph's operations (graph_operations), e.g. CONV_FPROP, ADD, RELU_FWD

  // The activation (not identity): in the graph's epilogue, or a pass over the graph's (activation_after_graph_) or ATen's output.
  bool activation_fused = false;
  std::string activation_why; // why it is (not) in the graph: the knob, cuDNN's refusal, or the timings
  // Measured (timed choices): the graph with the epilogue in it ... against the graph without it followed by ATen's
  // pointwise pass. The epilogue is the activation, or for a has_residual problem the residual add (and activation,
  // if any): one pair of fields for both, so explain() and the plan store read them the same way.
  float epilogue_ms = -1;
  float separate_activation_ms = -1;
  // The graph writes the pre-activation as a second output (activation_fused for a keep_preactivation problem): the
  // bias ADD's (or, without bias, the convolution's) result marked as an output rather than left virtual.
  bool preactivation_output = false;
  // The graph adds the residual (a has_residual problem's graph plan; the activation, if any, is then its epilogue).
  bool residual_fused = false;
  // A residual problem's plan that is not residual_fused, with a bias: ATen's convolution runs without the bias and one
  // pass adds the bias and the residual (run_aten_then_residual), rather than forward's own route then the pass adding
  // the residual. Where forward's own route is ATen's convolution anyway (bias_joins_residual_pass), or, timed, where
  // it measures faster than that route (on strict fp32 a conv + bias graph often costs what ATen's convolution and its
  // bias add cost, and the bias then rides free in the residual's pass, as in Inductor's block ending).
  bool residual_bias_in_pass = false;

  // NCHW problems: the three ways to run them (a graph over NCHW strides, the channels_last plan on copies,
  // ATen) are measured once and the fastest kept. When the copies won, `via_channels_last` is the plan they run
  // (and `path`/`engine` above are copied from it); `layout_timings` holds (way, ms) of each way measured.
  std::shared_ptr<const FpropPlan> via_channels_last;
  std::vector<std::pair<std::string, float>> layout_timings;
  // Channels_last problems with padded_channels(): when the way over zero-padded copies of x and w was taken
  // (measured faster than the problem as it is, the pads included, or TORCH_CONVBIAS_PAD_CHANNELS=on), the plan of
  // the padded problem it runs (`path`/`engine` above copied from it); `layout_timings` then holds ("as_is", ms) and
  // ("padded_channels", ms) where both were measured.
  std::shared_ptr<const FpropPlan> via_padded_channels;
  // Channels_last problems with space_to_depth(): when the regrouped problem's way was taken (measured faster than the
  // problem's own way, the regrouping included, or TORCH_CONVBIAS_SPACE_TO_DEPTH=on), its plan (`path`/`engine` above
  // copied from it); `layout_timings` then ends with ("space_to_depth", ms) after the other ways measured.
  std::shared_ptr<const FpropPlan> via_space_to_depth;
};

PlanCaches<FpropPlan>& fprop_cache();

// The problem for fully packed x, w, (b) (all channels_last or all NCHW), an output of `y_dims` and `activation`.
FpropProblem make_problem(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, at::IntArrayRef y_dims,
    const ConvParams& params, bool channels_last, const ActivationSpec& activation);

// The cached plan for `problem`, built on a miss (and, where timing is asked for, timed on these tensors and a scratch
// output; during CUDA graph capture untimed, for captures only: see plan_lookup.h).
std::shared_ptr<const FpropPlan> fprop_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    bool* was_cached = nullptr, double* build_seconds = nullptr);

// (act(z), z) for z = conv(x, w) + b by `plan` for a keep_preactivation problem, on the current stream, in the
// problem's layout, two new tensors: one graph writing both where the plan has the epilogue (the activation then
// may read the FP32 z, so 16-bit outputs may differ from act(z rounded) by one rounding), else the graph writing z and
// the activation pass out of place (activation_after_graph). Not for the ATen path.
std::pair<at::Tensor, at::Tensor> run_fprop_with_preactivation(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b);

// The cached plan of a has_residual (channels_last) problem, built on a miss (build_residual_plan: timed on these
// tensors where timing is asked for). `r` is the residual packed like the output.
std::shared_ptr<const FpropPlan> fprop_residual_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& r, bool* was_cached = nullptr, double* build_seconds = nullptr);

// act(conv(x, w) + b + r) by the graph of a residual_fused plan on the current stream, into a new tensor in the
// problem's layout; `r` packed like the output.
at::Tensor run_fprop_residual(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& r);

// Test hook (convbias::_inject_aten_preferences): the next `count` timed comparisons against ATen's convolution
// choose it as if it had measured faster. 0 clears it.
void inject_aten_preferences(int64_t count);
// Test hook (convbias::_inject_matmul_preferences): likewise, the next `count` timed comparisons where the matmul way
// applies (matmul_fits and the flags allow it) choose it. 0 clears it.
void inject_matmul_preferences(int64_t count);

// Whether the problem is a matrix multiply as its tensors lie: a channels_last float32 convolution with a 1x1 kernel,
// stride 1, no padding and one group, without a residual or a kept pre-activation, not a way's copy (matmul_way).
// x viewed as [N*H*W, C] times the weight viewed as [K, C] transposed is the output viewed as [N*H*W, K],
// channels_last already: no transposes, where cuDNN's strict-fp32 engines for these shapes convert to NCHW and back
// (ResNet-50's 1x1 layers). float32 only: cuBLAS's 16-bit GEMMs may reduce in reduced precision
// (torch.backends.cuda.matmul), cuDNN's convolution does not.
bool matmul_fits(const FpropProblem& problem);
// Whether the matmul way applies the activation in cuBLAS's epilogue (a ReLU after a bias: at::_addmm_activation)
// rather than in a pass after the product. One answer for running it, its notes and explain().
bool matmul_relu_epilogue(bool has_bias, const ActivationSpec& activation);

// The ATen path of a plan (FpropPath::Aten: measured faster than any graph) on the original arguments, in the layout
// F.conv2d returns: ATen's convolution; with a bias and an activation (the pre-activation not kept), then one pass of
// ours adding the bias and applying it (bias_activation_), else ATen's bias add and activation (the reference).
// `as_matmul` (FpropPlan::aten_matmul): one cuBLAS matrix multiply instead (at::addmm, the bias and a ReLU in its
// epilogue, another activation a pass after it) where matmul_fits and torch's flags allow it at this call (strict
// float32 convolutions with TF32 matmuls allowed, or deterministic algorithms asked for, run ATen's convolution).
at::Tensor run_aten(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    bool as_matmul = false);

// Whether the pass after forward's own route for a residual block ending (forward_residual where the residual's graph
// is not taken) adds the bias too: where that route (`own`, the plan of `problem`, conv + bias without the residual)
// is ATen's convolution, not the matmul way (whose bias is in cuBLAS's epilogue). The convolution then runs without
// its bias (run_aten_then_residual): two passes over the output, as Inductor runs nn.Conv2d's block ending, instead
// of ATen's bias add making a third.
bool bias_joins_residual_pass(const FpropPlan& own, const FpropProblem& problem);

// act(conv(x, w) + b + r) where the bias joins the residual's pass (FpropPlan::residual_bias_in_pass): ATen's
// convolution without the bias, then one pass adding the bias and the residual and applying the activation
// (bias_residual_activation_).
at::Tensor run_aten_then_residual(
    const ConvParams& params, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& r,
    const ActivationSpec& activation);

// act(conv(x, w) + b) by `plan` on the current stream, in the problem's layout (the activation in the graph or
// applied after it). Into `out` where the graph can write it (of the problem's shape and layout, fully packed and
// 16-byte aligned: a batch part's slice of the whole output, batch_parts.h), else into a new tensor: the caller
// copies when the result is not `out`. Not for the ATen path (run_aten).
at::Tensor run_fprop(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& out = at::Tensor());

} // namespace convbias::cuda

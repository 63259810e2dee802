#include "cuda/fprop.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <sstream>

#include "cuda/bias_activation.h"
#include "cuda/epilogue.h"
#include "cuda/pad_channels.h"
#include "cuda/padded_choice.h"
#include "cuda/plan_store.h"
#include "cuda/test_hook.h"
#include "reference.h"

namespace convbias::cuda {
namespace {

// kZ: the pre-activation, written only by the graphs of keep_preactivation problems with the epilogue.
// kR: the residual, read by the graphs of has_residual problems.
constexpr int64_t kX = 1, kW = 2, kB = 3, kY = 4, kZ = 5, kR = 6;

// What a forward graph holds after the convolution: the pointwise ADD of the bias, then the problem's activation,
// and whether the activation's input (the pre-activation) is written too.
struct GraphForm {
  bool bias = false;
  bool activation = false;
  bool preactivation = false; // only with activation
  bool residual = false; // the residual ADD right after the convolution, before the bias (never with preactivation)
};

GraphForm form_of(const FpropPlan& plan) {
  return GraphForm{plan.path == FpropPath::Fused, plan.activation_fused, plan.preactivation_output, plan.residual_fused};
}

// "fused conv+bias graph", "conv graph", "fused conv+bias+gelu graph", "conv+relu graph", "fused conv+bias+gelu graph
// writing the pre-activation too": for messages.
std::string graph_name(const GraphForm& form, const ActivationSpec& activation) {
  std::string name = form.bias ? "fused conv+bias" : "conv";
  if (form.residual) {
    name += "+residual";
  }
  if (form.activation) {
    name += std::string("+") + activation_name(activation.kind);
  }
  return name + " graph" + (form.preactivation ? " writing the pre-activation too" : "");
}

// The graph: conv_fprop, then (in FP32, inside the graph) the pointwise ADD of the bias [1,K,1,1] and the activation
// node, each when `form` asks for it; the last result is y, written once in the I/O dtype. With form.preactivation the
// activation's input is written as well (z, in the I/O dtype): one graph, two outputs. Returns nullptr and the reason
// when cuDNN does not accept the graph itself.
std::shared_ptr<fe::graph::Graph> make_graph(
    const FpropProblem& p, const GraphForm& form, cudnnHandle_t handle, std::string* why) {
  if ((form.activation || form.residual) && take_injected_epilogue_rejection()) {
    *why = "refused by the test hook (convbias::_inject_epilogue_rejections)";
    return nullptr;
  }
  auto graph = new_graph(p.dtype);
  auto x = packed_tensor(*graph, "x", kX, p.x_dims, p.channels_last, p.alignments[0]);
  auto w = packed_tensor(*graph, "w", kW, p.w_dims, p.channels_last, p.alignments[1]);
  auto conv = graph->conv_fprop(x, w, with_conv_params(fe::graph::Conv_fprop_attributes().set_name("conv"), p.params));
  std::shared_ptr<fe::graph::Tensor_attributes> y = conv;
  if (form.bias || form.activation || form.residual) {
    // An intermediate: FP32, never written to memory.
    conv->set_data_type(fe::DataType_t::FLOAT).set_dim(as_vector(p.y_dims)).set_stride(packed_strides(p.y_dims, p.channels_last));
  }
  if (form.residual) {
    // The residual (y's shape, packed like y) added in FP32 before the bias: a residual block's ending. This order
    // (conv, + residual, + bias, activation) is cudnnConvolutionBiasActivationForward's and ATen's fused graph's, the
    // pattern cuDNN's precompiled conv+add+bias+activation engines are made for; with the bias first, the engines
    // chosen were runtime-compiled ones, slower than ATen's on most shapes (bench_forward --residual, H100, cuDNN 9.19).
    auto r = packed_tensor(*graph, "residual", kR, p.y_dims, p.channels_last, p.residual_alignment);
    y = graph->pointwise(
        y, r,
        fe::graph::Pointwise_attributes()
            .set_name("residual_add")
            .set_mode(fe::PointwiseMode_t::ADD)
            .set_compute_data_type(fe::DataType_t::FLOAT));
  }
  if (form.bias) {
    y->set_data_type(fe::DataType_t::FLOAT); // the sum so far: FP32, never written
    const int64_t k = p.w_dims[0];
    auto b = graph->tensor(fe::graph::Tensor_attributes()
                               .set_name("bias")
                               .set_uid(kB)
                               .set_dim({1, k, 1, 1})
                               .set_stride({k, 1, k, k})
                               .set_alignment(p.alignments[2]));
    y = graph->pointwise(
        y, b,
        fe::graph::Pointwise_attributes()
            .set_name("bias_add")
            .set_mode(fe::PointwiseMode_t::ADD)
            .set_compute_data_type(fe::DataType_t::FLOAT));
  }
  if (form.activation && form.preactivation) {
    // z as a real output rather than a virtual FP32 intermediate: the backward needs it. Whether the activation node
    // reads the FP32 sum or z as rounded to the dtype is the engine's business (not measured yet): 16-bit outputs may
    // differ from the other routes' act(z rounded) by one rounding of the activation's input.
    y->set_output(true)
        .set_uid(kZ)
        .set_data_type(to_frontend_dtype(p.dtype))
        .set_dim(as_vector(p.y_dims))
        .set_stride(packed_strides(p.y_dims, p.channels_last))
        .set_alignment(16); // allocated by us, as y
    y = graph->pointwise(y, epilogue_attributes(p.activation));
  } else if (form.activation) {
    // The epilogue: the activation of the FP32 sum, so that the output is rounded once (as the CPU reference does).
    y->set_data_type(fe::DataType_t::FLOAT);
    y = graph->pointwise(y, epilogue_attributes(p.activation));
  }
  y->set_output(true)
      .set_uid(kY)
      .set_data_type(to_frontend_dtype(p.dtype))
      .set_dim(as_vector(p.y_dims))
      .set_stride(packed_strides(p.y_dims, p.channels_last))
      .set_alignment(p.alignments[3]);
  return finalize_graph(*graph, handle, why) ? graph : nullptr;
}

// `z` (the pre-activation output) only for graphs that write it, `r` (the residual) only for graphs that read it.
VariantPack variant_pack(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y,
    bool with_bias, const at::Tensor& z = at::Tensor(), const at::Tensor& r = at::Tensor()) {
  VariantPack pack{{kX, x.data_ptr()}, {kW, w.data_ptr()}, {kY, y.data_ptr()}};
  if (with_bias) {
    pack.emplace(kB, b->data_ptr());
  }
  if (z.defined()) {
    pack.emplace(kZ, z.data_ptr());
  }
  if (r.defined()) {
    pack.emplace(kR, r.data_ptr());
  }
  return pack;
}

at::Tensor new_output(const FpropProblem& p, const at::Tensor& like) {
  return at::empty(
      as_vector(p.y_dims),
      like.options().memory_format(p.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous));
}

void execute(
    fe::graph::Graph& graph, int64_t plan_index, void* workspace, VariantPack& pack, const FpropProblem& problem,
    const GraphForm& form) {
  execute_graph(graph, plan_index, workspace, pack, [&] { return graph_name(form, problem.activation) + " for " + problem.describe(); });
}

GraphAttempt attempt(
    const FpropProblem& p, const GraphForm& form, const SelectionPolicy& policy, const at::Tensor& x,
    const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y, const at::Tensor& r = at::Tensor()) {
  // Candidates are timed writing every output the graph has.
  const at::Tensor z = form.preactivation ? new_output(p, x) : at::Tensor();
  return build_graph_plan(
      [&](cudnnHandle_t handle, std::string* why) { return make_graph(p, form, handle, why); }, policy,
      variant_pack(x, w, b, y, form.bias, z, form.residual ? r : at::Tensor()), x.device(),
      [&] { return graph_name(form, p.activation) + " for " + p.describe(); });
}

// The operations a graph of `form` for `p` consists of (graph_operations): what a stored graph must show.
std::vector<std::string> expected_operations(const FpropProblem& p, const GraphForm& form) {
  std::vector<std::string> operations{"CONV_FPROP"};
  if (form.bias) {
    operations.emplace_back("ADD");
  }
  if (form.residual) {
    operations.emplace_back("ADD");
  }
  if (form.activation) {
    operations.push_back(epilogue_operation(p.activation));
  }
  return operations;
}

std::string layout_hint(const FpropProblem& p) {
  const int64_t element = c10::elementSize(p.dtype);
  std::ostringstream hint;
  hint << (p.channels_last ? "inputs run as channels_last (NHWC)"
                           : "NCHW tensors leave only precompiled engines; channels_last (NHWC) inputs have the most");
  if (p.x_dims[1] * element % 16 != 0 || p.w_dims[0] * element % 16 != 0) {
    hint << "; channel counts whose rows are not 16-byte multiples (C=" << p.x_dims[1] << ", K=" << p.w_dims[0]
         << ", " << element << "-byte " << p.dtype << ") leave few engines";
  }
  if (const int64_t least = *std::min_element(p.alignments.begin(), p.alignments.end()); least < 16) {
    hint << "; a data pointer is only " << least << "-byte aligned";
  }
  return hint.str();
}

TestHookCountdown injected_aten_preferences; // inject_aten_preferences
TestHookCountdown injected_matmul_preferences; // inject_matmul_preferences

// Whether torch's flags let the matmul way run a problem that fits it now: the convolution's TF32 setting must allow
// whatever cuBLAS's allows (a strict-fp32 convolution never runs as a TF32 GEMM), and deterministic algorithms rule it
// out (cuBLAS is deterministic only under CUBLAS_WORKSPACE_CONFIG; ATen's matmul raises without it). Read at each call:
// cuBLAS's flag is not part of the plan's key.
bool matmul_allowed_now(const FpropProblem& p) {
  return !p.flags.deterministic && (p.flags.allow_tf32 || !at::globalContext().allowTF32CuBLAS());
}

// act(x . w^T + b) over the tensors viewed as matrices (matmul_fits), the output a channels_last view of the product.
at::Tensor run_matmul(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), width = x.size(3), k = w.size(0);
  // Views where x is channels_last and packed (reshape copies otherwise: the original arguments reach run_aten).
  const at::Tensor rows = x.permute({0, 2, 3, 1}).reshape({n * h * width, c});
  const at::Tensor weight = w.reshape({k, c}).t();
  const bool relu_epilogue = matmul_relu_epilogue(p.has_bias, p.activation);
  const at::Tensor product = relu_epilogue ? at::_addmm_activation(*b, rows, weight)
      : p.has_bias                         ? at::addmm(*b, rows, weight)
                                           : at::mm(rows, weight);
  at::Tensor y = product.view({n, h, width, k}).permute({0, 3, 1, 2});
  if (!relu_epilogue) {
    activation_after_graph_(y, p.activation); // none for identity
  }
  return y;
}

} // namespace

void inject_aten_preferences(int64_t count) {
  injected_aten_preferences.arm(count);
}

void inject_matmul_preferences(int64_t count) {
  injected_matmul_preferences.arm(count);
}

bool matmul_relu_epilogue(bool has_bias, const ActivationSpec& activation) {
  return has_bias && activation.kind == Activation::Relu;
}

bool matmul_fits(const FpropProblem& p) {
  const ConvParams& c = p.params;
  return p.matmul_way && p.channels_last && p.dtype == at::kFloat && !p.has_residual && !p.keep_preactivation &&
      c.groups == 1 &&
      p.w_dims[2] == 1 && p.w_dims[3] == 1 && c.stride[0] == 1 && c.stride[1] == 1 && c.padding[0] == 0 &&
      c.padding[1] == 0;
}

namespace {

// Whether run_aten runs `p` as one matrix multiply: asked to (a plan's aten_matmul, or a timing of that way), and the
// problem fits it and torch's flags allow it at this call. One answer for run_aten, its timing and the residual's pass.
bool runs_as_matmul(const FpropProblem& p, bool as_matmul) {
  return as_matmul && matmul_fits(p) && matmul_allowed_now(p);
}

} // namespace

// act(conv + bias) by ATen's convolution (fprop.h says which passes follow it; out of place, z kept, when the problem
// keeps the pre-activation).
at::Tensor run_aten(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    bool as_matmul) {
  if (runs_as_matmul(p, as_matmul)) {
    return run_matmul(p, x, w, b);
  }
  const ConvParams& c = p.params;
  if (p.keep_preactivation) {
    return std::get<0>(
        forward_with_preactivation_reference(x, w, b, c.stride, c.padding, c.dilation, c.groups, p.activation));
  }
  if (p.has_bias && !p.activation.is_identity()) {
    // ATen's convolution alone, then one pass of ours adding the bias and applying the activation: what Inductor runs
    // for nn.Conv2d + the activation (ATen's own bias add and activation are two passes).
    at::Tensor y = forward_reference(x, w, std::nullopt, c.stride, c.padding, c.dilation, c.groups, ActivationSpec{});
    return bias_activation_(y, *b, p.activation);
  }
  return forward_reference(x, w, b, c.stride, c.padding, c.dilation, c.groups, p.activation);
}

bool bias_joins_residual_pass(const FpropPlan& own, const FpropProblem& p) {
  TORCH_INTERNAL_ASSERT(!p.has_residual && p.activation.is_identity());
  return own.path == FpropPath::Aten && p.has_bias && !p.keep_preactivation && !runs_as_matmul(p, own.aten_matmul);
}

at::Tensor run_aten_then_residual(
    const ConvParams& c, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& r,
    const ActivationSpec& activation) {
  at::Tensor y = forward_reference(x, w, std::nullopt, c.stride, c.padding, c.dilation, c.groups, ActivationSpec{});
  return bias_residual_activation_(y, b, r, activation);
}

namespace {

// Whether the graph can write `out` as its output: defined, of the problem's shape, fully packed in its layout and
// 16-byte aligned (what plans assume of the outputs they allocate).
bool can_write_into(const at::Tensor& out, const FpropProblem& problem) {
  const auto format = problem.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  return out.defined() && out.scalar_type() == problem.dtype && out.sizes() == at::IntArrayRef(problem.y_dims) &&
      out.is_contiguous(format) && pointer_alignment(out) >= 16;
}

// (output, pre-activation) by `plan` on the current stream, in the problem's layout; the pre-activation is defined
// exactly when the problem keeps it. What run_fprop and run_fprop_with_preactivation return, and what timed choices
// measure, so that a keep_preactivation problem's routes are compared writing what the call writes.
std::pair<at::Tensor, at::Tensor> run_plan(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& out = at::Tensor()) {
  if (plan.via_channels_last) {
    constexpr auto cl = at::MemoryFormat::ChannelsLast;
    auto [y, z] = run_plan(*plan.via_channels_last, problem.as_channels_last(), x.contiguous(cl), w.contiguous(cl), b);
    return {y.contiguous(), z.defined() ? z.contiguous() : z};
  }
  if (plan.via_padded_channels) {
    // The output has the problem's own shape (only the reduction dimension grew, by zeros): `out` serves as it is.
    const int64_t channels = problem.padded_channels();
    TORCH_INTERNAL_ASSERT(channels > 0);
    return run_plan(
        *plan.via_padded_channels, problem.with_padded_channels(), pad_channels(x, channels), pad_channels(w, channels), b,
        out);
  }
  if (plan.via_space_to_depth) {
    // After via_padded_channels: a padded problem's plan (float32 C=3 padded to 4) may itself run regrouped, and the
    // padded way's plan is a copy of it. The regrouped problem's own ways (a padded one) are run by the recursion:
    // the copy made here has no via_padded_channels. The output is the problem's own: `out` serves as it is.
    const auto g = problem.space_to_depth();
    TORCH_INTERNAL_ASSERT(g);
    return run_plan(
        *plan.via_space_to_depth, problem.with_space_to_depth(), space_to_depth_input(x, *g), space_to_depth_weight(w, *g),
        b, out);
  }
  TORCH_INTERNAL_ASSERT(plan.path != FpropPath::Aten && plan.graph);
  TORCH_INTERNAL_ASSERT(!plan.activation_fused || plan.preactivation_output == problem.keep_preactivation);
  const GraphForm form = form_of(plan);
  at::Tensor y = can_write_into(out, problem) ? out : new_output(problem, x);
  at::Tensor z = form.preactivation ? new_output(problem, x) : at::Tensor();
  auto pack = variant_pack(x, w, b, y, form.bias, z);
  execute_plan(*plan.graph, plan.engine, pack, x.options(), [&] {
    return graph_name(form, problem.activation) + " for " + problem.describe();
  });
  if (plan.path == FpropPath::ConvThenBiasAdd && !problem.activation.is_identity() && !problem.keep_preactivation) {
    // One pass after the conv graph: bias add and activation (the pass Inductor makes after nn.Conv2d's convolution).
    bias_activation_(y, *b, problem.activation);
    return {y, at::Tensor()};
  }
  if (plan.path == FpropPath::ConvThenBiasAdd) {
    y.add_(b->view({1, -1, 1, 1}));
  }
  if (plan.activation_fused) {
    return {y, z}; // z undefined unless the problem keeps it
  }
  if (problem.keep_preactivation) {
    // The graph wrote z; the activation over it, out of place.
    const auto format = problem.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    at::Tensor out = activation_after_graph(y, problem.activation, format);
    return {std::move(out), std::move(y)};
  }
  activation_after_graph_(y, problem.activation); // the activation pass over the graph's output (none for identity)
  return {y, at::Tensor()};
}

// act(conv + bias) by a problem's own plan as it was measured: its ATen path (ATen's convolution or the matmul way) or
// its graph. What the other ways (padded, regrouped, the residual's separate add) are measured against.
at::Tensor run_own_way(
    const FpropPlan& own, const FpropProblem& p, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b) {
  return own.path == FpropPath::Aten ? run_aten(p, x, w, b, own.aten_matmul) : run_plan(own, p, x, w, b).first;
}

// Fills `plan` with the graph path that leaves the activation to ATen: the fused conv+bias graph, the conv graph +
// bias add, or ATen when neither builds. Throws when a path forced by TORCH_CONVBIAS_PATH does not build
// (channels_last problems only: an NCHW problem still has the channels_last copies to fall back on).
void choose_graph_without_epilogue(
    FpropPlan& plan, const FpropProblem& p, const SelectionPolicy& policy, bool exhaustive, const at::Tensor& x,
    const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y) {
  const auto& k = knobs();
  const bool forced_must_build = p.channels_last;
  const GraphForm with_bias{/*bias=*/true, /*activation=*/false};
  const GraphForm conv_only{/*bias=*/false, /*activation=*/false};

  std::optional<GraphAttempt> fused;
  if (p.has_bias && k.path != "unfused") {
    fused = attempt(p, with_bias, policy, x, w, b, y);
    if (!fused->failure.empty()) {
      plan.notes.push_back("fused conv+bias graph rejected: " + fused->failure);
      TORCH_CHECK(
          k.path != "fused" || !forced_must_build,
          "convbias: TORCH_CONVBIAS_PATH=fused but cuDNN rejected the fused conv+bias graph for ", p.describe(), ": ",
          fused->failure, ". Hint: ", layout_hint(p));
    }
  }
  const bool fused_ok = fused && fused->failure.empty();
  // Conv alone (then a bias add): needed without bias, when the fused graph failed, when forced, and when
  // measuring whether fusion pays for this key (cudnn.benchmark, or AUTOTUNE=on, without a forced path).
  const bool measure_both = fused_ok && exhaustive;
  std::optional<GraphAttempt> unfused;
  if (!fused_ok || measure_both) {
    unfused = attempt(p, conv_only, policy, x, w, b, y);
    if (!unfused->failure.empty()) {
      plan.notes.push_back("conv graph rejected: " + unfused->failure);
    }
  }
  const bool unfused_ok = unfused && unfused->failure.empty();

  auto take = [&](GraphAttempt& a, FpropPath path) {
    plan.path = path;
    plan.graph = a.graph;
    plan.engine = a.engine;
  };
  // Time both complete paths on these tensors: fused graph vs conv graph + bias add (when their workspace can be
  // allocated: else the fused graph is taken unmeasured), each with the activation as run_plan applies it after that
  // graph: the activation pass after the fused graph, one bias + activation pass after the conv graph (the
  // pre-activation kept: ATen's bias add, then the activation out of place, after either).
  const at::Tensor workspace = fused_ok && unfused_ok
      ? try_workspace(std::max(fused->engine.workspace_bytes, unfused->engine.workspace_bytes), x.options())
      : at::Tensor();
  if (workspace.defined()) {
    auto fused_pack = variant_pack(x, w, b, y, true);
    auto conv_pack = variant_pack(x, w, b, y, false);
    const at::Tensor bias_view = b->view({1, -1, 1, 1});
    const bool one_pass = !p.activation.is_identity() && !p.keep_preactivation;
    const auto format = p.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    at::Tensor out = y; // the activation's result: y itself, or a new tensor when the pre-activation is kept
    auto activation_after = [&] {
      if (p.keep_preactivation) {
        out = activation_after_graph(y, p.activation, format);
      } else {
        activation_after_graph_(out, p.activation);
      }
    };
    plan.fused_ms = time_on_stream([&] {
      execute(*fused->graph, fused->engine.plan_index, workspace.data_ptr(), fused_pack, p, with_bias);
      activation_after();
    });
    plan.unfused_ms = time_on_stream([&] {
      execute(*unfused->graph, unfused->engine.plan_index, workspace.data_ptr(), conv_pack, p, conv_only);
      if (one_pass) {
        bias_activation_(out, *b, p.activation);
      } else {
        y.add_(bias_view);
        activation_after();
      }
    });
    if (plan.unfused_ms < plan.fused_ms) {
      take(*unfused, FpropPath::ConvThenBiasAdd);
      plan.notes.push_back(
          one_pass ? "conv graph + one bias and activation pass measured faster than the fused graph + the activation"
                   : "conv graph + bias add measured faster than the fused graph");
    } else {
      take(*fused, FpropPath::Fused);
    }
  } else if (fused_ok) {
    take(*fused, FpropPath::Fused);
  } else if (unfused_ok) {
    take(*unfused, p.has_bias ? FpropPath::ConvThenBiasAdd : FpropPath::Conv);
  } else {
    TORCH_CHECK(
        k.path == "auto" || !forced_must_build, "convbias: TORCH_CONVBIAS_PATH=", k.path,
        " but cuDNN rejected the graph for ", p.describe(), ": ", plan.notes.empty() ? "" : plan.notes.back(),
        ". Hint: ", layout_hint(p));
    plan.path = FpropPath::Aten;
    plan.notes.push_back("no cuDNN graph builds (and runs) for this problem; running ATen's convolution. Hint: " + layout_hint(p));
    // Out of memory while trying candidates: the next call tries again.
    plan.transient = (fused && fused->engine.transient) || (unfused && unfused->engine.transient);
  }
}

// The graph with the activation in its epilogue (conv [+ bias] + activation), or nullopt where it is not to be tried
// (identity, or a knob excludes it); `plan.activation_why` says why not, or why it was rejected. Throws when
// TORCH_CONVBIAS_ACTIVATION=fused and it does not build (channels_last problems, as for TORCH_CONVBIAS_PATH=fused).
std::optional<GraphAttempt> attempt_epilogue(
    FpropPlan& plan, const FpropProblem& p, const SelectionPolicy& policy, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& y) {
  const auto& k = knobs();
  if (p.activation.is_identity()) {
    return std::nullopt;
  }
  if (k.activation == "unfused") {
    plan.activation_why = "TORCH_CONVBIAS_ACTIVATION=unfused";
    return std::nullopt;
  }
  if (k.path == "unfused") {
    plan.activation_why = "TORCH_CONVBIAS_PATH=unfused: nothing is fused into the convolution's graph";
    return std::nullopt;
  }
  const GraphForm form{p.has_bias, /*activation=*/true, /*preactivation=*/p.keep_preactivation};
  SelectionPolicy epilogue_policy = policy;
  // An untimed choice takes the epilogue only where a precompiled engine runs it: runtime-compiled fusion engines
  // cost 0.05-5.6 s to build per shape and ran conv+bias up to 2x slower than the best precompiled engine on the H200,
  // which only a timed choice (measured against the graph without the epilogue) can notice.
  const bool precompiled_only = !policy.time_candidates() && k.activation != "fused";
  if (precompiled_only) {
    epilogue_policy.allow_runtime_compiled = false;
  }
  GraphAttempt a = attempt(p, form, epilogue_policy, x, w, b, y);
  if (!a.failure.empty()) {
    plan.activation_why = graph_name(form, p.activation) + " rejected: " + a.failure +
        (precompiled_only && policy.allow_runtime_compiled
             ? " (precompiled engines only: runtime-compiled ones are tried when choices are timed, under "
               "torch.backends.cudnn.benchmark or TORCH_CONVBIAS_AUTOTUNE=quick/on)"
             : "");
    plan.notes.push_back(plan.activation_why);
    TORCH_CHECK(
        k.activation != "fused" || !p.channels_last, "convbias: TORCH_CONVBIAS_ACTIVATION=fused but cuDNN rejected the ",
        graph_name(form, p.activation), " for ", p.describe(), ": ", a.failure, ". Hint: ", layout_hint(p));
  }
  return a;
}

// The graph path for the problem in its own layout. With an activation: the graph with it in the epilogue where
// that builds and runs (when choices are timed, where it also measures faster than the graph without it followed by
// an activation pass), else the path without it (choose_graph_without_epilogue) and that pass. Under
// exhaustive tuning ATen's own route (convolution, bias add, activation) is measured against the result.
std::shared_ptr<FpropPlan> build_graph_path(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  auto plan = std::make_shared<FpropPlan>();
  const auto& k = knobs();
  SelectionPolicy policy = default_policy(p.dtype, p.flags);
  if (!p.channels_last) {
    // Runtime-compiled engines build for NHWC only (measured on the H200) and cost seconds to try.
    policy.allow_runtime_compiled = false;
  }
  plan->tuned = policy.time_candidates();
  const at::Tensor y = new_output(p, x);
  // cudnn.benchmark (or AUTOTUNE=on) without a forced path: every alternative is measured.
  const bool exhaustive = policy.tuning == Tuning::Exhaustive && k.path == "auto";

  std::optional<GraphAttempt> epilogue = attempt_epilogue(*plan, p, policy, x, w, b, y);
  const bool epilogue_ok = epilogue && epilogue->failure.empty();
  auto take_epilogue = [&](std::string why) {
    plan->path = p.has_bias ? FpropPath::Fused : FpropPath::Conv;
    plan->graph = epilogue->graph;
    plan->engine = epilogue->engine;
    plan->activation_fused = true;
    plan->preactivation_output = p.keep_preactivation;
    plan->activation_why = std::move(why);
    plan->transient = false; // a graph that ran was chosen, whatever the route without the epilogue met
  };
  const std::string epilogue_name = graph_name(GraphForm{p.has_bias, true, p.keep_preactivation}, p.activation);
  // Timed choices (quick or exhaustive) measure the epilogue against the route without it; forced ones do not.
  const bool compare = epilogue_ok && policy.time_candidates() && k.activation == "auto";
  if (epilogue_ok && !compare) {
    take_epilogue(
        "the " + epilogue_name + " built and ran" +
        (k.activation == "fused" ? " (TORCH_CONVBIAS_ACTIVATION=fused)" : ""));
  } else {
    choose_graph_without_epilogue(*plan, p, policy, exhaustive, x, w, b, y);
    // Refused for want of memory (a candidate's workspace): not a final choice, the next call tries again.
    plan->transient = plan->transient || (epilogue && !epilogue_ok && epilogue->engine.transient);
  }
  if (compare && plan->path == FpropPath::Aten) {
    take_epilogue("the " + epilogue_name + " built and ran; no graph without the activation did");
  } else if (compare) {
    // Both complete routes on these tensors, each with its own output and workspace as a call has them.
    FpropPlan candidate;
    candidate.path = p.has_bias ? FpropPath::Fused : FpropPath::Conv;
    candidate.graph = epilogue->graph;
    candidate.engine = epilogue->engine;
    candidate.activation_fused = true;
    candidate.preactivation_output = p.keep_preactivation;
    plan->epilogue_ms = time_on_stream([&] { (void)run_plan(candidate, p, x, w, b); });
    plan->separate_activation_ms = time_on_stream([&] { (void)run_plan(*plan, p, x, w, b); });
    std::ostringstream timings;
    timings << plan->epilogue_ms << " ms against " << plan->separate_activation_ms << " ms for the "
            << (plan->path == FpropPath::Fused ? "fused conv+bias graph"
                    : plan->path == FpropPath::Conv ? "conv graph"
                                                    : "conv graph + bias add")
            << (plan->path == FpropPath::ConvThenBiasAdd && !p.keep_preactivation
                    ? " + one bias and activation pass"
                    : std::string(" + ") + activation_pass_name(p.dtype));
    if (plan->epilogue_ms <= plan->separate_activation_ms) {
      plan->notes.clear(); // what the route without the epilogue rejected no longer applies
      take_epilogue("the " + epilogue_name + " measured faster: " + timings.str());
    } else {
      plan->activation_why = "the " + epilogue_name + " measured slower: " + timings.str();
      plan->notes.push_back(plan->activation_why);
    }
  }

  if (plan->path != FpropPath::Aten && p.channels_last && exhaustive) {
    // Under cudnn.benchmark, ATen's convolution (then its bias add, or with an activation one pass of ours adding
    // the bias and applying it: run_aten) is measured too: on strict fp32 the graph's best engine is often the one ATen
    // uses, and where ATen is faster it is taken, so this op is never slower than nn.Conv2d (+ the activation module,
    // eager or compiled: Inductor runs ATen's convolution and one such pass) for the key.
    const float graph_ms = time_on_stream([&] { (void)run_plan(*plan, p, x, w, b); });
    const float aten_ms = time_on_stream([&] { (void)run_aten(p, x, w, b); });
    // A 1x1 float32 convolution is also measured as one matrix multiply (matmul_fits).
    const bool matmul_ok = runs_as_matmul(p, true);
    const float matmul_ms = matmul_ok ? time_on_stream([&] { (void)run_aten(p, x, w, b, /*as_matmul=*/true); }) : -1;
    plan->aten_ms = aten_ms;
    plan->graph_ms = graph_ms;
    plan->matmul_ms = matmul_ms;
    const bool injected_matmul = matmul_ok && injected_matmul_preferences.take();
    const bool injected = !injected_matmul && injected_aten_preferences.take();
    const bool matmul = injected_matmul || (matmul_ok && matmul_ms < std::min(graph_ms, aten_ms));
    if (matmul || aten_ms < graph_ms || injected) {
      plan->path = FpropPath::Aten;
      plan->aten_matmul = matmul;
      plan->graph.reset();
      plan->activation_fused = false;
      plan->preactivation_output = false;
      // What run_aten ran, named once for the note and the activation's reason.
      const bool relu_epilogue = matmul_relu_epilogue(p.has_bias, p.activation);
      const char* aten_route = matmul
          ? (relu_epilogue ? "one matrix multiply with the bias and ReLU in its epilogue"
                 : p.has_bias ? "one matrix multiply with the bias in its epilogue"
                              : "one matrix multiply")
          : p.activation.is_identity()          ? "ATen's convolution + bias add"
          : p.has_bias && !p.keep_preactivation ? "ATen's convolution + one bias and activation pass"
                                                : "ATen's convolution, bias add and activation";
      const std::string measured = std::string(aten_route) + " measured faster than the cuDNN graph" +
          (matmul ? " and ATen's convolution" : "");
      plan->notes.push_back(
          injected_matmul ? "one matrix multiply taken by the test hook (convbias::_inject_matmul_preferences)"
              : injected  ? "ATen's convolution taken by the test hook (convbias::_inject_aten_preferences)"
                          : measured);
      if (!p.activation.is_identity()) {
        plan->activation_why = measured;
      }
    }
  }
  if (plan->graph) {
    plan->graph_ops = graph_operations(*plan->graph);
  }
  return plan;
}

// An NCHW problem (NCHW input and weight, so F.conv2d returns NCHW) runs one of three ways: a graph over the
// NCHW strides (precompiled engines only), the channels_last plan on copies (two copies in, one out), or
// ATen's convolution. Which is fastest depends on the shape (the copies cost 0.37-0.97x of nn.Conv2d on the
// H200 suite), so each way that builds is timed once per key; without timing (CUDA graph capture,
// TORCH_CONVBIAS_AUTOTUNE=off) the NCHW graph is taken if it builds, else the copies, else ATen.
// TORCH_CONVBIAS_NCHW forces one way.
std::shared_ptr<const FpropPlan> build_nchw_plan(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  const auto& k = knobs();
  auto aten_plan = [](std::vector<std::string> notes, const std::string& why) {
    auto plan = std::make_shared<FpropPlan>();
    plan->path = FpropPath::Aten;
    plan->notes = std::move(notes);
    plan->notes.push_back(why);
    return plan;
  };
  if (k.nchw == "aten") {
    return aten_plan({}, "TORCH_CONVBIAS_NCHW=aten");
  }
  std::shared_ptr<FpropPlan> native;
  if (k.nchw == "auto" || k.nchw == "graph") {
    native = build_graph_path(p, x, w, b);
    TORCH_CHECK(
        k.nchw != "graph" || native->path != FpropPath::Aten,
        "convbias: TORCH_CONVBIAS_NCHW=graph but no cuDNN graph over NCHW strides builds for ", p.describe(), ": ",
        native->notes.empty() ? "" : native->notes.back());
    if (k.nchw == "graph") {
      return native;
    }
  }
  // The channels_last way copies x and w: only when it may be taken (forced, or native failed, or timed against the
  // others), so that an untimed choice of the NCHW graph leaves no copy kernels behind (nor in a captured graph).
  const bool timed = current_tuning(p.flags) != Tuning::Untimed;
  const bool native_ok = native && native->path != FpropPath::Aten;
  std::shared_ptr<const FpropPlan> via_cl;
  const FpropProblem cl_problem = p.as_channels_last();
  constexpr auto cl = at::MemoryFormat::ChannelsLast;
  if (k.nchw == "copy" || (k.nchw == "auto" && (!native_ok || timed))) {
    via_cl = fprop_plan(cl_problem, x.contiguous(cl), w.contiguous(cl), b);
  }
  auto via_cl_plan = [&] {
    auto plan = std::make_shared<FpropPlan>(*via_cl);
    plan->via_channels_last = via_cl;
    plan->notes.push_back("NCHW tensors copied to channels_last and the output copied back");
    return plan;
  };
  if (k.nchw == "copy") {
    return via_cl_plan();
  }
  // Here TORCH_CONVBIAS_NCHW=auto.
  const bool via_cl_ok = via_cl && via_cl->path != FpropPath::Aten;
  if (!native_ok && !via_cl_ok) {
    auto plan = aten_plan(native->notes, "no cuDNN graph builds for this problem, in NCHW or channels_last");
    plan->transient = native->transient || (via_cl && via_cl->transient);
    return plan;
  }
  if (!timed) {
    return native_ok ? native : via_cl_plan();
  }

  std::vector<std::pair<std::string, float>> timings;
  if (native_ok) {
    timings.emplace_back("nchw_graph", time_on_stream([&] { (void)run_plan(*native, p, x, w, b); }));
  }
  if (via_cl_ok) {
    timings.emplace_back("channels_last_copies", time_on_stream([&] {
                           (void)run_plan(*via_cl, cl_problem, x.contiguous(cl), w.contiguous(cl), b).first.contiguous();
                         }));
  }
  if (k.path == "auto") {
    timings.emplace_back("aten", time_on_stream([&] { (void)run_aten(p, x, w, b); }));
  }
  const auto best = std::min_element(
      timings.begin(), timings.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  std::shared_ptr<FpropPlan> plan;
  if (best->first == "nchw_graph") {
    plan = native;
  } else if (best->first == "channels_last_copies") {
    plan = via_cl_plan();
  } else {
    plan = aten_plan(native->notes, "ATen's convolution measured fastest for these NCHW tensors");
  }
  plan->layout_timings = std::move(timings);
  return plan;
}

// A channels_last problem with padded_channels() runs as it is or on zero-padded copies of x and w: the padded
// problem has 16-byte channel rows, which the fast and the fused engines need (pad_channels.h), at the price of the two
// copies. Under timed choices both ways are measured, the copies included, and the faster kept; untimed, the problem
// runs as it is (heuristics cannot weigh the copies), unless TORCH_CONVBIAS_PAD_CHANNELS=on (the padded way wherever
// its graph builds) or off (never).
std::shared_ptr<const FpropPlan> consider_padded_channels(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    std::shared_ptr<FpropPlan> own) {
  const int64_t channels = p.padded_channels();
  if (!padded_way_tried(channels, p.flags, own->transient)) {
    return own;
  }
  const FpropProblem q = p.with_padded_channels();
  const std::string note = padded_way_note(p.x_dims[1], channels);
  return padded_or_own<FpropPlan>(own, note, [&]() -> std::shared_ptr<const FpropPlan> {
    const std::shared_ptr<const FpropPlan> padded =
        fprop_plan(q, pad_channels(x, channels), pad_channels(w, channels), b);
    if (padded->path == FpropPath::Aten) {
      // ATen's convolution needs no copies of ours: on the padded problem it is no way of its own.
      own->notes.push_back(
          note + " not taken: that problem's plan is ATen's convolution (" +
          (padded->aten_ms >= 0 ? "measured faster than its cuDNN graph" : "no cuDNN graph runs it") + ")");
      return own;
    }
    // Both complete ways on these tensors, as calls run them: the padded one with its two copies.
    return keep_padded_or_own<FpropPlan>(
        own, padded, note,
        [&] {
          return time_on_stream([&] {
            (void)run_own_way(*own, p, x, w, b);
          });
        },
        [&] {
          return time_on_stream(
              [&] { (void)run_plan(*padded, q, pad_channels(x, channels), pad_channels(w, channels), b); });
        },
        [](FpropPlan& plan, float own_ms, float padded_ms) {
          plan.layout_timings = {{"as_is", own_ms}, {"padded_channels", padded_ms}};
        });
  });
}

// A channels_last problem with space_to_depth() (a strided stem) runs its own way (`chosen`: as it is, on padded
// channels or ATen's) or as the regrouped stride-1 problem (space_to_depth.h), at the price of regrouping x and w. Under
// timed choices both complete ways are measured, the regrouping included, and the faster kept; untimed, the problem's
// own way (heuristics cannot weigh the regrouping), unless TORCH_CONVBIAS_SPACE_TO_DEPTH=on (the regrouped way wherever
// a graph runs it) or off (never). Whatever stops the regrouped way (out of memory, a forced path it cannot take)
// leaves the problem its own way, with the reason in the plan's notes.
std::shared_ptr<const FpropPlan> consider_space_to_depth(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    std::shared_ptr<const FpropPlan> chosen) {
  const auto g = p.space_to_depth();
  const std::string& knob = knobs().space_to_depth;
  if (!g || knob == "off" || (knob != "on" && (current_tuning(p.flags) == Tuning::Untimed || chosen->transient))) {
    return chosen;
  }
  const std::string note = space_to_depth_note(*g, x.size(1));
  auto own = std::make_shared<FpropPlan>(*chosen);
  return optional_way_or_own<FpropPlan>(own, note, "regrouped copies", [&]() -> std::shared_ptr<const FpropPlan> {
    const FpropProblem q = p.with_space_to_depth();
    const std::shared_ptr<const FpropPlan> regrouped =
        fprop_plan(q, space_to_depth_input(x, *g), space_to_depth_weight(w, *g), b);
    if (regrouped->path == FpropPath::Aten) {
      own->notes.push_back(note + " not taken: that problem's plan is ATen's convolution");
      return own;
    }
    const auto via_regrouped = [&](const std::string& why) {
      auto plan = std::make_shared<FpropPlan>(*regrouped);
      plan->via_space_to_depth = regrouped;
      plan->via_padded_channels = nullptr; // the regrouped problem's own way, run through via_space_to_depth
      plan->notes.push_back(note + why);
      return plan;
    };
    if (knob == "on") {
      auto plan = via_regrouped(" (TORCH_CONVBIAS_SPACE_TO_DEPTH=on)");
      plan->layout_timings.clear();
      return plan;
    }
    // The problem's own way: the faster of the ways measured before (as_is / padded_channels: the one kept), or
    // measured now; then this one, all in layout_timings.
    auto timings = own->layout_timings;
    if (timings.empty()) {
      timings.emplace_back("as_is", time_on_stream([&] {
        (void)run_own_way(*own, p, x, w, b);
      }));
    }
    const float own_ms = std::min_element(timings.begin(), timings.end(), [](const auto& l, const auto& r) {
                           return l.second < r.second;
                         })->second;
    const float regrouped_ms = time_on_stream([&] {
      (void)run_plan(*regrouped, q, space_to_depth_input(x, *g), space_to_depth_weight(w, *g), b);
    });
    timings.emplace_back("space_to_depth", regrouped_ms);
    std::ostringstream measured;
    measured << regrouped_ms << " ms against " << own_ms << " ms";
    if (regrouped_ms < own_ms) {
      auto plan = via_regrouped(": measured faster, " + measured.str());
      plan->layout_timings = std::move(timings);
      return plan;
    }
    own->notes.push_back(note + " measured slower: " + measured.str());
    own->layout_timings = std::move(timings);
    return own;
  });
}

std::shared_ptr<const FpropPlan> build_plan(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (p.channels_last) {
    return consider_space_to_depth(p, x, w, b, consider_padded_channels(p, x, w, b, build_graph_path(p, x, w, b)));
  }
  return build_nchw_plan(p, x, w, b);
}

// The problem of forward's own route for a residual problem: conv + bias alone (the add and the activation follow).
FpropProblem without_residual(const FpropProblem& p) {
  FpropProblem q = p;
  q.has_residual = false;
  q.residual_alignment = 16;
  q.activation = ActivationSpec{};
  return q;
}

// How a residual problem runs where its graph does not: forward's own route for conv + bias, then one pass adding the
// residual, or, with a bias, ATen's convolution without it, then one pass adding both (sets `plan`'s
// residual_bias_in_pass). The latter where forward's own route is ATen's convolution anyway (bias_joins_residual_pass)
// or, timed, where it measures faster than that route with its pass. Returns the chosen way's time (-1 untimed).
float choose_residual_pass(
    FpropPlan& plan, const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& r, bool timed) {
  const FpropProblem q = without_residual(p);
  const auto own = fprop_plan(q, x, w, b);
  plan.residual_bias_in_pass = bias_joins_residual_pass(*own, q);
  if (!timed) {
    return -1;
  }
  const float own_ms = time_on_stream([&] {
    if (plan.residual_bias_in_pass) {
      (void)run_aten_then_residual(q.params, x, w, *b, r, p.activation);
      return;
    }
    at::Tensor out = run_own_way(*own, q, x, w, b);
    add_activation_(out, r, p.activation);
  });
  if (plan.residual_bias_in_pass || !p.has_bias) {
    return own_ms;
  }
  const float aten_ms = time_on_stream([&] { (void)run_aten_then_residual(q.params, x, w, *b, r, p.activation); });
  const bool injected = injected_aten_preferences.take();
  std::ostringstream timings;
  timings << aten_ms << " ms against " << own_ms << " ms for forward's route (" << path_name(own->path)
          << ") + one pass adding the residual";
  if (!injected && aten_ms >= own_ms) {
    plan.notes.push_back("forward's route + one pass adding the residual measured faster than ATen's convolution + "
                         "one pass adding the bias and the residual: " + timings.str());
    return own_ms;
  }
  plan.residual_bias_in_pass = true;
  plan.notes.push_back(
      injected ? "ATen's convolution + one pass adding the bias and the residual taken by the test hook "
                 "(convbias::_inject_aten_preferences)"
               : "ATen's convolution + one pass adding the bias and the residual measured faster: " + timings.str());
  return aten_ms;
}

// A residual problem's plan (channels_last only): the graph conv -> residual ADD -> [bias ADD] -> [activation] where
// it builds and runs (untimed: on a precompiled engine, as the activation's epilogue; timed: also measured against
// the faster way without it, choose_residual_pass, the faster kept), else the ATen path, which forward_residual reads
// as "forward's route (or ATen's convolution without the bias: residual_bias_in_pass), then one pass adding the
// residual and applying the activation".
std::shared_ptr<FpropPlan> build_residual_plan(
    const FpropProblem& p, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& r) {
  TORCH_INTERNAL_ASSERT(p.has_residual && p.channels_last && !p.keep_preactivation);
  auto plan = std::make_shared<FpropPlan>();
  const auto& k = knobs();
  SelectionPolicy policy = default_policy(p.dtype, p.flags);
  plan->tuned = policy.time_candidates();
  if (k.path == "unfused" || k.activation == "unfused") {
    plan->notes.push_back(
        std::string(k.path == "unfused" ? "TORCH_CONVBIAS_PATH=unfused" : "TORCH_CONVBIAS_ACTIVATION=unfused") +
        ": the residual is added after forward's route");
    choose_residual_pass(*plan, p, x, w, b, r, /*timed=*/false);
    return plan;
  }
  const bool forced = k.path == "fused" || k.activation == "fused";
  if (!policy.time_candidates() && !forced) {
    // As for the activation's epilogue: runtime-compiled fusion engines cost seconds to build per shape.
    policy.allow_runtime_compiled = false;
  }
  const GraphForm form{p.has_bias, !p.activation.is_identity(), false, /*residual=*/true};
  const at::Tensor y = new_output(p, x);
  GraphAttempt a = attempt(p, form, policy, x, w, b, y, r);
  if (!a.failure.empty()) {
    plan->notes.push_back(
        graph_name(form, p.activation) + " rejected: " + a.failure + "; forward's route, then the residual added");
    plan->transient = a.engine.transient;
    TORCH_CHECK(
        !forced, "convbias: ", k.path == "fused" ? "TORCH_CONVBIAS_PATH" : "TORCH_CONVBIAS_ACTIVATION",
        "=fused but cuDNN rejected the ", graph_name(form, p.activation), " for ", p.describe(), ": ", a.failure,
        ". Hint: ", layout_hint(p));
    plan->separate_activation_ms = choose_residual_pass(*plan, p, x, w, b, r, policy.time_candidates());
    return plan;
  }
  auto fused = std::make_shared<FpropPlan>(*plan);
  fused->path = p.has_bias ? FpropPath::Fused : FpropPath::Conv;
  fused->graph = a.graph;
  fused->engine = a.engine;
  fused->residual_fused = true;
  fused->activation_fused = !p.activation.is_identity();
  fused->graph_ops = graph_operations(*a.graph);
  if (!policy.time_candidates() || forced) {
    fused->notes.push_back("the " + graph_name(form, p.activation) + " built and ran");
    return fused;
  }
  // The graph against the best way without it, on these tensors, as calls run them.
  fused->epilogue_ms = time_on_stream([&] { (void)run_fprop_residual(*fused, p, x, w, b, r); });
  fused->separate_activation_ms = choose_residual_pass(*plan, p, x, w, b, r, /*timed=*/true);
  std::ostringstream timings;
  timings << fused->epilogue_ms << " ms against " << fused->separate_activation_ms << " ms for "
          << (plan->residual_bias_in_pass ? "ATen's convolution" : "forward's route") << " + one pass adding "
          << (plan->residual_bias_in_pass ? "the bias and " : "") << "the residual and applying the activation";
  if (fused->epilogue_ms <= fused->separate_activation_ms) {
    fused->notes.push_back("the " + graph_name(form, p.activation) + " measured faster: " + timings.str());
    return fused;
  }
  plan->epilogue_ms = fused->epilogue_ms;
  plan->separate_activation_ms = fused->separate_activation_ms;
  plan->notes.push_back("the " + graph_name(form, p.activation) + " measured slower: " + timings.str());
  return plan;
}

// The tensors a stored graph of `form` for `p` must have (plan_store::take_graph checks them): the pre-activation
// output among them when the form writes it.
plan_store::ExpectedTensors expected_tensors(const FpropProblem& p, const GraphForm& form) {
  plan_store::ExpectedTensors expected{
      {kX, {as_vector(p.x_dims), packed_strides(p.x_dims, p.channels_last)}},
      {kW, {as_vector(p.w_dims), packed_strides(p.w_dims, p.channels_last)}},
      {kY, {as_vector(p.y_dims), packed_strides(p.y_dims, p.channels_last)}}};
  if (form.preactivation) {
    expected[kZ] = {as_vector(p.y_dims), packed_strides(p.y_dims, p.channels_last)};
  }
  if (form.residual) {
    expected[kR] = {as_vector(p.y_dims), packed_strides(p.y_dims, p.channels_last)};
  }
  if (form.bias) {
    const int64_t k = p.w_dims[0];
    expected[kB] = {{1, k, 1, 1}, {k, 1, k, k}};
  }
  return expected;
}

// The persistent plan cache's record of a plan: its decisions and, for a graph path, the graph's plans.
std::optional<plan_store::Json> plan_record(const FpropPlan& plan) {
  plan_store::Json r{
      {"path", path_name(plan.path)},
      {"via_channels_last", plan.via_channels_last != nullptr},
      {"via_padded_channels", plan.via_padded_channels != nullptr},
      {"via_space_to_depth", plan.via_space_to_depth != nullptr},
      {"tuned", plan.tuned},
      {"fused_ms", plan.fused_ms},
      {"unfused_ms", plan.unfused_ms},
      {"graph_ms", plan.graph_ms},
      {"aten_ms", plan.aten_ms},
      {"aten_matmul", plan.aten_matmul},
      {"matmul_ms", plan.matmul_ms},
      {"notes", plan.notes},
      {"layout_timings", plan_store::timings_json(plan.layout_timings)},
      {"activation_fused", plan.activation_fused},
      {"activation_why", plan.activation_why},
      {"epilogue_ms", plan.epilogue_ms},
      {"separate_activation_ms", plan.separate_activation_ms},
      {"preactivation_output", plan.preactivation_output},
      {"residual_fused", plan.residual_fused},
      {"residual_bias_in_pass", plan.residual_bias_in_pass}};
  // A plan run via channels_last, padded or regrouped copies stores its choice only: the plan it runs is stored under its own key.
  const bool own_graph = !plan.via_channels_last && !plan.via_padded_channels && !plan.via_space_to_depth &&
      plan.path != FpropPath::Aten;
  return plan_store::put_graph(r, own_graph ? plan.graph : nullptr, plan.engine) ? std::optional(r) : std::nullopt;
}

// The plan a record describes, or null when it does not fit the problem or cuDNN does not rebuild its graph. A
// plan that ran via channels_last copies looks up (or loads, or builds) the channels_last plan it runs.
std::shared_ptr<const FpropPlan> plan_from_record(
    const plan_store::Json& r, const FpropProblem& p, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b) {
  const std::string path = r.at("path").get<std::string>();
  const FpropPath paths[] = {FpropPath::Fused, FpropPath::Conv, FpropPath::ConvThenBiasAdd, FpropPath::Aten};
  const auto* found = std::find_if(std::begin(paths), std::end(paths), [&](FpropPath c) { return path == path_name(c); });
  if (found == std::end(paths) || (*found != FpropPath::Aten && (*found == FpropPath::Conv) == p.has_bias)) {
    return nullptr;
  }
  // The epilogue ends a fused or conv graph, and only for an activation (the key has it: this guards the record).
  const bool activation_fused = r.at("activation_fused").get<bool>();
  if (activation_fused &&
      (p.activation.is_identity() || (*found != FpropPath::Fused && *found != FpropPath::Conv))) {
    return nullptr;
  }
  // A graph with the epilogue writes the pre-activation exactly when the problem keeps it (the key says so too).
  const bool preactivation_output = r.at("preactivation_output").get<bool>();
  if (preactivation_output != (activation_fused && p.keep_preactivation)) {
    return nullptr;
  }
  // A residual problem's plan is its graph (which adds the residual) or ATen (forward's route, then the add).
  const bool residual_fused = r.at("residual_fused").get<bool>();
  if (residual_fused != (p.has_residual && *found != FpropPath::Aten)) {
    return nullptr;
  }
  // The bias in the residual's pass: only for the ATen path of a residual problem with a bias.
  const bool residual_bias_in_pass = r.at("residual_bias_in_pass").get<bool>();
  if (residual_bias_in_pass && (!p.has_residual || !p.has_bias || *found != FpropPath::Aten)) {
    return nullptr;
  }
  // The matmul way: the ATen path of a problem it fits (records from before it have no such field).
  const bool aten_matmul = r.value("aten_matmul", false);
  if (aten_matmul && (*found != FpropPath::Aten || !matmul_fits(p))) {
    return nullptr;
  }
  std::shared_ptr<FpropPlan> plan;
  if (r.at("via_channels_last").get<bool>()) {
    if (p.channels_last) {
      return nullptr;
    }
    constexpr auto cl = at::MemoryFormat::ChannelsLast;
    auto via = fprop_plan(p.as_channels_last(), x.contiguous(cl), w.contiguous(cl), b);
    plan = std::make_shared<FpropPlan>(*via);
    plan->via_channels_last = via;
  } else if (r.at("via_padded_channels").get<bool>()) {
    const int64_t channels = p.padded_channels();
    if (channels == 0) {
      return nullptr;
    }
    auto via = fprop_plan(p.with_padded_channels(), pad_channels(x, channels), pad_channels(w, channels), b);
    if (via->path == FpropPath::Aten) {
      return nullptr;
    }
    plan = std::make_shared<FpropPlan>(*via);
    plan->via_padded_channels = via;
  } else if (r.at("via_space_to_depth").get<bool>()) {
    const auto g = p.space_to_depth();
    if (!g) {
      return nullptr;
    }
    auto via = fprop_plan(p.with_space_to_depth(), space_to_depth_input(x, *g), space_to_depth_weight(w, *g), b);
    if (via->path == FpropPath::Aten) {
      return nullptr;
    }
    plan = std::make_shared<FpropPlan>(*via);
    plan->via_space_to_depth = via;
    plan->via_padded_channels = nullptr;
  } else {
    plan = std::make_shared<FpropPlan>();
    plan->path = *found;
    plan->aten_matmul = aten_matmul;
    plan->activation_fused = activation_fused;
    plan->preactivation_output = preactivation_output;
    plan->residual_fused = residual_fused;
    plan->residual_bias_in_pass = residual_bias_in_pass;
    // The stored graph must hold the problem's tensors (the pre-activation output when it writes one) and exactly the
    // operations the record says it runs (the activation node, with its slope, in particular).
    const GraphForm form = form_of(*plan);
    const std::vector<std::string> operations = expected_operations(p, form);
    std::string why;
    if (!plan_store::take_graph(r, expected_tensors(p, form), plan->graph, plan->engine, &why, operations) ||
        (plan->path != FpropPath::Aten) != bool(plan->graph)) {
      return nullptr;
    }
    if (plan->graph) {
      plan->graph_ops = operations;
    }
  }
  plan->tuned = r.at("tuned").get<bool>();
  plan->fused_ms = r.at("fused_ms").get<float>();
  plan->unfused_ms = r.at("unfused_ms").get<float>();
  plan->graph_ms = r.at("graph_ms").get<float>();
  plan->aten_ms = r.at("aten_ms").get<float>();
  plan->matmul_ms = r.value("matmul_ms", -1.0f);
  plan->notes = r.at("notes").get<std::vector<std::string>>();
  plan->notes.push_back("loaded from the persistent plan cache");
  plan->layout_timings = plan_store::timings_from(r.at("layout_timings"));
  plan->activation_why = r.at("activation_why").get<std::string>();
  plan->epilogue_ms = r.at("epilogue_ms").get<float>();
  plan->separate_activation_ms = r.at("separate_activation_ms").get<float>();
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
  f.push_back(device); // fields[2]: the device (plan_store::load leaves it out)
  f.push_back(channels_last);
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
  // The activation: its kind, and for leaky_relu the bits of its slope (the others ignore it, so share their keys).
  f.push_back(static_cast<int64_t>(activation.kind));
  int64_t slope_bits = 0;
  if (activation.kind == Activation::LeakyRelu) {
    static_assert(sizeof(slope_bits) == sizeof(activation.negative_slope));
    std::memcpy(&slope_bits, &activation.negative_slope, sizeof(slope_bits));
  }
  f.push_back(slope_bits);
  f.push_back(keep_preactivation);
  f.push_back(has_residual);
  f.push_back(has_residual ? residual_alignment : 0);
  return key;
}

std::string FpropProblem::describe() const {
  std::ostringstream s;
  s << "input " << at::IntArrayRef(x_dims) << ", weight " << at::IntArrayRef(w_dims) << ", output "
    << at::IntArrayRef(y_dims) << (channels_last ? " (all channels_last), " : " (all NCHW), ") << dtype
    << (has_bias ? ", with bias" : ", no bias") << ", stride " << at::IntArrayRef(params.stride) << ", padding "
    << at::IntArrayRef(params.padding) << ", dilation " << at::IntArrayRef(params.dilation) << ", groups "
    << params.groups << ", alignment " << at::IntArrayRef(alignments) << " bytes";
  if (!activation.is_identity()) {
    s << ", activation " << activation_name(activation.kind);
    if (activation.kind == Activation::LeakyRelu) {
      s << " (negative_slope " << activation.negative_slope << ")";
    }
    if (keep_preactivation) {
      s << ", pre-activation kept (second output)";
    }
  }
  if (has_residual) {
    s << ", residual added before the activation (alignment " << residual_alignment << " bytes)";
  }
  return s.str();
}

FpropProblem FpropProblem::as_channels_last() const {
  FpropProblem p = *this;
  p.channels_last = true;
  p.alignments = {16, 16, alignments[2], 16};
  p.matmul_way = false;
  return p;
}

int64_t FpropProblem::padded_channels() const {
  return channels_last && !has_residual
      ? padded_channel_count(dtype, x_dims[1], params.groups, x_dims[0] * x_dims[2] * x_dims[3])
      : 0;
}

FpropProblem FpropProblem::with_padded_channels() const {
  const int64_t channels = padded_channels();
  TORCH_INTERNAL_ASSERT(channels > 0);
  FpropProblem p = *this;
  p.x_dims[1] = channels;
  p.w_dims[1] = channels;
  p.alignments[0] = 16;
  p.alignments[1] = 16;
  p.matmul_way = false;
  return p;
}

std::optional<SpaceToDepth> FpropProblem::space_to_depth() const {
  return channels_last && !has_residual ? space_to_depth_of(x_dims, w_dims, y_dims, params, c10::elementSize(dtype))
                                        : std::nullopt;
}

FpropProblem FpropProblem::with_space_to_depth() const {
  const auto g = space_to_depth();
  TORCH_INTERNAL_ASSERT(g);
  FpropProblem p = regrouped_problem(*this, *g, 0, 1);
  p.matmul_way = false;
  return p;
}

PlanCaches<FpropPlan>& fprop_cache() {
  static PlanCaches<FpropPlan> caches(knobs().cache_size);
  return caches;
}

FpropProblem make_problem(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, at::IntArrayRef y_dims,
    const ConvParams& params, bool channels_last, const ActivationSpec& activation) {
  FpropProblem p;
  p.dtype = x.scalar_type();
  p.device = x.device().index();
  p.channels_last = channels_last;
  for (int i = 0; i < 4; ++i) {
    p.x_dims[i] = x.size(i);
    p.w_dims[i] = w.size(i);
    p.y_dims[i] = y_dims[i];
  }
  p.params = params;
  p.has_bias = b.has_value() && b->defined();
  // The caching allocator hands out (at least) 512-byte aligned blocks, and y is always freshly allocated.
  p.alignments = {pointer_alignment(x), pointer_alignment(w), p.has_bias ? pointer_alignment(*b) : 16, 16};
  p.flags = current_math_flags();
  p.activation = activation;
  return p;
}

std::shared_ptr<const FpropPlan> fprop_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    bool* was_cached, double* build_seconds) {
  const PlanKey key = problem.key();
  return lookup_plan<FpropPlan>(
      fprop_cache(), "forward", key, requested_tuning(problem.flags) != Tuning::Untimed,
      [&](const plan_store::Json& r) { return plan_from_record(r, problem, x, w, b); },
      [&] { return build_plan(problem, x, w, b); }, &plan_record, build_seconds, was_cached);
}

at::Tensor run_fprop(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& out) {
  return run_plan(plan, problem, x, w, b, out).first;
}

std::shared_ptr<const FpropPlan> fprop_residual_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& r, bool* was_cached, double* build_seconds) {
  const PlanKey key = problem.key();
  return lookup_plan<FpropPlan>(
      fprop_cache(), "forward", key, requested_tuning(problem.flags) != Tuning::Untimed,
      [&](const plan_store::Json& record) { return plan_from_record(record, problem, x, w, b); },
      [&] { return build_residual_plan(problem, x, w, b, r); }, &plan_record, build_seconds, was_cached);
}

at::Tensor run_fprop_residual(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& r) {
  TORCH_INTERNAL_ASSERT(plan.residual_fused && plan.graph);
  const GraphForm form = form_of(plan);
  at::Tensor y = new_output(problem, x);
  auto pack = variant_pack(x, w, b, y, form.bias, at::Tensor(), r);
  execute_plan(*plan.graph, plan.engine, pack, x.options(), [&] {
    return graph_name(form, problem.activation) + " for " + problem.describe();
  });
  return y;
}

std::pair<at::Tensor, at::Tensor> run_fprop_with_preactivation(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b) {
  TORCH_INTERNAL_ASSERT(problem.keep_preactivation);
  return run_plan(plan, problem, x, w, b);
}

} // namespace convbias::cuda

// convbias::_input_grad_activation on CUDA: a layer's input gradient multiplied by the derivative of the activation of
// the layer below (whose output is this layer's input), dz = conv_dgrad(dy, w) * act'(saved), and the bias gradient
// of dz. Two ways:
//   separate  the input gradient's own route (dgrad.h: ATen's, or a timed conv_dgrad graph), then
//             convbias::_activation_backward's (activation_backward.h: one pass writing dz and summing it);
//   graph     one cuDNN graph conv_dgrad -> pointwise derivative (the activation's *_BWD mode reading `saved`), the
//             FP32 input gradient multiplied before its one rounding to dz; then the bias gradient of dz by
//             param_grad's way (bias_grad.h). Saves writing and re-reading the input gradient.
// The graph is only ever chosen by measurement: under TORCH_CONVBIAS_INPUT_GRAD=timed (the default) with choices
// timed, both ways are timed once per key (the bias gradient included in both) and the faster kept; otherwise the
// separate way runs, as it would without this op. The convbias torch.compile backend puts the op where a backward
// graph has our input gradient feeding our activation backward (torch_convbias/_backward_fusion.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>

#include "activation.h"
#include "conv_args.h"
#include "cuda/dgrad.h"
#include "cuda/grad_graph.h"

namespace convbias::cuda {

struct DgradActivationProblem {
  DgradProblem conv; // dy, w and dz (the input gradient's dims); conv.alignments[2] is dz's
  ActivationSpec activation;
  int64_t saved_alignment = 0;

  PlanKey key() const;
  std::string describe() const;
};

// graph null: the separate way runs; graph_ms / aten_ms: the graph way and the separate way, when measured.
using DgradActivationPlan = GradGraphPlan;

PlanCaches<DgradActivationPlan>& dgrad_activation_cache();

// How _input_grad_activation computes its results for these tensors; shared with its explain.
struct InputGradActivationRoute {
  // Set: the separate way, for this reason, without trying a graph (the knob, untimed choices, NCHW, the activation).
  std::optional<std::string> separate_reason;
  DgradActivationProblem problem;
  at::Tensor dy, w, saved; // channels_last and 16-byte aligned (only when a plan was looked up)
  std::shared_ptr<const DgradActivationPlan> plan;
  bool was_cached = false;
  double build_seconds = 0;

  bool runs_graph() const { return !separate_reason && plan && plan->graph; }
};

InputGradActivationRoute route_input_grad_activation(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params,
    const at::Tensor& saved, const ActivationSpec& activation);

// (grad_z, grad_bias if bias_grad) the way the route says; arguments checked by the caller.
std::tuple<at::Tensor, std::optional<at::Tensor>> input_grad_activation(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params,
    const at::Tensor& saved, const ActivationSpec& activation, bool bias_grad);

} // namespace convbias::cuda

// The input gradient on a cuDNN conv_dgrad graph (channels_last dy and weight), chosen only by measurement: when
// choices are timed (cudnn.benchmark, TORCH_CONVBIAS_AUTOTUNE), the best graph plan is timed against ATen's input
// gradient (nn.Conv2d's) and the faster kept; untimed, ATen's runs, as for nn.Conv2d. TORCH_CONVBIAS_INPUT_GRAD=timed,
// the default since the H100 model rows (AlexNet fp32 training 1.37x against 1.08x with ATen's input gradient: the
// graphs' FFT engines against the legacy kernels cudnnFind picks); =aten keeps nn.Conv2d's. Same plan cache,
// persistent store and diagnostics as the weight gradient (wgrad.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conv_args.h"
#include "cuda/grad_graph.h"
#include "cuda/graph_common.h"
#include "cuda/plan_lookup.h"

namespace convbias::cuda {

struct DgradProblem {
  at::ScalarType dtype;
  c10::DeviceIndex device;
  std::array<int64_t, 4> dy_dims, w_dims, x_dims;
  ConvParams params;
  std::array<int64_t, 3> alignments; // dy, w, dx in bytes
  MathFlags flags;

  PlanKey key() const;
  std::string describe() const;
};

// The input gradient's plan: the conv_dgrad graph where it measured faster, else ATen's input gradient.
using DgradPlan = GradGraphPlan;

PlanCaches<DgradPlan>& dgrad_cache();

// How convbias::_input_grad computes the input gradient for these tensors; shared with explain_param_grad.
struct InputGradRoute {
  // Set: ATen's input gradient, for this reason, without trying a graph (the knob, untimed choices, NCHW, ...).
  std::optional<std::string> aten_reason;
  DgradProblem problem;
  at::Tensor dy, w, dx; // channels_last and 16-byte aligned; dx allocated for the graph to write
  std::shared_ptr<const DgradPlan> plan;
  bool was_cached = false;
  double build_seconds = 0;

  bool runs_graph() const { return !aten_reason && plan && plan->graph; }
};

// Looks up (or builds, times and caches) the input-gradient plan; `input` gives the gradient's shape and layout only
// (its data is never read: it may be a stand-in).
InputGradRoute route_input_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

// Runs the route's conv_dgrad graph (route.runs_graph()): grad_input, channels_last.
at::Tensor run_input_grad(const InputGradRoute& route);

// convbias::_input_grad on CUDA (arguments checked): the route's graph where it runs one, else ATen's input gradient
// (input_grad_reference).
at::Tensor input_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

} // namespace convbias::cuda

// The weight gradient on a cuDNN conv_wgrad graph (channels_last dy and x), with the same plan cache, engine
// selection, note filters and diagnostics as the forward.
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
#include "cuda/space_to_depth.h"

namespace convbias::cuda {

struct WgradProblem {
  at::ScalarType dtype;
  c10::DeviceIndex device;
  std::array<int64_t, 4> x_dims, dy_dims, w_dims;
  ConvParams params;
  std::array<int64_t, 3> alignments; // x, dy, dw in bytes
  MathFlags flags;

  PlanKey key() const;
  std::string describe() const;
  // As FpropProblem's: the input channel count of the same problem on zero-padded copies of x (dw then has the
  // padded channels too, the extra ones discarded), or 0 where that way does not apply (pad_channels.h).
  int64_t padded_channels() const;
  WgradProblem with_padded_channels() const; // on those copies (fresh, 16-byte aligned)
  // The forward's regrouping of a strided stem (space_to_depth.h), or nullopt: besides space_to_depth_of's conditions,
  // only where x's channel rows need padding and the regrouped ones do not (bf16 RGB: 3 -> 48 channels), so that the
  // padded and the regrouped ways never run one inside the other.
  std::optional<SpaceToDepth> space_to_depth() const;
  WgradProblem with_space_to_depth() const; // the regrouped problem (fresh, 16-byte aligned x and dw; the same dy)
};

// The weight gradient's plan: the conv_wgrad graph, or ATen's weight gradient where no graph builds or it measured
// faster.
using WgradPlan = GradGraphPlan;

PlanCaches<WgradPlan>& wgrad_cache();

// How param_grad computes the weight gradient for these tensors; shared by param_grad and explain_param_grad.
struct WeightGradRoute {
  // Set: ATen's weight gradient, for this reason, without trying a graph (NCHW tensors, float64, the knob, ...).
  std::optional<std::string> aten_reason;
  WgradProblem problem;
  // channels_last and 16-byte aligned; dw allocated for the graph to write. With the plan's via_padded_channels, x and
  // dw have problem.padded_channels() channels (x zero-padded); with its via_space_to_depth, x is regrouped and dw has
  // the regrouped weight's shape (problem.with_space_to_depth()).
  at::Tensor dy, x, dw;
  // The cached plan; without a graph in it ATen runs (no graph builds, or ATen was measured faster: see notes).
  std::shared_ptr<const WgradPlan> plan;
  bool was_cached = false;
  double build_seconds = 0;

  bool runs_graph() const { return !aten_reason && plan && plan->graph; }
};

// Looks up (or builds and caches) the weight-gradient plan for grad_output, input and weight.
WeightGradRoute route_weight_grad(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

// Runs the route's conv_wgrad graph (route.runs_graph()): grad_weight in `weight`'s memory format.
at::Tensor run_weight_grad(const WeightGradRoute& route, const at::Tensor& weight);

} // namespace convbias::cuda

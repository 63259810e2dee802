// Turning forward's arguments into the channels_last tensors and the problem (with its activation) the fprop plans
// work on.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "conv_args.h"
#include "cuda/fprop.h"

namespace convbias::cuda {

// Why a call goes straight to ATen without trying a cuDNN graph, or nullopt. `output_numel`: the element count of the
// convolution's output side (the forward's output, the gradients' grad_output), which can pass 2^31 - 1 while the
// input does not (N >= 1024 with more output than input channels).
std::optional<std::string> aten_only_reason(const at::Tensor& input, const at::Tensor& weight, int64_t output_numel);

// aten_only_reason without the element-count limit: the settings and tensors that send a call to ATen whatever its
// size (a call only too large is split into parts of the batch instead, where it can be: batch_parts.h).
std::optional<std::string> aten_only_setting_reason(const at::Tensor& input, const at::Tensor& weight);

// The element count of the convolution's output for these arguments.
int64_t output_numel(const at::Tensor& input, const at::Tensor& weight, const ConvParams& params);

// The caller's tensors made fully packed in one layout: channels_last when F.conv2d would return channels_last
// (input or weight channels_last), else NCHW (the plan then decides, by measurement, how NCHW runs).
struct PreparedForward {
  at::Tensor x, w; // fully packed in the problem's layout (copies when the caller's were not)
  std::optional<at::Tensor> b; // contiguous, or nullopt
  bool converted_input = false; // x or w had to be copied
  bool realigned = false; // x, w or bias was copied to a 16-byte aligned buffer
  FpropProblem problem;
};

// keep_preactivation: the problem keeps the pre-activation as a second output (FpropProblem::keep_preactivation).
PreparedForward prepare_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& activation, bool keep_preactivation = false);

// The path a forward call takes: ATen before any graph (aten_reason set), or the prepared tensors and their
// cached plan (whose own path may still be ATen when no graph builds). The one decision forward and explain share.
struct ForwardRoute {
  std::optional<std::string> aten_reason;
  // With keep_preactivation: the plan is that of conv + bias alone (identity), and the caller applies the activation
  // to its output out of place (NCHW problems, whose graphs are precompiled-engine only and often run via copies:
  // they keep today's two passes rather than a second kind of NCHW plan).
  bool activation_after = false;
  std::optional<PreparedForward> prepared;
  std::shared_ptr<const FpropPlan> plan;
  bool was_cached = false;
  double build_seconds = 0;
};

// keep_preactivation (convbias::_forward_with_preactivation, an activation other than identity): a channels_last
// problem gets the plan whose graph writes both the pre-activation and the activation (or, where that does not
// build or measures slower, the graph without the activation: run_fprop_with_preactivation runs either); an NCHW one
// the plan of conv + bias alone, with activation_after set.
ForwardRoute route_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const ConvParams& params,
    const ActivationSpec& activation, bool keep_preactivation = false);

// forward_residual's route. A call whose output is channels_last gets the residual plan (fprop_residual_plan) over
// the prepared tensors and `r`, the residual packed channels_last (a copy when it was not); `why_not` says why the
// residual cannot be in a graph otherwise (an ATen-only call, NCHW tensors). Where the plan is not residual_fused
// the caller runs forward's route (or ATen's convolution without the bias: residual_pass_adds_bias), then one pass
// adding the residual (and the bias) and applying the activation.
struct ResidualRoute {
  std::optional<std::string> why_not;
  std::optional<PreparedForward> prepared;
  at::Tensor r;
  std::shared_ptr<const FpropPlan> plan;
  bool was_cached = false;
  double build_seconds = 0;
};

// Whether forward_residual's pass (where the residual's graph does not run) adds the bias too, ATen's convolution then
// running without it: the residual plan's choice where the call has one (FpropPlan::residual_bias_in_pass), else where
// `own` (forward's route for conv + bias alone, one call of the whole batch) is ATen's convolution
// (bias_joins_residual_pass). One decision for the call and explain().
bool residual_pass_adds_bias(const ResidualRoute& route, const ForwardRoute& own);

ResidualRoute route_forward_residual(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& residual, const ConvParams& params, const ActivationSpec& activation);

} // namespace convbias::cuda

// The fused conv+bias forward on cuDNN graphs: which path a problem takes (fused graph, conv-only graph plus
// a bias add, or ATen), the cached plan for it, and running it.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conv_args.h"
#include "cuda/graph_common.h"
#include "cuda/plan_cache.h"

namespace convbias::cuda {

// Fused: the conv+bias graph; Conv: the conv graph of a call without bias; ConvThenBiasAdd: the conv graph
// followed by ATen's bias add; Aten: ATen's convolution (no cuDNN graph builds for the problem).
enum class FpropPath { Fused, Conv, ConvThenBiasAdd, Aten };
const char* path_name(FpropPath path);

// Everything that decides the plan. Tensors are channels_last (fully packed NHWC) by the time they get here.
struct FpropProblem {
  at::ScalarType dtype;
  c10::DeviceIndex device;
  std::array<int64_t, 4> x_dims, w_dims, y_dims;
  ConvParams params;
  bool has_bias;
  std::array<int64_t, 4> alignments; // x, w, bias, y in bytes
  MathFlags flags;

  PlanKey key() const;
  std::string describe() const; // shapes, dtype and parameters, for messages
};

struct FpropPlan {
  FpropPath path = FpropPath::Aten;
  std::shared_ptr<fe::graph::Graph> graph; // the fused or conv-only graph; null on the ATen path
  EngineChoice engine;
  bool tuned = false; // candidates (and fused vs unfused) were timed
  float fused_ms = -1; // measured, when both paths were timed
  float unfused_ms = -1;
  std::vector<std::string> notes; // why this path: what was rejected and why
};

PlanCache<FpropPlan>& fprop_cache();

// The problem for channels_last tensors x, w, (b), y on the current device.
FpropProblem make_problem(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, const at::Tensor& y,
    const ConvParams& params);

// The cached plan for `problem`, built (and timed on these tensors, which it may overwrite y of) on a miss.
std::shared_ptr<const FpropPlan> fprop_plan(
    const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
    const at::Tensor& y, bool* was_cached = nullptr, double* build_seconds = nullptr);

// y = conv(x, w) + b by `plan` on the current stream (the ATen path is the caller's).
void run_fprop(
    const FpropPlan& plan, const FpropProblem& problem, const at::Tensor& x, const at::Tensor& w,
    const std::optional<at::Tensor>& b, const at::Tensor& y);

} // namespace convbias::cuda

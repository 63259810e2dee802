// The weight gradient on a cuDNN conv_wgrad graph (channels_last dy and x), with the same plan cache, engine
// selection, note filters and diagnostics as the forward.
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

struct WgradProblem {
  at::ScalarType dtype;
  c10::DeviceIndex device;
  std::array<int64_t, 4> x_dims, dy_dims, w_dims;
  ConvParams params;
  std::array<int64_t, 3> alignments; // x, dy, dw in bytes
  MathFlags flags;

  PlanKey key() const;
  std::string describe() const;
};

struct WgradPlan {
  std::shared_ptr<fe::graph::Graph> graph; // null: no graph builds, the caller runs ATen
  EngineChoice engine;
  float graph_ms = -1; // measured, when timing was allowed: the chosen graph plan ...
  float aten_ms = -1; // ... and ATen's weight gradient; the faster one is kept
  std::vector<std::string> notes;
};

PlanCache<WgradPlan>& wgrad_cache();

// grad_weight of the convolution for channels_last `dy` and `x` (16-byte aligned), in `weight`'s memory format,
// or nullopt when no cuDNN graph builds for the problem or ATen's was measured faster (the caller runs ATen).
std::optional<at::Tensor> weight_grad(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const ConvParams& params);

} // namespace convbias::cuda

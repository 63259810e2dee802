// What the weight-gradient (wgrad.h) and input-gradient (dgrad.h) routes share: a plan that is one cuDNN graph or
// ATen's kernel, whichever was chosen, with what was measured; its plan-cache key and its persistent-store record.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conv_args.h"
#include "cuda/graph_common.h"
#include "cuda/math_flags.h"
#include "cuda/plan_cache.h"
#include "cuda/plan_store.h"

namespace convbias::cuda {

struct GradGraphPlan {
  std::shared_ptr<fe::graph::Graph> graph; // null: ATen's kernel runs
  EngineChoice engine;
  float graph_ms = -1; // measured, when timing was allowed: the chosen graph plan ...
  float aten_ms = -1; // ... and ATen's kernel for the same gradient; the faster one is kept
  std::vector<std::string> notes;
  bool timed = false; // graph candidates and graph vs ATen were timed
  bool transient = false; // ATen because no candidate's workspace could be allocated now: neither cached nor stored
  // Weight gradient only (wgrad.cpp): taken when the problem on zero-padded input channels measured faster (the copies
  // included) or TORCH_CONVBIAS_PAD_CHANNELS=on: that problem's plan (graph and engine above copied from it), run on
  // the padded x into a padded dw whose first C channels are the gradient; padded_ms / as_is_ms: the two ways, when
  // measured.
  std::shared_ptr<const GradGraphPlan> via_padded_channels;
  float padded_ms = -1;
  float as_is_ms = -1;
  // Weight gradient only: taken when the strided stem's regrouped problem (space_to_depth.h) measured faster (the
  // regroupings included) or TORCH_CONVBIAS_SPACE_TO_DEPTH=on: that problem's plan, run on the regrouped x into a dw
  // of the regrouped weight's shape, regrouped back; space_to_depth_ms / own_way_ms: the two ways, when measured.
  std::shared_ptr<const GradGraphPlan> via_space_to_depth;
  float space_to_depth_ms = -1;
  float own_way_ms = -1;
};

// The plan-cache key of a gradient graph: `kind` (2: weight gradient, 4: input gradient), dtype, device (fields[2],
// which the plan store leaves out), the graph's three tensors' dims, the conv parameters, the alignments and the
// math flags that select engines.
PlanKey gradient_plan_key(
    int64_t kind, at::ScalarType dtype, c10::DeviceIndex device, const std::array<std::array<int64_t, 4>, 3>& dims,
    const ConvParams& params, const std::array<int64_t, 3>& alignments, const MathFlags& flags);

// The plan's persistent-store record (a null graph, ATen chosen by measurement, is stored too).
std::optional<plan_store::Json> gradient_plan_record(const GradGraphPlan& plan);

// The plan rebuilt from its record, after checking the stored graph's tensors are `expected`; null to refuse it.
std::shared_ptr<const GradGraphPlan> gradient_plan_from_record(
    const plan_store::Json& record, const plan_store::ExpectedTensors& expected);

} // namespace convbias::cuda

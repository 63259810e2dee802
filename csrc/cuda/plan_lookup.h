// Where a kind of plan (forward, weight gradient, bias reduction) is looked up, built and stored: the in-memory
// cache of the choices made outside CUDA graph capture (backed by the persistent plan store), and a cache of the
// untimed plans made during capture, which serve captures only - the next eager call of the key chooses as usual.
#pragma once

#include <functional>
#include <memory>

#include "cuda/plan_cache.h"
#include "cuda/plan_store.h"
#include "cuda/timing.h"

namespace convbias::cuda {

template <typename Plan>
struct PlanCaches {
  explicit PlanCaches(int64_t capacity) : eager(capacity), capture(capacity) {}
  PlanCache<Plan> eager;
  PlanCache<Plan> capture;

  void clear() {
    eager.clear();
    capture.clear();
  }
};

// The plan of `kind` for `key`: the eager cache's (also during capture: a choice already made is the best one),
// else, during capture, the capture cache's (built untimed by `build`: default_policy is untimed during capture), else
// the eager cache's built through the plan store (plan_store::load_or_build). `timed` says whether an eager choice is
// made by timing (only such choices are stored on disk).
template <typename Plan>
std::shared_ptr<const Plan> lookup_plan(
    PlanCaches<Plan>& caches,
    const char* kind,
    const PlanKey& key,
    bool timed,
    const std::function<std::shared_ptr<const Plan>(const plan_store::Json&)>& from_record,
    const std::function<std::shared_ptr<const Plan>()>& build,
    const std::function<std::optional<plan_store::Json>(const Plan&)>& to_record,
    double* build_seconds,
    bool* was_cached) {
  if (auto plan = caches.eager.find(key)) {
    if (was_cached != nullptr) {
      *was_cached = true;
    }
    return plan;
  }
  if (stream_is_capturing()) {
    return caches.capture.get_or_build(key, build, build_seconds, was_cached);
  }
  return caches.eager.get_or_build(
      key, [&] { return plan_store::load_or_build<Plan>(kind, key, timed, from_record, build, to_record); },
      build_seconds, was_cached);
}

} // namespace convbias::cuda

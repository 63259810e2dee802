// A thread-safe LRU of built cuDNN plans, keyed by everything that decides which plan is valid and best:
// graph kind, device, dtype, sizes, strides, conv parameters, math flags and pointer alignments.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace convbias::cuda {

struct PlanKey {
  std::vector<int64_t> fields;
  bool operator==(const PlanKey& other) const { return fields == other.fields; }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const;
};

struct CacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  int64_t size = 0;
  int64_t capacity = 0;
  double build_seconds = 0; // total time spent building (and timing) plans on misses
};

// Values are immutable once inserted and shared with callers, so an eviction never frees a plan in use.
// `Plan` has a `bool transient` member: a plan built under a transient condition (a workspace that could not be
// allocated while choosing) is returned to its caller but not kept.
template <typename Plan>
class PlanCache {
 public:
  explicit PlanCache(int64_t capacity) : capacity_(capacity) {}

  // The cached plan for `key`, or the one `build` makes. One build per key at a time: a thread missing a key that
  // another thread is building waits for that build (building and timing the same candidates twice on one GPU would
  // cost twice and disturb both timings), while builds of other keys go on in parallel (outside the lock). When a
  // build throws or its plan is transient, a waiting thread builds in turn. `was_cached`, when given, says whether
  // the plan came from the cache (a hit, also after waiting); `build_seconds_out` the build's time on a miss.
  std::shared_ptr<const Plan> get_or_build(
      const PlanKey& key,
      const std::function<std::shared_ptr<const Plan>()>& build,
      double* build_seconds_out,
      bool* was_cached = nullptr);

  // The cached plan for `key` (counted as a hit), or null (not counted: the caller builds through get_or_build).
  std::shared_ptr<const Plan> find(const PlanKey& key);

  CacheStats stats() const;
  void clear();

 private:
  using Entry = std::pair<PlanKey, std::shared_ptr<const Plan>>;
  mutable std::mutex mutex_;
  std::condition_variable built_; // signalled whenever a build ends
  int64_t capacity_;
  std::list<Entry> order_; // most recently used first
  std::unordered_map<PlanKey, typename std::list<Entry>::iterator, PlanKeyHash> index_;
  std::unordered_set<PlanKey, PlanKeyHash> building_; // keys whose build is under way
  CacheStats stats_;
};

} // namespace convbias::cuda

#include "cuda/plan_cache_impl.h"

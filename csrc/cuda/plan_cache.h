// A thread-safe LRU of built cuDNN plans, keyed by everything that decides which plan is valid and best:
// graph kind, device, dtype, sizes, strides, conv parameters, math flags and pointer alignments.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
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
template <typename Plan>
class PlanCache {
 public:
  explicit PlanCache(int64_t capacity) : capacity_(capacity) {}

  // The cached plan for `key`, or the one `build` makes (built outside the lock: a slow build does not block
  // other keys; two threads missing the same key both build, and the first insert wins). `was_cached`, when
  // given, says whether it was found (a hit); `build_seconds_out` the build's time on a miss.
  std::shared_ptr<const Plan> get_or_build(
      const PlanKey& key,
      const std::function<std::shared_ptr<const Plan>()>& build,
      double* build_seconds_out,
      bool* was_cached = nullptr);

  CacheStats stats() const;
  void clear();

 private:
  using Entry = std::pair<PlanKey, std::shared_ptr<const Plan>>;
  mutable std::mutex mutex_;
  int64_t capacity_;
  std::list<Entry> order_; // most recently used first
  std::unordered_map<PlanKey, typename std::list<Entry>::iterator, PlanKeyHash> index_;
  CacheStats stats_;
};

} // namespace convbias::cuda

#include "cuda/plan_cache_impl.h"

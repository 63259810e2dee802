// Template definitions of PlanCache (included by plan_cache.h).
#pragma once

#include <chrono>

namespace convbias::cuda {

inline size_t PlanKeyHash::operator()(const PlanKey& key) const {
  size_t seed = key.fields.size();
  for (const int64_t v : key.fields) {
    seed ^= std::hash<int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2);
  }
  return seed;
}

template <typename Plan>
std::shared_ptr<const Plan> PlanCache<Plan>::find(const PlanKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(key);
  if (it == index_.end()) {
    return nullptr;
  }
  order_.splice(order_.begin(), order_, it->second);
  ++stats_.hits;
  return it->second->second;
}

template <typename Plan>
std::shared_ptr<const Plan> PlanCache<Plan>::get_or_build(
    const PlanKey& key,
    const std::function<std::shared_ptr<const Plan>()>& build,
    double* build_seconds_out,
    bool* was_cached) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      auto it = index_.find(key);
      if (it != index_.end()) {
        if (was_cached != nullptr) {
          *was_cached = true;
        }
        order_.splice(order_.begin(), order_, it->second);
        ++stats_.hits;
        return it->second->second;
      }
      if (building_.count(key) == 0) {
        break;
      }
      built_.wait(lock);
    }
    if (was_cached != nullptr) {
      *was_cached = false;
    }
    ++stats_.misses;
    building_.insert(key);
  }
  // Whatever happens, the key stops being "under way" and waiting threads look again.
  auto finish = [&] {
    building_.erase(key);
    built_.notify_all();
  };
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<const Plan> plan;
  try {
    plan = build();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    finish();
    throw;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (build_seconds_out != nullptr) {
    *build_seconds_out = seconds;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  finish();
  stats_.build_seconds += seconds;
  if (plan->transient) {
    return plan;
  }
  order_.emplace_front(key, plan);
  index_.emplace(key, order_.begin());
  while (static_cast<int64_t>(order_.size()) > capacity_) {
    index_.erase(order_.back().first);
    order_.pop_back();
    ++stats_.evictions;
  }
  return plan;
}

template <typename Plan>
CacheStats PlanCache<Plan>::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheStats result = stats_;
  result.size = static_cast<int64_t>(order_.size());
  result.capacity = capacity_;
  return result;
}

template <typename Plan>
void PlanCache<Plan>::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  order_.clear();
  index_.clear();
  stats_ = CacheStats{};
}

} // namespace convbias::cuda

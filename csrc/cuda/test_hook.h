// The countdown behind the test hooks (convbias::_inject_*): arm(n) makes the next n events happen as the hook says
// (an execution fails, an epilogue graph is refused, ATen's convolution is preferred), take() consumes one. Atomic:
// calls from several threads each consume at most one.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace convbias::cuda {

class TestHookCountdown {
 public:
  void arm(int64_t count) {
    left_.store(std::max<int64_t>(count, 0));
  }

  // Whether this event is one the hook takes over (and one fewer is left).
  bool take() {
    int64_t left = left_.load();
    while (left > 0) {
      if (left_.compare_exchange_weak(left, left - 1)) {
        return true;
      }
    }
    return false;
  }

 private:
  std::atomic<int64_t> left_{0};
};

} // namespace convbias::cuda

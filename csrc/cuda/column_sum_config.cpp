#include "cuda/column_sum_config.h"

#include "cuda/math_flags.h"
#include "cuda/timing.h"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <mutex>

namespace convbias::cuda {
namespace {

// Measured on the H200 (2026-12-02, bench/bias_kernel_variants.cu over 9 grad_outputs of 98-784 MiB): 4 blocks
// per SM with 16 streaming loads in flight reached 0.83-1.05 of the copy bandwidth, the best or within 3% of it
// on every shape but one (bf16 98 MiB, where contiguous bands gained 5%); no setting is best everywhere. So each
// (device, dtype, rows, K, kernel) is timed once over a few launch configurations and the fastest kept where timing
// is asked for (cudnn.benchmark, TORCH_CONVBIAS_AUTOTUNE=quick/on); the default is used untimed (benchmark off, CUDA
// graph capture, TORCH_CONVBIAS_AUTOTUNE=off) and under determinism (cudnn.deterministic or
// use_deterministic_algorithms), where the summation order must not depend on a timing. The fused activation backward
// (two reads and a write per element) starts from the same default; not yet measured on a GPU.
constexpr std::array<LaunchConfig, 6> kCandidateConfigs = {
    {{4, 16, false}, {4, 16, true}, {2, 16, true}, {8, 16, true}, {4, 4, false}, {8, 4, true}}};

} // namespace

std::pair<LaunchConfig, bool> column_sum_config(
    const at::Tensor& like, ColumnSumKernel kernel, const std::function<void(LaunchConfig)>& run) {
  const MathFlags flags = current_math_flags();
  if (flags.deterministic || requested_tuning(flags) == Tuning::Untimed) {
    return {kDefaultLaunchConfig, false};
  }
  const int64_t columns = like.size(1);
  const std::array<int64_t, 5> key = {
      like.device().index(), static_cast<int64_t>(like.scalar_type()), like.numel() / columns, columns, kernel};
  static std::mutex mutex;
  static std::map<std::array<int64_t, 5>, LaunchConfig> tuned;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (auto it = tuned.find(key); it != tuned.end()) {
      return {it->second, true};
    }
  }
  // Only a shape not seen yet asks whether the stream is capturing (a stream query): the hot path is the lookup above.
  if (stream_is_capturing()) {
    return {kDefaultLaunchConfig, false};
  }
  // Two rounds (the second in reverse order), each candidate's faster time kept: the configurations differ by a
  // few percent, about as much as one ~1 ms timing varies. The default (candidate 0) within 3% of the best stays:
  // on the H200 a one-round argmin picked configurations 5% slower than the default on 128 MiB tensors.
  static_assert(kCandidateConfigs[0].blocks_per_sm == kDefaultLaunchConfig.blocks_per_sm &&
                kCandidateConfigs[0].unroll == kDefaultLaunchConfig.unroll &&
                kCandidateConfigs[0].contiguous == kDefaultLaunchConfig.contiguous);
  std::array<float, kCandidateConfigs.size()> ms;
  ms.fill(std::numeric_limits<float>::infinity());
  for (int round = 0; round < 2; ++round) {
    for (size_t n = 0; n < ms.size(); ++n) {
      const size_t i = round == 0 ? n : ms.size() - 1 - n;
      ms[i] = std::min(ms[i], time_on_stream([&] { run(kCandidateConfigs[i]); }));
    }
  }
  const size_t fastest = static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
  const LaunchConfig best = ms[fastest] < 0.97f * ms[0] ? kCandidateConfigs[fastest] : kDefaultLaunchConfig;
  const std::lock_guard<std::mutex> lock(mutex);
  // A bounded table: shapes seen by one training run are few; a program cycling through endless shapes re-times.
  if (tuned.size() >= 4096) {
    tuned.clear();
  }
  return {tuned.emplace(key, best).first->second, true};
}

} // namespace convbias::cuda

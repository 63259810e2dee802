// Measuring candidates on the GPU (engines, paths, kernel configurations), once per cache key. Kept apart from
// the cuDNN frontend so that CUDA kernels (.cu) can use it too; defined in graph_common.cpp.
#pragma once

#include <functional>
#include <limits>

namespace convbias::cuda {

// Runs `fn` once to warm up, then three times between CUDA events on the current stream; the best time in ms.
// When the warm-up run alone took longer than `give_up_above_ms`, returns its time without running again.
// Synchronises the stream, so it is only used once per cache key and never during CUDA graph capture.
float time_on_stream(
    const std::function<void()>& fn, float give_up_above_ms = std::numeric_limits<float>::infinity());

// Whether the current stream is capturing a CUDA graph (no synchronisation, no timing allowed then).
bool stream_is_capturing();

// Whether candidates may be timed now: not during CUDA graph capture, and not with TORCH_CONVBIAS_AUTOTUNE=off.
// The one rule for every choice made by measurement (engines, paths, layouts, kernel launch configurations).
bool timing_allowed();

} // namespace convbias::cuda

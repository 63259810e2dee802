// Measuring candidates on the GPU (engines, paths, kernel configurations), once per cache key. Kept apart from
// the cuDNN frontend so that CUDA kernels (.cu) can use it too; defined in graph_common.cpp.
#pragma once

#include <functional>
#include <limits>

namespace convbias::cuda {

// Runs `fn` once to warm up (timed alone), then once more and, queued behind it, 3-20 times (about 1 ms) between
// CUDA events on the current stream: the mean time per call in ms, as back-to-back calls cost in a training loop
// (GPU time, or host time where the host cannot keep up). When the warm-up run alone took longer than
// `give_up_above_ms`, returns its time without running again. The events are freed on every path, also when `fn`
// throws (the exception propagates).
// Synchronises the stream, so it is only used once per cache key and never during CUDA graph capture.
float time_on_stream(
    const std::function<void()>& fn, float give_up_above_ms = std::numeric_limits<float>::infinity());

// Whether the current stream is capturing a CUDA graph (no synchronisation, no timing allowed then).
bool stream_is_capturing();

} // namespace convbias::cuda

// The bias gradient: dy summed over N, H and W with FP32 accumulation, for channels_last dy, by a kernel of our
// own. On a channels_last tensor this is a column sum of the [N*H*W, K] matrix that dy is in memory: each block
// streams a band of rows with 16-byte loads, several in flight per thread (bandwidth is all that matters; the
// launch configuration is timed once per shape), folds them into per-column partial
// sums in a fixed order, and a second small pass adds the bands in a fixed order, so the result is bitwise
// repeatable (deterministic) without atomics.
#include "cuda/bias_grad.h"
#include "cuda/math_flags.h"
#include "cuda/timing.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace convbias::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;

template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

// The elements of one 16-byte load, widened and added into sum[0..kCount). bfloat16 widens by a shift (its bits
// are a float's upper half); the generic path through c10::BFloat16 cost ~15% of the bandwidth on the H200.
template <typename T>
struct Lanes;
template <>
struct Lanes<float> {
  static constexpr int kCount = 4;
  __device__ static void add(const uint4& v, float* sum) {
    sum[0] += __uint_as_float(v.x);
    sum[1] += __uint_as_float(v.y);
    sum[2] += __uint_as_float(v.z);
    sum[3] += __uint_as_float(v.w);
  }
};
template <>
struct Lanes<double> {
  static constexpr int kCount = 2;
  __device__ static void add(const uint4& v, double* sum) {
    sum[0] += __hiloint2double(static_cast<int>(v.y), static_cast<int>(v.x));
    sum[1] += __hiloint2double(static_cast<int>(v.w), static_cast<int>(v.z));
  }
};
template <>
struct Lanes<at::BFloat16> {
  static constexpr int kCount = 8;
  __device__ static void add(const uint4& v, float* sum) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sum[2 * i] += __uint_as_float(words[i] << 16);
      sum[2 * i + 1] += __uint_as_float(words[i] & 0xffff0000u);
    }
  }
};
template <>
struct Lanes<at::Half> {
  static constexpr int kCount = 8;
  __device__ static void add(const uint4& v, float* sum) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
      sum[2 * i] += pair.x;
      sum[2 * i + 1] += pair.y;
    }
  }
};

// Block (x, y): column vectors [x * columns_per_block, ...) of the rows of band y, in steps of rows_per_step rows.
// Bands are interleaved (band y takes steps y, y + bands, ...) or contiguous (band y takes one range of steps);
// which streams faster depends on the shape (measured, bench/bias_kernel_variants.cu). Loads are streaming
// (__ldcs, evict-first): grad_output is read once here. partial[y][k] = sum of dy[row][k] over the band's rows,
// in a fixed order.
template <typename T, int kUnroll, bool kContiguous>
__global__ void __launch_bounds__(kThreads) column_partial_sums(
    const uint4* __restrict__ dy, int64_t rows, int64_t columns, int columns_per_block, int rows_per_step,
    typename Accumulator<T>::type* __restrict__ partial) {
  using Acc = typename Accumulator<T>::type;
  constexpr int kVec = Lanes<T>::kCount;
  extern __shared__ unsigned char shared_bytes[];
  Acc* shared = reinterpret_cast<Acc*>(shared_bytes);

  const int lane_column = threadIdx.x % columns_per_block;
  const int row_in_step = threadIdx.x / columns_per_block;
  const int64_t vector_column = static_cast<int64_t>(blockIdx.x) * columns_per_block + lane_column;
  const int64_t vector_columns = columns / kVec;
  const bool active = row_in_step < rows_per_step && vector_column < vector_columns;

  Acc sum[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    sum[i] = 0;
  }
  if (active) {
    const uint4* base = dy + vector_column;
    int64_t row, stride, end;
    if constexpr (kContiguous) {
      const int64_t steps = (rows + rows_per_step - 1) / rows_per_step;
      const int64_t steps_per_band = (steps + gridDim.y - 1) / gridDim.y;
      row = static_cast<int64_t>(blockIdx.y) * steps_per_band * rows_per_step + row_in_step;
      end = min(rows, static_cast<int64_t>(blockIdx.y + 1) * steps_per_band * rows_per_step);
      stride = rows_per_step;
    } else {
      row = static_cast<int64_t>(blockIdx.y) * rows_per_step + row_in_step;
      end = rows;
      stride = static_cast<int64_t>(gridDim.y) * rows_per_step;
    }
    // kUnroll independent loads in flight per thread before any of them is added.
    for (; row + (kUnroll - 1) * stride < end; row += kUnroll * stride) {
      uint4 loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        loaded[u] = __ldcs(base + (row + u * stride) * vector_columns);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        Lanes<T>::add(loaded[u], sum);
      }
    }
    for (; row < end; row += stride) {
      Lanes<T>::add(__ldcs(base + row * vector_columns), sum);
    }
  }
  // Fold the block's rows: shared[row_in_step][lane_column * kVec + i].
  const int width = columns_per_block * kVec;
  if (row_in_step < rows_per_step) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      shared[row_in_step * width + lane_column * kVec + i] = sum[i];
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < width; j += blockDim.x) {
    const int64_t column = static_cast<int64_t>(blockIdx.x) * width + j;
    if (column >= columns) {
      continue;
    }
    Acc total = 0;
    for (int r = 0; r < rows_per_step; ++r) {
      total += shared[r * width + j];
    }
    partial[static_cast<int64_t>(blockIdx.y) * columns + column] = total;
  }
}

// out[k] = sum over bands of partial[band][k]. The bands number up to a few hundred: one thread per column walking
// them all is a chain of dependent L2 round trips (measured: tens of microseconds, the bulk of the time on tensors
// of 10-250 MB). So a block takes kFoldColumns columns and kFoldSlices threads per column: slice s adds bands s,
// s + kFoldSlices, ... with kFoldLoads loads in flight, then the slices are added in slice order - a fixed order.
constexpr int kFoldColumns = 32;
constexpr int kFoldSlices = kThreads / kFoldColumns;
constexpr int kFoldLoads = 8;

template <typename T>
__global__ void sum_bands(
    const typename Accumulator<T>::type* __restrict__ partial, int bands, int64_t columns, T* __restrict__ out) {
  using Acc = typename Accumulator<T>::type;
  __shared__ Acc slice_sums[kFoldSlices][kFoldColumns];
  const int lane = threadIdx.x % kFoldColumns;
  const int slice = threadIdx.x / kFoldColumns;
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kFoldColumns + lane;
  Acc total = 0;
  if (column < columns) {
    int band = slice;
    for (; band + (kFoldLoads - 1) * kFoldSlices < bands; band += kFoldLoads * kFoldSlices) {
      Acc loaded[kFoldLoads];
#pragma unroll
      for (int u = 0; u < kFoldLoads; ++u) {
        loaded[u] = partial[static_cast<int64_t>(band + u * kFoldSlices) * columns + column];
      }
#pragma unroll
      for (int u = 0; u < kFoldLoads; ++u) {
        total += loaded[u];
      }
    }
    for (; band < bands; band += kFoldSlices) {
      total += partial[static_cast<int64_t>(band) * columns + column];
    }
  }
  slice_sums[slice][lane] = total;
  __syncthreads();
  if (slice == 0 && column < columns) {
    Acc sum = 0;
#pragma unroll
    for (int s = 0; s < kFoldSlices; ++s) {
      sum += slice_sums[s][lane];
    }
    out[column] = static_cast<T>(sum);
  }
}

// How the kernel is launched: blocks of 256 threads per SM, loads in flight per thread (4 or 16), and whether
// each band of rows is one contiguous range or interleaved with the others.
struct LaunchConfig {
  int blocks_per_sm;
  int unroll;
  bool contiguous;
};

template <typename T, int kUnroll, bool kContiguous>
void launch_partials(
    const dim3& grid, size_t shared_bytes, cudaStream_t stream, const at::Tensor& dy, int64_t rows, int64_t columns,
    int columns_per_block, int rows_per_step, at::Tensor& partial) {
  using Acc = typename Accumulator<T>::type;
  column_partial_sums<T, kUnroll, kContiguous><<<grid, kThreads, shared_bytes, stream>>>(
      static_cast<const uint4*>(dy.const_data_ptr()), rows, columns, columns_per_block, rows_per_step,
      partial.mutable_data_ptr<Acc>());
}

template <typename T>
at::Tensor launch(const at::Tensor& dy, LaunchConfig config) {
  using Acc = typename Accumulator<T>::type;
  constexpr int kVec = Lanes<T>::kCount;
  static_assert(kVec * sizeof(T) == kVectorBytes);
  const int64_t columns = dy.size(1);
  const int64_t rows = dy.numel() / columns;
  const int64_t vector_columns = columns / kVec;
  const int columns_per_block = static_cast<int>(std::min<int64_t>(vector_columns, kThreads));
  const int rows_per_step = kThreads / columns_per_block;
  const int column_blocks = static_cast<int>((vector_columns + columns_per_block - 1) / columns_per_block);
  // `blocks_per_sm` blocks of 256 threads on every SM, and no band with fewer than ~16 steps of rows.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t max_bands = std::max<int64_t>(1, rows / (16LL * rows_per_step));
  const int bands =
      static_cast<int>(std::min<int64_t>(std::max(1, config.blocks_per_sm * sms / column_blocks), max_bands));

  at::Tensor partial = at::empty({bands, columns}, dy.options().dtype(c10::CppTypeToScalarType<Acc>::value));
  at::Tensor out = at::empty({columns}, dy.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const size_t shared_bytes = static_cast<size_t>(rows_per_step) * columns_per_block * kVec * sizeof(Acc);
  const dim3 grid(column_blocks, bands);
  const auto args = std::forward_as_tuple(grid, shared_bytes, stream, dy, rows, columns, columns_per_block, rows_per_step, partial);
  if (config.unroll == 16) {
    std::apply(config.contiguous ? launch_partials<T, 16, true> : launch_partials<T, 16, false>, args);
  } else {
    std::apply(config.contiguous ? launch_partials<T, 4, true> : launch_partials<T, 4, false>, args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_bands<T><<<static_cast<int>((columns + kFoldColumns - 1) / kFoldColumns), kThreads, 0, stream>>>(
      partial.const_data_ptr<Acc>(), bands, columns, out.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace

bool bias_grad_kernel_applies(const at::Tensor& grad_output) {
  if (grad_output.dim() != 4 || grad_output.numel() == 0 || !grad_output.is_cuda() ||
      !grad_output.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return false;
  }
  const auto dtype = grad_output.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kDouble) {
    return false;
  }
  // 16-byte vectors along K: K a multiple of the vector width and a 16-byte aligned base.
  const int64_t vec = kVectorBytes / grad_output.element_size();
  return grad_output.size(1) % vec == 0 && reinterpret_cast<uintptr_t>(grad_output.const_data_ptr()) % 16 == 0;
}

namespace {

at::Tensor launch_for(const at::Tensor& grad_output, LaunchConfig config) {
  switch (grad_output.scalar_type()) {
    case at::kFloat: return launch<float>(grad_output, config);
    case at::kDouble: return launch<double>(grad_output, config);
    case at::kHalf: return launch<at::Half>(grad_output, config);
    case at::kBFloat16: return launch<at::BFloat16>(grad_output, config);
    default: TORCH_CHECK(false, "convbias: no bias-gradient kernel for ", grad_output.scalar_type());
  }
}

// Measured on the H200 (2026-12-02, bench/bias_kernel_variants.cu over 9 grad_outputs of 98-784 MiB): 4 blocks
// per SM with 16 streaming loads in flight reached 0.83-1.05 of the copy bandwidth, the best or within 3% of it
// on every shape but one (bf16 98 MiB, where contiguous bands gained 5%); no setting is best everywhere. So each
// (device, dtype, rows, K) is timed once over a few launch configurations and the fastest kept where timing is asked
// for (cudnn.benchmark, TORCH_CONVBIAS_AUTOTUNE=quick/on); the default is used untimed (benchmark off, CUDA graph
// capture, TORCH_CONVBIAS_AUTOTUNE=off) and under determinism (cudnn.deterministic or use_deterministic_algorithms),
// where the summation order must not depend on a timing.
constexpr LaunchConfig kDefaultConfig = {4, 16, false};
constexpr std::array<LaunchConfig, 6> kCandidateConfigs = {
    {{4, 16, false}, {4, 16, true}, {2, 16, true}, {8, 16, true}, {4, 4, false}, {8, 4, true}}};

// The configuration for grad_output and whether it was measured (false: the default, untimed).
std::pair<LaunchConfig, bool> config_for(const at::Tensor& grad_output) {
  const MathFlags flags = current_math_flags();
  if (flags.deterministic || requested_tuning(flags) == Tuning::Untimed) {
    return {kDefaultConfig, false};
  }
  const int64_t columns = grad_output.size(1);
  const std::array<int64_t, 4> key = {
      grad_output.device().index(), static_cast<int64_t>(grad_output.scalar_type()), grad_output.numel() / columns,
      columns};
  static std::mutex mutex;
  static std::map<std::array<int64_t, 4>, LaunchConfig> tuned;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (auto it = tuned.find(key); it != tuned.end()) {
      return {it->second, true};
    }
  }
  // Only a shape not seen yet asks whether the stream is capturing (a stream query): the hot path is the lookup above.
  if (stream_is_capturing()) {
    return {kDefaultConfig, false};
  }
  // Two rounds (the second in reverse order), each candidate's faster time kept: the configurations differ by a
  // few percent, about as much as one ~1 ms timing varies. The default (candidate 0) within 3% of the best stays:
  // on the H200 a one-round argmin picked configurations 5% slower than the default on 128 MiB tensors.
  static_assert(kCandidateConfigs[0].blocks_per_sm == kDefaultConfig.blocks_per_sm &&
                kCandidateConfigs[0].unroll == kDefaultConfig.unroll &&
                kCandidateConfigs[0].contiguous == kDefaultConfig.contiguous);
  std::array<float, kCandidateConfigs.size()> ms;
  ms.fill(std::numeric_limits<float>::infinity());
  for (int round = 0; round < 2; ++round) {
    for (size_t n = 0; n < ms.size(); ++n) {
      const size_t i = round == 0 ? n : ms.size() - 1 - n;
      ms[i] = std::min(ms[i], time_on_stream([&] { (void)launch_for(grad_output, kCandidateConfigs[i]); }));
    }
  }
  const size_t fastest = static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
  const LaunchConfig best = ms[fastest] < 0.97f * ms[0] ? kCandidateConfigs[fastest] : kDefaultConfig;
  const std::lock_guard<std::mutex> lock(mutex);
  // A bounded table: shapes seen by one training run are few; a program cycling through endless shapes re-times.
  if (tuned.size() >= 4096) {
    tuned.clear();
  }
  return {tuned.emplace(key, best).first->second, true};
}

} // namespace

at::Tensor bias_grad_channels_last(const at::Tensor& grad_output) {
  TORCH_INTERNAL_ASSERT(bias_grad_kernel_applies(grad_output));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  return launch_for(grad_output, config_for(grad_output).first);
}

BiasKernelLaunch bias_grad_kernel_launch(const at::Tensor& grad_output) {
  TORCH_INTERNAL_ASSERT(bias_grad_kernel_applies(grad_output));
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const auto [config, timed] = config_for(grad_output);
  return {config.blocks_per_sm, config.unroll, config.contiguous, timed};
}

} // namespace convbias::cuda

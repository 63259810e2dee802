// The column sum of a channels_last tensor viewed as the [N*H*W, K] matrix it is in memory, with FP32 accumulation
// (FP64 for double), deterministic: the kernels behind the bias gradient (bias_grad.cu) and the fused activation
// backward (activation_backward.cu). Each block streams a band of rows with 16-byte loads, several in flight per
// thread (bandwidth is all that matters; the launch configuration is timed once per shape, column_sum_config.h),
// folds them into per-column partial sums in a fixed order, and a second small pass adds the bands in a fixed
// order, so the result is bitwise repeatable without atomics.
//
// What is summed comes from a Source: where each row's 16-byte vector of a column block comes from and what it
// contributes. SumOf<T> reads the tensor itself (the bias gradient); activation_backward.cu's source reads two
// tensors, writes the vector it computes and sums that. One kernel, so that both reduce in the same order.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/column_sum_config.h"

namespace convbias::cuda::column_sum {

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

// The elements of one 16-byte vector: added into sum[0..kCount) (add), widened into out[0..kCount) (widen), or
// packed from Acc values rounded to nearest even (narrow). bfloat16 widens by a shift (its bits are a float's upper
// half); the generic path through c10::BFloat16 cost ~15% of the bandwidth on the H200.
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
  __device__ static void widen(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ static uint4 narrow(const float* in) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
  }
};
template <>
struct Lanes<double> {
  static constexpr int kCount = 2;
  __device__ static void add(const uint4& v, double* sum) {
    sum[0] += __hiloint2double(static_cast<int>(v.y), static_cast<int>(v.x));
    sum[1] += __hiloint2double(static_cast<int>(v.w), static_cast<int>(v.z));
  }
  __device__ static void widen(const uint4& v, double* out) {
    out[0] = __hiloint2double(static_cast<int>(v.y), static_cast<int>(v.x));
    out[1] = __hiloint2double(static_cast<int>(v.w), static_cast<int>(v.z));
  }
  __device__ static uint4 narrow(const double* in) {
    return make_uint4(
        static_cast<unsigned>(__double2loint(in[0])), static_cast<unsigned>(__double2hiint(in[0])),
        static_cast<unsigned>(__double2loint(in[1])), static_cast<unsigned>(__double2hiint(in[1])));
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
  __device__ static void widen(const uint4& v, float* out) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
  __device__ static uint4 narrow(const float* in) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Lower element in the lower half, as in memory; round to nearest even, as c10::BFloat16's conversion.
      const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
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
  __device__ static void widen(const uint4& v, float* out) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
      out[2 * i] = pair.x;
      out[2 * i + 1] = pair.y;
    }
  }
  __device__ static uint4 narrow(const float* in) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 pair = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
      words[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};

// The plain source: the tensor's own vectors (the bias gradient). Loads are streaming (__ldcs, evict-first): the
// tensor is read once here.
template <typename T>
struct SumOf {
  using Value = T;
  using Acc = typename Accumulator<T>::type;
  using Loaded = uint4;
  static constexpr int kLoadsPerRow = 1;

  const uint4* dy;

  __device__ Loaded load(int64_t vector) const {
    return __ldcs(dy + vector);
  }
  __device__ void add(const Loaded& loaded, int64_t /*vector*/, Acc* sum) const {
    Lanes<T>::add(loaded, sum);
  }
};

// Block (x, y): column vectors [x * columns_per_block, ...) of the rows of band y, in steps of rows_per_step rows.
// Bands are interleaved (band y takes steps y, y + bands, ...) or contiguous (band y takes one range of steps);
// which streams faster depends on the shape (measured, bench/bias_kernel_variants.cu). partial[y][k] = sum of the
// source's values in column k over the band's rows, in a fixed order. kRows rows are loaded before any is added.
template <typename Source, int kRows, bool kContiguous>
__global__ void __launch_bounds__(kThreads) column_partial_sums(
    Source source, int64_t rows, int64_t columns, int columns_per_block, int rows_per_step,
    typename Source::Acc* __restrict__ partial) {
  using Acc = typename Source::Acc;
  constexpr int kVec = Lanes<typename Source::Value>::kCount;
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
    // kRows independent rows' loads in flight per thread before any of them is added.
    for (; row + (kRows - 1) * stride < end; row += kRows * stride) {
      typename Source::Loaded loaded[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        loaded[u] = source.load((row + u * stride) * vector_columns + vector_column);
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        source.add(loaded[u], (row + u * stride) * vector_columns + vector_column, sum);
      }
    }
    for (; row < end; row += stride) {
      const int64_t vector = row * vector_columns + vector_column;
      source.add(source.load(vector), vector, sum);
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

template <typename Source, int kLoads, bool kContiguous>
void launch_partials(
    const Source& source, const dim3& grid, size_t shared_bytes, cudaStream_t stream, int64_t rows, int64_t columns,
    int columns_per_block, int rows_per_step, at::Tensor& partial) {
  // A source reading kLoadsPerRow tensors keeps as many loads in flight with fewer rows (registers).
  constexpr int kRows = std::max(1, kLoads / Source::kLoadsPerRow);
  column_partial_sums<Source, kRows, kContiguous><<<grid, kThreads, shared_bytes, stream>>>(
      source, rows, columns, columns_per_block, rows_per_step, partial.mutable_data_ptr<typename Source::Acc>());
}

// The sums over `rows` rows of `columns` columns of what `source` yields, as a new [columns] tensor of the source's
// dtype on `options`' device, rounded once from the accumulator. Launches on the current stream; the caller checks
// that columns are whole 16-byte vectors and the tensors' bases are 16-byte aligned.
template <typename Source>
at::Tensor column_sums(const Source& source, int64_t rows, int64_t columns, const at::TensorOptions& options,
                       LaunchConfig config) {
  using T = typename Source::Value;
  using Acc = typename Source::Acc;
  constexpr int kVec = Lanes<T>::kCount;
  static_assert(kVec * sizeof(T) == kVectorBytes);
  const int64_t vector_columns = columns / kVec;
  const int columns_per_block = static_cast<int>(std::min<int64_t>(vector_columns, kThreads));
  const int rows_per_step = kThreads / columns_per_block;
  const int column_blocks = static_cast<int>((vector_columns + columns_per_block - 1) / columns_per_block);
  // `blocks_per_sm` blocks of 256 threads on every SM, and no band with fewer than ~16 steps of rows.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t max_bands = std::max<int64_t>(1, rows / (16LL * rows_per_step));
  const int bands =
      static_cast<int>(std::min<int64_t>(std::max(1, config.blocks_per_sm * sms / column_blocks), max_bands));

  at::Tensor partial = at::empty({bands, columns}, options.dtype(c10::CppTypeToScalarType<Acc>::value));
  at::Tensor out = at::empty({columns}, options.dtype(c10::CppTypeToScalarType<T>::value));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const size_t shared_bytes = static_cast<size_t>(rows_per_step) * columns_per_block * kVec * sizeof(Acc);
  const dim3 grid(column_blocks, bands);
  const auto launch = config.unroll == 16
      ? (config.contiguous ? launch_partials<Source, 16, true> : launch_partials<Source, 16, false>)
      : (config.contiguous ? launch_partials<Source, 4, true> : launch_partials<Source, 4, false>);
  launch(source, grid, shared_bytes, stream, rows, columns, columns_per_block, rows_per_step, partial);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sum_bands<T><<<static_cast<int>((columns + kFoldColumns - 1) / kFoldColumns), kThreads, 0, stream>>>(
      partial.const_data_ptr<Acc>(), bands, columns, out.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace convbias::cuda::column_sum

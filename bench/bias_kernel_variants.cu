// Experiments for the bias-gradient kernel (csrc/cuda/bias_grad.cu): which way of streaming a channels_last
// grad_output [rows, columns] and summing its columns gets closest to the copy bandwidth. Standalone CUDA (no
// torch), so many variants build in seconds on the GPU machine:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/bias_kernel_variants.cu -o /tmp/variants && /tmp/variants > out.json
//
// Variants (all FP32 accumulation, fixed summation order):
//   load    plain 16-byte loads, or streaming loads (__ldcs: evict-first, the data is read once)
//   order   interleaved: block band y reads row steps y, y + bands, ...; contiguous: band y reads one range
//   fold    two kernels (partial sums, then a fold kernel), or one: the last block of each column block to
//           finish (a counter per column block) folds the bands
//   grid    blocks per SM and loads in flight per thread
// plus references on the same bytes: cudaMemcpyAsync device to device (read + write), and a read-only kernel
// that XORs what it loads (the load pattern's own ceiling). Times: per launch, 30 launches back to back between
// two events, median of 7 repeats. Prints one JSON object per line.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e = (x);                                                                      \
    if (e != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kThreads = 256;

// The 16 bytes of a load as floats, added into sum[0..elements): the same widening as csrc/cuda/bias_grad.cu's
// Lanes, restated over CUDA's own 16-bit types so that this file builds without torch.
template <typename T>
struct Lanes;
template <>
struct Lanes<float> {
  static constexpr int n = 4;
  __device__ static void add(const uint4& v, float* sum) {
    sum[0] += __uint_as_float(v.x);
    sum[1] += __uint_as_float(v.y);
    sum[2] += __uint_as_float(v.z);
    sum[3] += __uint_as_float(v.w);
  }
};
template <>
struct Lanes<__nv_bfloat16> {
  static constexpr int n = 8;
  __device__ static void add(const uint4& v, float* sum) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      sum[2 * i] += __uint_as_float(w[i] << 16);
      sum[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};
template <>
struct Lanes<__half> {
  static constexpr int n = 8;
  __device__ static void add(const uint4& v, float* sum) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      sum[2 * i] += f.x;
      sum[2 * i + 1] += f.y;
    }
  }
};

template <bool kStreaming>
__device__ __forceinline__ uint4 load(const uint4* p) {
  if constexpr (kStreaming) {
    return __ldcs(p);
  } else {
    return *p;
  }
}

// Folds bands of partial sums for columns [c0, c0 + width): 32 columns x 8 slices per pass, fixed order.
__device__ void fold_bands(const float* partial, int bands, int64_t columns, int64_t c0, int width, float* out) {
  __shared__ float slice_sums[8][32];
  const int lane = threadIdx.x % 32, slice = threadIdx.x / 32;
  for (int base = 0; base < width; base += 32) {
    const int64_t column = c0 + base + lane;
    float total = 0;
    if (base + lane < width && column < columns) {
      for (int band = slice; band < bands; band += 8) {
        total += partial[static_cast<int64_t>(band) * columns + column];
      }
    }
    slice_sums[slice][lane] = total;
    __syncthreads();
    if (slice == 0 && base + lane < width && column < columns) {
      float sum = 0;
#pragma unroll
      for (int s = 0; s < 8; ++s) sum += slice_sums[s][lane];
      out[column] = sum;
    }
    __syncthreads();
  }
}

template <typename T, int kUnroll, bool kStreaming, bool kContiguous, bool kLastBlockFold, bool kXorOnly>
__global__ void __launch_bounds__(kThreads) partials(
    const uint4* __restrict__ dy, int64_t rows, int64_t columns, int columns_per_block, int rows_per_step,
    float* __restrict__ partial, unsigned* __restrict__ counters, float* __restrict__ out) {
  constexpr int kVec = Lanes<T>::n;
  extern __shared__ float shared[];
  const int lane_column = threadIdx.x % columns_per_block;
  const int row_in_step = threadIdx.x / columns_per_block;
  const int64_t vector_column = static_cast<int64_t>(blockIdx.x) * columns_per_block + lane_column;
  const int64_t vector_columns = columns / kVec;
  const bool active = row_in_step < rows_per_step && vector_column < vector_columns;
  float sum[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) sum[i] = 0;
  uint32_t x = 0;
  if (active) {
    const uint4* base = dy + vector_column;
    int64_t row, stride, end;
    if constexpr (kContiguous) {
      const int64_t steps = (rows + rows_per_step - 1) / rows_per_step;
      const int64_t per_band = (steps + gridDim.y - 1) / gridDim.y;
      row = blockIdx.y * per_band * rows_per_step + row_in_step;
      end = min(rows, static_cast<int64_t>(blockIdx.y + 1) * per_band * rows_per_step);
      stride = rows_per_step;
    } else {
      stride = static_cast<int64_t>(gridDim.y) * rows_per_step;
      row = static_cast<int64_t>(blockIdx.y) * rows_per_step + row_in_step;
      end = rows;
    }
    for (; row + (kUnroll - 1) * stride < end; row += kUnroll * stride) {
      uint4 loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) loaded[u] = load<kStreaming>(base + (row + u * stride) * vector_columns);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if constexpr (kXorOnly) {
          x ^= loaded[u].x ^ loaded[u].y ^ loaded[u].z ^ loaded[u].w;
        } else {
          Lanes<T>::add(loaded[u], sum);
        }
      }
    }
    for (; row < end; row += stride) {
      const uint4 a = load<kStreaming>(base + row * vector_columns);
      if constexpr (kXorOnly) {
        x ^= a.x ^ a.y ^ a.z ^ a.w;
      } else {
        Lanes<T>::add(a, sum);
      }
    }
  }
  if constexpr (kXorOnly) {
    if (x == 0x12345678u) partial[0] = 1.0f;  // keeps the loads alive
    return;
  } else {
    const int width = columns_per_block * kVec;
    if (row_in_step < rows_per_step) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) shared[row_in_step * width + lane_column * kVec + i] = sum[i];
    }
    __syncthreads();
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
      const int64_t column = static_cast<int64_t>(blockIdx.x) * width + j;
      if (column >= columns) continue;
      float total = 0;
      for (int r = 0; r < rows_per_step; ++r) total += shared[r * width + j];
      partial[static_cast<int64_t>(blockIdx.y) * columns + column] = total;
    }
    if constexpr (kLastBlockFold) {
      __shared__ bool last;
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
      }
      __syncthreads();
      if (last) {
        __threadfence();
        fold_bands(partial, gridDim.y, columns, static_cast<int64_t>(blockIdx.x) * width, width, out);
        if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch
      }
    }
  }
}

__global__ void fold_kernel(const float* __restrict__ partial, int bands, int64_t columns, float* __restrict__ out) {
  fold_bands(partial, bands, columns, static_cast<int64_t>(blockIdx.x) * 32, 32, out);
}

struct Problem {
  const char* dtype;
  int element;
  int64_t rows, columns;
  const char* label;
};

struct Config {
  int blocks_per_sm, unroll;
  bool streaming, contiguous, last_block, xor_only;
};

int sms = 0;

template <typename T, int U, bool S, bool C, bool L, bool X>
void launch_t(const Problem& p, const Config& c, const void* dy, float* partial, unsigned* counters, float* out,
              int bands, int column_blocks, int columns_per_block, int rows_per_step) {
  constexpr int kVec = Lanes<T>::n;
  const size_t shared = static_cast<size_t>(rows_per_step) * columns_per_block * kVec * sizeof(float);
  partials<T, U, S, C, L, X><<<dim3(column_blocks, bands), kThreads, shared>>>(
      static_cast<const uint4*>(dy), p.rows, p.columns, columns_per_block, rows_per_step, partial, counters, out);
  if (!L && !X) {
    fold_kernel<<<static_cast<int>((p.columns + 31) / 32), kThreads>>>(partial, bands, p.columns, out);
  }
}

template <typename T, int U>
void dispatch_flags(const Problem& p, const Config& c, const void* dy, float* partial, unsigned* counters,
                    float* out, int bands, int cb, int cpb, int rps) {
#define GO(S, C, L, X)                                                                   \
  if (c.streaming == S && c.contiguous == C && c.last_block == L && c.xor_only == X) {   \
    launch_t<T, U, S, C, L, X>(p, c, dy, partial, counters, out, bands, cb, cpb, rps); \
    return;                                                                              \
  }
  GO(false, false, false, false)
  GO(true, false, false, false)
  GO(false, true, false, false)
  GO(true, true, false, false)
  GO(false, false, true, false)
  GO(true, false, true, false)
  GO(false, true, true, false)
  GO(true, true, true, false)
  GO(false, false, false, true)
  GO(true, false, false, true)
  GO(false, true, false, true)
#undef GO
  std::fprintf(stderr, "no instance\n");
  std::exit(1);
}

template <typename T>
void run(const Problem& p, const Config& c, const void* dy, float* partial, unsigned* counters, float* out) {
  constexpr int kVec = Lanes<T>::n;
  const int64_t vector_columns = p.columns / kVec;
  const int columns_per_block = static_cast<int>(std::min<int64_t>(vector_columns, kThreads));
  const int rows_per_step = kThreads / columns_per_block;
  const int column_blocks = static_cast<int>((vector_columns + columns_per_block - 1) / columns_per_block);
  const int64_t max_bands = std::max<int64_t>(1, p.rows / (16LL * rows_per_step));
  const int bands = static_cast<int>(std::min<int64_t>(std::max(1, c.blocks_per_sm * sms / column_blocks), max_bands));
  if (c.unroll == 8) {
    dispatch_flags<T, 8>(p, c, dy, partial, counters, out, bands, column_blocks, columns_per_block, rows_per_step);
  } else if (c.unroll == 4) {
    dispatch_flags<T, 4>(p, c, dy, partial, counters, out, bands, column_blocks, columns_per_block, rows_per_step);
  } else {
    dispatch_flags<T, 16>(p, c, dy, partial, counters, out, bands, column_blocks, columns_per_block, rows_per_step);
  }
}

void run_any(const Problem& p, const Config& c, const void* dy, float* partial, unsigned* counters, float* out) {
  const std::string d = p.dtype;
  if (d == "fp32") run<float>(p, c, dy, partial, counters, out);
  else if (d == "bf16") run<__nv_bfloat16>(p, c, dy, partial, counters, out);
  else run<__half>(p, c, dy, partial, counters, out);
}

template <typename F>
float time_ms(F fn, int calls = 30, int repeats = 7) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> samples;
  for (int r = 0; r < repeats; ++r) {
    fn();
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    samples.push_back(ms / calls);
  }
  CHECK(cudaGetLastError());
  std::sort(samples.begin(), samples.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return samples[samples.size() / 2];
}

__global__ void fill(uint16_t* p, int64_t n, int element) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    // Small values of either kind: floats built from the low 16 bits pattern, halves/bf16 near 1.
    const uint32_t h = static_cast<uint32_t>(i * 2654435761u);
    p[i] = element == 4 ? static_cast<uint16_t>((i & 1) ? 0x3f80 + (h & 0x7f) : 0) : static_cast<uint16_t>(0x3c00 + (h & 0xff));
  }
}

int main() {
  int device = 0;
  CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, device));
  sms = prop.multiProcessorCount;
  const int64_t max_bytes = 822083584;
  void *dy = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&dy, max_bytes));
  CHECK(cudaMalloc(&dst, max_bytes));
  fill<<<4096, 256>>>(static_cast<uint16_t*>(dy), max_bytes / 2, 2);
  float *partial = nullptr, *out = nullptr, *ref = nullptr;
  unsigned* counters = nullptr;
  CHECK(cudaMalloc(&partial, 64 << 20));
  CHECK(cudaMalloc(&out, 1 << 20));
  CHECK(cudaMalloc(&ref, 1 << 20));
  CHECK(cudaMalloc(&counters, 1 << 16));
  CHECK(cudaMemset(counters, 0, 1 << 16));
  CHECK(cudaDeviceSynchronize());

  const int64_t big = 1LL << 30;  // reference copy: 2 x 512 MiB regions of the two buffers
  const float big_ms = time_ms([&] { CHECK(cudaMemcpyAsync(dst, dy, big / 2, cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = 2.0 * (big / 2) / (big_ms * 1e6);
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"copy_gbps_512MiB\": %.1f}\n", prop.name, sms, copy_gbps);

  const std::vector<Problem> problems = {
      {"fp32", 4, 262144, 128, "fp32 128 MiB (N1024 K128 16x16)"},
      {"fp32", 4, 802816, 64, "fp32 196 MiB (N256 K64 56x56)"},
      {"fp32", 4, 802816, 256, "fp32 784 MiB (N256 K256 56x56)"},
      {"fp32", 4, 1048576, 64, "fp32 256 MiB (N1024 K64 32x32)"},
      {"bf16", 2, 1048576, 64, "bf16 128 MiB (N1024 K64 32x32)"},
      {"bf16", 2, 802816, 64, "bf16 98 MiB (N256 K64 56x56)"},
      {"bf16", 2, 802816, 256, "bf16 392 MiB (N256 K256 56x56)"},
      {"bf16", 2, 3211264, 64, "bf16 392 MiB (N256 K64 112x112)"},
      {"fp16", 2, 1048576, 64, "fp16 128 MiB (N1024 K64 32x32)"},
  };
  std::vector<Config> configs;
  for (int bps : {1, 2, 4, 8}) {
    for (int unroll : {4, 8, 16}) {
      for (bool streaming : {false, true}) {
        for (bool contiguous : {false, true}) {
          for (bool last : {false, true}) {
            configs.push_back({bps, unroll, streaming, contiguous, last, false});
          }
        }
      }
    }
  }
  for (int bps : {2, 4, 8}) {
    for (int unroll : {4, 8}) {
      configs.push_back({bps, unroll, false, false, false, true});
      configs.push_back({bps, unroll, false, true, false, true});
    }
  }
  std::vector<float> host_ref, host_out;
  for (const Problem& p : problems) {
    const int64_t bytes = p.rows * p.columns * p.element;
    const float copy_ms = time_ms([&] { CHECK(cudaMemcpyAsync(dst, dy, bytes, cudaMemcpyDeviceToDevice)); });
    // Reference result: the current kernel's default shape (4 blocks/SM, unroll 4, two kernels).
    run_any(p, {4, 4, false, false, false, false}, dy, partial, counters, ref);
    host_ref.resize(p.columns);
    CHECK(cudaMemcpy(host_ref.data(), ref, p.columns * 4, cudaMemcpyDeviceToHost));
    std::printf("{\"problem\": \"%s\", \"bytes\": %lld, \"copy_same_bytes_gbps\": %.1f, \"read_at_copy_gbps_ms\": %.4f}\n",
                p.label, static_cast<long long>(bytes), 2.0 * bytes / (copy_ms * 1e6), bytes / (copy_gbps * 1e6));
    for (const Config& c : configs) {
      const float ms = time_ms([&] { run_any(p, c, dy, partial, counters, out); });
      double max_rel = 0;
      if (!c.xor_only) {
        host_out.resize(p.columns);
        CHECK(cudaMemcpy(host_out.data(), out, p.columns * 4, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < p.columns; ++i) {
          max_rel = std::max(max_rel, std::fabs(double(host_out[i]) - host_ref[i]) / (std::fabs(host_ref[i]) + 1e-3));
        }
      }
      std::printf(
          "{\"problem\": \"%s\", \"blocks_per_sm\": %d, \"unroll\": %d, \"streaming\": %d, \"contiguous\": %d, "
          "\"last_block_fold\": %d, \"xor_only\": %d, \"ms\": %.4f, \"read_gbps\": %.1f, \"fraction_of_copy\": %.3f, "
          "\"max_rel_diff\": %.2e}\n",
          p.label, c.blocks_per_sm, c.unroll, c.streaming, c.contiguous, c.last_block, c.xor_only, ms,
          bytes / (ms * 1e6), bytes / (ms * 1e6) / copy_gbps, max_rel);
    }
  }
  return 0;
}

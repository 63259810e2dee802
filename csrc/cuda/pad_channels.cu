// pad_channels.h: one thread per 16-byte chunk of the output, reading the chunk's elements of the input row (each
// element as raw bits: zero bits are +0.0 in every floating type, so one kernel serves float16, bfloat16 and float32).
#include "cuda/pad_channels.h"
#include "cuda/grid_stride.h"
#include "cuda/test_hook.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>
#include <cstdint>
#include <limits>

namespace convbias::cuda {
namespace {

constexpr int64_t kChunkBytes = 16;

template <typename Word>
__global__ void pad_rows(const Word* __restrict__ in, int64_t in_row, Word* __restrict__ out, int64_t out_row, int64_t chunks) {
  constexpr int kWords = kChunkBytes / sizeof(Word);
  const int64_t chunks_per_row = out_row / kWords;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int64_t first = (i - row * chunks_per_row) * kWords;
    union {
      Word words[kWords];
      uint4 vector;
    } chunk;
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      chunk.words[j] = first + j < in_row ? in[row * in_row + first + j] : Word(0);
    }
    *reinterpret_cast<uint4*>(out + row * out_row + first) = chunk.vector;
  }
}

template <typename Word>
void launch(const at::Tensor& in, at::Tensor& out, int64_t in_row, int64_t out_row) {
  const int64_t chunks = out.numel() * static_cast<int64_t>(sizeof(Word)) / kChunkBytes;
  constexpr int kThreads = 256;
  const int64_t blocks = grid_stride_blocks(chunks, kThreads);
  pad_rows<Word><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Word*>(in.const_data_ptr()), in_row, static_cast<Word*>(out.mutable_data_ptr()), out_row,
      chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

TestHookCountdown injected_padded_way_failures; // inject_padded_way_failures
std::atomic<bool> injected_out_of_memory{false};

} // namespace

void inject_padded_way_failures(int64_t count, bool out_of_memory) {
  injected_out_of_memory.store(out_of_memory);
  injected_padded_way_failures.arm(count);
}

void throw_injected_padded_way_failure() {
  if (!injected_padded_way_failures.take()) {
    return;
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError, !injected_out_of_memory.load(),
      "out of memory for the padded copies (injected: convbias::_inject_padded_way_failures)");
  TORCH_CHECK(false, "the padded way failed (injected: convbias::_inject_padded_way_failures)");
}

int64_t padded_channel_count(at::ScalarType dtype, int64_t channels, int64_t groups, int64_t pixels) {
  if (groups != 1 || (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat)) {
    return 0;
  }
  const int64_t per_chunk = kChunkBytes / static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t padded = (channels + per_chunk - 1) / per_chunk * per_chunk;
  const bool fits_int32 = pixels <= std::numeric_limits<int32_t>::max() / padded;
  return padded > channels && fits_int32 ? padded : 0;
}

at::Tensor pad_channels(const at::Tensor& t, int64_t channels) {
  TORCH_INTERNAL_ASSERT(t.is_cuda() && t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast));
  const int64_t element = static_cast<int64_t>(t.element_size());
  TORCH_INTERNAL_ASSERT((element == 2 || element == 4) && channels >= t.size(1) && channels * element % kChunkBytes == 0);
  const c10::cuda::CUDAGuard device_guard(t.device());
  at::Tensor out = at::empty(
      {t.size(0), channels, t.size(2), t.size(3)}, t.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (out.numel() == 0) {
    return out;
  }
  if (element == 2) {
    launch<uint16_t>(t, out, t.size(1), channels);
  } else {
    launch<uint32_t>(t, out, t.size(1), channels);
  }
  return out;
}

} // namespace convbias::cuda

// space_to_depth.h's regrouping of an input on the GPU in one pass: every output word is written once, from the input
// or as a zero of the padding. ATen's way (constant_pad_nd, then a six-dimensional permuted copy) makes two passes
// over the data, the second with 12 to 24-byte runs: on the H100 it took 1.40 ms for AlexNet's bf16 stem at batch
// 1024, twice the regrouped convolution (bench/results/space_to_depth-nvidia-h100-80gb-hbm3.json). A stride-1 stem's
// patches, which overlap, have a kernel of their own (unfold_patches.cu).
#include "cuda/space_to_depth.h"
#include "cuda/grid_stride.h"
#include "cuda/regroup_geometry.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

namespace convbias::cuda {
namespace {

// One thread per Store (16, 8, 4 or 2 bytes: the widest that divides the output's rows, so that a thread's words
// lie in one output pixel's row and its store is aligned) of consecutive words of the output. Word is the element's
// raw bits (zero bits are +0.0 in every floating type). The word's channel (c, a, b) = c * bh * bw + a * bw + b reads
// x[n, hb * block_h + a - before_h, wb * block_w + b - before_w, c]; the walk over (c, a, b) carries instead of dividing.
template <typename Word, typename Store>
__global__ void regroup_blocks(const Word* __restrict__ in, Word* __restrict__ out, RegroupGeometry s, int32_t units) {
  constexpr int kWords = sizeof(Store) / sizeof(Word);
  // 64-bit steps: the last stride may pass INT32_MAX.
  for (int64_t unit = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; unit < units;
       unit += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t first = static_cast<int32_t>(unit * kWords);
    const int32_t pixel = first / s.row;
    const int32_t wb = pixel % s.out_w;
    const int32_t rest = pixel / s.out_w;
    const int32_t hb = rest % s.out_h;
    const int64_t n = rest / s.out_h;
    const int32_t per_channel = s.block_h * s.block_w;
    int32_t o = first - pixel * s.row;
    int32_t c = o / per_channel;
    o -= c * per_channel;
    int32_t a = o / s.block_w;
    int32_t b = o - a * s.block_w;
    const int64_t h0 = static_cast<int64_t>(hb) * s.block_h - s.before_h;
    const int64_t w0 = static_cast<int64_t>(wb) * s.block_w - s.before_w;
    union {
      Word words[kWords];
      Store store;
    } chunk;
#pragma unroll
    for (int j = 0; j < kWords; ++j) {
      const int64_t h = h0 + a, w = w0 + b;
      const bool inside = c < s.channels && h >= 0 && h < s.height && w >= 0 && w < s.width;
      chunk.words[j] = inside ? in[((n * s.height + h) * s.width + w) * s.channels + c] : Word(0);
      if (++b == s.block_w) {
        b = 0;
        if (++a == s.block_h) {
          a = 0;
          ++c;
        }
      }
    }
    *reinterpret_cast<Store*>(out + first) = chunk.store;
  }
}

template <typename Word, typename Store>
void launch(const at::Tensor& x, at::Tensor& out, const RegroupGeometry& shape) {
  static_assert(sizeof(Store) % sizeof(Word) == 0);
  const int64_t units = out.numel() / static_cast<int64_t>(sizeof(Store) / sizeof(Word));
  TORCH_INTERNAL_ASSERT(units <= std::numeric_limits<int32_t>::max());
  constexpr int kThreads = 256;
  const int64_t blocks = grid_stride_blocks(units, kThreads);
  regroup_blocks<Word, Store><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Word*>(x.const_data_ptr()), static_cast<Word*>(out.mutable_data_ptr()), shape,
      static_cast<int32_t>(units));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// AlexNet's 48 channels: 16-byte stores; RGB in 16-bit at stride 2 (12 channels, 24-byte rows): 8-byte ones.
template <typename Word>
void launch_for_rows(const at::Tensor& x, at::Tensor& out, const RegroupGeometry& shape) {
  const int64_t row_bytes = shape.row * static_cast<int64_t>(sizeof(Word));
  if (row_bytes % 16 == 0) {
    launch<Word, uint4>(x, out, shape);
  } else if (row_bytes % 8 == 0) {
    launch<Word, uint2>(x, out, shape);
  } else if (row_bytes % 4 == 0) {
    launch<Word, uint32_t>(x, out, shape);
  } else {
    launch<Word, Word>(x, out, shape);
  }
}

} // namespace

bool regroups_on_gpu(const at::Tensor& x) {
  return x.is_cuda() && x.dim() == 4 && (x.element_size() == 2 || x.element_size() == 4);
}

at::Tensor regroup_input_on_gpu(const at::Tensor& x, const SpaceToDepth& g) {
  TORCH_INTERNAL_ASSERT(regroups_on_gpu(x) && !g.patches);
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto [in, out, geometry] = regroup_buffers(x, g);
  if (out.numel() > 0) {
    if (in.element_size() == 2) {
      launch_for_rows<uint16_t>(in, out, geometry);
    } else {
      launch_for_rows<uint32_t>(in, out, geometry);
    }
  }
  return out.permute({0, 3, 1, 2});
}

} // namespace convbias::cuda

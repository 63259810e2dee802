// A stride-1 stem's input unfolded into patches on the GPU (space_to_depth.h's "patches"): out[n, p, q, (c, r, s)] =
// x_pad[n, c, p + r, q + s], the channels past C * R * S zeros. The blocks' one-pass kernel (space_to_depth_regroup.cu)
// did this with a scattered 2-byte load per output word, each input element fetched R * S times: on the H100 it wrote
// VGG's bf16 patches at batch 256 (822 MB) in 0.98 ms, a third of the memory's rate, nearly as long as the 1x1
// convolution over them (bench/results/space_to_depth-nvidia-h100-80gb-hbm3.json). Here a block unfolds a strip of
// kRows output rows by kTile pixels: it stages the kRows + R - 1 input rows the strip reads in shared memory (coalesced
// loads, several in flight per thread, each input element loaded about (kRows + R - 1) / kRows times instead of R * S),
// then writes each row's patches, one contiguous run, in 16-byte stores. One output row a block (0c5e14c) ran at half
// the memory's rate (0.56 ms for those patches: the staging's R dependent rounds of loads a row were not hidden); in
// strips, 0.42 ms (31718ea, H100).
#include "cuda/space_to_depth.h"
#include "cuda/grid_stride.h"
#include "cuda/regroup_geometry.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace convbias::cuda {
namespace {

constexpr int kTile = 128; // output pixels of a row a block unfolds at a time
constexpr int kRows = 4; // output rows a block unfolds at a time
constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 4; // staged words a thread loads before it stores them
// space_to_depth_of takes at most 64 unfolded channels (C * R * S), rounded up to 16-byte rows: still 64.
constexpr int kMaxRow = 64;

// The geometry (regroup_geometry.h; block_h x block_w: the kernel, R x S; out_h x out_w: the convolution's output, P x Q)
// and what the strips add.
struct PatchShape : RegroupGeometry {
  int32_t taps; // C * R * S
  int32_t tiles_w; // strips across an output row: ceil(Q / kTile)
  int32_t strips_h; // strips down the output: ceil(P / kRows)
  int32_t stage_cols; // input columns a full strip reads: kTile + S - 1
};

// Shared memory: the row's source offsets into the stage (-1: a padding channel), then the stage, the kRows + R - 1
// input rows [row][column][c] a strip reads (zeros outside the input). Output row i of the strip reads staged rows
// i .. i + R - 1: its patches are the first row's, read one staged row further down.
template <typename Word>
__global__ void unfold_patches(const Word* __restrict__ in, Word* __restrict__ out, PatchShape s, int64_t strips) {
  extern __shared__ __align__(16) unsigned char shared[];
  int32_t* const source = reinterpret_cast<int32_t*>(shared);
  Word* const stage = reinterpret_cast<Word*>(shared + kMaxRow * sizeof(int32_t));
  constexpr int kWords = sizeof(uint4) / sizeof(Word);
  const int32_t per_channel = s.block_h * s.block_w;
  for (int32_t k = threadIdx.x; k < s.row; k += blockDim.x) {
    const int32_t c = k / per_channel, r = k / s.block_w % s.block_h, t = k % s.block_w;
    source[k] = k < s.taps ? (r * s.stage_cols + t) * s.channels + c : -1;
  }
  const int32_t stage_row = s.stage_cols * s.channels; // words of one staged input row
  for (int64_t strip = blockIdx.x; strip < strips; strip += gridDim.x) {
    const int32_t q0 = static_cast<int32_t>(strip % s.tiles_w) * kTile;
    const int64_t rest = strip / s.tiles_w;
    const int32_t p0 = static_cast<int32_t>(rest % s.strips_h) * kRows;
    const int64_t n = rest / s.strips_h;
    const int32_t pixels = min(kTile, s.out_w - q0);
    const int32_t rows = min(kRows, s.out_h - p0);
    // The staged columns w0 .. w0 + pixels + S - 2 of the input rows h0 .. h0 + rows + R - 2; those inside the input
    // are words [lo, hi) of a staged row.
    const int64_t w0 = static_cast<int64_t>(q0) - s.before_w;
    const int64_t h0 = static_cast<int64_t>(p0) - s.before_h;
    const int32_t cols = pixels + s.block_w - 1;
    const int32_t row_words = cols * s.channels;
    const int32_t lo = static_cast<int32_t>(w0 < 0 ? -w0 : 0) * s.channels;
    const int32_t hi = static_cast<int32_t>(cols < s.width - w0 ? cols : s.width - w0) * s.channels;
    const int32_t staged = (rows + s.block_h - 1) * row_words;
    __syncthreads(); // the previous strip's reads of the stage (and, the first time, the source table) are done
    // Each thread issues kLoadsInFlight independent loads before it stores any: the loads' latency overlaps.
    for (int32_t first = threadIdx.x; first < staged; first += kLoadsInFlight * blockDim.x) {
      Word words[kLoadsInFlight];
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j) {
        const int32_t e = first + j * static_cast<int32_t>(blockDim.x);
        const int32_t i = e / row_words, at = e - i * row_words;
        const int64_t h = h0 + i;
        const bool inside = e < staged && h >= 0 && h < s.height && at >= lo && at < hi;
        words[j] = inside ? in[((n * s.height + h) * s.width + w0) * s.channels + at] : Word(0);
      }
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j) {
        const int32_t e = first + j * static_cast<int32_t>(blockDim.x);
        if (e < staged) {
          const int32_t i = e / row_words;
          stage[i * stage_row + (e - i * row_words)] = words[j];
        }
      }
    }
    __syncthreads();
    const int32_t units_per_row = pixels * s.row / kWords;
    for (int32_t unit = threadIdx.x; unit < rows * units_per_row; unit += blockDim.x) {
      const int32_t i = unit / units_per_row, in_row = unit - i * units_per_row;
      const int32_t word = in_row * kWords;
      const int32_t pixel = word / s.row, k0 = word - pixel * s.row;
      const Word* const at_pixel = stage + i * stage_row + pixel * s.channels;
      union {
        Word words[kWords];
        uint4 store;
      } chunk;
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const int32_t from = source[k0 + j];
        chunk.words[j] = from >= 0 ? at_pixel[from] : Word(0);
      }
      Word* const out_row = out + ((n * s.out_h + p0 + i) * s.out_w + q0) * s.row;
      reinterpret_cast<uint4*>(out_row)[in_row] = chunk.store;
    }
  }
}

template <typename Word>
void launch(const at::Tensor& in, at::Tensor& out, const PatchShape& shape) {
  const int64_t strips = static_cast<int64_t>(out.size(0)) * shape.strips_h * shape.tiles_w;
  // At most (kRows + R - 1) * (kTile + S - 1) * C words: with C <= 4 and C * R * S <= 64 (space_to_depth_of), under
  // 40 KB (C = 4, R = 16, S = 1, float32).
  const size_t shared_bytes = kMaxRow * sizeof(int32_t) +
      static_cast<size_t>(kRows + shape.block_h - 1) * shape.stage_cols * shape.channels * sizeof(Word);
  TORCH_INTERNAL_ASSERT(shared_bytes <= 48 * 1024, "unfold_patches: a stage of ", shared_bytes, " bytes");
  const int64_t blocks = grid_stride_blocks(strips * kThreads, kThreads);
  unfold_patches<Word><<<blocks, kThreads, shared_bytes, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Word*>(in.const_data_ptr()), static_cast<Word*>(out.mutable_data_ptr()), shape, strips);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

at::Tensor unfold_patches_on_gpu(const at::Tensor& x, const SpaceToDepth& g) {
  TORCH_INTERNAL_ASSERT(regroups_on_gpu(x) && g.patches);
  const c10::cuda::CUDAGuard device_guard(x.device());
  auto [in, out, geometry] = regroup_buffers(x, g);
  TORCH_INTERNAL_ASSERT(geometry.row <= kMaxRow && geometry.row * in.element_size() % 16 == 0);
  if (out.numel() > 0) {
    const PatchShape shape{
        geometry,
        static_cast<int32_t>(g.patch_taps),
        (geometry.out_w + kTile - 1) / kTile,
        (geometry.out_h + kRows - 1) / kRows,
        kTile + geometry.block_w - 1};
    if (in.element_size() == 2) {
      launch<uint16_t>(in, out, shape);
    } else {
      launch<uint32_t>(in, out, shape);
    }
  }
  return out.permute({0, 3, 1, 2});
}

} // namespace convbias::cuda

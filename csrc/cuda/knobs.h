// Environment knobs (TORCH_CONVBIAS_*), read once and checked on first use; documented in README.md.
#pragma once

#include <cstdint>
#include <string>

namespace convbias::cuda {

struct Knobs {
  int64_t cache_size; // TORCH_CONVBIAS_CACHE_SIZE (plans kept, LRU), default 1000
  // TORCH_CONVBIAS_RUNTIME_COMPILATION: fallback (default: runtime-compiled, NVRTC, engines are built only where no
  // precompiled one builds) | timed (timed choices also build and time them beside the precompiled ones) | off
  // (never; also TORCH_CONVBIAS_NO_RUNTIME_COMPILATION=1)
  bool allow_runtime_compiled;
  bool time_runtime_compiled;
  std::string path; // TORCH_CONVBIAS_PATH: auto | fused | unfused | aten
  // TORCH_CONVBIAS_ACTIVATION: auto (the activation in the graph's epilogue where it builds; when choices are timed,
  // only where measured faster) | fused (the epilogue graph or an error) | unfused (a pass after the graph:
  // activation_after_graph_)
  std::string activation;
  std::string autotune; // TORCH_CONVBIAS_AUTOTUNE: auto (follow cudnn.benchmark) | off | quick | on (math_flags.h)
  std::string param_grad; // TORCH_CONVBIAS_PARAM_GRAD: cudnn (conv_wgrad graph, default) | aten
  // TORCH_CONVBIAS_INPUT_GRAD: timed (default: when choices are timed, a cuDNN conv_dgrad graph against ATen's, the
  // faster kept; untimed: ATen's) | aten (ATen's convolution backward, nn.Conv2d's) | graph (the graph, unmeasured)
  std::string input_grad;
  std::string bias_grad; // TORCH_CONVBIAS_BIAS_GRAD: kernel (ours, where it applies) | cudnn (reduction graph) | aten
  std::string nchw; // TORCH_CONVBIAS_NCHW: auto (measure) | graph | copy | aten: how NCHW tensors run
  // TORCH_CONVBIAS_PAD_CHANNELS: auto (measured when choices are timed) | on | off: whether a forward whose input
  // channels leave misaligned rows may run on zero-padded copies (pad_channels.h)
  std::string pad_channels;
  // TORCH_CONVBIAS_SPACE_TO_DEPTH: auto (measured when choices are timed) | on | off: whether a strided stem's forward
  // may run as a stride-1 convolution over its input regrouped into blocks, a stride-1 stem's as a 1x1 convolution
  // over its unfolded patches (space_to_depth.h)
  std::string space_to_depth;
  bool workspace_fallback; // TORCH_CONVBIAS_WORKSPACE_FALLBACK: on (default) | off: raise when a workspace fails
  std::string plan_cache_dir; // TORCH_CONVBIAS_PLAN_CACHE_DIR: persistent plan cache directory ("" = none)
};
const Knobs& knobs();


} // namespace convbias::cuda

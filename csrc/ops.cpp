// The one place where the convbias operators are declared. Kernels live in cpu/, cuda/ and autocast.cpp;
// autograd of forward in autograd.cpp; fake (meta) kernels and param_grad's autograd in Python (torch_convbias/ops.py).
#include <torch/library.h>

#include "diagnostics.h"

TORCH_LIBRARY(convbias, m) {
  // act(F.conv2d(input, weight, bias, stride, padding, dilation, groups)), bias (and activation) fused into the
  // convolution. activation: identity, relu, leaky_relu (negative_slope), gelu, gelu_tanh, silu, sigmoid, tanh.
  m.def(
      "forward(Tensor input, Tensor weight, Tensor? bias, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, SymInt groups, str activation=\"identity\", float negative_slope=0.01) -> Tensor");
  // act(F.conv2d(input, weight, bias, ...) + residual): the ending of a residual block (torchvision's ResNet:
  // `out += identity; out = relu(out)`, the batch norm folded into the bias) in one op. `residual` has the
  // convolution's output shape, dtype and device; the output has forward's memory format. On CUDA (channels_last) one
  // cuDNN graph conv -> residual ADD -> bias ADD -> activation where an engine runs it; elsewhere forward's route, then
  // the add and the activation.
  m.def(
      "forward_residual(Tensor input, Tensor weight, Tensor? bias, Tensor residual, SymInt[2] stride, "
      "SymInt[2] padding, SymInt[2] dilation, SymInt groups, str activation=\"identity\", "
      "float negative_slope=0.01) -> Tensor");
  // Internal, for forward's autograd (csrc/autograd.cpp) with an activation whose derivative needs the pre-activation
  // (gelu, gelu_tanh, silu, leaky_relu with a negative slope): (act(z), z) for z = F.conv2d(input, weight, bias, ...),
  // both of forward's output shape, dtype and memory format, in one call. On CUDA (channels_last) one cuDNN graph
  // writes both (the activation may read the FP32 z; csrc/cuda/fprop.h); elsewhere z is rounded to the dtype first and
  // the activation applied to it out of place. No autograd of its own: it is called below autograd.
  m.def(
      "_forward_with_preactivation(Tensor input, Tensor weight, Tensor? bias, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, SymInt groups, str activation, float negative_slope) -> (Tensor output, Tensor preactivation)");
  // Gradients of forward's parameters: output_mask = (weight, bias) says which to compute; the others are None.
  // grad_weight has weight's shape and memory format; grad_bias has shape [out_channels].
  m.def(
      "param_grad(Tensor grad_output, Tensor input, Tensor weight, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, SymInt groups, bool[2] output_mask) -> (Tensor? grad_weight, Tensor? grad_bias)");
  // Internal, for forward's autograd (csrc/autograd.cpp): the input gradient of F.conv2d, in input's dtype, with the
  // memory format ATen's convolution backward gives it. `input` gives the shape and layout only (its data is never
  // read). On CUDA under TORCH_CONVBIAS_INPUT_GRAD=timed a cuDNN conv_dgrad graph where it measured faster than ATen's
  // (csrc/cuda/dgrad.h); ATen's convolution backward elsewhere.
  m.def(
      "_input_grad(Tensor grad_output, Tensor input, Tensor weight, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, SymInt groups) -> Tensor");
  // Internal, for the convbias torch.compile backend's backward graphs (torch_convbias/_backward_fusion.py): what
  // _activation_backward(_input_grad(grad_output, input, weight, ...), saved, activation, negative_slope, bias_grad)
  // computes - a layer's input gradient times the derivative of the activation of the layer below (`saved`: what that
  // activation's backward keeps, of input's shape) and its bias gradient - in one call. On CUDA under
  // TORCH_CONVBIAS_INPUT_GRAD=timed with choices timed, one conv_dgrad graph with the derivative in it where that
  // measured faster (csrc/cuda/dgrad_activation.h); the two steps elsewhere.
  m.def(
      "_input_grad_activation(Tensor grad_output, Tensor input, Tensor weight, SymInt[2] stride, SymInt[2] padding, "
      "SymInt[2] dilation, SymInt groups, Tensor saved, str activation, float negative_slope, bool bias_grad) "
      "-> (Tensor grad_z, Tensor? grad_bias)");
  // The backward of forward's activation at the convolution's output, with the bias gradient in the same pass:
  // grad_z = grad_output * act'(saved) (saved: forward's output or pre-activation, as the activation's backward needs,
  // csrc/activation.h) in grad_output's dtype, channels_last when grad_output or saved is; grad_bias = grad_z summed
  // over N, H, W (FP32 accumulation, FP64 for double, rounded once) when bias_grad, else None. One CUDA kernel for
  // channels_last tensors (csrc/cuda/activation_backward.cu), ATen's pointwise backward and a sum elsewhere.
  m.def(
      "_activation_backward(Tensor grad_output, Tensor saved, str activation, float negative_slope, bool bias_grad) "
      "-> (Tensor grad_z, Tensor? grad_bias)");
  // Diagnostics (torch_convbias.explain, cache_info, cache_clear, versions).
  // The path forward takes for these arguments, as JSON: fused or not, engine, workspace, build time, and
  // why alternatives were rejected. Builds (and caches) the plan if needed, exactly as forward would. for_backward:
  // the path forward takes under autograd instead (_forward_with_preactivation where the activation's derivative
  // needs the pre-activation; the same path otherwise).
  m.def(
      "_explain(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, int[2] dilation, "
      "int groups, str activation=\"identity\", float negative_slope=0.01, bool for_backward=False) -> str");
  // The path forward_residual takes for these arguments, as JSON: _explain's keys, and `residual` (in the cuDNN graph
  // or added after it, and why).
  m.def(
      "_explain_residual(Tensor input, Tensor weight, Tensor? bias, Tensor residual, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, str activation=\"identity\", float negative_slope=0.01) -> str");
  // The way param_grad computes the weight and bias gradients for these arguments, as JSON (graph or ATen and why,
  // engine, timings; the bias gradient's way and launch configuration). Builds and caches plans as param_grad would.
  m.def(
      "_explain_param_grad(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups) -> str");
  // The way _activation_backward computes its results for these arguments, as JSON: fused kernel or ATen and why,
  // the launch configuration, the bias gradient's way.
  m.def(
      "_explain_activation_backward(Tensor grad_output, Tensor saved, str activation, float negative_slope, "
      "bool bias_grad) -> str");
  // The way _input_grad_activation computes its results for these arguments, as JSON: "cudnn graph" (dgrad with the
  // derivative in it) or "separate", why, the engine and both ways' times. Builds and caches the plan as the call would.
  m.def(
      "_explain_input_grad_activation(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, Tensor saved, str activation, float negative_slope) -> str");
  // The bias gradient one way by name ("kernel": ours; "aten": ATen's sum), for benchmarks and tests (CUDA only).
  m.def("_bias_grad(Tensor grad_output, str way) -> Tensor");
  // act(z) out of place (z's layout) by the pass run after a cuDNN graph ("graph": activation_after_graph), by ATen's
  // kernel ("aten"), or by our 16-bit pass with the cheaper math ("fast") or ATen's formulas ("exact"), for
  // benchmarks and tests (CUDA only).
  m.def("_activation_pass(Tensor z, str activation, float negative_slope, str way) -> Tensor");
  m.def("_plan_cache_stats() -> str", &convbias::plan_cache_stats);
  m.def("_plan_cache_clear() -> ()", &convbias::plan_cache_clear);
  // The flags a CUDA call runs under (TF32 for convolutions, determinism, benchmark, cudnn.enabled, tuning), as JSON.
  m.def("_math_flags() -> str", &convbias::math_flags);
  // Test hook: the next `count` cuDNN graph executions fail as a failing execute would (0 clears it).
  m.def("_inject_execution_failures(int count) -> ()", &convbias::inject_execution_failures);
  // Test hook: the next `count` forward graphs with an epilogue (the activation, the residual add) are refused as cuDNN
  // would refuse them (the graph without it and one pointwise pass run instead); 0 clears it.
  m.def("_inject_epilogue_rejections(int count) -> ()", &convbias::inject_epilogue_rejections);
  // Test hook: the next `count` timed comparisons of a forward graph against ATen's convolution (cudnn.benchmark)
  // choose ATen's as if it had measured faster; 0 clears it.
  m.def("_inject_aten_preferences(int count) -> ()", &convbias::inject_aten_preferences);
  // Test hook: the next `count` such comparisons where a 1x1 float32 forward fits one matrix multiply choose that way;
  // 0 clears it.
  m.def("_inject_matmul_preferences(int count) -> ()", &convbias::inject_matmul_preferences);
  // Test hook: the next `count` tries of the padded-channels way (TORCH_CONVBIAS_PAD_CHANNELS) fail before they run, as
  // out of memory for the copies (out_of_memory) or as another error would; the problem runs as it is. 0 clears it.
  m.def(
      "_inject_padded_way_failures(int count, bool out_of_memory) -> ()", &convbias::inject_padded_way_failures);
  // The samples per part of a call run in parts of its batch (past cuDNN's 32-bit indexing), or None: for tests of
  // the arithmetic on meta tensors.
  m.def("_batch_part_size(Tensor input, Tensor weight, int output_numel) -> int?", &convbias::batch_part_size);
  // Test hook: [regrouped input, regrouped weight] of the space-to-depth way (cuda/space_to_depth.h), or [].
  m.def(
      "_space_to_depth(Tensor input, Tensor weight, int[2] stride, int[2] padding, int[2] dilation, int groups) "
      "-> Tensor[]",
      &convbias::space_to_depth);
  // Test hook: the original weight's gradient from the regrouped weight's (cuda/space_to_depth.h).
  m.def(
      "_space_to_depth_weight_grad(Tensor grad, Tensor input, Tensor weight, int[2] stride, int[2] padding) -> Tensor",
      &convbias::space_to_depth_weight_grad);
  // [cuDNN version compiled against, cuDNN version loaded at run time, cuDNN frontend version].
  m.def("_cudnn_versions() -> int[]", &convbias::cudnn_versions);
}

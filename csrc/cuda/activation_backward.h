// The activation's backward fused with the bias gradient, on CUDA: one pass over grad_output and the tensor the
// derivative needs (activation_backward.cu) that writes dz = grad_output * act'(saved) once and sums the written dz
// over N, H, W (FP32 accumulation, FP64 for double; deterministic), and the choice between it and ATen
// (activation_backward_ways.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "activation.h"
#include "cuda/column_sum_config.h"

namespace convbias::cuda {

// Why the fused kernel cannot take these tensors (the first reason found), or nullopt when it can: it takes a
// non-identity activation over non-empty CUDA grad_output and saved that are both channels_last (NHWC-packed, hence
// the same strides), with K a whole number of 16-byte vectors (a multiple of 4 in fp32, 8 in 16-bit types, 2 in fp64)
// and 16-byte aligned bases.
std::optional<std::string> fused_activation_backward_refusal(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

// (dz, grad_bias) by the fused kernel: dz channels_last in grad_output's dtype, the derivative computed in FP32 (FP64
// for double) from the widened inputs and rounded once; grad_bias [K] = the sum of the rounded dz over N, H, W,
// accumulated in FP32 (FP64) in a fixed order and rounded once. Requires no refusal.
std::pair<at::Tensor, at::Tensor> fused_activation_backward(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

// The fused kernel's launch configuration for these tensors, as a call would use it (column_sum_config.h).
KernelLaunch fused_activation_backward_launch(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation);

// How convbias::_activation_backward computes its results on CUDA: the fused kernel, or ATen's pointwise backward
// followed (when the bias gradient is asked for) by the bias gradient as param_grad computes it (bias_grad.h).
// `notes` say why the fused kernel did not run.
struct ActivationBackwardWay {
  bool fused;
  std::vector<std::string> notes;
};
ActivationBackwardWay activation_backward_way(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation, bool with_bias_grad);

// convbias::_activation_backward's CUDA kernel (arguments checked): (grad_z, grad_bias if with_bias_grad).
std::tuple<at::Tensor, std::optional<at::Tensor>> activation_backward(
    const at::Tensor& grad_output, const at::Tensor& saved, const ActivationSpec& activation, bool with_bias_grad);

} // namespace convbias::cuda

// The activation of convbias::forward as the last node of the cuDNN forward graph (its epilogue): conv_fprop ->
// ADD bias -> pointwise activation, FP32 compute, one output write. Which cuDNN pointwise mode (and attributes) each
// activation is, and a test hook that makes cuDNN's refusal of such a graph reproducible.
//
//   relu        RELU_FWD (lower clip 0, slope 0)
//   leaky_relu  RELU_FWD with relu_lower_clip_slope = negative_slope: y = x for x > 0, negative_slope * x otherwise
//   gelu        GELU_FWD (the erf form, as nn.GELU())
//   gelu_tanh   GELU_APPROX_TANH_FWD (nn.GELU(approximate="tanh"))
//   silu        SWISH_FWD with swish_beta 1: x * sigmoid(x)
//   sigmoid     SIGMOID_FWD
//   tanh        TANH_FWD
//
// One difference from ATen, at +inf only: the frontend caps RELU_FWD's upper clip at FLT_MAX for FP32 compute, so
// relu / leaky_relu of +inf is FLT_MAX in a float32 output (float16 / bfloat16 outputs round it back to +inf).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "activation.h"
#include "cuda/graph_common.h"

namespace convbias::cuda {

// The pointwise node applying `activation` (not identity) to the FP32 result of conv (+ bias).
fe::graph::Pointwise_attributes epilogue_attributes(const ActivationSpec& activation);

// The operation list graph_operations() gives for that node, e.g. "RELU_FWD" or "RELU_FWD(lower_clip_slope=0.2)":
// what a graph holding the epilogue must show (explain, and the plan store's check of a stored graph).
std::string epilogue_operation(const ActivationSpec& activation);

// The pointwise node of a backward graph computing grad * act'(saved), where `saved` is the tensor the backward keeps
// (activation.h) and cuDNN's backward mode reads that same tensor: relu and leaky_relu (RELU_BWD with the slope: the
// sign test reads the same on the output as on the pre-activation), gelu (GELU_BWD), gelu_tanh
// (GELU_APPROX_TANH_BWD) and silu (SWISH_BWD, beta 1) from the pre-activation. nullopt for identity, and for sigmoid
// and tanh, whose backward keeps the output while cuDNN's SIGMOID_BWD / TANH_BWD read the forward input.
std::optional<fe::graph::Pointwise_attributes> derivative_attributes(const ActivationSpec& activation);

// Test hook (convbias::_inject_epilogue_rejections): the next `count` graphs with an activation epilogue are refused
// as if cuDNN had rejected them, so that the fallback to the graph without it can be tested. 0 clears it.
void inject_epilogue_rejections(int64_t count);

// Whether this epilogue graph is to be refused (inject_epilogue_rejections), consuming one injected rejection.
bool take_injected_epilogue_rejection();

} // namespace convbias::cuda

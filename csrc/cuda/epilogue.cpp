#include "cuda/epilogue.h"

#include <c10/util/Exception.h>

#include "cuda/test_hook.h"

namespace convbias::cuda {
namespace {

TestHookCountdown injected_rejections;

fe::PointwiseMode_t mode_of(Activation kind) {
  switch (kind) {
    case Activation::Relu:
    case Activation::LeakyRelu: return fe::PointwiseMode_t::RELU_FWD;
    case Activation::Gelu: return fe::PointwiseMode_t::GELU_FWD;
    case Activation::GeluTanh: return fe::PointwiseMode_t::GELU_APPROX_TANH_FWD;
    case Activation::Silu: return fe::PointwiseMode_t::SWISH_FWD;
    case Activation::Sigmoid: return fe::PointwiseMode_t::SIGMOID_FWD;
    case Activation::Tanh: return fe::PointwiseMode_t::TANH_FWD;
    case Activation::Identity: break;
  }
  TORCH_INTERNAL_ASSERT(false, "convbias: no epilogue node for the identity activation");
}

// The slope cuDNN is given (the frontend's attribute is a float, as ATen's float32 opmath uses it).
float lower_clip_slope(const ActivationSpec& a) {
  return a.kind == Activation::LeakyRelu ? static_cast<float>(a.negative_slope) : 0.0f;
}

} // namespace

fe::graph::Pointwise_attributes epilogue_attributes(const ActivationSpec& activation) {
  auto attributes = fe::graph::Pointwise_attributes()
                        .set_name(std::string("activation_") + activation_name(activation.kind))
                        .set_mode(mode_of(activation.kind))
                        .set_compute_data_type(fe::DataType_t::FLOAT);
  switch (activation.kind) {
    case Activation::Relu:
    case Activation::LeakyRelu:
      // Lower clip 0 (the frontend's default, set here so that it does not depend on it): x > 0 passes, the rest is
      // scaled by the slope (0 for relu).
      attributes.set_relu_lower_clip(0.0f).set_relu_lower_clip_slope(lower_clip_slope(activation));
      break;
    case Activation::Silu:
      attributes.set_swish_beta(1.0f); // swish(x) = x * sigmoid(beta * x); silu is beta = 1
      break;
    default:
      break;
  }
  return attributes;
}

std::optional<fe::graph::Pointwise_attributes> derivative_attributes(const ActivationSpec& activation) {
  fe::PointwiseMode_t mode;
  switch (activation.kind) {
    case Activation::Relu:
    case Activation::LeakyRelu: mode = fe::PointwiseMode_t::RELU_BWD; break;
    case Activation::Gelu: mode = fe::PointwiseMode_t::GELU_BWD; break;
    case Activation::GeluTanh: mode = fe::PointwiseMode_t::GELU_APPROX_TANH_BWD; break;
    case Activation::Silu: mode = fe::PointwiseMode_t::SWISH_BWD; break;
    default: return std::nullopt;
  }
  auto attributes = fe::graph::Pointwise_attributes()
                        .set_name(std::string("derivative_") + activation_name(activation.kind))
                        .set_mode(mode)
                        .set_compute_data_type(fe::DataType_t::FLOAT);
  if (mode == fe::PointwiseMode_t::RELU_BWD) {
    attributes.set_relu_lower_clip(0.0f).set_relu_lower_clip_slope(lower_clip_slope(activation));
  } else if (mode == fe::PointwiseMode_t::SWISH_BWD) {
    attributes.set_swish_beta(1.0f);
  }
  return attributes;
}

std::string epilogue_operation(const ActivationSpec& activation) {
  return operation_name(nlohmann::json(mode_of(activation.kind)).get<std::string>(), lower_clip_slope(activation));
}

void inject_epilogue_rejections(int64_t count) {
  injected_rejections.arm(count);
}

bool take_injected_epilogue_rejection() {
  return injected_rejections.take();
}

} // namespace convbias::cuda

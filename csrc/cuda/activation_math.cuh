// Device math shared by the activation kernels: the float / double overloads of exp, erf and tanh, and the forward
// activations in the opmath type, formula for formula as PyTorch's CUDA kernels compute them
// (aten/src/ATen/native/cuda: relu as clamp_min, leaky_relu, gelu with approximate none / tanh, silu, sigmoid, tanh),
// so that a result differs from ATen's only by contraction into FMAs.
#pragma once

#include <cmath>

#include "activation.h"

namespace convbias::cuda {

__device__ inline float exp_of(float x) {
  return expf(x);
}
__device__ inline double exp_of(double x) {
  return exp(x);
}
__device__ inline float erf_of(float x) {
  return erff(x);
}
__device__ inline double erf_of(double x) {
  return erf(x);
}
__device__ inline float tanh_of(float x) {
  return tanhf(x);
}
__device__ inline double tanh_of(double x) {
  return tanh(x);
}

// act(x) in the opmath type Acc. NaN passes through every activation, as in ATen.
template <typename Acc>
__device__ inline Acc activation_forward(Activation kind, Acc x, Acc negative_slope) {
  switch (kind) {
    case Activation::Identity:
      return x;
    case Activation::Relu:
      return x <= Acc(0) ? Acc(0) : x; // NaN: the comparison is false, NaN stays
    case Activation::LeakyRelu:
      return x > Acc(0) ? x : x * negative_slope;
    case Activation::Gelu: {
      constexpr Acc kAlpha = static_cast<Acc>(M_SQRT1_2);
      return x * Acc(0.5) * (Acc(1) + erf_of(x * kAlpha));
    }
    case Activation::GeluTanh: {
      constexpr Acc kBeta = static_cast<Acc>(M_SQRT2 * M_2_SQRTPI * 0.5);
      constexpr Acc kKappa = static_cast<Acc>(0.044715);
      const Acc inner = kBeta * (x + kKappa * x * x * x);
      return Acc(0.5) * x * (Acc(1) + tanh_of(inner));
    }
    case Activation::Silu:
      return x / (Acc(1) + exp_of(-x));
    case Activation::Sigmoid:
      return Acc(1) / (Acc(1) + exp_of(-x));
    case Activation::Tanh:
      return tanh_of(x);
  }
  return x;
}

} // namespace convbias::cuda

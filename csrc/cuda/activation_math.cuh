// Device math shared by the activation kernels: the float / double overloads of exp, erf and tanh, and the forward
// activations in the opmath type, formula for formula as PyTorch's CUDA kernels compute them
// (aten/src/ATen/native/cuda: relu as clamp_min, leaky_relu, gelu with approximate none / tanh, silu, sigmoid, tanh),
// so that a result differs from ATen's only by contraction into FMAs.
//
// Except where the result is 16-bit (kFastMath): float16 and bfloat16 keep 11 and 8 significant bits, and at 2 bytes
// per element the passes over them are bound by arithmetic, not memory, when each element costs an erff (~22
// instructions), an expf (~14) and an IEEE division (measured on the H200: gelu's fused backward at 0.63-0.68 of copy
// bandwidth, silu's 0.72-0.81, fp32's 0.80-0.91; with the math below gelu's reached 0.77-0.86). There the exp is
// __expf (ex2.approx), a division by a value that cannot exceed 2^126 __fdividef, and the normal distribution's tail
// (gelu's erf) a fitted polynomial (normal_tail_fast). Errors in FP32: relative ~1e-6 (up to ~1e-5 where __expf's
// argument is large), absolute ~3e-7 where a result crosses zero (gelu's derivative at -0.75), far under float16's
// half-ulp (2.4e-4 relative); over every float16 / bfloat16 input in [-16, 16] the rounded result is within one ulp of
// float64's and differs from its correct rounding in a few per thousand values at most (numpy emulation and the CUDA
// tests). Unlike ATen's float formulas, whose 1 + erf(x) cancels, the tail keeps its relative accuracy. tanh keeps
// tanhf: the tanh activation needs its relative accuracy near 0.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <type_traits>

#include "activation.h"

namespace convbias::cuda {

// Whether a kernel producing T computes its activation with the cheaper math above.
template <typename T>
inline constexpr bool kFastMath = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

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

// exp and 1 / x, exact or fast (kFast only ever with float: kFastMath's types compute in float).
template <bool kFast, typename Acc>
__device__ inline Acc exp_as(Acc x) {
  static_assert(!kFast || std::is_same_v<Acc, float>, "the fast math is float math");
  if constexpr (kFast) {
    return __expf(x);
  } else {
    return exp_of(x);
  }
}
// 1 / x for x in [1, inf]: __fdividef's one limit (0 for x beyond 2^126, where 1 / x is below float's normal range
// anyway) does not matter there.
template <bool kFast, typename Acc>
__device__ inline Acc reciprocal_as(Acc x) {
  if constexpr (kFast) {
    return __fdividef(1.0f, x);
  } else {
    return Acc(1) / x;
  }
}

// 1 / (1 + exp(-x)), as ATen's sigmoid.
template <bool kFast, typename Acc>
__device__ inline Acc sigmoid_as(Acc x) {
  return reciprocal_as<kFast>(Acc(1) + exp_as<kFast>(-x));
}

// P(X > |x|) = Phi(-|x|) for a standard normal X, given pdf = phi(x): pdf times Mills' ratio M(|x|), the ratio from a
// polynomial in t = 1 / (1 + 0.3 |x|) (degree 7; least-squares fit with minimax reweighting of M(u) / t over
// u in [0, 13.5], where phi underflows float; max relative error 1.5e-7). Relative, not absolute, accuracy in the tail:
// gelu's derivative there is a difference of two small terms.
__device__ inline float normal_tail_fast(float x, float pdf) {
  const float t = __fdividef(1.0f, fmaf(0.3f, fabsf(x), 1.0f));
  float m = 0.08994967490434647f;
  m = fmaf(m, t, -0.39628127217292786f);
  m = fmaf(m, t, 0.5211647152900696f);
  m = fmaf(m, t, -0.13823014497756958f);
  m = fmaf(m, t, 0.3242291808128357f);
  m = fmaf(m, t, 0.24983781576156616f);
  m = fmaf(m, t, 0.30278435349464417f);
  m = fmaf(m, t, 0.2998596131801605f);
  return pdf * (m * t);
}

// Phi(x), the standard normal CDF, as ATen's gelu computes it (0.5 * (1 + erf(x / sqrt 2))), or fast from the tail.
// NaN passes through both.
template <bool kFast, typename Acc>
__device__ inline Acc normal_cdf_as(Acc x, Acc pdf) {
  if constexpr (kFast) {
    const float tail = normal_tail_fast(x, pdf);
    return x > 0.0f ? 1.0f - tail : tail;
  } else {
    constexpr Acc kAlpha = static_cast<Acc>(M_SQRT1_2);
    return Acc(0.5) * (Acc(1) + erf_of(x * kAlpha));
  }
}

// phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
template <bool kFast, typename Acc>
__device__ inline Acc normal_pdf_as(Acc x) {
  constexpr Acc kBeta = static_cast<Acc>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
  return exp_as<kFast>(Acc(-0.5) * x * x) * kBeta;
}

// act(x) in the opmath type Acc (kFast: the cheaper math, see the top). NaN passes through every activation, as in
// ATen.
template <typename Acc, bool kFast = false>
__device__ inline Acc activation_forward(Activation kind, Acc x, Acc negative_slope) {
  static_assert(!kFast || std::is_same_v<Acc, float>, "the fast math is float math");
  switch (kind) {
    case Activation::Identity:
      return x;
    case Activation::Relu:
      return x <= Acc(0) ? Acc(0) : x; // NaN: the comparison is false, NaN stays
    case Activation::LeakyRelu:
      return x > Acc(0) ? x : x * negative_slope;
    case Activation::Gelu: {
      if constexpr (kFast) {
        return x * normal_cdf_as<true>(x, normal_pdf_as<true>(x));
      } else {
        constexpr Acc kAlpha = static_cast<Acc>(M_SQRT1_2);
        return x * Acc(0.5) * (Acc(1) + erf_of(x * kAlpha));
      }
    }
    case Activation::GeluTanh: {
      constexpr Acc kBeta = static_cast<Acc>(M_SQRT2 * M_2_SQRTPI * 0.5);
      constexpr Acc kKappa = static_cast<Acc>(0.044715);
      const Acc inner = kBeta * (x + kKappa * x * x * x);
      if constexpr (kFast) {
        return x * sigmoid_as<true>(Acc(2) * inner); // 0.5 (1 + tanh(u)) = sigmoid(2u)
      } else {
        return Acc(0.5) * x * (Acc(1) + tanh_of(inner));
      }
    }
    case Activation::Silu:
      if constexpr (kFast) {
        return x * sigmoid_as<true>(x);
      } else {
        return x / (Acc(1) + exp_of(-x));
      }
    case Activation::Sigmoid:
      return sigmoid_as<kFast>(x);
    case Activation::Tanh:
      return tanh_of(x);
  }
  return x;
}

// Calls f(std::integral_constant<Activation, kind>{}): kernels get the activation as a template argument, so that each
// is compiled for one activation alone. With the kind a runtime value inside the kernel, every activation's code sat in
// one kernel and its registers cost the simple ones too (our relu pass measured at 0.93 of ATen's on the H200).
template <typename F>
decltype(auto) with_activation_kind(Activation kind, F&& f) {
  using A = Activation;
  switch (kind) {
    case A::Relu: return f(std::integral_constant<A, A::Relu>{});
    case A::LeakyRelu: return f(std::integral_constant<A, A::LeakyRelu>{});
    case A::Gelu: return f(std::integral_constant<A, A::Gelu>{});
    case A::GeluTanh: return f(std::integral_constant<A, A::GeluTanh>{});
    case A::Silu: return f(std::integral_constant<A, A::Silu>{});
    case A::Sigmoid: return f(std::integral_constant<A, A::Sigmoid>{});
    case A::Tanh: return f(std::integral_constant<A, A::Tanh>{});
    case A::Identity: break;
  }
  return f(std::integral_constant<A, A::Identity>{});
}

} // namespace convbias::cuda

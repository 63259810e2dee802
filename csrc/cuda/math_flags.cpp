#include "cuda/math_flags.h"

#include <ATen/Context.h>

#include "cuda/knobs.h"
#include "cuda/timing.h"

namespace convbias::cuda {

MathFlags current_math_flags() {
  const auto& ctx = at::globalContext();
  // As ATen's convolution (aten/src/ATen/native/Convolution.cpp) reads them. allowTF32CuDNN() without an op raises
  // as soon as the conv and RNN precisions differ (torch.backends.cudnn.conv.fp32_precision = "ieee"): ask for the
  // convolution's own.
  return MathFlags{
      ctx.allowTF32CuDNN(at::Float32Op::CONV), ctx.deterministicCuDNN() || ctx.deterministicAlgorithms(),
      ctx.benchmarkCuDNN()};
}

const char* tuning_name(Tuning tuning) {
  switch (tuning) {
    case Tuning::Untimed: return "untimed";
    case Tuning::Quick: return "quick";
    case Tuning::Exhaustive: return "exhaustive";
  }
  return "?";
}

Tuning requested_tuning(const MathFlags& flags) {
  const std::string& autotune = knobs().autotune;
  if (autotune == "on") {
    return Tuning::Exhaustive;
  }
  if (autotune == "quick") {
    return Tuning::Quick;
  }
  if (autotune == "off") {
    return Tuning::Untimed;
  }
  return flags.benchmark ? Tuning::Exhaustive : Tuning::Untimed;
}

Tuning current_tuning(const MathFlags& flags) {
  const Tuning requested = requested_tuning(flags);
  return requested != Tuning::Untimed && stream_is_capturing() ? Tuning::Untimed : requested;
}

} // namespace convbias::cuda

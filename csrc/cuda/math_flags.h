// The flags that decide which engines a call may use and how a new problem's choices are made: PyTorch's own
// convolution flags, read as ATen's convolution reads them, and the TORCH_CONVBIAS_AUTOTUNE knob. Kept apart from
// the cuDNN frontend so that CUDA kernels (.cu) can use it too.
#pragma once

namespace convbias::cuda {

// The numerical promises a call makes, from torch's flags at call time.
struct MathFlags {
  // TF32 tensor cores for float32 convolutions: the convolution's own setting, at::globalContext()
  // .allowTF32CuDNN(Float32Op::CONV), which the legacy torch.backends.cudnn.allow_tf32 and the fp32_precision of
  // torch.backends.cudnn.conv / torch.backends.cudnn / torch.backends all set.
  bool allow_tf32;
  // torch.backends.cudnn.deterministic or torch.use_deterministic_algorithms(True): either one, as for ATen's
  // convolution. No NONDETERMINISTIC engine, no timed choice that could differ between runs, no substituted engine.
  bool deterministic;
  bool benchmark; // torch.backends.cudnn.benchmark
};
MathFlags current_math_flags();

// How the choices for a new problem (engine, fused or not, NCHW way, ATen or graph, bias-kernel launch) are made.
//   Untimed:    heuristics' first plan that builds and runs, and fixed defaults elsewhere: no timing, no
//               synchronisation, the same choice in every run (torch.backends.cudnn.benchmark=False, the default;
//               TORCH_CONVBIAS_AUTOTUNE=off; always during CUDA graph capture).
//   Quick:      the first 3 candidates timed once (TORCH_CONVBIAS_AUTOTUNE=quick).
//   Exhaustive: every engine that builds, fused vs unfused and ATen's own path timed (cudnn.benchmark=True, or
//               TORCH_CONVBIAS_AUTOTUNE=on).
// bench/bench_variable_shapes.py measured the choice of Untimed for benchmark=False (README: "Tuning").
enum class Tuning { Untimed, Quick, Exhaustive };
const char* tuning_name(Tuning tuning);

// The tuning the knob and the flags ask for, without asking the stream (no CUDA call).
Tuning requested_tuning(const MathFlags& flags);

// requested_tuning, but Untimed while the current stream is capturing a CUDA graph.
Tuning current_tuning(const MathFlags& flags);

} // namespace convbias::cuda

#include "cuda/knobs.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace convbias::cuda {

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(fallback);
}

} // namespace

const Knobs& knobs() {
  static const Knobs k = [] {
    Knobs result;
    const std::string size = env_or("TORCH_CONVBIAS_CACHE_SIZE", "1000");
    try {
      result.cache_size = std::stoll(size);
    } catch (const std::exception&) {
      TORCH_CHECK_VALUE(false, "TORCH_CONVBIAS_CACHE_SIZE must be a positive integer, got '", size, "'");
    }
    TORCH_CHECK_VALUE(result.cache_size > 0, "TORCH_CONVBIAS_CACHE_SIZE must be a positive integer, got ", size);
    const std::string runtime_compilation = env_or("TORCH_CONVBIAS_RUNTIME_COMPILATION", "fallback");
    TORCH_CHECK_VALUE(
        runtime_compilation == "fallback" || runtime_compilation == "timed" || runtime_compilation == "off",
        "TORCH_CONVBIAS_RUNTIME_COMPILATION must be fallback, timed or off, got '", runtime_compilation, "'");
    const bool none = env_or("TORCH_CONVBIAS_NO_RUNTIME_COMPILATION", "0") == "1";
    TORCH_CHECK_VALUE(
        !none || runtime_compilation != "timed",
        "TORCH_CONVBIAS_RUNTIME_COMPILATION=timed contradicts TORCH_CONVBIAS_NO_RUNTIME_COMPILATION=1");
    result.allow_runtime_compiled = !none && runtime_compilation != "off";
    result.time_runtime_compiled = runtime_compilation == "timed";
    result.path = env_or("TORCH_CONVBIAS_PATH", "auto");
    TORCH_CHECK_VALUE(
        result.path == "auto" || result.path == "fused" || result.path == "unfused" || result.path == "aten",
        "TORCH_CONVBIAS_PATH must be auto, fused, unfused or aten, got '", result.path, "'");
    result.activation = env_or("TORCH_CONVBIAS_ACTIVATION", "auto");
    TORCH_CHECK_VALUE(
        result.activation == "auto" || result.activation == "fused" || result.activation == "unfused",
        "TORCH_CONVBIAS_ACTIVATION must be auto, fused or unfused, got '", result.activation, "'");
    // The epilogue follows the bias add inside the graph: a graph without the bias (or no graph) cannot have it.
    TORCH_CHECK_VALUE(
        result.activation != "fused" || result.path == "auto" || result.path == "fused",
        "TORCH_CONVBIAS_ACTIVATION=fused needs the bias in the cuDNN graph, which TORCH_CONVBIAS_PATH=", result.path,
        " excludes");
    result.autotune = env_or("TORCH_CONVBIAS_AUTOTUNE", "auto");
    TORCH_CHECK_VALUE(
        result.autotune == "auto" || result.autotune == "off" || result.autotune == "quick" || result.autotune == "on",
        "TORCH_CONVBIAS_AUTOTUNE must be auto, off, quick or on, got '", result.autotune, "'");
    result.param_grad = env_or("TORCH_CONVBIAS_PARAM_GRAD", "cudnn");
    TORCH_CHECK_VALUE(
        result.param_grad == "aten" || result.param_grad == "cudnn",
        "TORCH_CONVBIAS_PARAM_GRAD must be aten or cudnn, got '", result.param_grad, "'");
    result.input_grad = env_or("TORCH_CONVBIAS_INPUT_GRAD", "timed");
    TORCH_CHECK_VALUE(
        result.input_grad == "aten" || result.input_grad == "timed" || result.input_grad == "graph",
        "TORCH_CONVBIAS_INPUT_GRAD must be aten, timed or graph, got '", result.input_grad, "'");
    result.bias_grad = env_or("TORCH_CONVBIAS_BIAS_GRAD", "kernel");
    TORCH_CHECK_VALUE(
        result.bias_grad == "kernel" || result.bias_grad == "cudnn" || result.bias_grad == "aten",
        "TORCH_CONVBIAS_BIAS_GRAD must be kernel, cudnn or aten, got '", result.bias_grad, "'");
    result.nchw = env_or("TORCH_CONVBIAS_NCHW", "auto");
    TORCH_CHECK_VALUE(
        result.nchw == "auto" || result.nchw == "graph" || result.nchw == "copy" || result.nchw == "aten",
        "TORCH_CONVBIAS_NCHW must be auto, graph, copy or aten, got '", result.nchw, "'");
    result.pad_channels = env_or("TORCH_CONVBIAS_PAD_CHANNELS", "auto");
    TORCH_CHECK_VALUE(
        result.pad_channels == "auto" || result.pad_channels == "on" || result.pad_channels == "off",
        "TORCH_CONVBIAS_PAD_CHANNELS must be auto, on or off, got '", result.pad_channels, "'");
    result.space_to_depth = env_or("TORCH_CONVBIAS_SPACE_TO_DEPTH", "auto");
    TORCH_CHECK_VALUE(
        result.space_to_depth == "auto" || result.space_to_depth == "on" || result.space_to_depth == "off",
        "TORCH_CONVBIAS_SPACE_TO_DEPTH must be auto, on or off, got '", result.space_to_depth, "'");
    const std::string fallback = env_or("TORCH_CONVBIAS_WORKSPACE_FALLBACK", "on");
    TORCH_CHECK_VALUE(
        fallback == "on" || fallback == "off", "TORCH_CONVBIAS_WORKSPACE_FALLBACK must be on or off, got '", fallback,
        "'");
    result.workspace_fallback = fallback == "on";
    result.plan_cache_dir = env_or("TORCH_CONVBIAS_PLAN_CACHE_DIR", "");
    return result;
  }();
  return k;
}

} // namespace convbias::cuda

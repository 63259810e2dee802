// Autocast for convbias::forward and forward_residual: under torch.autocast the op casts its floating-point inputs to the autocast
// dtype, exactly as conv2d does (conv2d is on autocast's lower-precision list for CUDA and CPU).
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "convbias.h"

namespace convbias {
namespace {

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
at::Tensor forward_autocast(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation,
    double negative_slope) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const at::ScalarType to = at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return forward_symint(
      at::autocast::cached_cast(to, input, device_type), at::autocast::cached_cast(to, weight, device_type),
      at::autocast::cached_cast(to, bias, device_type), stride, padding, dilation, std::move(groups), activation,
      negative_slope);
}

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
at::Tensor forward_residual_autocast(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& residual,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    c10::SymInt groups,
    c10::string_view activation,
    double negative_slope) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const at::ScalarType to = at::autocast::get_lower_precision_fp_from_device_type(device_type);
  return forward_residual_symint(
      at::autocast::cached_cast(to, input, device_type), at::autocast::cached_cast(to, weight, device_type),
      at::autocast::cached_cast(to, bias, device_type), at::autocast::cached_cast(to, residual, device_type), stride,
      padding, dilation, std::move(groups), activation, negative_slope);
}

} // namespace

TORCH_LIBRARY_IMPL(convbias, AutocastCUDA, m) {
  m.impl("forward", &forward_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
  m.impl("forward_residual", &forward_residual_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(convbias, AutocastCPU, m) {
  m.impl("forward", &forward_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
  m.impl("forward_residual", &forward_residual_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

} // namespace convbias

// torch_convbias from C++ without Python: convbias::forward and convbias::param_grad (csrc/convbias.h) on the CPU
// and, when a GPU is present, on CUDA, each checked against LibTorch's own convolution. Exits 1 on a mismatch.
#include <convbias.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

namespace {

bool check(const std::string& what, const at::Tensor& actual, const at::Tensor& expected, double tolerance) {
  const double error = (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs().max().item<double>();
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  const bool ok = error <= tolerance * scale;
  std::cout << (ok ? "ok   " : "FAIL ") << what << ": max |error| " << error << "\n";
  return ok;
}

bool run(const torch::Device& device) {
  torch::manual_seed(0);
  const auto options = torch::TensorOptions().device(device).dtype(torch::kFloat);
  const auto cl = at::MemoryFormat::ChannelsLast;
  const at::Tensor x = torch::randn({4, 8, 12, 12}, options).contiguous(cl);
  const at::Tensor w = (torch::randn({16, 8, 3, 3}, options) / 8.5).contiguous(cl);
  const at::Tensor b = torch::randn({16}, options);
  const std::vector<int64_t> stride{1, 1}, padding{1, 1}, dilation{1, 1}, bias_sizes{16};

  const at::Tensor y = convbias::forward(x, w, b, stride, padding, dilation, /*groups=*/1);
  const at::Tensor expected = at::conv2d(x, w, b, stride, padding, dilation, 1);
  const at::Tensor dy = torch::randn(expected.sizes(), options).contiguous(cl);
  const auto [grad_weight, grad_bias] = convbias::param_grad(dy, x, w, stride, padding, dilation, 1);
  const auto reference = at::convolution_backward(
      dy, x, w, bias_sizes, stride, padding, dilation, false, {0, 0}, 1, {false, true, true});

  const std::string name = device.str();
  const double tolerance = 1e-4;
  bool ok = check(name + " forward", y, expected, tolerance);
  // With an activation: conv + bias + GELU in one call.
  const at::Tensor activated = convbias::forward(x, w, b, stride, padding, dilation, 1, "gelu");
  ok = check(name + " forward + gelu", activated, at::gelu(expected), tolerance) && ok;
  // A residual block's ending: relu(conv + bias + residual) in one call.
  const at::Tensor residual = torch::randn(expected.sizes(), options).contiguous(cl);
  const at::Tensor ended = convbias::forward_residual(x, w, b, residual, stride, padding, dilation, 1, "relu");
  ok = check(name + " forward_residual + relu", ended, at::relu(expected + residual), tolerance) && ok;
  ok = check(name + " grad_weight", grad_weight.value(), std::get<1>(reference), tolerance) && ok;
  ok = check(name + " grad_bias", grad_bias.value(), std::get<2>(reference), tolerance) && ok;
  return ok;
}

} // namespace

int main() {
  // Strict fp32 on both sides (LibTorch allows TF32 in cuDNN by default).
  at::globalContext().setAllowTF32CuDNN(false);
  bool ok = run(torch::kCPU);
  if (torch::cuda::is_available()) {
    ok = run(torch::Device(torch::kCUDA, 0)) && ok;
  } else {
    std::cout << "no GPU: the CUDA part is skipped\n";
  }
  return ok ? 0 : 1;
}

"""Problems with a tensor past 2^31 - 1 elements run ATen's convolution, which splits such a batch (cuDNN's engines
index with 32 bits): the input and weight, and also the output side alone — the forward's output, the gradients'
grad_output — which passes the limit first where a layer has more output than input channels (N >= 1024 RGB images
into 64 channels). Only routing is asked (explain), so the tests allocate without computing."""

from __future__ import annotations

import torch
from conftest import cuda

import torch_convbias

LIMIT = "more than 2^31 - 1 elements"


@cuda
def test_output_past_int32_elements_routes_forward_and_weight_gradient_to_aten() -> None:
    """A 1-channel 16384 x 16384 input (2^28 elements) into 9 channels: the output has 9 * 2^28 > 2^31 - 1 elements."""
    x = torch.empty(1, 1, 16384, 16384, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(9, 1, 1, 1, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    b = torch.randn(9, device="cuda", dtype=torch.float16)
    info = torch_convbias.explain(x, w, b)
    assert info["path"] == "aten" and LIMIT in info["notes"][0], info
    dy = torch.empty(1, 9, 16384, 16384, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    grad = torch_convbias.explain_param_grad(dy, x, w)
    assert grad["weight_grad"]["path"] == "aten" and LIMIT in grad["weight_grad"]["notes"][0], grad


@cuda
def test_tensors_under_the_limit_are_not_sent_to_aten_for_it() -> None:
    """The same layer at a quarter of the size (9 * 2^26 output elements) takes a cuDNN graph: the check is the
    element count, not the shape."""
    x = torch.randn(1, 1, 8192, 8192, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(9, 1, 1, 1, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    b = torch.randn(9, device="cuda", dtype=torch.float16)
    info = torch_convbias.explain(x, w, b)
    assert info["path"] != "aten" or not any(LIMIT in note for note in info["notes"]), info

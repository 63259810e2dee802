"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with ConvBias2d: two processes each shard a converted network (conv +
ReLU and a grouped conv + GELU fused into ConvBias2d, a plain ConvBias2d last) and train it on their half of a batch;
after every step each parameter, gathered whole, must equal a float64 nn.Conv2d network trained without any
distribution on the whole batch (FSDP2 averages the ranks' gradients, which is the mean loss over the whole batch).
gloo on the CPU in CI; NCCL on two GPUs (the device tool's two-GPU kind; skipped otherwise)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torch_convbias
from ranks import rank_device, run_ranks, small_network

WORLD = 2
STEPS = 3
HALF = 4  # samples per rank


def check(rank: int, backend: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = rank_device(rank, backend)
    torch.backends.cudnn.allow_tf32 = False  # strict fp32 against the float64 reference (on CUDA)
    torch.manual_seed(0)  # the same initial parameters on every rank
    reference = small_network(nn.GELU).double()
    ours = torch_convbias.convert(copy.deepcopy(reference).float()).to(device)
    fused = [m.activation for m in ours.modules() if isinstance(m, torch_convbias.ConvBias2d)]
    assert fused == ["relu", "gelu", "identity"], fused
    mesh = init_device_mesh(device.type, (WORLD,))
    for layer in ours:
        if isinstance(layer, torch_convbias.ConvBias2d):
            fully_shard(layer, mesh=mesh)
    fully_shard(ours, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in ours.parameters())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, reference)]
    generator = torch.Generator().manual_seed(100)  # the whole batch, the same on every rank
    for step in range(STEPS):
        x = torch.randn(WORLD * HALF, 3, 10, 10, generator=generator, dtype=torch.float64)
        target = torch.randn(WORLD * HALF, 4, 5, 5, generator=generator, dtype=torch.float64)
        mine = slice(rank * HALF, (rank + 1) * HALF)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ours(x[mine].float().to(device)), target[mine].float().to(device)).backward()
        nn.functional.mse_loss(reference(x), target).backward()
        for optimizer in optimizers:
            optimizer.step()
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            whole = p.full_tensor().detach().cpu().double()
            torch.testing.assert_close(
                whole, q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}"
            )


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


@pytest.mark.skipif(not fsdp2_available() or not dist.is_gloo_available(), reason="needs FSDP2 and gloo")
def test_fsdp2_gloo_cpu_matches_float64_unsharded_training(tmp_path: Path) -> None:
    run_ranks(check, "gloo", tmp_path, WORLD)


@pytest.mark.skipif(
    torch.cuda.device_count() < WORLD or not fsdp2_available() or not dist.is_nccl_available(),
    reason="needs two GPUs, FSDP2 and NCCL",
)
def test_fsdp2_nccl_matches_float64_unsharded_training(tmp_path: Path) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device machines ask for NVLink multicast off
    run_ranks(check, "nccl", tmp_path, WORLD)

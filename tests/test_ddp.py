"""DistributedDataParallel with ConvBias2d: two processes (gloo, CPU) train the same small network twice, once with
ConvBias2d layers and once with nn.Conv2d, and after each step the all-reduced gradients and the updated
parameters must agree. NCCL on several GPUs needs a machine with more than one GPU (skipped otherwise)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_convbias
from ranks import rank_device, run_ranks, small_network

WORLD = 2
STEPS = 3


def check(rank: int, backend: str) -> None:
    """Both networks trained side by side under DDP: equal gradients every step, equal replicas after."""
    device = rank_device(rank, backend)
    torch.manual_seed(0)  # the same initial parameters on every rank and for both networks
    reference = small_network().to(device)
    ours = torch_convbias.convert(copy.deepcopy(reference))
    assert sum(isinstance(m, torch_convbias.ConvBias2d) for m in ours.modules()) == 3
    models = {"ours": DistributedDataParallel(ours), "reference": DistributedDataParallel(reference)}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in models.items()}
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of the batch
    for step in range(STEPS):
        x = torch.randn(4, 3, 10, 10, generator=generator).to(device)
        target = torch.randn(4, 4, 5, 5, generator=generator).to(device)
        for name, model in models.items():
            optimizers[name].zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), target).backward()
        for (name, p), (_, q) in zip(models["ours"].named_parameters(), models["reference"].named_parameters()):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} step {step} {name}: {m}")
        for optimizer in optimizers.values():
            optimizer.step()
    # All-reduced gradients keep the replicas equal: every rank ends with the same parameters.
    for p in models["ours"].parameters():
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p.detach())
        torch.testing.assert_close(gathered[0], gathered[1], rtol=0, atol=0)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_gloo_cpu_matches_conv2d(tmp_path: Path) -> None:
    run_ranks(check, "gloo", tmp_path, WORLD)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not dist.is_nccl_available(), reason="needs two GPUs and NCCL")
def test_ddp_nccl_matches_conv2d(tmp_path: Path) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device machines ask for NVLink multicast off
    run_ranks(check, "nccl", tmp_path, WORLD)

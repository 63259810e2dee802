"""Running a check in several processes of one torch.distributed group (tests/test_ddp.py, tests/test_fsdp.py): each
rank writes its verdict to a file before the process group is torn down, and the verdicts decide. Also the network
those tests train."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def small_network(second_activation: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    """The distributed tests' network of nn.Conv2d layers (3 -> 4 channels, 10x10 -> 5x5): conv + ReLU, a strided
    grouped conv + `second_activation`, a 1x1 conv; what convert() turns into three ConvBias2d layers."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
        second_activation(),
        nn.Conv2d(8, 4, 1),
    )


def rank_device(rank: int, backend: str) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL (made current), the CPU under gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def worker(
    rank: int, check: Callable[[int, str], None], init_file: str, backend: str, report_dir: str, world: int
) -> None:
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    report = Path(report_dir) / f"rank{rank}"
    try:
        check(rank, backend)
        report.write_text("ok")
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails the test with it
        report.write_text(f"{type(error).__name__}: {error}")
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(check: Callable[[int, str], None], backend: str, tmp_path: Path, world: int = 2) -> None:
    """``check(rank, backend)`` in ``world`` spawned processes (``check`` a module-level function, so that it pickles).

    gloo's teardown at process exit occasionally aborts ("terminate called without an active exception", seen once
    in CI with torch 2.14.1, after every check had passed), which is torch's, not the model's: a rank's exit code
    counts only when it wrote no verdict."""
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=worker, args=(rank, check, str(tmp_path / "init"), backend, str(tmp_path), world))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
    for rank, process in enumerate(processes):
        if process.is_alive():
            process.kill()
        report = tmp_path / f"rank{rank}"
        assert report.exists(), f"rank {rank} wrote no verdict (exit code {process.exitcode})"
        assert report.read_text() == "ok", f"rank {rank}: {report.read_text()}"

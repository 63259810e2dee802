"""A variable-shape workload: what choosing plans for every new shape costs and what it pays, ours against nn.Conv2d.

A small CNN (three 3x3 convolutions with bias and ReLU, channels_last) takes a training step (forward, loss,
backward) on each of ``--shapes`` distinct (batch, height, width) inputs, as a detector with multi-scale inputs or a
language of variable image sizes would. Every new shape is a new key for every layer: its plans are chosen on its
first step. Each tuning configuration runs in a process of its own (``TORCH_CONVBIAS_AUTOTUNE`` is read once):

* ``untimed``   ``cudnn.benchmark=False``, ``TORCH_CONVBIAS_AUTOTUNE=auto`` (the default): heuristics, no timing;
* ``quick``     ``cudnn.benchmark=False``, ``TORCH_CONVBIAS_AUTOTUNE=quick``: the first 3 candidates timed per key
  (the default before issue 16);
* ``benchmark`` ``cudnn.benchmark=True`` on both sides: everything timed.

In each process both sides run interleaved shape by shape, on copies of one network:

* ``first_epoch_s``: the sum over shapes of each shape's first step, wall time with synchronisation (plans built,
  and timed where asked; nn.Conv2d's cuDNN does the same for its own algorithms under benchmark mode);
* ``steady_ms``: a second pass, each shape's step timed back to back (``--repeat`` steps queued between CUDA events,
  the rate a training loop gets), summed over the shapes;
* ``steady_gpu_ms``: the GPU kernel time of one such pass (profiler sums): the work itself, without the host.

``python -m bench.bench_variable_shapes`` runs the three configurations (GPU); ``--device cpu --shapes 3`` is a smoke
test of the script. The decision it informs (README, "Tuning"): what ``cudnn.benchmark=False`` means for us.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bench import common

CONFIGS: dict[str, dict[str, Any]] = {
    "untimed": {"benchmark": False, "autotune": "auto"},
    "quick": {"benchmark": False, "autotune": "quick"},
    "benchmark": {"benchmark": True, "autotune": "auto"},
}


def shapes(count: int, seed: int = 20261203) -> list[tuple[int, int, int]]:
    """`count` distinct (batch, height, width): batches 16-128 in steps of 8, sides 12-64."""
    rng = random.Random(seed)
    chosen: dict[tuple[int, int, int], None] = {}
    while len(chosen) < count:
        chosen[(8 * rng.randint(2, 16), rng.randint(12, 64), rng.randint(12, 64))] = None
    return list(chosen)


def network(dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    return net.to(device=device, dtype=dtype, memory_format=torch.channels_last)


def make_step(net: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = net(x).float().square().mean()
        loss.backward()
        for p in net.parameters():
            p.grad = None
        return loss.detach()

    return step


def worker(config: str, mode_name: str, count: int, repeat: int, device: str) -> dict[str, Any]:
    """One configuration's measurements, both sides interleaved shape by shape (this process's knobs)."""
    import torch_convbias

    mode = common.modes()[mode_name]
    reference = network(mode.dtype, device)
    sides = {"torch": copy.deepcopy(reference), "ours": torch_convbias.convert(copy.deepcopy(reference))}
    suite = shapes(count)
    first: dict[str, float] = {name: 0.0 for name in sides}
    steady: dict[str, float] = {name: 0.0 for name in sides}
    worst_loss_gap = 0.0
    with common.mode_flags(mode, cudnn_benchmark=CONFIGS[config]["benchmark"]):
        inputs = [
            torch.randn(n, 3, h, w, device=device, dtype=mode.dtype).contiguous(memory_format=torch.channels_last)
            for n, h, w in suite
        ]
        for i, x in enumerate(inputs):
            losses = {}
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                ms, losses[name] = common.wall_ms(make_step(sides[name], x), device)
                first[name] += ms / 1e3
            gap = abs(losses["ours"].item() - losses["torch"].item()) / max(1e-6, abs(losses["torch"].item()))
            worst_loss_gap = max(worst_loss_gap, gap)
        for i, x in enumerate(inputs):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                steady[name] += common.back_to_back_ms(make_step(sides[name], x), repeat, device)
        gpu = {name: common.gpu_kernel_ms([make_step(net, x) for x in inputs], device) for name, net in sides.items()}
    return {
        "config": config,
        "mode": mode_name,
        "shapes": count,
        "first_epoch_s": first,
        "steady_ms": steady,
        "steady_gpu_ms": gpu,
        "worst_relative_loss_gap": worst_loss_gap,
        "cache_info": torch_convbias.cache_info(),
        "math": json.loads(torch.ops.convbias._math_flags()),
    }


def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """`worker` in a fresh process with the configuration's environment."""
    env = {**os.environ, "TORCH_CONVBIAS_AUTOTUNE": CONFIGS[config]["autotune"]}
    command = [
        sys.executable, "-m", "bench.bench_variable_shapes", "--worker", config, "--modes", ",".join(args.modes),
        "--shapes", str(args.benchmark_shapes if config == "benchmark" else args.shapes), "--repeat", str(args.repeat), "--device", args.device,
    ]
    done = subprocess.run(command, env=env, cwd=common.REPO_ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"config": config, "error": done.stderr[-3000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """torch / ours of each measurement (> 1: ours is faster)."""
    out: dict[str, float | None] = {}
    for key in ("first_epoch_s", "steady_ms", "steady_gpu_ms"):
        values = row.get(key) or {}
        ours, torch_ = values.get("ours"), values.get("torch")
        out[key] = torch_ / ours if ours and torch_ else None
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=100)
    parser.add_argument(
        "--benchmark-shapes", type=int, default=30,
        help="shapes for the benchmark configuration (the first of the list): its first epoch times every engine",
    )
    parser.add_argument("--repeat", type=int, default=3, help="steps queued back to back per shape in the steady pass")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["tf32", "bf16"])
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout", type=float, default=500)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rows = [worker(args.worker, mode, args.shapes, args.repeat, args.device) for mode in args.modes]
        print(json.dumps(rows))
        return
    results: dict[str, Any] = {"environment": common.environment(), "config": vars(args), "rows": []}
    for config in args.configs:
        report = run_config(config, args)
        for row in report if isinstance(report, list) else [report]:
            row["ratios"] = ratios(row) if "error" not in row else {}
            results["rows"].append(row)
            print(json.dumps({k: row.get(k) for k in ("config", "mode", "first_epoch_s", "steady_ms", "steady_gpu_ms",
                                                      "ratios", "error")}))
    path = common.write_json(results, args.out, "variable_shapes")
    print(f"results: {path}")


if __name__ == "__main__":
    main()

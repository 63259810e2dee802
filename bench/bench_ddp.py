"""Data-parallel scaling of the layer-wise training step (issue 15): the per-GPU rate of DistributedDataParallel steps
over ``--world`` GPUs against one GPU's, for ``ConvBias2d(activation="relu")`` and ``nn.Sequential(nn.Conv2d,
nn.ReLU)``, measured in one run.

Each rank is one process with one GPU (NCCL; gloo with ``--device cpu``, the smoke test) and holds the same layer,
input and output gradient (``bench_layerwise.make_layers``: the per-GPU batch is the shape's N, weak scaling). Per
(mode, shape, side):

* ``single_ms``: the step alone (forward, backward with the fixed output gradient, SGD with momentum), no process
  group involved, all ranks stepping at once on their own GPUs (as the GPUs of a data-parallel job share a host);
* ``ddp_ms``: the same step with the layer in ``DistributedDataParallel`` (gradients all-reduced, bucketed and
  overlapped with the backward);
* ``efficiency`` = ``single_ms / ddp_ms`` (1.0: the all-reduce is free; its cost shows as the shortfall) and, per
  row, ``ddp_speedup`` = nn's ``ddp_ms`` / ours (ours against nn.Conv2d, both data-parallel).

Times are medians over ``--repeats`` samples of ``--calls`` steps queued back to back, sides interleaved, every rank
starting each sample at a barrier; rank 0's figures are recorded (each rank's are in ``per_rank``). After the timing,
the replicas of each DDP layer are compared across ranks (all-reduced gradients keep them equal: ``replicas_equal``).
Results go to ``ddp-<gpu>.json``. ``python -m bench.bench_ddp --world 2`` (GPU: as many GPUs as ranks);
``--device cpu --quick`` is the smoke test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from bench import common, harness
from bench.bench_layerwise import Layer, make_layers

NAME = "ddp"
SIDES = ("ours", "torch")
DEFAULT_SHAPES = ("N1024 C64 32x32 K64 k3s1p1", "N256 C64 56x56 K64 k3s1p1", "N1024 C512 7x7 K512 k3s1p1")


def shapes(labels: Sequence[str], quick: bool) -> list[harness.Shape]:
    if quick:
        return [harness.QUICK_SUITE[0]]
    by_label = {shape.label: shape for shape in harness.ACTIVATION_SUITE}
    unknown = [label for label in labels if label not in by_label]
    if unknown:
        raise SystemExit(f"bench_ddp: unknown shape(s) {unknown}; choose from {sorted(by_label)}")
    return [by_label[label] for label in labels]


def data_parallel(layer: Layer) -> Layer:
    """The layer's module (a copy) in DistributedDataParallel, with its own optimizer; same input and gradient."""
    module = DistributedDataParallel(copy.deepcopy(layer.module))
    optimizer = torch.optim.SGD(module.parameters(), lr=layer.optimizer.defaults["lr"], momentum=0.9)
    return Layer(module, optimizer, layer.x, layer.grad_seed)


def timed(steps: dict[str, Callable[[], None]], calls: int, repeats: int, device: str) -> dict[str, float]:
    """Median ms per step of each of ``steps``, samples of ``calls`` steps back to back, every rank starting each
    sample together."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            common.synchronize(device)
            dist.barrier()
            samples[name].append(common.back_to_back_ms(step, calls, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def replicas_equal(module: torch.nn.Module) -> bool:
    """Every parameter equal on every rank."""
    for p in module.parameters():
        gathered = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, p.detach().contiguous())
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            return False
    return True


def measure(shape: harness.Shape, mode: common.Mode, args: argparse.Namespace, device: str) -> dict[str, Any]:
    ours, ref = make_layers(shape, mode, device, args.seed, activation="relu")
    single = {"ours": ours, "torch": ref}
    ddp = {side: data_parallel(layer) for side, layer in single.items()}
    steps = {f"{side}_single": layer.step for side, layer in single.items()}
    steps.update({f"{side}_ddp": layer.step for side, layer in ddp.items()})
    for step in steps.values():  # warm-up: plans, cuDNN autotuning, DDP's buckets
        for _ in range(args.warmup):
            step()
    times = timed(steps, args.calls, args.repeats, device)
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, times)
    row: dict[str, Any] = {"mode": mode.name, "label": shape.label, "per_rank": gathered}
    for side in SIDES:
        row[f"{side}_single_ms"] = times[f"{side}_single"]
        row[f"{side}_ddp_ms"] = times[f"{side}_ddp"]
        row[f"{side}_efficiency"] = times[f"{side}_single"] / times[f"{side}_ddp"]
        row[f"{side}_replicas_equal"] = replicas_equal(ddp[side].module)
    row["ddp_speedup"] = times["torch_ddp"] / times["ours_ddp"]
    return row


def worker(rank: int, args: argparse.Namespace, init_file: str, result_file: str) -> None:
    device = "cuda" if args.device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=args.world)
    try:
        rows = []
        for mode_name in args.modes:
            mode = common.modes()[mode_name]
            for shape in shapes(args.shapes, args.quick):
                with common.mode_flags(mode, cudnn_benchmark=True):
                    try:
                        row = {**measure(shape, mode, args, device), "status": "ok"}
                    except Exception as error:  # noqa: BLE001 - recorded; the other rows still run
                        row = {"mode": mode_name, "label": shape.label, "status": "error",
                               "error": common.short_error(error)}
                rows.append(row)
                if rank == 0:
                    print(
                        f"{mode_name:4s} {shape.label:30s} {row['status']}: efficiency ours "
                        f"{common.fmt(row.get('ours_efficiency'))}, nn {common.fmt(row.get('torch_efficiency'))}; "
                        f"DDP step ours vs nn {common.fmt(row.get('ddp_speedup'))}x",
                        flush=True,
                    )
                common.free_memory(device)
        if rank == 0:
            Path(result_file).write_text(json.dumps(common.to_jsonable(rows)))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--modes", nargs="+", default=["bf16", "tf32", "fp32"], help="bf16 tf32 fp32 fp16")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="labels from the activation suite")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke test)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="steps back to back per sample")
    parser.add_argument("--repeats", type=int, default=5, help="samples per variant, variants interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    try:
        args.modes = harness.mode_list(args.modes)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if args.world < 2:
        parser.error("--world must be >= 2")
    shapes(args.shapes, args.quick)  # unknown labels: refused here, before any process starts
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"bench_ddp: needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the device machines ask for NVLink multicast off
    with tempfile.TemporaryDirectory() as scratch:
        result_file = os.path.join(scratch, "rows")
        mp.spawn(worker, args=(args, os.path.join(scratch, "init"), result_file), nprocs=args.world)
        rows = json.loads(Path(result_file).read_text())
    results = {"environment": common.environment(), "config": vars(args), "rows": rows}
    for side in SIDES:
        measured = [r[f"{side}_efficiency"] for r in rows if r["status"] == "ok"]
        results[f"{side}_efficiency_min"] = min(measured, default=None)
    results["ddp_speedup_geomean"] = common.geomean(r.get("ddp_speedup") for r in rows if r["status"] == "ok")
    path = common.write_json(results, args.out, NAME)
    print(f"results: {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

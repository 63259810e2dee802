"""Memory under many shapes: ``--calls`` (10,000 by default) forward + param_grad calls over a pool of varied
problems (more keys than the plan cache holds, with ``--cache-size``), recording every ``--every`` calls the plan
cache's size and evictions, the device's allocated and reserved memory and the process's resident memory.

The verdict: bounded — the cache never holds more than its capacity per kind of plan, and the allocated memory
and the process's peak resident memory after the warm-up window stay within ``--tolerance-mib`` of their level there
(no growth with the number of calls). The resident memory's growth over the last half is recorded beside it: a
growth that levels off (memory per distinct problem, e.g. cuDNN's runtime-compiled kernels) shows there as ~0.
A measurement for the record, not a timed test. Run from the repository root::

    TORCH_CONVBIAS_CACHE_SIZE=64 python -m bench.stress_memory --out bench/results    # GPU
    python -m bench.stress_memory --device cpu --calls 200 --every 50                # smoke run
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import torch_convbias

from .common import environment, write_json

NAME = "stress_memory"
SCHEMA = "torch_convbias.stress_memory/1"


def problem_pool(size: int, device: str, seed: int) -> list[dict[str, Any]]:
    """``size`` distinct problems: batch, channels, spatial size, kernel, stride, dtype and layout drawn at random."""
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]
    pool, seen = [], set()
    while len(pool) < size:
        spec = (
            rng.choice([1, 2, 4, 8]), rng.choice([8, 16, 24, 32]), rng.choice([7, 8, 12, 14, 16]),
            rng.choice([8, 16, 32]), rng.choice([1, 3]), rng.choice([1, 2]), rng.choice(dtypes),
            rng.choice([torch.channels_last, torch.contiguous_format]),
        )  # fmt: skip
        if spec not in seen:
            seen.add(spec)
            n, c, hw, k, r, s, dtype, fmt = spec
            pool.append({"n": n, "c": c, "hw": hw, "k": k, "kernel": r, "stride": s, "dtype": dtype, "format": fmt})
    return pool


def run_call(p: dict[str, Any], device: str) -> None:
    """One forward and one param_grad of problem ``p`` on fresh tensors (as a training loop allocates them)."""
    fmt, dtype, pad = p["format"], p["dtype"], p["kernel"] // 2
    x = torch.randn(p["n"], p["c"], p["hw"], p["hw"], device=device, dtype=dtype).contiguous(memory_format=fmt)
    w = torch.randn(p["k"], p["c"], p["kernel"], p["kernel"], device=device, dtype=dtype).contiguous(memory_format=fmt)
    b = torch.randn(p["k"], device=device, dtype=dtype)
    stride, padding = [p["stride"]] * 2, [pad, pad]
    out = torch.ops.convbias.forward(x, w, b, stride, padding, [1, 1], 1)
    torch.ops.convbias.param_grad(torch.ones_like(out), x, w, stride, padding, [1, 1], 1, [True, True])


def sample(calls: int, started: float, device: str) -> dict[str, Any]:
    info = torch_convbias.cache_info()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    return {
        "calls": calls,
        "seconds": time.perf_counter() - started,
        "cache_size": info["size"],
        "cache_evictions": info["evictions"],
        "cache_misses": info["misses"],
        "allocated_mib": torch.cuda.memory_allocated() / 2**20 if cuda else None,
        "reserved_mib": torch.cuda.memory_reserved() / 2**20 if cuda else None,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def verdict(samples: Sequence[dict[str, Any]], capacity: int, tolerance_mib: float) -> dict[str, Any]:
    """Bounded cache (size never above capacity per kind: forward, weight-gradient and bias-gradient plans), and
    allocated memory and peak RSS flat after the first quarter of the run."""
    kinds = 3
    cache_bounded = all(s["cache_size"] <= kinds * capacity for s in samples)
    settled = samples[len(samples) // 4 :]
    allocated = [s["allocated_mib"] for s in settled if s["allocated_mib"] is not None]
    growth = (max(allocated) - allocated[0]) if allocated else None
    rss_growth = settled[-1]["max_rss_mib"] - settled[0]["max_rss_mib"] if settled else None
    return {
        "cache_capacity_per_kind": capacity,
        "cache_bounded": cache_bounded,
        "allocated_growth_mib": growth,
        "allocated_bounded": None if growth is None else growth <= tolerance_mib,
        "rss_growth_mib": rss_growth,
        "rss_bounded": None if rss_growth is None else rss_growth <= tolerance_mib,
        "rss_growth_last_half_mib": samples[-1]["max_rss_mib"] - samples[len(samples) // 2]["max_rss_mib"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=500, help="calls between samples")
    parser.add_argument("--pool", type=int, default=300, help="distinct problems drawn from")
    parser.add_argument("--tolerance-mib", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for the JSON (default: bench/results)")
    args = parser.parse_args(argv)

    pool = problem_pool(args.pool, args.device, args.seed)
    rng = random.Random(args.seed)
    torch_convbias.cache_clear()
    capacity = int(os.environ.get("TORCH_CONVBIAS_CACHE_SIZE", "1000"))
    started = time.perf_counter()
    samples = [sample(0, started, args.device)]
    for call in range(1, args.calls + 1):
        run_call(rng.choice(pool), args.device)
        if call % args.every == 0 or call == args.calls:
            samples.append(sample(call, started, args.device))
            last = samples[-1]
            print(
                f"{call:>6} calls  cache {last['cache_size']:>4} (evictions {last['cache_evictions']})  "
                f"allocated {last['allocated_mib']} MiB  reserved {last['reserved_mib']} MiB  "
                f"max rss {last['max_rss_mib']:.0f} MiB"
            )
    results = {
        "schema": SCHEMA,
        "environment": environment(),
        "config": {**vars(args), "cache_size_env": os.environ.get("TORCH_CONVBIAS_CACHE_SIZE"),
                   "autotune_env": os.environ.get("TORCH_CONVBIAS_AUTOTUNE")},
        "samples": samples,
        "verdict": verdict(samples, capacity, args.tolerance_mib),
    }
    path = write_json(results, args.out, NAME)
    print(f"verdict: {results['verdict']}\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

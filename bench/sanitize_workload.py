"""A small workload for NVIDIA's compute-sanitizer: every kernel of ours and every kind of cuDNN graph we build
(fused forward, conv-only, NCHW, weight gradient, bias-gradient kernel in each dtype and launch configuration,
plans loaded from a persistent cache), from several threads at once, each result checked against ATen.

Run on the GPU machine (``./dev.sh gpu OUT sanitize`` runs it under memcheck, racecheck and synccheck)::

    compute-sanitizer --tool memcheck --target-processes all python3 -m bench.sanitize_workload
    compute-sanitizer --tool racecheck --kernel-name kns=column_partial_sums python3 -m bench.sanitize_workload --quick

Exits non-zero when a result is wrong; the sanitizer's own exit code says whether it found an error.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import torch_convbias

# (N, C, K, HW, kernel, stride, dtype, channels_last, bias): small, so that the sanitizer's slowdown (10-100x)
# keeps the run to minutes, and varied, so that each code path runs.
PROBLEMS = [
    (2, 16, 32, 9, 3, 1, torch.float32, True, True),
    (3, 8, 16, 7, 1, 2, torch.bfloat16, True, True),
    (2, 16, 16, 8, 3, 1, torch.float16, True, False),
    (2, 8, 24, 6, 3, 1, torch.float32, False, True),
    (1, 3, 16, 12, 5, 2, torch.bfloat16, True, True),
    (4, 32, 48, 5, 3, 1, torch.float16, True, True),
]
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def check(problem: tuple, seed: int) -> list[str]:
    """Forward and param_grad of `problem` against ATen in float32; the failures, as messages."""
    n, c, k, hw, r, s, dtype, channels_last, has_bias = problem
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(k, c, r, r, device="cuda", generator=g) / (c * r * r) ** 0.5).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(k, device="cuda", generator=g).to(dtype) if has_bias else None
    pad = r // 2
    y = torch.ops.convbias.forward(x, w, b, [s, s], [pad, pad], [1, 1], 1)
    dy = torch.randn(y.shape, device="cuda", generator=g).to(dtype)
    gw, gb = torch.ops.convbias.param_grad(dy, x, w, [s, s], [pad, pad], [1, 1], 1, [True, has_bias])
    ref = F.conv2d(x.float(), w.float(), None if b is None else b.float(), stride=s, padding=pad)
    _, ref_w, ref_b = torch.ops.aten.convolution_backward(
        dy.float(), x.float(), w.float(), [k], [s, s], [pad, pad], [1, 1], False, [0, 0], 1, [False, True, has_bias]
    )
    failures = []
    for name, got, want in (("output", y, ref), ("grad_weight", gw, ref_w), ("grad_bias", gb, ref_b)):
        if want is None:
            continue
        error = ((got.float() - want).abs().max() / max(1.0, want.abs().max().item())).item()
        if not error <= TOLERANCE[dtype]:
            failures.append(f"{problem} {name}: relative error {error:.2e}")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="calls of every problem per thread")
    parser.add_argument("--quick", action="store_true", help="one thread, one round (racecheck is slow)")
    args = parser.parse_args(argv)
    threads, rounds = (1, 1) if args.quick else (args.threads, args.rounds)
    torch.backends.cudnn.allow_tf32 = False
    failures: list[str] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        for round_ in range(rounds):
            for i, problem in enumerate(PROBLEMS):
                found = check(problem, seed=1000 * t + 10 * round_ + i)
                with lock:
                    failures.extend(found)

    # Plans are built by the first thread that misses (the others wait on nothing: they build too, first insert
    # wins), so building, timing and executing overlap across threads as in a data-parallel host program.
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    torch.cuda.synchronize()
    calls = threads * rounds * len(PROBLEMS)
    print(f"sanitize_workload: {calls} forward + param_grad calls, {len(failures)} wrong; cache {torch_convbias.cache_info()}")
    for failure in failures[:10]:
        print("  " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole models: torchvision VGG-11, AlexNet and ResNet-50 (random weights, channels_last), a training step and
inference, nn.Conv2d eager and compiled against ours.

Variants, each on its own copy of one randomly initialised model, measured in one process, interleaved:

* ``nn_eager``            the torchvision model as it is;
* ``nn_compiled``         ``torch.compile(model)`` (Inductor, default mode);
* ``nn_frozen``           inference only: ``torch.compile(model)`` compiled and called with Inductor's freezing on
                          (``torch._inductor.config.freezing = True``: parameters become constants, batch norms and
                          constants are folded, as a deployment would). Not ``options={"freezing": True}``: Dynamo
                          decides at trace time, from the global setting, whether parameters may become constants, so
                          that option alone freezes nothing (measured before 2026-12-05: nn_frozen equal to
                          nn_compiled);
* ``ours_eager``          ``torch_convbias.convert(model)`` run eagerly;
* ``ours_backend``        ``torch.compile(model, backend="convbias")``: the unmodified model rewritten into our ops,
                          then Inductor.
* ``ours_backend_frozen``  inference only: the backend under the same freezing (its folded batch norms become
                          constants too): like with like against ``nn_frozen``;
* ``ours_backend_kernel_bwd`` training, with ``--activation-backward-variant`` only: the backend with
                          ``convbias.activation_backward="ours"`` (every activation backward on our kernel, none
                          fused by Inductor with the max-pool backward before it): what that pass is worth.

A training step is forward, cross-entropy loss, backward and an SGD step (foreach); inference is a forward under
``torch.inference_mode()``. Per variant: ``gpu_ms``, the GPU kernel time of one step (profiler sums, the work
itself: a compiled step of a small model measures the host otherwise), and ``step_ms``, steps queued back to back
(the rate a loop gets). Ratios are the strongest nn side over ours (> 1: ours is faster), on GPU time.
``gpu_kernels``: per variant, the kernels that take most of that time (ms per step), and ``gpu_kernel_groups`` all
of it by kind (our kernels, convolution fprop / dgrad / wgrad, GEMMs, Inductor's Triton, ATen's), to see where the
sides differ;
``backward_fusion``: how many activation backwards the backend handed to Inductor, merged with our input gradient
(``merged_paths``: per merged pair, whether _input_grad_activation ran the cuDNN graph or the two steps, with both
times; the graph is tried under TORCH_CONVBIAS_INPUT_GRAD=timed, the default) and kept on our kernel;
``layers``: per convolution the backend rewrote (its last graph), how the op ran it (explain: path, engine, activation
and residual in the graph or not, padded channels; for training the weight gradient's path and engine).

Numerics: each variant's logits (first call, before any parameter update, eval mode) against the nn model run in
float64 on the same input: relative RMS error, passing when within twice nn eager's own error plus the mode's
rounding bound. Inference rows check every variant; training rows the eager ones (a compiled variant would compile
once more for it), the backend's rewrite being checked by the inference rows and by tests/test_compiler.py.

Defaults: VGG-11 and AlexNet train and infer, ResNet-50 infer (its targets are for inference); each row compiles its
variants anew (Inductor: tens of seconds per model on the H200), so a device call runs one model at a time, e.g.
``--models vgg11``.

``python -m bench.bench_models`` (GPU; torchvision needed) writes ``bench/results/models-<gpu>.json``;
``--device cpu --models tiny`` is a smoke test of the script (a small built-in CNN, no torchvision).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_convbias
from bench import common
from torch_convbias import _validation

TRAIN_VARIANTS = ("nn_eager", "nn_compiled", "ours_eager", "ours_backend")
INFER_VARIANTS = ("nn_eager", "nn_compiled", "nn_frozen", "ours_eager", "ours_backend", "ours_backend_frozen")
# (batch for training, batch for inference, image side): GPU-bound on the H200 in every mode.
MODELS: dict[str, tuple[int, int, int]] = {
    "vgg11": (128, 256, 224),
    "alexnet": (512, 1024, 224),
    "resnet50": (128, 256, 224),
    "tiny": (4, 4, 32),
}
# (model, phase) pairs left out unless --all-phases: no target, and minutes of compilation.
SKIPPED_BY_DEFAULT = {("resnet50", "train")}
# Targets of issue 14 (GPU time): headline = the faster nn compiled variant / ours_backend.
TARGETS: dict[tuple[str, str], dict[str, float]] = {
    ("vgg11", "train"): {"bf16": 1.12, "tf32": 1.06, "fp32": 1.10},
    ("alexnet", "train"): {"bf16": 1.12, "tf32": 1.06, "fp32": 1.10},
    ("vgg11", "infer"): {"bf16": 1.35, "tf32": 1.25},
    ("alexnet", "infer"): {"bf16": 1.35, "tf32": 1.25},
    ("resnet50", "infer"): {"bf16": 1.15},
}


def tiny() -> nn.Module:
    """A small VGG-like CNN with batch norm and a residual-free stack (CPU smoke tests; no torchvision)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.GELU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def build(name: str) -> nn.Module:
    if name == "tiny":
        return tiny()
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


class Frozen:
    """A compiled model called with Inductor's freezing on (``torch._inductor.config.freezing``), as it must be set
    when Dynamo traces (the first call, grad disabled) for parameters to become constants, and when Inductor compiles.
    ``_orig_mod`` is the compiled model's, so that the helpers below find its module."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self._orig_mod = compiled._orig_mod

    def __call__(self, *args: Any) -> Any:
        with torch._inductor.config.patch(freezing=True):
            return self.compiled(*args)


# Kernels recorded per variant in a row's gpu_kernels (the largest; the rest summed under "other"): a VGG-11 step runs
# about thirty distinct kernels, and a dozen left a third of the difference between the sides under "other".
TOP_KERNELS = 30


def variants(
    model: nn.Module, phase: str, device: str, kernel_bwd_variant: bool = False, skip: Sequence[str] = ()
) -> dict[str, nn.Module | Callable[..., Any]]:
    """Each variant's callable, on its own deep copy of ``model``, but those in ``skip`` (never nn_eager or
    ours_backend: the numerics' bound and the headline). On the CPU the backend also rewrites CPU convolutions (the
    op's reference path) so that the script's logic runs end to end."""
    options = {"convbias.devices": ("cpu", "cuda")} if device == "cpu" else {}
    out: dict[str, nn.Module | Callable[..., Any]] = {
        "nn_eager": copy.deepcopy(model),
        "nn_compiled": torch.compile(copy.deepcopy(model)),
        "ours_eager": torch_convbias.convert(copy.deepcopy(model)),
        "ours_backend": torch.compile(copy.deepcopy(model), backend="convbias", options=options or None),
    }
    if phase == "infer":
        out["nn_frozen"] = Frozen(torch.compile(copy.deepcopy(model)))
        out["ours_backend_frozen"] = Frozen(torch.compile(copy.deepcopy(model), backend="convbias", options=options or None))
    names = [name for name in (TRAIN_VARIANTS if phase == "train" else INFER_VARIANTS) if name not in skip]
    if kernel_bwd_variant and phase == "train":
        kept = {**options, "convbias.activation_backward": "ours"}
        out["ours_backend_kernel_bwd"] = torch.compile(copy.deepcopy(model), backend="convbias", options=kept)
        names.append("ours_backend_kernel_bwd")
    return {name: out[name] for name in names}


# Kernel groups of a row's gpu_kernel_groups: the first group whose words a kernel's name contains (lower case).
# Inductor's Triton kernels come before the convolutions: their names spell the ATen ops they fused
# ("triton_poi_fused_convolution_relu_0" is nn_compiled's bias + ReLU, not a convolution; rows measured before
# 2026-12-05 counted those under conv_fprop). cuDNN's runtime-compiled kernels spell the direction differently
# ("cudnn_generated_fort_native_sm90_convBwdData_pointwise_..."): rows before 2026-12-06 counted those as conv_fprop.
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ours", ("convbias",)),
    ("inductor", ("triton",)),
    ("conv_dgrad", ("dgrad", "convbwddata")),
    ("conv_wgrad", ("wgrad", "convbwdfilter")),
    ("conv_fprop", ("fprop", "conv", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cublas", "cutlass")),
    ("aten", ("at::native", "at::", "elementwise", "reduce")),
)


def kernel_groups(kernels: dict[str, float] | None, calls: int) -> dict[str, float] | None:
    """GPU time per step (ms) of a profile's kernels by what they do (KERNEL_GROUPS; the rest as "other"): where two
    variants differ, at a glance."""
    if kernels is None:
        return None
    groups: dict[str, float] = {}
    for name, ms in kernels.items():
        lower = name.lower()
        group = next((g for g, words in KERNEL_GROUPS if any(w in lower for w in words)), "other")
        groups[group] = groups.get(group, 0.0) + ms / calls
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


def top_kernels(kernels: dict[str, float] | None, calls: int) -> dict[str, float] | None:
    """The largest kernels of a profile (ms per step), the rest summed as "other"."""
    if kernels is None:
        return None
    items = list(kernels.items())  # largest first
    top = {name[:160]: ms / calls for name, ms in items[:TOP_KERNELS]}
    rest = sum(ms for _, ms in items[TOP_KERNELS:])
    if rest:
        top["other"] = rest / calls
    return top


def layer_paths(records: Sequence[dict[str, Any]], phase: str, dtype: torch.dtype, device: str) -> list[dict[str, Any]]:
    """How the op ran each convolution the backend rewrote: explain() (and for training explain_param_grad()) on
    tensors of the layer's shapes, under the row's flags, so that the plans are the ones the timed steps used (cached:
    true where the key matched). Per layer: the problem, the forward's path, engine, whether the activation (and
    residual) ran in the graph, the padded channel count, and for training the weight gradient's path and engine."""
    layers = []
    cl = torch.channels_last
    for record in records:
        layer: dict[str, Any] = {
            "node": record["node"], "input": record.get("input_shape"), "weight": record.get("weight_shape"),
            "activation": record["activation"], "residual": record["residual"],
        }  # fmt: skip
        if record.get("input_shape") is None or record.get("weight_shape") is None:
            layer["error"] = "dynamic shapes"
            layers.append(layer)
            continue
        x = torch.randn(record["input_shape"], device=device, dtype=dtype).contiguous(memory_format=cl)
        w = torch.randn(record["weight_shape"], device=device, dtype=dtype).contiguous(memory_format=cl)
        b = torch.randn(record["weight_shape"][0], device=device, dtype=dtype) if record["bias"] else None
        conv = {k: record[k] for k in ("stride", "padding", "dilation", "groups")}
        out_shape = _validation.output_size(x, w, record["stride"], record["padding"], record["dilation"])
        residual = torch.randn(out_shape, device=device, dtype=dtype).contiguous(memory_format=cl) if record["residual"] else None
        try:
            info = torch_convbias.explain(
                x, w, b, **conv, activation=record["activation"], negative_slope=record["slope"], residual=residual,
                for_backward=phase == "train" and residual is None,
            )  # fmt: skip
            layer.update({
                "path": info.get("path"), "engine": (info.get("engine") or {}).get("name"), "cached": info.get("cached"),
                "activation_fused": (info.get("activation") or {}).get("fused"),
                "residual_fused": (info.get("residual") or {}).get("fused"),
                "padded_channels": info.get("padded_channels"), "space_to_depth": info.get("space_to_depth"),
                "layout_timings": info.get("layout_timings"),
            })  # fmt: skip
            if phase == "train":
                dy = torch.randn(out_shape, device=device, dtype=dtype).contiguous(memory_format=cl)
                grad = torch_convbias.explain_param_grad(dy, x, w, **conv)["weight_grad"]
                layer.update({"weight_grad_path": grad.get("path"), "weight_grad_engine": (grad.get("engine") or {}).get("name")})
        except Exception as error:  # noqa: BLE001 - recorded: a diagnostic, not the measurement
            layer["error"] = common.short_error(error)
        layers.append(layer)
    return layers


def merged_paths(entries: Sequence[dict[str, Any]], dtype: torch.dtype, device: str) -> list[dict[str, Any]]:
    """How convbias._input_grad_activation ran each input gradient + activation backward the backend merged (the
    backward report's ``merged`` entries): explain_input_grad_activation on tensors of the recorded shapes, under the
    row's flags and knobs (TORCH_CONVBIAS_INPUT_GRAD), so that the plans are the ones the timed steps used. Per pair:
    the shapes, the path (``cudnn graph`` or ``separate``), both ways' times, the engine and the notes."""
    paths = []
    cl = torch.channels_last
    for entry in entries:
        problem = entry.get("problem")
        path: dict[str, Any] = {"node": entry["node"], "activation": entry["activation"]}
        if problem is None:
            path["error"] = "dynamic shapes"
            paths.append(path)
            continue
        path.update({"input": problem["input"], "weight": problem["weight"]})
        dy, x, w, saved = (
            torch.randn(problem[key], device=device, dtype=dtype).contiguous(memory_format=cl)
            for key in ("grad_output", "input", "weight", "input")
        )
        try:
            info = torch_convbias.explain_input_grad_activation(
                dy, x, w, saved, entry["activation"], problem["negative_slope"],
                **{k: problem[k] for k in ("stride", "padding", "dilation", "groups")},
            )  # fmt: skip
            path.update({
                "path": info.get("path"), "graph_ms": info.get("graph_ms"), "separate_ms": info.get("separate_ms"),
                "engine": (info.get("engine") or {}).get("name"), "cached": info.get("cached"), "notes": info.get("notes"),
            })  # fmt: skip
        except Exception as error:  # noqa: BLE001 - recorded: a diagnostic, not the measurement
            path["error"] = common.short_error(error)
        paths.append(path)
    return paths


def parameters_of(fn: nn.Module | Callable[..., Any]) -> list[nn.Parameter]:
    module = getattr(fn, "_orig_mod", fn)
    return list(module.parameters()) if isinstance(module, nn.Module) else []


def make_step(fn: nn.Module | Callable[..., Any], phase: str, x: torch.Tensor, target: torch.Tensor) -> Callable[[], Any]:
    if phase == "infer":

        def infer() -> torch.Tensor:
            with torch.inference_mode():
                return fn(x)

        return infer
    optimizer = torch.optim.SGD(parameters_of(fn), lr=1e-3, foreach=True)

    def train() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fn(x).float(), target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return train


def numerics(fns: dict[str, Any], reference: nn.Module, x: torch.Tensor, mode: common.Mode) -> dict[str, Any]:
    """Each variant's first logits against float64 (see the module docstring), every model in eval mode (dropout
    off, batch norm on its running statistics) so that all compute the same function."""
    with torch.inference_mode():
        expected = reference.double().eval()(x.double())
        errors = {}
        for name, fn in fns.items():
            module = getattr(fn, "_orig_mod", fn)
            was_training = module.training
            module.eval()
            try:
                check = common.check_against_float64(fn(x), expected, mode)
            finally:
                module.train(was_training)
            errors[name] = check.get("rel_rms_error")
    bound = None if errors.get("nn_eager") is None else 2 * errors["nn_eager"] + mode.rel_rms
    passed = {name: (e is not None and bound is not None and e <= bound) for name, e in errors.items()}
    return {"rel_rms_error": errors, "bound": bound, "passed": all(passed.values()), "by_variant": passed}


def measure(name: str, phase: str, mode: common.Mode, args: argparse.Namespace) -> dict[str, Any]:
    train_batch, infer_batch, side = MODELS[name]
    batch = train_batch if phase == "train" else infer_batch
    if args.device == "cpu":
        batch, side = 2, min(side, 32)
    # Every variant compiles the same forward code objects (the model class's, nn.Sequential's): without a reset per
    # row, Dynamo's recompile limit would leave later rows' compiled variants silently running eagerly.
    torch._dynamo.reset()
    torch_convbias.compiler.reports.clear()
    torch_convbias.compiler.backward_reports.clear()
    torch.manual_seed(args.seed)
    model = build(name).to(device=args.device, dtype=mode.dtype, memory_format=torch.channels_last)
    if phase == "infer":
        model.eval()
    x = torch.randn(batch, 3, side, side, device=args.device, dtype=mode.dtype).contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (batch,), device=args.device)
    fns = variants(model, phase, args.device, args.activation_backward_variant, args.skip)
    row: dict[str, Any] = {"model": name, "phase": phase, "mode": mode.name, "batch": batch, "side": side}
    # Inductor's caches off: every variant compiles here, so that the backend's pass reports what it did (a graph from
    # the cache would skip it); the timings do not depend on it.
    with (
        common.mode_flags(mode, cudnn_benchmark=True),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        # Training rows check the eager variants only: checking a compiled one there would compile it once more (eval
        # mode, no gradients); the inference rows check the compiled graphs, rewritten the same way.
        checked = fns if phase == "infer" else {v: fns[v] for v in ("nn_eager", "ours_eager") if v in fns}
        row["numerics"] = numerics(checked, copy.deepcopy(model), x, mode)
        steps = {variant: make_step(fn, phase, x, target) for variant, fn in fns.items()}
        for step in steps.values():  # compile, autotune, warm
            for _ in range(args.warmup):
                step()
        rates = common.time_back_to_back(steps, args.calls, args.repeats, args.device)
        kernels = {variant: common.gpu_kernels([step] * args.calls, args.device) for variant, step in steps.items()}
        reports = list(torch_convbias.compiler.reports)
        # Under the same flags, after the timings: explain's lookups find the plans the steps made.
        row["layers"] = layer_paths(reports[-1].rewrites, phase, mode.dtype, args.device) if reports else None
        backward = list(torch_convbias.compiler.backward_reports)
        merged = merged_paths(backward[-1].merged, mode.dtype, args.device) if backward else None
    row["step_ms"] = {v: rates[v]["median_ms"] for v in steps}
    row["gpu_ms"] = {v: (sum(k.values()) / args.calls if k is not None else None) for v, k in kernels.items()}
    row["gpu_kernels"] = {v: top_kernels(k, args.calls) for v, k in kernels.items()}
    row["gpu_kernel_groups"] = {v: kernel_groups(k, args.calls) for v, k in kernels.items()}
    row["rewrites"] = reports[-1].count() if reports else None
    # What the backend's last graph holds: convolutions rewritten with an activation, a folded batch norm, a residual
    # add, and the candidates it left alone (why a row's figure is what it is).
    last = reports[-1] if reports else None
    row["rewrite_details"] = None if last is None else {
        "with_activation": last.count() - last.count(activation="identity"),
        "batchnorm_folded": last.count(batchnorm=True),
        "residual": last.count(residual=True),
        "skipped": last.skipped,
    }

    def over_ours(key: str, nn_side: Sequence[str], ours_side: str = "ours_backend") -> float | None:
        """The fastest of ``nn_side`` over ``ours_side`` (None where a side was not measured)."""
        ours = row[key].get(ours_side)
        theirs = [row[key][v] for v in nn_side if row[key].get(v)]
        return min(theirs) / ours if ours and theirs else None

    compiled = ("nn_compiled", "nn_frozen") if phase == "infer" else ("nn_compiled",)
    # The headline: the backend without freezing against the faster of nn compiled with and without it.
    row["backend_vs_nn_compiled_gpu"] = over_ours("gpu_ms", compiled)
    row["backend_vs_nn_compiled_rate"] = over_ours("step_ms", compiled)
    row["backend_vs_nn_eager_gpu"] = over_ours("gpu_ms", ("nn_eager",))
    # Freezing on both sides.
    row["backend_frozen_vs_nn_frozen_gpu"] = over_ours("gpu_ms", ("nn_frozen",), "ours_backend_frozen")
    row["ours_eager_vs_nn_eager_gpu"] = over_ours("gpu_ms", ("nn_eager",), "ours_eager")
    # The backward pass's worth: the backend with every activation backward on our kernel over the default.
    row["backward_fusion_gain_gpu"] = over_ours("gpu_ms", ("ours_backend_kernel_bwd",))
    row["backward_fusion"] = (
        {
            "handed": len(backward[-1].handed), "kept": len(backward[-1].kept),
            "kept_why": [e["reason"] for e in backward[-1].kept],
            "merged": len(backward[-1].merged), "merged_paths": merged,
        }  # fmt: skip
        if backward
        else None
    )
    goal = TARGETS.get((name, phase), {}).get(mode.name)
    headline = row["backend_vs_nn_compiled_gpu"]
    row["target"] = goal
    row["target_pass"] = None if goal is None or headline is None else headline >= goal
    return row


def main(argv: Sequence[str] | None = None) -> int:
    # A row compiles up to four variants of one model, each possibly in two grad modes: room for all of them.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    parser = argparse.ArgumentParser(prog="python -m bench.bench_models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["vgg11", "alexnet", "resnet50"])
    parser.add_argument("--phases", type=lambda s: s.split(","), default=["train", "infer"])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["bf16", "tf32", "fp32"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="steps queued back to back per sample (and profiled)")
    parser.add_argument("--repeats", type=int, default=5, help="samples per variant, variants interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-phases", action="store_true", help="also ResNet-50 training (no target; slow to compile)")
    parser.add_argument(
        "--activation-backward-variant",
        action="store_true",
        help="training rows also measure the backend with convbias.activation_backward='ours' (one more compile)",
    )
    parser.add_argument(
        "--skip",
        type=lambda s: s.split(","),
        default=[],
        help="variants not to measure, e.g. ours_backend_frozen,ours_eager (each compiled variant costs tens of seconds)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    required = {"nn_eager", "ours_backend"} & set(args.skip)
    if required or set(args.skip) - {*TRAIN_VARIANTS, *INFER_VARIANTS}:
        parser.error(f"--skip: expected variants other than nn_eager and ours_backend, got {args.skip}")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}")
    results: dict[str, Any] = {"environment": common.environment(), "config": vars(args), "rows": []}
    for name in args.models:
        for phase in args.phases:
            if (name, phase) in SKIPPED_BY_DEFAULT and not args.all_phases:
                continue
            for mode_name in args.modes:
                mode = common.modes()[mode_name]
                try:
                    row = measure(name, phase, mode, args)
                    row["status"] = "ok"
                except Exception as error:  # noqa: BLE001 - recorded; the other rows still run
                    row = {"model": name, "phase": phase, "mode": mode_name, "status": "failed", "error": common.short_error(error)}
                results["rows"].append(row)
                common.write_json(results, args.out, "models")
                print(
                    f"{name:9s} {phase:5s} {mode_name:4s} {row['status']:6s} "
                    f"backend/nn_compiled (GPU) {common.fmt(row.get('backend_vs_nn_compiled_gpu'))}x "
                    f"(rate {common.fmt(row.get('backend_vs_nn_compiled_rate'))}x), "
                    f"ours eager/nn eager {common.fmt(row.get('ours_eager_vs_nn_eager_gpu'))}x, "
                    f"target {row.get('target')} {common.verdict(row.get('target_pass'))}, "
                    f"numerics {common.verdict((row.get('numerics') or {}).get('passed'))}",
                    flush=True,
                )
                common.free_memory(args.device)
    path = common.write_json(results, args.out, "models")
    print(f"results: {path}")
    return 0 if all(r["status"] == "ok" for r in results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

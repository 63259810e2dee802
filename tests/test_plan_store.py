"""The persistent plan cache (TORCH_CONVBIAS_PLAN_CACHE_DIR): timed plans one process chooses are loaded by the next
instead of built, give the same engines and results, and files that are corrupted, truncated, made under other
knobs, or hold a graph of other shapes are never trusted: rejected (counted), rebuilt and rewritten. Untimed choices
are not written; files are private to the user; temporary files of dead writers are removed. Each step is its own
process, as in real use (TORCH_CONVBIAS_AUTOTUNE=quick: timed choices without cudnn.benchmark's full search)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cuda

ROOT = Path(__file__).resolve().parents[1]

# Forward and param_grad of a few problems (channels_last fp32 3x3, bf16 1x1, NCHW fp32, fp16 without bias), each
# checked against F.conv2d / autograd; prints the cache counters and each problem's engines as JSON.
SCRIPT = r"""
import json
import torch
import torch.nn.functional as F
import torch_convbias

torch.backends.cudnn.allow_tf32 = False
cl, nchw = torch.channels_last, torch.contiguous_format
PROBLEMS = [
    (8, 32, 64, 16, 3, torch.float32, cl, True),
    (16, 64, 64, 8, 1, torch.bfloat16, cl, True),
    (4, 16, 32, 12, 3, torch.float32, nchw, True),
    (8, 32, 32, 10, 3, torch.float16, cl, False),
]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
rows = []
for n, c, k, hw, r, dtype, fmt, has_bias in PROBLEMS:
    g = torch.Generator(device="cuda").manual_seed(n * 1000 + c)
    x = torch.randn(n, c, hw, hw, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(k, c, r, r, device="cuda", generator=g) / (c * r * r) ** 0.5).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(k, device="cuda", generator=g).to(dtype) if has_bias else None
    pad = r // 2
    y = torch.ops.convbias.forward(x, w, b, [1, 1], [pad, pad], [1, 1], 1)
    ref = F.conv2d(x.float(), w.float(), None if b is None else b.float(), padding=pad)
    dy = torch.empty_like(y).normal_(generator=g)  # y's layout
    gw, gb = torch.ops.convbias.param_grad(dy, x, w, [1, 1], [pad, pad], [1, 1], 1, [True, has_bias])
    _, ref_w, ref_b = torch.ops.aten.convolution_backward(
        dy.float(), x.float(), w.float(), [k], [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [False, True, has_bias])
    errors = [((y.float() - ref).abs().max() / max(1.0, ref.abs().max())).item(),
              ((gw.float() - ref_w).abs().max() / max(1.0, ref_w.abs().max())).item()]
    if has_bias:
        errors.append(((gb.float() - ref_b).abs().max() / max(1.0, ref_b.abs().max())).item())
    fwd = torch_convbias.explain(x, w, b, padding=pad)
    grad = torch_convbias.explain_param_grad(dy, x, w, padding=pad)["weight_grad"]
    rows.append({
        "ok": max(errors) <= TOL[dtype], "errors": errors, "path": fwd["path"],
        "forward_engine": (fwd.get("engine") or {}).get("name"),
        "forward_from_disk": (fwd.get("engine") or {}).get("from_disk"),
        "weight_grad_engine": (grad.get("engine") or {}).get("name"),
        "weight_grad_from_disk": (grad.get("engine") or {}).get("from_disk"),
    })
print(json.dumps({"cache": torch_convbias.cache_info(), "rows": rows}))
"""


def run(directory: Path, bias_grad: str, script: str = SCRIPT, **knobs: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCH_CONVBIAS_PLAN_CACHE_DIR": str(directory),
        "TORCH_CONVBIAS_BIAS_GRAD": bias_grad,
        "TORCH_CONVBIAS_AUTOTUNE": "quick",
        **{f"TORCH_CONVBIAS_{name.upper()}": value for name, value in knobs.items()},
    }
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["stderr"] = result.stderr
    assert all(row["ok"] for row in report["rows"]), report["rows"]
    return report


def plan_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.plan"))


@cuda
@pytest.mark.parametrize("bias_grad", ["kernel", "cudnn"])
def test_plans_written_by_one_process_are_loaded_by_the_next(tmp_path: Path, bias_grad: str) -> None:
    built = run(tmp_path, bias_grad)
    first = built["cache"]
    assert first["disk_enabled"] and first["disk_hits"] == 0 and first["disk_rejected"] == 0, first
    files = plan_files(tmp_path)
    # A forward and a weight-gradient plan per problem at least (NCHW may add its channels_last plan).
    assert first["disk_writes"] == len(files) >= 8, (first, files)
    if bias_grad == "cudnn":
        assert any(f.name.startswith("bias_grad-") for f in files), files
    # One folder per GPU model and library versions.
    assert {f.parent.parent for f in files} == {tmp_path} and len({f.parent for f in files}) == 1, files

    # Every plan built was stored (all serialize on the H200).
    assert first["disk_writes"] == first["disk_misses"], first
    loaded = run(tmp_path, bias_grad)
    second = loaded["cache"]
    # Every plan the second process needs comes from disk: none built, none written, none rejected. (It may need
    # fewer than the first wrote: an NCHW problem whose stored choice is the NCHW graph no longer looks up the
    # channels_last plan the first process built to compare with.)
    assert second["disk_hits"] == second["misses"] >= len(built["rows"]), second
    assert second["disk_writes"] == 0 and second["disk_misses"] == 0 and second["disk_rejected"] == 0, second
    rows = loaded["rows"]
    assert all(r["forward_from_disk"] in (True, None) and r["weight_grad_from_disk"] in (True, None) for r in rows), rows
    # Loaded plans are the plans the first process chose.
    chosen = [(r["path"], r["forward_engine"], r["weight_grad_engine"]) for r in built["rows"]]
    assert [(r["path"], r["forward_engine"], r["weight_grad_engine"]) for r in rows] == chosen


@cuda
def test_corrupted_and_truncated_files_are_rejected_and_rewritten(tmp_path: Path) -> None:
    written = run(tmp_path, "kernel")["cache"]["disk_writes"]
    files = plan_files(tmp_path)
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2 == 0:
            data[-1] ^= 0xFF  # one flipped bit pattern in the plan's bytes
        else:
            data = data[: len(data) // 2]  # a write cut short
        path.write_bytes(bytes(data))
    damaged = run(tmp_path, "kernel")
    cache = damaged["cache"]
    # Every file looked up was damaged: each rejected, its plan rebuilt and the file rewritten.
    assert cache["disk_rejected"] == cache["misses"] == cache["disk_writes"] > 0 and cache["disk_hits"] == 0, cache
    assert cache["disk_rejected"] <= written, (cache, written)
    assert "checksum mismatch" in damaged["stderr"], damaged["stderr"][-2000:]
    # The rewritten files are good again.
    repaired = run(tmp_path, "kernel")["cache"]
    assert repaired["disk_hits"] == repaired["misses"] and repaired["disk_rejected"] == 0, repaired


@cuda
def test_unwritable_directory_warns_and_still_computes(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("in the way")
    report = run(not_a_directory, "kernel")
    assert report["cache"]["disk_writes"] == 0 and report["cache"]["disk_hits"] == 0, report["cache"]
    stderr = report["stderr"]
    assert "persistent plan cache" in stderr and "cannot create" in stderr and "plans are not stored" in stderr, stderr[-2000:]


@cuda
def test_untimed_choices_are_not_written(tmp_path: Path) -> None:
    """cudnn.benchmark off and TORCH_CONVBIAS_AUTOTUNE=auto (the default: heuristics, nothing timed): nothing to
    save a later process, and nothing a process that times should take for a measured choice."""
    report = run(tmp_path, "kernel", autotune="auto")
    cache = report["cache"]
    assert cache["disk_enabled"] and cache["disk_writes"] == 0 and cache["disk_hits"] == 0, cache
    assert plan_files(tmp_path) == []


@cuda
def test_records_made_under_other_knobs_are_not_used(tmp_path: Path) -> None:
    run(tmp_path, "kernel")
    other = run(tmp_path, "kernel", nchw="copy")
    cache = other["cache"]
    assert cache["disk_hits"] == 0 and cache["disk_rejected"] > 0, cache
    assert "knobs" in cache["disk_last_rejection"] and '"nchw":"copy"' in cache["disk_last_rejection"], cache


@cuda
def test_files_are_private_and_dead_writers_temporaries_removed(tmp_path: Path) -> None:
    run(tmp_path, "kernel")
    files = plan_files(tmp_path)
    folder = files[0].parent
    assert folder.stat().st_mode & 0o777 == 0o700, oct(folder.stat().st_mode)
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
    dead = folder / f"{files[0].name}.tmp.999999999.1"  # no process has this pid
    alive = folder / f"{files[0].name}.tmp.{os.getpid()}.1"  # this test's own process: being written
    dead.write_bytes(b"half a plan")
    alive.write_bytes(b"half a plan")
    run(tmp_path, "kernel")
    assert not dead.exists() and alive.exists()


def swap_records(target: Path, donor: Path) -> None:
    """`target`'s file with `donor`'s record (its plan and graph) in place of its own, checksum recomputed: a file
    whose envelope (environment, knobs, kind, key) fits one problem and whose plan was built for another. The CBOR
    object's keys are sorted: ... "record" <value> "timed" <value>."""
    magic = target.read_bytes()[:8]
    body_t, body_d = target.read_bytes()[16:], donor.read_bytes()[16:]
    record, timed = b"\x66record", b"\x65timed"
    start_t, start_d = body_t.index(record) + len(record), body_d.index(record) + len(record)
    rewrite_body(target, magic, body_t[:start_t] + body_d[start_d : body_d.rindex(timed)] + body_t[body_t.rindex(timed) :])


def rewrite_body(path: Path, magic: bytes, body: bytes) -> None:
    """`path` as magic, the FNV-1a checksum of `body`, `body`: a file the store's checksum accepts."""
    fnv = 0xCBF29CE484222325
    for byte in body:
        fnv = ((fnv ^ byte) * 0x100000001B3) % 2**64
    path.write_bytes(magic + fnv.to_bytes(8, "little") + body)


@cuda
def test_a_plan_built_for_other_shapes_is_rejected(tmp_path: Path) -> None:
    """The graph stored with a plan must have the problem's tensors: a file whose key fits but whose plan was built
    for other shapes (forged, or a key collision) is rejected and the plan rebuilt, with results still right."""
    run(tmp_path, "kernel")
    forward = sorted(plan_files(tmp_path), key=lambda f: f.stat().st_size)
    forward = [f for f in forward if f.name.startswith("forward-")]
    assert len(forward) >= 2, forward
    for target, donor in zip(forward, forward[1:] + forward[:1]):
        swap_records(target, donor)
    report = run(tmp_path, "kernel")
    cache = report["cache"]
    assert cache["disk_rejected"] >= 1, cache
    assert "the stored plan's tensor" in cache["disk_last_rejection"], cache


# Forward calls with activations (relu and leaky_relu of one shape, gelu in bf16, silu without bias, relu on NCHW
# tensors), each checked against F.conv2d + the activation; prints each problem's route as explain reports it.
ACTIVATION_SCRIPT = r"""
import json
import torch
import torch.nn.functional as F
import torch_convbias

torch.backends.cudnn.allow_tf32 = False
cl, nchw = torch.channels_last, torch.contiguous_format
PROBLEMS = [
    ("relu", 0.01, torch.float16, cl, True),
    ("leaky_relu", 0.2, torch.float16, cl, True),
    ("gelu", 0.01, torch.bfloat16, cl, True),
    ("silu", 0.01, torch.float16, cl, False),
    ("relu", 0.01, torch.float32, nchw, True),
]
SELECTED = None  # indices into PROBLEMS, or all
ACT = {"relu": lambda t, s: F.relu(t), "leaky_relu": F.leaky_relu, "gelu": lambda t, s: F.gelu(t),
       "silu": lambda t, s: F.silu(t)}
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
rows = []
for i, (name, slope, dtype, fmt, has_bias) in enumerate(PROBLEMS):
    if SELECTED is not None and i not in SELECTED:
        continue
    g = torch.Generator(device="cuda").manual_seed(100 + i)
    x = torch.randn(8, 32, 12, 12, device="cuda", generator=g).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(64, 32, 3, 3, device="cuda", generator=g) / 17).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(64, device="cuda", generator=g).to(dtype) if has_bias else None
    y = torch.ops.convbias.forward(x, w, b, [1, 1], [1, 1], [1, 1], 1, name, slope)
    ref = ACT[name](F.conv2d(x.float(), w.float(), None if b is None else b.float(), padding=1), slope)
    error = ((y.float() - ref).abs().max() / max(1.0, ref.abs().max())).item()
    info = torch_convbias.explain(x, w, b, padding=1, activation=name, negative_slope=slope)
    engine = info.get("engine") or {}
    rows.append({
        "ok": error <= TOL[dtype], "error": error, "name": name, "path": info["path"],
        "fused": info["activation"]["fused"], "graph_ops": info["graph_ops"], "engine": engine.get("name"),
        "from_disk": engine.get("from_disk"),
    })
print(json.dumps({"cache": torch_convbias.cache_info(), "rows": rows}))
"""


@cuda
def test_plans_with_an_activation_are_stored_and_loaded(tmp_path: Path) -> None:
    """A timed choice with an activation (the epilogue graph, or the graph without it and ATen's pass) is stored
    under a key holding the activation and its slope, and the next process loads the same route, graph and engine."""
    built = run(tmp_path, "kernel", script=ACTIVATION_SCRIPT)
    first = built["cache"]
    assert first["disk_writes"] >= len(built["rows"]) and first["disk_rejected"] == 0, first
    loaded = run(tmp_path, "kernel", script=ACTIVATION_SCRIPT)
    second = loaded["cache"]
    assert second["disk_hits"] == second["misses"] >= len(built["rows"]), second
    assert second["disk_writes"] == 0 and second["disk_misses"] == 0 and second["disk_rejected"] == 0, second
    route = [(r["path"], r["fused"], r["graph_ops"], r["engine"]) for r in built["rows"]]
    assert [(r["path"], r["fused"], r["graph_ops"], r["engine"]) for r in loaded["rows"]] == route
    assert all(r["from_disk"] in (True, None) for r in loaded["rows"]), loaded["rows"]


@cuda
def test_a_stored_graph_with_another_epilogue_is_rejected(tmp_path: Path) -> None:
    """The stored graph must run the problem's activation: relu's record (same shapes) in leaky_relu(0.2)'s file
    is rejected by the operations check (not the tensor check), and the plan rebuilt with the right result. Both in
    the epilogue (TORCH_CONVBIAS_ACTIVATION=fused), fp16 channels_last: the fusion the precompiled engines make."""
    script = ACTIVATION_SCRIPT.replace("SELECTED = None", "SELECTED = [0, 1]")
    run(tmp_path, "kernel", script=script, activation="fused")
    files = [f for f in plan_files(tmp_path) if f.name.startswith("forward-")]
    # The records' texts name their graphs (activation_why: "the fused conv+bias+relu graph built and ran").
    relu = [f for f in files if b"fused conv+bias+relu graph" in f.read_bytes()]
    leaky = [f for f in files if b"fused conv+bias+leaky_relu graph" in f.read_bytes()]
    assert len(relu) == 1 and len(leaky) == 1, files
    swap_records(leaky[0], relu[0])
    report = run(tmp_path, "kernel", script=script, activation="fused")
    cache = report["cache"]
    assert cache["disk_rejected"] == 1 and cache["disk_writes"] == 1, cache
    assert "the stored plan's graph runs" in cache["disk_last_rejection"], cache
    assert "RELU_FWD(lower_clip_slope=0.200000003)" in cache["disk_last_rejection"], cache
    leaky_row = [r for r in report["rows"] if r["name"] == "leaky_relu"][0]
    assert leaky_row["fused"] and leaky_row["graph_ops"][-1] == "RELU_FWD(lower_clip_slope=0.200000003)", leaky_row


RESIDUAL_SCRIPT = r"""
import json
import torch
import torch.nn.functional as F
import torch_convbias

torch.backends.cudnn.allow_tf32 = False
rows = []
for i, (name, dtype, has_bias) in enumerate([("relu", torch.float16, True), ("identity", torch.bfloat16, False)]):
    g = torch.Generator(device="cuda").manual_seed(200 + i)
    cl = torch.channels_last
    x = torch.randn(8, 32, 12, 12, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    w = (torch.randn(64, 32, 3, 3, device="cuda", generator=g) / 17).to(dtype).contiguous(memory_format=cl)
    b = torch.randn(64, device="cuda", generator=g).to(dtype) if has_bias else None
    r = torch.randn(8, 64, 12, 12, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
    y = torch_convbias.conv_bias2d(x, w, b, padding=1, activation=name, residual=r)
    ref = F.conv2d(x.float(), w.float(), None if b is None else b.float(), padding=1) + r.float()
    ref = F.relu(ref) if name == "relu" else ref
    error = ((y.float() - ref).abs().max() / max(1.0, ref.abs().max())).item()
    info = torch_convbias.explain(x, w, b, padding=1, activation=name, residual=r)
    engine = info.get("engine") or {}
    rows.append({
        "ok": error <= 3e-2, "error": error, "name": name, "path": info["path"], "fused": info["residual"]["fused"],
        "graph_ops": info["graph_ops"], "engine": engine.get("name"), "from_disk": engine.get("from_disk"),
    })
print(json.dumps({"cache": torch_convbias.cache_info(), "rows": rows}))
"""


@cuda
def test_residual_plans_are_stored_and_loaded(tmp_path: Path) -> None:
    """forward_residual's timed choice (the residual's graph, or forward's route and one pass) is stored under a key
    holding the residual, and the next process loads the same route, graph and engine without building."""
    built = run(tmp_path, "kernel", script=RESIDUAL_SCRIPT)
    first = built["cache"]
    assert first["disk_writes"] >= len(built["rows"]) and first["disk_rejected"] == 0, first
    loaded = run(tmp_path, "kernel", script=RESIDUAL_SCRIPT)
    second = loaded["cache"]
    assert second["disk_hits"] == second["misses"] >= len(built["rows"]), second
    assert second["disk_writes"] == 0 and second["disk_misses"] == 0 and second["disk_rejected"] == 0, second
    route = [(r["path"], r["fused"], r["graph_ops"], r["engine"]) for r in built["rows"]]
    assert [(r["path"], r["fused"], r["graph_ops"], r["engine"]) for r in loaded["rows"]] == route


@cuda
def test_a_record_claiming_the_bias_in_the_residual_pass_where_it_cannot_be_is_rejected(tmp_path: Path) -> None:
    """A record's residual_bias_in_pass (ATen's convolution without the bias, then one pass adding bias and residual)
    fits only a residual problem with a bias whose plan is the ATen path: a record claiming it for a problem without a
    residual (forward's own route), without a bias, or whose plan is the residual's graph is rejected and rebuilt."""
    built = run(tmp_path, "kernel", script=RESIDUAL_SCRIPT)
    claim = b"\x75residual_bias_in_pass"  # CBOR: a text of 21 bytes, then the value (false 0xf4, true 0xf5)
    flipped = 0
    for path in plan_files(tmp_path):
        data = path.read_bytes()
        if not path.name.startswith("forward-") or claim + b"\xf4" not in data:
            continue
        # A residual problem's record names its graph in its notes ("fused conv+bias+residual+relu graph ...").
        fits_the_claim = b"fused conv+bias+residual" in data and b"\x6eresidual_fused\xf4" in data
        if fits_the_claim:
            continue
        rewrite_body(path, data[:8], data[16:].replace(claim + b"\xf4", claim + b"\xf5"))
        flipped += 1
    residual_graphs = sum(row["fused"] for row in built["rows"])
    assert flipped >= 2 + residual_graphs, (flipped, built["rows"])  # the no-bias residual record, own routes, graphs
    report = run(tmp_path, "kernel", script=RESIDUAL_SCRIPT)  # the rows are still right (run checks them)
    cache = report["cache"]
    assert cache["disk_rejected"] == cache["disk_writes"] == flipped, (cache, flipped)

"""Zero-padded input channels (csrc/cuda/pad_channels.*, TORCH_CONVBIAS_PAD_CHANNELS): a channels_last forward or
weight gradient whose channel rows are not 16-byte multiples (C=3 RGB inputs) can run on padded copies of input (and
weight, or a padded weight gradient). Forced on, every such problem (dtypes, activations, strides, the pre-activation
kept for autograd, NCHW via channels_last copies) equals F.conv2d in float64, gradients included, and says so in
explain() / explain_param_grad(); timed (cudnn.benchmark), both ways are measured and the faster is the one taken;
untimed or off, the problem runs as it is; problems it does not apply to are never padded; padded plans survive the
persistent plan cache. Knobs are read once per process: each setting runs in its own process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import MODES, assert_close, cuda, math_mode, run_script_with_knobs

import torch_convbias


# (n, c, hw, k, kernel, stride, padding, dilation, dtype name, activation, channels_last): C=3 in every dtype, C=5 and
# C=12 (padded to 8 / 16), 11x11 stride 4 (AlexNet's first layer, scaled down), a dilated one, relu / gelu / identity.
CASES = [
    (4, 3, 16, 16, 3, 1, 1, 1, "bfloat16", "relu", True),
    (4, 3, 16, 16, 3, 1, 1, 1, "float16", "identity", True),
    (4, 3, 16, 16, 3, 1, 1, 1, "float32", "gelu", True),
    (2, 3, 35, 24, 11, 4, 2, 1, "bfloat16", "relu", True),
    (3, 5, 12, 8, 3, 2, 1, 2, "float32", "relu", True),
    (3, 12, 10, 16, 1, 1, 0, 1, "bfloat16", "silu", True),
    (2, 3, 15, 8, 5, 1, 2, 1, "float16", "relu", False),  # NCHW: padded behind the channels_last copies
]

# Runs CASES (forward and, under autograd, every gradient) against float64 and prints, per case, the padded channel
# count explain() reports and whether the results matched.
SCRIPT = r"""
import json, sys, torch, torch.nn.functional as F, torch_convbias
sys.path.insert(0, "tests")
from conftest import MODES, assert_close
from test_pad_channels import CASES, ACTIVATIONS
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.benchmark = sys.argv[1] == "benchmark"
rows = []
for n, c, hw, k, r, stride, pad, dil, mode_name, act, channels_last in CASES:
    mode = MODES[mode_name]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator(device="cuda").manual_seed(n * 100 + c * 10 + r)
    x = torch.randn(n, c, hw, hw, device="cuda", generator=g).to(mode.dtype).contiguous(memory_format=fmt)
    w = (torch.randn(k, c, r, r, device="cuda", generator=g) / (c * r * r) ** 0.5).to(mode.dtype)
    w = w.contiguous(memory_format=fmt)
    b = torch.randn(k, device="cuda", generator=g).to(mode.dtype)
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = torch_convbias.conv_bias2d(*leaves, stride=stride, padding=pad, dilation=dil, activation=act)
    dy = torch.randn(y.shape, device="cuda", generator=g).to(mode.dtype)
    y.backward(dy)
    ref_leaves = [t.detach().cpu().double().requires_grad_(True) for t in (x, w, b)]
    pre = F.conv2d(*ref_leaves, stride=stride, padding=pad, dilation=dil)
    ref = ACTIVATIONS[act](pre)
    if act == "relu":
        # ReLU's derivative where our output is positive: a pre-activation within rounding of 0 lands on either side in
        # 16-bit, and one flip moves a whole kernel window of the input gradient (seen on the GPU: 11x11, bf16).
        pre.backward(dy.cpu().double() * (y.detach().cpu() > 0))
    else:
        ref.backward(dy.cpu().double())
    for what, got, want in [("output", y, ref)] + [(f"grad {i}", t.grad, u.grad) for i, (t, u) in enumerate(zip(leaves, ref_leaves))]:
        assert_close(got.detach().cpu().double(), want.detach(), mode, f"case {(n, c, hw, k, r, mode_name, act)}: {what}")
    info = torch_convbias.explain(x, w, b, stride=stride, padding=pad, dilation=dil, activation=act)
    trained = torch_convbias.explain(x, w, b, stride=stride, padding=pad, dilation=dil, activation=act, for_backward=True)
    wgrad = torch_convbias.explain_param_grad(dy, x, w, stride=stride, padding=pad, dilation=dil)["weight_grad"]
    rows.append({"case": [c, mode_name, act, channels_last], "padded": info.get("padded_channels"),
                 "padded_wgrad": wgrad.get("padded_channels"), "wgrad_notes": wgrad.get("notes", []),
                 "wgrad_timings": {"padded": wgrad.get("padded_ms", -1), "as_is": wgrad.get("as_is_ms", -1)},
                 "padded_for_backward": trained.get("padded_channels"), "timings": dict(info.get("layout_timings", [])),
                 "notes": info.get("notes", []), "layout": info["layout"]})
print(json.dumps({"rows": rows, "cache": torch_convbias.cache_info()}))
"""

ACTIVATIONS = {
    "identity": lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
}


def padded_problem_runs_aten(notes: list[str]) -> bool:
    """Whether explain's notes say the padded way was not taken because the padded problem's own plan is ATen's."""
    return any("zero-padded from" in note and "plan is ATen's" in note for note in notes)


def expected_channels(c: int, mode_name: str) -> int:
    per_row = 16 // MODES[mode_name].dtype.itemsize
    return (c + per_row - 1) // per_row * per_row


def run(tuning: str, **knobs: str) -> dict[str, Any]:
    # The space-to-depth way (timed beside the padded one under cudnn.benchmark) off unless a test names it: its own
    # tests are in test_space_to_depth.py.
    return run_script_with_knobs(SCRIPT, tuning, **{"space_to_depth": "off", **knobs})


@cuda
def test_forced_padding_matches_conv2d_and_is_reported() -> None:
    """TORCH_CONVBIAS_PAD_CHANNELS=on: every case runs padded (explain's padded_channels is the next 16-byte row; the
    NCHW one through channels_last copies, TORCH_CONVBIAS_NCHW=copy), and output and gradients equal float64
    F.conv2d."""
    report = run("untimed", pad_channels="on", nchw="copy")
    for (n, c, hw, k, r, stride, pad, dil, mode_name, act, channels_last), row in zip(CASES, report["rows"]):
        expected = expected_channels(c, mode_name)
        assert row["padded"] == expected and row["padded_for_backward"] == expected, row
        if channels_last:
            assert any("zero-padded from" in note and "PAD_CHANNELS=on" in note for note in row["notes"]), row
        # The weight gradient of NCHW tensors is ATen's (nn.Conv2d's path): never padded.
        assert row["padded_wgrad"] == (expected if channels_last else None), row


@cuda
def test_timed_choice_measures_both_ways_and_keeps_the_faster() -> None:
    """Under cudnn.benchmark (default knob): both ways measured, the padded one taken exactly when it measured faster;
    results equal float64 F.conv2d either way."""
    report = run("benchmark")
    measured = {"forward": 0, "weight gradient": 0}
    for case, row in zip(CASES, report["rows"]):
        if not case[-1]:
            continue  # NCHW: its own layout timings (the NCHW ways); the channels_last plan behind the copies is padded or not
        timings = row["timings"]
        if padded_problem_runs_aten(row["notes"]):
            assert row["padded"] is None and "padded_channels" not in timings, row
        else:
            assert set(timings) == {"as_is", "padded_channels"} and all(ms > 0 for ms in timings.values()), row
            assert (row["padded"] is not None) == (timings["padded_channels"] < timings["as_is"]), row
            measured["forward"] += 1
        wgrad = row["wgrad_timings"]
        if padded_problem_runs_aten(row["wgrad_notes"]):
            assert row["padded_wgrad"] is None and wgrad["padded"] == -1, row
        else:
            assert wgrad["padded"] > 0 and wgrad["as_is"] > 0, row
            assert (row["padded_wgrad"] is not None) == (wgrad["padded"] < wgrad["as_is"]), row
            measured["weight gradient"] += 1
    # Where the padded problem's own plan is ATen's (measured faster than its graph) there is nothing to compare; the
    # comparison itself must have run somewhere.
    assert all(count > 0 for count in measured.values()), (measured, report["rows"])


@cuda
def test_untimed_and_off_run_the_problem_as_it_is() -> None:
    """Untimed choices (the default) never pad (heuristics cannot weigh the copies), nor does
    TORCH_CONVBIAS_PAD_CHANNELS=off under cudnn.benchmark."""
    for tuning, knobs in (("untimed", {}), ("benchmark", {"pad_channels": "off"})):
        report = run(tuning, **knobs)
        for row in report["rows"]:
            assert row["padded"] is None and row["padded_for_backward"] is None, (tuning, row)
            assert "padded_channels" not in row["timings"], (tuning, row)
            assert row["padded_wgrad"] is None and row["wgrad_timings"]["padded"] == -1, (tuning, row)


@cuda
@pytest.mark.parametrize(
    "c,groups,dtype",
    [(8, 1, torch.bfloat16), (4, 1, torch.float32), (6, 3, torch.bfloat16), (3, 1, torch.float64)],
    ids=["aligned-bf16", "aligned-fp32", "grouped", "float64"],
)
def test_problems_it_does_not_apply_to_are_never_padded(c: int, groups: int, dtype: torch.dtype) -> None:
    """Aligned channel rows, grouped convolutions and float64 have no padded way, timed or not: explain's
    padded_channels is null and no such timing is made."""
    x = torch.randn(2, c, 8, 8, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, c // groups, 3, 3, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    b = torch.randn(6, device="cuda", dtype=dtype)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with math_mode(MODES["float32"]):
            y = torch_convbias.conv_bias2d(x, w, b, padding=1, groups=groups)
            info = torch_convbias.explain(x, w, b, padding=1, groups=groups)
            wgrad = torch_convbias.explain_param_grad(torch.ones_like(y), x, w, padding=1, groups=groups)["weight_grad"]
    finally:
        torch.backends.cudnn.benchmark = saved
    mode = MODES["float64" if dtype == torch.float64 else "float32" if dtype == torch.float32 else "bfloat16"]
    expected = F.conv2d(x.cpu().double(), w.cpu().double(), b.cpu().double(), padding=1, groups=groups)
    assert_close(y.cpu().double(), expected, mode, "output")
    assert info.get("padded_channels") is None, info
    assert "padded_channels" not in dict(info.get("layout_timings") or []), info
    assert wgrad.get("padded_channels") is None and wgrad.get("padded_ms", -1) == -1, wgrad


@cuda
def test_padded_plan_is_stored_and_loaded(tmp_path: Path) -> None:
    """A timed padded choice (forced on, so that it is the one made) goes to the persistent plan cache and the next
    process loads it, padded still, with the same results."""
    first = run("benchmark", pad_channels="on", plan_cache_dir=str(tmp_path))
    assert first["cache"]["disk_writes"] > 0, first["cache"]
    second = run("benchmark", pad_channels="on", plan_cache_dir=str(tmp_path))
    assert second["cache"]["disk_hits"] > 0 and second["cache"]["disk_rejected"] == 0, second["cache"]
    padded = 0
    for row in second["rows"]:
        if row["case"][-1]:
            # Timed, the padded problem's own plan may be ATen's (measured faster than its graph): then not padded.
            assert (row["padded"] is None) == padded_problem_runs_aten(row["notes"]), row
            assert (row["padded_wgrad"] is None) == padded_problem_runs_aten(row["wgrad_notes"]), row
            assert any("loaded from the persistent plan cache" in note for note in row["notes"]), row
            padded += row["padded"] is not None
    assert padded > 0, second["rows"]



# One C=3 bfloat16 problem explained (forward and weight gradient) while a test hook is armed, then again with the hooks
# cleared, and run: argv[1] the tuning, argv[2:] the hooks, each after a cleared plan cache. "oom" / "other": the next
# two tries of the padded way (the forward's, then the weight gradient's) fail as out of memory for the copies / as
# another error; "aten": the next two forward comparisons with ATen (the problem as it is, then the padded problem)
# take ATen's.
HOOK_SCRIPT = r"""
import json, sys, torch, torch.nn.functional as F, torch_convbias
sys.path.insert(0, "tests")
from conftest import MODES, assert_close
torch.backends.cudnn.benchmark = sys.argv[1] == "benchmark"
g = torch.Generator(device="cuda").manual_seed(0)
cl = torch.channels_last
x = torch.randn(4, 3, 16, 16, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=cl)
w = (torch.randn(8, 3, 3, 3, device="cuda", generator=g) / 27 ** 0.5).to(torch.bfloat16).contiguous(memory_format=cl)
b = torch.randn(8, device="cuda", generator=g).to(torch.bfloat16)
dy = torch.randn(4, 8, 16, 16, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=cl)

def state():
    info = torch_convbias.explain(x, w, b, padding=1)
    wgrad = torch_convbias.explain_param_grad(dy, x, w, padding=1)["weight_grad"]
    return {"padded": info.get("padded_channels"), "notes": info["notes"],
            "padded_wgrad": wgrad.get("padded_channels"), "wgrad_notes": wgrad["notes"]}

rows = {}
for hook in sys.argv[2:]:
    torch.ops.convbias._plan_cache_clear()
    if hook == "aten":
        torch.ops.convbias._inject_aten_preferences(2)
    else:
        torch.ops.convbias._inject_padded_way_failures(2, hook == "oom")
    first = state()
    torch.ops.convbias._inject_aten_preferences(0)
    torch.ops.convbias._inject_padded_way_failures(0, False)
    again = state()
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    y = torch_convbias.conv_bias2d(*leaves, padding=1)
    y.backward(dy)
    ref = [t.detach().cpu().double().requires_grad_(True) for t in (x, w, b)]
    want = F.conv2d(*ref, padding=1)
    want.backward(dy.cpu().double())
    assert_close(y.detach().cpu().double(), want.detach(), MODES["bfloat16"], hook + ": output")
    for i in (1, 2):
        assert_close(leaves[i].grad.cpu().double(), ref[i].grad, MODES["bfloat16"], f"{hook}: grad {i}")
    rows[hook] = {"first": first, "again": again}
print(json.dumps(rows))
"""


def run_hooks(tuning: str, hooks: list[str], **knobs: str) -> dict[str, Any]:
    return run_script_with_knobs(HOOK_SCRIPT, tuning, *hooks, **knobs)


@cuda
def test_a_failing_padded_way_leaves_the_problem_as_it_is() -> None:
    """The padded way is optional: when it fails (TORCH_CONVBIAS_PAD_CHANNELS=on, test hook) the forward and the weight
    gradient run as they are, their notes saying why, with results equal to float64. Out of memory for the copies the
    choice is not final (transient: the next call pads); any other failure is final for the key."""
    rows = run_hooks("untimed", ["oom", "other"], pad_channels="on")
    expected = {"oom": ("not tried: out of memory", 8), "other": ("failed, the problem runs as it is", None)}
    for hook, (note, padded_again) in expected.items():
        first, again = rows[hook]["first"], rows[hook]["again"]
        assert first["padded"] is None and any(note in n for n in first["notes"]), (hook, first)
        assert first["padded_wgrad"] is None and any(note in n for n in first["wgrad_notes"]), (hook, first)
        assert again["padded"] == padded_again and again["padded_wgrad"] == padded_again, (hook, again)


@cuda
def test_a_padded_problem_whose_plan_is_aten_is_not_taken() -> None:
    """Timed, where ATen's convolution wins on the padded problem too (test hook: the problem as it is and the padded
    one both prefer ATen), padding would only add copies: the problem runs as it is and explain's notes say why."""
    first = run_hooks("benchmark", ["aten"])["aten"]["first"]
    assert first["padded"] is None, first
    why = "not taken: that problem's plan is ATen's convolution (measured faster"
    assert any(why in note for note in first["notes"]), first

"""The post-grad pass the ``convbias`` backend gives Inductor: an activation's backward (and the bias gradient with
it) handed to Inductor where Inductor can fuse it with the kernel that produces the incoming gradient.

In eager mode ``convbias._activation_backward`` is one kernel of ours: the gradient at the convolution's output, dz =
g * act'(saved), and the bias gradient, dz summed over N, H and W, in one pass over g. Under Inductor that pass has
a neighbour: when g itself comes out of code Inductor generates (a max-pool's backward, the sum of two branches'
gradients, a flatten's view of a pointwise result), compiled nn.Conv2d computes g, dz and the bias sum in the same
Triton kernels, while our opaque op forces g to be written out in full and read back. Here the op is replaced, in the
backward graph, by ATen's own derivative (``threshold_backward``, ``gelu_backward``, ...) and a sum, traced with
Inductor's decompositions, so that Inductor fuses them with g's producer. Where g comes from a kernel Inductor only
calls (a convolution's input gradient, a matmul, an op of ours) or is an input of the backward graph, there is
nothing to fuse with and our kernel stays.

Where g is our own input gradient (``convbias._input_grad``, the next layer's: a convolution directly above this
activation) used by nothing else, the two become one ``convbias._input_grad_activation``: on CUDA that op may run the
input gradient with the derivative in the same cuDNN graph, so that g is never written out (it chooses by
measurement, csrc/cuda/dgrad_activation.h; otherwise it runs the same two kernels).

Policies (backend option ``convbias.activation_backward``): ``"auto"`` (the rules above, the default), ``"ours"``
(never replaced nor merged), ``"inductor"`` (always replaced: for measuring one against the other). :data:`reports`
keeps one :class:`BackwardReport` per backward graph compiled.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import operator
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

LOG = logging.getLogger("torch_convbias.compile")

POLICIES = ("auto", "ours", "inductor")

# Producers that Inductor lowers to a library call (or a template) whose output it cannot fuse a reduction into.
_LIBRARY_KERNELS = {
    "aten::convolution",
    "aten::convolution_backward",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_int_mm",
}
# Ops that only reinterpret their input's storage (Inductor makes them views, not kernels): g's producer is found
# behind them.
_VIEWS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::permute",
    "aten::expand",
    "aten::squeeze",
    "aten::unsqueeze",
    "aten::alias",
    "aten::t",
    "aten::transpose",
}


@dataclasses.dataclass
class BackwardReport:
    """What the pass did in one backward graph: ``handed`` the activation backwards replaced by ATen's derivative and a
    sum (Inductor fuses them with the gradient's producer), ``merged`` those merged with the input gradient producing
    their gradient into ``convbias._input_grad_activation``, ``kept`` those left to our kernel as they are; each entry
    names the node, the activation and the reason (the gradient's producer); a merged one also its ``problem`` (the
    static shapes and parameters of the merged op, for explain_input_grad_activation; None under dynamic shapes)."""

    handed: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    merged: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    kept: list[dict[str, Any]] = dataclasses.field(default_factory=list)


# The last backward graphs' reports, newest last.
reports: collections.deque[BackwardReport] = collections.deque(maxlen=64)


def _op_name(node: fx.Node) -> str | None:
    target = node.target
    return target._schema.name if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _producer(node: fx.Node) -> fx.Node:
    """The node that computes ``node``'s data: through views and through ``getitem`` of a multi-output node."""
    while node.op == "call_function" and (node.target is operator.getitem or _op_name(node) in _VIEWS):
        node = node.args[0]  # type: ignore[assignment]
    return node


def _inductor_generates(op: torch._ops.OpOverload) -> bool:
    """Whether Inductor computes ``op`` in code it generates (a lowering that is not a fallback to the op's kernel)."""
    try:
        from torch._inductor import lowering
    except ImportError:  # pragma: no cover - Inductor absent: nothing to fuse with
        return False
    return op in lowering.lowerings and op not in lowering.fallbacks


def fusible_producer(grad: fx.Node) -> tuple[bool, str]:
    """Whether Inductor can fuse the activation backward with the kernel producing ``grad``, and why (for the report)."""
    source = _producer(grad)
    if source.op == "placeholder":
        return False, f"the gradient is {source.name}, an input of the backward graph: nothing to fuse with"
    name = _op_name(source)
    if name is None:
        return False, f"the gradient comes from {source.format_node() or source.name}, not an ATen op"
    if not name.startswith(("aten::", "prims::")):
        return False, f"the gradient comes from {name}, a kernel Inductor calls as it is"
    if name in _LIBRARY_KERNELS or not _inductor_generates(source.target):  # type: ignore[arg-type]
        return False, f"the gradient comes from {name}, a library kernel Inductor calls as it is"
    return True, f"the gradient comes from {name}, which Inductor generates code for"


def derivative(
    grad_output: torch.Tensor, saved: torch.Tensor, activation: str, negative_slope: float, bias_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``convbias._activation_backward`` written with ATen's own backward ops: (dz, the bias gradient or None), dz in
    the layout the op gives it. ``saved`` is what csrc/activation.h says the activation keeps (the output for relu,
    sigmoid, tanh and leaky_relu with a non-negative slope; the pre-activation otherwise)."""
    aten = torch.ops.aten
    if activation == "relu":
        grad_z = aten.threshold_backward(grad_output, saved, 0)
    elif activation == "leaky_relu":
        grad_z = aten.leaky_relu_backward(grad_output, saved, negative_slope, negative_slope >= 0)
    elif activation in ("gelu", "gelu_tanh"):
        grad_z = aten.gelu_backward(grad_output, saved, approximate="tanh" if activation == "gelu_tanh" else "none")
    elif activation == "silu":
        grad_z = aten.silu_backward(grad_output, saved)
    elif activation == "sigmoid":
        grad_z = aten.sigmoid_backward(grad_output, saved)
    elif activation == "tanh":
        grad_z = aten.tanh_backward(grad_output, saved)
    elif activation == "identity":
        grad_z = grad_output.clone()
    else:
        raise ValueError(f"convbias backend: no ATen derivative for activation {activation!r}")
    from torch_convbias import _validation

    grad_z = grad_z.contiguous(memory_format=_validation.activation_grad_memory_format(grad_output, saved))
    return grad_z, (grad_z.sum((0, 2, 3)) if bias_grad else None)


def _arguments(node: fx.Node) -> tuple[fx.Node, fx.Node, str, float, bool]:
    names = ("grad_output", "saved", "activation", "negative_slope", "bias_grad")
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    return (
        values["grad_output"],  # type: ignore[return-value]
        values["saved"],
        str(values["activation"]),
        float(values["negative_slope"]),  # type: ignore[arg-type]
        bool(values["bias_grad"]),
    )


def _trace(grad: fx.Node, saved: fx.Node, activation: str, slope: float, bias_grad: bool) -> fx.GraphModule:
    """:func:`derivative` traced with Inductor's decompositions on the nodes' fake values, as Inductor's own pattern
    replacements are traced."""
    from torch._guards import detect_fake_mode
    from torch._inductor.pattern_matcher import fwd_only

    example = [grad.meta["val"], saved.meta["val"]]
    with detect_fake_mode(example) or contextlib.nullcontext():
        return fwd_only(lambda g, s: derivative(g, s, activation, slope, bias_grad), example)


def _replace(graph: fx.Graph, node: fx.Node, traced: fx.GraphModule, grad: fx.Node, saved: fx.Node) -> None:
    """Replace ``node`` (and its ``getitem`` users) by the nodes of ``traced``."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(node):
        outputs = graph.graph_copy(traced.graph, dict(zip(placeholders, (grad, saved))))
    for user in list(node.users):
        replacement = outputs[user.args[1]]  # type: ignore[index]
        replacement.meta.update({k: v for k, v in user.meta.items() if k not in ("val", "tensor_meta")})
        user.replace_all_uses_with(replacement)
        graph.erase_node(user)
    graph.erase_node(node)


def _replaceable(node: fx.Node, bias_grad: bool) -> str:
    """Why ``node``'s uses cannot be rewired to a traced replacement ("" when they can)."""
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            return f"{node.name} is used by {user.format_node()}, not an element of its result"
        if user.args[1] == 1 and not bias_grad:
            return f"{user.format_node()} reads a bias gradient {node.name} does not compute"
    return ""


_NOT_OUR_INPUT_GRAD = "the gradient is not convbias._input_grad's result"


def _merge_refusal(node: fx.Node, grad: fx.Node) -> str:
    """Why ``node`` (an activation backward) cannot be merged with the producer of its gradient ``grad`` into
    ``convbias._input_grad_activation`` ("" when it can): the gradient must be our input gradient's result itself (no
    view between), used by this node alone."""
    if grad.op != "call_function" or grad.target is not torch.ops.convbias._input_grad.default:
        return _NOT_OUR_INPUT_GRAD
    if len(grad.users) != 1:
        return f"the input gradient {grad.name} is also used by {', '.join(u.name for u in grad.users if u is not node)}"
    return ""


def _merged_problem(grad: fx.Node, slope: float) -> dict[str, Any] | None:
    """The merged op's static shapes and conv parameters, from the input gradient's arguments (None where a shape or
    parameter is symbolic)."""
    names = ("grad_output", "input", "weight", "stride", "padding", "dilation", "groups")
    values = dict(zip(names, grad.args))
    values.update(grad.kwargs)
    def static(value: Any) -> int:
        # A torch.SymInt (dynamic shapes) is not turned into an int here: that would add a guard after guarding ended.
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"not a static int: {value!r}")
        return value

    try:
        problem: dict[str, Any] = {
            name: [static(size) for size in values[name].meta["val"].shape]  # type: ignore[union-attr]
            for name in ("grad_output", "input", "weight")
        }
        for name in ("stride", "padding", "dilation"):
            problem[name] = [static(v) for v in values[name]]  # type: ignore[union-attr]
        problem["groups"] = static(values["groups"])
    except (KeyError, TypeError, AttributeError):
        return None
    problem["negative_slope"] = slope
    return problem


def _merge(graph: fx.Graph, node: fx.Node, grad: fx.Node) -> None:
    """Replace ``node`` and the ``convbias._input_grad`` producing its gradient by one ``_input_grad_activation``
    (same results, same ``getitem`` users)."""
    names = ("grad_output", "input", "weight", "stride", "padding", "dilation", "groups")
    conv = dict(zip(names, grad.args))
    conv.update(grad.kwargs)
    _, saved, activation, slope, bias_grad = _arguments(node)
    with graph.inserting_before(node):
        merged = graph.call_function(
            torch.ops.convbias._input_grad_activation.default,
            tuple(conv[name] for name in names) + (saved, activation, slope, bias_grad),
        )
    # The activation backward's results are the merged op's; not its eager_input_vals (the fake arguments of another
    # schema, which Inductor would match against this op's).
    merged.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
    node.replace_all_uses_with(merged)
    graph.erase_node(node)
    graph.erase_node(grad)


class ActivationBackwardPass(CustomGraphPass):
    """Inductor's ``post_grad_custom_pre_pass`` under the convbias backend (the module docstring says what it does);
    ``then`` is a pre-pass the caller had set, run after this one."""

    def __init__(self, policy: str, then: Any = None) -> None:
        self.policy, self.then = policy, then  # policy: one of POLICIES (the backend checked it)

    def __call__(self, graph: fx.Graph) -> None:
        target = torch.ops.convbias._activation_backward.default
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is target]
        if nodes:
            report = BackwardReport()
            for node in nodes:
                grad, saved, activation, slope, bias_grad = _arguments(node)
                traced, why = self._replacement(node, grad, saved, activation, slope, bias_grad)
                entry = {"node": node.name, "activation": activation, "reason": why}
                merge_refusal = _merge_refusal(node, grad) if traced is None and self.policy == "auto" else None
                if traced is not None:
                    _replace(graph, node, traced, grad, saved)
                    report.handed.append(entry)
                    LOG.info("handed %s (%s backward) to Inductor: %s", node.name, activation, why)
                elif merge_refusal == "":
                    entry["reason"] = f"merged with the input gradient {grad.name} into convbias._input_grad_activation"
                    entry["problem"] = _merged_problem(grad, slope)
                    _merge(graph, node, grad)
                    report.merged.append(entry)
                    LOG.info("merged %s (%s backward) with %s", node.name, activation, grad.name)
                else:
                    if merge_refusal and merge_refusal != _NOT_OUR_INPUT_GRAD:
                        entry["reason"] = f"{why}; not merged: {merge_refusal}"
                    report.kept.append(entry)
                    LOG.info("kept %s (%s backward) on our kernel: %s", node.name, activation, entry["reason"])
            reports.append(report)
            graph.lint()
        if self.then is not None:
            self.then(graph)

    def _replacement(
        self, node: fx.Node, grad: fx.Node, saved: fx.Node, activation: str, slope: float, bias_grad: bool
    ) -> tuple[fx.GraphModule | None, str]:
        """ATen's derivative traced for ``node`` when it is to be handed over (else None), and why."""
        if self.policy == "ours":
            return None, "convbias.activation_backward='ours'"
        why = "convbias.activation_backward='inductor'"
        if self.policy == "auto":
            fusible, why = fusible_producer(grad)
            if not fusible:
                return None, why
        refusal = _replaceable(node, bias_grad)
        if refusal:
            return None, refusal
        try:
            return _trace(grad, saved, activation, slope, bias_grad), why
        except Exception as error:  # noqa: BLE001 - our kernel is always a correct fallback
            return None, f"could not trace ATen's derivative ({type(error).__name__}: {error})"

    def uuid(self) -> Any:
        """Inductor's cache key of the pass: the code it runs, the policy, and the chained pass's uuid (None, no caching, when it has none)."""
        chained = None
        if self.then is not None:
            chained = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
            if chained is None:
                return None
        digest = hashlib.sha256()
        for source in (Path(__file__), Path(__file__).with_name("_validation.py")):  # derivative() calls the latter
            digest.update(source.read_bytes())
        return (digest.hexdigest(), self.policy, chained)

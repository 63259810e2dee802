"""The ``convbias`` torch.compile backend: nn.Conv2d (+ bias) (+ residual add) (+ activation) rewritten into
``convbias.forward`` / ``convbias.forward_residual``.

``torch.compile(model, backend="convbias")`` (or :func:`compile`) captures the model with Dynamo as usual; before
AOTAutograd sees the graph, :func:`rewrite_graph` replaces

* ``conv2d(x, w, b)`` by ``convbias.forward(x, w, b)`` (the bias fused into the convolution),
* ``act(conv2d(x, w, b))`` by ``convbias.forward(x, w, b, activation=act)`` for ReLU, LeakyReLU, GELU (erf and
  tanh), SiLU, Sigmoid and Tanh, written as modules, functions or tensor methods, in place or not; a ConvBias2d
  followed by such an activation likewise,
* in inference (grad disabled, batch norm in eval mode), ``batch_norm(conv2d(x, w, b))`` by a convolution whose
  weight and bias have the normalisation folded in (computed in the graph from the live parameters and running
  statistics on every call, so nothing is frozen), which can then take the following activation too,
* a residual block's ending, ``act(conv2d(x, w, b) + r)`` (the convolution possibly with its batch norm folded as
  above, the activation optional), by ``convbias.forward_residual(x, w, b, r, activation=act)``, in training too (the
  op has autograd): the add written ``conv + r``, ``r + conv``, ``torch.add`` (``alpha`` 1), ``conv.add(r)``, or in
  place on the convolution's output, ``out += r`` / ``out.add_(r)`` as torchvision's ResNet blocks do,

then hands the graph to Inductor with the caller's ``mode`` and ``options`` (or to another backend,
``options={"convbias.inner": "aot_eager"}``). Only what the op covers is rewritten: CUDA tensors (by default) of
float16, bfloat16 or float32, 4-D inputs, integer padding or ``'valid'`` / a symmetric ``'same'``. A pattern that
could change what the program computes is left as it is: an activation is fused only when the convolution's
output has no other user (a hook that reads it, a residual branch), a batch norm only when its convolution's output
feeds nothing else, a residual add only when the convolution's output feeds nothing else, the other operand is a
tensor of exactly the output's shape, dtype and device (no broadcasting, no type promotion), the add's result keeps
the convolution's layout, an in-place add writes into the convolution's output (not into the other operand), and no
in-place operation, grad mode or autocast switch runs between the convolution and the add (the fused op reads its
operands where the add stood). ``TORCH_CONVBIAS_COMPILE_LOG=1`` logs every rewrite and every candidate left alone
with the reason (logger ``torch_convbias.compile``, so ``TORCH_LOGS=torch_convbias`` shows it too, in torch's
format); :data:`reports` keeps the last graphs' :class:`RewriteReport`.

Backend options (keys of ``options`` starting with ``convbias.``, removed before Inductor sees the rest):

* ``convbias.devices``: device types whose convolutions are rewritten, default ``("cuda",)``; ``("cpu", "cuda")``
  also rewrites CPU convolutions into the op's CPU reference path (tests);
* ``convbias.fuse_activations`` (default True), ``convbias.fold_batchnorm`` (default True);
* ``convbias.fuse_residual`` (default True): False leaves residual adds as they are (the convolution before them
  is still rewritten alone);
* ``convbias.activation_backward`` (Inductor only): where an activation's backward and the bias gradient run in the
  backward graph: ``"auto"`` (default) hands them to Inductor, as ATen's derivative and a sum, when the incoming
  gradient is computed by code Inductor generates (a max-pool's backward, a sum of branches), so that one Triton
  kernel produces the gradient and its derivative; elsewhere our fused kernel runs. ``"ours"``: always our kernel;
  ``"inductor"``: always Inductor's (torch_convbias/_backward_fusion.py; :data:`backward_reports`);
* ``convbias.inner``: the backend that compiles the rewritten graph, default ``"inductor"``.

Inductor's freezing (deployment: parameters, and so the folded batch norms, become constants) needs
``torch._inductor.config.freezing`` set while Dynamo traces; ``options={"freezing": True}`` alone freezes nothing,
and the backend warns once when it sees it so in inference.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import operator
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from torch_convbias import _backward_fusion

__all__ = ["RewriteReport", "backward_reports", "compile", "convbias_backend", "reports", "rewrite_graph"]

LOG = logging.getLogger("torch_convbias.compile")
if os.environ.get("TORCH_CONVBIAS_COMPILE_LOG", "") not in ("", "0"):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[torch_convbias.compile] %(message)s"))
    LOG.addHandler(_handler)
    LOG.setLevel(logging.INFO)

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OPTION_PREFIX = "convbias."


@dataclasses.dataclass
class RewriteReport:
    """What :func:`rewrite_graph` did to one graph: ``rewrites`` holds one line per convolution replaced (its node,
    the activation fused, whether a batch norm was folded, whether a residual add was fused, and the problem: input and
    weight shapes where static, stride, padding, dilation, groups, slope), ``skipped`` one line per candidate left alone
    and why."""

    rewrites: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def count(self, *, activation: str | None = None, batchnorm: bool | None = None, residual: bool | None = None) -> int:
        """How many convolutions were rewritten, optionally only those with ``activation`` / with (or without) a folded
        batch norm / with (or without) a fused residual add."""
        return sum(
            1
            for r in self.rewrites
            if (activation is None or r["activation"] == activation)
            and (batchnorm is None or r["batchnorm_folded"] == batchnorm)
            and (residual is None or r["residual"] == residual)
        )


# The last graphs' reports, newest last (a graph break makes several graphs per compiled function).
reports: collections.deque[RewriteReport] = collections.deque(maxlen=64)
# The last backward graphs' reports of the activation-backward pass (torch_convbias/_backward_fusion.py).
backward_reports = _backward_fusion.reports


@dataclasses.dataclass(frozen=True)
class _Config:
    devices: tuple[str, ...] = ("cuda",)
    fuse_activations: bool = True
    fold_batchnorm: bool = True
    fuse_residual: bool = True
    activation_backward: str = "auto"
    inner: str | Callable[..., Any] = "inductor"


def _config_from(options: dict[str, Any]) -> _Config:
    known = {f"{_OPTION_PREFIX}{field.name}" for field in dataclasses.fields(_Config)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"convbias backend: unknown option(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}"
        )
    values = {key[len(_OPTION_PREFIX) :]: value for key, value in options.items()}
    if "devices" in values:
        devices = values["devices"]
        if isinstance(devices, str) or not all(d in ("cpu", "cuda") for d in devices):
            raise ValueError(f"convbias backend: expected `convbias.devices` to be a sequence of 'cpu' / 'cuda', got {devices!r}")
        values["devices"] = tuple(devices)
    if "activation_backward" in values and values["activation_backward"] not in _backward_fusion.POLICIES:
        raise ValueError(
            f"convbias backend: expected `convbias.activation_backward` to be one of {', '.join(_backward_fusion.POLICIES)}, "
            f"got {values['activation_backward']!r}"
        )
    for flag in ("fuse_activations", "fold_batchnorm", "fuse_residual"):
        if flag in values and not isinstance(values[flag], bool):
            raise ValueError(f"convbias backend: expected `convbias.{flag}` to be a bool, got {values[flag]!r}")
    return _Config(**values)


# ---------------------------------------------------------------------------------------------------------------
# Recognising the nodes: convolutions, activations, batch norms as Dynamo records them (torch-level calls).


def _conv2d_signature(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    pass


def _convbias_signature(  # type: ignore[no-untyped-def]
    input, weight, bias, stride, padding, dilation, groups, activation="identity", negative_slope=0.01
):
    pass


def _batch_norm_signature(  # type: ignore[no-untyped-def]
    input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5
):
    pass


def _bound(signature_of: Callable[..., None], node: fx.Node) -> dict[str, Any] | None:
    """The node's arguments by name (defaults filled in), or None if they do not fit the signature."""
    try:
        bound = inspect.signature(signature_of).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _add_signature(input, other, *, alpha=1):  # type: ignore[no-untyped-def]
    pass


_CONV_TARGETS = (torch.conv2d, F.conv2d)
_ADD_FUNCTIONS = (torch.add, torch.Tensor.add)
_ADD_METHODS = {"add": False, "add_": True}  # method name -> writes into self
# Python's augmented assignments (what `a += b` and the like trace to), and item assignment.
_INPLACE_OPERATORS = (
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
    operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.setitem,
)
_BATCH_NORM_TARGETS = (F.batch_norm, torch.batch_norm)


def _is_convbias_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (torch.ops.convbias.forward, torch.ops.convbias.forward.default)


def _activation_of(node: fx.Node) -> tuple[str, float] | str | None:
    """(activation, negative_slope) for a node applying a supported activation to its first argument; a string saying
    why not for a supported activation that cannot be fused as traced; else None."""
    if node.op == "call_method":
        name = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid", "sigmoid_": "sigmoid", "tanh": "tanh", "tanh_": "tanh"}
        return (name[node.target], 0.01) if node.target in name and len(node.args) == 1 and not node.kwargs else None
    if node.op != "call_function":
        return None
    target = node.target
    if target in (F.relu, torch.relu, torch.relu_, F.relu_):
        return "relu", 0.01
    if target in (torch.sigmoid, F.sigmoid, torch.sigmoid_):
        return "sigmoid", 0.01
    if target in (torch.tanh, F.tanh, torch.tanh_):
        return "tanh", 0.01
    if target is F.silu:
        return "silu", 0.01
    if target in (F.gelu, torch._C._nn.gelu):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"none": ("gelu", 0.01), "tanh": ("gelu_tanh", 0.01)}.get(approximate) if isinstance(approximate, str) else None
    if target in (F.leaky_relu, torch._C._nn.leaky_relu, F.leaky_relu_, torch._C._nn.leaky_relu_):
        slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1 else 0.01)
        if isinstance(slope, fx.Node):
            # Under dynamic=True Dynamo traces a module's float attribute (nn.LeakyReLU.negative_slope) as a graph
            # input, unguarded: baking its present value into our op would go stale silently if it changed.
            return (
                "leaky_relu's negative_slope is traced as a symbolic float (dynamic shapes); set "
                "torch._dynamo.config.specialize_float = True to make it a constant that can be fused"
            )
        return ("leaky_relu", float(slope)) if isinstance(slope, (int, float)) and not isinstance(slope, bool) else None
    return None


def _add_operands(node: fx.Node) -> tuple[Any, Any, bool] | str | None:
    """(a, b, whether the add writes into a) for a node computing ``a + b`` as Dynamo records it (``operator.add``,
    ``operator.iadd`` for ``a += b``, ``torch.add``, the ``add`` / ``add_`` tensor methods); a string saying why not
    for an add that is not plainly ``a + b`` (an ``alpha``, an ``out=``); else None."""
    if node.op == "call_function" and node.target in (operator.add, operator.iadd):
        if len(node.args) != 2 or node.kwargs:
            return None
        return node.args[0], node.args[1], node.target is operator.iadd
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS:
        inplace, what = False, "torch.add"
    elif node.op == "call_method" and node.target in _ADD_METHODS:
        inplace, what = _ADD_METHODS[node.target], f"Tensor.{node.target}"  # type: ignore[index]
    else:
        return None
    args = _bound(_add_signature, node)
    if args is None:
        return f"{what} called with arguments other than (input, other, alpha=...)"
    alpha = args["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha != 1:
        return f"{what} with alpha={alpha} (only alpha=1 is fused)"
    return args["input"], args["other"], inplace


def _may_mutate(node: fx.Node) -> bool:
    """Whether the node may write into a tensor (an in-place op, a module call we cannot see into), as far as its
    target tells."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
    if node.op != "call_function":
        return False
    target = node.target
    if target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, name)._schema.is_mutable for name in target.overloads())
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    try:  # a function taking `inplace` positionally (F.relu(x, True))
        parameters = list(inspect.signature(target).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    if "inplace" in parameters:
        index = parameters.index("inplace")
        return len(node.args) > index and node.args[index] is True
    return False


# What Dynamo records for entering and leaving a torch.autocast region.
_AUTOCAST_SWITCHES = tuple(
    f for f in (getattr(torch.amp.autocast_mode, name, None) for name in ("_enter_autocast", "_exit_autocast")) if f is not None
)


def _statically_equal(a: Any, b: Any) -> bool:
    """a == b for ints and SymInts, True only where provable without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _example(node: Any) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for a node's value, if any."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _static_shape(tensor: torch.Tensor | None) -> list[int] | None:
    """A fake tensor's sizes as ints, or None where any is symbolic (or the tensor unknown)."""
    if tensor is None or not all(isinstance(size, int) for size in tensor.shape):
        return None
    return list(tensor.shape)


def _int_pair(value: Any) -> list[int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value, value]
    if isinstance(value, (list, tuple)) and len(value) in (1, 2):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value[0], value[-1]]
    return None


def _normalised_conv_args(args: dict[str, Any], weight: torch.Tensor) -> tuple[dict[str, Any] | None, str]:
    """stride, padding, dilation, groups as the op takes them, or (None, why not)."""
    stride, dilation = _int_pair(args["stride"]), _int_pair(args["dilation"])
    groups = args["groups"]
    if stride is None or dilation is None or not isinstance(groups, int) or isinstance(groups, bool):
        return None, "stride, dilation or groups is not a constant int"
    padding: Any = args["padding"]
    if padding == "valid":
        padding = [0, 0]
    elif padding == "same":
        kernel = [weight.shape[2], weight.shape[3]]
        if not all(isinstance(k, int) for k in kernel):
            return None, "padding='same' with a symbolic kernel size"
        totals = [dilation[d] * (kernel[d] - 1) for d in range(2)]
        if stride != [1, 1] or any(t % 2 for t in totals):
            return None, "padding='same' here needs asymmetric padding (even effective kernel)"
        padding = [t // 2 for t in totals]
    else:
        padding = _int_pair(padding)
        if padding is None:
            return None, f"padding {args['padding']!r} is not an int pair, 'valid' or 'same'"
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}, ""


# ---------------------------------------------------------------------------------------------------------------
# The rewrite.


def _fold_batchnorm(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of conv followed by eval-mode batch norm as one convolution, computed in FP32 from the
    current values and rounded once to the weight's dtype (called inside the compiled graph on every call)."""
    scale = torch.rsqrt(running_var.float() + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.float()
    shift = -running_mean.float() * scale
    if bias is not None:
        shift = shift + bias.float() * scale
    if bn_bias is not None:
        shift = shift + bn_bias.float()
    folded_weight = (weight.float() * scale.reshape(-1, 1, 1, 1)).to(weight.dtype)
    return folded_weight, shift.to(weight.dtype)


def _grad_mode_is_off_throughout(graph: fx.Graph) -> bool:
    """No gradient is recorded anywhere in the graph: grad mode off when compiling and never switched on inside."""
    if torch.is_grad_enabled():
        return False
    return not any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in graph.nodes)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, config: _Config) -> None:
        self.gm, self.graph, self.config = gm, gm.graph, config
        self.report = RewriteReport()
        self.inference = _grad_mode_is_off_throughout(self.graph)
        # Residual adds left unfused, reported at the end only if no other convolution took them (an add of two
        # convolutions' outputs, or a block's input that is a convolution's output, is seen from both sides).
        self.unfused_adds: list[tuple[fx.Node, str]] = []

    def skip(self, node: fx.Node, reason: str) -> None:
        self.report.skipped.append({"node": node.name, "reason": reason})
        LOG.info("left %s (%s) as it is: %s", node.name, node.format_node(), reason)

    def check_tensors(self, node: fx.Node, input: Any, weight: Any, bias: Any) -> str:
        """Why the op cannot take these tensors ("" when it can)."""
        x, w, out = _example(input), _example(weight), _example(node)
        if x is None or w is None or out is None:
            return "no recorded example value for the input, weight or output"
        if x.device.type not in self.config.devices:
            return f"device {x.device} (rewritten: {', '.join(self.config.devices)})"
        if out.dtype not in _SUPPORTED_DTYPES:
            return f"dtype {out.dtype} (supported: float16, bfloat16, float32)"
        if x.dim() != 4 or w.dim() != 4:
            return f"{x.dim()}-D input (the op takes (N, C, H, W))"
        if bias is not None:
            b = _example(bias)
            if b is None or b.dtype != w.dtype or b.dim() != 1:
                return "the bias is not a 1-D tensor of the weight's dtype"
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type) and not self._in_autocast(node):
            return f"input dtype {x.dtype} differs from the weight's {w.dtype}"
        return ""

    def _in_autocast(self, node: fx.Node) -> bool:
        """Whether an autocast region Dynamo recorded encloses the node (then dtypes may differ, as for conv2d)."""
        enter = getattr(torch.amp.autocast_mode, "_enter_autocast", None)
        exit_ = getattr(torch.amp.autocast_mode, "_exit_autocast", None)
        depth = 0
        for n in self.graph.nodes:
            if n is node:
                return depth > 0
            if n.op == "call_function" and enter is not None and n.target is enter:
                depth += 1
            elif n.op == "call_function" and exit_ is not None and n.target is exit_:
                depth -= 1
        return False

    def single_user(self, node: fx.Node) -> fx.Node | None:
        users = list(node.users)
        return users[0] if len(users) == 1 else None

    def residual_of(self, conv: fx.Node, side: fx.Node, add: fx.Node) -> fx.Node | str | None:
        """The other operand of ``add``, ``side + r`` where ``side`` is the convolution's output (or its folded batch
        norm's) and its only reader, if the op can take ``act(conv + r)`` in the add's place; a string saying why not
        for an add that cannot be fused; None when ``add`` is not an add."""
        operands = _add_operands(add)
        if operands is None or isinstance(operands, str):
            return operands
        a, b, inplace = operands
        if a is side and b is side:
            return "both operands are the convolution's output"
        if a is side:
            other = b
        elif b is side:
            if inplace:
                return "the add writes in place into the other operand, not into the convolution's output"
            other = a
        else:
            return "the convolution's output is not an operand of the add"
        r, y, out, result = _example(other), _example(side), _example(conv), _example(add)
        if r is None:
            return "the other operand is not a tensor with a recorded example value"
        if y is None or out is None or result is None:
            return "no recorded example value for the convolution's output or the add's result"
        if r.dim() != y.dim() or not all(_statically_equal(p, q) for p, q in zip(r.shape, y.shape)):
            return f"the other operand's shape {list(r.shape)} is not the convolution output's {list(y.shape)} (broadcasting)"
        if r.dtype != y.dtype:
            return f"the other operand's dtype {r.dtype} is not the convolution output's {y.dtype} (type promotion)"
        if r.device != y.device:
            return f"the other operand is on {r.device}, the convolution's output on {y.device}"
        if result.dtype != out.dtype or result.dim() != out.dim():
            return f"the add's result ({result.dtype}) is not of the convolution output's dtype {out.dtype}"
        if not all(
            _statically_equal(size, 1) or _statically_equal(p, q) for size, p, q in zip(out.shape, result.stride(), out.stride())
        ):
            return "the add's result has another memory layout than the convolution's output (the op keeps the latter)"
        # The op reads its operands where the add stood: nothing may have changed them since the convolution.
        node = conv.next
        while node is not add:
            if node is not side:
                if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                    return "grad mode changes between the convolution and the add"
                if node.op == "call_function" and node.target in _AUTOCAST_SWITCHES:
                    return "an autocast region begins or ends between the convolution and the add"
                if _may_mutate(node):
                    return f"an in-place operation ({node.name}) runs between the convolution and the add"
            node = node.next
        return other

    def fold_batchnorm(self, conv: fx.Node, bn: fx.Node, args: dict[str, Any]) -> tuple[Any, Any] | str:
        """Folded (weight, bias) nodes for conv -> bn, inserted before the convolution, or why not."""
        bn_args = _bound(_batch_norm_signature, bn)
        if bn_args is None or bn_args["training"] is not False:
            return "batch norm in training mode"
        if not self.inference:
            return "gradients are recorded (batch norm is folded for inference only)"
        if not isinstance(bn_args["running_mean"], fx.Node) or not isinstance(bn_args["running_var"], fx.Node):
            return "batch norm without running statistics"
        eps = bn_args["eps"]
        if not isinstance(eps, (int, float)):
            return "batch norm eps is not a constant"
        # Before the batch norm: every argument of both is defined by then.
        with self.graph.inserting_before(bn):
            folded = self.graph.call_function(
                _fold_batchnorm,
                (args["weight"], args["bias"], bn_args["running_mean"], bn_args["running_var"], bn_args["weight"], bn_args["bias"], float(eps)),
            )
            weight = self.graph.call_function(operator.getitem, (folded, 0))
            bias = self.graph.call_function(operator.getitem, (folded, 1))
        return weight, bias

    def rewrite(self, conv: fx.Node) -> None:
        from_convbias = _is_convbias_op(conv)
        args = _bound(_convbias_signature if from_convbias else _conv2d_signature, conv)
        if args is None:
            return self.skip(conv, "arguments do not match conv2d's signature")
        if from_convbias and (args["activation"] != "identity"):
            return  # already fused
        reason = self.check_tensors(conv, args["input"], args["weight"], args["bias"])
        if reason:
            return self.skip(conv, reason)
        conv_args, reason = (
            ({k: args[k] for k in ("stride", "padding", "dilation", "groups")}, "")
            if from_convbias
            else _normalised_conv_args(args, _example(args["weight"]))  # type: ignore[arg-type]
        )
        if conv_args is None:
            return self.skip(conv, reason)

        weight, bias, last, batchnorm_folded = args["weight"], args["bias"], conv, False
        chain = [conv]  # the nodes the op replaces, in order; the last one's users get the op's result
        follower = self.single_user(conv)
        if self.config.fold_batchnorm and follower is not None and follower.target in _BATCH_NORM_TARGETS:
            folded = self.fold_batchnorm(conv, follower, args)
            if isinstance(folded, str):
                self.skip(follower, f"batch norm not folded: {folded}")
            else:
                (weight, bias), last, batchnorm_folded = folded, follower, True
                chain.append(follower)

        residual: fx.Node | None = None
        follower = self.single_user(last)
        if self.config.fuse_residual and follower is not None:
            found_residual = self.residual_of(conv, last, follower)
            if isinstance(found_residual, str):
                self.unfused_adds.append((follower, found_residual))
            elif found_residual is not None:
                residual, last = found_residual, follower
                chain.append(follower)
        elif self.config.fuse_residual and len(last.users) > 1:
            for user in last.users:
                if _add_operands(user) is not None:
                    self.unfused_adds.append((user, "the convolution's output has other users"))
        add = last if residual is not None else None

        activation, slope = "identity", 0.01
        follower = self.single_user(last)
        if self.config.fuse_activations and follower is not None:
            found = _activation_of(follower)
            if isinstance(found, str):
                self.skip(follower, f"activation not fused: {found}")
            elif found is not None and follower.args and follower.args[0] is last:
                (activation, slope), last = found, follower
                chain.append(follower)
        elif self.config.fuse_activations and len(last.users) > 1:
            if any(isinstance(_activation_of(u), tuple) for u in last.users):
                what = "residual add" if residual is not None else "convolution"
                self.skip(last, f"activation not fused: the {what}'s output has other users")

        if bias is None and activation == "identity" and residual is None and not from_convbias:
            return self.skip(conv, "no bias, batch norm or activation to fuse")
        if from_convbias and activation == "identity" and not batchnorm_folded and residual is None:
            return  # a ConvBias2d alone is already the op

        conv_operands = (
            conv_args["stride"],
            conv_args["padding"],
            conv_args["dilation"],
            conv_args["groups"],
            activation,
            float(slope),
        )
        # The residual op stands where the add stood (the other operand may be computed after the convolution, e.g.
        # a downsample branch); the activation, when fused, has no other input.
        with self.graph.inserting_before(add if add is not None else last):
            if residual is not None:
                fused = self.graph.call_function(
                    torch.ops.convbias.forward_residual.default, (args["input"], weight, bias, residual, *conv_operands)
                )
            else:
                fused = self.graph.call_function(torch.ops.convbias.forward.default, (args["input"], weight, bias, *conv_operands))
        fused.meta.update({k: v for k, v in last.meta.items() if k in ("example_value", "val", "stack_trace", "nn_module_stack")})
        # Every reader of the last node (for `out += r`, of the in-place add's result: the same tensor as the
        # convolution's output, which nothing else reads) now reads the op's new tensor.
        last.replace_all_uses_with(fused)
        for node in reversed(chain):
            self.graph.erase_node(node)
        record = {
            "node": conv.name,
            "activation": activation,
            "batchnorm_folded": batchnorm_folded,
            "bias": bias is not None,
            "residual": residual is not None,
            # The problem, where its sizes are static (a dynamic batch: None): what explain() takes, to say how the
            # op runs each rewritten layer (bench/bench_models.py's per-layer paths).
            "input_shape": _static_shape(_example(args["input"])),
            "weight_shape": _static_shape(_example(args["weight"])),
            "stride": list(conv_args["stride"]),
            "padding": list(conv_args["padding"]),
            "dilation": list(conv_args["dilation"]),
            "groups": conv_args["groups"],
            "slope": float(slope),
        }
        self.report.rewrites.append(record)
        LOG.info(
            "rewrote %s into convbias.%s (activation %s%s%s)",
            conv.name,
            "forward_residual" if residual is not None else "forward",
            activation,
            ", batch norm folded" if batchnorm_folded else "",
            f", residual add of {residual.name}" if residual is not None else "",
        )

    def run(self) -> RewriteReport:
        candidates = [
            n for n in self.graph.nodes if (n.op == "call_function" and n.target in _CONV_TARGETS) or _is_convbias_op(n)
        ]
        for conv in candidates:
            self.rewrite(conv)
        live = set(self.graph.nodes)
        for add, reason in dict.fromkeys(self.unfused_adds):
            if add in live:
                self.skip(add, f"residual add not fused: {reason}")
        if self.report.rewrites:
            self.graph.lint()
            self.gm.recompile()
        return self.report


def rewrite_graph(gm: fx.GraphModule, **options: Any) -> RewriteReport:
    """Rewrite, in place, the convolutions of a Dynamo graph into ``convbias.forward`` (see the module docstring;
    ``options`` are the backend's without the ``convbias.`` prefix). Returns what was done."""
    return _rewrite(gm, _config_from({f"{_OPTION_PREFIX}{k}": v for k, v in options.items()}))


def _rewrite(gm: fx.GraphModule, config: _Config) -> RewriteReport:
    report = _Rewriter(gm, config).run()
    reports.append(report)
    return report


def _inductor(mode: str | None, options: dict[str, Any]) -> Callable[..., Any]:
    """Inductor as torch.compile(mode=..., options=...) would call it: torch's own wrapper (which checks the options
    and maps the mode to Inductor settings), else compile_fx with the mode's settings and the options as patches."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    if wrapper is not None:
        return wrapper(mode, options, None)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**(list_mode_options(mode) if mode else {}), **options}
    return lambda gm, inputs: compile_fx(gm, inputs, config_patches=patches)


_FREEZING_WARNED = False


def _warn_if_freezing_only_in_options(options: dict[str, Any]) -> None:
    """``options={"freezing": True}`` freezes nothing under torch.compile, ours or Inductor's: Dynamo decides when it
    traces, from the global ``torch._inductor.config.freezing``, whether parameters may become constants, and by the
    time a backend sees the options they are graph inputs. Said once per process, in inference (where freezing acts)."""
    global _FREEZING_WARNED
    import torch._inductor.config as inductor_config

    if _FREEZING_WARNED or not options.get("freezing") or inductor_config.freezing or torch.is_grad_enabled():
        return
    _FREEZING_WARNED = True
    warnings.warn(
        "convbias backend: options={'freezing': True} freezes no parameter (Dynamo decides while tracing, from "
        "torch._inductor.config.freezing, whether parameters may become constants; the same holds for Inductor's own "
        "backend). Set torch._inductor.config.freezing = True, or call the compiled model inside "
        "torch._inductor.config.patch(freezing=True), for parameters and folded batch norms to become constants.",
        UserWarning,
        stacklevel=2,
    )


def convbias_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The ``convbias`` torch.compile backend: :func:`rewrite_graph`, then Inductor with ``mode`` and ``options``
    (the ``convbias.*`` options are this backend's, see the module docstring)."""
    options = dict(options or {})
    ours = {key: options.pop(key) for key in list(options) if key.startswith(_OPTION_PREFIX)}
    config = _config_from(ours)
    _rewrite(gm, config)
    if config.inner == "inductor":
        _warn_if_freezing_only_in_options(options)
        if config.activation_backward != "ours":
            # Chained: a pre-pass the caller set (in options, else in Inductor's config) still runs, after ours.
            import torch._inductor.config as inductor_config

            theirs = options.get("post_grad_custom_pre_pass", inductor_config.post_grad_custom_pre_pass)
            options["post_grad_custom_pre_pass"] = _backward_fusion.ActivationBackwardPass(config.activation_backward, theirs)
        return _inductor(mode, options)(gm, list(example_inputs))
    if mode is not None or options:
        raise ValueError(f"convbias backend: `mode` and Inductor `options` need convbias.inner='inductor', got {config.inner!r}")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(config.inner)(gm, list(example_inputs))  # type: ignore[arg-type]


def compile(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile(model, backend="convbias", **kwargs)``: ``fullgraph``, ``dynamic``, ``mode``, ``options``
    (Inductor's, plus the ``convbias.*`` ones) as torch.compile takes them."""
    if "backend" in kwargs:
        raise ValueError("torch_convbias.compile: the backend is convbias; use torch.compile for another one")
    return torch.compile(model, backend="convbias", **kwargs) if model is not None else torch.compile(backend="convbias", **kwargs)


def _register() -> None:
    """Register the backend under "convbias" unless the installed package's entry point will (registering twice
    would fail when Dynamo loads the entry point after this module was imported through it)."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if "convbias" in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get("convbias") is not None:
        return  # a discovered entry point: Dynamo loads and registers it
    if "convbias" in entry_points(group="torch_dynamo_backends").names:
        return
    registry.register_backend(convbias_backend, name="convbias")


_register()

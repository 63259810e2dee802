"""torch_convbias: convolution + bias as one fused cuDNN graph, with cuDNN parameter-gradient graphs.

Public API:

* ``torch.ops.convbias.forward(input, weight, bias, stride, padding, dilation, groups)`` and
  ``torch.ops.convbias.param_grad(...)``: the operators (differentiable, torch.compile-able);
* :func:`conv_bias2d` (``torch_convbias.functional``): ``F.conv2d``'s signature;
* :class:`ConvBias2d`: a drop-in ``nn.Conv2d``; :func:`convert` swaps a model's ``nn.Conv2d`` layers;
* :class:`ConvBiasFunction`: the same forward/backward as an ``autograd.Function``;
* ``torch.compile(model, backend="convbias")`` / :func:`compile`: unmodified nn.Conv2d models rewritten into the op
  (``torch_convbias.compiler``);
* :func:`explain`, :func:`explain_param_grad`, :func:`explain_activation_backward`, :func:`cache_info`, :func:`cache_clear`, :func:`versions`; ``python -m torch_convbias.doctor``.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The operators live in libtorch_convbias.so (loading it registers torch.ops.convbias.*; LibTorch programs link
# the same file); _C holds the Python entry points.
LIBRARY_PATH = Path(__file__).with_name("libtorch_convbias.so")
try:
    torch.ops.load_library(str(LIBRARY_PATH))
    from . import _C  # noqa: F401
except (ImportError, OSError) as error:  # pragma: no cover - only when the extension was not built
    raise ImportError(
        f"torch_convbias: the compiled library could not be loaded ({error}). "
        "Build it against the installed torch (see README.md: `./dev.sh setup`)."
    ) from error

from . import diagnostics, functional, ops  # noqa: E402  (ops registers fake kernels and autograd)
from . import compiler  # noqa: E402  (registers the "convbias" torch.compile backend)
from .autograd import ConvBiasFunction  # noqa: E402
from .compiler import compile  # noqa: E402
from .diagnostics import (  # noqa: E402
    cache_clear,
    cache_info,
    explain,
    explain_activation_backward,
    explain_input_grad_activation,
    explain_param_grad,
    versions,
)
from .functional import conv_bias2d  # noqa: E402
from .nn import ConvBias2d, convert  # noqa: E402

__all__ = [
    "ConvBias2d",
    "ConvBiasFunction",
    "cache_clear",
    "cache_info",
    "compile",
    "compiler",
    "conv_bias2d",
    "convert",
    "diagnostics",
    "explain",
    "explain_activation_backward",
    "explain_input_grad_activation",
    "explain_param_grad",
    "functional",
    "ops",
    "versions",
]
__version__ = "0.1.0"

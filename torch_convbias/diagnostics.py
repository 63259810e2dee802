"""What torch_convbias was built against and what it runs with."""

from __future__ import annotations

import torch


def _version_string(encoded: int) -> str:
    """cuDNN 9 encodes major*10000 + minor*100 + patch; the frontend major*10000 + minor*100 + patch too."""
    return f"{encoded // 10000}.{encoded // 100 % 100}.{encoded % 100}"


def versions() -> dict[str, str | None]:
    """Versions of torch, CUDA and cuDNN (compiled against and loaded), and of the cuDNN frontend."""
    compiled, loaded, frontend = torch.ops.convbias._cudnn_versions()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn_compiled": _version_string(compiled),
        "cudnn_loaded": _version_string(loaded),
        "cudnn_frontend": _version_string(frontend),
    }

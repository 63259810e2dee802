"""Convolution cases for the tests: a seeded random grid plus hand-picked edge cases."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    n: int
    c: int
    h: int
    w: int
    k: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    bias: bool
    channels_last: bool

    @property
    def id(self) -> str:
        return (
            f"n{self.n}c{self.c}h{self.h}w{self.w}k{self.k}-r{self.kernel[0]}x{self.kernel[1]}"
            f"-s{self.stride[0]}{self.stride[1]}-p{self.padding[0]}{self.padding[1]}"
            f"-d{self.dilation[0]}{self.dilation[1]}-g{self.groups}{'-bias' if self.bias else ''}"
            f"{'-cl' if self.channels_last else ''}"
        )

    def conv_args(self) -> tuple[list[int], list[int], list[int], int]:
        return list(self.stride), list(self.padding), list(self.dilation), self.groups

    def tensors(
        self, device: str, dtype: torch.dtype, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input, weight, bias) of unit-scale outputs: weights scaled by 1/sqrt(fan_in) as nn.Conv2d does."""
        g = torch.Generator().manual_seed(seed)
        fan_in = (self.c // self.groups) * self.kernel[0] * self.kernel[1]
        x = torch.randn(self.n, self.c, self.h, self.w, generator=g, dtype=torch.float64)
        w = torch.randn(self.k, self.c // self.groups, *self.kernel, generator=g, dtype=torch.float64) / fan_in**0.5
        b = torch.randn(self.k, generator=g, dtype=torch.float64) if self.bias else None
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        x = x.to(device=device, dtype=dtype).contiguous(memory_format=fmt)
        w = w.to(device=device, dtype=dtype).contiguous(memory_format=fmt)
        b = b.to(device=device, dtype=dtype) if b is not None else None
        return x, w, b


def _fits(case: Case) -> bool:
    return all(
        case.dilation[d] * (case.kernel[d] - 1) + 1 <= (case.h, case.w)[d] + 2 * case.padding[d] for d in range(2)
    )


def random_cases(count: int, seed: int) -> list[Case]:
    """`count` valid cases drawn with a fixed seed: groups (depthwise included), non-square kernels, unequal
    height/width stride, padding and dilation, bias on and off, NCHW and channels_last."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < count:
        groups = rng.choice([1, 1, 2, 3])
        c = groups * rng.randint(1, 4)
        depthwise = rng.random() < 0.2
        if depthwise:
            groups = c
        k = groups * rng.randint(1, 3)
        case = Case(
            n=rng.randint(1, 3),
            c=c,
            h=rng.randint(4, 11),
            w=rng.randint(4, 11),
            k=k,
            kernel=(rng.randint(1, 3), rng.randint(1, 3)),
            stride=(rng.randint(1, 2), rng.randint(1, 2)),
            padding=(rng.randint(0, 2), rng.randint(0, 2)),
            dilation=(rng.randint(1, 2), rng.randint(1, 2)),
            groups=groups,
            bias=rng.random() < 0.7,
            channels_last=rng.random() < 0.5,
        )
        if _fits(case):
            cases.append(case)
    return cases


EDGE_CASES = [
    # the seed case of the project: N=C=H=W=K=16, 3x3, pad 1, NCHW
    Case(16, 16, 16, 16, 16, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, False),
    Case(16, 16, 16, 16, 16, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, True),
    # C=3 stem (odd channel count), 7x7 stride 2 pad 3
    Case(2, 3, 20, 20, 8, (7, 7), (2, 2), (3, 3), (1, 1), 1, True, True),
    # depthwise with channel multiplier 2
    Case(2, 8, 9, 9, 16, (3, 3), (1, 1), (1, 1), (1, 1), 8, True, True),
    # 1x1
    Case(3, 16, 7, 7, 32, (1, 1), (1, 1), (0, 0), (1, 1), 1, True, True),
    # unequal stride/padding/dilation along H and W
    Case(2, 4, 10, 13, 6, (3, 2), (2, 1), (2, 0), (1, 2), 2, False, False),
]

CASES = EDGE_CASES + random_cases(18, seed=20261202)


def input_grad_float64(
    dy: torch.Tensor, w: torch.Tensor, x_shape: torch.Size, case: Case
) -> torch.Tensor:
    """dL/dx of y = conv2d(x, w) for dL/dy = dy, in float64 on the CPU: each tap (r, s) of the kernel scatters
    dy @ w[:, :, r, s] back onto the strided, dilated window of the padded input it read."""
    n, c, h, width = x_shape
    k, groups = w.shape[0], case.groups
    cg, kg = c // groups, k // groups
    (sh, sw), (ph, pw), (dh, dw) = case.stride, case.padding, case.dilation
    dy, w = dy.detach().cpu().double(), w.detach().cpu().double()
    ho, wo = dy.shape[2:]
    padded = torch.zeros(n, c, h + 2 * ph, width + 2 * pw, dtype=torch.float64)
    for g in range(groups):
        for r in range(w.shape[2]):
            for s in range(w.shape[3]):
                tap = torch.einsum("nkhw,kc->nchw", dy[:, g * kg:(g + 1) * kg], w[g * kg:(g + 1) * kg, :, r, s])
                padded[:, g * cg:(g + 1) * cg, r * dh:r * dh + sh * (ho - 1) + 1:sh,
                       s * dw:s * dw + sw * (wo - 1) + 1:sw] += tap
    return padded[:, :, ph:ph + h, pw:pw + width]

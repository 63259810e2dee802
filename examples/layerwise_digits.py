"""Greedy layer-by-layer training of a small CNN on scikit-learn's digits.

Each conv layer is trained on its own, with a small auxiliary classifier
head on top, while the layers below it stay frozen: their output is computed
once under ``torch.no_grad()``, so the input of the layer being trained never
requires grad and backward needs only the weight and bias gradients.  That is
the case ``torch_convbias.ConvBias2d`` is built for, so the script runs the
same procedure (same seed, same split, same initial weights) with
``ConvBias2d`` and with ``torch.nn.Conv2d`` and prints, per layer, the test
accuracy of that layer's head and its training time, side by side.

Run it from the repository root, after building the extension (see README.md):

    python examples/layerwise_digits.py [--device cpu|cuda] [--epochs N]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# Lets an in-place build in the repository root be found when the script is
# run as `python examples/...`; appended, so an installed package wins.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from torch_convbias import ConvBias2d  # noqa: E402  (its ImportError says how to build the extension)

# (in_channels, out_channels, stride) of each 3x3 conv; 8x8 -> 8x8 -> 8x8 -> 4x4.
LAYERS = ((1, 32, 1), (32, 64, 1), (64, 64, 2))


@dataclass
class Data:
    x_train: torch.Tensor  # (N, 1, 8, 8) standardized float32
    y_train: torch.Tensor  # (N,) int64 labels 0..9
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class LayerResult:
    layer: int
    accuracy: float  # test accuracy of this layer's auxiliary head
    seconds: float  # training time of this layer (plus its frozen feature pass)


def load_digits_data(seed: int = 0, test_fraction: float = 0.2) -> Data:
    """Load sklearn's digits, split it with a seeded permutation, standardize."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    # Statistics from the training split only, so the test set stays unseen.
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Data(x[train], y[train], x[test], y[test])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_layerwise(
    conv_cls: type[nn.Conv2d],
    data: Data,
    epochs: int,
    device: torch.device | str,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
) -> list[LayerResult]:
    """Train the LAYERS stack greedily with ``conv_cls`` convs; one result per layer.

    Every conv class starts from the same weights for a given ``seed``, and
    sees the same batches, so runs differ only in the conv implementation.
    """
    device = torch.device(device)
    # channels_last is the layout cuDNN prefers; on CPU keep the default.
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    # Seeded init, drawn from nn.Conv2d and copied into conv_cls (same
    # state_dict) so it cannot depend on what conv_cls's constructor draws;
    # forked so the caller's RNG state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inits = [nn.Conv2d(i, o, 3, s, padding=1).state_dict() for i, o, s in LAYERS]
        linears = [nn.Linear(4 * o, 10) for _, o, _ in LAYERS]
        convs = [conv_cls(i, o, 3, s, padding=1) for i, o, s in LAYERS]
    for conv, init in zip(convs, inits):
        conv.load_state_dict(init)
    results = []
    x_tr = data.x_train.to(device, memory_format=fmt)
    x_te = data.x_test.to(device, memory_format=fmt)
    y_tr, y_te = data.y_train.to(device), data.y_test.to(device)
    for k, (conv, linear) in enumerate(zip(convs, linears), start=1):
        block = nn.Sequential(conv, nn.ReLU()).to(device, memory_format=fmt)
        # Aux head: pooling to 2x2 keeps a coarse layout yet stays tiny.
        pool = nn.AdaptiveAvgPool2d(2)
        head = nn.Sequential(pool, nn.Flatten(), linear).to(device)
        opt = torch.optim.Adam([*block.parameters(), *head.parameters()], lr=lr)
        shuffle = torch.Generator().manual_seed(seed + k)

        _sync(device)
        start = time.perf_counter()
        for _ in range(epochs):
            # One host-to-device copy per epoch rather than a blocking one per step.
            perm = torch.randperm(len(y_tr), generator=shuffle).to(device)
            for idx in perm.split(batch_size):
                loss = nn.functional.cross_entropy(head(block(x_tr[idx])), y_tr[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        # Freeze the layer: its outputs, computed without autograd, are the
        # next layer's inputs and so never require grad.
        with torch.no_grad():
            x_tr, x_te = block(x_tr), block(x_te)
        _sync(device)
        seconds = time.perf_counter() - start

        with torch.no_grad():
            acc = (head(x_te).argmax(1) == y_te).float().mean().item()
        results.append(LayerResult(k, acc, seconds))
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the demo with both conv classes and print the comparison table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=f"default: {default}")
    parser.add_argument("--epochs", type=int, default=20, help="epochs per layer")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    data = load_digits_data(args.seed)
    print(
        f"digits: {len(data.y_train)} train / {len(data.y_test)} test, "
        f"device={device}, epochs/layer={args.epochs}, batch={args.batch_size}"
    )
    classes: list[tuple[str, type[nn.Conv2d]]] = [
        ("ConvBias2d", ConvBias2d),
        ("nn.Conv2d", nn.Conv2d),
    ]
    # Untimed warm-up on a small slice, so one-off costs (CUDA context,
    # kernel selection, allocator growth) are not billed to whichever
    # variant happens to run first.
    n = 2 * args.batch_size
    tiny = Data(data.x_train[:n], data.y_train[:n], data.x_test[:n], data.y_test[:n])
    for _, cls in classes:
        train_layerwise(cls, tiny, 1, device, args.batch_size, seed=args.seed)

    runs = [
        train_layerwise(cls, data, args.epochs, device, args.batch_size, seed=args.seed)
        for _, cls in classes
    ]

    (name_a, _), (name_b, _) = classes
    print(f"\n{'layer':>5}  {name_a + ' acc':>14} {'time':>7}  "
          f"{name_b + ' acc':>14} {'time':>7}  {'speedup':>7}")
    for a, b in zip(*runs):
        print(f"{a.layer:>5}  {a.accuracy:>14.4f} {a.seconds:>6.2f}s  "
              f"{b.accuracy:>14.4f} {b.seconds:>6.2f}s  {b.seconds / a.seconds:>6.2f}x")
    total_a = sum(r.seconds for r in runs[0])
    total_b = sum(r.seconds for r in runs[1])
    print(f"{'total':>5}  {'':>14} {total_a:>6.2f}s  {'':>14} {total_b:>6.2f}s  "
          f"{total_b / total_a:>6.2f}x")
    print(f"\nspeedup = {name_b} time / {name_a} time (> 1 means {name_a} is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

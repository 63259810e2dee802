"""ConvBias2d as a drop-in nn.Conv2d, and conversion of existing models."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from torch import nn

from torch_convbias import ConvBias2d, convert

CONSTRUCTORS = {
    "plain": dict(in_channels=4, out_channels=6, kernel_size=3),
    "padded-strided": dict(in_channels=4, out_channels=6, kernel_size=(3, 2), stride=(2, 1), padding=(1, 0)),
    "same-dilated": dict(in_channels=4, out_channels=8, kernel_size=(4, 3), padding="same", dilation=(1, 2)),
    "valid-no-bias": dict(in_channels=4, out_channels=6, kernel_size=3, padding="valid", bias=False),
    "groups": dict(in_channels=4, out_channels=8, kernel_size=3, padding=1, groups=2),
    "depthwise": dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4),
    "reflect": dict(in_channels=4, out_channels=6, kernel_size=3, padding=(2, 1), padding_mode="reflect"),
    "replicate": dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="replicate"),
    "circular": dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="circular"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", list(CONSTRUCTORS.values()), ids=list(CONSTRUCTORS))
def test_drop_in_for_conv2d(device: str, kwargs: dict) -> None:
    torch.manual_seed(0)
    reference = nn.Conv2d(**kwargs, device=device, dtype=torch.float64)
    ours = ConvBias2d(**kwargs, device=device, dtype=torch.float64)
    assert isinstance(ours, nn.Conv2d)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    ours.load_state_dict(reference.state_dict())
    assert repr(ours).replace("ConvBias2d", "Conv2d") == repr(reference)
    x = torch.randn(2, 4, 9, 10, device=device, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, expected = ours(x), reference(x2)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_state_dict_round_trip() -> None:
    reference = nn.Conv2d(3, 5, 3, padding=1)
    ours = ConvBias2d(3, 5, 3, padding=1)
    ours.load_state_dict(reference.state_dict())
    back = nn.Conv2d(3, 5, 3, padding=1)
    back.load_state_dict(ours.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.ReLU(), nn.Conv2d(8, 16, 1), nn.ReLU()
        )
        self.shared = nn.Conv2d(16, 16, 3, padding=1)
        self.again = self.shared  # one module reached twice
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.again(self.shared(self.body(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


class CustomConv(nn.Conv2d):
    """A subclass may change forward: convert() must leave it alone."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2


def test_convert_small_cnn_identical_outputs_and_shared_parameters() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    model.custom = CustomConv(3, 3, 1)
    x = torch.randn(2, 3, 12, 12)
    expected = model(x)
    weights = {name: p for name, p in model.named_parameters()}
    assert convert(model) is model
    assert type(model.stem) is ConvBias2d and type(model.body[0]) is ConvBias2d and type(model.body[2]) is ConvBias2d
    assert model.shared is model.again and type(model.shared) is ConvBias2d
    assert type(model.custom) is CustomConv
    for name, p in model.named_parameters():
        assert p is weights[name], f"{name} is not shared with the original model"
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_from_conv_shares_parameters_and_hooks() -> None:
    conv = nn.Conv2d(2, 3, 3)
    calls: list[str] = []
    conv.register_forward_hook(lambda *_: calls.append("hook"))
    converted = ConvBias2d.from_conv(conv.eval())
    assert converted.weight is conv.weight and converted.bias is conv.bias
    assert not converted.training
    converted(torch.randn(1, 2, 5, 5))
    assert calls == ["hook"]
    converted.register_buffer("extra", torch.zeros(1))
    assert "extra" not in dict(conv.named_buffers())


def test_convert_root_conv_and_ineligible() -> None:
    conv = nn.Conv2d(2, 3, 3)
    assert type(convert(conv)) is ConvBias2d
    with pytest.raises(TypeError, match="only plain nn.Conv2d modules are converted"):
        ConvBias2d.from_conv(CustomConv(2, 3, 3))
    with pytest.raises(TypeError, match="weight dtype torch.complex64 is not one of"):
        ConvBias2d.from_conv(nn.Conv2d(2, 3, 3, dtype=torch.complex64))
    complex_model = nn.Sequential(nn.Conv2d(2, 3, 3, dtype=torch.complex64))
    assert type(convert(complex_model)[0]) is nn.Conv2d

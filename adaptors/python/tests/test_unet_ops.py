"""Models built from the ops a U-Net adds, trained on a real salusd's CPU device.

- A small U-Net: convolutions with GroupNorm, a strided and a dilated grouped
  ConvTranspose2d (stride, padding, output_padding, groups, dilation), nearest and
  bilinear upsampling (``scale_factor`` and ``size``, ``align_corners`` both ways),
  constant and reflection padding, max pooling and skip connections through ``cat``.
- A model of cumulative sums, flips and elementwise maxima and minima.
- A block of a parameter's copy written through a view (as swin v2's attention bias).
- A diffusion model's timestep embedding and learned Fourier features: sines and
  cosines, of a batch input and of trained values.
- Sliding windows and patches (``Tensor.unfold``) of trained features.

Each trains 3 steps (SGD with momentum) on salusd and must be as close to the same
steps run eagerly in float64 as eager PyTorch in float32 is (the rule of
``harness.assert_as_exact_as_pytorch``), loss by loss and tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from daemon import Daemon
from harness import (assert_as_exact_as_pytorch, check_graph_structure, eager_steps,
                     randomly_rounded, to_dtype, torch_state, twin)
from torch import nn

import salus
import salus.torch as st
from salus.lower import supported_ops

STEPS = 3


def _block(cin: int, cout: int, groups: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(groups, cout),
                         nn.ReLU())


class UNet(nn.Module):
    """Two levels down (max pooling, a strided convolution), back up by transposed
    convolutions and nearest upsampling, with skip connections; a side path of bilinear
    and nearest upsampling; reflection and constant padding."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stem_norm = nn.Sequential(nn.Conv2d(c, c, 3), nn.GroupNorm(2, c), nn.ReLU())
        self.down1 = nn.Sequential(nn.MaxPool2d(2), _block(c, 2 * c, 4))
        self.down2 = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1),
                                   nn.GroupNorm(4, 2 * c), nn.ReLU())
        self.up_t = nn.ConvTranspose2d(2 * c, 2 * c, 3, stride=2, padding=1, output_padding=1)
        self.up_g = nn.ConvTranspose2d(2 * c, 2 * c, 3, stride=2, padding=2, output_padding=1,
                                       groups=2, dilation=2)
        self.dec1 = _block(4 * c, 2 * c, 4)
        self.up_n = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec0 = _block(3 * c, c, 2)
        self.side = nn.Conv2d(2 * c, c, 1)
        self.crop = nn.Conv2d(c, c, 2)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        e0 = self.stem_norm(F.pad(self.stem(x), (1, 1, 1, 1), mode="reflect"))
        e1 = self.down1(e0)
        b = self.down2(e1)
        d1 = self.dec1(torch.cat([self.up_t(b) + self.up_g(b), e1], dim=1))
        d0 = self.dec0(torch.cat([self.up_n(d1), e0], dim=1))
        s = F.interpolate(b, scale_factor=4, mode="bilinear", align_corners=False)
        s = s + F.interpolate(d1, size=(16, 16), mode="bilinear", align_corners=True)
        s = s + F.interpolate(e1, size=(16, 16), mode="nearest")
        h = self.crop(F.pad(d0 + self.side(s), (0, 1, 0, 1), value=0.25))
        return self.head(h)


class Scan(nn.Module):
    """Running sums, a reversed copy and their elementwise maxima and minima."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.out = nn.Linear(10, 3)

    def forward(self, x):
        h = self.fc(x)
        running = torch.cumsum(h, dim=1)
        reversed_ = torch.flip(h, dims=[1])
        return self.out(torch.maximum(running, reversed_) + torch.minimum(h, 0.5 * running))


def _unet_case():
    torch.manual_seed(0)
    model = UNet()
    batches = [(torch.randn(2, 3, 16, 16), torch.randn(2, 2, 16, 16)) for _ in range(STEPS)]
    return model, batches


def _scan_case():
    torch.manual_seed(1)
    model = Scan()
    batches = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(STEPS)]
    return model, batches


class BlockWrite(nn.Module):
    """Swin v2's attention bias: a copy of a parameter with a dense block zeroed through a
    view (``as_strided_scatter`` and ``as_strided`` after functionalization), then used."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(6, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        bias = self.qkv.bias.clone()
        bias[4:8].zero_()
        return self.out(F.linear(x, self.qkv.weight, bias).relu() + bias[4:8].sum())


def _block_case():
    torch.manual_seed(0)
    batches = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(STEPS)]
    return BlockWrite(), batches


class Timesteps(nn.Module):
    """A diffusion model's conditioning: each example's timestep (a batch input, up to
    1000) as sines and cosines at geometric frequencies (the sinusoidal embedding of
    DDPM and Stable Diffusion), and learned Fourier features of the input, whose
    frequencies train through sin's and cos's gradients."""

    def __init__(self, dim: int = 16):
        super().__init__()
        half = dim // 2
        self.register_buffer("freqs", torch.exp(-torch.arange(half) * (9.21 / half)))
        self.time = nn.Sequential(nn.Linear(dim, 32), nn.SiLU(), nn.Linear(32, 32))
        self.fourier = nn.Linear(6, 8, bias=False)
        self.inp = nn.Linear(6 + 16, 32)
        self.out = nn.Linear(32, 3)

    def forward(self, x, t):
        args = t.to(self.freqs.dtype)[:, None] * self.freqs[None]
        emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
        z = self.fourier(x)
        h = self.inp(torch.cat([x, torch.sin(z), torch.cos(z)], dim=1))
        return self.out(F.silu(h + self.time(emb)))


def _time_case():
    torch.manual_seed(2)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 1000, (8,), generator=g),
                torch.randn(8, 3, generator=g)) for _ in range(STEPS)]
    return Timesteps(), batches


class Windows(nn.Module):
    """``Tensor.unfold``: overlapping frames of a signal (as audio and time-series models
    cut them) and non-overlapping 2-D patches, of trained features."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.frame = nn.Linear(8, 12)
        self.out = nn.Linear(12 + 4, 3)

    def forward(self, x):
        h = self.pre(x)
        frames = h.unsqueeze(1).unfold(2, 8, 3)  # [B, 1, 9, 8]
        patches = h.view(-1, 1, 4, 8).unfold(2, 2, 2).unfold(3, 4, 4)  # [B, 1, 2, 2, 2, 4]
        pooled = torch.tanh(self.frame(frames)).mean((1, 2))
        return self.out(torch.cat([pooled, patches.pow(2).mean((1, 4, 5)).flatten(1)], 1))


def _windows_case():
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 32, generator=g), torch.randn(8, 3, generator=g))
               for _ in range(STEPS)]
    return Windows(), batches


CASES = {"unet": _unet_case, "scan": _scan_case, "block": _block_case, "time": _time_case,
         "windows": _windows_case}

# The ops each model's training step must bring (beyond those every model uses).
NEW_OPS = {
    "unet": {"native_group_norm", "index.Tensor", "index_put", "reflection_pad2d",
             "reflection_pad2d_backward", "constant_pad_nd"},
    "scan": {"cumsum", "flip", "maximum", "minimum", "eq.Tensor", "lt.Tensor", "gt.Tensor"},
    "block": {"slice.Tensor", "cat"},
    "time": {"sin", "cos"},
    "windows": {"index_select", "index_put"},
}


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--memory", "256MiB") as d:
        yield d


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_lowers_to_the_new_ops(name):
    model, batches = CASES[name]()
    traced = salus.trace_train_step(model, F.mse_loss, _optimizer(model.parameters()),
                                    batches[0])
    ops = set(traced.ops())
    assert NEW_OPS[name] <= ops, NEW_OPS[name] - ops
    graph = traced.to_graph()
    check_graph_structure(graph, supported_ops(), kind="train")
    if name == "unet":
        # Both ConvTranspose2d layers, forward and backward, as transposed convolutions.
        transposed = [n for n in graph.nodes if n.op.startswith("convolution")
                      and n.attributes["transposed"].bool]
        assert len(transposed) == 4, [n.name for n in transposed]
        assert {tuple(n.attributes["output_padding"].ints.values) for n in transposed} == {(1, 1)}
        assert any(tuple(n.attributes["dilation"].ints.values) == (2, 2)
                   and n.attributes["groups"].int == 2 for n in transposed)


@pytest.mark.parametrize("name", list(CASES))
def test_training_on_salusd_matches_pytorch(daemon, name):
    model, batches = CASES[name]()

    def eager(dtype):
        m = twin(model, dtype)
        o = _optimizer(m.parameters())
        losses = eager_steps(m, o, F.mse_loss, [to_dtype(b, dtype) for b in batches])
        return losses, torch_state(m, o)

    want = eager(torch.float32)
    exact = eager(torch.float64)
    rounded = randomly_rounded(lambda: eager(torch.float64), seeds=(0,))
    with st.TrainSession(model, F.mse_loss, _optimizer(model.parameters()), batches[0],
                         address=daemon.address, name=f"ops-{name}", total_iterations=STEPS,
                         admission_timeout=10) as session:
        losses = [session.step(*b) for b in batches]
        state = session.state_dict()
    assert_as_exact_as_pytorch([loss.item() for loss in losses], exact[0], want[0],
                               [r[0] for r in rounded], dtype=torch.float32, label="losses ")
    assert_as_exact_as_pytorch(state, exact[1], want[1], [r[1] for r in rounded],
                               label="state ")


"""Fourier transforms in steps (``salus.spectral``): the transforms against PyTorch's in
float64 (every ``torch.fft`` form, ``n``/``s``, ``norm``, shifts, ``torch.stft``); and
models that use them, each trained three Adam steps on salusd against float64 by the
suite's rule (harness.py): FNet's token mixing (the real part of a 2-d transform), a
log-spectrogram front end behind a learned filter, a long convolution by FFT with a
learned kernel, a global filter (a complex weight from ``view_as_complex``), a
frequency loss, and rotary embeddings as complex turns (``torch.polar``). A complex
value a step returns is refused, naming it."""

from __future__ import annotations

import functools

import pytest
import torch
from harness import assert_built_model_trains_on_salusd_as_eagerly
from torch import nn

import salus

F = nn.functional


class FNetMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.head = nn.Linear(8, 2)
        # a reference taken when the model is built, as transformers' FNet takes it
        self.fourier_transform = functools.partial(torch.fft.fftn, dim=(1, 2))

    def forward(self, x):
        h = self.embed(x)
        mixed = self.fourier_transform(h).real
        return self.head(F.layer_norm(h + mixed, (8,))).mean(1)


class Spectrogram(nn.Module):
    """A learned filter, then the log power of a Hann-windowed STFT, then a classifier."""

    def __init__(self):
        super().__init__()
        self.filter = nn.Conv1d(1, 1, 5, padding=2)
        self.head = nn.Linear(9, 3)

    def forward(self, wave):
        signal = self.filter(wave.unsqueeze(1)).squeeze(1)
        window = torch.hann_window(16, dtype=wave.dtype)
        spec = torch.stft(signal, 16, hop_length=8, window=window, return_complex=True)
        power = spec.abs().pow(2) + 1e-3
        return self.head(power.log().mean(-1))


class LongConvolution(nn.Module):
    """A causal convolution with a learned kernel as long as the sequence, by FFT."""

    def __init__(self, length=12):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(4, length) * 0.1)
        self.proj = nn.Linear(4, 2)

    def forward(self, x):  # [B, 4, L]
        n = 2 * x.shape[-1]
        y = torch.fft.irfft(torch.fft.rfft(x, n=n) * torch.fft.rfft(self.kernel, n=n), n=n)
        return self.proj(y[..., :x.shape[-1]].transpose(1, 2)).mean(1)


class GlobalFilter(nn.Module):
    """GFNet's layer: a learned complex filter over a 2-d spectrum."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4, 2) * 0.1)
        self.head = nn.Linear(36, 2)

    def forward(self, x):  # [B, 6, 6]
        spectrum = torch.fft.rfft2(x, norm="ortho") * torch.view_as_complex(self.weight)
        return self.head(torch.fft.irfft2(spectrum, s=(6, 6), norm="ortho").flatten(1))


class RotaryAttentionInput(nn.Module):
    """Rotary position embeddings as Meta's Llama writes them: each query's pairs as
    complex numbers (``view_as_complex``) turned by ``torch.polar`` angles."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):  # [B, T, 8]: two heads of 4
        q = self.q(x).view(*x.shape[:2], 2, 4)
        steps = x.shape[1]
        freqs = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=x.dtype) / 4))
        angles = torch.outer(torch.arange(steps, dtype=x.dtype), freqs)
        turns = torch.polar(torch.ones_like(angles), angles).view(1, steps, 1, 2)
        pairs = torch.view_as_complex(q.reshape(*q.shape[:-1], 2, 2))
        rotated = torch.view_as_real(pairs * turns).flatten(3).flatten(2)
        return self.head(rotated).mean(1)


def _frequency_loss(m, x, target):
    out = m(x)
    diff = torch.fft.rfft2(out, norm="ortho") - torch.fft.rfft2(target, norm="ortho")
    return diff.abs().mean() + F.mse_loss(out, target)


def _case(model, shape, out, loss=None):
    def build():
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(*shape, generator=g), torch.randn(*out, generator=g))
        return model(), batch, loss or (lambda m, x, y: F.mse_loss(m(x), y))
    return build


class _Conv2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(x.unsqueeze(1)).squeeze(1)


MODELS = {
    "fnet": _case(FNetMixer, (2, 5, 3), (2, 2)),
    "spectrogram": _case(Spectrogram, (2, 64), (2, 3)),
    "long_convolution": _case(LongConvolution, (2, 4, 12), (2, 2)),
    "global_filter": _case(GlobalFilter, (2, 6, 6), (2, 2)),
    "frequency_loss": _case(_Conv2d, (2, 6, 7), (2, 6, 7), _frequency_loss),
    "rotary": _case(RotaryAttentionInput, (2, 5, 8), (2, 2)),
}


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    assert_built_model_trains_on_salusd_as_eagerly(MODELS[name], daemon.address,
                                                   label=f"{name}: ")


def _pair(z):
    from salus.spectral import Complex
    return torch.complex(z.re, z.im) if isinstance(z, Complex) else z


def test_the_transforms_give_pytorchs_values():
    """Within 64 float64 epsilons of the values' scale (a sum of products over the
    transformed lengths, in another order than PyTorch's FFT)."""
    from salus.spectral import spectra_in_the_graph
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 6, dtype=torch.float64, generator=g)
    signal = torch.randn(2, 64, dtype=torch.float64, generator=g)
    fft = torch.fft
    cases = [
        lambda: fft.rfft(x), lambda: fft.rfft(x, n=10, dim=1, norm="ortho"),
        lambda: fft.fft(x, dim=1), lambda: fft.ifft(fft.fft(x), norm="forward"),
        lambda: fft.rfft2(x), lambda: fft.irfft2(fft.rfft2(x), s=(8, 6)),
        lambda: fft.irfft(fft.rfft(x), n=6), lambda: fft.irfft(fft.rfft(x[..., :5]), n=5),
        lambda: fft.fftn(x), lambda: fft.ifftn(fft.rfftn(x), dim=(0, 1)),
        lambda: fft.fftshift(fft.fft(x), dim=-1), lambda: fft.ifftshift(x),
        lambda: torch.stft(signal, 16, hop_length=4, return_complex=True,
                           window=torch.hann_window(16, dtype=torch.float64)),
        lambda: torch.stft(signal, 16, hop_length=4, win_length=12, normalized=True,
                           window=torch.hann_window(12, dtype=torch.float64),
                           return_complex=True),
        # Away from the zero-frequency and Nyquist bins, real here, whose angle is on the
        # branch cut (pi or -pi by the sign of a rounded zero).
        lambda: (fft.rfft(x) * fft.rfft(x.flip(-1)) / (1 + fft.rfft(x).abs()))[..., 1:-1]
        .angle(),
    ]
    want = [case() for case in cases]
    with spectra_in_the_graph():
        got = [case() for case in cases]
    for k, (mine, theirs) in enumerate(zip(map(_pair, got), want)):
        assert mine.shape == theirs.shape, k
        bound = 64 * torch.finfo(torch.float64).eps * max(1.0, theirs.abs().max().item())
        assert (mine - theirs).abs().max().item() <= bound, k


def test_a_complex_value_returned_is_refused_naming_it():
    class Spectrum(nn.Module):
        def forward(self, x):
            return torch.fft.rfft(x)

    with pytest.raises(salus.TraceError, match="returns .* a complex tensor"):
        salus.trace_inference(Spectrum(), (torch.randn(2, 8),))

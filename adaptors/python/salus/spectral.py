"""Fourier transforms in a step, while it records: the IR has no complex dtype, so the
complex values ``torch.fft`` gives are kept as two real tensors, their real and
imaginary parts (:class:`Complex`), and the transforms are products with the discrete
Fourier transform's cosine and sine matrices (``O(n^2)`` per transformed dim, for the
lengths models use: a spectrogram's frame, a sequence, an image side).

``torch.fft``'s transforms (``fft``, ``ifft``, ``rfft``, ``irfft`` and their ``2``/``n``
forms, with ``n``/``s``, ``dim`` and ``norm``), ``fftshift``/``ifftshift``,
``torch.stft`` (a centred, windowed one-sided transform), ``torch.view_as_complex``,
``torch.complex`` and ``torch.polar`` give a :class:`Complex`. On it: arithmetic with
complex, real tensors and numbers; ``abs``, ``angle``, ``real``, ``imag``, ``conj``,
``exp``; sums and means; shape ops (each part alike); products and ``einsum`` with
complex or real operands; the inverse transforms; ``torch.view_as_real``. The gradients
are autograd's of these real ops. Anything else on a complex value, or a complex value
returned, is refused, naming it. Complex parameters are not IR tensors and are refused
as any other dtype the IR lacks.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .errors import TraceError
from .stand_ins import StandIn, route


def _refuse(what: str):
    raise TraceError(
        f"the step {what} a complex tensor (from torch.fft or torch.stft): salus keeps "
        "complex values as their real and imaginary parts while a step records, and follows "
        "them through the transforms, arithmetic, abs, angle, real, imag, conj, exp, sums, "
        "shape ops, products and einsum, and view_as_real; take a real value "
        "(.abs(), .real, view_as_real) before anything else")


def _dft(n_in: int, n_out: int, inverse: bool, dtype, device):
    """The cosine and sine matrices [n_in, n_out] of ``exp(-+2 pi i j k / n)`` with
    ``n = n_in`` for a forward transform, ``n_out`` for an inverse one."""
    n = n_out if inverse else n_in
    j = torch.arange(n_in, dtype=torch.float64)
    k = torch.arange(n_out, dtype=torch.float64)
    angle = 2 * math.pi * torch.remainder(j[:, None] * k[None, :], n) / n
    sign = 1.0 if inverse else -1.0
    return (torch.cos(angle).to(dtype=dtype, device=device),
            (sign * torch.sin(angle)).to(dtype=dtype, device=device))


def _scale(norm: str | None, n: int, inverse: bool) -> float:
    norm = norm or "backward"
    if norm == "ortho":
        return 1.0 / math.sqrt(n)
    if (norm == "backward") == inverse:
        return 1.0 / n
    return 1.0


def _along(t: torch.Tensor, dim: int, matrix: torch.Tensor) -> torch.Tensor:
    """``t`` times ``matrix`` along ``dim``."""
    moved = t.movedim(dim, -1)
    return (moved @ matrix).movedim(-1, dim)


def _fit(t: torch.Tensor | None, dim: int, n: int | None):
    """``t`` zero-padded or trimmed to ``n`` along ``dim`` (``torch.fft``'s ``n``)."""
    if t is None or n is None or n == t.shape[dim]:
        return t
    if n < t.shape[dim]:
        return t.narrow(dim, 0, n)
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, n - t.shape[dim]]
    return torch.nn.functional.pad(t, pad)


class Complex(StandIn):
    """A complex tensor while a step records: its real and imaginary parts."""

    def __init__(self, re: torch.Tensor, im: torch.Tensor):
        self.re, self.im = re, im

    # -- transforms ------------------------------------------------------------------
    def c2c(self, dim: int, n: int | None, norm, inverse: bool) -> "Complex":
        re, im = _fit(self.re, dim, n), _fit(self.im, dim, n)
        size = re.shape[dim]
        cos, sin = _dft(size, size, inverse, re.dtype, re.device)
        scale = _scale(norm, size, inverse)
        out_re = _along(re, dim, cos) - _along(im, dim, sin)
        out_im = _along(re, dim, sin) + _along(im, dim, cos)
        return Complex(out_re * scale, out_im * scale)

    def c2r(self, dim: int, n: int | None, norm) -> torch.Tensor:
        """The real signal of ``n`` samples (default ``2 (m - 1)``) whose one-sided
        spectrum is this one's ``m`` bins: the imaginary parts of the zero-frequency
        (and, for an even ``n``, the Nyquist) bin are ignored, as PyTorch's."""
        bins = self.re.shape[dim]
        n = n if n is not None else 2 * (bins - 1)
        used = n // 2 + 1
        re, im = _fit(self.re, dim, used), _fit(self.im, dim, used)
        cos, sin = _dft(used, n, True, re.dtype, re.device)
        weight = torch.full((used, 1), 2.0, dtype=re.dtype, device=re.device)
        weight[0] = 1.0
        if n % 2 == 0:
            weight[used - 1] = 1.0
        return (_along(re, dim, cos * weight) - _along(im, dim, sin * weight)) * _scale(
            norm, n, True)

    # -- the torch function protocol -------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        rule = _RULES.get(name)
        if rule is not None:
            return rule(*args, **kwargs)
        if name in _PARTWISE:
            return Complex(*(func(*parts, **kwargs) for parts in _parts(args)))
        _refuse(f"applies {name} to")

    @property
    def real(self):
        return self.re

    @property
    def imag(self):
        return self.im

    @property
    def shape(self):
        return self.re.shape

    def size(self, *dim):
        return self.re.size(*dim)

    def dim(self) -> int:
        return self.re.dim()

    @property
    def ndim(self) -> int:
        return self.re.dim()

    @property
    def dtype(self):
        return torch.complex128 if self.re.dtype == torch.float64 else torch.complex64

    @property
    def device(self):
        return self.re.device

    def is_complex(self) -> bool:
        return True



def _parts(args) -> tuple[list, list]:
    """``args`` with each :class:`Complex` replaced by its real part, and by its
    imaginary part (shape ops apply to each part alike)."""
    return (pytree.tree_map(lambda a: a.re if isinstance(a, Complex) else a, list(args)),
            pytree.tree_map(lambda a: a.im if isinstance(a, Complex) else a, list(args)))


def _as_complex(value) -> Complex:
    if isinstance(value, Complex):
        return value
    if isinstance(value, complex):
        return Complex(torch.tensor(value.real), torch.tensor(value.imag))
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            _refuse("uses a complex tensor made outside the step alongside")
        return Complex(value, torch.zeros_like(value))
    return Complex(torch.tensor(float(value)), torch.tensor(0.0))


def _add(a, b, *, alpha=1):
    a, b = _as_complex(a), _as_complex(b)
    return Complex(a.re + alpha * b.re, a.im + alpha * b.im)


def _sub(a, b, *, alpha=1):
    return _add(a, b, alpha=-alpha)


def _rsub(a, b):
    return _sub(b, a)


def _mul(a, b):
    if not isinstance(b, Complex) and not isinstance(b, complex):
        return Complex(a.re * b, a.im * b) if isinstance(a, Complex) else _mul(b, a)
    if not isinstance(a, Complex) and not isinstance(a, complex):
        return Complex(b.re * a, b.im * a)
    a, b = _as_complex(a), _as_complex(b)
    return Complex(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re)


def _div(a, b):
    if not isinstance(b, (Complex, complex)):
        return Complex(a.re / b, a.im / b)
    a, b = _as_complex(a), _as_complex(b)
    scale = b.re * b.re + b.im * b.im
    return Complex((a.re * b.re + a.im * b.im) / scale, (a.im * b.re - a.re * b.im) / scale)


def _rdiv(a, b):
    return _div(_as_complex(b), a)


def _matmul(a, b):
    a, b = _as_complex(a), _as_complex(b)
    return Complex(a.re @ b.re - a.im @ b.im, a.re @ b.im + a.im @ b.re)


def _einsum(equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2:
        _refuse("takes an einsum of other than two operands with")
    a, b = (_as_complex(o) for o in operands)
    return Complex(torch.einsum(equation, a.re, b.re) - torch.einsum(equation, a.im, b.im),
                   torch.einsum(equation, a.re, b.im) + torch.einsum(equation, a.im, b.re))


def _to(z, *args, **kwargs):
    """``to`` a device, or to a complex dtype (as it is); a real dtype drops nothing
    silently: refused."""
    target = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    if target is not None and not target.is_complex:
        _refuse(f"casts to {target}")
    rest = [a for a in args if not isinstance(a, torch.dtype)]
    kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
    return Complex(z.re.to(*rest, **kwargs), z.im.to(*rest, **kwargs))


def _abs(z):
    # The magnitude, with PyTorch's gradient of 0 at 0.
    square = z.re * z.re + z.im * z.im
    positive = square > 0
    safe = torch.where(positive, square, torch.ones_like(square))
    return torch.where(positive, safe.sqrt(), torch.zeros_like(square))


def _angle(z):
    return torch.atan2(z.im, z.re)


def _conj(z):
    return Complex(z.re, -z.im)


def _exp(z):
    scale = torch.exp(z.re)
    return Complex(scale * torch.cos(z.im), scale * torch.sin(z.im))


def _neg(z):
    return Complex(-z.re, -z.im)


def _pow(z, exponent):
    if exponent == 2:
        return _mul(z, z)
    _refuse(f"raises to the power {exponent!r}")


def _reduce(op):
    def rule(z, *args, **kwargs):
        return Complex(op(z.re, *args, **kwargs), op(z.im, *args, **kwargs))
    return rule


def _view_as_real(z):
    return torch.stack([z.re, z.im], -1)


def _returns_real(z):
    return z.re


_RULES = {
    "add": _add, "__add__": _add, "__radd__": _add, "sub": _sub, "__sub__": _sub,
    "__rsub__": _rsub, "mul": _mul, "__mul__": _mul, "__rmul__": _mul, "div": _div,
    "__truediv__": _div, "__rtruediv__": _rdiv, "true_divide": _div, "matmul": _matmul,
    "__matmul__": _matmul, "einsum": _einsum, "abs": _abs, "__abs__": _abs, "angle": _angle,
    "conj": _conj, "conj_physical": _conj, "resolve_conj": lambda z: z, "exp": _exp,
    "neg": _neg, "__neg__": _neg, "pow": _pow, "__pow__": _pow,
    "sum": _reduce(torch.sum), "mean": _reduce(torch.mean),
    "view_as_real": _view_as_real, "real": _returns_real,
    "imag": lambda z: z.im, "to": _to,
}
_PARTWISE = {
    "reshape", "view", "permute", "transpose", "flip", "roll", "narrow", "__getitem__",
    "unsqueeze", "squeeze", "expand", "repeat", "contiguous", "clone", "flatten",
    "unflatten", "movedim", "select", "chunk", "split", "cat", "stack", "detach",
    "t", "mT", "swapaxes", "fftshift", "ifftshift", "tril", "triu", "pad",
}


route(Complex, ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__", "__rtruediv__", "__matmul__", "__neg__", "__abs__", "__pow__",
                "__getitem__"))


# -- the transforms as torch.fft names them --------------------------------------------
def _dims(x, dim, s, default):
    if dim is None:
        dim = list(range(-len(s), 0)) if s is not None else default(x)
    dim = [dim] if isinstance(dim, int) else list(dim)
    sizes = [None] * len(dim) if s is None else list(s)
    return [d % x.dim() for d in dim], sizes


def _transform(kind: str, ndims):
    """``torch.fft`` function ``kind`` over one dim (``ndims`` 1), the last two (2) or
    any (None)."""
    def default(x):
        return [x.dim() - 1] if ndims == 1 else (list(range(x.dim() - 2, x.dim()))
                                                 if ndims == 2 else list(range(x.dim())))

    def rule(input, n_or_s=None, dim=None if ndims != 1 else -1, norm=None, *, out=None,
             s=None, n=None):
        size = n if n is not None else (s if s is not None else n_or_s)
        if ndims == 1:
            dims, sizes = [dim % input.dim()], [size]
        else:
            dims, sizes = _dims(input, dim, size, default)
        if kind in ("fft", "ifft"):
            z = _as_complex(input)
            for d, m in zip(dims, sizes):
                z = z.c2c(d, m, norm, kind == "ifft")
            return z
        if kind == "rfft":
            if isinstance(input, Complex):
                _refuse("takes rfft of")
            last, last_n = dims[-1], sizes[-1]
            real = _fit(input, last, last_n)
            z = _as_complex(real).c2c(last, None, norm, False)
            z = Complex(z.re.narrow(last, 0, real.shape[last] // 2 + 1),
                        z.im.narrow(last, 0, real.shape[last] // 2 + 1))
            for d, m in zip(dims[:-1], sizes[:-1]):
                z = z.c2c(d, m, norm, False)
            return z
        # irfft: the inverse along every dim but the last, then the real one.
        z = _as_complex(input)
        for d, m in zip(dims[:-1], sizes[:-1]):
            z = z.c2c(d, m, norm, True)
        return z.c2r(dims[-1], sizes[-1], norm)
    return rule


def _shift(inverse: bool):
    def rule(input, dim=None):
        dims = list(range(input.dim())) if dim is None else (
            [dim] if isinstance(dim, int) else list(dim))
        shifts = [(-(input.shape[d] // 2) if inverse else input.shape[d] // 2) for d in dims]
        if isinstance(input, Complex):
            return Complex(torch.roll(input.re, shifts, dims), torch.roll(input.im, shifts,
                                                                          dims))
        return torch.roll(input, shifts, dims)
    return rule


def _stft(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
          pad_mode="reflect", normalized=False, onesided=None, return_complex=None,
          align_to_window=None):
    """``torch.stft`` of a real signal [L] or [B, L]: frames of ``n_fft`` every
    ``hop_length`` (the signal reflected by ``n_fft // 2`` at each end when centred), the
    window (zero-padded to ``n_fft`` in the middle) applied, a one-sided transform of
    each: [(B,) n_fft // 2 + 1, frames]."""
    if not return_complex:
        _refuse("asks torch.stft for real pairs (return_complex=False) of")
    if onesided is False or isinstance(input, Complex) or align_to_window:
        _refuse("takes a two-sided (or window-aligned) stft of")
    hop = hop_length or n_fft // 4
    win = win_length or n_fft
    batched = input.dim() == 2
    x = input if batched else input.unsqueeze(0)
    if center:
        x = torch.nn.functional.pad(x.unsqueeze(1), [n_fft // 2, n_fft // 2],
                                    mode=pad_mode).squeeze(1)
    frames = x.unfold(-1, n_fft, hop)  # [B, frames, n_fft]
    if window is not None:
        left = (n_fft - win) // 2
        frames = frames * torch.nn.functional.pad(window, [left, n_fft - win - left])
    z = _transform("rfft", 1)(frames, None, -1, "ortho" if normalized else None)
    z = Complex(z.re.transpose(-1, -2), z.im.transpose(-1, -2))
    return z if batched else Complex(z.re.squeeze(0), z.im.squeeze(0))


def _view_as_complex(input):
    return Complex(input[..., 0], input[..., 1])


def _complex(real, imag, *, out=None):
    return Complex(real, imag)


def _polar(abs, angle, *, out=None):
    return Complex(abs * torch.cos(angle), abs * torch.sin(angle))


_FFT = {
    "fft": ("fft", 1), "ifft": ("ifft", 1), "rfft": ("rfft", 1), "irfft": ("irfft", 1),
    "fft2": ("fft", 2), "ifft2": ("ifft", 2), "rfft2": ("rfft", 2), "irfft2": ("irfft", 2),
    "fftn": ("fft", None), "ifftn": ("ifft", None), "rfftn": ("rfft", None),
    "irfftn": ("irfft", None),
}


@contextlib.contextmanager
def spectra_in_the_graph() -> Iterator[None]:
    """While a step records: ``torch.fft``'s transforms and shifts, ``torch.stft``,
    ``torch.view_as_complex``, ``torch.complex`` and ``torch.polar`` give and take
    :class:`Complex` values; all put back after. Each is replaced where it is looked up
    (``torch.fft.fftn``) and, for a reference a model took before (FNet's
    ``partial(torch.fft.fftn, dim=(1, 2))``), where PyTorch dispatches it
    (:class:`_Spectra`)."""
    replaced = [(torch.fft, name, _transform(*spec)) for name, spec in _FFT.items()]
    replaced += [(torch.fft, "fftshift", _shift(False)), (torch.fft, "ifftshift", _shift(True)),
                 (torch, "stft", _stft), (torch, "view_as_complex", _view_as_complex),
                 (torch, "complex", _complex), (torch, "polar", _polar)]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    rules = {original: rule for (_, _, original), (_, _, rule) in zip(originals, replaced)}
    for owner, name, rule in replaced:
        setattr(owner, name, rule)
    try:
        with _Spectra(rules):
            yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


class _Spectra(TorchFunctionMode):
    """Calls of the original functions (references taken before recording) go to their
    rules."""

    def __init__(self, rules: dict):
        super().__init__()
        self._rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = self._rules.get(func)
        return (rule or func)(*args, **(kwargs or {}))

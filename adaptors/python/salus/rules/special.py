"""Special functions as Chebyshev series in IR ops, evaluated by Clenshaw's recurrence.
The coefficients are the functions' own Chebyshev coefficients (computed at 40 digits
or more, kept to 1e-16 of the largest), so the series match the functions to double
precision; PyTorch's gradients follow from its formulas of the same functions.

- Modified Bessel functions of the first kind, orders 0 and 1 (``torch.special.i0``,
  ``i0e``, ``i1``, ``i1e``; ``torch.i0``: Kaiser windows, von Mises heads): each scaled
  function ``exp(-|x|) I(x)`` as a series in ``|x| / 4 - 1`` up to 8 and in
  ``16 / |x| - 1`` beyond (times ``sqrt(|x|)`` there).
- The scaled complementary error function ``erfcx(x) = exp(x^2) erfc(x)`` (and
  ``log_ndtr``, a probit's log-likelihood, from it): ``(1 + 2x) erfcx(x)`` for ``x >= 0``
  as a series in ``(x - 3.75) / (x + 3.75)``, ``2 exp(x^2) - erfcx(-x)`` below 0."""

from __future__ import annotations

import torch

aten = torch.ops.aten

_I0E_SMALL = (
    3.3839763720473804e-1, -3.046826723431984e-1, 1.7162090152220878e-1,
    -9.4901097048047644e-2, 4.9305284239670708e-2, -2.3737414805899469e-2,
    1.0546460394594998e-2, -4.3243099950505759e-3, 1.6394756169413358e-3,
    -5.7637557453858237e-4, 1.8850288509584166e-4, -5.7541950100821037e-5,
    1.6448448070728897e-5, -4.4167383584587506e-6, 1.1173875391201037e-6,
    -2.6707938539406117e-7, 6.0469950225419189e-8, -1.300025009986248e-8,
    2.6598237246823867e-9, -5.1897956016352629e-10, 9.6758090353732369e-11,
    -1.7268262914415557e-11, 2.9550526631296398e-12, -4.8564467831119295e-13,
    7.6761854986049356e-14, -1.1685332877993452e-14, 1.715391285555133e-15,
    -2.4312798465479547e-16,
)
_I0E_LARGE = (
    4.0224520550705442e-1, 3.3691164782556941e-3, 6.889758346916824e-5,
    2.8913705208347565e-6, 2.0489185894690637e-7, 2.2666689904981781e-8,
    3.3962320257083863e-9, 4.9406023882249696e-10, 1.1889147107846438e-11,
    -3.1499165279632414e-11, -1.3215811840447713e-11, -1.7941785315068061e-12,
    7.1801244513836662e-13, 3.8527783827421427e-13, 1.5400862175214098e-14,
    -4.1505693472872221e-14, -9.5548466988283076e-15, 3.8116806693526224e-15,
    1.7725601330565264e-15, -3.4254856196772191e-16, -2.8276239805165835e-16,
    3.461222867697461e-17, 4.46562142029676e-17,
)
_I1E_SMALL = (
    1.2629359322181683e-1, -1.7641651835783406e-1, 1.026436586898471e-1,
    -5.2945981208094991e-2, 2.4726449030626517e-2, -1.0564084894626198e-2,
    4.1564229443128882e-3, -1.5135724506312531e-3, 5.1228595616857577e-4,
    -1.6176081582589675e-4, 4.7815651075500542e-5, -1.3273163656039436e-5,
    3.4702513081376785e-6, -8.5687202646954547e-7, 2.0032947535521353e-7,
    -4.4450591287963281e-8, 9.3815373864957718e-9, -1.8872497517228293e-9,
    3.625590281552117e-10, -6.6634897235020277e-11, 1.1736186298890902e-11,
    -1.9839743977649437e-12, 3.2237933659455747e-13, -5.0421855047279117e-14,
    7.6006842947354069e-15, -1.1055969477353863e-15, 1.5536319577362005e-16,
    -2.1114212143581661e-17,
)
_I1E_LARGE = (
    3.8928811750914006e-1, -9.7610974913614684e-3, -1.1058893876262372e-4,
    -3.8825648088776904e-6, -2.5122362378702089e-7, -2.6314688468895195e-8,
    -3.835380385964237e-9, -5.5897434621965838e-10, -1.8974958123505412e-11,
    3.2526035830154882e-11, 1.4125807436613781e-11, 2.0356285441470895e-12,
    -7.1985517762459085e-13, -4.0835511110921973e-13, -2.1015418427726643e-14,
    4.2724400167119514e-14, 1.0420276984128803e-14, -3.8144030724370078e-15,
    -1.8803547755107824e-15, 3.3082023109209283e-16, 2.9626289976459501e-16,
    -3.2095259219934239e-17, -4.6503053684893583e-17,
)


_ERFCX = (
    1.1775789345674018, -4.5900545806464773e-3, -8.4249133366517916e-2,
    5.920993999819189e-2, -2.6658668435305752e-2, 9.0749976707052651e-3,
    -2.4131635404176082e-3, 4.9077583652580863e-4, -6.9169733025012064e-5,
    4.1390279860730102e-6, 7.7403830661984907e-7, -2.1886401049234396e-7,
    1.076499946567091e-8, 4.5219598112182869e-9, -7.7544002088313511e-10,
    -6.3180883408866845e-11, 2.8687950109306699e-11, 1.9455868545777347e-13,
    -9.6546967484334389e-13, 3.2525481481487398e-14, 3.3478119482868054e-14,
    -1.8645628804193131e-15, -1.2507950530688647e-15, 7.4182352566240435e-17,
    5.0681489047961113e-17,
)

# erfcx's series variable: (x - K) / (x + K), which maps [0, inf] onto [-1, 1].
_ERFCX_K = 3.75


def _series(t, coefficients):
    """``sum c_k T_k(t)`` by Clenshaw's recurrence."""
    twice = aten.mul.Scalar(t, 2.0)
    later = aten.full_like.default(t, 0.0)
    last = aten.full_like.default(t, 0.0)
    for c in reversed(coefficients[1:]):
        later, last = last, aten.add.Scalar(
            aten.sub.Tensor(aten.mul.Tensor(twice, last), later), c)
    return aten.add.Scalar(aten.sub.Tensor(aten.mul.Tensor(t, last), later),
                           coefficients[0])


def _as_float(x):
    if x.dtype.is_floating_point:
        return x
    return aten._to_copy.default(x, dtype=torch.get_default_dtype())


def _scaled(x, small, large, times_x: bool):
    """``exp(-|x|) I(|x|)`` from the two series: ``small`` (times ``|x|`` for order 1)
    up to 8, ``large / sqrt(|x|)`` beyond."""
    a = aten.abs.default(x)
    near = _series(aten.sub.Scalar(aten.mul.Scalar(a, 0.25), 1.0), small)
    if times_x:
        near = aten.mul.Tensor(near, a)
    # Beyond 8 (and NaN) only: the far series' argument of a small |x| is 8's.
    safe = aten.where.self(aten.le.Scalar(a, 8.0), aten.full_like.default(a, 8.0), a)
    far = aten.div.Tensor(
        _series(aten.sub.Scalar(aten.reciprocal.default(aten.mul.Scalar(safe, 1 / 16)), 1.0),
                large), aten.sqrt.default(safe))
    return aten.where.self(aten.le.Scalar(a, 8.0), near, far)


def _unscaled(x, scaled):
    """``exp(|x|)`` times a scaled function (NaN at infinities, as PyTorch's)."""
    return aten.mul.Tensor(aten.exp.default(aten.abs.default(x)), scaled)


def _i0e(x):
    x = _as_float(x)
    return _scaled(x, _I0E_SMALL, _I0E_LARGE, False)


def _i0(x):
    x = _as_float(x)
    return _unscaled(x, _i0e(x))


def _i1e(x):
    x = _as_float(x)
    return aten.mul.Tensor(aten.sign.default(x), _scaled(x, _I1E_SMALL, _I1E_LARGE, True))


def _i1(x):
    x = _as_float(x)
    return aten.mul.Tensor(aten.sign.default(x), _unscaled(x, _scaled(
        x, _I1E_SMALL, _I1E_LARGE, True)))


def _erfcx_nonnegative(a):
    """``erfcx`` of ``a >= 0`` (and of +inf: 0): the series over ``1 + 2a``."""
    t = aten.add.Scalar(aten.neg.default(aten.div.Tensor(
        aten.full_like.default(a, 2 * _ERFCX_K), aten.add.Scalar(a, _ERFCX_K))), 1.0)
    return aten.div.Tensor(_series(t, _ERFCX), aten.add.Scalar(aten.mul.Scalar(a, 2.0), 1.0))


def _erfcx(x):
    """``special.erfcx``: the series for ``x >= 0``; ``2 exp(x^2) - erfcx(-x)`` below
    (infinite where ``exp(x^2)`` is, as PyTorch's)."""
    x = _as_float(x)
    negative = aten.lt.Scalar(x, 0)
    a = aten.abs.default(x)
    mirrored = _erfcx_nonnegative(a)
    below = aten.sub.Tensor(aten.mul.Scalar(aten.exp.default(aten.mul.Tensor(x, x)), 2.0),
                            mirrored)
    return aten.where.self(negative, below, mirrored)


def _log_ndtr(x):
    """``special.log_ndtr``, the log of the standard normal's distribution function, as
    PyTorch computes it: ``log(erfcx(-t) / 2) - t^2`` with ``t = x / sqrt(2)`` below -1
    (no underflow far in the tail), ``log1p(-erfc(t) / 2)`` from there."""
    x = _as_float(x)
    t = aten.mul.Scalar(x, 0.5 ** 0.5)
    low = aten.lt.Scalar(x, -1.0)
    # Each branch on arguments of its own range, so that neither overflows into NaN.
    t_low = aten.where.self(low, t, aten.full_like.default(t, -1.0))
    t_high = aten.where.self(low, aten.full_like.default(t, 0.0), t)
    tail = aten.sub.Tensor(
        aten.log.default(aten.mul.Scalar(_erfcx_nonnegative(aten.neg.default(t_low)), 0.5)),
        aten.mul.Tensor(t_low, t_low))
    body = aten.log1p.default(aten.mul.Scalar(aten.erfc.default(t_high), -0.5))
    return aten.where.self(low, tail, body)

"""Pooling and padding: adaptive pooling (2-d, and 3-d by gathered windows), 3-d pooling
by gathered windows, replication and circular padding, ``unfold``."""

from __future__ import annotations

import torch

from .common import _extreme_of

aten = torch.ops.aten


def _unfold(x, dimension, size, step):
    """``Tensor.unfold`` (sliding windows along a dim, each window a new last dim) as an
    ``index_select`` of the windows' positions, viewed and permuted: the same values as
    PyTorch's strided view."""
    if x.dim() == 0:
        return NotImplemented
    dim = dimension % x.dim()
    count = (x.shape[dim] - size) // step + 1
    starts = aten.mul.Scalar(aten.unsqueeze.default(
        aten.arange.start_step(0, count, dtype=torch.int64, device=x.device), 1), step)
    positions = aten.add.Tensor(
        starts, aten.arange.start_step(0, size, dtype=torch.int64, device=x.device))
    picked = aten.index_select.default(x, dim, aten.view.default(positions, [count * size]))
    shape = list(x.shape)
    shape[dim:dim + 1] = [count, size]
    order = [d for d in range(len(shape)) if d != dim + 1] + [dim + 1]
    return aten.permute.default(aten.view.default(picked, shape), order)


def _adaptive_avg_pool2d(x, output_size):
    # The composite's 1x1 shortcut (a mean, then `as_strided_` for a channels-last input)
    # would leave view mutations in the graph: the IR has the pooling op itself.
    return aten._adaptive_avg_pool2d.default(x, output_size)


def _adaptive_max_window(x, output_size) -> list[int] | None:
    """The window (and stride) of the plain max pooling that equals adaptive max pooling
    of ``x`` to ``output_size``: each output size must divide its input size (windows of
    uneven sizes have no IR op; the op then stays and is reported unsupported)."""
    sizes = list(x.shape[-2:])
    out = list(output_size)
    if len(out) != 2 or any(o <= 0 or s % o for s, o in zip(sizes, out)):
        return None
    return [s // o for s, o in zip(sizes, out)]


def _adaptive_positions(size, out, device):
    """Adaptive pooling's windows along a dim of ``size`` to ``out``: output i covers
    [floor(i size / out), ceil((i + 1) size / out)) (in float32, exact for sizes below
    2^12). Each window's positions ``[out, width]``, padded to the widest by repeating
    its last (a maximum is the same with it twice), and that width."""
    width = max(-(-((i + 1) * size) // out) - (i * size) // out for i in range(out))
    i = aten.arange.start_step(0, out, 1, dtype=torch.float32, device=device)
    start = aten.floor.default(aten.div.Scalar(aten.mul.Scalar(i, size), out))
    end = aten.ceil.default(aten.div.Scalar(aten.mul.Scalar(aten.add.Scalar(i, 1), size), out))
    j = aten.arange.start_step(0, width, 1, dtype=torch.float32, device=device)
    positions = aten.minimum.default(aten.add.Tensor(aten.unsqueeze.default(start, 1), j),
                                     aten.unsqueeze.default(aten.sub.Scalar(end, 1), 1))
    return aten._to_copy.default(positions, dtype=torch.int64), width


def _adaptive_max_pool2d(x, output_size):
    """Adaptive max pooling: where the output sizes divide the input's, the plain max
    pooling it equals; otherwise each window gathered (``index_select`` of its rows, then
    of its columns), its maximum found by ``argmax`` (the first of equal ones, as
    PyTorch's) and its flat index within the input plane from the positions gathered."""
    window = _adaptive_max_window(x, output_size)
    if window is not None:
        # Both give each maximum's flat index within its input plane.
        return aten.max_pool2d_with_indices.default(x, window, window, [0, 0], [1, 1],
                                                    False)
    (height, width), (out_h, out_w) = x.shape[-2:], output_size
    rows, k_h = _adaptive_positions(height, out_h, x.device)
    cols, k_w = _adaptive_positions(width, out_w, x.device)
    lead = list(x.shape[:-2])
    cells = aten.index_select.default(aten.index_select.default(
        x, x.dim() - 2, aten.view.default(rows, [-1])), x.dim() - 1,
        aten.view.default(cols, [-1]))
    cells = aten.view.default(cells, lead + [out_h, k_h, out_w, k_w])
    n = len(lead)
    cells = aten.permute.default(cells, list(range(n)) + [n, n + 2, n + 1, n + 3])
    cells = aten.view.default(aten.clone.default(cells, memory_format=torch.contiguous_format),
                              lead + [out_h, out_w, k_h * k_w])
    pick = aten.argmax.default(cells, -1, True)
    values = aten.squeeze.dims(aten.gather.default(cells, -1, pick), [-1])
    # Each window cell's flat position in the input plane, [out_h, out_w, k_h * k_w].
    flat = aten.add.Tensor(aten.mul.Scalar(aten.view.default(rows, [out_h, 1, k_h, 1]), width),
                           aten.view.default(cols, [1, out_w, 1, k_w]))
    flat = aten.expand.default(aten.view.default(flat, [out_h, out_w, k_h * k_w]),
                               lead + [out_h, out_w, k_h * k_w])
    return values, aten.squeeze.dims(aten.gather.default(flat, -1, pick), [-1])


def _adaptive_max_pool2d_backward(grad, x, indices):
    """Each output's gradient added at its maximum's flat index in the input plane."""
    window = _adaptive_max_window(x, grad.shape[-2:])
    if window is not None:
        return aten.max_pool2d_with_indices_backward.default(grad, x, window, window,
                                                             [0, 0], [1, 1], False, indices)
    lead = list(x.shape[:-2])
    plane = x.shape[-2] * x.shape[-1]
    zeros = aten.full.default(lead + [plane], 0, dtype=grad.dtype, device=grad.device)
    flat = aten.scatter_add.default(zeros, -1, aten.view.default(indices, lead + [-1]),
                                    aten.view.default(aten.clone.default(
                                        grad, memory_format=torch.contiguous_format),
                                        lead + [-1]))
    return aten.view.default(flat, list(x.shape))


def _replication_pad_backward(grad, x, padding):
    """``replication_pad{1,2,3}d_backward``: each padded dim's gradient added back onto
    the input position it copied (the edge for every padded position), dim by dim, as an
    accumulating ``index_put``."""
    if any(p < 0 for p in padding):
        return NotImplemented
    for i in range(len(padding) // 2):
        dim = grad.dim() - 1 - i
        before, size = padding[2 * i], x.shape[dim]
        positions = aten.clamp.default(
            aten.arange.start_step(-before, grad.shape[dim] - before, dtype=torch.int64,
                                   device=grad.device), 0, size - 1)
        shape = list(grad.shape)
        shape[dim] = size
        zeros = aten.full.default(shape, 0, dtype=grad.dtype, device=grad.device)
        grad = aten.index_put.default(zeros, [None] * dim + [positions], grad, True)
    return grad


def _pad_circular(x, pad):
    """Circular padding (``F.pad(mode="circular")``) as a concatenation of the input's
    ends around it, dim by dim from the last (negative padding crops)."""
    for i in range(len(pad) // 2):
        dim = x.dim() - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before < 0:
            x = aten.slice.Tensor(x, dim, -before, x.shape[dim])
        if after < 0:
            x = aten.slice.Tensor(x, dim, 0, x.shape[dim] + after)
        size = x.shape[dim]
        parts = ([aten.slice.Tensor(x, dim, size - before, size)] if before > 0 else []) + [x]
        if after > 0:
            parts.append(aten.slice.Tensor(x, dim, 0, after))
        if len(parts) > 1:
            x = aten.cat.default(parts, dim)
    return x


def _triple(value, default=None):
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        value = default
    return [value] * 3 if isinstance(value, int) else list(value) * (3 // len(value))


def _pooled_size(size, kernel, stride, pad, dilation, ceil_mode):
    """PyTorch's pooling output size (``pooling_output_shape``)."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _windows(x, outs, kernel, stride, pad, dilation, fill):
    """The pooling windows of ``x``'s last three dims as ``[..., o1, o2, o3, k1 * k2 *
    k3]``: ``x`` padded with ``fill`` (past the last window too, in ceil mode), then each
    dim's windows gathered with ``index_select`` (their gradients: accumulating
    ``index_put``s)."""
    lead = x.dim() - 3
    pads = []
    for i in reversed(range(3)):
        size = x.shape[lead + i]
        after = max(0, (outs[i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
                    - (size + pad[i]))
        pads += [pad[i], after]
    if any(pads):
        x = torch.constant_pad_nd(x, pads, fill)
    for i in range(3):
        dim = lead + 2 * i
        starts = torch.arange(outs[i], device=x.device) * stride[i]
        offsets = torch.arange(kernel[i], device=x.device) * dilation[i]
        where = (starts[:, None] + offsets[None, :]).reshape(-1)
        x = x.index_select(dim, where).unflatten(dim, (outs[i], kernel[i]))
    order = (list(range(lead)) + [lead + 2 * i for i in range(3)]
             + [lead + 2 * i + 1 for i in range(3)])
    return x.permute(order).flatten(-3)


def _max_pool3d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """``max_pool3d_with_indices``: the largest element of each window (the first of equal
    ones) found by ``max`` along the gathered windows, and its position in the input's
    ``D * H * W`` plane, as PyTorch gives it."""
    kernel = _triple(kernel_size)
    stride, pad, dilation = _triple(stride, kernel), _triple(padding), _triple(dilation)
    sizes = list(x.shape[-3:])
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], pad[i], dilation[i], ceil_mode)
            for i in range(3)]
    fill = _extreme_of(x.dtype, False)
    values, local = _windows(x, outs, kernel, stride, pad, dilation, fill).max(-1)
    place = [torch.arange(outs[i], device=x.device)[:, None] * stride[i] - pad[i]
             + torch.arange(kernel[i], device=x.device)[None, :] * dilation[i]
             for i in range(3)]
    flat = ((place[0][:, None, None, :, None, None] * sizes[1]
             + place[1][None, :, None, None, :, None]) * sizes[2]
            + place[2][None, None, :, None, None, :])
    flat = flat.reshape(*outs, -1).expand(*local.shape, kernel[0] * kernel[1] * kernel[2])
    indices = flat.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return values, indices


def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None):
    """``avg_pool3d``: the sum of each zero-padded window over PyTorch's divisor (the
    window clipped to the padded input, or to the input without ``count_include_pad``,
    or ``divisor_override``), a constant of the output's positions."""
    kernel = _triple(kernel_size)
    stride, pad = _triple(stride, kernel), _triple(padding)
    sizes = list(x.shape[-3:])
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], pad[i], 1, ceil_mode)
            for i in range(3)]
    sums = _windows(x, outs, kernel, stride, pad, [1, 1, 1], 0.0).sum(-1)
    if divisor_override:
        return sums / divisor_override
    factors = []
    for i in range(3):
        per = []
        for o in range(outs[i]):
            start = o * stride[i] - pad[i]
            end = min(start + kernel[i], sizes[i] + pad[i])
            if not count_include_pad:
                start, end = max(start, 0), min(end, sizes[i])
            per.append(end - start)
        factors.append(torch.tensor(per, dtype=x.dtype, device=x.device))
    divisor = (factors[0][:, None, None] * factors[1][None, :, None]
               * factors[2][None, None, :])
    return sums / divisor


def _adaptive_windows_3d(x, output_size):
    """Adaptive pooling's windows of ``x``'s last three dims to ``output_size``: the
    window cells as ``[..., o1, o2, o3, k1 * k2 * k3]`` (each window padded to the widest
    by repeating its last cell, :func:`_adaptive_positions`), each cell's flat position in
    the input's ``D * H * W`` volume, and each window's true cell count."""
    sizes, outs = list(x.shape[-3:]), list(output_size)
    lead = x.dim() - 3
    places, widths, counts = [], [], []
    for i in range(3):
        positions, width = _adaptive_positions(sizes[i], outs[i], x.device)
        places.append(positions)
        widths.append(width)
        counts.append([-(-((o + 1) * sizes[i]) // outs[i]) - (o * sizes[i]) // outs[i]
                       for o in range(outs[i])])
        dim = lead + 2 * i
        x = x.index_select(dim, positions.reshape(-1)).unflatten(dim, (outs[i], width))
    order = (list(range(lead)) + [lead + 2 * i for i in range(3)]
             + [lead + 2 * i + 1 for i in range(3)])
    cells = x.permute(order).flatten(-3)
    flat = ((places[0][:, None, None, :, None, None] * sizes[1]
             + places[1][None, :, None, None, :, None]) * sizes[2]
            + places[2][None, None, :, None, None, :]).reshape(*outs, -1)
    return cells, flat, counts, widths


def _adaptive_avg_pool3d(x, output_size):
    """``_adaptive_avg_pool3d``: each window's mean (a window of uneven size pads with
    repeats of its last cell, masked out of the sum), its gradient autograd's."""
    cells, _, counts, widths = _adaptive_windows_3d(x, output_size)
    keep = None
    for i in range(3):
        # Along dim i, window o holds counts[i][o] real cells of widths[i].
        real = (torch.arange(widths[i], device=x.device)[None, :]
                < torch.tensor(counts[i], device=x.device)[:, None])
        shape = [1, 1, 1, 1, 1, 1]
        shape[i], shape[3 + i] = real.shape
        real = real.reshape(shape)
        keep = real if keep is None else keep & real
    keep = keep.reshape(*cells.shape[-4:-1], -1)
    total = torch.where(keep, cells, torch.zeros_like(cells)).sum(-1)
    size = torch.tensor(counts[0], dtype=x.dtype, device=x.device)[:, None, None] \
        * torch.tensor(counts[1], dtype=x.dtype, device=x.device)[None, :, None] \
        * torch.tensor(counts[2], dtype=x.dtype, device=x.device)[None, None, :]
    return total / size


def _adaptive_max_pool3d(x, output_size):
    """``adaptive_max_pool3d``: each window's largest cell (the first of equal ones) and
    its flat position in the input volume, as PyTorch gives them."""
    cells, flat, _, _ = _adaptive_windows_3d(x, output_size)
    values, local = cells.max(-1)
    indices = flat.expand(*local.shape, flat.shape[-1]).gather(-1, local.unsqueeze(-1))
    return values, indices.squeeze(-1)


def _filter_weight(x: float, cubic: bool) -> float:
    """The antialiasing filters: a triangle (bilinear), Keys' cubic with a = -0.5."""
    x = abs(x)
    if not cubic:
        return 1.0 - x if x < 1.0 else 0.0
    a = -0.5
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _resampling_matrix(size: int, out: int, align_corners: bool, scale, cubic: bool):
    """The [out, size] weights of antialiased resampling along one dim, as PyTorch's
    separable kernel computes them: output ``i`` centred at ``scale (i + 0.5)``, its
    filter widened by ``scale`` when shrinking, the weights of each row normalized."""
    if align_corners:
        step = (size - 1) / (out - 1) if out > 1 else 0.0
    else:
        step = 1.0 / scale if scale is not None and scale > 0 else size / out
    half = 2.0 if cubic else 1.0
    support = half * step if step >= 1.0 else half
    inverse = 1.0 / step if step >= 1.0 else 1.0
    rows = []
    for i in range(out):
        center = step * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), size) - first
        weights = [_filter_weight((j + first - center + 0.5) * inverse, cubic)
                   for j in range(count)]
        total = sum(weights)
        row = [0.0] * size
        for j, w in enumerate(weights):
            row[first + j] = w / total if total != 0.0 else w
        rows.append(row)
    return rows


def _antialiased(cubic: bool):
    """``_upsample_bilinear2d_aa`` / ``_upsample_bicubic2d_aa`` (``F.interpolate(...,
    antialias=True)``, torchvision's ``Resize``): resampling of the last two dims as two
    matrix products with the weights PyTorch's kernel uses; the gradient theirs."""
    def rule(x, output_size, align_corners, scales_h=None, scales_w=None):
        (height, width), (out_h, out_w) = x.shape[-2:], output_size
        rows = torch.tensor(_resampling_matrix(height, out_h, align_corners, scales_h, cubic),
                            dtype=x.dtype, device=x.device)
        cols = torch.tensor(_resampling_matrix(width, out_w, align_corners, scales_w, cubic),
                            dtype=x.dtype, device=x.device)
        return torch.matmul(torch.matmul(rows, x), cols.T)
    return rule

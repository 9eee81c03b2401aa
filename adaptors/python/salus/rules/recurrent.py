"""Recurrent layers unrolled over time in IR ops: ``nn.LSTM`` on padded batches (the rule
for ``lstm.input``), and ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` on packed sequences.

A packed sequence's data has as many rows as its sequences have steps together, a
number set by the lengths' values, while salus runs one fixed graph per batch shape.
While a step records, ``pack_padded_sequence`` (and ``pack_sequence``) therefore keep
the padded batch, time-major, with its lengths (:class:`PaddedSteps`, in the place of
the packed data); the recurrent modules run every step of it, each sequence's state
updated only while the step is within its length (the reverse direction starts at each
sequence's own last step), its outputs past its length zero; ``pad_packed_sequence``
gives the padded outputs. The results are PyTorch's. What else a step might do with a
packed sequence's ``data`` (its rows are not the packed rows) is refused, naming it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

aten = torch.ops.aten


def _lstm_cell(x_projected, h, c, w_hh, b_hh, w_hr):
    """One LSTM step as PyTorch's Python rule writes it: the gates ``linear(h, W_hh,
    b_hh) + linear(x, W_ih, b_ih)``, chunked in four (input, forget, cell, output)."""
    gates = F.linear(h, w_hh, b_hh) + x_projected
    i, f, g, o = gates.chunk(4, 1)
    c = f.sigmoid() * c + i.sigmoid() * g.tanh()
    h = o.sigmoid() * c.tanh()
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _gru_cell(x_projected, h, w_hh, b_hh):
    """One GRU step as PyTorch's Python rule writes it (reset, update and new gates)."""
    xr, xz, xn = x_projected.chunk(3, 1)
    hr, hz, hn = F.linear(h, w_hh, b_hh).chunk(3, 1)
    reset = (hr + xr).sigmoid()
    update = (hz + xz).sigmoid()
    new = (xn + hn * reset).tanh()
    return (h - new) * update + new


def _recurrence(mode: str, x, h0, c0, params, has_biases, num_layers, dropout, train,
                bidirectional, lengths=None):
    """The layers of ``mode`` (``LSTM``, ``GRU``, ``RNN_TANH``, ``RNN_RELU``) over ``x``
    [T, B, I] from the states ``h0`` (and ``c0``) [layers * directions, B, H], the
    parameters in PyTorch's flat order (per layer and direction: ``W_ih``, ``W_hh``,
    biases, ``W_hr``). With ``lengths`` [B], sequence ``b`` runs its first
    ``lengths[b]`` steps only. Returns the last layer's outputs [T, B, directions * H] and
    the final states, stacked."""
    directions = 2 if bidirectional else 1
    projected = mode == "LSTM" and h0.size(2) != c0.size(2)
    per = (4 if has_biases else 2) + (1 if projected else 0)
    last_h, last_c = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            p = params[k * per:(k + 1) * per]
            b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
            w_hr = p[-1] if projected else None
            h = h0[k]
            c = c0[k] if mode == "LSTM" else None
            inputs = F.linear(x, p[0], b_ih)
            steps = inputs.size(0)
            out = [None] * steps
            for t in (reversed(range(steps)) if direction else range(steps)):
                if mode == "LSTM":
                    new_h, new_c = _lstm_cell(inputs[t], h, c, p[1], b_hh, w_hr)
                elif mode == "GRU":
                    new_h, new_c = _gru_cell(inputs[t], h, p[1], b_hh), None
                else:
                    pre = F.linear(h, p[1], b_hh) + inputs[t]
                    new_h, new_c = (pre.tanh() if mode == "RNN_TANH" else pre.relu()), None
                if lengths is None:
                    h, c, out[t] = new_h, new_c, new_h
                    continue
                live = (lengths > t).unsqueeze(1)
                h = torch.where(live, new_h, h)
                if c is not None:
                    c = torch.where(live, new_c, c)
                out[t] = torch.where(live, new_h, torch.zeros_like(new_h))
            outputs.append(torch.stack(out))
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, 2) if directions == 2 else outputs[0]
        if dropout and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, True)
    return x, torch.stack(last_h), (torch.stack(last_c) if mode == "LSTM" else None)


def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
          batch_first):
    """``nn.LSTM`` (``lstm.input``) unrolled over time as PyTorch's Python rule writes it,
    with the hidden state [B, H]: every layer and direction, projections
    (``proj_size``), dropout between layers (the session's generator), ``batch_first``.
    PyTorch's own rule, which the Python dispatcher would run, keeps the state [1, B, H],
    and its backward adds a gradient of shape [1, B, 4H] into one of [B, 4H] and fails
    ("output with shape ... doesn't match the broadcast shape"); without any Python rule
    its C++ composite runs oneDNN's fused layer, which the IR has no op for."""
    x = input.transpose(0, 1) if batch_first else input
    out, h, c = _recurrence("LSTM", x, hx[0], hx[1], params, has_biases, num_layers,
                            dropout, train, bidirectional)
    return (out.transpose(0, 1) if batch_first else out), h, c


class PaddedSteps:
    """What stands for a packed sequence's data while a step records: the padded steps
    ``steps`` [T, B, ...] (time-major, in the packed order) and each sequence's length.
    Its rows are not the packed rows, so any other use of it is refused, naming it."""

    def __init__(self, steps: torch.Tensor, lengths: torch.Tensor):
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_lengths", lengths)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        _refuse(f"passes it to {getattr(func, '__name__', func)}")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        _refuse(f"reads its .{name}")


def _refuse(what: str):
    from ..errors import TraceError
    raise TraceError(
        f"the step uses a packed sequence's data ({what}): while a step records, salus keeps "
        "a packed sequence as its padded steps and lengths, which the recurrent modules "
        "(nn.LSTM, nn.GRU, nn.RNN) and pad_packed_sequence take, since the packed rows' "
        "count depends on the lengths' values; unpack it first (pad_packed_sequence) and "
        "compute on the padded tensor, masking the steps past each length")


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__matmul__", "__getitem__", "__len__",
              "__iter__", "__neg__", "__pow__"):
    setattr(PaddedSteps, _name, lambda self, *args, _n=_name: _refuse(f"applies {_n}"))


def _pack_padded(input, lengths, batch_first):
    """``_pack_padded_sequence``: the padded steps (time-major) and their lengths in the
    place of the packed data, and the batch sizes (how many sequences reach each step).
    PyTorch's checks of the lengths (each at least 1, sorted longest first, none longer
    than the batch's steps) fail the iteration with its messages."""
    steps = input.transpose(0, 1) if batch_first else input
    count = steps.shape[0]
    lengths = lengths.to(torch.int64)
    torch._assert_async((lengths > 0).all(), "Length of all samples has to be greater than "
                        "0, but found an element in 'lengths' that is <= 0")
    if lengths.numel() > 1:
        torch._assert_async((lengths[:-1] >= lengths[1:]).all(), "`lengths` array must be "
                            "sorted in decreasing order when `enforce_sorted` is True")
    torch._assert_async((lengths <= count).all(), "a length in 'lengths' is longer than "
                        f"the input's {count} steps")
    batch_sizes = (lengths.unsqueeze(0) > torch.arange(count).unsqueeze(1)).sum(1)
    return PaddedSteps(steps, lengths), batch_sizes


def _pad_packed(data, batch_sizes, batch_first, padding_value, total_length):
    """``_pad_packed_sequence``: the padded steps, each past its sequence's length set to
    ``padding_value``, to ``total_length`` steps; and the lengths. PyTorch pads to the
    longest sequence when no ``total_length`` is given: the iteration then fails unless
    the longest sequence fills the batch's steps, the length salus pads to."""
    if not isinstance(data, PaddedSteps):
        _refuse("pads a packed sequence made another way than by pack_padded_sequence")
    steps, lengths = data._steps, data._lengths
    count = steps.shape[0]
    if sys._getframe(1).f_locals.get("total_length", 0) is None:
        torch._assert_async(lengths.max() == count, "pad_packed_sequence: salus pads to "
                            f"the batch's {count} steps and this batch's longest sequence "
                            "is shorter, which PyTorch would pad to: pass "
                            f"total_length={count} (a fixed padded length)")
    live = lengths.unsqueeze(0) > torch.arange(count).unsqueeze(1)
    live = live.reshape(*live.shape, *([1] * (steps.dim() - 2)))
    padded = torch.where(live, steps, torch.full_like(steps, padding_value))
    if total_length > count:
        padded = torch.cat([padded, torch.full((total_length - count, *padded.shape[1:]),
                                               padding_value, dtype=padded.dtype)])
    return (padded.transpose(0, 1) if batch_first else padded), lengths


def _packed_forward(module: nn.RNNBase, packed: PackedSequence, hx):
    """A recurrent module on a packed sequence whose data is :class:`PaddedSteps`: the
    steps of each sequence past its length skipped; the outputs packed the same way and
    the final states in the caller's order, as PyTorch gives them."""
    data, batch_sizes, sorted_indices, unsorted_indices = packed
    if not isinstance(data, PaddedSteps):
        _refuse(f"gives {type(module).__name__} a packed sequence made another way than "
                "by pack_padded_sequence")
    steps, lengths = data._steps, data._lengths
    mode = module.mode  # LSTM, GRU, RNN_TANH or RNN_RELU
    directions = 2 if module.bidirectional else 1
    batch = steps.shape[1]
    out_size = module.proj_size if getattr(module, "proj_size", 0) else module.hidden_size
    layers = module.num_layers * directions
    if hx is None:
        h0 = torch.zeros(layers, batch, out_size, dtype=steps.dtype)
        c0 = torch.zeros(layers, batch, module.hidden_size, dtype=steps.dtype)
    else:
        h0, c0 = hx if mode == "LSTM" else (hx, None)
        if sorted_indices is not None:
            h0 = h0.index_select(1, sorted_indices)
            c0 = c0.index_select(1, sorted_indices) if c0 is not None else None
    # By name: the module's cached list holds the parameters of before the recording.
    weights = [getattr(module, name) for name in module._flat_weights_names]
    out, h, c = _recurrence(mode, steps, h0, c0, weights, module.bias,
                            module.num_layers, module.dropout, module.training,
                            module.bidirectional, lengths)
    if unsorted_indices is not None:
        h = h.index_select(1, unsorted_indices)
        c = c.index_select(1, unsorted_indices) if c is not None else None
    output = PackedSequence(PaddedSteps(out, lengths), batch_sizes, sorted_indices,
                            unsorted_indices)
    return output, ((h, c) if mode == "LSTM" else h)


def _with_packed(forward):
    def run(self, input, hx=None):
        if isinstance(input, PackedSequence):
            return _packed_forward(self, input, hx)
        return forward(self, input, hx)
    return run


@contextlib.contextmanager
def packed_sequences_in_the_graph() -> Iterator[None]:
    """While a step records: packing keeps the padded steps, and ``nn.LSTM``, ``nn.GRU``
    and ``nn.RNN`` (and their subclasses) and ``pad_packed_sequence`` take them; all put
    back after."""
    vf = torch._VF
    forwards = {cls: cls.forward for cls in (nn.LSTM, nn.GRU, nn.RNN)}
    vf._pack_padded_sequence, vf._pad_packed_sequence = _pack_padded, _pad_packed
    for cls, forward in forwards.items():
        cls.forward = _with_packed(forward)
    try:
        yield
    finally:
        del vf._pack_padded_sequence, vf._pad_packed_sequence
        for cls, forward in forwards.items():
            cls.forward = forward

"""What eager PyTorch computes differently in inference, kept in an inference step.

``nn.TransformerEncoder`` in eval mode, run without gradients (``torch.no_grad()``,
``torch.inference_mode()``), with a key padding mask and its layers fit for it, takes
PyTorch's "fast path": the padded positions are dropped (a nested tensor) and come back
as zeros before the final norm, so the output there is ``norm(0)``, not what the layers
compute for them (which the path with gradients, and a recorded step, give). The valid
positions agree either way, but a head that pools over every position (a mean over the
sequence) sees the difference. While an inference step records, an encoder that would
take that path gives zeros at the padded positions before its norm, as eagerly
(:func:`inference_paths`). PyTorch takes the path only for a mask whose valid positions
come first in each row (``mask_check``): the recorded step checks that in the graph.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

_ENCODER_FORWARD = nn.TransformerEncoder.forward


def _takes_the_nested_path(encoder: nn.TransformerEncoder, src: torch.Tensor,
                           mask, padding) -> bool:
    """Whether eager PyTorch, without gradients, would run ``encoder`` on nested
    tensors: its own conditions that do not depend on the values (the mask's
    alignment is checked in the graph)."""
    first = encoder.layers[0]
    return (torch.backends.mha.get_fastpath_enabled()
            and getattr(encoder, "use_nested_tensor", False) and not first.training
            and src.dim() == 3 and padding is not None and mask is None
            and not torch.is_autocast_enabled()
            and src.device.type in ("cpu", "cuda"))


def _encoder_forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
    if not _takes_the_nested_path(self, src, mask, src_key_padding_mask):
        return _ENCODER_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
    norm, self.norm = self.norm, None
    try:
        out = _ENCODER_FORWARD(self, src, mask, src_key_padding_mask, is_causal)
    finally:
        self.norm = norm
    padding = src_key_padding_mask
    padding = padding if padding.dtype == torch.bool else padding != 0
    zeroed = padding
    if getattr(self, "mask_check", True):
        # PyTorch's path needs each row's valid positions first (right padding).
        valid = (~padding).to(torch.int32)
        aligned = torch.all(torch.cummin(valid, dim=1).values == valid)
        zeroed = padding & aligned
    out = torch.where(zeroed[..., None], torch.zeros((), dtype=out.dtype), out)
    return out if norm is None else norm(out)


@contextlib.contextmanager
def inference_paths() -> Iterator[None]:
    """While an inference step records, ``nn.TransformerEncoder`` computes what eager
    PyTorch's inference path gives (see the module's docs)."""
    nn.TransformerEncoder.forward = _encoder_forward
    try:
        yield
    finally:
        nn.TransformerEncoder.forward = _ENCODER_FORWARD

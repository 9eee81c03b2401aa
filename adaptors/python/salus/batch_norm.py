"""Batch norm's cumulative moving average (``momentum=None``) in a recorded step.

With ``momentum=None`` a training batch norm averages its running statistics over every
batch so far, weighing the batch by ``1 / num_batches_tracked``, a factor PyTorch reads
from the count in Python (``float(self.num_batches_tracked)``): a value a recording
cannot take. While a step records, such a batch norm normalises with a momentum of 0
(its running statistics as they are) and then updates them with the factor computed in
the graph from the count, as PyTorch's kernel does with the factor it read: the mean,
and the unbiased variance, of the batch weighed by ``1 / n`` (:func:`cumulative_averages`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

_FORWARD = _BatchNorm.forward


def _forward(self, input: torch.Tensor) -> torch.Tensor:
    if not (self.momentum is None and self.training and self.track_running_stats
            and self.num_batches_tracked is not None):
        return _FORWARD(self, input)
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    with torch.no_grad():
        # (before the normalisation, whose momentum of 0 then keeps them as they are)
        x = input.detach().to(self.running_mean.dtype)
        dims = [0, *range(2, x.dim())]
        factor = torch.reciprocal(self.num_batches_tracked.to(x.dtype))
        mean = x.mean(dims)
        var = x.var(dims, correction=1)
        self.running_mean.copy_(mean * factor + self.running_mean * (1 - factor))
        self.running_var.copy_(var * factor + self.running_var * (1 - factor))
    return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                        True, 0.0, self.eps)


@contextlib.contextmanager
def cumulative_averages() -> Iterator[None]:
    """While a step records, batch norms with ``momentum=None`` update their running
    statistics as eager PyTorch does (see the module's docs)."""
    _BatchNorm.forward = _forward
    try:
        yield
    finally:
        _BatchNorm.forward = _FORWARD

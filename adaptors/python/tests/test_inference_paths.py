"""An inference step computes what eager PyTorch's inference computes: a
``nn.TransformerEncoder`` with a key padding mask, in eval mode without gradients, gives
``norm(0)`` at the padded positions (PyTorch's nested-tensor path), which a head that
pools over every position sees (salus.inference_paths)."""

from __future__ import annotations

import pytest
import torch
from harness import assert_as_exact_as_pytorch, randomly_rounded, twin
from torch import nn

import salus


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16))
            self.head = nn.Linear(16, 3)

    def forward(self, x, padding):
        # pooled over every position, padded ones included
        return self.head(self.encoder(x, src_key_padding_mask=padding).mean(1))


@pytest.mark.parametrize("padded", ["right", "left"])
def test_a_padded_encoder_infers_as_eager_pytorch_without_gradients(padded):
    model = _Classifier().eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 6, 16, generator=g)
    lengths = torch.tensor([6, 4, 2])
    positions = torch.arange(6)[None, :]
    padding = (positions >= lengths[:, None] if padded == "right"
               else positions < 6 - lengths[:, None])  # left padding: PyTorch's slow path
    traced = salus.trace_inference(model, (x, padding))
    _, out = traced.run(dict(traced.initial_state), x, padding)

    def eager(dtype):
        with torch.no_grad():
            return {"out": twin(model, dtype)(x.to(dtype), padding)}

    exact, pytorch = eager(torch.float64), eager(torch.float32)
    assert_as_exact_as_pytorch({"out": out}, exact, pytorch,
                               randomly_rounded(lambda: eager(torch.float64)))
    # With gradients PyTorch computes the padded positions: the outputs differ there.
    with_grad = model(x, padding)
    differs = not torch.allclose(with_grad, exact["out"].float(), atol=1e-3)
    assert differs == (padded == "right")

"""A loss that takes a gradient itself (WGAN-GP's gradient penalty, a double backward):
written with ``torch.func.grad`` it trains three Adam steps on salusd against float64 by
the suite's rule (harness.py); written with ``requires_grad_`` and
``torch.autograd.grad(..., create_graph=True)``, which PyTorch does not allow inside the
transform salus records the step's gradient with, it is refused naming the line and the
``torch.func`` form."""

from __future__ import annotations

import pytest
import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn

import salus


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def _penalty_by_func(critic, real, fake, mix):
    x_hat = mix * real + (1 - mix) * fake
    grad = torch.func.grad(lambda x: critic(x).sum())(x_hat)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def _penalty_by_autograd(critic, real, fake, mix):
    x_hat = (mix * real + (1 - mix) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g),
            torch.rand(6, 1, generator=g))


def test_a_gradient_penalty_by_torch_func_trains_on_salusd_as_eagerly(daemon):
    torch.manual_seed(0)
    assert_trains_on_salusd_as_eagerly(Critic(), _batch(), _penalty_by_func,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)


def test_a_gradient_penalty_by_autograd_is_refused_naming_the_torch_func_form():
    critic = Critic()
    _penalty_by_autograd(critic, *_batch()).backward()  # eager PyTorch runs it
    with pytest.raises(salus.TraceError, match=r"test_gradient_penalty.py:\d+.*torch.func.grad"):
        salus.trace_train_step(critic, None, torch.optim.Adam(critic.parameters()), _batch(),
                               loss_of=_penalty_by_autograd)

"""A loss that takes a gradient itself (``salus.inner_gradients``): WGAN-GP's gradient
penalty and R1's by ``requires_grad_()`` and ``torch.autograd.grad(...,
create_graph=True)`` (a double backward), R1's with ``requires_grad`` set as an attribute,
the same by ``torch.func.grad``, and a gradient taken without ``create_graph`` (a
constant, as eagerly), each trained three Adam steps on salusd against float64 by the
suite's rule (harness.py)."""

from __future__ import annotations

import pytest
import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn

F = nn.functional


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def _wgan_gp(critic, real, fake, mix):
    x_hat = (mix * real + (1 - mix) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def _r1(critic, real, fake, mix):
    real = real.detach().requires_grad_()
    scores = critic(real)
    grad, = torch.autograd.grad(scores.sum(), real, create_graph=True)
    return (F.softplus(-scores).mean() + F.softplus(critic(fake)).mean()
            + 5 * grad.pow(2).sum(1).mean())


def _by_torch_func(critic, real, fake, mix):
    x_hat = mix * real + (1 - mix) * fake
    grad = torch.func.grad(lambda x: critic(x).sum())(x_hat)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    return critic(fake).mean() - critic(real).mean() + 10 * penalty


def _constant_gradient(critic, real, fake, mix):
    x_hat = (mix * real + (1 - mix) * fake).requires_grad_()
    grad, = torch.autograd.grad(critic(x_hat).sum(), x_hat)  # no create_graph: a constant
    return critic(fake).mean() - critic(real).mean() + (critic(x_hat) * grad[:, :1]).mean()


def _by_attribute(critic, real, fake, mix):
    real = real.detach()
    real.requires_grad = True
    grad, = torch.autograd.grad(critic(real).sum(), real, create_graph=True)
    return F.softplus(critic(fake)).mean() + grad.pow(2).sum()


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g),
            torch.rand(6, 1, generator=g))


@pytest.mark.parametrize("loss", [_wgan_gp, _r1, _by_torch_func, _constant_gradient, _by_attribute],
                         ids=["wgan_gp", "r1", "torch_func", "constant", "attribute"])
def test_a_loss_taking_a_gradient_trains_on_salusd_as_eagerly(daemon, loss):
    torch.manual_seed(0)
    assert_trains_on_salusd_as_eagerly(Critic(), _batch(), loss,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)

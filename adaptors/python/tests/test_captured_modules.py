"""Modules outside the session's model that its step reads: a DQN's target network synced
now and then, a teacher that follows the student by a moving average, a GAN's two
networks each in the other's loss (each trained by a session of its own). Their
parameters are session state (``captured.<k>``) that the session writes again whenever
they change, so every step reads what eager PyTorch would."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import assert_as_exact_as_pytorch, randomly_rounded, torch_state, twin
from torch import nn

import salus
import salus.torch as st

F = nn.functional
STEPS = 6


def _net(seed: int, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))


def _batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g),
             torch.randn(6, generator=g)) for _ in range(STEPS)]


def _judge(run):
    assert_as_exact_as_pytorch(run(None), run(torch.float64), run(torch.float32),
                               randomly_rounded(lambda: run(torch.float64)))


def test_a_target_network_synced_every_few_steps(daemon):
    """DQN: the loss reads a target network under no_grad; every second step the loop
    copies the online network into it (load_state_dict)."""
    batches = _batches()

    def loss_of(target):
        def loss(online, s, a, r):
            with torch.no_grad():
                goal = r + 0.9 * target(s).max(1).values
            return F.smooth_l1_loss(online(s).gather(1, a[:, None])[:, 0], goal)
        return loss

    def run(dtype):
        online, target = twin(_net(0), dtype), twin(_net(1), dtype)
        optimizer = torch.optim.Adam(online.parameters(), lr=1e-2)
        cast = [tuple(t.to(dtype) if dtype and t.is_floating_point() else t for t in b)
                for b in batches]
        if dtype is None:
            with st.TrainSession(online, None, optimizer, batches[0], loss_of=loss_of(target),
                                 address=daemon.address) as session:
                for k, b in enumerate(batches):
                    session.step(*b)
                    if k % 2 == 1:
                        target.load_state_dict(online.state_dict())
        else:
            loss = loss_of(target)
            for k, b in enumerate(cast):
                optimizer.zero_grad()
                loss(online, *b).backward()
                optimizer.step()
                if k % 2 == 1:
                    target.load_state_dict(online.state_dict())
        return {**torch_state(online, optimizer),
                **{f"target.{n}": p for n, p in target.named_parameters()}}

    _judge(run)


def test_a_teacher_that_follows_the_student_by_a_moving_average(daemon):
    """BYOL/DINO style: the loss matches a teacher's outputs; after each step the loop
    moves the teacher's parameters toward the student's (read through parameters())."""
    batches = _batches(2)

    def run(dtype):
        student = twin(_net(3), dtype)
        teacher = copy.deepcopy(student)
        optimizer = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)

        def loss(m, s, a, r):
            with torch.no_grad():
                goal = F.softmax(teacher(s) / 0.5, dim=1)
            return -(goal * F.log_softmax(m(s), dim=1)).sum(1).mean()

        def follow():
            with torch.no_grad():
                for t, p in zip(teacher.parameters(), student.parameters()):
                    t.mul_(0.8).add_(p, alpha=0.2)

        if dtype is None:
            with st.TrainSession(student, None, optimizer, batches[0], loss_of=loss,
                                 address=daemon.address) as session:
                for b in batches:
                    session.step(*b)
                    follow()
        else:
            for b in batches:
                b = tuple(t.to(dtype) if t.is_floating_point() else t for t in b)
                optimizer.zero_grad()
                loss(student, *b).backward()
                optimizer.step()
                follow()
        return {**torch_state(student, optimizer),
                **{f"teacher.{n}": p for n, p in teacher.named_parameters()}}

    _judge(run)


def test_a_gan_trained_by_two_sessions(daemon):
    """The discriminator's session reads the generator, the generator's session reads
    the discriminator; each brings the other's trained tensors back before it steps."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(6, 3, generator=g) * 0.5 + 1, torch.randn(6, 2, generator=g))
               for _ in range(STEPS)]

    def build(dtype):
        torch.manual_seed(5)
        generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 3))
        critic = nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        return twin(generator, dtype), twin(critic, dtype)

    def run(dtype):
        generator, critic = build(dtype)
        opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2, betas=(0.5, 0.9))
        opt_d = torch.optim.Adam(critic.parameters(), lr=1e-2, betas=(0.5, 0.9))

        def d_loss(d, real, z):
            fake = generator(z).detach()
            ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
            return (F.binary_cross_entropy_with_logits(d(real), ones.to(real.dtype))
                    + F.binary_cross_entropy_with_logits(d(fake), zeros.to(real.dtype)))

        def g_loss(gen, z):
            return F.binary_cross_entropy_with_logits(
                critic(gen(z)), torch.ones(z.shape[0], 1, dtype=z.dtype))

        if dtype is None:
            with st.TrainSession(critic, None, opt_d, batches[0], loss_of=d_loss,
                                 address=daemon.address) as ds, \
                    st.TrainSession(generator, None, opt_g, batches[0][1:], loss_of=g_loss,
                                    address=daemon.address) as gs:
                for real, z in batches:
                    ds.step(real, z)
                    gs.step(z)
        else:
            for real, z in batches:
                real, z = real.to(dtype), z.to(dtype)
                opt_d.zero_grad()
                d_loss(critic, real, z).backward()
                opt_d.step()
                opt_g.zero_grad()
                g_loss(generator, z).backward()
                opt_g.step()
        return {**{f"g.{k}": v for k, v in torch_state(generator, opt_g).items()},
                **{f"d.{k}": v for k, v in torch_state(critic, opt_d).items()}}

    _judge(run)


class _Head(nn.Module):
    """A head over an encoder that is not a submodule: the forward pass reads it from
    outside the model."""

    def __init__(self, head: nn.Module, encoder: nn.Module):
        super().__init__()
        self.head = head
        self.__dict__["encoder"] = encoder  # a plain attribute, not a submodule

    def forward(self, x):
        return self.head(self.encoder(x))


def test_an_inference_session_follows_a_captured_module(daemon):
    """A forward pass that reads a module outside the model (a frozen encoder the loop
    swaps weights into) answers with its current weights."""
    encoder, head = _net(6), nn.Linear(3, 2)


    model, x = _Head(head, encoder), torch.randn(5, 4)
    with st.InferenceSession(model, (x,), address=daemon.address) as serve:
        first = serve(x)
        encoder.load_state_dict(_net(7).state_dict())
        second = serve(x)
    with torch.no_grad():
        want = model(x)
        exact = copy.deepcopy(head).double()(copy.deepcopy(encoder).double()(x.double()))
    assert not torch.allclose(first, second)
    assert_as_exact_as_pytorch({"out": second}, {"out": exact}, {"out": want})


def test_a_captured_plain_tensor_changed_in_place_is_refused(daemon):
    """A plain tensor the loss captures (class weights in a global) is a constant of the
    graph: changing it in place between steps is refused, naming the remedies, rather
    than trained past."""
    weights = torch.tensor([1.0, 2.0, 0.5])
    model = _net(8)
    batch = _batches(3)[0][:2]
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                         loss_of=lambda m, x, y: F.cross_entropy(m(x), y, weight=weights),
                         address=daemon.address) as session:
        session.step(*batch)
        weights.mul_(2)
        with pytest.raises(salus.SalusError, match="register it as a buffer"):
            session.step(*batch)


def test_a_loss_fn_that_reads_the_model_trains_its_weights(daemon):
    """``loss_fn(model(x), y)`` with a penalty on the model's own weights (a closure over
    the model) reads the traced, trained tensors, as eagerly; a tensor of the model held
    by another reference (taken before) would be a copy, and is refused naming it."""
    model = _net(9)
    x, y, _ = _batches(4)[0]

    def run(dtype):
        m = twin(model, dtype)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)

        def loss(out, target):
            return F.cross_entropy(out, target) + 1e-2 * m[0].weight.pow(2).sum()

        if dtype is None:
            with st.TrainSession(m, loss, optimizer, (x, y), address=daemon.address) as s:
                for _ in range(3):
                    s.step(x, y)
        else:
            for _ in range(3):
                optimizer.zero_grad()
                loss(m(x.to(dtype)), y).backward()
                optimizer.step()
        return torch_state(m, optimizer)

    _judge(run)
    held = model[0].weight
    with pytest.raises(salus.TraceError, match="reads the model's 0.weight other than"):
        salus.trace_train_step(model, lambda out, t: F.cross_entropy(out, t) + held.sum(),
                               torch.optim.SGD(model.parameters(), lr=0.1), (x, y))


def test_a_served_model_refuses_requests_once_a_module_it_reads_changed(daemon):
    """A served model keeps what its forward pass reads from outside as it was when
    served: after that changes in place, a request is refused, naming the remedy."""
    from salus.serving import ServedModel

    encoder, head = _net(10), nn.Linear(3, 2)


    with ServedModel(_Head(head, encoder), torch.randn(4), batch_sizes=(1, 2),
                     address=daemon.address) as served:
        x = torch.randn(4)
        out = served.infer(x)
        with torch.no_grad():
            exact = copy.deepcopy(head).double()(copy.deepcopy(encoder).double()(x.double()))
            assert_as_exact_as_pytorch({"out": out}, {"out": exact}, {"out": head(encoder(x))})
        encoder.load_state_dict(_net(11).state_dict())
        with pytest.raises(salus.SalusError, match="serve the model anew"):
            served.infer(x)

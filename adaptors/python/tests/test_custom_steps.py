"""Training steps beyond ``loss_fn(model(x), y)``: a user's ``loss_of(model, *batch)``
(several outputs, an auxiliary loss, a dict batch), gradient accumulation over
micro-batches and gradient clipping, traced and checked against the eager loop that
does the same; and on salusd, accumulation planned for one micro-batch's memory."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from harness import (assert_as_exact_as_pytorch, randomly_rounded, to_dtype, torch_state,
                     traced_steps, twin)
from torch import nn
from torch.nn import functional as F

import salus
import salus.torch as st
from salus.models import MLP, vector_batch

STEPS = 4


class TwoHeads(nn.Module):
    """A classifier and a regressor over one body, returned as a dict."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.cls = nn.Linear(8, 3)
        self.reg = nn.Linear(8, 1)

    def forward(self, x):
        h = self.body(x)
        return {"logits": self.cls(h), "value": self.reg(h).squeeze(1), "hidden": h}


def _two_heads():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TwoHeads()


def _mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP(6, (5,), 3)


def loss_of(model, batch):
    """Cross-entropy plus a weighted regression loss plus an activity penalty."""
    out = model(batch["x"])
    return (F.cross_entropy(out["logits"], batch["label"])
            + 0.5 * F.mse_loss(out["value"], batch["target"])
            + 1e-3 * out["hidden"].pow(2).mean())


def _dict_batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 6, generator=g), "label": torch.randint(0, 3, (n,), generator=g),
            "target": torch.randn(n, generator=g)}


def _eager(model, optimizer, batches, compute, k=1, clip=None):
    """The eager loop: k micro-batches per step, (loss / k).backward() each, then clip,
    then step."""
    for batch in batches:
        optimizer.zero_grad()
        for i in range(k):
            part = {n: t.chunk(k)[i] for n, t in batch.items()}
            (compute(model, part) / k).backward()
        if clip is not None:
            clip(model.parameters())
        optimizer.step()
    return torch_state(model, optimizer)


def _dtype(batch, dtype):
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in batch.items()}


CASES = {
    "loss_of_dict_batch": dict(k=1, recipe={}, clip=None),
    "accumulate_4": dict(k=4, recipe={"accumulate": 4}, clip=None),
    "accumulate_2_clip_norm": dict(
        k=2, recipe={"accumulate": 2, "clip_grad_norm": 0.1},
        clip=lambda p: nn.utils.clip_grad_norm_(p, 0.1)),
    "clip_norm_inf": dict(
        k=1, recipe={"clip_grad_norm": 0.05, "norm_type": float("inf")},
        clip=lambda p: nn.utils.clip_grad_norm_(p, 0.05, norm_type=float("inf"))),
    "clip_value": dict(
        k=1, recipe={"clip_grad_value": 0.02},
        clip=lambda p: nn.utils.clip_grad_value_(p, 0.02)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_custom_step_matches_the_eager_loop(case):
    k, recipe, clip = CASES[case]["k"], CASES[case]["recipe"], CASES[case]["clip"]
    model = _two_heads()
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    batches = [_dict_batch(s) for s in range(STEPS)]

    def reference(dtype):
        m = twin(model, dtype)
        o = make(m.parameters())
        return _eager(m, o, [_dtype(b, dtype) for b in batches], loss_of, k, clip)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    traced = salus.trace_train_step(model, None, make(model.parameters()), (batches[0],),
                                    loss_of=loss_of, gradients=salus.GradientRecipe(**recipe))
    state, _ = traced_steps(traced, [(b,) for b in batches])
    assert_as_exact_as_pytorch(state, exact, eager, rounded, label=f"{case}: ")


def test_recipe_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="not both"):
        salus.GradientRecipe(clip_grad_norm=1.0, clip_grad_value=1.0)
    with pytest.raises(ValueError, match="accumulate"):
        salus.GradientRecipe(accumulate=0)
    model = _mlp()
    with pytest.raises(salus.TraceError, match="3 equal micro-batches"):
        salus.trace_train_step(model, F.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(8, 6, 3), gradients=salus.GradientRecipe(3))
    with pytest.raises(ValueError, match="not both"):
        salus.trace_train_step(model, F.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(8, 6, 3), loss_of=loss_of)


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def test_accumulation_on_salusd_matches_eager_in_a_micro_batchs_memory(daemon):
    # A fixed draw: with the global generator's state left by earlier tests, some draws
    # put a ReLU's input within float32 rounding of zero (seed 42: 3e-8 in the second
    # layer), where any other order of the sum may flip that unit's gradient; no rounding
    # rule bounds that jump, and which draw the suite reaches depended on the tests before.
    torch.manual_seed(0)
    model = MLP(64, (256, 256), 10)
    x, y = vector_batch(2048, 64, 10)
    make = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731

    def reference(dtype):
        m = twin(model, dtype)
        o = make(m.parameters())
        batch = {"x": x.to(dtype), "y": y}
        return _eager(m, o, [batch] * 2,
                      lambda mod, b: F.cross_entropy(mod(b["x"]), b["y"]), k=8)

    exact, eager = reference(torch.float64), reference(torch.float32)
    sizes = {}
    for k in (1, 8):
        m = twin(model)
        with st.TrainSession(m, F.cross_entropy, make(m.parameters()), (x, y),
                             accumulate=k, address=daemon.address,
                             admission_timeout=10) as session:
            sizes[k] = session.session.ephemeral_bytes
            if k == 8:
                loss = session.step(x, y)
                session.step(x, y)
                state = session.state_dict()
    assert sizes[8] < sizes[1] / 2, f"E with 8 micro-batches {sizes[8]} vs whole {sizes[1]}"
    assert loss.shape == ()
    assert_as_exact_as_pytorch(state, exact, eager, label="accumulate on salusd: ")


def test_a_batch_of_another_structure_is_refused_by_name(daemon):
    model = _two_heads()
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         (_dict_batch(0),), loss_of=loss_of, address=daemon.address,
                         admission_timeout=10) as session:
        session.step(_dict_batch(1))
        wrong = _dict_batch(2)
        wrong["weights"] = wrong.pop("target")
        with pytest.raises(st.BatchError, match="structured as"):
            session.step(wrong)


# -- random numbers drawn inside the step ---------------------------------------------------


class _Draws(nn.Module):
    """Uniform and normal draws shaped like the input (``rand_like``, ``randn_like``,
    ``randn`` of a size, and a 16-bit ``rand_like``)."""

    def forward(self, x):
        return (torch.rand_like(x), torch.randn_like(x), torch.randn(x.shape),
                torch.rand_like(x, dtype=torch.bfloat16))


def test_draws_in_the_step_come_from_the_sessions_generator(daemon):
    """The draws are the session generator's: uniform in [0, 1) and standard normal
    (Box and Muller's transform of two uniform draws), new on every call, and the same
    again from the same generator state."""
    x = torch.zeros(64, 500)
    with st.InferenceSession(_Draws(), x, address=daemon.address) as session:
        state = session.state_dict()
        first = session(x)
        second = session(x)
        session.load_state_dict(state)
        again = session(x)
    n = x.numel()
    uniform, normal, sized, half = first
    assert uniform.min() >= 0 and uniform.max() < 1 and half.max() < 1
    assert half.dtype == torch.bfloat16
    for u in (uniform, half.float()):
        assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    for z in (normal, sized):
        z = z.double()
        # Mean 0, variance 1, and the normal's share within one and two deviations
        # (0.6827, 0.9545), each within 5 standard errors.
        assert abs(z.mean().item()) < 5 / n ** 0.5
        assert abs(z.var().item() - 1) < 5 * (2 / n) ** 0.5
        for k, share in ((1, 0.682689), (2, 0.954500)):
            inside = (z.abs() < k).double().mean().item()
            assert abs(inside - share) < 5 * (share * (1 - share) / n) ** 0.5, (k, inside)
    assert not torch.equal(normal, sized), "two draws, two streams"
    assert all(not torch.equal(a, b) for a, b in zip(first, second)), "new draws each call"
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "the state decides the draws"


class _MoreDraws(nn.Module):
    """The other draws a step may make, from the same generator: ``normal_``,
    ``uniform_``, ``exponential_`` (Gumbel noise), ``randint``, ``randint_like``,
    ``torch.normal`` of tensors, ``randperm``, ``F.gumbel_softmax`` and ``RReLU``'s
    slopes in training."""

    def forward(self, x):
        logits = torch.zeros(x.shape[0], 4) + torch.tensor([0.0, 1.0, 2.0, 3.0])
        return (torch.empty_like(x).normal_(2.0, 3.0), torch.empty_like(x).uniform_(-1, 3),
                torch.empty_like(x).exponential_(2.0), torch.randint(3, 8, x.shape),
                torch.randint_like(x, 5), torch.normal(x + 1, torch.full_like(x, 0.5)),
                torch.randperm(x.shape[1]), F.gumbel_softmax(logits, tau=1.0, hard=True),
                F.rrelu(torch.cat([x - 1, x + 1]), 0.1, 0.4, training=True))


def test_every_kind_of_draw_has_its_distribution(daemon):
    """Each draw of ``_MoreDraws`` against its distribution's mean and variance (within 5
    standard errors), its range, and for ``randperm`` and a hard Gumbel-softmax what
    they must be (a permutation; one-hot rows picking class k with probability
    softmax(logits)[k]; RReLU's negative inputs times slopes uniform in [lower, upper),
    its positive ones as they are)."""
    x = torch.zeros(64, 500)
    with st.InferenceSession(_MoreDraws(), x, address=daemon.address) as session:
        (normal, uniform, exponential, ints, ints_like, normal_of, order, gumbel,
         rrelu) = session(x)
    n = x.numel()

    def moments(t, mean, variance, fourth):
        """Sample mean and variance within 5 standard errors; ``fourth``: the law's
        fourth central moment (the variance's standard error is sqrt((m4 - var^2) / n))."""
        t = t.double()
        assert abs(t.mean().item() - mean) < 5 * (variance / n) ** 0.5, (t.mean(), mean)
        spread = 5 * ((fourth - variance ** 2) / n) ** 0.5
        assert abs(t.var().item() - variance) < spread, (t.var(), variance)

    moments(normal, 2.0, 9.0, 3 * 9.0 ** 2)
    moments(normal_of, 1.0, 0.25, 3 * 0.25 ** 2)
    assert uniform.min() >= -1 and uniform.max() < 3
    moments(uniform, 1.0, 4 ** 2 / 12, 4 ** 4 / 80)
    assert exponential.min() >= 0
    moments(exponential, 0.5, 0.25, 9 / 2 ** 4)
    assert ints.dtype == torch.int64 and ints.min() == 3 and ints.max() == 7
    k = 5  # values 3..7
    moments(ints, 5.0, (k ** 2 - 1) / 12, (k ** 2 - 1) * (3 * k ** 2 - 7) / 240)
    assert ints_like.dtype == torch.float32 and set(ints_like.unique().tolist()) == set(range(5))
    assert torch.equal(order.sort().values, torch.arange(500))
    assert torch.equal(gumbel.sum(1), torch.ones(64)) and set(gumbel.unique().tolist()) == {0, 1}
    share = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0)
    picked = gumbel.mean(0)
    assert ((picked - share).abs() < 5 * (share * (1 - share) / 64) ** 0.5).all(), picked
    slopes, positive = -rrelu[:64], rrelu[64:]
    assert slopes.min() >= 0.1 and slopes.max() < 0.4 and torch.equal(positive, x + 1)
    moments(slopes, 0.25, 0.3 ** 2 / 12, 0.3 ** 4 / 80)


def _denoising_loss(model, x0, level):
    """A diffusion model's training loss: the noise drawn in the step, mixed into the
    clean batch at each example's noise level, predicted back."""
    noise = torch.randn_like(x0)
    a = level[:, None]
    return F.mse_loss(model(a.sqrt() * x0 + (1 - a).sqrt() * noise), noise)


def test_a_denoising_step_draws_its_noise_on_salusd(daemon):
    """The noise is drawn on salusd from the session's generator: a seeded session trains
    the same losses twice, and the denoiser learns (the loss falls from about 1, the
    noise's variance)."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(32, 8, generator=g), torch.rand(32, generator=g) * 0.5 + 0.25)
            for _ in range(40)]
    runs = []
    for _ in range(2):
        torch.manual_seed(11)  # seeds the model and the session's generator
        model = nn.Sequential(nn.Linear(8, 64), nn.SiLU(), nn.Linear(64, 8))
        with st.TrainSession(model, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                             data[0], loss_of=_denoising_loss,
                             address=daemon.address) as session:
            runs.append([float(session.step(*b)) for b in data])
    assert runs[0] == runs[1]
    first, last = sum(runs[0][:5]) / 5, sum(runs[0][-5:]) / 5
    assert 0.7 < first < 1.5 and last < 0.8 * first, (first, last)


def test_a_cosine_similarity_loss_trains_on_salusd_as_eagerly(daemon):
    """A contrastive-style loss: cosine similarity (its norm floor a ``clamp`` by a
    tensor) between two views' embeddings."""
    from harness import assert_trains_on_salusd_as_eagerly

    def loss_of(model, a, b):
        return (1 - F.cosine_similarity(model(a), model(b), dim=1)).mean()

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
    g = torch.Generator().manual_seed(4)
    a = torch.randn(8, 6, generator=g)
    batch = (a, a + 0.1 * torch.randn(8, 6, generator=g))
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of,
                                       lambda p: torch.optim.SGD(p, lr=0.1), daemon.address)


# -- custom autograd Functions -------------------------------------------------------------


def _swish_gradient(x, grad):
    s = torch.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


class _Swish(torch.autograd.Function):
    """New style (``setup_context``), its derivative by hand."""

    @staticmethod
    def forward(x):
        return x * torch.sigmoid(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        return _swish_gradient(*ctx.saved_tensors, grad)


class _OldSwish(torch.autograd.Function):
    """Old style: ``forward(ctx, ...)`` saves for the backward itself (as Bloom's GELU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        return _swish_gradient(*ctx.saved_tensors, grad)


class _GradientReversal(torch.autograd.Function):
    """Domain-adversarial training's layer: the identity, its gradient negated and scaled
    by an attribute kept on ``ctx``."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class _StraightThrough(torch.autograd.Function):
    """Quantization-aware training's estimator: the sign forward, the identity back."""

    @staticmethod
    def forward(ctx, x):
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


FUNCTIONS = {"swish": lambda h: _Swish.apply(h), "old_swish": lambda h: _OldSwish.apply(h),
             "gradient_reversal": lambda h: h + _GradientReversal.apply(h, 0.5),
             "straight_through": lambda h: h + _StraightThrough.apply(h)}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_custom_autograd_functions_train_on_salusd_as_eagerly(daemon, name):
    """The user's backward is what the traced step runs: each Function trains three steps
    on salusd as it trains eagerly (the suite's rule, every parameter)."""
    from harness import assert_trains_on_salusd_as_eagerly

    apply = FUNCTIONS[name]

    class WithFunction(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(6, 16)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(apply(self.body(x)))

    torch.manual_seed(6)
    g = torch.Generator().manual_seed(7)
    batch = (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
    assert_trains_on_salusd_as_eagerly(WithFunction(), batch,
                                       lambda m, x, y: F.cross_entropy(m(x), y),
                                       lambda p: torch.optim.SGD(p, lr=0.1), daemon.address,
                                       label=f"{name}: ")


def test_one_hot_targets_train_and_check_their_range_on_salusd(daemon):
    """``F.one_hot`` in the loss (a soft-target loss): it trains as eagerly, and a class
    out of range fails that step with PyTorch's own message (its ``_assert_async``
    checks run on salusd, on every PyTorch: 2.11 reads the indices in Python, and
    salus.checks records them as 2.15 does), the session's state unchanged."""
    from harness import assert_trains_on_salusd_as_eagerly

    def loss_of(model, x, y):
        target = F.one_hot(y, 5).float() * 0.9 + 0.02
        return -(target * F.log_softmax(model(x), dim=1)).sum(1).mean()

    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))
    g = torch.Generator().manual_seed(9)
    batch = (torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g))
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of,
                                       lambda p: torch.optim.SGD(p, lr=0.1), daemon.address)
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                         loss_of=loss_of, address=daemon.address) as session:
        before = session.state_dict()
        for bad, message in ((5, "smaller than num_classes"), (-1, "must be non-negative")):
            y = batch[1].clone()
            y[3] = bad
            with pytest.raises(st.DaemonError, match=message):
                session.step(batch[0], y)
        after = session.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        session.step(*batch)

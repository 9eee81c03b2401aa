"""A user's training loop on real salusd processes: learning-rate schedules (stepped per
iteration, and on the loss salusd returns), per-group hyperparameters, and checkpoints
that keep the optimizer's ``param_groups`` the truth for hyperparameters."""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from daemon import Daemon
from harness import (assert_as_exact_as_pytorch, randomly_rounded, to_dtype, torch_state,
                     twin)
from torch.nn.utils import clip_grad_norm_  # (taken before any session opened)
from torch.optim import lr_scheduler as sched

import salus
import salus.torch as st
from salus.client import Client
from salus.reference import eager_steps, reference_runs

STEPS = 8


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def _groups(model):
    return [{"params": model.body.parameters(), "lr": 0.05},
            {"params": model.head.parameters(), "lr": 0.01, "weight_decay": 1e-3}]


LOOPS = {
    "sgd_groups_steplr": (
        lambda m: torch.optim.SGD(_groups(m), lr=0.1, momentum=0.9),
        lambda o: sched.StepLR(o, step_size=2, gamma=0.5)),
    "adamw_onecycle": (
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)),
    "rmsprop_plateau": (
        lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5),
        lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=0.5)),
}


def _schedule(scheduler, loss) -> None:
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(float(loss))
    else:
        scheduler.step()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_loop_with_a_schedule_trains_on_salusd_as_in_eager(daemon, loop):
    make, make_scheduler = LOOPS[loop]
    spec = reference_runs()["mlp"].spec
    batches = [spec.batch(k) for k in range(STEPS)]
    model = spec.model(0)

    def eager(dtype):
        m = twin(model, dtype)
        o = make(m)
        s = make_scheduler(o)
        losses = []
        for batch in batches:
            losses += eager_steps(m, o, spec.loss_fn, [to_dtype(batch, dtype)])
            _schedule(s, losses[-1])
        return losses, torch_state(m, o)

    want, exact = eager(torch.float32), eager(torch.float64)
    rounded = randomly_rounded(lambda: eager(torch.float64), seeds=(0,))
    optimizer = make(model)
    scheduler = make_scheduler(optimizer)
    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0],
                         address=daemon.address, admission_timeout=10) as session:
        losses, used = [], []
        for batch in batches:  # the user's loop, unchanged but for session.step
            used.append([group["lr"] for group in optimizer.param_groups])
            loss = session.step(*batch)
            _schedule(scheduler, loss)
            losses.append(loss.item())
        state = session.state_dict()
    lrs = {n: v.item() for n, v in state.items() if n.endswith(".lr")}
    assert lrs == pytest.approx({f"optimizer.param_groups.{g}.lr": lr
                                 for g, lr in enumerate(used[-1])}), \
        "the session holds the learning rates the last step used"
    assert len({tuple(lr) for lr in used}) > 1, "the schedule changed the learning rate"
    assert_as_exact_as_pytorch(losses, exact[0], want[0], [r[0] for r in rounded],
                               label="losses ", dtype=torch.float32)
    assert_as_exact_as_pytorch(state, exact[1], want[1], [r[1] for r in rounded],
                               label=f"{loop}: ")


def test_param_groups_stay_the_truth_after_a_checkpoint_is_loaded(daemon):
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = spec.batch(0)
    with st.TrainSession(model, spec.loss_fn, optimizer, batch,
                         address=daemon.address, admission_timeout=10) as session:
        session.step(*batch)
        checkpoint = session.state_dict()
        optimizer.param_groups[0]["lr"] = 0.0
        session.step(*batch)  # lr 0: nothing moves
        after = session.state_dict()
        for name, _ in model.named_parameters():
            assert torch.equal(after[name], checkpoint[name]), name
        # The checkpoint carries lr 0.1, but the optimizer says 0: the optimizer wins.
        session.load_state_dict(checkpoint)
        session.step(*batch)
        assert session.state_dict()["optimizer.param_groups.0.lr"].item() == 0.0
        for name, _ in model.named_parameters():
            assert torch.equal(session.state_dict()[name], checkpoint[name]), name


def test_a_change_the_session_cannot_follow_fails_the_step_and_names_it(daemon):
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = spec.batch(0)
    with st.TrainSession(model, spec.loss_fn, optimizer, batch,
                         address=daemon.address, admission_timeout=10) as session:
        session.step(*batch)
        optimizer.param_groups[0]["momentum"] = 0.9
        with pytest.raises(salus.UnsupportedOptimizerError, match="momentum"):
            session.step(*batch)
        optimizer.param_groups[0]["momentum"] = 0
        session.step(*batch)  # back to what was traced: it goes on
        assert session.iterations == 2
        # Freezing (or unfreezing) a parameter changes what the step trains.
        first = next(model.parameters())
        first.requires_grad_(False)
        with pytest.raises(salus.UnsupportedOptimizerError, match="changed requires_grad"):
            session.step(*batch)
        first.requires_grad_(True)
        session.step(*batch)
        assert session.iterations == 3
        # A validation pass's eval() not undone: eager PyTorch would train in eval mode.
        model.eval()
        with pytest.raises(salus.TraceError, match=r"changed train/eval mode .*train mode"):
            session.step(*batch)
        model.train()
        session.step(*batch)
        assert session.iterations == 4


def test_weights_changed_in_place_between_steps_are_refused_until_written(daemon):
    """WGAN's critic clamps its weights after each step. On salusd the weights live in
    the session: a clamp of the model's copy would be lost, so the step says so; written
    with load_state_dict, the clamp takes."""
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    batch = spec.batch(0)
    with st.TrainSession(model, spec.loss_fn, torch.optim.SGD(model.parameters(), lr=0.5),
                         batch, address=daemon.address, admission_timeout=10) as session:
        session.step(*batch)
        session.update_model()
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.01, 0.01)
        with pytest.raises(salus.SalusError, match="changed in place"):
            session.step(*batch)
        session.load_state_dict(model.state_dict(), strict=False)
        names = [n for n, _ in model.named_parameters()]
        assert all(v.abs().max() <= 0.01 for v in session.read_state(names).values())
        session.step(*batch)
        assert session.iterations == 2
        # A parameter replaced, not changed in place: the optimizer still holds the old
        # one, so eager PyTorch would train something else again; refused for good.
        name, linear = next((n, m) for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear))
        linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
        with pytest.raises(salus.SalusError, match=f"{name}.weight replaced .* new session"):
            session.step(*batch)
        # Reading the model would bring the session's tensors back over the change.
        with pytest.raises(salus.SalusError, match=f"{name}.weight replaced"):
            model.state_dict()
        session.update_model()  # the weights carried over, for a new session
        with pytest.raises(salus.SalusError, match=f"{name}.weight replaced"):
            session.step(*batch)


def test_a_partial_last_batch_just_works(daemon):
    """A DataLoader without drop_last: 3 batches of 8 and a last one of 4, twice over."""
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    x, y = (torch.cat(t) for t in zip(*(spec.batch(k) for k in range(7))))
    n = 28
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:n], y[:n]),
                                         batch_size=8)
    batches = [b for _ in range(2) for b in loader]
    assert [len(b[0]) for b in batches] == [8, 8, 8, 4] * 2
    make = lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731

    def eager(dtype):
        m = twin(model, dtype)
        o = make(m)
        losses = eager_steps(m, o, spec.loss_fn, [to_dtype(b, dtype) for b in batches])
        return losses, torch_state(m, o)

    want, exact = eager(torch.float32), eager(torch.float64)
    rounded = randomly_rounded(lambda: eager(torch.float64), seeds=(0,))
    optimizer = make(model)
    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0],
                         address=daemon.address, admission_timeout=10) as session:
        losses = [session.step(*b).item() for b in batches[:4]]
        losses += [loss.item() for loss in session.steps(batches[4:], depth=3)]
        state = session.state_dict()
        assert session.programs == 2
    assert_as_exact_as_pytorch(losses, exact[0], want[0], [r[0] for r in rounded],
                               label="losses ", dtype=torch.float32)
    assert_as_exact_as_pytorch(state, exact[1], want[1], [r[1] for r in rounded],
                               label="partial batches: ")


def test_a_batch_larger_than_any_before_reopens_the_session_planned_for_it(daemon):
    """The session opened with batches of 2 meets one of 64: it is opened again, planned
    for 64, with its state moved over; it then computes what a session opened with the
    batch of 16 computes, bit for bit, and steps() refuses to grow it mid-flight."""
    spec = reference_runs()["mlp"].spec
    x, y = spec.batch(0)
    small, large, larger = (x[:2], y[:2]), (x.repeat(8, 1), y.repeat(8)), \
        (x.repeat(64, 1), y.repeat(64))
    loop = [small, large, small, large, (x[:3], y[:3])]

    def run(first):
        model = spec.model(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with st.TrainSession(model, spec.loss_fn, optimizer, first,
                             address=daemon.address, admission_timeout=10) as session:
            opened = session.id
            losses = []
            for k, batch in enumerate(loop):
                optimizer.param_groups[0]["lr"] = 0.1 / (k + 1)  # a schedule
                losses.append(session.step(*batch).item())
            with pytest.raises(st.BatchError, match="steps\\(\\).*largest batch"):
                list(session.steps([larger], depth=2))
            assert session.iterations == len(loop)
            return losses, session.state_dict(), session.programs, opened != session.id

    grown = run(small)
    planned = run(large)
    assert grown[2] == planned[2] == 3
    assert grown[3] and not planned[3], "only the session opened small was opened again"
    assert grown[0] == planned[0]
    assert set(grown[1]) == set(planned[1])
    for name, value in planned[1].items():
        assert torch.equal(grown[1][name], value), name


def test_inference_serves_other_batch_sizes(daemon):
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    x, _ = spec.batch(0)
    big = x.repeat(64, 1)
    with st.InferenceSession(model, x, address=daemon.address) as serve:
        outputs = {n: serve(x[:n]) for n in (len(x), 1, 3, 1)}
        assert serve.programs == 3
        # Larger than any before: served by the session opened again for it.
        opened = serve.id
        served = serve(big)
        assert serve.id != opened and serve.programs == 4
        assert torch.equal(serve(x[:3]), outputs[3])
    model.eval()
    with torch.no_grad():
        assert_as_exact_as_pytorch({"out": served}, {"out": model.double()(big.double())},
                                   label="batch 512: ")
    with torch.no_grad():
        for n, out in outputs.items():
            want = model.double()(x[:n].double())
            assert out.shape == want.shape
            assert_as_exact_as_pytorch({"out": out}, {"out": want}, label=f"batch {n}: ")


def test_a_served_model_whose_weights_are_loaded_anew_says_so_until_they_are_written(daemon):
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    x, _ = spec.batch(0)
    with st.InferenceSession(model, x, address=daemon.address) as serve:
        before = serve(x)
        model.load_state_dict(spec.model(1).state_dict())  # new weights, copied in place
        with pytest.raises(salus.SalusError, match="changed in place"):
            serve(x)
        serve.load_state_dict(model.state_dict(), strict=False)
        # A layer replaced: refused until written to the session, then followed.
        name, linear = next((n, m) for n, m in reversed(list(model.named_modules()))
                            if isinstance(m, torch.nn.Linear))
        parent = model.get_submodule(name.rpartition(".")[0])
        setattr(parent, name.rpartition(".")[2], twin(linear, torch.float32))
        with pytest.raises(salus.SalusError, match=f"{name}.weight, {name}.bias replaced"):
            serve(x)
        serve.load_state_dict(model.state_dict(), strict=False)
        model.eval()
        with torch.no_grad():
            want, exact = model(x), twin(model, torch.float64)(x.double())
        got = serve(x)
    assert not torch.equal(got, before)
    assert_as_exact_as_pytorch({"output": got}, {"output": exact}, {"output": want})


def test_a_validation_pass_and_a_checkpoint_read_the_trained_weights(daemon):
    """Between steps the trained tensors live on salusd. An eager forward pass of the
    model (or of a module of it), model.state_dict() and optimizer.state_dict() first
    bring them back, as does closing the session; inside a steps() loop, reading the
    model is refused (its tensors would be of an iteration not yet decided)."""
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    batches = [spec.batch(k) for k in range(3)]
    x, _ = spec.batch(9)
    names = [n for n, _ in model.named_parameters()]

    def trained(session):
        return session.read_state(names)

    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0],
                         address=daemon.address, admission_timeout=10) as session:
        for b in batches:
            session.step(*b)
        on_salusd = trained(session)
        assert all(not torch.equal(on_salusd[n], before[n]) for n in names)
        model.eval()
        with torch.no_grad():
            got = model(x)  # a validation pass
        model.train()
        assert all(torch.equal(p, on_salusd[n]) for n, p in model.named_parameters())
        with torch.no_grad():
            assert torch.equal(got, model(x))
        # A checkpoint after more steps: the optimizer's state too.
        session.step(*batches[0])
        checkpoint = optimizer.state_dict()
        assert all(int(s["step"]) == 4 for s in checkpoint["state"].values())
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(),
                                                     trained(session).values()))
        session.step(*batches[1])
        assert all(torch.equal(t, trained(session)[n]) for n, t in model.state_dict().items()
                   if n in names)
        # A module of the model, called alone, sees the trained weights as well.
        session.step(*batches[2])
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        with torch.no_grad():
            first(x.flatten(1)[:, :first.in_features])
        assert torch.equal(first.weight, trained(session)[next(
            n for n in names if n.endswith("weight"))])
        # The whole model saved, or copied: the copy is not the session's model (nor of
        # the class that follows the model's reads).
        kind = type(spec.model(0))
        now = [p.detach().clone() for p in model.parameters()]
        session.step(*batches[1])
        saved = io.BytesIO()
        torch.save(model, saved)
        copied = copy.deepcopy(model)
        with torch.no_grad():
            copied(x)
        saved.seek(0)
        for copy_ in (copied, torch.load(saved, weights_only=False)):
            assert type(copy_) is kind
            assert all(torch.equal(p, v) for p, v in zip(copy_.parameters(), now))
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(),
                                                     trained(session).values()))
        # A compiled copy of the model for validation: the hook runs outside the graph.
        session.step(*batches[0])
        with torch.no_grad():
            torch.compile(model, backend="eager")(x)
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(),
                                                     trained(session).values()))
        with pytest.raises(salus.SalusError, match="steps\\(\\) had iterations in flight"):
            for _ in session.steps(batches, depth=2):
                model(x)
        # Left early: what was submitted ahead (when the loop left) ran too, and is
        # counted and said; salusd counts the same iterations.
        count = session.iterations
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in session.steps(batches, depth=2):
                break
        ran = [int(m.group(1)) for w in said
               for m in [re.search(r"left steps\(\) with (\d+) iteration", str(w.message))] if m]
        assert session.iterations == count + 1 + sum(ran) and sum(ran) <= 2
        with Client(daemon.address) as client:
            assert next(s.iterations for s in client.list_sessions()
                        if s.id == session.id) == session.iterations
        last = trained(session)
    # Closing brought the last steps back.
    assert all(torch.equal(p, last[n]) for n, p in model.named_parameters())
    assert type(model) is kind and all(type(m).__module__.startswith("torch.nn")
                                       for m in model.modules() if m is not model)


def test_weight_averages_read_the_trained_weights(daemon):
    """A weight average (torch.optim.swa_utils.AveragedModel) and an exponential moving
    average written by hand read the model through parameters() after each step: they
    average what eager training would have left, step by step."""
    spec = reference_runs()["mlp"].spec
    batches = [spec.batch(k) for k in range(4)]

    def averages(model, step):
        swa = torch.optim.swa_utils.AveragedModel(model)
        ema = copy.deepcopy(model)
        for b in batches:
            step(b)
            swa.update_parameters(model)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        return {**{f"swa.{n}": p for n, p in swa.module.named_parameters()},
                **{f"ema.{n}": p for n, p in ema.named_parameters()}}

    def eager(dtype):
        m = twin(spec.model(0), dtype)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return averages(m, lambda b: eager_steps(m, opt, spec.loss_fn, [to_dtype(b, dtype)]))

    model = spec.model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0],
                         address=daemon.address, admission_timeout=10) as session:
        got = averages(model, lambda b: session.step(*b))
    assert_as_exact_as_pytorch(got, eager(torch.float64), eager(torch.float32),
                               randomly_rounded(lambda: eager(torch.float64)))


def test_clipping_the_trained_parameters_in_the_loop_is_refused(daemon):
    """A clip_grad_norm_ left from an eager loop would clip nothing (salusd computes the
    gradients): refused while the session is open, naming the session option, also
    through a reference imported before the session opened; other parameters clip as
    always, and so do the model's after the session closed."""
    spec = reference_runs()["mlp"].spec
    model, other = spec.model(0), spec.model(1)
    x, y = spec.batch(0)
    with st.TrainSession(model, spec.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                         (x, y), address=daemon.address) as session:
        session.step(x, y)
        for clip, option in ((lambda p: torch.nn.utils.clip_grad_norm_(p, 1.0),
                              "clip_grad_norm="),
                             (lambda p: clip_grad_norm_(p, 1.0), "clip_grad_norm="),
                             (lambda p: torch.nn.utils.clip_grad_value_(p, 0.1),
                              "clip_grad_value=")):
            with pytest.raises(salus.SalusError, match=option):
                clip(model.parameters())
        spec.loss_fn(other(x), y).backward()
        total = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)
        assert total > 1e-3
        assert torch.nn.utils.get_total_norm([p.grad for p in other.parameters()]) <= 1.001e-3
    spec.loss_fn(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

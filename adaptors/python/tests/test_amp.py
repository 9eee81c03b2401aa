"""Mixed precision on real salusd processes: training steps traced under CPU autocast
(bf16, and f16 with ``torch.amp.GradScaler``) against eager PyTorch's autocast, the
scaler's decisions (skipped steps, backoff, growth) bit for bit, the memory a 16-bit
step plans, and what is refused.

Numbers follow the suite's rule (``harness.assert_as_exact_as_pytorch``) with eager
autocast as the yardstick: the exact answer is the same training in float64 without
autocast, and salus's autocast run must be as close to it as eager PyTorch's autocast
run is (within ``NOISE_FACTOR`` times eager's own error, plus the float32 floor: the
parameters and optimizer state are float32 master copies)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from daemon import Daemon
from torch.nn.attention import SDPBackend, sdpa_kernel
from harness import assert_as_exact_as_pytorch, to_dtype, torch_state

import salus.torch as st
from salus import UnsupportedMixedPrecisionError, models
from salus.amp import GROWTH_TRACKER, SCALE
from salus.trace import trace_inference, trace_train_step
from salus.v1 import graph_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3
HALF = {pb.DTYPE_F16, pb.DTYPE_BF16}


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "512MiB") as d:
        yield d


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _eager(model, make_optimizer, loss_fn, batches, *, dtype=None, scaler=None,
           exact=False, skip=()):
    """Eager training of a copy of ``model``: under CPU autocast at ``dtype`` with
    ``scaler`` as a mixed-precision loop writes it, or (``exact``) in float64 without
    autocast, skipping the optimizer's step at the indices ``skip`` (the steps the scaler
    skipped). Returns (losses, state named as salus names it, the scaler's (scale,
    growth tracker) after each step)."""
    m = copy.deepcopy(model)
    if exact:
        m = m.double()
    optimizer = make_optimizer(m)
    losses, decisions = [], []
    for k, batch in enumerate(batches):
        *xs, target = to_dtype(batch, torch.float64) if exact else batch
        optimizer.zero_grad()
        # Attention as salus traces it: PyTorch's math backend (under autocast it computes
        # in f32 inside; eager's default CPU kernel rounds differently, by about 1e-5 of
        # the gpt's loss, a choice among PyTorch's own backends).
        with (torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None),
              sdpa_kernel(SDPBackend.MATH)):
            loss = loss_fn(m(*xs), target)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            decisions.append((scaler.get_scale(), scaler._get_growth_tracker()))
        else:
            loss.backward()
            if k not in skip:
                optimizer.step()
        losses.append(loss.item())
    return losses, torch_state(m, optimizer), decisions


def _assert_like_eager_autocast(losses, state, eager, exact, label, f32=None):
    """The rule; with ``f32`` (eager float32's run), also that the run computed in 16
    bits: its first loss (the forward from the same parameters) is as far from eager
    float32's as 16-bit rounding moves it (at least a quarter of eager autocast's distance
    from float32), where a step that ignored autocast lands within float32 rounding of it
    and would pass the rule. Not closeness to eager autocast's loss: on a GPU the 16-bit
    products round differently from the CPU's (another order of the sums), as far from
    CPU autocast as float32 is. Later steps drift apart by rounding, as two correct
    16-bit runs do. (Under f16, whose
    rounding moves the gpt's loss by 5e-6 only, one unit of f16 in a product's result
    moves it about as much: there the casts are checked in the graph instead.)"""
    assert_as_exact_as_pytorch(losses, exact[0], eager[0], label=f"{label} losses ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(state, exact[1], eager[1], label=f"{label}: ")
    if f32 is not None:
        ours, theirs = abs(losses[0] - f32[0][0]), abs(eager[0][0] - f32[0][0])
        assert ours > theirs / 4, (label, ours, theirs)


# ---------------------------------------------------------------------------------------
# What autocast-traced graphs hold


def _half_ops_tested() -> set[str]:
    source = (ROOT / "crates" / "salus-testkit" / "tests" / "half_ops.rs").read_text()
    block = source.split("const AUTOCAST_OPS: &[&str] = &[", 1)[1].split("];", 1)[0]
    return set(re.findall(r'"([^"]+)"', block))


def test_autocast_graphs_keep_f32_masters_and_use_only_tested_half_ops():
    """Every op the target models run with f16 or bf16 tensors has a half-precision op
    test (crates/salus-testkit/tests/half_ops.rs); parameters, optimizer state and the
    loss stay float32, and the casts are there."""
    tested = _half_ops_tested()
    targets = models.target_models()
    used: dict[str, set[str]] = {}
    for name in ("mlp", "cnn", "gpt"):
        spec = targets[name]
        for dtype in (torch.bfloat16, torch.float16):
            model = spec.model(0)
            scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
            train = trace_train_step(model, spec.loss_fn, _sgd(model), spec.batch(0),
                                     autocast=dtype, scaler=scaler).to_graph()
            graphs = [train]
            if dtype == torch.bfloat16:  # the forward's ops are the training step's
                graphs.append(trace_inference(model, spec.batch(0)[:-1],
                                              autocast=dtype).to_graph())
            for graph in graphs:
                tensors = graph.tensors
                for node in graph.nodes:
                    if any(tensors[i].dtype in HALF
                           for i in [*node.inputs, *node.outputs] if i >= 0):
                        used.setdefault(node.op, set()).add(f"{name} {dtype}")
            persistent = [t for t in train.tensors
                          if t.role in (pb.TENSOR_ROLE_PARAMETER, pb.TENSOR_ROLE_STATE)]
            assert not [t.name for t in persistent if t.dtype in HALF], \
                f"{name} {dtype}: parameters, buffers and optimizer state stay f32"
            assert train.tensors[train.fetches[0]].dtype == pb.DTYPE_F32
            casts = [n for n in train.nodes if n.op == "_to_copy"
                     and train.tensors[n.outputs[0]].dtype in HALF]
            assert casts, f"{name} {dtype}: autocast's casts are in the graph"
    untested = {op: sorted(where) for op, where in used.items() if op not in tested}
    assert not untested, f"half-precision paths without an op test: {untested}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tracing_with_fake_tensors_under_autocast_gives_the_real_traces_graph(dtype):
    """Fake tensors run PyTorch's meta kernels, whose batch norm with a 16-bit input gives
    the saved statistics the input's dtype; the kernels (and a real trace) give them f32.
    A fake trace (large models, the coverage tool) must declare what the kernels give."""
    spec = models.target_models()["resnet18"]
    model = spec.model(0)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    graphs = [trace_train_step(model, spec.loss_fn, _sgd(model), spec.batch(0),
                               autocast=dtype, scaler=scaler, tracing_mode=mode).to_graph()
              for mode in ("real", "fake")]
    real, fake = ([(t.name, t.dtype, list(t.shape)) for t in g.tensors] for g in graphs)
    assert fake == real
    assert [n.op for n in graphs[1].nodes] == [n.op for n in graphs[0].nodes]
    stats = [graphs[1].tensors[n.outputs[i]].dtype for n in graphs[1].nodes
             if n.op == "_native_batch_norm_legit_functional" for i in (1, 2)]
    assert stats and set(stats) == {pb.DTYPE_F32}


# ---------------------------------------------------------------------------------------
# Parity with eager autocast


@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_bf16_autocast_trains_on_salusd_as_eager_autocast(daemon, name):
    spec = models.target_models()[name]
    batches = [spec.batch(k) for k in range(STEPS)]
    model = spec.model(0)
    eager = _eager(model, _sgd, spec.loss_fn, batches, dtype=torch.bfloat16)
    exact = _eager(model, _sgd, spec.loss_fn, batches, exact=True)
    f32 = _eager(model, _sgd, spec.loss_fn, batches)
    if name == "cnn":  # the session's own autocast=
        session = st.TrainSession(model, spec.loss_fn, _sgd(model), batches[0],
                                  autocast=torch.bfloat16, address=daemon.address)
    else:  # the user's autocast inside a custom step
        def loss_of(m, tokens, targets):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return spec.loss_fn(m(tokens), targets)
        session = st.TrainSession(model, None, _sgd(model), batches[0], loss_of=loss_of,
                                  address=daemon.address)
    with session:
        losses = [session.step(*batch).item() for batch in batches]
        state = session.state_dict()
    _assert_like_eager_autocast(losses, state, eager, exact, f"{name} bf16", f32)


@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_fp16_autocast_with_a_grad_scaler_trains_as_eager(daemon, name):
    """The default scale (2**16), growing every clean step: the gpt's grows at each of
    them, the cnn's gradients overflow f16 at 2**17 in the second step, which is skipped
    (on salus as in eager: the scale and growth tracker after every step are PyTorch's),
    so its float64 reference skips that step too."""
    spec = models.target_models()[name]
    batches = [spec.batch(k) for k in range(STEPS)]
    model = spec.model(0)

    def scaler():
        return torch.amp.GradScaler("cpu", growth_interval=1)

    eager = _eager(model, _sgd, spec.loss_fn, batches, dtype=torch.float16,
                   scaler=scaler())
    scales = [2.0**16] + [scale for scale, _ in eager[2]]
    skipped = {k for k in range(STEPS) if scales[k + 1] < scales[k]}
    exact = _eager(model, _sgd, spec.loss_fn, batches, exact=True, skip=skipped)
    with st.TrainSession(model, spec.loss_fn, _sgd(model), batches[0],
                         autocast=torch.float16, scaler=scaler(),
                         address=daemon.address) as session:
        losses, decisions = [], []
        for batch in batches:
            losses.append(session.step(*batch).item())
            now = session.state_dict()
            decisions.append((now[SCALE].item(), now[GROWTH_TRACKER].item()))
        state = session.state_dict()
    assert decisions == eager[2]
    _assert_like_eager_autocast(losses, state, eager, exact, f"{name} f16")


LONG_STEPS = 20


def _long_models() -> dict[str, models.TargetModel]:
    """The target models (resnet18 narrowed), torchvision's resnet50 and a stock
    ``nn.TransformerEncoder`` (no dropout: salus draws its own random numbers). The
    images are 64 px, so that the last stage's batch norms see 2x2 pixels of each of the
    8 images: at 32 px with 4 images a channel's statistics come from 4 values, and a
    16-bit rounding that flips a ReLU before them moves the gradient behind by a third
    (any two correct 16-bit runs part there, salus's and eager's as much as eager's on
    two machines, and the scaler's overflow test with them)."""
    targets = models.target_models(batch_size=8, image_size=32, resnet_size=64,
                                   resnet_width=16)
    large = models.large_models(batch_size=8, image_size=64, num_classes=10, seq=16,
                                d_model=64, layers=2)
    return {**targets, "resnet50": large["resnet50"],
            "encoder": large["transformer_nodrop"]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("name", [
    "mlp", "cnn", "gpt", "resnet18", "encoder",
    # Minutes of float64 on a CPU: run with SALUS_LONG_TESTS=1.
    pytest.param("resnet50", marks=pytest.mark.skipif(
        not os.environ.get("SALUS_LONG_TESTS"), reason="resnet50: set SALUS_LONG_TESTS=1")),
])
def test_twenty_steps_train_as_eager_autocast(daemon, name, dtype):
    """Twenty steps under autocast (f16 with PyTorch's default ``GradScaler``, whose
    decisions must be eager's, bit for bit), against eager autocast by the rule; the
    float64 reference skips the steps the scaler skipped."""
    spec = _long_models()[name]
    batches = [spec.batch(k) for k in range(LONG_STEPS)]
    model = spec.model(0)
    # resnet50 at SGD's lr 0.05 (momentum 0.9, 8 images) is chaotic within 20 steps:
    # eager bf16's own distance from float64 reaches 1.5 times a batch norm weight's
    # momentum, which leaves no rounding yardstick to compare against.
    lr = 0.01 if name == "resnet50" else 0.05

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)

    scaler = (lambda: torch.amp.GradScaler("cpu")) if dtype == torch.float16 else None
    eager = _eager(model, sgd, spec.loss_fn, batches, dtype=dtype,
                   scaler=scaler and scaler())
    scales = [2.0**16] + [scale for scale, _ in eager[2]]
    skipped = {k for k in range(LONG_STEPS) if scaler and scales[k + 1] < scales[k]}
    exact = _eager(model, sgd, spec.loss_fn, batches, exact=True, skip=skipped)
    with st.TrainSession(model, spec.loss_fn, sgd(model), batches[0], autocast=dtype,
                         scaler=scaler and scaler(), address=daemon.address) as session:
        losses, decisions = [], []
        for batch in batches:
            losses.append(session.step(*batch).item())
            if scaler:
                now = session.state_dict()
                decisions.append((now[SCALE].item(), now[GROWTH_TRACKER].item()))
        state = session.state_dict()
    assert decisions == eager[2]
    _assert_like_eager_autocast(losses, state, eager, exact, f"{name} {dtype} x{LONG_STEPS}")


def test_grad_scaler_skips_an_overflowing_step_and_backs_off_as_torch(daemon):
    """An inf in a batch makes every gradient inf/NaN: the step is skipped (parameters,
    Adam's moments and its step counter keep their values), the scale backs off and the
    growth tracker restarts, exactly as ``torch.amp.GradScaler`` decides; before it the
    scale grows after ``growth_interval`` clean steps. ``update_model`` gives the scale
    back to the user's scaler."""
    spec = models.target_models()["mlp"]
    batches = [spec.batch(k) for k in range(5)]
    x, y = batches[2]
    x = x.clone()
    x[0, 0] = float("inf")
    batches[2] = (x, y)
    model = spec.model(0)

    def adam(m):
        return torch.optim.Adam(m.parameters(), lr=1e-3)

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)

    eager = _eager(model, adam, spec.loss_fn, batches, dtype=torch.float16,
                   scaler=scaler())
    assert [d[0] for d in eager[2]] == [2.0**12, 2.0**13, 2.0**12, 2.0**12, 2.0**13]
    exact = _eager(model, adam, spec.loss_fn, batches, exact=True, skip={2})
    user_scaler = scaler()
    optimizer = adam(model)
    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0],
                         autocast=torch.float16, scaler=user_scaler,
                         address=daemon.address) as session:
        losses, decisions, states = [], [], []
        for batch in batches:
            losses.append(session.step(*batch).item())
            states.append(session.state_dict())
            decisions.append((states[-1][SCALE].item(), states[-1][GROWTH_TRACKER].item()))
        session.update_model()
    assert decisions == eager[2], "scale and growth tracker after every step"
    skipped, before = states[2], states[1]
    for name, value in before.items():
        if name not in (SCALE, GROWTH_TRACKER):
            assert torch.equal(skipped[name], value), f"{name} changed in a skipped step"
    assert states[-1]["optimizer.step"].item() == 4 == eager[1]["optimizer.step"].item()
    assert losses[2] != losses[2]  # NaN, as eager's
    clean = [k for k in range(5) if k != 2]
    assert_as_exact_as_pytorch([losses[k] for k in clean], [exact[0][k] for k in clean],
                               [eager[0][k] for k in clean], label="losses ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(states[-1], exact[1], eager[1], label="mlp f16 skip: ")
    assert user_scaler.get_scale() == eager[2][-1][0]
    assert user_scaler.state_dict()["_growth_tracker"] == eager[2][-1][1]


def test_a_scaler_with_accumulation_and_clipping_follows_the_eager_recipe(daemon):
    """PyTorch's recipe: each micro-batch's ``scaler.scale(loss / k).backward()``, then
    ``scaler.unscale_`` before clipping, ``scaler.step``, ``scaler.update``."""
    spec = models.target_models()["mlp"]
    batches = [spec.batch(k) for k in range(STEPS)]
    model = spec.model(0)

    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    def loop(dtype, exact=False):
        m = copy.deepcopy(model).double() if exact else copy.deepcopy(model)
        optimizer, s = _sgd(m), scaler()
        losses, decisions = [], []
        for batch in batches:
            x, y = to_dtype(batch, torch.float64) if exact else batch
            optimizer.zero_grad()
            parts = []
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                with torch.autocast("cpu", dtype=dtype or torch.float16,
                                    enabled=dtype is not None):
                    loss = spec.loss_fn(m(xs), ys)
                (s.scale(loss / 2) if dtype else loss / 2).backward()
                parts.append(loss.item())
            if dtype:
                s.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            if dtype:
                s.step(optimizer)
                s.update()
                decisions.append((s.get_scale(), s._get_growth_tracker()))
            else:
                optimizer.step()
            losses.append(sum(parts) / 2)
        return losses, torch_state(m, optimizer), decisions

    eager, exact = loop(torch.float16), loop(None, exact=True)
    with st.TrainSession(model, spec.loss_fn, _sgd(model), batches[0],
                         autocast=torch.float16, scaler=scaler(), accumulate=2,
                         clip_grad_norm=0.5, address=daemon.address) as session:
        losses, decisions = [], []
        for batch in batches:
            losses.append(session.step(*batch).item())
            now = session.state_dict()
            decisions.append((now[SCALE].item(), now[GROWTH_TRACKER].item()))
        state = session.state_dict()
    assert decisions == eager[2]
    _assert_like_eager_autocast(losses, state, eager, exact, "mlp f16 accumulate clip")


def test_a_checkpoint_carries_the_scaler_and_continues_bit_for_bit(daemon):
    spec = models.target_models()["mlp"]
    batches = [spec.batch(k) for k in range(4)]

    def session():
        model = spec.model(0)
        return st.TrainSession(model, spec.loss_fn, torch.optim.Adam(model.parameters()),
                               batches[0], autocast=torch.float16,
                               scaler=torch.amp.GradScaler("cpu", growth_interval=1),
                               address=daemon.address)

    with session() as first:
        for batch in batches[:2]:
            first.step(*batch)
        checkpoint = first.state_dict()
        assert checkpoint[SCALE].item() == 2.0**18 and checkpoint[GROWTH_TRACKER].item() == 0
        want = [first.step(*batch).item() for batch in batches[2:]]
        final = first.state_dict()
    with session() as second:
        second.load_state_dict(checkpoint)
        got = [second.step(*batch).item() for batch in batches[2:]]
        resumed = second.state_dict()
    assert got == want
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name


def test_inference_under_autocast_serves_as_eager_autocast(daemon):
    spec = models.target_models()["cnn"]
    model = spec.model(0).eval()
    x = spec.batch(0)[0]
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = model(x)
        exact = copy.deepcopy(model).double()(x.double())
    with st.InferenceSession(model, (x,), autocast=torch.bfloat16,
                             address=daemon.address) as serve:
        out = serve(x)
    assert out.dtype == eager.dtype == torch.bfloat16
    assert_as_exact_as_pytorch({"out": out.float()}, {"out": exact}, {"out": eager.float()},
                               label="cnn inference bf16: ")


# ---------------------------------------------------------------------------------------
# Memory


def test_a_bf16_step_plans_less_scratch_than_f32(daemon):
    spec = models.target_models()["gpt"]
    model = spec.model(0)
    planned = {}
    for dtype in (None, torch.bfloat16):
        with st.TrainSession(model, spec.loss_fn, _sgd(model), spec.batch(0),
                             autocast=dtype, address=daemon.address,
                             admission_timeout=10) as session:
            planned[dtype] = session.session.ephemeral_bytes
    assert planned[torch.bfloat16] < planned[None], planned


# ---------------------------------------------------------------------------------------
# What salus refuses


def _mlp():
    spec = models.target_models()["mlp"]
    model = spec.model(0)
    return spec, model, _sgd(model)


def test_autocast_dtypes_cpu_autocast_cannot_compute_in_are_refused():
    spec, model, optimizer = _mlp()
    with pytest.raises(UnsupportedMixedPrecisionError, match="autocast=torch.float32"):
        trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0),
                         autocast=torch.float32)


def test_autocast_of_another_device_type_is_refused():
    """``torch.autocast("cuda")`` does not cast the CPU tensors salus traces with: the
    graph would silently compute in f32. (Simulated: this host has no GPU, where
    ``torch.autocast("cuda")`` disables itself, as in eager PyTorch.)"""
    spec, model, optimizer = _mlp()

    def loss_of(m, x, y):
        torch.set_autocast_enabled("cuda", True)
        try:
            return F.cross_entropy(m(x), y)
        finally:
            torch.set_autocast_enabled("cuda", False)

    with pytest.raises(UnsupportedMixedPrecisionError, match=r"autocast\('cuda'\)"):
        trace_train_step(model, None, optimizer, spec.batch(0), loss_of=loss_of)


def test_a_session_created_inside_autocast_is_refused():
    spec, model, optimizer = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(UnsupportedMixedPrecisionError, match="autocast="):
            trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0))


def test_a_step_that_scales_its_own_loss_is_refused():
    spec, model, optimizer = _mlp()
    scaler = torch.amp.GradScaler("cpu")

    def loss_of(m, x, y):
        return scaler.scale(F.cross_entropy(m(x), y))

    with pytest.raises(UnsupportedMixedPrecisionError, match="scaler=scaler"):
        trace_train_step(model, None, optimizer, spec.batch(0), loss_of=loss_of)
    assert scaler.scale(torch.ones(())).item() == 2.0**16, "GradScaler.scale is back"


def test_scalers_salus_cannot_follow_are_refused_naming_why():
    spec, model, optimizer = _mlp()

    class MyScaler(torch.amp.GradScaler):
        pass

    with pytest.raises(UnsupportedMixedPrecisionError, match="MyScaler"):
        trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0),
                         autocast=torch.float16, scaler=MyScaler("cpu"))
    half = copy.deepcopy(model).half()
    with pytest.raises(UnsupportedMixedPrecisionError, match="float16"):
        trace_train_step(half, spec.loss_fn, _sgd(half), spec.batch(0),
                         scaler=torch.amp.GradScaler("cpu"))
    scaler = torch.amp.GradScaler("cpu", growth_interval=0)
    with pytest.raises(UnsupportedMixedPrecisionError, match="growth_interval"):
        trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0),
                         autocast=torch.float16, scaler=scaler)
    # A disabled scaler does nothing, in eager PyTorch as here.
    traced = trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0),
                              scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert traced.scaler is None and SCALE not in traced.state_names


def test_a_scaler_option_changed_after_tracing_fails_the_step_and_names_it(daemon):
    spec, model, optimizer = _mlp()
    scaler = torch.amp.GradScaler("cpu")
    with st.TrainSession(model, spec.loss_fn, optimizer, spec.batch(0),
                         autocast=torch.float16, scaler=scaler,
                         address=daemon.address) as session:
        session.step(*spec.batch(0))
        scaler.set_growth_factor(4.0)
        with pytest.raises(UnsupportedMixedPrecisionError, match="growth_factor: 2.0 -> 4.0"):
            session.step(*spec.batch(1))

"""salus.torch against real salusd processes: PyTorch's numbers through the daemon.

- Training: 20 steps of the MLP (SGD with momentum and weight decay), the small CNN
  (Adam; batch norm buffers) and the GPT-style decoder (AdamW) on salusd's CPU device
  match eager PyTorch on the CPU: every loss within 1e-4 relative, and every parameter,
  buffer and optimizer tensor within 1e-4 of its scale (the largest magnitude, at least
  1). gpt's attention qkv biases get 1e-3: the key third of each has a gradient that is
  zero in exact arithmetic (softmax ignores a shift common to a row of scores), so AdamW
  trains it on f32 rounding noise, which depends on the order of reductions (see
  test_cpu_engine.py).
- The trained weights and optimizer state come back into the user's model and optimizer
  in place, and eager training goes on from them as if it had run all along.
- Inference: the forward pass on salusd matches the model's eval-mode output.
- Checkpoints: state_dict out, a new session, load_state_dict, continue: bit for bit what
  an uninterrupted session gives.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from daemon import Daemon
from harness import torch_state
from torch import nn

import salus.torch as st
from salus.models import target_models
from salus.reference import eager_steps, reference_runs

STEPS = 20
RTOL = 1e-4
LOOSER = {"gpt": ("attn.qkv.bias", 1e-3)}


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def assert_close_to_scale(actual: dict, expected: dict, model: str, label: str) -> None:
    """Every expected tensor: max |difference| <= rtol * max(1, max |expected|)."""
    assert set(expected) <= set(actual), set(expected) - set(actual)
    looser, looser_rtol = LOOSER.get(model, (None, RTOL))
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        rtol = looser_rtol if looser is not None and looser in name else RTOL
        if want.numel() == 0:
            continue
        scale = max(1.0, want.double().abs().max().item())
        error = (got.double() - want.double()).abs().max().item()
        assert error <= rtol * scale, f"{label} {name}: error {error:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_training_on_salusd_matches_pytorch(daemon, name):
    run = reference_runs()[name]
    spec = run.spec
    batches = [spec.batch(k) for k in range(STEPS + 2)]
    model = spec.model(0)
    optimizer = run.optimizer(model.parameters())
    eager_model = copy.deepcopy(model)
    eager_optimizer = run.optimizer(eager_model.parameters())

    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0], address=daemon.address,
                         name=f"parity-{name}", total_iterations=STEPS,
                         admission_timeout=10) as session:
        losses = [session.step(*b) for b in batches[:STEPS]]
        state = session.state_dict()
        session.update_model()
    want_losses = eager_steps(eager_model, eager_optimizer, spec.loss_fn, batches[:STEPS])
    assert all(loss.shape == () and loss.dtype == torch.float32 for loss in losses)
    for k, (ours, theirs) in enumerate(zip(losses, want_losses, strict=True)):
        assert abs(ours.item() - theirs) <= RTOL * max(1.0, abs(theirs)), (k, losses,
                                                                           want_losses)
    want = torch_state(eager_model, eager_optimizer)
    assert_close_to_scale(state, want, name, "session")
    # The model (and the optimizer's state) were updated in place: eager training goes
    # on from them as it goes on from the eager run.
    model_state = {n: t.detach() for n, t in (*model.named_parameters(),
                                              *model.named_buffers())}
    assert_close_to_scale(model_state, {n: want[n] for n in model_state}, name, "model")
    more = eager_steps(model, optimizer, spec.loss_fn, batches[STEPS:])
    more_eager = eager_steps(eager_model, eager_optimizer, spec.loss_fn, batches[STEPS:])
    assert more == pytest.approx(more_eager, rel=RTOL)
    assert_close_to_scale(torch_state(model, optimizer), torch_state(eager_model,
                                                                     eager_optimizer),
                          name, "eager after salus")


class _TwoHeads(nn.Module):
    """Returns a dict and a tuple: outputs keep the model's structure."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh())
        self.a = nn.Linear(16, 3)
        self.b = nn.Linear(16, 2)

    def forward(self, x, scale):
        h = self.body(x) * scale
        return {"a": self.a(h), "pair": (self.b(h), h.sum(dim=1))}


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_inference_on_salusd_matches_the_eval_forward(daemon, name):
    spec = target_models(batch_size=8, image_size=16)[name]
    model = spec.model(0)
    if name == "cnn":  # running statistics that are not the initial ones
        eager_steps(model, torch.optim.SGD(model.parameters(), lr=0.01), spec.loss_fn,
                    [spec.batch(k) for k in range(2)])
    inputs = [spec.batch(k)[:-1] for k in range(3)]
    with st.InferenceSession(model, inputs[0], address=daemon.address) as serve:
        outputs = [serve(*x) for x in inputs]
    assert model.training, "the model's mode is left as it was"
    model.eval()
    with torch.no_grad():
        for x, out in zip(inputs, outputs):
            torch.testing.assert_close(out, model(*x), rtol=1e-5, atol=1e-5)


def test_inference_outputs_keep_their_structure(daemon):
    torch.manual_seed(0)
    model = _TwoHeads()
    x, scale = torch.randn(4, 12), torch.tensor(0.5)
    with st.InferenceSession(model, (x, scale), address=daemon.address) as serve:
        out = serve(x, scale)
    with torch.no_grad():
        want = model(x, scale)
    assert set(out) == {"a", "pair"} and isinstance(out["pair"], tuple)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_checkpoint_and_restore_continue_exactly(daemon):
    run = reference_runs()["cnn"]  # Adam state and batch norm buffers
    spec = run.spec
    batches = [spec.batch(k) for k in range(8)]

    def session(seed):
        model = spec.model(seed)
        return st.TrainSession(model, spec.loss_fn, run.optimizer(model.parameters()),
                               batches[0], address=daemon.address)

    with session(0) as straight:
        straight_losses = [straight.step(*b).item() for b in batches]
        straight_state = straight.state_dict()

    with session(0) as first:
        losses = [first.step(*b).item() for b in batches[:4]]
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
    # Another initialisation: everything it has is overwritten by the checkpoint.
    with session(1) as second:
        buffer.seek(0)
        second.load_state_dict(torch.load(buffer))
        losses += [second.step(*b).item() for b in batches[4:]]
        state = second.state_dict()
    assert losses == straight_losses
    assert set(state) == set(straight_state)
    for name, value in state.items():
        assert torch.equal(value, straight_state[name]), name


def test_load_state_dict_checks_names_shapes_and_dtypes(daemon):
    spec = target_models(batch_size=4)["mlp"]
    model = spec.model(0)
    with st.TrainSession(model, spec.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                         spec.batch(0), address=daemon.address) as session:
        with pytest.raises(st.SalusError, match="missing tensors: body.0.bias"):
            session.load_state_dict({"head.bias": torch.zeros(10)})
        with pytest.raises(st.SalusError, match="unknown tensors: nope"):
            session.load_state_dict({"nope": torch.zeros(1)}, strict=False)
        with pytest.raises(st.SalusError, match=r"head.bias is float64\[10\] but the "
                                                r"session's is float32\[10\]"):
            session.load_state_dict({"head.bias": torch.zeros(10, dtype=torch.float64)},
                                    strict=False)
        # A model's own state_dict is a valid partial load.
        fresh = spec.model(3)
        session.load_state_dict(fresh.state_dict(), strict=False)
        assert torch.equal(session.state_dict()["head.weight"], fresh.head.weight.detach())

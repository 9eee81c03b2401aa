"""JAX steps on a real salusd (salus.jax, through XLA's HLO): training with the user's own
pure step, inference, partial batches, dropout from a key in the state, and clear
refusals.

Each result is checked by the rule of ``harness.assert_as_exact_as_pytorch`` with JAX in
PyTorch's place: the exact reference is the same step run by JAX in float64
(``enable_x64``), the rounding noise is JAX's own float32 run's distance from it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import enable_x64  # noqa: E402

import salus.jax as sj  # noqa: E402
from salus.errors import LoweringError, UnsupportedOpError  # noqa: E402

from daemon import Daemon  # noqa: E402
from harness import assert_as_exact_as_pytorch  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def cnn(p, x):
    h = jax.lax.conv_general_dilated(x, p["conv"], (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.gelu(h + p["conv_b"], approximate=False)
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = h.reshape(h.shape[0], -1)
    return h @ p["w"] + p["b"]


def encoder(p, x):
    """One pre-norm attention block and a feed-forward, on [batch, seq, d]."""
    def norm(h, g, b):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * g + b
    h = norm(x, p["g1"], p["b1"])
    q, k, v = (jnp.einsum("bsd,hde->bhse", h, p[n]) for n in ("q", "k", "v"))
    scores = jnp.einsum("bhse,bhte->bhst", q, k) / np.sqrt(q.shape[-1])
    attended = jnp.einsum("bhst,bhte->bhse", jax.nn.softmax(scores, -1), v)
    x = x + jnp.einsum("bhse,hed->bsd", attended, p["o"])
    h = norm(x, p["g2"], p["b2"])
    x = x + jnp.tanh(h @ p["f1"]) @ p["f2"]
    return x.mean(1) @ p["head"]


def fourier(p, x):
    """Learned Fourier features (sines and cosines of trained frequencies) quantized to
    quarters with a straight-through gradient (XLA's round-nearest-even, round-nearest-afz
    and floor), then
    softplus (XLA's log-plus-one) and ELU (its exponential-minus-one)."""
    z = x @ p["freq"]
    h = jnp.concatenate([jnp.sin(z), jnp.cos(z)], -1)
    steps = 0.1 * jnp.floor(h * 2) + 0.05 * jax.lax.round(h * 3)
    h = h + jax.lax.stop_gradient(jnp.round(h * 4) / 4 + steps - h)
    h = jax.nn.softplus(h @ p["w1"]) + jax.nn.elu(h @ p["w2"])
    return h @ p["head"]


def ranking(p, x):
    """Features pooled by rank: the top three of each row (lax.top_k), its two smallest
    (sort) and its largest (max); their gradients go back to the positions they came
    from (a scatter by the sort's permutation)."""
    h = jnp.tanh(x @ p["w1"])
    top, _ = jax.lax.top_k(h, 3)
    low = jnp.sort(h, -1)[:, :2]
    return jnp.concatenate([top, low, jnp.max(h, -1, keepdims=True)], -1) @ p["head"]


def init(name: str, seed: int = 0):
    rs = np.random.RandomState(seed)
    r = lambda *s: (rs.randn(*s) * 0.3).astype(np.float32)  # noqa: E731
    if name == "cnn":
        return {"conv": r(3, 3, 3, 4), "conv_b": r(4), "w": r(4 * 2 * 2, 5), "b": r(5)}
    if name == "fourier":
        return {"freq": 3 * r(6, 8), "w1": r(16, 12), "w2": r(16, 12), "head": r(12, 5)}
    if name == "ranking":
        return {"w1": r(6, 8), "head": r(6, 5)}
    d, heads, e = 8, 2, 4
    return {"g1": 1 + r(d), "b1": r(d), "q": r(heads, d, e), "k": r(heads, d, e),
            "v": r(heads, d, e), "o": r(heads, e, d), "g2": 1 + r(d), "b2": r(d),
            "f1": r(d, 16), "f2": r(16, d), "head": r(d, 5)}


MODELS = {"cnn": (cnn, (8, 8, 3)), "encoder": (encoder, (6, 8)), "fourier": (fourier, (6,)),
          "ranking": (ranking, (6,))}


def batches(name: str, sizes=(4, 4, 4)):
    rs = np.random.RandomState(1)
    shape = MODELS[name][1]
    return [(rs.randn(n, *shape).astype(np.float32), rs.randint(0, 5, n).astype(np.int32))
            for n in sizes]


def train_step(model):
    """Adam with bias correction, on the user's side: the state holds everything."""
    def loss_fn(p, x, y):
        logits = model(p, x)
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 5), -1))

    def step(state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], x, y)
        t = state["t"] + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["v"], g)
        lr = 0.05 * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        p = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8),
                         state["params"], m, v)
        return {"params": p, "m": m, "v": v, "t": t}, loss
    return step


def initial_state(name: str):
    params = init(name)
    zeros = jax.tree.map(np.zeros_like, params)
    return {"params": params, "m": zeros, "v": zeros, "t": np.zeros((), np.float32)}


def run_jax(step, state, data, dtype=None):
    """The step run by JAX itself (float32, or float64 under enable_x64)."""
    losses = []
    f = jax.jit(step)
    cast = (lambda a: a.astype(np.float64) if a.dtype == np.float32 else a) if dtype else (
        lambda a: a)
    state = jax.tree.map(lambda a: a if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                         else jnp.asarray(cast(np.asarray(a))), state)
    for x, y in data:
        state, loss = f(state, jnp.asarray(cast(x)), jnp.asarray(y))
        losses.append(float(loss))
    return losses, state


def as_named(state) -> dict[str, torch.Tensor]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(p): torch.from_numpy(np.array(v, dtype=np.float64))
            for p, v in leaves}


@pytest.mark.parametrize("name", ["cnn", "encoder", "fourier", "ranking"])
def test_a_jax_step_trains_on_salusd_as_jax_computes_it(daemon, name):
    model = MODELS[name][0]
    step, state = train_step(model), initial_state(name)
    data = batches(name, (4, 4, 3))  # the last batch is partial: a second program
    with sj.TrainSession(step, state, data[0], address=daemon.address) as session:
        start = session.state_dict()
        losses = [float(session.step(x, y)) for x, y in data]
        final = session.state()
        assert session.programs == 2
        session.load_state_dict(start)  # from the same state, pipelined: the same steps
        assert [float(loss) for loss in session.steps(data, depth=2)] == losses
    jax_losses, jax_state = run_jax(step, state, data)
    with enable_x64(True):
        exact_losses, exact_state = run_jax(step, state, data, np.float64)
    assert_as_exact_as_pytorch(losses, exact_losses, jax_losses, label=f"{name} losses: ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(as_named(final), as_named(exact_state), as_named(jax_state),
                               label=f"{name}: ", dtype=torch.float32)


def test_a_jax_forward_function_serves_on_salusd(daemon):
    params = init("encoder")
    (x, _), (x2, _) = batches("encoder", (4, 2))
    with sj.InferenceSession(encoder, params, (x,), address=daemon.address) as serve:
        got = [serve(x), serve(x2)]
    for inputs, out in zip((x, x2), got):
        want = np.asarray(encoder(params, inputs))
        with enable_x64(True):
            exact = np.asarray(encoder(jax.tree.map(lambda a: a.astype(np.float64), params),
                                       inputs.astype(np.float64)))
        assert out.shape == want.shape and out.dtype == np.float32
        assert_as_exact_as_pytorch({"out": torch.from_numpy(out)},
                                   {"out": torch.from_numpy(np.array(exact))},
                                   {"out": torch.from_numpy(np.array(want))})


def powered(params, x):
    """A power of two computed tensors (a learned, input-dependent exponent)."""
    return jnp.power(jnp.abs(x @ params["w"]) + 0.5, jnp.tanh(x @ params["v"]) + 1.5)


def test_a_power_of_two_computed_tensors_serves_as_jax_computes_it(daemon):
    rs = np.random.RandomState(4)
    params = {"w": rs.randn(6, 5).astype(np.float32), "v": rs.randn(6, 5).astype(np.float32)}
    x = rs.randn(7, 6).astype(np.float32)
    with sj.InferenceSession(powered, params, (x,), address=daemon.address) as serve:
        got = serve(x)
    with enable_x64(True):
        exact = np.asarray(powered(jax.tree.map(lambda a: a.astype(np.float64), params),
                                   x.astype(np.float64)))
    assert got.dtype == np.float32
    assert_as_exact_as_pytorch({"out": torch.from_numpy(got)},
                               {"out": torch.from_numpy(np.array(exact))},
                               {"out": torch.from_numpy(np.array(powered(params, x)))})


def dropout_step(state, x, y):
    """A dropout layer whose key is part of the state: split each step, as JAX code does.
    The uniform numbers are float32 (JAX's float64 ones are other bits), so the float64
    run draws the same masks."""
    key, sub = jax.random.split(state["key"])

    def loss_fn(p):
        h = jnp.tanh(x @ p["a"])
        keep = jax.random.uniform(sub, h.shape, jnp.float32) < 0.7
        h = jnp.where(keep, h / 0.7, 0.0)
        return jnp.mean((h @ p["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
    return {"params": params, "key": key}, loss


@pytest.mark.parametrize("typed", [True, False], ids=["jax.random.key", "PRNGKey"])
def test_dropout_from_a_key_in_the_state_trains_as_jax_computes_it(daemon, typed):
    rs = np.random.RandomState(5)
    key = jax.random.key(3) if typed else jax.random.PRNGKey(3)
    state = {"params": {"a": rs.randn(5, 7).astype(np.float32),
                        "b": rs.randn(7, 2).astype(np.float32)}, "key": key}
    data = [(rs.randn(n, 5).astype(np.float32), rs.randn(n, 2).astype(np.float32))
            for n in (4, 4, 3)]
    with sj.TrainSession(dropout_step, state, data[0], address=daemon.address) as session:
        assert session.traced.feed_names[-1] == "random.0"
        losses = [float(session.step(*b)) for b in data]
        final = session.state()
    jax_losses, jax_state = run_jax(dropout_step, state, data)
    with enable_x64(True):
        exact_losses, exact_state = run_jax(dropout_step, state, data, np.float64)
    data_of = jax.random.key_data if typed else np.asarray
    # The key advanced on the client as JAX advances it: the masks are JAX's.
    assert np.array_equal(data_of(final["key"]), data_of(jax_state["key"]))
    assert_as_exact_as_pytorch(losses, exact_losses, jax_losses, label="losses: ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(as_named(final["params"]), as_named(exact_state["params"]),
                               as_named(jax_state["params"]), dtype=torch.float32)


def test_random_numbers_from_a_key_not_in_the_state_are_refused(daemon):
    def noisy(state, x):
        keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.5, x.shape)
        return state, jnp.sum(jnp.where(keep, x, 0.0)) * state["w"]

    with pytest.raises(UnsupportedOpError) as error:
        sj.TrainSession(noisy, {"w": np.ones((), np.float32)}, (np.ones((3,), np.float32),),
                        address=daemon.address)
    assert "PRNG key in the state" in str(error.value)


def test_a_step_whose_new_state_differs_in_structure_is_refused(daemon):
    def wrong(state, x):
        return {"w": state["w"], "extra": x.sum()}, x.sum()

    with pytest.raises(LoweringError, match="structured"):
        sj.TrainSession(wrong, {"w": np.ones((2,), np.float32)},
                        (np.ones((3,), np.float32),), address=daemon.address)


def test_embedding_lookups_and_their_gradients_train_on_salusd(daemon):
    """Gathers (``emb[ids]``, ``take_along_axis``) and the scatters of their gradients; the
    ids hashed into the table (``jnp.mod`` of integers of either sign: XLA's remainder
    and its sign fix-ups) and the features wrapped by a float ``jnp.mod``."""
    def loss_fn(p, ids, y):
        h = jnp.tanh(jnp.mod(p["emb"][jnp.mod(ids, 12)].mean(1) @ p["w"], 1.7))
        return -jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1).mean()

    def step(state, ids, y):
        loss, g = jax.value_and_grad(loss_fn)(state, ids, y)
        return jax.tree.map(lambda p, g: p - 0.5 * g, state, g), loss

    rs = np.random.RandomState(2)
    state = {"emb": rs.randn(12, 6).astype(np.float32), "w": rs.randn(6, 5).astype(np.float32)}
    data = [(rs.randint(-50, 50, (4, 7)).astype(np.int32), rs.randint(0, 5, 4).astype(np.int32))
            for _ in range(3)]
    with sj.TrainSession(step, state, data[0], address=daemon.address) as session:
        losses = [float(session.step(*b)) for b in data]
        final = session.state()
    jax_losses, jax_state = run_jax(step, state, data)
    with enable_x64(True):
        exact_losses, exact_state = run_jax(step, state, data, np.float64)
    assert_as_exact_as_pytorch(losses, exact_losses, jax_losses, label="losses: ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(as_named(final), as_named(exact_state), as_named(jax_state),
                               dtype=torch.float32)


def ranked(params, x):
    """A classifier's answers by rank: the predicted class (argmax), the least likely
    (argmin), the top two scores and their classes (lax.top_k), the scores sorted both
    ways with their order (sort, argsort), and the largest over the batch."""
    logits = x @ params["w"]
    top, classes = jax.lax.top_k(logits, 2)
    return (jnp.argmax(logits, -1), jnp.argmin(logits, 0), top, classes,
            jnp.sort(logits, -1), jnp.sort(logits, 0, descending=True),
            jnp.argsort(logits, -1), jnp.max(logits, 0))


def test_argmax_sort_and_top_k_serve_on_salusd_as_jax_computes_them(daemon):
    """XLA's argmax and argmin (a reduction of values with their positions), sort (one
    key, with a payload for argsort) and topk become the IR's ordering ops: every answer
    equals JAX's (the scores are rounded to quarters first, so ties are exercised and
    the order of equal scores is the lower position first, as JAX's)."""
    rs = np.random.RandomState(3)
    params = {"w": (np.round(rs.randn(6, 5) * 4) / 4).astype(np.float32)}
    x = np.round(rs.randn(7, 6)).astype(np.float32)
    x[2] = x[1]  # two equal rows: equal scores across the batch
    with sj.InferenceSession(ranked, params, (x,), address=daemon.address) as serve:
        got = serve(x)
    want = ranked(params, x)
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        b = np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (k, a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=f"output {k}")

"""Keras applications and a transformer block trained on a real salusd (salus.tf, through
XLA's HLO), against TensorFlow's own eager training.

Each model trains three steps through :class:`salus.tf.TrainSession`; the losses, and
every variable of the model and the optimizer after each step, are checked by the rule
of ``harness.assert_as_exact_as_pytorch`` with TensorFlow in PyTorch's place: the exact
reference is a float64 twin of the model (the same weights) trained eagerly by
TensorFlow (``tf.GradientTape`` and ``optimizer.apply_gradients``), the rounding noise is
the larger distance from it of two float32 eager runs by TensorFlow (the second with each
batch's examples in reverse order: the same mathematics, rounded differently).

- EfficientNetB0 (batch norm, residual adds, depthwise convolutions, whose filter
  gradient XLA writes as a convolution with ``batch_group_count``; squeeze-and-excitation,
  swish) at 32 px, about half a minute on two cores; MobileNetV2 and ResNet50 too with
  ``SALUS_LONG_TESTS=1`` (ResNet50 a minute: its 10,000 HLO instructions take most of it
  to trace);
- a transformer encoder block (multi-head attention, layer norm, a dense feed-forward);
- a small CNN of depthwise and grouped convolutions and ResNet's stem pooling (zero
  padding, then overlapping 3x3 max pooling, whose gradient is XLA's
  ``select-and-scatter``): in seconds;
- EfficientNetB0 as Keras builds it, dropout on, trains (its masks drawn on the client),
  with ``SALUS_LONG_TESTS=1``: that the masks are TensorFlow's is checked on a small
  model in ``test_tf.py``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("tensorflow")
import salus.tf as stf  # noqa: E402  (before TensorFlow: see salus.tf)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from daemon import Daemon  # noqa: E402
from harness import assert_as_exact_as_pytorch  # noqa: E402

STEPS = 3
BATCH = 4
CLASSES = 10


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "fifo", "--memory", "4GiB") as d:
        yield d


# -- models -------------------------------------------------------------------------------


def _application(constructor, dropout: bool = False):
    def build() -> keras.Model:
        # Logits out (the loss takes them), so eager and compiled runs compute the same
        # cross-entropy: Keras reads logits back from a softmax only in a graph.
        model = constructor(weights=None, input_shape=(32, 32, 3), classes=CLASSES,
                            classifier_activation=None)
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dropout) and not dropout:
                layer.rate = 0.0  # the parity tests compare with eager TensorFlow,
                # whose random numbers are not XLA's
        return model
    return build


def transformer() -> keras.Model:
    """An encoder block (attention, then a feed-forward, each residual and layer-normed)
    over ``[batch, 16, 32]`` floats, mean-pooled into a classifier."""
    tokens = keras.Input((16, 32))
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, dropout=0.0)(
        tokens, tokens)
    x = keras.layers.LayerNormalization()(tokens + attended)
    hidden = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(32)(hidden))
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(CLASSES)(pooled))


def grouped_cnn() -> keras.Model:
    """Depthwise and grouped convolutions: their filter gradients are convolutions with
    ``batch_group_count`` (one input channel per group, and three); between them,
    ResNet's stem pooling (zero padding, then 3x3 windows at stride 2, overlapping, with
    ties at zero after the ReLU)."""
    return keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2),
        keras.layers.ReLU(),
        keras.layers.ZeroPadding2D(1),
        keras.layers.MaxPooling2D(3, strides=2),
        keras.layers.Conv2D(4, 3, padding="same", groups=2),
        keras.layers.ReLU(),
        keras.layers.DepthwiseConv2D(3, padding="valid"),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES)])


# SGD with momentum for the applications. At 32 px their last batch norms see four values
# per channel, which makes float32 training chaotic within three steps (TensorFlow's own
# float32 losses are up to 50% off float64 by the third), so the first step is the sharp test.
# Adam is no test there: its first step is lr * sign(gradient), and gradients that are
# about zero get their sign from rounding, which XLA's own float32 run of the step gets
# wrong (by 2 lr) on elements where TensorFlow's eager run happens to get it right.
def momentum_sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(1e-3, momentum=0.9)


MODELS = {
    "resnet50": (_application(keras.applications.ResNet50), (32, 32, 3), momentum_sgd),
    "mobilenetv2": (_application(keras.applications.MobileNetV2), (32, 32, 3), momentum_sgd),
    "efficientnetb0": (_application(keras.applications.EfficientNetB0), (32, 32, 3), momentum_sgd),
    "transformer": (transformer, (16, 32), lambda: keras.optimizers.Adam(1e-3)),
    "grouped_cnn": (grouped_cnn, (16, 16, 3), lambda: keras.optimizers.SGD(0.05)),
}


def build(name: str, floatx: str = "float32") -> keras.Model:
    """Model ``name`` with every variable and computation in ``floatx`` (seeded: the same
    initial weights each time)."""
    # Layers take the global dtype policy, which Keras fixes from floatx on first use:
    # both are set.
    before = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx(floatx)
    keras.config.set_dtype_policy(floatx)
    try:
        keras.utils.set_random_seed(0)
        model = MODELS[name][0]()
    finally:
        keras.config.set_floatx(before[0])
        keras.config.set_dtype_policy(before[1])
    assert all(v.dtype == floatx for v in model.weights if "float" in v.dtype), name
    return model


def twin(name: str, model: keras.Model, floatx: str) -> keras.Model:
    other = build(name, floatx)
    other.set_weights([w.astype(floatx) for w in model.get_weights()])
    return other


def batches(name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    rs = np.random.RandomState(1)
    return [(rs.randn(BATCH, *MODELS[name][1]).astype(np.float32),
             rs.randint(0, CLASSES, BATCH)) for _ in range(STEPS)]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- runs ---------------------------------------------------------------------------------


def variables(model, optimizer) -> dict[str, torch.Tensor]:
    """Every variable of the model and the optimizer by its place (paths differ between
    twins), floats as float64."""
    out = {}
    for group, vs in (("model", model.variables), ("optimizer", optimizer.variables)):
        for k, v in enumerate(vs):
            value = np.array(v.numpy())
            kind = np.float64 if value.dtype.kind == "f" else value.dtype
            out[f"{group}.{k}"] = torch.from_numpy(value.astype(kind))
    return out


@dataclass
class Run:
    """A training run: the loss of each step, every variable after each step and the
    seconds each step took."""

    losses: list[float] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def eager(model, optimizer, data, dtype) -> Run:
    """TensorFlow's own training, eagerly."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         dtype=np.dtype(dtype).name)
    run = Run()
    for x, y in data:
        started = time.perf_counter()
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x.astype(dtype), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        run.losses.append(float(loss))
        run.seconds.append(time.perf_counter() - started)
        run.states.append(variables(model, optimizer))
    return run


def on_salusd(model, optimizer, data, address) -> Run:
    run = Run()
    with stf.TrainSession(model, LOSS, optimizer, data[0], address=address) as session:
        for x, y in data:
            started = time.perf_counter()
            run.losses.append(float(session.step(x, y)))
            run.seconds.append(time.perf_counter() - started)
            session.update_model()
            run.states.append(variables(model, optimizer))
    return run


def check_model(name: str, address: str) -> dict[str, list[float]]:
    """Trains ``name`` on salusd and eagerly in float32 and float64 from the same
    weights and asserts the rule on the losses and on every variable after each step
    (the first step is the sharpest test: small batch norm batches make later steps
    chaotic in float32); returns the seconds of each step on salusd and of TensorFlow's
    eager float32 steps."""
    data = batches(name)
    model = build(name)
    f32, f64 = twin(name, model, "float32"), twin(name, model, "float64")
    f32_reversed = twin(name, model, "float32")
    make_optimizer = MODELS[name][2]
    got = on_salusd(model, make_optimizer(), data, address)
    tensorflow = eager(f32, make_optimizer(), data, np.float32)
    # The same steps with each batch's examples in reverse order: the same mathematics
    # (means over the batch), rounded differently. Its distance from float64 is a second
    # sample of TensorFlow's float32 rounding, which chaotic later steps need: one run's
    # distance alone can fall well inside the spread.
    reversed_run = eager(f32_reversed, make_optimizer(),
                         [(x[::-1].copy(), y[::-1].copy()) for x, y in data], np.float32)
    exact = eager(f64, make_optimizer(), data, np.float64)
    assert_as_exact_as_pytorch(got.losses, exact.losses, tensorflow.losses,
                               [reversed_run.losses], label=f"{name} losses: ",
                               dtype=torch.float32)
    for step, (state, want, tf_state, tf_reversed) in enumerate(
            zip(got.states, exact.states, tensorflow.states, reversed_run.states), start=1):
        assert_as_exact_as_pytorch(state, want, tf_state, [tf_reversed],
                                   label=f"{name} step {step}: ", dtype=torch.float32)
    return {"salusd": got.seconds, "tensorflow": tensorflow.seconds}


# -- tests --------------------------------------------------------------------------------

LONG = pytest.mark.skipif(not os.environ.get("SALUS_LONG_TESTS"),
                          reason="a long test: set SALUS_LONG_TESTS=1")


@pytest.mark.parametrize("name", [
    "grouped_cnn", "transformer", "efficientnetb0",
    # MobileNetV2's layers are EfficientNetB0's less squeeze-and-excitation and swish.
    pytest.param("mobilenetv2", marks=LONG), pytest.param("resnet50", marks=LONG),
])
def test_a_keras_model_trains_on_salusd_as_tensorflow_computes_it(daemon, name):
    check_model(name, daemon.address)


@LONG
def test_efficientnet_as_keras_builds_it_trains_with_its_dropout(daemon):
    """Drop-connect in each block (one mask per example) and dropout before the
    classifier: their random numbers are drawn on the client from the layers' seeds,
    which advance as Keras advances them (one draw per step). That the masks are
    TensorFlow's own is checked on a small model (``test_tf.py``)."""
    keras.utils.set_random_seed(0)
    model = _application(keras.applications.EfficientNetB0, dropout=True)()
    dropouts = [layer for layer in model.layers
                if isinstance(layer, keras.layers.Dropout) and layer.rate > 0]
    assert len(dropouts) >= 2
    seeds = {v.path: v.numpy() for v in model.variables
             if v.path.endswith("seed_generator_state")}
    data = batches("efficientnetb0")
    with stf.TrainSession(model, LOSS, momentum_sgd(), data[0], address=daemon.address) as s:
        assert len(s.traced.draws.fed) >= len(dropouts)
        losses = [float(s.step(*b)) for b in data]
        s.update_model()
    assert all(np.isfinite(losses)), losses
    for path, before in seeds.items():
        after = next(v.numpy() for v in model.variables if v.path == path)
        assert list(after) == [before[0], before[1] + STEPS], path

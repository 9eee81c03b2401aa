"""Keras steps on a real salusd (salus.tf, through XLA's HLO): TrainSession, fit,
InferenceSession, learning-rate changes, checkpoints, dropout and refusals.

Each result is checked by the rule of ``harness.assert_as_exact_as_pytorch`` with
TensorFlow in PyTorch's place: the exact reference is the same model trained eagerly by
TensorFlow in float64, the rounding noise is TensorFlow's own float32 eager run's
distance from it. With dropout both runs are compiled by XLA instead, whose random
numbers salus draws (TensorFlow's eager kernels draw others for the same seed).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("tensorflow")
import salus.tf as stf  # noqa: E402  (before TensorFlow: see salus.tf)
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from salus.errors import UnsupportedOpError  # noqa: E402

from daemon import Daemon  # noqa: E402
from harness import assert_as_exact_as_pytorch  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def cnn(dtype: str = "float32", dropout: float = 0.0, f32_masks: bool = False) -> keras.Model:
    """A small CNN; with ``dropout``, a per-example one over the feature maps (as
    EfficientNet's drop-connect) and an elementwise one before the classifier."""
    keras.utils.set_random_seed(0)
    kind = F32MaskDropout if f32_masks else keras.layers.Dropout
    layers = [keras.Input((8, 8, 3), dtype=dtype),
              keras.layers.Conv2D(6, 3, strides=2, padding="same", dtype=dtype),
              keras.layers.BatchNormalization(dtype=dtype), keras.layers.ReLU(dtype=dtype)]
    if dropout:
        layers.append(kind(dropout, noise_shape=(None, 1, 1, 1), dtype=dtype))
    layers += [keras.layers.MaxPooling2D(dtype=dtype), keras.layers.Flatten(dtype=dtype)]
    if dropout:
        layers.append(kind(dropout, dtype=dtype))
    layers.append(keras.layers.Dense(5, dtype=dtype,
                                     kernel_regularizer=keras.regularizers.L2(1e-3)))
    return keras.Sequential(layers)


def batches(sizes=(4, 4, 3)):
    rs = np.random.RandomState(1)
    return [(rs.randn(n, 8, 8, 3).astype(np.float32), rs.randint(0, 5, n)) for n in sizes]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def eager(model: keras.Model, optimizer, data, dtype=np.float32, lr_at=None):
    """Keras' own training loop, eagerly: the losses and every variable after it."""
    losses = []
    for number, (x, y) in enumerate(data):
        if lr_at is not None and number in lr_at:
            optimizer.learning_rate = lr_at[number]
        with tf.GradientTape() as tape:
            prediction = model(x.astype(dtype) if x.dtype.kind == "f" else x, training=True)
            loss = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, dtype=np.dtype(dtype).name)(y, prediction)
            loss = loss + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, variables(model, optimizer)


def variables(model, optimizer=None) -> dict[str, torch.Tensor]:
    """Every variable by its place (paths differ between twins): ``model.<k>``,
    ``optimizer.<k>``."""
    out = {}
    for group, vs in (("model", model.variables),
                      ("optimizer", optimizer.variables if optimizer else [])):
        for k, v in enumerate(vs):
            value = np.array(v.numpy())
            out[f"{group}.{k}"] = torch.from_numpy(
                value.astype(np.float64 if value.dtype.kind == "f" else value.dtype))
    return out


def twin(model: keras.Model, dtype: str, build=None) -> keras.Model:
    """A copy of ``model`` in ``dtype`` (its random seeds included)."""
    other = (build or cnn)(dtype)
    other.set_weights([w.astype(dtype) if w.dtype.kind == "f" else w
                       for w in model.get_weights()])
    for mine, theirs in zip(seeds(other), seeds(model)):
        mine.assign(theirs.numpy())
    return other


def seeds(model: keras.Model) -> list:
    """The states of the model's random-number generators (set_weights leaves them)."""
    return [v for v in model.variables if v.path.endswith("seed_generator_state")]


def test_a_keras_step_trains_on_salusd_as_tensorflow_computes_it(daemon):
    data = batches()  # the last batch is partial: a second program
    model = cnn()
    f32, f64 = twin(model, "float32"), twin(model, "float64")
    optimizer = keras.optimizers.Adam(0.01)
    # The learning rate changes between steps, as a callback would change it.
    lr_at = {2: 0.003}
    with stf.TrainSession(model, LOSS, optimizer, data[0], address=daemon.address) as s:
        losses = []
        for number, (x, y) in enumerate(data):
            if number in lr_at:
                optimizer.learning_rate = lr_at[number]
            losses.append(float(s.step(x, y)))
        assert s.programs == 2
        s.update_model()
    got = variables(model, optimizer)
    tf_losses, tf_state = eager(f32, keras.optimizers.Adam(0.01), data, lr_at=lr_at)
    exact_losses, exact_state = eager(f64, keras.optimizers.Adam(0.01), data, np.float64,
                                      lr_at=lr_at)
    assert_as_exact_as_pytorch(losses, exact_losses, tf_losses, label="losses: ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(got, exact_state, tf_state, dtype=torch.float32)


def _fit_case(seed: int):
    """11 examples (batches of 4, 4, 3), a CNN for salus and its float32 twin for Keras'
    fit, both compiled with SGD, and a float64 twin for the exact run."""
    rs = np.random.RandomState(seed)
    x, y = rs.randn(11, 8, 8, 3).astype(np.float32), rs.randint(0, 5, 11)
    model = cnn()
    f32, f64 = twin(model, "float32"), twin(model, "float64")
    for m in (model, f32):
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=LOSS)

    def dataset(dtype):
        return tf.data.Dataset.from_tensor_slices((x.astype(dtype), y)).batch(4)

    return x, y, model, f32, f64, dataset


def test_fit_trains_a_compiled_model_on_salusd_as_keras_fit_does(daemon):
    x, y, model, f32, f64, dataset = _fit_case(4)
    history = stf.fit(model, dataset(np.float32), epochs=2, address=daemon.address)
    tf_history = f32.fit(dataset(np.float32), epochs=2, verbose=0, shuffle=False).history
    # Keras' fit does not run in float64: the exact run is the same steps, eagerly.
    batches = [(x[k:k + 4], y[k:k + 4]) for k in range(0, 11, 4)]
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    losses, _ = eager(f64, optimizer, batches + batches, np.float64)
    sizes = [len(b[1]) for b in batches]
    exact_history = {"loss": [np.dot(losses[:3], sizes) / 11, np.dot(losses[3:], sizes) / 11]}
    assert_as_exact_as_pytorch(history["loss"], exact_history["loss"], tf_history["loss"],
                               label="epoch losses: ", dtype=torch.float32)
    assert_as_exact_as_pytorch(variables(model), variables(f64), variables(f32),
                               dtype=torch.float32)


class _Halve(keras.callbacks.Callback):
    """At each epoch's end: halves the learning rate and shrinks the first kernel (what a
    callback may change), and records the hooks it saw."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch", batch, sorted(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch", epoch, sorted(logs)))
        self.model.optimizer.learning_rate.assign(self.model.optimizer.learning_rate * 0.5)
        kernel = self.model.weights[0]
        kernel.assign(kernel * 0.9)


def test_fit_runs_keras_callbacks_as_keras_fit_does(daemon):
    """A callback that changes the learning rate and the weights between epochs,
    EarlyStopping ending the training, and validation data: salus.tf.fit as Keras' fit
    (the same hooks, history and variables; float64 steps replayed eagerly)."""
    x, y, model, f32, f64, dataset = _fit_case(6)

    def callbacks():
        return [_Halve(), keras.callbacks.EarlyStopping(monitor="loss", min_delta=10,
                                                        patience=0)]

    ours, theirs = callbacks(), callbacks()
    validation = (x[:5], y[:5])
    history = stf.fit(model, dataset(np.float32), epochs=4, callbacks=ours,
                      validation_data=validation, address=daemon.address)
    tf_history = f32.fit(dataset(np.float32), epochs=4, verbose=0, shuffle=False,
                         callbacks=theirs, validation_data=validation).history
    assert ours[0].seen == theirs[0].seen and len(history["loss"]) == 2
    assert set(history) == set(tf_history) == {"loss", "val_loss"}
    # The exact run: the same steps and the callback's changes, eagerly in float64.
    batches = [(x[k:k + 4], y[k:k + 4]) for k in range(0, 11, 4)]
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss64 = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")

    def validation_loss():
        return float(loss64(validation[1], f64(validation[0].astype(np.float64))))

    first, _ = eager(f64, optimizer, batches, np.float64)
    exact_validation = [validation_loss()]
    optimizer.learning_rate = 0.025
    f64.weights[0].assign(f64.weights[0] * 0.9)
    second, _ = eager(f64, optimizer, batches, np.float64)
    exact_validation.append(validation_loss())
    f64.weights[0].assign(f64.weights[0] * 0.9)
    sizes = [len(b[1]) for b in batches]
    exact = [np.dot(first, sizes) / 11, np.dot(second, sizes) / 11]
    assert_as_exact_as_pytorch(history["loss"], exact, tf_history["loss"],
                               label="epoch losses: ", dtype=torch.float32)
    assert_as_exact_as_pytorch(variables(model), variables(f64), variables(f32),
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(history["val_loss"], exact_validation, tf_history["val_loss"],
                               label="validation losses: ", dtype=torch.float32)


def test_a_checkpoint_round_trips_and_inference_serves_the_trained_model(daemon):
    data = batches((4, 4))
    model = cnn()
    optimizer = keras.optimizers.Adam(0.01)
    with stf.TrainSession(model, LOSS, optimizer, data[0], address=daemon.address) as s:
        s.step(*data[0])
        checkpoint = s.state_dict()
        first = float(s.step(*data[1]))
        s.load_state_dict(checkpoint)
        assert float(s.step(*data[1])) == first  # the same step from the same state
        assert set(checkpoint) >= {v.path for v in model.variables}
        # Keras' weight lists round trip, and pipelined steps are the same steps.
        weights, everything = s.get_weights(), s.state_dict()
        again = [float(s.step(*b)) for b in data]
        s.load_state_dict(everything)
        assert [float(loss) for loss in s.steps(data, depth=2)] == again
        s.set_weights(weights)
        assert all(np.array_equal(a, b) for a, b in zip(s.get_weights(), weights))
        s.update_model()
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), s.get_weights()))
    x = data[1][0]
    with stf.InferenceSession(model, x, address=daemon.address) as serve:
        got = serve(x)
        partial = serve(x[:2])
    want = model(x, training=False).numpy()
    exact = twin(model, "float64")(x.astype(np.float64), training=False).numpy()
    assert_as_exact_as_pytorch({"out": torch.from_numpy(got)},
                               {"out": torch.from_numpy(exact)},
                               {"out": torch.from_numpy(want)})
    assert partial.shape == (2, 5)
    assert np.abs(partial - got[:2]).max() <= 1e-5 * np.abs(got).max()


class F32MaskDropout(keras.layers.Layer):
    """Keras' Dropout for a float64 twin, with the masks its float32 model draws (float64
    dropout draws 64-bit random numbers: other masks), applied in float64."""

    def __init__(self, rate: float, noise_shape=None, **kwargs):
        super().__init__(**kwargs)
        self.rate, self.noise_shape = rate, noise_shape
        self.seed_generator = keras.random.SeedGenerator()

    def call(self, x, training=False):
        if not training:
            return x
        shape = tf.shape(x) if self.noise_shape is None else [
            x.shape[k] if n is None else n for k, n in enumerate(self.noise_shape)]
        kept = keras.random.dropout(tf.ones(shape, tf.float32), self.rate,
                                    seed=self.seed_generator)
        return tf.where(kept != 0, x / (1 - self.rate), tf.zeros_like(x))


def compiled(model: keras.Model, optimizer, data, dtype=np.float32):
    """TensorFlow's own training steps compiled by XLA (whose random numbers salus draws;
    TensorFlow's eager kernels draw others for the same seed): the losses and every
    variable after them."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         dtype=np.dtype(dtype).name)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) + tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(step(x.astype(dtype), y)) for x, y in data]
    return losses, variables(model, optimizer)


def test_dropout_trains_with_tensorflows_masks_drawn_on_the_client(daemon):
    data = batches()  # the last batch is partial: a second program, with masks of its own
    model = cnn(dropout=0.5)
    f32 = twin(model, "float32", lambda d: cnn(d, dropout=0.5))
    f64 = twin(model, "float64", lambda d: cnn(d, dropout=0.5, f32_masks=True))
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    with stf.TrainSession(model, LOSS, optimizer, data[0], address=daemon.address) as s:
        # One mask per dropout: per example, and per element.
        assert s.traced.feed_names == ["batch.0", "batch.1", "random.0", "random.1"]
        masks, _ = s.traced.draws.draw(s.state_dict())
        assert [m.shape for m in masks] == [(4, 1, 1, 1), (4, 24)]
        assert not any("seed" in name for name in s.traced.state_names)
        losses = [float(s.step(*data[0]))]
        losses += [float(loss) for loss in s.steps(data[1:], depth=2)]
        s.update_model()
        got = variables(model, optimizer)
        # A checkpoint carries the seed: the same step from it draws the same masks; the
        # step after draws others.
        checkpoint = s.state_dict()
        first = float(s.step(*data[0]))
        s.load_state_dict(checkpoint)
        assert float(s.step(*data[0])) == first
        assert float(s.step(*data[0])) != first
    tf_losses, tf_state = compiled(f32, keras.optimizers.SGD(0.05, momentum=0.9), data)
    exact_losses, exact_state = compiled(f64, keras.optimizers.SGD(0.05, momentum=0.9),
                                         data, np.float64)
    assert_as_exact_as_pytorch(losses, exact_losses, tf_losses, label="losses: ",
                               dtype=torch.float32)
    # The seeds (integers) are equal, the masks therefore too.
    assert_as_exact_as_pytorch(got, exact_state, tf_state, dtype=torch.float32)


def test_random_numbers_without_a_seed_in_the_state_are_refused(daemon):
    class Noise(keras.layers.Layer):
        def call(self, x, training=False):
            return x + tf.random.uniform(tf.shape(x)) if training else x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), Noise(), keras.layers.Dense(2)])
    data = (np.ones((3, 4), np.float32), np.zeros(3, np.int64))
    with pytest.raises(UnsupportedOpError) as error:
        stf.TrainSession(model, LOSS, keras.optimizers.SGD(0.1), data,
                         address=daemon.address)
    message = str(error.value)
    assert "HLO rng" in message and "SeedGenerator" in message and "noise" in message


def text_model(dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((7,), dtype="int32"),
                             keras.layers.Embedding(20, 8, dtype=dtype),
                             keras.layers.GlobalAveragePooling1D(dtype=dtype),
                             keras.layers.Dense(3, dtype=dtype,
                                                kernel_regularizer=keras.regularizers.L2(1e-3))])


def test_an_embedding_model_trains_on_salusd_as_tensorflow_computes_it(daemon):
    rs = np.random.RandomState(3)
    data = [(rs.randint(0, 20, (4, 7)).astype(np.int32), rs.randint(0, 3, 4))
            for _ in range(3)]
    model = text_model()
    f32, f64 = twin(model, "float32", text_model), twin(model, "float64", text_model)
    optimizer = keras.optimizers.Adam(0.01)
    with stf.TrainSession(model, LOSS, optimizer, data[0], address=daemon.address) as s:
        losses = [float(s.step(*b)) for b in data]
        s.update_model()
    tf_losses, tf_state = eager(f32, keras.optimizers.Adam(0.01), data)
    exact_losses, exact_state = eager(f64, keras.optimizers.Adam(0.01), data, np.float64)
    assert_as_exact_as_pytorch(losses, exact_losses, tf_losses, label="losses: ",
                               dtype=torch.float32)
    assert_as_exact_as_pytorch(variables(model, optimizer), exact_state, tf_state,
                               dtype=torch.float32)

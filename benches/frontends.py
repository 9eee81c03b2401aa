"""Keras and JAX training through salusd against the frameworks themselves, in the same run.

For each model, measures the time of one training step:

- ``tf_eager_ms``: Keras eagerly (``tf.GradientTape`` and ``optimizer.apply_gradients``,
  as a custom loop runs it without ``tf.function``);
- ``tf_xla_ms``: the same step under ``tf.function(jit_compile=True)``, the HLO salus
  lowers (for JAX models: ``jax.jit``, ``framework_ms``);
- ``salus_ms``: one ``salus.tf.TrainSession.step`` / ``salus.jax.TrainSession.step``
  through salusd's CPU device (batch in, the gRPC round trip, the iteration, the loss
  back);
- ``ratio``: ``salus_ms`` over the eager step (Keras) or the jitted step (JAX).

The framework and salus steps alternate in rounds; each figure is the median over all
rounds, so a machine that gets busier slows both alike. salusd is started from
``target/release/salusd`` (built if missing) on a temporary socket.

    python benches/frontends.py [--json] [--rounds 5] [--steps 5]
        [--models cnn,resnet50,mobilenetv2,jax_encoder]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))
sys.path.insert(0, str(ROOT / "benches"))

import numpy as np  # noqa: E402

import salus.jax as sj  # noqa: E402  (before JAX and TensorFlow: see salus.jax)
import salus.tf as stf  # noqa: E402
import jax  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from torch_e2e import start_daemon  # noqa: E402

BATCH = 32
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_cnn() -> keras.Model:
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])


def keras_resnet50() -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                       classifier_activation=None)


def keras_mobilenetv2() -> keras.Model:
    return keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10,
                                          classifier_activation=None)


def keras_batch(rs):
    return rs.randn(BATCH, 32, 32, 3).astype(np.float32), rs.randint(0, 10, BATCH)


def time_keras(build, rounds: int, steps: int, address: str) -> dict:
    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(0)
    batch = keras_batch(rs)
    model, eager_model, xla_model = build(), build(), build()
    for other in (eager_model, xla_model):
        other.set_weights(model.get_weights())
    eager_opt, xla_opt = keras.optimizers.SGD(0.01, momentum=0.9), keras.optimizers.SGD(
        0.01, momentum=0.9)

    def step_of(m, opt):
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, m(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables),
                                    m.trainable_variables))
            return loss
        return step
    eager = step_of(eager_model, eager_opt)
    xla = tf.function(step_of(xla_model, xla_opt), jit_compile=True)
    session = stf.TrainSession(model, LOSS, keras.optimizers.SGD(0.01, momentum=0.9), batch,
                               address=address)
    return against(session, batch, {"tf_eager_ms": lambda: float(eager(*batch)),
                                     "tf_xla_ms": lambda: float(xla(*batch))},
                   "tf_eager_ms", rounds, steps)


def time_jax_encoder(rounds: int, steps: int, address: str) -> dict:
    sys.path.insert(0, str(ROOT / "adaptors" / "python" / "tests"))
    from test_jax import encoder, init, train_step
    rs = np.random.RandomState(0)
    step = train_step(encoder)
    params = init("encoder")
    zeros = jax.tree.map(np.zeros_like, params)
    state = {"params": params, "m": zeros, "v": zeros, "t": np.zeros((), np.float32)}
    batch = (rs.randn(BATCH, 6, 8).astype(np.float32), rs.randint(0, 5, BATCH).astype(np.int32))
    jitted = jax.jit(step)
    holder = {"state": jax.tree.map(jax.numpy.asarray, state)}

    def framework():
        holder["state"], loss = jitted(holder["state"], *batch)
        return float(loss)
    session = sj.TrainSession(step, state, batch, address=address)
    return against(session, batch, {"framework_ms": framework}, "framework_ms", rounds,
                   steps)


def against(session, batch, framework: dict, baseline: str, rounds: int, steps: int
            ) -> dict:
    """The framework's runs and ``session``'s steps, alternating (:func:`alternate`); the
    ratio of salus to ``baseline``. Closes the session."""
    runs = {**framework, "salus_ms": lambda: float(session.step(*batch))}
    try:
        result = alternate(runs, rounds, steps)
    finally:
        session.close()
    result["ratio"] = result["salus_ms"] / result[baseline]
    result["open_session_ms"] = session.open_ms
    return result


def alternate(runs: dict, rounds: int, steps: int) -> dict:
    for run in runs.values():  # warm up: compile, first-program set-up
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(steps):
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


MODELS = {"cnn": lambda r, s, a: time_keras(keras_cnn, r, s, a),
          "resnet50": lambda r, s, a: time_keras(keras_resnet50, r, s, a),
          "mobilenetv2": lambda r, s, a: time_keras(keras_mobilenetv2, r, s, a),
          "jax_encoder": time_jax_encoder}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--salusd", type=Path, default=ROOT / "target" / "release" / "salusd")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="salus-frontends-") as directory:
        process, address = start_daemon(args.salusd, directory)
        try:
            for name in args.models.split(","):
                results[name] = MODELS[name](args.rounds, args.steps, address)
                if not args.json:
                    print(name, {k: round(v, 2) for k, v in results[name].items()},
                          flush=True)
        finally:
            process.kill()
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Keras training script moved onto salusd: the changed lines are marked `# salus`.

Start salusd first (`salusd`, or `salusd --socket /tmp/s.sock` and
`SALUS_ADDRESS=/tmp/s.sock`), then:

    python examples/keras_train.py [--epochs 3] [--compare]

The script is an ordinary one: a compiled model, a `tf.data` pipeline whose last batch
of each epoch is smaller, `fit`, then `evaluate`-style predictions. `--compare` also
trains copies on the same data, with Keras' own `model.fit` in float32 and eagerly in
float64, and prints how far salus and Keras' float32 run each end up from float64: salus
gives TensorFlow's numbers, as exactly as TensorFlow does.
"""

import argparse

import salus.tf  # salus (first: salusd, not TensorFlow, owns the GPU)

import keras
import numpy as np
import tensorflow as tf


def build(dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 1), dtype=dtype),
        keras.layers.Conv2D(8, 3, padding="same", use_bias=False, dtype=dtype),
        keras.layers.BatchNormalization(dtype=dtype), keras.layers.ReLU(dtype=dtype),
        keras.layers.MaxPooling2D(dtype=dtype), keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(32, activation="relu", dtype=dtype),
        keras.layers.Dense(10, dtype=dtype)])
    model.compile(optimizer=optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  dtype=dtype))
    return model


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(
        1e-3, decay_steps=5, decay_rate=0.9))


def data(dtype=np.float32) -> tf.data.Dataset:
    rs = np.random.RandomState(1)
    x = rs.randn(100, 16, 16, 1)
    y = (x.mean(axis=(1, 2, 3)) * 40).astype(np.int64).clip(-5, 4) + 5  # learnable labels
    return tf.data.Dataset.from_tensor_slices((x.astype(dtype), y)).batch(32)  # 32 32 32 4


def float64_run(epochs: int, initial: list) -> keras.Model:
    """The same training in float64, eagerly (Keras' fit does not run in float64)."""
    model = build("float64")
    model.set_weights([w.astype(np.float64) for w in initial])
    opt = optimizer()
    for _ in range(epochs):
        for x, y in data(np.float64):
            with tf.GradientTape() as tape:
                loss = model.loss(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()

    model = build()
    history = salus.tf.fit(model, data(), epochs=args.epochs)  # salus: was model.fit(...)
    print("salus  loss per epoch:", " ".join(f"{v:.6f}" for v in history["loss"]))
    x, _ = next(iter(data()))
    predictions = model(x, training=False).numpy()  # the trained weights are back in Keras
    print("predicted classes of the first batch:", predictions.argmax(-1)[:10].tolist())

    if args.compare:
        reference = build()
        keras_history = reference.fit(data(), epochs=args.epochs, verbose=0, shuffle=False)
        print("keras  loss per epoch:", " ".join(f"{v:.6f}"
                                                 for v in keras_history.history["loss"]))
        exact = float64_run(args.epochs, build().get_weights()).get_weights()

        def error(weights):
            return max(float(np.abs(a - b).max()) for a, b in zip(weights, exact))
        scale = max(float(np.abs(w).max()) for w in exact)
        print(f"against float64: salus {error(model.get_weights()):.3g}, keras float32 "
              f"{error(reference.get_weights()):.3g} (largest weight {scale:.3g})")


if __name__ == "__main__":
    main()

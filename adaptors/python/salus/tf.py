"""TensorFlow (Keras 3) jobs on salusd: ``TrainSession``, ``InferenceSession`` and ``fit``.

A Keras training step (the model's forward in training mode, the loss and the model's own
regularization losses, the gradients, and the optimizer's own update: any Keras optimizer,
its schedule and gradient clipping included) is written as one pure function of the
variables' values through Keras' stateless API, compiled by TensorFlow to XLA's HLO
(``tf.function(jit_compile=True)``), and lowered to the salus IR by :mod:`salus.hlo`. So
salusd runs exactly the computation TensorFlow would, and the session behaves as a
:mod:`salus.torch` session does: one program per batch shape, persistent state, a
checkpoint as :meth:`state_dict`.

Persistent tensors are named by their Keras variable paths (``dense/kernel``,
``adam/iteration``). An optimizer variable the step never changes (``learning_rate``) is
a hyperparameter: the Keras optimizer stays its truth, and a change to it
(``optimizer.learning_rate = 0.01``, a callback) reaches the next step.

Dropout's random numbers come from the layers' ``SeedGenerator`` states, which the
client keeps: it draws TensorFlow's (XLA's) own masks there for each step and sends them
with the batch (:mod:`salus.hlo.draws`). Not supported yet (refused before anything is
sent, naming the op): random numbers from no seed in the model, loops;
``docs/frontends.md`` lists the rest.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from ._llvm import triton_first
from .client import Client
from .errors import LoweringError
from .hlo import trace_hlo
from .hlo.parse import parse_module
from .hlo.seeds import SeededSession
from .torch import _default_name, _SalusSession
from .trace import InputSlot, OutputSlot, TracedStep

triton_first()  # before TensorFlow and JAX: see salus._llvm

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

# salusd owns the GPU; TensorFlow here only builds and compiles steps. By default it would
# reserve nearly all of every GPU's memory on first use, beside salusd's lanes.
try:
    tf.config.set_visible_devices([], "GPU")
except RuntimeError:  # TensorFlow already runs on them: too late to hide them
    warnings.warn("salus.tf was imported after TensorFlow started using the GPU, whose "
                  "memory it may now hold beside salusd's: import salus.tf first",
                  stacklevel=2)

__all__ = ["InferenceSession", "TrainSession", "fit"]


def _torch(value: Any) -> torch.Tensor:
    array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
    return torch.from_numpy(np.array(array, copy=True, order="C"))  # owned by the tensor


def _path_names(variables: Sequence[Any]) -> dict[int, str]:
    """Keras variable path by the id of its TensorFlow variable's handle (a name taken
    twice gets a prime)."""
    names: dict[int, str] = {}
    taken: set[str] = set()
    for v in variables:
        name = v.path
        while name in taken:
            name += "'"
        taken.add(name)
        names[id(v.value.handle)] = name
    return names


class _Step:
    """A Keras step as ``tf.function(jit_compile=True)`` compiles it, in salus' terms.

    The step reads and assigns the variables themselves, as Keras' own ``train_step``
    does. TensorFlow compiles it with the batch as the first parameters and every
    variable it captures after them, in ``captured_inputs`` order; its result is the
    step's return value followed by the new value of every variable it assigned, each
    marked by ``input_output_alias`` with the parameter it replaces."""

    def __init__(self, fn, groups: dict[str, Sequence[Any]], training: bool):
        self.function = tf.function(fn, jit_compile=True, autograph=False)
        self.groups = groups
        self.training = training

    def trace(self, batch: Sequence[Any], kind: str) -> TracedStep:
        """The step for a batch of these shapes: a training step returns the loss, a
        forward pass its outputs (``output.<k>``)."""
        tensors = [tf.convert_to_tensor(np.asarray(b)) for b in batch]
        concrete = self.function.get_concrete_function(*tensors)
        module = parse_module(self.function.experimental_get_compiler_ir(*tensors)(
            stage="hlo"))
        inputs = [InputSlot(f"batch.{k}", "feed", "batch") for k in range(len(batch))]
        state: dict[str, torch.Tensor] = {}
        known = {}
        for group, variables in self.groups.items():
            role = "parameter" if group == "param" and self.training else "state"
            for handle_id, name in _path_names(variables).items():
                known[handle_id] = (name, role, group)
        by_handle = {id(v.value.handle): v for vs in self.groups.values() for v in vs}
        constants = 0
        seeds = []
        for captured in concrete.captured_inputs:
            if id(captured) in known:
                name, role, group = known[id(captured)]
                inputs.append(InputSlot(name, role, group))
                state[name] = _torch(by_handle[id(captured)].value)
                if _is_seed(by_handle[id(captured)]):
                    seeds.append(name)
            elif captured.dtype != tf.resource:
                # A tensor the model keeps outside its variables (a Normalization layer's
                # mean): session state that no step changes.
                name = f"captured.{constants}"
                constants += 1
                inputs.append(InputSlot(name, "state", "captured"))
                state[name] = _torch(captured)
            else:
                raise LoweringError(
                    f"the step captures the variable {captured.name!r}, which is not one "
                    "of the model's or the optimizer's: salus keeps only those between "
                    "steps")
        root = module.entry_computation.by_name()[module.entry_computation.root]
        count = len(root.shape.elements) if root.shape.dtype == "tuple" else 1
        returned = count - len(module.aliases)
        outputs = ([OutputSlot("loss", "loss")] if kind == "train" else
                   [OutputSlot("output", f"output.{k}") for k in range(returned)])
        for index in range(len(outputs), count):
            param = module.aliases.get(index)
            if param is None or inputs[param].role == "feed":
                raise LoweringError(f"TensorFlow's result {index} is neither the step's "
                                    "value nor a variable's update")
            outputs.append(OutputSlot("update", inputs[param].name))
        return trace_hlo(module, inputs, outputs, state, _batch(batch), kind, seeds=seeds)


def _is_seed(variable) -> bool:
    """Whether ``variable`` is the state of a Keras ``SeedGenerator`` (a Dropout layer's
    random numbers come from one): salus draws what it seeds on the client."""
    return variable.path.split("/")[-1] == "seed_generator_state"


def _model_input(inputs: Sequence[Any]):
    return inputs[0] if len(inputs) == 1 else list(inputs)


def _train_step(model: keras.Model, loss: Any, optimizer: keras.optimizers.Optimizer
                ) -> _Step:
    """One training step of a Keras model on ``(inputs..., target)``: the loss (plus the
    model's own losses), the gradients, the optimizer's update. ``loss=None``: the loss the
    model was compiled with, computed by ``model.compute_loss`` as Keras' own
    ``train_step`` does (its loss tracker's variables are then session state too)."""
    loss_fn = None if loss is None else _loss_object(loss)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    def step(*batch):
        *inputs, target = batch
        with tf.GradientTape() as tape:
            prediction = model(_model_input(inputs), training=True)
            if loss_fn is None:
                value = model.compute_loss(x=_model_input(inputs), y=target,
                                           y_pred=prediction, training=True)
            else:
                value = loss_fn(target, prediction)
                if model.losses:
                    value = value + tf.add_n(model.losses)
        gradients = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return value

    groups = {"param": model.trainable_variables, "buffer": model.non_trainable_variables,
              "optimizer": optimizer.variables}
    if loss_fn is None:
        groups["metric"] = model.metrics_variables
    return _Step(step, groups, training=True)


def _loss_object(loss: Any) -> keras.losses.Loss:
    """A Keras loss as ``model.compile`` takes it (a name, a function, a ``Loss``), as a
    ``Loss`` that reduces to the batch mean, as ``compile`` reduces it."""
    if isinstance(loss, keras.losses.Loss):
        return loss
    fn = keras.losses.get(loss)
    if isinstance(fn, keras.losses.Loss):
        return fn
    if fn is None or not callable(fn):
        raise ValueError(f"not a Keras loss: {loss!r}")
    return keras.losses.LossFunctionWrapper(fn)


def _forward(model: keras.Model) -> _Step:
    def forward(*inputs):
        return tuple(tf.nest.flatten(model(_model_input(inputs), training=False)))

    return _Step(forward, {"param": model.trainable_variables,
                           "buffer": model.non_trainable_variables}, training=False)


def _batch(batch: Sequence[Any]) -> list[torch.Tensor]:
    return [_torch(b) for b in batch]


class _KerasSession(SeededSession, _SalusSession):
    # The seeds of the step's random numbers are the SeedGenerator states, by path.

    def _keep_keras_seeds(self) -> None:
        self._keep_seeds({name: variable.numpy() for name, variable in self._variables().items()
                          if _is_seed(variable)})

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every persistent tensor of the session as it is on salusd now, by Keras variable
        path (a checkpoint; :meth:`load_state_dict` takes it back), and the seeds of its
        random numbers as they are on the client."""
        return {name: value.numpy() for name, value in super().state_dict().items()}

    def update_model(self, model: keras.Model | None = None) -> keras.Model:
        """Copies every variable from salusd into the Keras model (and, for a training
        session, its optimizer) in place; returns the model."""
        values = self.state_dict()
        for name, variable in self._variables().items():
            if name in values:
                variable.assign(values[name])
        return self.model

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights as they are on salusd, in ``model.get_weights()`` order."""
        values = self.state_dict()
        return [values[name] for name in self._weight_names()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Overwrites the model's weights on salusd, as ``model.set_weights`` takes them."""
        names = self._weight_names()
        if len(weights) != len(names):
            raise ValueError(f"set_weights: {len(weights)} arrays for the model's "
                             f"{len(names)} weights")
        self.load_state_dict({n: np.asarray(w) for n, w in zip(names, weights)},
                             strict=False)

    def _weight_names(self) -> list[str]:
        by_variable = {id(v): name for name, v in self._variables().items()}
        return [by_variable[id(v)] for v in self.model.weights]

    def _variables(self) -> dict[str, Any]:
        """The Keras variables of the step by name."""
        return {name: v for vs in self._step.groups.values()
                for v, name in zip(vs, _path_names(vs).values())}


class TrainSession(_KerasSession):
    """A Keras training job on salusd.

    Traces one training step of ``model`` under ``loss`` (a Keras loss object, function
    or name, called as ``loss(target, prediction)`` and reduced to the batch mean as
    ``model.compile`` does; ``None``: the loss the model was compiled with) and
    ``optimizer`` (a Keras optimizer: its own update rule, schedule and clipping are
    traced) with
    ``example_batch = (inputs..., target)`` (arrays or tensors), opens a session on the
    daemon and uploads the model's and the optimizer's variables. Scheduling hints,
    ``client``/``address``, ``offline``/``slo_ms``, ``admission_timeout``,
    ``feed_buffer`` and ``reattach_timeout`` are those of
    :class:`salus.torch.TrainSession`. A batch of another size (the last of an epoch)
    runs a program traced for its shapes on first use.
    """

    kind = "training"

    def __init__(self, model: keras.Model, loss: Any,
                 optimizer: keras.optimizers.Optimizer, example_batch: Sequence[Any], *,
                 address: str | None = None, client: Client | None = None, name: str = "",
                 priority: int = 0, total_iterations: int = 0,
                 expected_iteration_ms: float = 0.0, admission_timeout: float | None = None,
                 feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
                 offline: bool = False, slo_ms: float = 0.0):
        started = time.perf_counter()
        if len(example_batch) < 2:
            raise ValueError("example_batch is (inputs..., target): at least two arrays")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self._step = _train_step(model, loss, optimizer)
        traced = self._step.trace(example_batch, "train")
        updated = {s.name for s in traced.outputs if s.kind == "update"}
        # Optimizer variables no step changes (the learning rate): the Keras optimizer
        # holds their truth; a changed value is written before the next step.
        self._hyperparameters = {
            name: variable for name, variable in self._variables().items()
            if name in traced.initial_state and name not in updated
            and any(v is variable for v in optimizer.variables)}
        self._sent = {name: np.asarray(v.value).copy()
                      for name, v in self._hyperparameters.items()}
        self._keep_keras_seeds()
        self._open(traced, client=client, address=address,
                   name=name or _default_name(f"{model.name} (keras)"), priority=priority,
                   total_iterations=total_iterations,
                   expected_iteration_ms=expected_iteration_ms,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)

    def _trace_for(self, batch: tuple) -> TracedStep:
        return self._step.trace([b.numpy() for b in batch], "train")

    def step(self, *batch: Any) -> np.ndarray:
        """Runs one training iteration on salusd with ``batch = (inputs..., target)``;
        returns the loss."""
        self._ensure_slots(2)
        iteration, answer = self._iteration(batch, "step()")
        response = self._run_or_resume(iteration)
        if response is None:
            return self.step(*batch)  # the iteration did not run: on the session back
        return self._stepped(response, answer)

    def steps(self, batches: Iterable[Sequence[Any]], depth: int = 4) -> Iterator[np.ndarray]:
        """Pipelined training, as :meth:`salus.torch.TrainSession.steps`: one iteration
        per batch, up to ``depth`` submitted ahead; yields each loss in order. A
        hyperparameter changed while iterations are in flight reaches the next one
        submitted."""
        for response, answer in self._pipelined(batches, depth):
            yield self._stepped(response, answer)

    def _iteration(self, batch: Sequence[Any], what: str):
        program, leaves = self._program_for(_batch(batch), what)
        leaves = leaves + self._drawn(program.traced)
        writes = {}
        for name, variable in self._hyperparameters.items():
            value = np.asarray(variable.value)
            if name not in self._sent or not np.array_equal(value, self._sent[name]):
                writes[self.layout.state[name].id] = value.tobytes()
                self._sent[name] = value.copy()
        return self._submission(program, leaves, what, writes or None)

    def _stepped(self, response, answer) -> np.ndarray:
        self.iterations += 1
        self.last_device_ms = response.device_us / 1e3
        return self._outputs(response, answer)[0].numpy()

    def _state_written(self) -> None:
        # The Keras optimizer stays the truth for hyperparameters: written again next step.
        self._sent = {}

    def _iteration_failed(self) -> None:
        self._sent = {}  # the hyperparameters may not have arrived: send them again

    def __repr__(self) -> str:
        return (f"<salus.tf.TrainSession {self.model.name} session {self.id}, "
                f"{self.iterations} steps>")


class InferenceSession(_KerasSession):
    """A Keras model's forward pass (inference mode) on salusd: ``session(*inputs)``
    returns its outputs as numpy arrays (one array, or a list for several outputs).
    Other arguments as :class:`TrainSession`."""

    kind = "inference"

    def __init__(self, model: keras.Model, example_inputs: Sequence[Any] | Any, *,
                 address: str | None = None, client: Client | None = None, name: str = "",
                 priority: int = 0, admission_timeout: float | None = None,
                 feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
                 offline: bool = False, slo_ms: float = 0.0):
        started = time.perf_counter()
        if not isinstance(example_inputs, (list, tuple)):
            example_inputs = (example_inputs,)
        self.model = model
        self._step = _forward(model)
        traced = self._step.trace(example_inputs, "inference")
        self._keep_keras_seeds()
        self._open(traced, client=client, address=address,
                   name=name or _default_name(f"{model.name} (keras inference)"),
                   priority=priority, total_iterations=0, expected_iteration_ms=0.0,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)

    def _trace_for(self, batch: tuple) -> TracedStep:
        return self._step.trace([b.numpy() for b in batch], "inference")

    def __call__(self, *inputs: Any):
        what = "the inference session"
        self._ensure_slots(2)
        program, leaves = self._program_for(_batch(inputs), what)
        leaves = leaves + self._drawn(program.traced)
        iteration, answer = self._submission(program, leaves, what)
        response = self._run_or_resume(iteration)
        if response is None:
            return self(*inputs)
        self.iterations += 1
        outputs = [t.numpy() for t in self._outputs(response, answer)]
        return outputs[0] if len(outputs) == 1 else outputs

    def __repr__(self) -> str:
        return f"<salus.tf.InferenceSession {self.model.name} session {self.id}>"


def fit(model: keras.Model, data: Iterable[Sequence[Any]], *, epochs: int = 1,
        steps_per_epoch: int | None = None, verbose: bool = False,
        callbacks: Sequence[Any] | None = None, validation_data: Any = None,
        **session_options: Any) -> dict[str, list[float]]:
    """``model.fit(data, epochs=..., callbacks=..., validation_data=...)`` with the steps
    on salusd: ``model`` is compiled (``model.compile(optimizer=..., loss=...)``),
    ``data`` yields ``(inputs..., target)`` batches (a ``tf.data.Dataset``, a list).
    Trains with :class:`TrainSession` (``session_options`` go to it), copies the trained
    variables back into the model and the optimizer, and returns what Keras'
    ``History.history`` holds: each epoch's ``loss`` (the mean over its samples) and,
    with ``validation_data``, ``model.evaluate``'s results as ``val_<name>``.

    Keras ``callbacks`` run where ``model.fit`` runs them. Before ``on_epoch_end`` the
    model and its optimizer get the session's variables, so a callback that saves,
    reads or restores weights (``ModelCheckpoint``, ``EarlyStopping``) sees the trained
    ones; what a callback changes then (a learning rate, as ``ReduceLROnPlateau``; the
    weights) the session takes before the next step; ``model.stop_training`` ends the
    training. Training metrics other than the loss are not computed (a callback that
    monitors one finds it missing, as Keras says)."""
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise ValueError("fit needs a compiled model: model.compile(optimizer=..., loss=...)")
    hooks = keras.callbacks.CallbackList(callbacks, model=model, epochs=epochs,
                                         steps=steps_per_epoch, verbose=0)
    model.stop_training = False
    session = None
    history: dict[str, list[float]] = {"loss": []}
    logs: dict[str, float] = {}
    try:
        hooks.on_train_begin()
        for epoch in range(epochs):
            hooks.on_epoch_begin(epoch)
            total, count = 0.0, 0
            for number, batch in enumerate(data):
                if steps_per_epoch is not None and number >= steps_per_epoch:
                    break
                batch = tuple(np.asarray(b) for b in batch)
                if session is None:
                    session = TrainSession(model, None, model.optimizer, batch,
                                           **session_options)
                hooks.on_train_batch_begin(number)
                # Keras' loss tracker: the mean over samples (a partial batch weighs less).
                size = len(batch[0])
                total += float(session.step(*batch)) * size
                count += size
                hooks.on_train_batch_end(number, {"loss": total / count})
            if not count:
                raise ValueError("fit: the data gave no batch")
            logs = {"loss": total / count}
            session.update_model()
            synced = _values(session)
            if validation_data is not None:
                if isinstance(validation_data, (tuple, list)):  # (x, y[, sample_weight])
                    vx, vy, vw = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
                    results = model.evaluate(vx, vy, sample_weight=vw, verbose=0,
                                             return_dict=True)
                else:
                    results = model.evaluate(validation_data, verbose=0, return_dict=True)
                logs.update({f"val_{k}": float(v) for k, v in results.items()})
            hooks.on_epoch_end(epoch, logs)
            for key, value in logs.items():
                history.setdefault(key, []).append(value)
            if verbose:
                print(f"epoch {epoch + 1}/{epochs}: loss {logs['loss']:.6g}")
            # what the callbacks changed in the model or the optimizer, the session takes
            changed = {n: v for n, v in _values(session).items()
                       if not np.array_equal(v, synced[n])}
            if changed:
                session.load_state_dict(changed, strict=False)
            if model.stop_training:
                break
        hooks.on_train_end(logs)
    finally:
        if session is not None:
            session.close()
    return history


def _values(session: "TrainSession") -> dict[str, np.ndarray]:
    """The session's Keras variables as the model and its optimizer hold them now."""
    return {name: np.array(variable.numpy()) for name, variable in session._variables().items()
            if name in session.layout.state}

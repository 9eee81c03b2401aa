"""Random numbers of an HLO step, drawn on the client by the framework's own generator.

A step with dropout computes its random numbers from a seed the framework keeps as a
variable (the state of a Keras ``SeedGenerator``): integer hashing of the seed, XLA's
``rng-bit-generator``, bit tricks that turn bits into floats in [0, 1), a comparison
with the rate. Those values depend on the seed alone, never on the batch or the
parameters, and they need unsigned 32- and 64-bit arithmetic the IR does not have. So
they run here, on the client, exactly as XLA specifies them (numpy, whose unsigned
arithmetic wraps as XLA's does), and what the step uses of them (a dropout mask) goes to
salusd with each batch, as feeds. The seed stays on the client and advances as the step
advances it: the masks are, bit for bit, those TensorFlow draws for the same seed.

:func:`find_draws` splits a module's entry computation; :meth:`Draws.draw` runs the
random part for one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import LoweringError
from .ops import DTYPES
from .parse import Computation, Instruction, Module, int_list

NUMPY = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s64": np.int64,
         "s32": np.int32, "s16": np.int16, "s8": np.int8, "u64": np.uint64, "u32": np.uint32,
         "u16": np.uint16, "u8": np.uint8, "pred": np.bool_}


@dataclass
class Draws:
    """The random part of a step: the instructions that depend on a seed (and otherwise
    on constants only), run for each step with :meth:`draw`.

    ``seeds``: parameter number -> the seed's name; ``fed``: the instructions whose
    values the rest of the step reads (each one feed, in this order); ``advances``: the
    seed's name -> the instruction of its new value (what the step returns for it);
    ``part``: every instruction of the random part."""

    module: Module
    seeds: dict[int, str]
    fed: list[str]
    advances: dict[str, str]
    part: frozenset[str]
    # The instructions each evaluation runs, in order, by computation and what it wants:
    # found on the first step, the same on every other.
    orders: dict[tuple[str, tuple[str, ...]], list[Instruction]] = field(
        default_factory=dict, repr=False, compare=False)

    def draw(self, seeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        """The fed values for one step from the seeds' values, and the seeds' next values."""
        entry = self.module.entry_computation
        args: dict[int, Any] = {}
        for i in entry.parameters():
            if int(i.literal) in self.seeds:
                value = np.asarray(seeds[self.seeds[int(i.literal)]])
                args[int(i.literal)] = value.astype(_dtype(i)).reshape(i.shape.dims)
        values = self._evaluate(entry, args, self.fed + list(self.advances.values()))
        return ([values[n] for n in self.fed],
                {seed: values[n] for seed, n in self.advances.items()})

    def _evaluate(self, computation: Computation, args: dict[int, Any],
                  wanted: list[str]) -> dict[str, Any]:
        """The values of ``wanted`` instructions of ``computation`` (and of what they
        need) for parameter values ``args``, by XLA's definitions over numpy."""
        key = (computation.name, tuple(wanted))
        if key not in self.orders:
            needed = computation.needed(wanted)
            self.orders[key] = [i for i in computation.instructions if i.name in needed]
        values: dict[str, Any] = {}
        for i in self.orders[key]:
            operands = [values[o] for o in i.operands]
            if i.opcode == "parameter":
                values[i.name] = args[int(i.literal)]
            elif i.opcode == "call":
                values[i.name] = self._call(i.attributes["to_apply"], operands)
            elif i.opcode == "while":
                state = operands[0]
                while self._call(i.attributes["condition"], [state]):
                    state = self._call(i.attributes["body"], [state])
                values[i.name] = state
            elif i.annotates:
                values[i.name] = operands[0]
            elif i.opcode in RULES:
                values[i.name] = RULES[i.opcode](i, operands)
            else:
                raise LoweringError(f"HLO {i.opcode} {i.name} ({i.source or 'no source'}): "
                                    "salus cannot draw this random number on the client")
        return values

    def _call(self, name: str, operands: list[Any]) -> Any:
        callee = self.module.computations[name.lstrip("%")]
        return self._evaluate(callee, dict(enumerate(operands)), [callee.root])[callee.root]


def find_draws(module: Module, seeds: dict[int, str], updates: dict[int, str]
               ) -> Draws | None:
    """The random part of ``module``'s entry computation, given which parameters are
    seeds (number -> name) and which element of the result is which input's new value
    (index -> name); None when the step reads no value computed from a seed.

    An instruction is *seeded* when some operand is seeded (a seed parameter is) and the
    others are constants; the step is fed each seeded value that an instruction outside
    the random part reads. The entry's result may return seeded values only as the
    seeds' new values, and a seed's new value must be seeded."""
    entry = module.entry_computation
    by_name = entry.by_name()
    kind: dict[str, str] = {}
    for i in entry.instructions:
        if i.opcode == "parameter":
            kind[i.name] = "seeded" if int(i.literal) in seeds else "computed"
        elif i.opcode in ("constant", "iota"):
            kind[i.name] = "constant"
        else:
            kinds = {kind[o] for o in i.operands}
            kind[i.name] = ("computed" if "computed" in kinds
                            else "seeded" if "seeded" in kinds else "constant")
    root = by_name[entry.root]
    results = root.operands if root.opcode == "tuple" else [root.name]
    def smallest(name: str) -> str:
        # A broadcast, reshape or conversion of a random value runs in the graph: the
        # value before it is fed (a per-example mask, not one per element; bools, not
        # floats).
        i = by_name[name]
        while (i.opcode in _EXPANDING and kind[i.operands[0]] == "seeded"
               and by_name[i.operands[0]].shape.dtype in DTYPES):
            i = by_name[i.operands[0]]
        return i.name

    fed: list[str] = []
    for i in entry.instructions:
        if kind[i.name] != "computed" or i is root:
            continue
        for o in i.operands:
            if kind[o] == "seeded" and smallest(o) not in fed:
                fed.append(smallest(o))
    advances: dict[str, str] = {}
    seed_names = set(seeds.values())
    for index, name in enumerate(results):
        updated = updates.get(index)
        if kind[name] == "computed" and updated in seed_names:
            raise LoweringError(f"the step's new {updated} depends on the batch or the "
                                "parameters: salus keeps it on the client as a random seed, "
                                "which only the seeds themselves may advance")
        if kind[name] != "seeded":
            continue
        if updated not in seed_names:
            source = by_name[name].source or "no source"
            raise LoweringError(f"the step returns {name} ({source}), a random value that "
                                "is not a seed's next value: salus draws random numbers on "
                                "the client only for the step's own use")
        advances[updated] = name
    if not fed and not advances:
        return None
    part = frozenset(name for name, k in kind.items() if k == "seeded")
    return Draws(module, dict(seeds), fed, advances, part)


# Ops whose result the graph computes from a fed random value as cheaply as from the
# result itself.
_EXPANDING = ("broadcast", "reshape", "copy", "convert", "bitcast")


def _dtype(i: Instruction) -> Any:
    if i.shape.dtype not in NUMPY:
        raise LoweringError(f"HLO {i.opcode} {i.name}: element type {i.shape.dtype} is not "
                            "supported in random numbers")
    return NUMPY[i.shape.dtype]


# -- the ops, as XLA defines them, over numpy -------------------------------------------


def _constant(i: Instruction, _) -> np.ndarray:
    return np.array(i.literal_values(), dtype=_dtype(i)).reshape(i.shape.dims)


def _iota(i: Instruction, _) -> np.ndarray:
    dim = int(i.attributes["iota_dimension"])
    line = np.arange(i.shape.dims[dim])
    view = [1] * len(i.shape.dims)
    view[dim] = i.shape.dims[dim]
    return np.broadcast_to(line.reshape(view), i.shape.dims).astype(_dtype(i))


def _broadcast(i: Instruction, operands) -> np.ndarray:
    (x,) = operands
    dims = int_list(i.attributes.get("dimensions", "{}"))
    view = [1] * len(i.shape.dims)
    for source, target in enumerate(dims):
        view[target] = x.shape[source]
    return np.broadcast_to(x.reshape(view), i.shape.dims).copy()


def _slice(i: Instruction, operands) -> np.ndarray:
    (x,) = operands
    index = []
    for part in i.attributes["slice"].strip("{}").split(","):
        bounds = [int(b) for b in part.strip().strip("[]").split(":")]
        index.append(slice(bounds[0], bounds[1], bounds[2] if len(bounds) > 2 else 1))
    return x[tuple(index)]


def _bitcast_convert(i: Instruction, operands) -> np.ndarray:
    (x,) = operands
    dtype = _dtype(i)
    if np.dtype(dtype).itemsize != x.dtype.itemsize:
        raise LoweringError(f"HLO bitcast-convert {i.name} between types of different "
                            "widths is not supported in random numbers")
    return np.ascontiguousarray(x).view(dtype).reshape(i.shape.dims)


def _convert(i: Instruction, operands) -> np.ndarray:
    (x,) = operands
    dtype = _dtype(i)
    if np.issubdtype(dtype, np.integer) and x.dtype.kind == "f":
        raise LoweringError(f"HLO convert {i.name} of floats to integers is not supported "
                            "in random numbers")
    return x.astype(dtype)


def _shift(kind: str) -> Callable:
    def rule(i: Instruction, operands) -> np.ndarray:
        x, s = operands
        bits = x.dtype.itemsize * 8
        unsigned = x.view(np.dtype(f"u{x.dtype.itemsize}"))
        amount = s.astype(np.uint64) if s.dtype.kind == "u" else s.astype(np.int64)
        large = (amount >= bits) | (amount < 0)
        safe = np.where(large, 0, amount).astype(unsigned.dtype)
        if kind == "left":
            out = np.where(large, 0, unsigned << safe).astype(unsigned.dtype)
        elif kind == "right-logical":
            out = np.where(large, 0, unsigned >> safe).astype(unsigned.dtype)
        else:  # arithmetic: the sign fills in
            signed = x.view(np.dtype(f"i{x.dtype.itemsize}"))
            fill = np.where(signed < 0, -1, 0).astype(signed.dtype)
            out = np.where(large, fill, signed >> safe.astype(signed.dtype)).view(unsigned.dtype)
        return out.view(x.dtype)
    return rule


def _compare(i: Instruction, operands) -> np.ndarray:
    a, b = operands
    return {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}[i.attributes["direction"]](a, b)


def _divide(i: Instruction, operands) -> np.ndarray:
    a, b = operands
    if a.dtype.kind in "iu":  # XLA rounds toward zero
        q = np.abs(a.astype(np.int64)) // np.abs(b.astype(np.int64))
        return (np.sign(a.astype(np.int64)) * np.sign(b.astype(np.int64)) * q).astype(a.dtype)
    return (a / b).astype(a.dtype)


def _elementwise(f: Callable) -> Callable:
    def rule(i: Instruction, operands) -> np.ndarray:
        with np.errstate(over="ignore"):
            return np.asarray(f(*operands)).astype(_dtype(i))
    return rule


# -- XLA's rng-bit-generator, Philox 4x32 with 10 rounds -------------------------------

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))


def philox4x32(counter: list[np.ndarray], key: tuple[np.uint32, np.uint32]) -> list[np.ndarray]:
    """Philox 4x32-10 (Salmon et al., 2011) of the counters (four u32 words each, word 0
    least significant) under ``key``: four u32 words each."""
    c = [w.astype(np.uint32) for w in counter]
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    low = np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for round_ in range(10):
            if round_:
                k0, k1 = k0 + _PHILOX_W[0], k1 + _PHILOX_W[1]
            p0 = c[0].astype(np.uint64) * _PHILOX_M[0]
            p1 = c[2].astype(np.uint64) * _PHILOX_M[1]
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & low).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & low).astype(np.uint32)
            c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return c


def _rng_bit_generator(i: Instruction, operands) -> tuple[np.ndarray, np.ndarray]:
    """``(new state, bits)`` as XLA's Philox generator makes them: the state is the key
    (word 0) and a 128-bit counter (words 1 and 2, low first); block ``b`` of four words
    is Philox of ``counter + b``; the bits are the blocks' words in order; the counter
    advances by the number of blocks."""
    (state,) = operands
    algorithm = i.attributes.get("algorithm", "rng_default")
    if algorithm not in ("rng_philox", "rng_default"):
        raise LoweringError(f"HLO rng-bit-generator {i.name}: algorithm {algorithm} is not "
                            "supported (Philox is)")
    state_shape, bits_shape = i.shape.elements
    if state.dtype != np.uint64 or state.shape[0] < 2:
        raise LoweringError(f"HLO rng-bit-generator {i.name}: the state must be u64[2] or "
                            "u64[3]")
    bits_dtype = np.dtype(NUMPY[bits_shape.dtype])
    words_per = bits_dtype.itemsize // 4
    if bits_dtype.itemsize not in (4, 8):
        raise LoweringError(f"HLO rng-bit-generator {i.name}: {bits_shape.dtype} bits are "
                            "not supported (32- and 64-bit ones are)")
    count = math.prod(bits_shape.dims) * words_per
    blocks = -(-count // 4)
    key = int(state[0])
    low = int(state[1])
    high = int(state[2]) if state.shape[0] > 2 else 0
    start = (high << 64) | low
    counters = [(start + b) % (1 << 128) for b in range(blocks)]
    words = [np.array([(c >> (32 * w)) & 0xFFFFFFFF for c in counters], dtype=np.uint32)
             for w in range(4)]
    out = philox4x32(words, (np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)))
    bits = np.stack(out, axis=1).reshape(-1)[:count]
    if words_per == 2:
        bits = (bits[0::2].astype(np.uint64) | (bits[1::2].astype(np.uint64) << np.uint64(32)))
    after = (start + blocks) % (1 << 128)
    new_state = state.copy()
    new_state[1] = np.uint64(after & ((1 << 64) - 1))
    if state.shape[0] > 2:
        new_state[2] = np.uint64(after >> 64)
    return new_state.reshape(state_shape.dims), bits.view(bits_dtype).reshape(bits_shape.dims)


RULES: dict[str, Callable] = {
    "constant": _constant,
    "iota": _iota,
    "broadcast": _broadcast,
    "reshape": lambda i, o: o[0].reshape(i.shape.dims),
    "bitcast": lambda i, o: o[0].reshape(i.shape.dims),
    "transpose": lambda i, o: np.transpose(o[0], int_list(i.attributes["dimensions"])).copy(),
    "copy": lambda i, o: o[0],
    "slice": _slice,
    "concatenate": lambda i, o: np.concatenate(o, axis=int_list(i.attributes["dimensions"])[0]),
    "tuple": lambda i, o: tuple(o),
    "get-tuple-element": lambda i, o: o[0][int(i.attributes["index"])],
    "convert": _convert,
    "bitcast-convert": _bitcast_convert,
    "add": _elementwise(np.add),
    "subtract": _elementwise(np.subtract),
    "multiply": _elementwise(np.multiply),
    "divide": _divide,
    "remainder": _elementwise(np.fmod),
    "maximum": _elementwise(np.maximum),
    "minimum": _elementwise(np.minimum),
    "negate": _elementwise(np.negative),
    "abs": _elementwise(np.abs),
    "and": _elementwise(np.bitwise_and),
    "or": _elementwise(np.bitwise_or),
    "xor": _elementwise(np.bitwise_xor),
    "not": _elementwise(lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)),
    "shift-left": _shift("left"),
    "shift-right-logical": _shift("right-logical"),
    "shift-right-arithmetic": _shift("right-arithmetic"),
    "compare": _compare,
    "select": lambda i, o: np.where(o[0], o[1], o[2]).astype(_dtype(i)),
    "clamp": lambda i, o: np.clip(o[1], o[0], o[2]).astype(_dtype(i)),
    "rng-bit-generator": _rng_bit_generator,
}

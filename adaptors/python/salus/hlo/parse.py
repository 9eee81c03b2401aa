"""Reading XLA's HLO text (``HloModule ...``) into plain Python objects.

Both TensorFlow (``tf.function(jit_compile=True).experimental_get_compiler_ir(...)(
stage="hlo")``) and JAX (``jax.jit(f).lower(...).as_text(dialect="hlo")``) print a
module in this form, with small differences the reader accepts either way: names with
or without ``%``, operands with or without their types, entry parameters listed in the
computation's header or not.

A module is computations; a computation is instructions in the order printed (operands
come before their users), one marked ``ROOT``. An instruction keeps its attributes as the
text after ``name=`` (``window={size=3x3 stride=2x2}``, ``dimensions={0,1}``); the
interpreter reads the ones its op needs with the helpers here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Collection, Sequence

from ..errors import LoweringError


@dataclass(frozen=True)
class Shape:
    """An array shape (``dtype`` as HLO spells it: f32, bf16, s64, pred, ...) or a tuple
    of shapes (``dtype == "tuple"``)."""

    dtype: str
    dims: tuple[int, ...] = ()
    elements: tuple["Shape", ...] = ()
    # Some dimension is only bounded (``<=N``, its bound in ``dims``): known at run time.
    dynamic: bool = False

    def __str__(self) -> str:
        if self.dtype == "tuple":
            return "(" + ", ".join(map(str, self.elements)) + ")"
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclass
class Instruction:
    name: str
    shape: Shape
    opcode: str
    operands: list[str]
    # The argument text of ops whose value sits between the parentheses (constant).
    literal: str
    attributes: dict[str, str]
    # Where the framework says it came from (TensorFlow's op name, JAX's source line).
    source: str = ""
    # JAX's stack frame (a debug section of the module), 0 for none.
    frame: int = 0

    @property
    def annotates(self) -> bool:
        """A custom call that only annotates its operand (JAX's sharding of a PRNG key):
        its value is the operand's."""
        return (self.opcode == "custom-call" and len(self.operands) == 1
                and self.attributes.get("custom_call_target", "").strip('"') == "Sharding")

    def literal_values(self) -> list[int | float | bool]:
        """A constant's elements in row-major order (one printed value stands for all)."""
        if "..." in self.literal:
            raise LoweringError(f"constant {self.name} was printed elided ({{...}}); print "
                                "the module with large constants")
        words = self.literal.replace("{", " ").replace("}", " ").replace(",", " ").split()
        values = [_number(w) for w in words]
        count = math.prod(self.shape.dims)
        if len(values) == 1 and count != 1:
            values = values * count
        if len(values) != count:
            raise LoweringError(f"constant {self.name} has {len(values)} values for "
                                f"{self.shape}")
        return values


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)
    root: str = ""

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    def parameters(self) -> list[Instruction]:
        """The parameters in their number order."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: int(i.literal))

    def needed(self, roots: Sequence[str], given: Collection[str] = ()) -> set[str]:
        """The instructions ``roots`` depend on, themselves included; the operands of
        ``given`` ones (known already) are not."""
        by_name = self.by_name()
        needed, todo = set(), list(roots)
        while todo:
            name = todo.pop()
            if name in needed:
                continue
            needed.add(name)
            if name not in given:
                todo.extend(by_name[name].operands)
        return needed


@dataclass
class Module:
    name: str
    computations: dict[str, Computation]
    entry: str
    # Result element -> the entry parameter it may alias (``input_output_alias``): how
    # TensorFlow marks a variable's new value.
    aliases: dict[int, int] = field(default_factory=dict)

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_SECTION = re.compile(r"^[A-Z]\w*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"^([a-z]+[0-9]*)\[([^\]]*)\](\{[^}]*\})?$")


def parse_module(text: str) -> Module:
    """The module printed in ``text``; raises :class:`LoweringError` naming the line it
    cannot read."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("HloModule"):
        raise LoweringError("not an HLO module: the text does not start with 'HloModule'")
    module_name = lines[0].split()[1].rstrip(",")
    aliases = {int(out): int(param) for out, param in
               re.findall(r"\{(\d+)\}:\s*\((\d+),", lines[0].split("entry_computation")[0])}
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    # Debug sections (JAX's FileNames, FileLocations, StackFrames...): id -> text.
    sections: dict[str, dict[int, str]] = {}
    section: str | None = None
    for number, line in enumerate(lines[1:], start=2):
        stripped = _COMMENT.sub("", line).strip()
        if not stripped:
            section = None
            continue
        if stripped.startswith("//"):
            continue
        if section is not None:
            key, _, value = stripped.partition(" ")
            sections[section][int(key)] = value
            continue
        if current is None and _SECTION.match(stripped):
            section = stripped
            sections[section] = {}
            continue
        if current is None:
            header = _HEADER.match(stripped)
            if header is None:
                raise LoweringError(f"HLO line {number}: expected a computation, got "
                                    f"{stripped[:120]!r}")
            current = Computation(header.group(2))
            if header.group(1):
                entry = current.name
            continue
        if stripped == "}":
            computations[current.name] = current
            current = None
            continue
        try:
            instruction, root = _instruction(stripped)
        except (ValueError, IndexError) as error:
            raise LoweringError(f"HLO line {number}: cannot read {stripped[:160]!r}: "
                                f"{error}") from None
        current.instructions.append(instruction)
        if root:
            current.root = instruction.name
    if not entry:
        raise LoweringError("the HLO module has no ENTRY computation")
    for computation in computations.values():
        if not computation.root and computation.instructions:
            computation.root = computation.instructions[-1].name
    if "StackFrames" in sections:
        _resolve_frames(computations.values(), sections)
    return Module(module_name, computations, entry, aliases)


def _resolve_frames(computations, sections: dict[str, dict[int, str]]) -> None:
    """Adds ``file:line`` to the source of each instruction that names a stack frame."""
    def fields(text: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=([^\s}]+)", text))
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    places = {k: fields(v) for k, v in sections.get("FileLocations", {}).items()}
    frames = {k: fields(v) for k, v in sections["StackFrames"].items()}
    for computation in computations:
        for i in computation.instructions:
            frame = frames.get(i.frame)
            place = places.get(int(frame["file_location_id"])) if frame else None
            if place is None:
                continue
            where = f"{files.get(int(place['file_name_id']), '?')}:{place.get('line', '?')}"
            i.source = f"{i.source} ({where})" if i.source else where


def _instruction(line: str) -> tuple[Instruction, bool]:
    root = line.startswith("ROOT ")
    if root:
        line = line[5:].lstrip()
    name, _, rest = line.partition("=")
    name = name.strip().lstrip("%")
    rest = rest.lstrip()
    type_end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape = parse_shape(rest[:type_end])
    rest = rest[type_end:].lstrip()
    open_at = rest.index("(")
    opcode = rest[:open_at]
    close_at = _closing(rest, open_at)
    inside = rest[open_at + 1:close_at]
    attributes = {}
    for item in split_top(rest[close_at + 1:].lstrip(", ")):
        key, _, value = item.partition("=")
        attributes[key.strip()] = value.strip()
    literal = inside if opcode in ("constant", "parameter", "iota") else ""
    operands = [] if literal or not inside.strip() else [
        operand.split()[-1].lstrip("%") for operand in split_top(inside)]
    metadata = attributes.pop("metadata", "")
    frame = re.search(r"stack_frame_id=(\d+)", metadata)
    return Instruction(name, shape, opcode, operands, literal.strip(), attributes,
                       _source(metadata), int(frame.group(1)) if frame else 0), root


def _source(metadata: str) -> str:
    parts = dict(re.findall(r'(\w+)="([^"]*)"', metadata))
    where = parts.get("op_name", "")
    if "source_file" in parts:
        place = f"{parts['source_file']}:{parts.get('source_line', '?')}"
        where = f"{where} ({place})" if where else place
    return where


def parse_shape(text: str) -> Shape:
    text = text.strip()
    if text.startswith("("):
        inner = text[1:_closing(text, 0)]
        return Shape("tuple", (), tuple(parse_shape(p) for p in split_top(inner)))
    array = _ARRAY.match(text)
    if array is None:
        raise ValueError(f"not a shape: {text!r}")
    dims = array.group(2).strip()
    if "?" in dims:
        raise ValueError(f"unbounded dynamic shapes are not supported: {text!r}")
    sizes = tuple(int(d.replace("<=", "")) for d in dims.split(",")) if dims else ()
    return Shape(array.group(1), sizes, dynamic="<=" in dims)


def _unquoted(text: str, start: int = 0):
    """``(index, character, bracket depth after it)`` of each character of ``text`` from
    ``start`` that is outside double quotes."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"':
            quoted = not quoted
            continue
        if quoted:
            continue
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        yield i, c, depth


def _closing(text: str, at: int) -> int:
    """The index of the bracket closing the one at ``at``."""
    for i, c, depth in _unquoted(text, at):
        if c in ")}]" and depth == 0:
            return i
    raise ValueError(f"unbalanced brackets in {text[at:at + 80]!r}")


def split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, start = [], 0
    for i, c, depth in _unquoted(text):
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def int_list(text: str) -> list[int]:
    """``{0,2,1}`` -> ``[0, 2, 1]``."""
    inner = text.strip().strip("{}").strip()
    return [int(v) for v in inner.split(",")] if inner else []


@dataclass(frozen=True)
class WindowDim:
    size: int = 1
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    lhs_dilate: int = 1
    rhs_dilate: int = 1
    reversal: bool = False


def window(text: str, rank: int) -> list[WindowDim]:
    """``{size=3x3 stride=2x2 pad=0_1x0_1 lhs_dilate=2x2}`` -> one :class:`WindowDim` per
    spatial dimension (``rank`` of them; an empty window is all ones)."""
    fields: dict[str, list[str]] = {}
    for item in text.strip().strip("{}").split():
        key, _, value = item.partition("=")
        fields[key] = value.split("x")
    dims = []
    for d in range(rank):
        pad = fields.get("pad", ["0_0"] * rank)[d].split("_")
        dims.append(WindowDim(
            size=int(fields.get("size", ["1"] * rank)[d]),
            stride=int(fields.get("stride", ["1"] * rank)[d]),
            pad_lo=int(pad[0]), pad_hi=int(pad[1]),
            lhs_dilate=int(fields.get("lhs_dilate", ["1"] * rank)[d]),
            rhs_dilate=int(fields.get("rhs_dilate", ["1"] * rank)[d]),
            reversal=fields.get("rhs_reversal", ["0"] * rank)[d] == "1"))
    return dims


def _number(word: str) -> int | float | bool:
    lowered = word.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("inf", "+inf", "-inf", "nan", "-nan"):
        return float(lowered.replace("+", ""))
    return int(word) if re.fullmatch(r"[-+]?\d+", word) else float(word)

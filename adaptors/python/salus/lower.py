"""Lowering a traced FX graph to the salus graph IR (``salus.v1.Graph``).

This module owns the mapping from Core ATen FX nodes to IR nodes described in
``docs/ir.md``. It is driven by each op's ATen schema, not by a per-op table:

- ``Tensor`` arguments become node inputs in schema order; ``Tensor?`` given ``None`` is
  ``-1``; ``Tensor[]``/``Tensor?[]`` are flattened in place with ``"<arg>.len"`` recorded;
- every other argument becomes an attribute named as in the schema (int, float, bool,
  Scalar, int/float/bool lists, ScalarType, str); ``None`` is left out, and so are
  ``layout``, ``device``, ``pin_memory`` and ``memory_format``; defaults the trace left
  implicit are written out, so a node carries its full argument list;
- tensor results become outputs in schema order (``getitem`` nodes pick them); ``-1``
  marks a result nothing uses.

A Python number where the schema has a Tensor (``x + 1`` is recorded as
``add.Tensor(x, 1)``) is a "wrapped number" in PyTorch. When the op has a ``.Scalar`` /
``.Tensor_Scalar`` overload in the IR taking the number in that position, the node uses
it (``add.Scalar(x, 1)``: identical semantics). Otherwise the number becomes a 0-dim
constant tensor whose dtype is the one PyTorch computes the op in (the number cast to the
promoted dtype, f32 for a float number next to half-precision tensors), so ordinary type
promotion gives PyTorch's result.

``clone`` nodes are not emitted: without mutation or memory layouts a clone is its
input, so uses of its result read the input (and a buffer the step only clones gets no
update).

Tensors captured by the trace (``get_attr``) become constants with their raw
little-endian bytes. Every op must be an aten op listed in ``proto/salus/v1/ops.txt``
(Core ATen, plus the few others the IR defines, such as ``bernoulli.p``); all offenders
of a graph are reported at once in one :class:`~salus.errors.UnsupportedOpError`.
"""

from __future__ import annotations

import functools
import operator
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .errors import LoweringError, MissingOp, TraceError, UnsupportedOpError
from .v1 import graph_pb2 as pb

if TYPE_CHECKING:
    from .trace import TracedStep

# Where salus.trace records the Scope (module path, type, backward or not) of each node.
MODULE_META = "salus_module"

REPO_ROOT = Path(__file__).resolve().parents[3]
# The source tree's op list, else the copy installed with the package (salus._codegen).
_SOURCE_OPS_TXT = REPO_ROOT / "proto" / "salus" / "v1" / "ops.txt"
OPS_TXT = (_SOURCE_OPS_TXT if _SOURCE_OPS_TXT.exists()
           else Path(__file__).resolve().parent / "v1" / "ops.txt")

DTYPES = {
    torch.float32: pb.DTYPE_F32,
    torch.float16: pb.DTYPE_F16,
    torch.bfloat16: pb.DTYPE_BF16,
    torch.int64: pb.DTYPE_I64,
    torch.int32: pb.DTYPE_I32,
    torch.bool: pb.DTYPE_BOOL,
}
# Little-endian numpy views used to serialise constants (bf16 travels as its raw bits).
_NUMPY_VIEW = {
    torch.float32: (torch.float32, "<f4"),
    torch.float16: (torch.float16, "<f2"),
    torch.bfloat16: (torch.int16, "<i2"),
    torch.int64: (torch.int64, "<i8"),
    torch.int32: (torch.int32, "<i4"),
    torch.bool: (torch.bool, "|b1"),
}
ROLES = {"parameter": pb.TENSOR_ROLE_PARAMETER, "state": pb.TENSOR_ROLE_STATE,
         "feed": pb.TENSOR_ROLE_FEED}
# Arguments that do not change what a salus device computes.
DROPPED_ARGUMENTS = {"layout", "device", "pin_memory", "memory_format"}
# Overloads taking a Python number where the .Tensor overload takes a tensor.
_SCALAR_TWIN = {"add.Tensor": "add.Scalar", "mul.Tensor": "mul.Scalar",
                "div.Tensor": "div.Scalar", "eq.Tensor": "eq.Scalar",
                "ne.Tensor": "ne.Scalar", "lt.Tensor": "lt.Scalar",
                "le.Tensor": "le.Scalar", "gt.Tensor": "gt.Scalar",
                "ge.Tensor": "ge.Scalar", "pow.Tensor_Tensor": "pow.Tensor_Scalar"}


@functools.cache
def supported_ops(path: Path = OPS_TXT) -> frozenset[str]:
    """The op set of the IR, read from ``proto/salus/v1/ops.txt``."""
    if not path.exists():
        raise LoweringError(f"the IR's op list {path} is missing (reinstall the salus "
                            "package: pip install adaptors/python)")
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line)


def op_name(target: Any) -> str:
    """The IR name of an FX target: ``aten.add.Tensor`` -> ``add.Tensor``,
    ``aten.neg.default`` -> ``neg``; other namespaces keep theirs (``prims.sum``)."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name.split("::", 1)
        namespace, base = packet if len(packet) == 2 else ("aten", packet[0])
        name = base if target._overloadname == "default" else f"{base}.{target._overloadname}"
        return name if namespace == "aten" else f"{namespace}.{name}"
    return getattr(target, "__name__", repr(target))


# ---------------------------------------------------------------------------------------
# Node descriptions for error messages


def node_source(node: torch.fx.Node) -> str:
    """Module path (and type) plus the last user source line the node came from."""
    scope = node.meta.get(MODULE_META)
    module = ""
    if scope is not None and scope.type_name:
        phase = ", backward" if scope.backward else ""
        module = f"{scope.path or '<model>'} ({scope.type_name}{phase})"
    line = _user_line(node.meta.get("stack_trace") or "")
    return " at ".join(part for part in (module, line) if part)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


_TRACER_FILE = str(Path(__file__).resolve().with_name("trace.py"))


@functools.cache
def _is_library(file: str) -> bool:
    path = str(Path(file).resolve())
    return path.startswith(_TORCH_DIR) or path == _TRACER_FILE


def _user_line(stack_trace: str) -> str:
    """``file:line`` of the innermost frame outside PyTorch and the tracer ("" if none:
    the module path then says enough)."""
    user = [f for f in _FRAME.findall(stack_trace) if not _is_library(f[0])]
    if not user:
        return ""
    file, line = user[-1]
    return f"{file}:{line}"


def _describe_value(value: Any) -> str:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "[" + ", ".join(_describe_value(v) for v in val) + "]"
    return repr(val)


def _tensor_inputs(node: torch.fx.Node) -> tuple[str, ...]:
    return tuple(_describe_value(a) for a in node.args
                 if isinstance(a, torch.fx.Node)
                 or (isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a)))


def _where(node: torch.fx.Node) -> str:
    op = op_name(node.target) if node.op == "call_function" else node.op
    source = node_source(node)
    return f"node {node.name} ({op}{', ' + source if source else ''})"


# ---------------------------------------------------------------------------------------
# Checking the op set


def _ir_op(node: torch.fx.Node) -> tuple[str, torch._ops.OpOverload | None]:
    """The op a call_function node becomes (after choosing a .Scalar twin)."""
    target = node.target
    name = op_name(target)
    twin = _SCALAR_TWIN.get(name)
    if twin and len(node.args) >= 2 and _is_number(node.args[1]) and not _is_number(node.args[0]):
        packet, overload = twin.split(".")
        return twin, getattr(getattr(torch.ops.aten, packet), overload)
    return name, target if isinstance(target, torch._ops.OpOverload) else None


#: Tensor arguments PyTorch passes undefined (None) though its schema says ``Tensor``:
#: attention's backward without a bias. The IR reads them as absent inputs.
_UNDEFINED = {("_scaled_dot_product_efficient_attention_backward", "attn_bias")}

#: The IR's ops that draw from the session's generator (its state their last input).
RANDOM_OPS = ("bernoulli.p", "rand_like", "_scaled_dot_product_efficient_attention")


def _unsupported_reason(name: str, target: Any) -> str | None:
    """Why the IR lacks this op (None when it has it). ops.txt is the authority: it
    lists Core ATen ops plus a few non-core ones the IR defines (``bernoulli.p``,
    ``rand_like``)."""
    if not isinstance(target, torch._ops.OpOverload):
        return "not an ATen op"
    if target.namespace != "aten":
        return f"{target.namespace}.* ops are not Core ATen"
    if name in supported_ops():
        return None
    if torch.Tag.core not in target.tags:
        return "not a Core ATen op"
    return "Core ATen, but not in proto/salus/v1/ops.txt"


def _is_alias(node: torch.fx.Node) -> bool:
    """``clone`` is the identity in a graph without mutation and without memory layouts:
    the lowering lets its result stand for its input instead of emitting a node."""
    return node.op == "call_function" and node.target is torch.ops.aten.clone.default


def _emits_node(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is not operator.getitem
            and not _is_alias(node))


def graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The distinct ops the graph's nodes lower to, sorted."""
    return sorted({_ir_op(n)[0] for n in gm.graph.nodes if _emits_node(n)})


#: Ops whose result's shape is how many elements a mask selects: ``masked_select`` and
#: ``nonzero`` (``torch.where(mask)``, ``mask.nonzero()``).
_MASK_SHAPED = (torch.ops.aten.masked_select.default, torch.ops.aten.nonzero.default)


def _selects_by_mask(node: torch.fx.Node) -> bool:
    """An ``index.Tensor`` with a boolean index (``x[mask]``), a ``masked_select`` or a
    ``nonzero``: its shape depends on the mask's values."""
    if node.target in _MASK_SHAPED:
        return True
    if node.target is not torch.ops.aten.index.Tensor:
        return False
    return any(isinstance(i, torch.fx.Node)
               and getattr(i.meta.get("val"), "dtype", None) == torch.bool
               for i in node.args[1])


def check_ops(gm: torch.fx.GraphModule) -> None:
    """Raises :class:`TraceError` for a selection by a boolean mask, and
    :class:`UnsupportedOpError` listing every node whose op the IR lacks."""
    masked = [n for n in gm.graph.nodes if _selects_by_mask(n)]
    if masked:
        where = "; ".join(dict.fromkeys(filter(None, map(node_source, masked))))
        where = f", at {where}" if where else ""
        raise TraceError(
            "the step selects elements by a boolean mask (x[mask], masked_select or "
            f"nonzero{where}): what it "
            "selects depends on the mask's values, so the result has no fixed shape, and "
            "salus runs one fixed graph per batch shape (a mask the step captures as a "
            "constant is selected once, at trace time). Compute over every element and "
            "mask the result instead: the mean loss over the selected rows is "
            "F.cross_entropy(out, torch.where(mask, target, -100)) (its ignore_index), "
            "or, with reduction='none', (loss * mask).sum() / mask.sum()")
    missing = []
    for node in gm.graph.nodes:
        if not _emits_node(node):
            continue
        name, overload = _ir_op(node)
        reason = _unsupported_reason(name, overload if overload is not None else node.target)
        if reason:
            missing.append(MissingOp(name, node.name, node_source(node), _tensor_inputs(node),
                                     reason))
    if missing:
        raise UnsupportedOpError(missing)


# ---------------------------------------------------------------------------------------
# Values


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and not isinstance(value, torch.Tensor)


def _meta_tensor(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise LoweringError(f"{_where(node)} has no tensor metadata")
    return val


def _dtype(dtype: torch.dtype, context: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise LoweringError(f"{context}: dtype {str(dtype).replace('torch.', '')} is not in "
                            f"the IR (supported: {supported})") from None


def constant_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian, row-major bytes of a tensor of an IR dtype."""
    view_dtype, np_dtype = _NUMPY_VIEW[tensor.dtype]
    t = tensor.detach().to("cpu").contiguous()
    if view_dtype != t.dtype:
        t = t.view(view_dtype)
    return t.numpy().astype(np_dtype, copy=False).tobytes()


def _number_dtype(node: torch.fx.Node, number: Any) -> torch.dtype:
    """The dtype PyTorch computes ``number`` in next to the node's tensor arguments."""
    tensors = [a.meta["val"] for a in node.args
               if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    _, result = elementwise_dtypes(*tensors, number,
                                   type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    if isinstance(number, float) and result in (torch.float16, torch.bfloat16):
        return torch.float32
    return result


# ---------------------------------------------------------------------------------------
# The lowering


def _unwrap_optional(t):
    return t.getElementType() if isinstance(t, torch.OptionalType) else t


def _attribute(value: Any, arg: torch.Argument, context: str) -> pb.Attribute | None:
    """The IR attribute of a non-tensor argument; None when it is left out."""
    if value is None or arg.name in DROPPED_ARGUMENTS:
        return None
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return None
    if isinstance(value, torch.dtype):
        return pb.Attribute(dtype=_dtype(value, context))
    kind = _unwrap_optional(arg.type).kind()
    if kind in ("IntType", "SymIntType", "FloatType", "BoolType", "NumberType"):
        return _scalar_attribute(value, kind, context)
    if kind == "StringType":
        return pb.Attribute(string=str(value))
    if kind == "ListType" and isinstance(value, (list, tuple)):
        elem = _unwrap_optional(arg.type).getElementType().kind()
        if elem in ("IntType", "SymIntType"):
            return pb.Attribute(ints=pb.IntList(values=[int(v) for v in value]))
        if elem == "FloatType":
            return pb.Attribute(floats=pb.FloatList(values=[float(v) for v in value]))
        if elem == "BoolType":
            return pb.Attribute(bools=pb.BoolList(values=[bool(v) for v in value]))
    raise LoweringError(f"{context}: argument '{arg.name}' of type {arg.type} "
                        f"(value {value!r}) has no IR attribute form")


def _scalar_attribute(value: Any, kind: str, context: str) -> pb.Attribute:
    if isinstance(value, bool) or kind == "BoolType":
        return pb.Attribute(bool=bool(value))
    if kind in ("IntType", "SymIntType") or (kind == "NumberType" and isinstance(value, int)):
        return pb.Attribute(int=int(value))
    if isinstance(value, (int, float)):
        return pb.Attribute(float=float(value))
    raise LoweringError(f"{context}: cannot express {value!r} as a {kind} attribute")


def _tensor_kind(arg: torch.Argument) -> str | None:
    """"tensor", "optional", "list" or None for a non-tensor argument."""
    t = arg.type
    if isinstance(t, torch.TensorType):
        return "tensor"
    if isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.TensorType):
        return "optional"
    if isinstance(t, torch.ListType):
        elem = _unwrap_optional(t.getElementType())
        if isinstance(elem, torch.TensorType):
            return "list"
    return None


class _Lowering:
    """One lowering of one traced step; see the module docstring."""

    def __init__(self, traced: "TracedStep"):
        self.traced = traced
        self.gm = traced.graph_module
        self.graph = pb.Graph(version=1)
        self.graph.precision.CopyFrom(pb.Precision(**traced.precision))
        self.ids: dict[torch.fx.Node, int] = {}
        self.multi: dict[torch.fx.Node, dict[int, int]] = {}
        self.numbers: dict[tuple, int] = {}

    def run(self) -> pb.Graph:
        check_ops(self.gm)
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.traced.inputs):
            raise LoweringError("the graph's inputs do not match the traced step's slots")
        self.slot_of = dict(zip(placeholders, self.traced.inputs))
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                self._getitem(node)
            elif _is_alias(node):
                self.ids[node] = self.ids[node.args[0]]
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._output(node)
            else:
                raise LoweringError(f"{_where(node)}: FX node kind {node.op} is not supported")
        return self.graph

    # -- tensors ------------------------------------------------------------------------

    def _new_tensor(self, name: str, val: torch.Tensor, role: int, context: str,
                    data: bytes = b"") -> int:
        tid = len(self.graph.tensors)
        self.graph.tensors.append(pb.Tensor(
            id=tid, name=name, dtype=_dtype(val.dtype, context), shape=list(val.shape),
            role=role, data=data))
        return tid

    def _placeholder(self, node: torch.fx.Node) -> None:
        slot = self.slot_of[node]
        self.ids[node] = self._new_tensor(slot.name, _meta_tensor(node), ROLES[slot.role],
                                          f"{slot.role} {slot.name}")

    def _get_attr(self, node: torch.fx.Node) -> None:
        value = getattr(self.gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise LoweringError(f"{_where(node)}: captured attribute is not a tensor")
        context = f"constant {node.target} ({_where(node)})"
        _dtype(value.dtype, context)
        self.ids[node] = self._new_tensor(str(node.target), value, pb.TENSOR_ROLE_CONSTANT,
                                          context, constant_bytes(value))

    def _number(self, node: torch.fx.Node, number: Any) -> int:
        dtype = _number_dtype(node, number)
        key = (type(number), number, dtype)
        if key not in self.numbers:
            value = torch.tensor(number, dtype=dtype)
            self.numbers[key] = self._new_tensor(
                f"scalar.{number}", value, pb.TENSOR_ROLE_CONSTANT, _where(node),
                constant_bytes(value))
        return self.numbers[key]

    def _input_id(self, node: torch.fx.Node, value: Any, arg: torch.Argument) -> int:
        if value is None:
            return -1
        if isinstance(value, torch.fx.Node):
            if value not in self.ids:
                raise LoweringError(f"{_where(node)}: input {value.name} is not a tensor "
                                    "defined earlier")
            return self.ids[value]
        if _is_number(value):
            return self._number(node, value)
        raise LoweringError(f"{_where(node)}: argument '{arg.name}' = {value!r} is not a tensor")

    # -- nodes --------------------------------------------------------------------------

    def _call(self, node: torch.fx.Node) -> None:
        name, overload = _ir_op(node)
        schema = overload._schema
        context = _where(node)
        ir = pb.Node(name=node.name, op=name, source=node_source(node))
        for arg, value in _bind(node, schema):
            kind = _tensor_kind(arg)
            if kind in ("tensor", "optional"):
                if kind == "tensor" and value is None and (name, arg.name) not in _UNDEFINED:
                    raise LoweringError(f"{context}: required tensor '{arg.name}' is None")
                ir.inputs.append(self._input_id(node, value, arg))
            elif kind == "list":
                items = list(value or [])
                ir.inputs.extend(self._input_id(node, v, arg) for v in items)
                ir.attributes[f"{arg.name}.len"].CopyFrom(pb.Attribute(int=len(items)))
            else:
                attribute = _attribute(value, arg, context)
                if attribute is not None:
                    ir.attributes[arg.name].CopyFrom(attribute)
        if name in RANDOM_OPS:
            # Random draws come from the session's generator state (trace.GENERATOR).
            generator = [self.ids[p] for p, slot in self.slot_of.items()
                         if slot.group == "generator"]
            if not generator:
                raise LoweringError(f"{context}: draws random numbers but the step has no "
                                    "generator state (trace it with salus.trace_*)")
            ir.inputs.append(generator[0])
        ir.outputs.extend(self._results(node, schema))
        self.graph.nodes.append(ir)

    def _results(self, node: torch.fx.Node, schema: torch.FunctionSchema) -> list[int]:
        returns = schema.returns
        context = _where(node)
        if not returns:  # a check (_assert_async.msg): no results
            return []
        if len(returns) == 1 and isinstance(returns[0].type, torch.TensorType):
            tid = self._new_tensor(node.name, _meta_tensor(node), pb.TENSOR_ROLE_INTERMEDIATE,
                                   context)
            self.ids[node] = tid
            return [tid]
        vals = node.meta.get("val")
        if not all(isinstance(r.type, torch.TensorType) for r in returns):
            if not (len(returns) == 1 and _tensor_kind(returns[0]) == "list"):
                raise LoweringError(f"{context}: results {schema.returns} are not supported")
        if not isinstance(vals, (list, tuple)):
            raise LoweringError(f"{context}: has no metadata for its results")
        users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        outputs = []
        for index, val in enumerate(vals):
            user = users.get(index)
            if user is None:
                outputs.append(-1)
                continue
            tid = self._new_tensor(user.name, val, pb.TENSOR_ROLE_INTERMEDIATE, context)
            self.ids[user] = tid
            outputs.append(tid)
        return outputs

    def _getitem(self, node: torch.fx.Node) -> None:
        if node not in self.ids:
            raise LoweringError(f"{_where(node)}: getitem of a value that is not an op result")

    def _output(self, node: torch.fx.Node) -> None:
        values = list(node.args[0])
        if len(values) != len(self.traced.outputs):
            raise LoweringError("the graph's outputs do not match the traced step's slots")
        slot_ids = {slot.name: self.ids[p] for p, slot in self.slot_of.items()}
        for slot, value in zip(self.traced.outputs, values):
            if not isinstance(value, torch.fx.Node) or value not in self.ids:
                raise LoweringError(f"output {slot.name} is not a tensor of the graph")
            vid = self.ids[value]
            if slot.kind == "update":
                self._update(slot.name, slot_ids[slot.name], vid)
            else:
                tensor = self.graph.tensors[vid]
                if tensor.role == pb.TENSOR_ROLE_INTERMEDIATE:
                    tensor.name = slot.name
                self.graph.fetches.append(vid)

    def _update(self, name: str, target: int, value: int) -> None:
        if target == value:
            return
        t, v = self.graph.tensors[target], self.graph.tensors[value]
        if list(t.shape) != list(v.shape) or t.dtype != v.dtype:
            raise LoweringError(
                f"the new value of {name} ({pb.DType.Name(v.dtype)}{list(v.shape)}) does "
                f"not match it ({pb.DType.Name(t.dtype)}{list(t.shape)})")
        self.graph.updates.append(pb.Update(target=target, value=value))


def _bind(node: torch.fx.Node, schema: torch.FunctionSchema):
    """(argument, value) for every schema argument, defaults filled in."""
    args, kwargs = node.args, node.kwargs
    for index, arg in enumerate(schema.arguments):
        if index < len(args) and not arg.kwarg_only:
            value = args[index]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            raise LoweringError(f"{_where(node)}: argument '{arg.name}' is missing")
        yield arg, value


def lower(traced: "TracedStep") -> pb.Graph:
    """The ``salus.v1.Graph`` of a traced step (see the module docstring)."""
    return _Lowering(traced).run()

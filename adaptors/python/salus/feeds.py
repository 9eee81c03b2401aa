"""How a session's tensors travel: their layout in the graph (names, feeds, fetches),
their bytes on the wire, and feed buffers (a file shared with salusd on its Unix socket,
cut into slots of one iteration's feeds and fetches, so that a batch costs one copy)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .client import FeedBuffer, Session
from .errors import BatchError
from .lower import DTYPES, constant_bytes
from .trace import TracedStep
from .v1 import graph_pb2 as pb

_TORCH_DTYPE = {code: dtype for dtype, code in DTYPES.items()}
# How bytes of each IR dtype are read (bf16 as its raw 16 bits).
_NUMPY = {pb.DTYPE_F32: "<f4", pb.DTYPE_F16: "<f2", pb.DTYPE_BF16: "<i2",
          pb.DTYPE_I64: "<i8", pb.DTYPE_I32: "<i4", pb.DTYPE_BOOL: "|b1"}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as salus sends them: little-endian, row-major, no padding."""
    return constant_bytes(tensor)


def tensor_from_bytes(data: bytes, dtype: int, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of IR ``dtype`` (``salus.v1.DType``) and ``shape`` whose bytes are
    ``data``."""
    array = np.frombuffer(data, dtype=_NUMPY[dtype]).copy()
    tensor = torch.from_numpy(array).reshape(tuple(shape))
    return tensor.view(torch.bfloat16) if dtype == pb.DTYPE_BF16 else tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class TensorSpec:
    id: int
    name: str
    dtype: int
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self.dtype]

    def describe(self) -> str:
        return f"{dtype_name(self.torch_dtype)}{list(self.shape)}"


class Layout:
    """Which tensor of the graph each name, feed and fetch is."""

    def __init__(self, graph: pb.Graph, traced: TracedStep):
        specs = {t.name: TensorSpec(t.id, t.name, t.dtype, tuple(t.shape))
                 for t in graph.tensors
                 if t.role in (pb.TENSOR_ROLE_PARAMETER, pb.TENSOR_ROLE_STATE,
                               pb.TENSOR_ROLE_FEED)}
        self.state = {n: specs[n] for n in traced.state_names}
        self.feeds = [specs[n] for n in traced.feed_names]
        self.by_id = {s.id: s for s in self.state.values()}
        self.fetches = [TensorSpec(t, graph.tensors[t].name, graph.tensors[t].dtype,
                                    tuple(graph.tensors[t].shape)) for t in graph.fetches]
        #: The structure of the fetched outputs (a training step's: those after the loss).
        self.output_spec = traced.output_spec

    def check(self, batch: Sequence[Any], what: str, count: int | None = None) -> None:
        """Raises :class:`BatchError` unless ``batch`` (the leaves) matches the feeds (the
        first ``count`` of them: those of the batch, without drawn random numbers)."""
        feeds = self.feeds if count is None else self.feeds[:count]
        if len(batch) != len(feeds):
            raise BatchError(f"{what} takes {len(feeds)} tensor(s), as the example it "
                             f"was traced with, but got {len(batch)}")
        for index, (spec, value) in enumerate(zip(feeds, batch)):
            if not isinstance(value, torch.Tensor):
                raise BatchError(f"{what}: batch element {index} is a "
                                 f"{type(value).__name__}, not a tensor")
            if tuple(value.shape) != spec.shape or value.dtype != spec.torch_dtype:
                got = f"{dtype_name(value.dtype)}{list(value.shape)}"
                raise BatchError(
                    f"{what}: batch element {index} is {got} but the session was traced "
                    f"with {spec.describe()}")

    def fetch_tensors(self, response) -> list[torch.Tensor]:
        return [tensor_from_bytes(data, spec.dtype, spec.shape)
                for spec, data in zip(self.fetches, response.fetches)]

    def feed_size(self) -> int:
        return sum(_nbytes(s) for s in self.feeds)


def _nbytes(spec: TensorSpec) -> int:
    n = torch.empty((), dtype=spec.torch_dtype).element_size()
    for d in spec.shape:
        n *= d
    return n


_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Placed:
    """Where one iteration's feeds and fetches lie in the feed buffer."""

    slot: int
    feed_ranges: list[tuple[int, int]]
    fetch_ranges: list[tuple[int, int]]


class Slots:
    """A session's feed buffer cut into ``count`` slots, each room for one iteration's
    feeds and fetches (of a program whose feeds and fetches fit ``slot_bytes``). Slots
    are used in turn: with up to ``count - 2`` iterations in flight, a slot is free again
    by the time it comes round."""

    def __init__(self, session: Session, slot_bytes: int, count: int):
        self.slot_bytes = _aligned(slot_bytes)
        self.count = count
        self.buffer: FeedBuffer = session.attach_buffer(self.slot_bytes * count)
        self._bytes = (torch.frombuffer(self.buffer.view, dtype=torch.uint8)
                       if self.buffer.size else torch.empty(0, dtype=torch.uint8))
        self._address = self._bytes.data_ptr()
        self._next = 0

    @staticmethod
    def room(layout: Layout) -> int:
        """Bytes of a slot for ``layout``'s feeds and fetches."""
        return sum(_aligned(_nbytes(s)) for s in (*layout.feeds, *layout.fetches))

    def fits(self, layout: Layout) -> bool:
        return self.room(layout) <= self.slot_bytes

    def put(self, layout: Layout, batch: Sequence[torch.Tensor]) -> Placed:
        """Copies ``batch`` (checked against ``layout``) into the next slot."""
        slot, self._next = self._next, (self._next + 1) % self.count
        at = slot * self.slot_bytes
        feeds, fetches = [], []
        for spec, value in zip(layout.feeds, batch):
            n = _nbytes(spec)
            if n:
                self._copy_in(at, n, spec, value)
            feeds.append((at, n))
            at += _aligned(n)
        for spec in layout.fetches:
            n = _nbytes(spec)
            fetches.append((at, n))
            at += _aligned(n)
        return Placed(slot, feeds, fetches)

    def fetch_tensors(self, layout: Layout, placed: Placed) -> list[torch.Tensor]:
        """The fetches salusd wrote into ``placed``'s slot (copies)."""
        fetched = []
        for spec, (at, n) in zip(layout.fetches, placed.fetch_ranges):
            tensor = torch.empty(spec.shape, dtype=spec.torch_dtype)
            if n:
                ctypes.memmove(tensor.data_ptr(), self._address + at, n)
            fetched.append(tensor)
        return fetched

    def _copy_in(self, at: int, n: int, spec: TensorSpec, value: torch.Tensor) -> None:
        # A contiguous tensor in host memory is one memmove on this thread. torch's
        # `copy_` runs a parallel loop for a large tensor, and its OpenMP threads then
        # spin for milliseconds: every iteration, a core taken from salusd and the other
        # jobs on this host (the offline ones among them, beside online work).
        if value.device.type == "cpu" and value.is_contiguous():
            ctypes.memmove(self._address + at, value.data_ptr(), n)
        else:
            self._view(at, spec).copy_(value)

    def _view(self, at: int, spec: TensorSpec) -> torch.Tensor:
        n = _nbytes(spec)
        return self._bytes[at:at + n].view(spec.torch_dtype).view(spec.shape)

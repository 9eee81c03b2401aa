from salus.v1 import graph_pb2 as _graph_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_KIND_UNSPECIFIED: _ClassVar[SessionKind]
    SESSION_KIND_TRAINING: _ClassVar[SessionKind]
    SESSION_KIND_INFERENCE: _ClassVar[SessionKind]

class SessionClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_CLASS_ONLINE: _ClassVar[SessionClass]
    SESSION_CLASS_OFFLINE: _ClassVar[SessionClass]
SESSION_KIND_UNSPECIFIED: SessionKind
SESSION_KIND_TRAINING: SessionKind
SESSION_KIND_INFERENCE: SessionKind
SESSION_CLASS_ONLINE: SessionClass
SESSION_CLASS_OFFLINE: SessionClass

class Hints(_message.Message):
    __slots__ = ("name", "priority", "total_iterations", "expected_iteration_ms", "slo_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ITERATION_MS_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    priority: int
    total_iterations: int
    expected_iteration_ms: float
    slo_ms: float
    def __init__(self, name: _Optional[str] = ..., priority: _Optional[int] = ..., total_iterations: _Optional[int] = ..., expected_iteration_ms: _Optional[float] = ..., slo_ms: _Optional[float] = ..., **kwargs) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("graph", "kind", "hints")
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    graph: _graph_pb2.Graph
    kind: SessionKind
    hints: Hints
    def __init__(self, graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ..., kind: _Optional[_Union[SessionKind, str]] = ..., hints: _Optional[_Union[Hints, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Reattach(_message.Message):
    __slots__ = ("session", "token")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    session: int
    token: bytes
    def __init__(self, session: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("open", "chunk", "commit", "reattach")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REATTACH_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    chunk: TensorChunk
    commit: Commit
    reattach: Reattach
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., reattach: _Optional[_Union[Reattach, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session", "persistent_bytes", "ephemeral_bytes", "token", "iterations")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    session: int
    persistent_bytes: int
    ephemeral_bytes: int
    token: bytes
    iterations: int
    def __init__(self, session: _Optional[int] = ..., persistent_bytes: _Optional[int] = ..., ephemeral_bytes: _Optional[int] = ..., token: _Optional[bytes] = ..., iterations: _Optional[int] = ...) -> None: ...

class SessionSnapshot(_message.Message):
    __slots__ = ("session", "owner_uid", "kind", "hints", "token", "iterations", "programs")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    session: int
    owner_uid: int
    kind: SessionKind
    hints: Hints
    token: bytes
    iterations: int
    programs: _containers.RepeatedCompositeFieldContainer[_graph_pb2.Graph]
    def __init__(self, session: _Optional[int] = ..., owner_uid: _Optional[int] = ..., kind: _Optional[_Union[SessionKind, str]] = ..., hints: _Optional[_Union[Hints, _Mapping]] = ..., token: _Optional[bytes] = ..., iterations: _Optional[int] = ..., programs: _Optional[_Iterable[_Union[_graph_pb2.Graph, _Mapping]]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("lane", "lane_bytes", "resumed")
    LANE_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    lane: int
    lane_bytes: int
    resumed: bool
    def __init__(self, lane: _Optional[int] = ..., lane_bytes: _Optional[int] = ..., resumed: _Optional[bool] = ...) -> None: ...

class Suspended(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("opened", "queued", "admitted", "suspended")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    queued: Queued
    admitted: Admitted
    suspended: Suspended
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., admitted: _Optional[_Union[Admitted, _Mapping]] = ..., suspended: _Optional[_Union[Suspended, _Mapping]] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("session", "feeds", "tag", "writes", "program", "feed_ranges", "fetch_ranges")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    FEED_RANGES_FIELD_NUMBER: _ClassVar[int]
    FETCH_RANGES_FIELD_NUMBER: _ClassVar[int]
    session: int
    feeds: _containers.RepeatedScalarFieldContainer[bytes]
    tag: int
    writes: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    program: int
    feed_ranges: _containers.RepeatedCompositeFieldContainer[BufferRange]
    fetch_ranges: _containers.RepeatedCompositeFieldContainer[BufferRange]
    def __init__(self, session: _Optional[int] = ..., feeds: _Optional[_Iterable[bytes]] = ..., tag: _Optional[int] = ..., writes: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., program: _Optional[int] = ..., feed_ranges: _Optional[_Iterable[_Union[BufferRange, _Mapping]]] = ..., fetch_ranges: _Optional[_Iterable[_Union[BufferRange, _Mapping]]] = ...) -> None: ...

class BufferRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class AttachBufferRequest(_message.Message):
    __slots__ = ("session", "path")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    session: int
    path: str
    def __init__(self, session: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class AttachBufferResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class AddProgramRequest(_message.Message):
    __slots__ = ("session", "graph")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    session: int
    graph: _graph_pb2.Graph
    def __init__(self, session: _Optional[int] = ..., graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ...) -> None: ...

class AddProgramResponse(_message.Message):
    __slots__ = ("program", "ephemeral_bytes")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    program: int
    ephemeral_bytes: int
    def __init__(self, program: _Optional[int] = ..., ephemeral_bytes: _Optional[int] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("tag", "fetches", "device_us", "wait_us", "failure")
    TAG_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_US_FIELD_NUMBER: _ClassVar[int]
    WAIT_US_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    tag: int
    fetches: _containers.RepeatedScalarFieldContainer[bytes]
    device_us: int
    wait_us: int
    failure: Failure
    def __init__(self, tag: _Optional[int] = ..., fetches: _Optional[_Iterable[bytes]] = ..., device_us: _Optional[int] = ..., wait_us: _Optional[int] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class ReadTensorsRequest(_message.Message):
    __slots__ = ("session", "tensors")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    session: int
    tensors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[int] = ..., tensors: _Optional[_Iterable[int]] = ...) -> None: ...

class WriteTensorsRequest(_message.Message):
    __slots__ = ("session", "chunk")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    session: int
    chunk: TensorChunk
    def __init__(self, session: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class WriteTensorsResponse(_message.Message):
    __slots__ = ("tensors_written",)
    TENSORS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    tensors_written: int
    def __init__(self, tensors_written: _Optional[int] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: int
    def __init__(self, session: _Optional[int] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("session", "scheduler", "variants", "decode", "default_slo_ms", "variant_feed")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FEED_FIELD_NUMBER: _ClassVar[int]
    session: int
    scheduler: str
    variants: _containers.RepeatedCompositeFieldContainer[ServedVariant]
    decode: Decode
    default_slo_ms: float
    variant_feed: int
    def __init__(self, session: _Optional[int] = ..., scheduler: _Optional[str] = ..., variants: _Optional[_Iterable[_Union[ServedVariant, _Mapping]]] = ..., decode: _Optional[_Union[Decode, _Mapping]] = ..., default_slo_ms: _Optional[float] = ..., variant_feed: _Optional[int] = ...) -> None: ...

class ServedVariant(_message.Message):
    __slots__ = ("name", "programs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    programs: _containers.RepeatedCompositeFieldContainer[BatchProgram]
    def __init__(self, name: _Optional[str] = ..., programs: _Optional[_Iterable[_Union[BatchProgram, _Mapping]]] = ...) -> None: ...

class BatchProgram(_message.Message):
    __slots__ = ("batch_size", "program")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    program: int
    def __init__(self, batch_size: _Optional[int] = ..., program: _Optional[int] = ...) -> None: ...

class Decode(_message.Message):
    __slots__ = ("carry", "done", "max_steps")
    CARRY_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    carry: _containers.RepeatedCompositeFieldContainer[Carry]
    done: int
    max_steps: int
    def __init__(self, carry: _Optional[_Iterable[_Union[Carry, _Mapping]]] = ..., done: _Optional[int] = ..., max_steps: _Optional[int] = ...) -> None: ...

class Carry(_message.Message):
    __slots__ = ("fetch", "feed")
    FETCH_FIELD_NUMBER: _ClassVar[int]
    FEED_FIELD_NUMBER: _ClassVar[int]
    fetch: int
    feed: int
    def __init__(self, fetch: _Optional[int] = ..., feed: _Optional[int] = ...) -> None: ...

class ServeResponse(_message.Message):
    __slots__ = ("calibration",)
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    calibration: _containers.RepeatedCompositeFieldContainer[ProgramTime]
    def __init__(self, calibration: _Optional[_Iterable[_Union[ProgramTime, _Mapping]]] = ...) -> None: ...

class ProgramTime(_message.Message):
    __slots__ = ("variant", "batch_size", "ms")
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    variant: int
    batch_size: int
    ms: float
    def __init__(self, variant: _Optional[int] = ..., batch_size: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("session", "feeds", "variant", "slo_ms", "app")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FEEDS_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    APP_FIELD_NUMBER: _ClassVar[int]
    session: int
    feeds: _containers.RepeatedScalarFieldContainer[bytes]
    variant: int
    slo_ms: float
    app: int
    def __init__(self, session: _Optional[int] = ..., feeds: _Optional[_Iterable[bytes]] = ..., variant: _Optional[int] = ..., slo_ms: _Optional[float] = ..., app: _Optional[int] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("fetches", "latency_us", "queue_us", "batch_size", "batch_requests", "batch_variant", "steps", "done", "met_deadline")
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_VARIANT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MET_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    fetches: _containers.RepeatedScalarFieldContainer[bytes]
    latency_us: int
    queue_us: int
    batch_size: int
    batch_requests: int
    batch_variant: int
    steps: int
    done: bool
    met_deadline: bool
    def __init__(self, fetches: _Optional[_Iterable[bytes]] = ..., latency_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_requests: _Optional[int] = ..., batch_variant: _Optional[int] = ..., steps: _Optional[int] = ..., done: _Optional[bool] = ..., met_deadline: _Optional[bool] = ...) -> None: ...

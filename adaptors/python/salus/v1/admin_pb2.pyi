from salus.v1 import session_pb2 as _session_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_PERSISTENT: _ClassVar[RegionKind]
    REGION_KIND_HOLE: _ClassVar[RegionKind]
    REGION_KIND_FREE: _ClassVar[RegionKind]
    REGION_KIND_LANE: _ClassVar[RegionKind]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_QUEUED: _ClassVar[SessionState]
    SESSION_STATE_ADMITTED: _ClassVar[SessionState]
    SESSION_STATE_SUSPENDED: _ClassVar[SessionState]
    SESSION_STATE_CLOSING: _ClassVar[SessionState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_OPENED: _ClassVar[EventKind]
    EVENT_KIND_QUEUED: _ClassVar[EventKind]
    EVENT_KIND_ADMITTED: _ClassVar[EventKind]
    EVENT_KIND_REJECTED: _ClassVar[EventKind]
    EVENT_KIND_ITERATION_STARTED: _ClassVar[EventKind]
    EVENT_KIND_ITERATION_FINISHED: _ClassVar[EventKind]
    EVENT_KIND_ITERATION_FAILED: _ClassVar[EventKind]
    EVENT_KIND_PREEMPTED: _ClassVar[EventKind]
    EVENT_KIND_LANE_MOVED: _ClassVar[EventKind]
    EVENT_KIND_CLOSED: _ClassVar[EventKind]
    EVENT_KIND_POLICY_CHANGED: _ClassVar[EventKind]
    EVENT_KIND_DRAINING: _ClassVar[EventKind]
    EVENT_KIND_PROTECTION: _ClassVar[EventKind]
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_PERSISTENT: RegionKind
REGION_KIND_HOLE: RegionKind
REGION_KIND_FREE: RegionKind
REGION_KIND_LANE: RegionKind
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_QUEUED: SessionState
SESSION_STATE_ADMITTED: SessionState
SESSION_STATE_SUSPENDED: SessionState
SESSION_STATE_CLOSING: SessionState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_OPENED: EventKind
EVENT_KIND_QUEUED: EventKind
EVENT_KIND_ADMITTED: EventKind
EVENT_KIND_REJECTED: EventKind
EVENT_KIND_ITERATION_STARTED: EventKind
EVENT_KIND_ITERATION_FINISHED: EventKind
EVENT_KIND_ITERATION_FAILED: EventKind
EVENT_KIND_PREEMPTED: EventKind
EVENT_KIND_LANE_MOVED: EventKind
EVENT_KIND_CLOSED: EventKind
EVENT_KIND_POLICY_CHANGED: EventKind
EVENT_KIND_DRAINING: EventKind
EVENT_KIND_PROTECTION: EventKind

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = ("name", "capacity", "reserve")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity: int
    reserve: int
    def __init__(self, name: _Optional[str] = ..., capacity: _Optional[int] = ..., reserve: _Optional[int] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("offset", "size", "kind", "session", "lane", "sessions")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    kind: RegionKind
    session: int
    lane: int
    sessions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., session: _Optional[int] = ..., lane: _Optional[int] = ..., sessions: _Optional[_Iterable[int]] = ...) -> None: ...

class MemoryMap(_message.Message):
    __slots__ = ("capacity", "reserve", "persistent_bytes", "lane_bytes", "available_bytes", "regions")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    reserve: int
    persistent_bytes: int
    lane_bytes: int
    available_bytes: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, capacity: _Optional[int] = ..., reserve: _Optional[int] = ..., persistent_bytes: _Optional[int] = ..., lane_bytes: _Optional[int] = ..., available_bytes: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class Lane(_message.Message):
    __slots__ = ("id", "size", "offset", "placed", "sessions", "running")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    id: int
    size: int
    offset: int
    placed: bool
    sessions: _containers.RepeatedScalarFieldContainer[int]
    running: int
    def __init__(self, id: _Optional[int] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., placed: _Optional[bool] = ..., sessions: _Optional[_Iterable[int]] = ..., running: _Optional[int] = ...) -> None: ...

class QueuedSession(_message.Message):
    __slots__ = ("session", "name", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: int
    name: str
    reason: str
    def __init__(self, session: _Optional[int] = ..., name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("host_memory", "user_host_memory", "max_sessions_per_user", "open_timeout_ms")
    HOST_MEMORY_FIELD_NUMBER: _ClassVar[int]
    USER_HOST_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_USER_FIELD_NUMBER: _ClassVar[int]
    OPEN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    host_memory: int
    user_host_memory: int
    max_sessions_per_user: int
    open_timeout_ms: int
    def __init__(self, host_memory: _Optional[int] = ..., user_host_memory: _Optional[int] = ..., max_sessions_per_user: _Optional[int] = ..., open_timeout_ms: _Optional[int] = ...) -> None: ...

class UserUsage(_message.Message):
    __slots__ = ("uid", "sessions", "opening", "opening_bytes", "host_bytes", "limited")
    UID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPENING_FIELD_NUMBER: _ClassVar[int]
    OPENING_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    uid: int
    sessions: int
    opening: int
    opening_bytes: int
    host_bytes: int
    limited: bool
    def __init__(self, uid: _Optional[int] = ..., sessions: _Optional[int] = ..., opening: _Optional[int] = ..., opening_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., limited: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("device", "policy", "draining", "memory", "lanes", "queue", "uptime_ms", "version", "limits", "host_bytes", "opening_sessions", "opening_bytes", "users", "protection")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPENING_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPENING_BYTES_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    PROTECTION_FIELD_NUMBER: _ClassVar[int]
    device: Device
    policy: str
    draining: bool
    memory: MemoryMap
    lanes: _containers.RepeatedCompositeFieldContainer[Lane]
    queue: _containers.RepeatedCompositeFieldContainer[QueuedSession]
    uptime_ms: int
    version: str
    limits: Limits
    host_bytes: int
    opening_sessions: int
    opening_bytes: int
    users: _containers.RepeatedCompositeFieldContainer[UserUsage]
    protection: Protection
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ..., policy: _Optional[str] = ..., draining: _Optional[bool] = ..., memory: _Optional[_Union[MemoryMap, _Mapping]] = ..., lanes: _Optional[_Iterable[_Union[Lane, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueuedSession, _Mapping]]] = ..., uptime_ms: _Optional[int] = ..., version: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., host_bytes: _Optional[int] = ..., opening_sessions: _Optional[int] = ..., opening_bytes: _Optional[int] = ..., users: _Optional[_Iterable[_Union[UserUsage, _Mapping]]] = ..., protection: _Optional[_Union[Protection, _Mapping]] = ...) -> None: ...

class Protection(_message.Message):
    __slots__ = ("enabled", "health", "offline_duty", "offline_bytes", "offline_limit", "offline_evictions", "overlimit_entries", "online_slowdown_p99", "slo_use_p99", "offline_held_ms", "offline_abandoned", "sm_activity", "clock_factor", "offline_compute_share", "offline_compute_share_learned")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_DUTY_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    OVERLIMIT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ONLINE_SLOWDOWN_P99_FIELD_NUMBER: _ClassVar[int]
    SLO_USE_P99_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_HELD_MS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_ABANDONED_FIELD_NUMBER: _ClassVar[int]
    SM_ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FACTOR_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_COMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_COMPUTE_SHARE_LEARNED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    health: str
    offline_duty: float
    offline_bytes: int
    offline_limit: int
    offline_evictions: int
    overlimit_entries: int
    online_slowdown_p99: float
    slo_use_p99: float
    offline_held_ms: float
    offline_abandoned: int
    sm_activity: float
    clock_factor: float
    offline_compute_share: float
    offline_compute_share_learned: bool
    def __init__(self, enabled: _Optional[bool] = ..., health: _Optional[str] = ..., offline_duty: _Optional[float] = ..., offline_bytes: _Optional[int] = ..., offline_limit: _Optional[int] = ..., offline_evictions: _Optional[int] = ..., overlimit_entries: _Optional[int] = ..., online_slowdown_p99: _Optional[float] = ..., slo_use_p99: _Optional[float] = ..., offline_held_ms: _Optional[float] = ..., offline_abandoned: _Optional[int] = ..., sm_activity: _Optional[float] = ..., clock_factor: _Optional[float] = ..., offline_compute_share: _Optional[float] = ..., offline_compute_share_learned: _Optional[bool] = ...) -> None: ...

class SetOfflineRequest(_message.Message):
    __slots__ = ("enable",)
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    def __init__(self, enable: _Optional[bool] = ...) -> None: ...

class SetOfflineResponse(_message.Message):
    __slots__ = ("health",)
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    health: str
    def __init__(self, health: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("id", "name", "owner_uid", "kind", "state", "reason", "lane", "persistent_bytes", "ephemeral_bytes", "priority", "total_iterations", "iterations", "pending", "mean_iteration_ms", "p99_iteration_ms", "queue_wait_ms", "attained_service_ms", "preemptions", "suspensions", "age_ms", "slo_ms", "serving")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITERATION_MS_FIELD_NUMBER: _ClassVar[int]
    P99_ITERATION_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ATTAINED_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SUSPENSIONS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    CLASS_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    owner_uid: int
    kind: _session_pb2.SessionKind
    state: SessionState
    reason: str
    lane: int
    persistent_bytes: int
    ephemeral_bytes: int
    priority: int
    total_iterations: int
    iterations: int
    pending: int
    mean_iteration_ms: float
    p99_iteration_ms: float
    queue_wait_ms: float
    attained_service_ms: float
    preemptions: int
    suspensions: int
    age_ms: float
    slo_ms: float
    serving: ServingInfo
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., owner_uid: _Optional[int] = ..., kind: _Optional[_Union[_session_pb2.SessionKind, str]] = ..., state: _Optional[_Union[SessionState, str]] = ..., reason: _Optional[str] = ..., lane: _Optional[int] = ..., persistent_bytes: _Optional[int] = ..., ephemeral_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., total_iterations: _Optional[int] = ..., iterations: _Optional[int] = ..., pending: _Optional[int] = ..., mean_iteration_ms: _Optional[float] = ..., p99_iteration_ms: _Optional[float] = ..., queue_wait_ms: _Optional[float] = ..., attained_service_ms: _Optional[float] = ..., preemptions: _Optional[int] = ..., suspensions: _Optional[int] = ..., age_ms: _Optional[float] = ..., slo_ms: _Optional[float] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., **kwargs) -> None: ...

class ServingInfo(_message.Message):
    __slots__ = ("scheduler", "pending", "finished", "met_deadline", "dropped", "failed", "batches", "p50_latency_ms", "p99_latency_ms", "scheduling_us_per_request")
    class BatchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MET_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    P50_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    P99_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_US_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    scheduler: str
    pending: int
    finished: int
    met_deadline: int
    dropped: int
    failed: int
    batches: _containers.ScalarMap[int, int]
    p50_latency_ms: float
    p99_latency_ms: float
    scheduling_us_per_request: float
    def __init__(self, scheduler: _Optional[str] = ..., pending: _Optional[int] = ..., finished: _Optional[int] = ..., met_deadline: _Optional[int] = ..., dropped: _Optional[int] = ..., failed: _Optional[int] = ..., batches: _Optional[_Mapping[int, int]] = ..., p50_latency_ms: _Optional[float] = ..., p99_latency_ms: _Optional[float] = ..., scheduling_us_per_request: _Optional[float] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Event(_message.Message):
    __slots__ = ("time_us", "kind", "session", "lane", "detail", "duration_us")
    TIME_US_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    time_us: int
    kind: EventKind
    session: int
    lane: int
    detail: str
    duration_us: int
    def __init__(self, time_us: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., session: _Optional[int] = ..., lane: _Optional[int] = ..., detail: _Optional[str] = ..., duration_us: _Optional[int] = ...) -> None: ...

"""The Python client of ``salusd``: finding the daemon, sessions and their leases, admin.

This module owns the protocol of ``proto/salus/v1/session.proto`` and ``admin.proto`` as
the Rust client (``crates/salus-client``) speaks it:

- **Finding the daemon**: an address argument, else ``SALUS_ADDRESS``, else the default
  socket ``salusd`` itself uses (``/run/salus/salusd.sock`` for root,
  ``$XDG_RUNTIME_DIR/salus/salusd.sock``, else ``/tmp/salus-$UID/salusd.sock``). An
  address is a Unix socket path (anything with a ``/``, or ``unix:PATH``), ``host:port``,
  or ``https://host:port`` (TCP over TLS, trusting the CA certificate named by the
  ``tls_ca`` argument or ``SALUS_TLS_CA``). Over TCP the bearer token comes from the
  ``token`` argument or the file named by ``SALUS_TOKEN_FILE``.
- **A session** (:class:`Session`): ``Sessions.Open`` is a bidirectional stream that is
  the session's lease. The request side sends ``open``, the initial tensors in 4 MiB
  chunks and ``commit``, then stays open until :meth:`Session.close`; a background thread
  reads the daemon's updates (``opened``, ``queued`` with a reason, ``admitted``,
  ``suspended``) so that :attr:`Session.state` and :attr:`Session.reason` are always
  current. :meth:`Session.run`, :meth:`Session.read` and :meth:`Session.write` are the
  ``Run``, ``ReadTensors`` and ``WriteTensors`` calls.
- **A served model**: :meth:`Session.serve` makes an inference session one
  (``docs/serving.md``); :meth:`Client.infer` and :meth:`Client.infer_future` bring it
  requests, which salusd batches and answers one by one.
- **Errors**: every ``grpc.RpcError`` becomes a :class:`~salus.errors.DaemonError` (or
  :class:`~salus.errors.DaemonUnavailableError` when the daemon cannot be reached)
  carrying the status code's name and the daemon's message; a request a served model's
  scheduler dropped is a :class:`~salus.errors.RequestDroppedError`.

Tensors travel as raw little-endian, row-major bytes keyed by their id in the session's
graph; :mod:`salus.torch` maps PyTorch tensors and names onto them.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import mmap
import os
import queue
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, TypeVar

import grpc

from .errors import (AdmissionTimeoutError, DaemonError, DaemonUnavailableError,
                     RequestDroppedError, SalusError, SessionClosedError)
from .v1 import admin_pb2, admin_pb2_grpc, graph_pb2, session_pb2, session_pb2_grpc

ADDRESS_ENV = "SALUS_ADDRESS"
TOKEN_FILE_ENV = "SALUS_TOKEN_FILE"
TLS_CA_ENV = "SALUS_TLS_CA"
# Largest message either side accepts: an iteration's feeds and fetches travel whole.
MAX_MESSAGE_BYTES = 1 << 30
# Tensors at open, read and write travel in chunks of this size.
CHUNK_BYTES = 4 << 20

KINDS = {"training": session_pb2.SESSION_KIND_TRAINING,
         "inference": session_pb2.SESSION_KIND_INFERENCE}

T = TypeVar("T")
# gRPC status codes by number (RunStream reports a failed iteration's code as a number).
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def default_socket_path() -> str:
    """The socket ``salusd`` listens on by default (the same rule as the daemon's)."""
    uid = os.getuid()
    if uid == 0:
        return "/run/salus/salusd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return str(Path(runtime) / "salus" / "salusd.sock")
    return f"/tmp/salus-{uid}/salusd.sock"


def address_from_env() -> str:
    """``SALUS_ADDRESS`` if set, else the default socket path."""
    return os.environ.get(ADDRESS_ENV) or default_socket_path()


@dataclass(frozen=True)
class Address:
    """Where a daemon listens: a Unix socket ``path`` or a TCP ``host`` (``host:port``),
    spoken over TLS when ``tls``."""

    path: str | None = None
    host: str | None = None
    tls: bool = False

    @classmethod
    def parse(cls, address: str) -> "Address":
        """``unix:PATH``/``unix://PATH``, a path (anything with a ``/``),
        ``http://host:port`` or ``host:port``, or ``https://host:port`` (TLS)."""
        for prefix in ("unix://", "unix:"):
            if address.startswith(prefix):
                return cls(path=address[len(prefix):])
        if address.startswith("http://"):
            return cls(host=address[len("http://"):].rstrip("/"))
        if address.startswith("https://"):
            return cls(host=address[len("https://"):].rstrip("/"), tls=True)
        if "/" in address:
            return cls(path=address)
        return cls(host=address)

    @property
    def target(self) -> str:
        """The gRPC target: ``unix:PATH`` or ``host:port``."""
        return f"unix:{self.path}" if self.path is not None else str(self.host)

    def __str__(self) -> str:
        if self.path is not None:
            return self.path
        return f"https://{self.host}" if self.tls else str(self.host)


def _read_token(token: str | None) -> str | None:
    if token is not None:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise DaemonError(f"cannot read the token file {path} (named by {TOKEN_FILE_ENV}): "
                          f"{e.strerror or e}", code="UNAUTHENTICATED") from None


def _read_ca(path: str | None) -> bytes:
    path = path or os.environ.get(TLS_CA_ENV)
    if not path:
        raise DaemonError(f"an https:// address needs {TLS_CA_ENV} (or tls_ca): the CA "
                          "certificate (PEM) that signed salusd's --tls-cert",
                          code="UNAVAILABLE")
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise DaemonError(f"cannot read the CA certificate {path}: {e.strerror or e}",
                          code="UNAVAILABLE") from None


def rpc_error(error: grpc.RpcError, operation: str, address: str) -> DaemonError:
    """The salus exception for a failed call: code name, daemon message, what was done."""
    code_enum = error.code() if hasattr(error, "code") else None
    code = code_enum.name if code_enum is not None else "UNKNOWN"
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    if code == "UNAVAILABLE":
        return DaemonUnavailableError(
            f"cannot {operation}: salusd at {address} is not reachable ({details}); is it "
            f"running? start it with `salusd`, or point {ADDRESS_ENV} at it",
            code=code, details=details, operation=operation, address=address)
    return DaemonError(f"salusd refused to {operation}: {code}: {details}", code=code,
                       details=details, operation=operation, address=address)


def infer_error(error: grpc.RpcError, operation: str, address: str) -> DaemonError:
    """The salus exception for a failed ``Infer``: :class:`RequestDroppedError` when the
    request scheduler dropped the request (``DEADLINE_EXCEEDED``), else as
    :func:`rpc_error`."""
    failed = rpc_error(error, operation, address)
    if failed.code != "DEADLINE_EXCEEDED":
        return failed
    return RequestDroppedError(f"salusd dropped the request ({operation}): {failed.details}",
                               code=failed.code, details=failed.details, operation=operation,
                               address=address)


def failure_error(failure: session_pb2.Failure, operation: str, address: str,
                  what: str = "") -> DaemonError:
    """The salus exception for an iteration that failed on a ``RunStream`` (whose status
    travels as a number and a message); ``what`` names the iteration, e.g. "iteration 3: "."""
    code = _CODE_NAMES.get(failure.code, "UNKNOWN")
    return DaemonError(f"salusd refused to {operation}: {what}{code}: {failure.message}",
                       code=code, details=failure.message, operation=operation,
                       address=address)


def chunks(tensor: int, data: bytes) -> Iterator[session_pb2.TensorChunk]:
    """``data`` of one tensor as chunks of at most :data:`CHUNK_BYTES` (at least one)."""
    view = memoryview(data)
    if len(view) == 0:
        yield session_pb2.TensorChunk(tensor=tensor, offset=0, data=b"")
        return
    for offset in range(0, len(view), CHUNK_BYTES):
        yield session_pb2.TensorChunk(tensor=tensor, offset=offset,
                                      data=bytes(view[offset:offset + CHUNK_BYTES]))


@dataclass(frozen=True)
class Iteration:
    """One iteration to run: a byte string per FEED tensor (graph order), the persistent
    tensors to overwrite just before it runs (tensor id -> whole bytes), and which of the
    session's programs runs."""

    feeds: list[bytes]
    writes: Mapping[int, bytes] | None = None
    program: int = 0
    #: Instead of ``feeds``: (offset, length) of each feed in the session's feed buffer.
    feed_ranges: list[tuple[int, int]] | None = None
    #: Where each fetch goes in the feed buffer (the response then carries none).
    fetch_ranges: list[tuple[int, int]] | None = None

    def request(self, session: int, tag: int = 0) -> session_pb2.RunRequest:
        ranges = lambda rs: [session_pb2.BufferRange(offset=o, length=n)  # noqa: E731
                             for o, n in rs or ()]
        return session_pb2.RunRequest(session=session, feeds=self.feeds, tag=tag,
                                      writes=_writes(self.writes), program=self.program,
                                      feed_ranges=ranges(self.feed_ranges),
                                      fetch_ranges=ranges(self.fetch_ranges))


def _writes(writes: Mapping[int, bytes] | None) -> list[session_pb2.TensorChunk]:
    return [session_pb2.TensorChunk(tensor=t, offset=0, data=d)
            for t, d in (writes or {}).items()]


class FeedBuffer:
    """A private file mapped into this process, whose ranges a session's iterations name
    for their feeds and fetches (:meth:`Session.attach_buffer`): ``view`` is its bytes as
    a writable ``memoryview``."""

    def __init__(self, size: int):
        directory = os.environ.get("SALUS_SHM_DIR") or (
            "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        fd, self.path = tempfile.mkstemp(prefix="salus-feeds-", dir=directory)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.size = size
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Client:
    """A connection to one salusd.

    ``address``: a socket path, ``host:port`` or ``https://host:port`` (default:
    ``SALUS_ADDRESS``, else the default socket). ``token``: the bearer token for TCP
    (default: the contents of the file named by ``SALUS_TOKEN_FILE``, if set).
    ``tls_ca``: for ``https://``, the file of the CA certificate (PEM) that signed salusd's
    ``--tls-cert`` (default: ``SALUS_TLS_CA``). Raises
    :class:`~salus.errors.DaemonUnavailableError` at once when a Unix socket does not
    exist. Usable as a context manager (closes the channel).
    """

    def __init__(self, address: str | None = None, *, token: str | None = None,
                 tls_ca: str | None = None):
        self.address = Address.parse(address or address_from_env())
        if self.address.path is not None and not Path(self.address.path).exists():
            raise DaemonUnavailableError(
                f"cannot reach salusd: no socket at {self.address.path} (is salusd running? "
                f"start it with `salusd`, or set {ADDRESS_ENV})", code="UNAVAILABLE",
                details=f"no socket at {self.address.path}", operation="connect",
                address=str(self.address))
        token = _read_token(token)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   # An iteration is one small round trip: nothing to retry or batch.
                   ("grpc.enable_retries", 0), ("grpc.optimization_target", "latency")]
        if self.address.path is not None:
            # Without it grpcio sends the socket path as :authority, which salusd's HTTP/2
            # server refuses (RST_STREAM).
            options.append(("grpc.default_authority", "localhost"))
        if self.address.tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=_read_ca(tls_ca))
            self.channel = grpc.secure_channel(self.address.target, credentials,
                                               options=options)
        else:
            self.channel = grpc.insecure_channel(self.address.target, options=options)
        self.sessions_stub = session_pb2_grpc.SessionsStub(self.channel)
        self.admin_stub = admin_pb2_grpc.AdminStub(self.channel)

    def call(self, operation: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, metadata=..., **kwargs)``, with errors as salus exceptions."""
        try:
            return fn(*args, metadata=self.metadata, **kwargs)
        except grpc.RpcError as e:
            raise rpc_error(e, operation, str(self.address)) from None

    # -- sessions -----------------------------------------------------------------------

    def open(self, graph: graph_pb2.Graph, initial: Iterable[tuple[int, bytes]] = (), *,
             kind: str = "training", name: str = "", priority: int = 0,
             total_iterations: int = 0, expected_iteration_ms: float = 0.0,
             offline: bool = False, slo_ms: float = 0.0) -> "Session":
        """Opens a session of ``graph`` with the initial value of every PARAMETER and STATE
        tensor (``(tensor id, bytes)``); returns once salusd has accepted it (queued or
        admitted). Hints: ``name`` (shown by ``salusctl``), ``priority`` (higher first),
        ``total_iterations`` (SRTF), ``expected_iteration_ms`` (until measured; the time of
        an iteration on the ``sim`` device). ``offline=True`` makes it best effort: it runs
        only in what online sessions leave and gives its memory up to them (suspended to
        host memory, resumed exactly). ``slo_ms``: an online session's latency target."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if offline and slo_ms:
            raise ValueError("slo_ms is for online sessions; an offline session has none")
        hints = session_pb2.Hints(name=name, priority=priority,
                                  total_iterations=total_iterations,
                                  expected_iteration_ms=expected_iteration_ms,
                                  slo_ms=slo_ms,
                                  **{"class": session_pb2.SESSION_CLASS_OFFLINE if offline
                                     else session_pb2.SESSION_CLASS_ONLINE})
        first = session_pb2.OpenRequest(open=session_pb2.OpenSession(
            graph=graph, kind=KINDS[kind], hints=hints))
        return Session(self, first, initial, f"open a session{f' ({name})' if name else ''}")

    def reattach(self, session: int, token: bytes) -> "Session":
        """Takes back a session that salusd restored after a restart (``--state-dir``),
        with the ``token`` its ``opened`` gave; ``iterations`` of the result says which
        iteration it resumes from."""
        first = session_pb2.OpenRequest(reattach=session_pb2.Reattach(session=session,
                                                                      token=token))
        return Session(self, first, (), f"reattach session {session}")

    # -- served models --------------------------------------------------------------------

    def infer(self, request: session_pb2.InferRequest) -> session_pb2.InferResponse:
        """One request to a served model (:meth:`Session.serve`): its rows, one byte string
        per feed but the variant feed, each without the batch dimension and in its
        variant's shapes. Returns its fetch rows and how it ran (latency, its batch,
        decode steps, whether it met its deadline). Raises
        :class:`~salus.errors.RequestDroppedError` when the request scheduler dropped
        it."""
        return self.infer_future(request).result()

    def infer_future(self, request: session_pb2.InferRequest
                     ) -> "concurrent.futures.Future[session_pb2.InferResponse]":
        """:meth:`infer` without waiting: a future of its response (or of its exception).
        Cancelling the future cancels the call."""
        operation = f"answer a request to session {request.session}"
        address = str(self.address)
        answer: concurrent.futures.Future = concurrent.futures.Future()
        call = self.sessions_stub.Infer.future(request, metadata=self.metadata)

        def settle(call) -> None:
            try:
                if call.cancelled():
                    answer.cancel()
                    return
                try:
                    answer.set_result(call.result())
                except grpc.RpcError as e:
                    answer.set_exception(infer_error(e, operation, address))
            except concurrent.futures.InvalidStateError:
                pass  # cancelled by its owner meanwhile

        answer.add_done_callback(lambda f: f.cancelled() and call.cancel())
        call.add_done_callback(settle)
        return answer

    # -- admin --------------------------------------------------------------------------

    def status(self) -> admin_pb2.StatusResponse:
        """The device, its memory map, lanes, the queue and the policy."""
        return self.call("read the status", self.admin_stub.Status, admin_pb2.StatusRequest())

    def list_sessions(self) -> list[admin_pb2.SessionInfo]:
        """Every open session with its statistics."""
        return list(self.call("list the sessions", self.admin_stub.ListSessions,
                              admin_pb2.ListSessionsRequest()).sessions)

    def policy(self, policy: str | None = None) -> str:
        """Sets the policy (``share``, ``pack``, ``srtf``, ``fair``, ``fifo``) or only reads it;
        returns the policy in force."""
        return self.call(f"set the policy to {policy}" if policy else "read the policy",
                         self.admin_stub.SetPolicy,
                         admin_pb2.SetPolicyRequest(policy=policy or "")).policy

    def watch(self) -> "EventWatch":
        """The daemon's events from now on (sessions opened, admitted, iterations started and
        finished, closed, policy changes): iterate it; :meth:`EventWatch.cancel` ends it."""
        return EventWatch(self.call("watch events", self.admin_stub.Watch,
                                    admin_pb2.WatchRequest()), str(self.address))

    def offline(self, enable: bool | None = None) -> str:
        """Enables (``True``) or disables offline sessions, or only reads; returns the
        protection's health state (``disabled`` while disabled)."""
        request = admin_pb2.SetOfflineRequest()
        if enable is not None:
            request.enable = enable
        what = "read the offline switch" if enable is None else (
            "enable offline sessions" if enable else "disable offline sessions")
        return self.call(what, self.admin_stub.SetOffline, request).health

    def drain(self, drain: bool = True) -> bool:
        """Stops (``True``) or resumes admission; returns whether salusd drains now."""
        return self.call("drain" if drain else "end draining", self.admin_stub.Drain,
                         admin_pb2.DrainRequest(drain=drain)).draining

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"salus.Client({str(self.address)!r})"


class EventWatch:
    """A stream of ``salus.v1.Event`` from :meth:`Client.watch`. Iterating ends quietly
    once :meth:`cancel` is called or the daemon ends the stream."""

    def __init__(self, call, address: str):
        self._call, self._address = call, address
        self._cancelled = False

    def __iter__(self) -> Iterator[admin_pb2.Event]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            if self._cancelled or e.code() == grpc.StatusCode.CANCELLED:
                return
            raise rpc_error(e, "watch events", self._address) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


# What a session's state can be, from the updates of its Open stream.
OPENING, QUEUED, ADMITTED, SUSPENDED, CLOSED = ("opening", "queued", "admitted", "suspended",
                                                "closed")


class Session:
    """An open session and its lease (the ``Open`` stream); see :meth:`Client.open`.

    ``id``, ``persistent_bytes`` (P), ``ephemeral_bytes`` (E), ``token`` (what reattaches
    it after a restart of salusd) and ``iterations`` (done when ``opened`` came: 0, or where
    a restored session resumes) come from ``opened``.
    ``state`` is ``"queued"``, ``"admitted"``, ``"suspended"`` or ``"closed"``;
    ``reason`` is the daemon's last word on why it waits. Closing (or leaving the ``with``
    block) ends the lease and the daemon frees the session's memory; so does the end of
    the process.
    """

    def __init__(self, client: Client, first: session_pb2.OpenRequest,
                 initial: Iterable[tuple[int, bytes]], what: str):
        self.client = client
        self.id: int | None = None
        self.persistent_bytes = 0
        self.ephemeral_bytes = 0
        self.token = b""
        self.iterations = 0
        #: Iterations of the last :meth:`run_pipelined` that ran after its caller stopped
        #: reading (sent ahead, answered while the stream closed).
        self.ran_unread = 0
        self.state = OPENING
        self.reason = ""
        self.lane: int | None = None
        self.error: DaemonError | None = None
        self._closing = False
        self._stream_lock = threading.Lock()
        self._stream: tuple[queue.SimpleQueue, grpc.Future] | None = None
        self._release = threading.Event()
        self._changed = threading.Condition()
        self._what = what
        self._call = client.sessions_stub.Open(self._requests(first, initial),
                                               metadata=client.metadata)
        self._reader = threading.Thread(target=self._read_updates, daemon=True,
                                        name="salus-session-lease")
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self.state != OPENING)
        if self.id is None:
            self._release.set()
            raise self.error or SessionClosedError(
                f"cannot {self._what}: salusd ended the session stream before `opened`",
                operation=self._what, address=str(client.address))
        _OPEN.add(self)

    # -- the lease ----------------------------------------------------------------------

    def _requests(self, first, initial) -> Iterator[session_pb2.OpenRequest]:
        yield first
        if first.HasField("open"):
            # This generator lives as long as the lease: it lets go of the initial tensors
            # once sent (of each one as it goes, when `initial` makes them one at a time),
            # so the process does not keep a copy of the initial state (P bytes).
            for tensor, data in initial:
                for chunk in chunks(tensor, data):
                    if self._release.is_set():
                        return
                    yield session_pb2.OpenRequest(chunk=chunk)
                data = chunk = None
            initial = None
            yield session_pb2.OpenRequest(commit=session_pb2.Commit())
        # The request side stays open while the session is held: ending it ends the lease.
        self._release.wait()

    def _read_updates(self) -> None:
        try:
            for update in self._call:
                self._apply(update)
            why = "the session was closed" if self._closing else \
                "salusd closed the session (it is shutting down, or the session was closed)"
            self._finish(SessionClosedError(why, code="CANCELLED", details=why,
                                            operation="use the session",
                                            address=str(self.client.address)))
        except grpc.RpcError as e:
            operation = self._what if self.id is None else f"keep session {self.id} open"
            self._finish(rpc_error(e, operation, str(self.client.address)))
        finally:
            self._release.set()

    def _apply(self, update: session_pb2.SessionUpdate) -> None:
        which = update.WhichOneof("update")
        with self._changed:
            if which == "opened":
                self.id = update.opened.session
                self.persistent_bytes = update.opened.persistent_bytes
                self.ephemeral_bytes = update.opened.ephemeral_bytes
                self.token = update.opened.token
                self.iterations = update.opened.iterations
                self.state = QUEUED
            elif which == "queued":
                self.state, self.reason = QUEUED, update.queued.reason
            elif which == "admitted":
                self.state, self.reason, self.lane = ADMITTED, "", update.admitted.lane
            elif which == "suspended":
                self.state, self.reason = SUSPENDED, "suspended to host memory by the policy"
            self._changed.notify_all()

    def _finish(self, error: DaemonError) -> None:
        with self._changed:
            self.state = CLOSED
            if self.error is None and not self._closing:
                self.error = error
            self._changed.notify_all()

    def wait_admitted(self, timeout: float | None = None) -> None:
        """Waits until salusd admits the session. Raises
        :class:`~salus.errors.AdmissionTimeoutError` (naming the wait's reason) after
        ``timeout`` seconds, or the error that closed the session."""
        with self._changed:
            admitted = self._changed.wait_for(lambda: self.state in (ADMITTED, CLOSED),
                                              timeout)
            if admitted and self.state == ADMITTED:
                return
            if self.state == CLOSED:
                raise self._closed_error("wait for admission")
            reason = self.reason or "no reason given yet"
        raise AdmissionTimeoutError(
            f"session {self.id} was not admitted within {timeout:g} s: salusd says it "
            f"waits because {reason}", reason=reason, operation="wait for admission",
            address=str(self.client.address))

    def _closed_error(self, operation: str) -> DaemonError:
        if self.error is not None and not self._closing:
            return self.error
        return SessionClosedError(
            f"cannot {operation}: session {self.id} is closed", code="CANCELLED",
            details="closed", operation=operation, address=str(self.client.address))

    # -- calls --------------------------------------------------------------------------

    def _check_open(self, operation: str) -> None:
        if self.state == CLOSED:
            raise self._closed_error(operation)

    def _rpc(self, operation: str, fn, *args):
        self._check_open(operation)
        try:
            return fn(*args, metadata=self.client.metadata)
        except grpc.RpcError as e:
            error = rpc_error(e, operation, str(self.client.address))
        raise self._explained(error)

    def _explained(self, error: DaemonError) -> DaemonError:
        """The error to raise for a failed call: the daemon may have closed the session
        meanwhile, and then that says more than NOT_FOUND or CANCELLED."""
        if error.code in ("NOT_FOUND", "CANCELLED") or isinstance(error,
                                                                  DaemonUnavailableError):
            self._reader.join(timeout=1.0)
            if self.state == CLOSED and self.error is not None and not self._closing:
                return self.error
        return error

    def run(self, feeds: list[bytes] | Iteration, writes: Mapping[int, bytes] | None = None,
            program: int = 0) -> session_pb2.RunResponse:
        """Runs one iteration of ``program`` (0: the graph the session opened with; else
        a number from :meth:`add_program`): one byte string per FEED tensor, in graph
        order (or an :class:`Iteration`, which may name feed buffer ranges instead).
        Waits for admission and for the policy; returns the fetches (in graph order), the
        device time and the wait. ``writes`` (tensor id -> its whole bytes) overwrite
        persistent tensors just before this iteration runs, after every earlier one.

        Iterations go through one ``RunStream`` per session, opened at the first call and
        kept: a message on an open stream costs a fraction of a unary call's setup."""
        operation = f"run an iteration of session {self.id}"
        self._check_open(operation)
        address = str(self.client.address)
        with self._stream_lock:
            if self._stream is None:
                requests: queue.SimpleQueue = queue.SimpleQueue()

                def feed():
                    while (item := requests.get()) is not None:
                        yield item

                call = self.client.sessions_stub.RunStream(feed(), metadata=self.client.metadata)
                self._stream = (requests, call)
            requests, call = self._stream
            iteration = (feeds if isinstance(feeds, Iteration)
                         else Iteration(feeds, writes, program))
            requests.put(iteration.request(self.id))
            try:
                response = next(call)
            except grpc.RpcError as e:
                self._stream = None
                raise self._explained(rpc_error(e, operation, address)) from None
            except StopIteration:
                self._stream = None
                raise self._explained(DaemonUnavailableError(
                    f"cannot {operation}: salusd ended the iteration stream", code="UNAVAILABLE",
                    details="stream ended", operation=operation, address=address)) from None
        if response.HasField("failure"):
            raise self._explained(failure_error(response.failure, operation, address))
        return response

    def _end_stream(self) -> None:
        with self._stream_lock:
            if self._stream is not None:
                requests, call = self._stream
                requests.put(None)
                call.cancel()
                self._stream = None

    def run_pipelined(self, iterations: Iterable[Iteration], depth: int = 4
                      ) -> Iterator[session_pb2.RunResponse]:
        """Runs each of ``iterations`` through ``RunStream``, keeping up
        to ``depth`` submitted ahead of the one being answered, so the session always has
        work queued on the daemon; yields the responses in order. A failed iteration
        raises its error (the iterations before it are done, none after it runs). Closed
        before its end, it first waits for the answers of the iterations already sent:
        they run on salusd regardless, and :attr:`ran_unread` says how many did."""
        if depth < 1:
            raise ValueError("depth must be at least 1")
        operation = f"run iterations of session {self.id}"
        self._check_open(operation)
        window = threading.Semaphore(depth)
        stop = threading.Event()
        sending = threading.Lock()  # stop is set, and requests counted, under it
        sent, answered = [0], [0]

        failed: list[BaseException] = []

        def requests():
            # Runs on grpc's thread: an error of `feeds` (a bad batch) ends the stream and
            # is raised to the caller once the iterations before it are answered.
            try:
                for tag, item in enumerate(iterations):
                    while not window.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    request = item.request(self.id, tag)
                    with sending:
                        if stop.is_set():
                            return
                        sent[0] += 1
                    yield request
            except BaseException as e:  # noqa: BLE001  (re-raised by the caller)
                failed.append(e)

        call = self.client.sessions_stub.RunStream(requests(), metadata=self.client.metadata)
        finished = False
        try:
            for response in call:
                answered[0] += 1
                if response.HasField("failure"):
                    finished = True  # none after a failed iteration runs
                    raise failure_error(response.failure, operation, str(self.client.address),
                                        f"iteration {response.tag}: ")
                window.release()
                yield response
            finished = True
            if failed:
                raise failed[0]
        except grpc.RpcError as e:
            finished = True
            raise rpc_error(e, operation, str(self.client.address)) from None
        finally:
            with sending:
                stop.set()
            if not finished:
                # Left early (the caller stopped reading): the iterations already sent
                # run on salusd regardless, so their answers are awaited first and a read
                # that follows sees them, not a state they are still changing.
                drained = 0
                try:
                    while answered[0] < sent[0]:
                        response = next(call)
                        answered[0] += 1
                        drained += 0 if response.HasField("failure") else 1
                except (grpc.RpcError, StopIteration):
                    pass
                self.ran_unread = drained
            call.cancel()

    def read(self, tensors: Iterable[int] = ()) -> dict[int, bytes]:
        """Reads persistent tensors by id (every PARAMETER and STATE tensor when empty)."""
        def read_all(request, metadata):
            out: dict[int, bytearray] = {}
            for chunk in self.client.sessions_stub.ReadTensors(request, metadata=metadata):
                out.setdefault(chunk.tensor, bytearray()).extend(chunk.data)
            return {k: bytes(v) for k, v in out.items()}

        return self._rpc(f"read tensors of session {self.id}", read_all,
                         session_pb2.ReadTensorsRequest(session=self.id, tensors=list(tensors)))

    def write(self, tensors: Mapping[int, bytes]) -> int:
        """Overwrites persistent tensors by id, all or nothing; returns how many."""
        def messages():
            yield session_pb2.WriteTensorsRequest(session=self.id)
            for tensor, data in tensors.items():
                for chunk in chunks(tensor, data):
                    yield session_pb2.WriteTensorsRequest(chunk=chunk)

        return self._rpc(f"write tensors of session {self.id}",
                         self.client.sessions_stub.WriteTensors, messages()).tensors_written

    def attach_buffer(self, size: int) -> "FeedBuffer":
        """A feed buffer of ``size`` bytes shared with salusd (Unix socket only): a
        private file in ``SALUS_SHM_DIR`` (default ``/dev/shm``), attached to the session
        and unlinked at once; it replaces any earlier one."""
        if self.client.address.path is None:
            raise SalusError("feed buffers need salusd's Unix socket (same host)")
        buffer = FeedBuffer(size)
        try:
            self._rpc(f"attach a feed buffer to session {self.id}",
                      self.client.sessions_stub.AttachBuffer,
                      session_pb2.AttachBufferRequest(session=self.id, path=buffer.path))
        finally:
            buffer.unlink()
        return buffer

    def add_program(self, graph: graph_pb2.Graph) -> session_pb2.AddProgramResponse:
        """Adds ``graph`` as another program of the session (its step for other feed
        shapes: the same persistent tensors, no more scratch); returns its number (for
        :meth:`run`'s ``program``) and its E."""
        return self._rpc(f"add a program to session {self.id}",
                         self.client.sessions_stub.AddProgram,
                         session_pb2.AddProgramRequest(session=self.id, graph=graph))

    def serve(self, variants: Iterable[session_pb2.ServedVariant], *, scheduler: str = "",
              decode: session_pb2.Decode | None = None, default_slo_ms: float = 0.0,
              variant_feed: int | None = None) -> session_pb2.ServeResponse:
        """Makes this inference session a served model (``docs/serving.md``): from then on
        salusd batches the requests :meth:`Client.infer` brings, by the request
        ``scheduler`` (``orloj`` when empty, ``clockwork``, ``nexus``, ``clipper``,
        ``edf`` or ``fifo``), and runs each batch as the program ``variants`` name for its
        size. ``variants``: cheapest first, each with a program per batch size, every
        variant the same sizes; a batch runs the costliest variant among its requests.
        ``decode``: the program repeats, carrying fetches into feeds, until every request
        of the batch is done. ``default_slo_ms``: the SLO of a request that gives none
        (0: the session's ``slo_ms`` hint). ``variant_feed``: the feed (one i64 or i32
        per request) salusd fills with each request's variant. Returns what salusd
        measured of each program (one batch of zeros each)."""
        request = session_pb2.ServeRequest(session=self.id, scheduler=scheduler,
                                           variants=list(variants), decode=decode,
                                           default_slo_ms=default_slo_ms,
                                           variant_feed=variant_feed)
        return self._rpc(f"serve session {self.id}", self.client.sessions_stub.Serve, request)

    def close(self) -> None:
        """Closes the session (a running iteration finishes) and ends the lease.
        Idempotent; a daemon that is already gone is not an error."""
        if self._closing:
            return
        self._closing = True
        _OPEN.discard(self)
        try:
            if self.state != CLOSED and self.id is not None:
                try:
                    self.client.sessions_stub.Close(session_pb2.CloseRequest(session=self.id),
                                                    metadata=self.client.metadata)
                except grpc.RpcError as e:
                    error = rpc_error(e, f"close session {self.id}", str(self.client.address))
                    if error.code not in ("NOT_FOUND", "UNAVAILABLE", "CANCELLED"):
                        raise error from None
        finally:
            self._end_stream()
            self._release.set()
            self._reader.join(timeout=10.0)
            if self._reader.is_alive():
                self._call.cancel()
            with self._changed:
                self.state = CLOSED
                self._changed.notify_all()

    def abandon(self) -> None:
        """Ends the lease at once, without asking salusd first: its iteration stream and
        lease stream are cancelled, and salusd closes the session as the lease ends (what
        the end of the process does too)."""
        self._closing = True
        _OPEN.discard(self)
        self._end_stream()
        self._release.set()
        self._call.cancel()

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<salus.Session {self.id} {self.state}>"


# Sessions whose lease is held: a process that exits with one (a training loop stopped by
# Ctrl-C) ends it while Python still runs gRPC's threads. Left to the interpreter's
# finalization, an open stream's teardown can wait on a thread that no longer runs, and
# the process never exits.
_OPEN: "weakref.WeakSet[Session]" = weakref.WeakSet()


@atexit.register
def _abandon_open_sessions() -> None:
    for session in list(_OPEN):
        with contextlib.suppress(Exception):
            session.abandon()


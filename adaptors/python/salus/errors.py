"""The exceptions the adaptor raises.

Every error the adaptor reports about a user's model says where in the model it comes
from (module path and source line) when that is known.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def in_user_code(filename: str) -> bool:
    """Whether a frame's source file is the user's: neither PyTorch's nor salus', nor
    code they generate (``<string>``, FX's ``<eval_with_key>``)."""
    return ("/torch/" not in filename and "/salus/" not in filename
            and not filename.startswith(("<string>", "<eval_with_key>")))


def user_location(frames: Iterable[tuple[str, int]]) -> str:
    """' at FILE:LINE' of the innermost of ``frames`` (``(file, line)``, outermost first)
    in the user's code, or '' if none is."""
    found = ""
    for filename, line in frames:
        if in_user_code(filename):
            found = f" at {filename}:{line}"
    return found


class SalusError(Exception):
    """Base class of every error the salus adaptor raises on purpose."""


class TraceError(SalusError):
    """Tracing produced a graph the adaptor cannot trust (e.g. a surviving mutation)."""


class LoweringError(SalusError):
    """An FX graph cannot be expressed in the salus graph IR (other than a missing op)."""


class UnsupportedOptimizerError(SalusError):
    """The optimizer, or one of its options, has no functional equivalent here."""


class UnsupportedMixedPrecisionError(TraceError):
    """An autocast setting or a GradScaler (or one of its options) salus cannot follow."""


@dataclass(frozen=True)
class MissingOp:
    """One node whose op the IR does not have."""

    op: str
    node: str
    source: str
    inputs: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        where = self.source or "unknown source"
        args = ", ".join(self.inputs) if self.inputs else "no tensor inputs"
        return f"{self.op} ({self.reason}) at node {self.node} in {where}; inputs: {args}"


@dataclass
class UnsupportedOpError(SalusError):
    """A graph uses ops the salus IR does not have.

    Carries every offending node of the graph, not only the first, so that one run
    reports the complete list of ops a model is missing.
    """

    missing: list[MissingOp] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self._message())

    @property
    def ops(self) -> list[str]:
        """The distinct missing ops, sorted."""
        return sorted({m.op for m in self.missing})

    def _message(self) -> str:
        lines = [
            f"the graph uses {len(self.ops)} op(s) the salus IR does not have: "
            + ", ".join(self.ops)
        ]
        for m in self.missing:
            lines.append("  " + m.describe())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._message()


# ---------------------------------------------------------------------------------------
# Talking to salusd


class DaemonError(SalusError):
    """salusd refused a request or could not be reached.

    ``code`` is the gRPC status code's name (``"INVALID_ARGUMENT"``, ``"UNAVAILABLE"``,
    ...), ``details`` the daemon's own message, ``operation`` what the client was doing
    ("open a session", "run an iteration of session 3") and ``address`` where the daemon
    was looked for. ``str(error)`` says all of it in one line.
    """

    def __init__(self, message: str, *, code: str = "UNKNOWN", details: str = "",
                 operation: str = "", address: str = ""):
        super().__init__(message)
        self.code = code
        self.details = details
        self.operation = operation
        self.address = address


class DaemonUnavailableError(DaemonError):
    """salusd is not running at the address, stopped, or the connection broke."""


class SessionClosedError(DaemonError):
    """The session is closed: by :meth:`close`, or by salusd (shutdown, lease lost)."""


class AdmissionTimeoutError(DaemonError):
    """The session was not admitted in time; ``reason`` is the daemon's last word on why
    it waits (the session is closed when this is raised)."""

    def __init__(self, message: str, *, reason: str = "", **kwargs):
        super().__init__(message, code="DEADLINE_EXCEEDED", details=reason, **kwargs)
        self.reason = reason


class RequestDroppedError(DaemonError):
    """A served model's request scheduler gave the request up unrun: it could no longer
    meet its deadline (salusd's ``DEADLINE_EXCEEDED``); ``details`` is the scheduler's
    reason."""


class BatchError(SalusError, ValueError):
    """A batch does not match the traced example: count, shape or dtype of a tensor."""


class SessionResumedError(SalusError):
    """salusd restarted and the session came back from a snapshot older than the client's
    last step (a daemon killed between snapshots), or pipelined iterations were lost with
    the daemon: the session is usable and holds the state after iteration
    ``resumed_from``; the iterations after it must be run again."""

    def __init__(self, message: str, *, resumed_from: int):
        super().__init__(message)
        self.resumed_from = resumed_from

"""Every failure a user can meet is a clear salus exception with salusd's own message:
unsupported ops, graphs the daemon rejects, wrong batches, a daemon that is not running
or stops, a queue wait that times out, a session that can never fit; and the client
finds the daemon as salusd and salusctl do."""

from __future__ import annotations

import os
from pathlib import Path
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
from daemon import Daemon
from harness import assert_as_exact_as_pytorch
from torch import nn

import salus
import salus.torch as st
from salus import client as salus_client
from salus.client import Address, Client
from salus.errors import TraceError, UnsupportedOpError
from salus.models import MLP, target_models, vector_batch
from salus.torch import (AdmissionTimeoutError, BatchError, DaemonError,
                         DaemonUnavailableError, SessionClosedError)
from salus.trace import GENERATOR

SPEC = target_models(batch_size=4)["mlp"]


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def _mlp_session(address, **kwargs):
    model = SPEC.model(0)
    return st.TrainSession(model, SPEC.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                           SPEC.batch(0), address=address, **kwargs)


def _traced_mlp():
    model = SPEC.model(0)
    return st.trace_train_step(model, SPEC.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                               SPEC.batch(0))


class _ScaledBessel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return torch.special.bessel_j0(self.fc(x))


def test_an_unsupported_op_is_named_before_anything_is_sent(daemon):
    model = _ScaledBessel()
    with pytest.raises(UnsupportedOpError) as info:
        st.TrainSession(model, SPEC.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                        SPEC.batch(0), address=daemon.address)
    message = str(info.value)
    assert "special_bessel_j0" in message and "salus IR does not have" in message
    assert "test_torch_errors.py" in message, "the user's source line is named"
    with Client(daemon.address) as client:
        assert client.list_sessions() == []


def test_a_selection_by_a_boolean_mask_is_refused_with_the_masked_form(daemon):
    """A ``masked_select`` by a broadcast mask has no fixed shape: refused before anything
    is sent, naming the masked form, which trains as the selection does eagerly; so does
    the selection by the mask's positions (``out[k.nonzero()[:, 0]]``, salus.positions).
    (``out[k]`` itself trains: ``tests/test_mask_selections.py``.)"""
    model = SPEC.model(0)
    x, y = SPEC.batch(0)
    mask = torch.arange(len(y)) % 3 != 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TraceError, match=r"boolean mask .* torch.where\(mask, target, -100\)"):
        st.TrainSession(model, None, optimizer, (x, y, mask), address=daemon.address,
                        loss_of=lambda m, x, y, k: m(x).masked_select(k[:, None]).sum())
    with Client(daemon.address) as client:
        assert client.list_sessions() == []
    eager = SPEC.model(0)
    want = nn.functional.cross_entropy(eager(x)[mask], y[mask]).detach()
    exact = nn.functional.cross_entropy(eager.double()(x.double())[mask], y[mask]).detach()
    masked_forms = [lambda out, y, k: nn.functional.cross_entropy(out, torch.where(k, y, -100)),
                    lambda out, y, k: nn.functional.cross_entropy(
                        out[k.nonzero()[:, 0]], y[:, None][k.nonzero()[:, 0]][:, 0])]
    for loss in masked_forms:
        model = SPEC.model(0)
        with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                             (x, y, mask), address=daemon.address,
                             loss_of=lambda m, x, y, k, loss=loss: loss(m(x), y, k)) as session:
            got = session.step(x, y, mask)
        assert_as_exact_as_pytorch({"loss": got}, {"loss": exact}, {"loss": want})


class _DoubledInPlace(torch.autograd.Function):
    """Changes its input in place (``ctx.mark_dirty``), which a traced graph cannot."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Prototypes(nn.Module):
    """Scores against prototype vectors: a plain attribute (captured), or a buffer."""

    def __init__(self, as_buffer: bool):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        prototypes = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))
        if as_buffer:
            self.register_buffer("prototypes", prototypes)
        else:
            self.prototypes = prototypes

    def forward(self, x):
        h = self.fc(x).unsqueeze(1)
        return torch.nn.functional.cosine_similarity(h, self.prototypes, dim=-1)


def test_a_captured_tensor_that_pytorch_cannot_functionalize_is_named():
    """``cosine_similarity`` of a plain attribute changes an intermediate of it in place,
    which PyTorch's functionalization refuses with an internal assertion: the tracer
    names the line and the remedy (a buffer), and as a buffer the model traces."""
    batch = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    loss = torch.nn.functional.cross_entropy
    model = _Prototypes(as_buffer=False)
    with pytest.raises(TraceError, match="register the tensor as a buffer") as info:
        salus.trace_train_step(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                               batch)
    assert "test_torch_errors.py" in str(info.value), "the user's line is named"
    model = _Prototypes(as_buffer=True)
    salus.trace_train_step(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                           batch).to_graph()


def test_a_custom_function_that_changes_its_input_is_named(daemon):
    class WithFunction(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            return _DoubledInPlace.apply(self.fc(x) + 0)

    model = WithFunction()
    with pytest.raises(TraceError, match=r"changes its inputs in place \(ctx.mark_dirty\)"):
        st.TrainSession(model, SPEC.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                        SPEC.batch(0), address=daemon.address)
    with Client(daemon.address) as client:
        assert client.list_sessions() == []


def test_a_graph_the_daemon_rejects_carries_its_message(daemon):
    traced = _traced_mlp()
    graph = traced.to_graph()
    graph.nodes[0].op = "fft_r2c"  # an op salusd does not know
    with Client(daemon.address) as client:
        with pytest.raises(DaemonError) as info:
            client.open(graph, [], name="bad-op")
    error = info.value
    assert error.code == "INVALID_ARGUMENT"
    assert "graph rejected" in error.details and "fft_r2c" in error.details
    assert str(error).startswith("salusd refused to open a session (bad-op): "
                                 "INVALID_ARGUMENT: graph rejected")


def test_dropout_draws_from_the_sessions_generator(daemon):
    """Dropout lowers to ``bernoulli.p`` reading the session's generator state, which each
    step advances and a checkpoint carries: new masks every step, and a restored session
    continues the stream exactly."""
    torch.manual_seed(0)
    model = MLP(32, (64,), 10, dropout=0.5)
    batch = vector_batch(4, 32)

    def session():
        # lr 0: the weights stay put, so only the dropout masks move the loss.
        return st.TrainSession(model, SPEC.loss_fn, torch.optim.SGD(model.parameters(), lr=0.0),
                               batch, address=daemon.address)

    with session() as first:
        start = first.state_dict()[GENERATOR].item()
        losses = [first.step(*batch).item() for _ in range(3)]
        assert len(set(losses)) == 3, losses
        checkpoint = first.state_dict()
        assert checkpoint[GENERATOR].item() == start + 3
        following = first.step(*batch).item()
    with session() as second:
        second.load_state_dict(checkpoint)
        assert second.step(*batch).item() == following


def test_missing_initial_values_are_named(daemon):
    traced = _traced_mlp()
    with Client(daemon.address) as client:
        with pytest.raises(DaemonError, match=r"INVALID_ARGUMENT: tensor 0 'body.0.weight' "
                                              r".*needs 8192 bytes of initial value, got 0"):
            client.open(traced.to_graph(), [])


def test_a_wrong_batch_is_refused_with_what_was_expected(daemon):
    with _mlp_session(daemon.address) as session:
        x, y = SPEC.batch(1)
        with pytest.raises(BatchError, match=r"batch element 0 is float32\[4, 31\] but the "
                                             r"session was traced with float32\[4, 32\]"):
            session.step(x[:, :31], y)
        with pytest.raises(BatchError, match=r"batch element 1 is int32\[4\] but .* "
                                             r"int64\[4\]"):
            session.step(x, y.int())
        with pytest.raises(BatchError, match="takes 2 tensor"):
            session.step(x)
        with pytest.raises(BatchError, match=r"steps\(\): batch element 0 is float32\[8, 32\]"):
            list(session.steps([(x, y), (torch.randn(8, 32), y)]))
        assert session.iterations == 1, "the good batch before the bad one ran"
        # The session is still usable, and the daemon checks what bypasses the client.
        session.step(x, y)
        with pytest.raises(DaemonError, match=r"INVALID_ARGUMENT: .*feed"):
            session.session.run([b"\0" * 12, b"\0" * 32])


def test_no_daemon_at_the_address(tmp_path):
    missing = str(tmp_path / "nobody.sock")
    with pytest.raises(DaemonUnavailableError, match=r"no socket at .*nobody.sock \(is "
                                                      r"salusd running\?"):
        _mlp_session(missing)
    # A socket file nobody listens on (a daemon that was killed).
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()
    with pytest.raises(DaemonUnavailableError, match=r"is not reachable .* is it running\?"):
        _mlp_session(str(stale))


def test_a_daemon_that_stops_under_a_session():
    daemon = Daemon("--policy", "pack")
    with daemon:
        session = _mlp_session(daemon.address, reattach_timeout=0)
        session.step(*SPEC.batch(0))
        daemon.process.send_signal(signal.SIGTERM)  # salusd closes its sessions, then exits
        for _ in range(200):
            if session.session.closed:
                break
            threading.Event().wait(0.05)
        with pytest.raises(SessionClosedError) as info:
            session.step(*SPEC.batch(1))
        assert "salusd closed the session (it is shutting down" in str(info.value)
        session.close()  # nothing left to close: not an error; the connection ends
        assert daemon.process.wait(10) == 0
    # Killed outright, mid-session; it does not come back within the second the session
    # waits for it.
    daemon = Daemon("--policy", "pack")
    with daemon:
        session = _mlp_session(daemon.address, reattach_timeout=1)
        daemon.stop()
        with pytest.raises((SessionClosedError, DaemonUnavailableError)) as info:
            session.step(*SPEC.batch(1))
        assert "salusd" in str(info.value)
        session.close()


def test_admission_timeout_names_the_wait_and_closes_the_session():
    with Daemon("--policy", "fifo") as daemon:
        with _mlp_session(daemon.address, name="first", admission_timeout=10) as first:
            with pytest.raises(AdmissionTimeoutError) as info:
                _mlp_session(daemon.address, name="second", admission_timeout=0.5)
            error = info.value
            assert f"session {first.id}" in error.reason, error.reason
            assert "was not admitted within 0.5 s: salusd says it waits because" in str(error)
            with Client(daemon.address) as client:
                assert [s.name for s in client.list_sessions()] == ["first"]


def test_a_session_that_can_never_fit():
    with Daemon("--memory", "64KiB") as daemon:
        with pytest.raises(DaemonError, match=r"RESOURCE_EXHAUSTED: the session needs \d+ "
                                              r"bytes .* it can never run here"):
            _mlp_session(daemon.address)


def test_using_a_closed_session(daemon):
    session = _mlp_session(daemon.address)
    session.close()
    session.close()
    with pytest.raises(SessionClosedError, match=r"session \d+ is closed"):
        session.step(*SPEC.batch(0))


def test_closing_on_exit_frees_the_daemon(daemon):
    with _mlp_session(daemon.address, name="held") as session:
        session.step(*SPEC.batch(0))
        with Client(daemon.address) as client:
            assert [s.name for s in client.list_sessions()] == ["held"]
    with Client(daemon.address) as client:
        assert client.list_sessions() == []
        memory = client.status().memory
        assert memory.persistent_bytes + memory.lane_bytes == 0


def test_a_client_process_that_dies_loses_its_session(daemon, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, torch\n"
        "import salus.torch as st\n"
        "from salus.models import target_models\n"
        "spec = target_models(batch_size=4)['mlp']\n"
        "m = spec.model(0)\n"
        "s = st.TrainSession(m, spec.loss_fn, torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                    spec.batch(0), name='doomed')\n"
        "s.step(*spec.batch(0))\n"
        "os._exit(0)\n")
    env = {**os.environ, "SALUS_ADDRESS": daemon.address}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    with Client(daemon.address) as client:
        for _ in range(100):
            if not client.list_sessions():
                break
            threading.Event().wait(0.05)
        assert client.list_sessions() == []


# ---------------------------------------------------------------------------------------
# Finding the daemon


def test_addresses_parse_as_the_rust_client_does():
    assert Address.parse("/run/salus/salusd.sock").target == "unix:/run/salus/salusd.sock"
    assert Address.parse("unix:/tmp/s.sock").path == "/tmp/s.sock"
    assert Address.parse("unix:///tmp/s.sock").path == "/tmp/s.sock"
    assert Address.parse("127.0.0.1:7777").target == "127.0.0.1:7777"
    assert Address.parse("http://gpu-box:7777").host == "gpu-box:7777"
    tls = Address.parse("https://gpu-box:7777")
    assert (tls.host, tls.tls, str(tls)) == ("gpu-box:7777", True, "https://gpu-box:7777")


TLS_FIXTURES = Path(__file__).resolve().parents[3] / "crates" / "salusd" / "tests" / "tls"


def test_tcp_over_tls(tmp_path, monkeypatch):
    """``https://host:port`` reaches a daemon started with --tls-cert/--tls-key, trusting
    the CA given; the token still decides who gets in."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("s3cret-s3cret-s3cret\n")
    with Daemon("--listen", f"127.0.0.1:{port}", "--token-file", str(token),
                "--tls-cert", str(TLS_FIXTURES / "server.pem"),
                "--tls-key", str(TLS_FIXTURES / "server.key")):
        ca = str(TLS_FIXTURES / "ca.pem")
        for _ in range(100):  # the TCP listener may come up just after the socket
            try:
                with Client(f"https://localhost:{port}", token="s3cret-s3cret-s3cret",
                            tls_ca=ca) as client:
                    assert client.policy() == "share"
                break
            except salus_client.DaemonUnavailableError:
                threading.Event().wait(0.05)
        else:
            pytest.fail("no TLS connection to salusd")
        with Client(f"https://localhost:{port}", token="guess", tls_ca=ca) as client:
            with pytest.raises(DaemonError) as info:
                client.status()
            assert info.value.code == "UNAUTHENTICATED"
        monkeypatch.delenv("SALUS_TLS_CA", raising=False)
        with pytest.raises(DaemonError, match="needs SALUS_TLS_CA"):
            Client(f"https://localhost:{port}", token="s3cret-s3cret-s3cret")


def test_default_socket_path(monkeypatch):
    monkeypatch.delenv("SALUS_ADDRESS", raising=False)
    monkeypatch.setattr(os, "getuid", lambda: 1234)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert salus_client.address_from_env() == "/run/user/1234/salus/salusd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert salus_client.default_socket_path() == "/tmp/salus-1234/salusd.sock"
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert salus_client.default_socket_path() == "/run/salus/salusd.sock"
    monkeypatch.setenv("SALUS_ADDRESS", "host:1")
    assert salus_client.address_from_env() == "host:1"


def test_salus_address_and_a_tcp_token(daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("SALUS_ADDRESS", daemon.address)
    with Client() as client:
        assert client.policy() == "pack"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("s3cret-s3cret-s3cret\n")  # salusd takes tokens of 16 bytes or more
    with Daemon("--listen", f"127.0.0.1:{port}", "--token-file", str(token)) as tcp:
        assert tcp
        monkeypatch.setenv("SALUS_ADDRESS", f"127.0.0.1:{port}")
        monkeypatch.setenv("SALUS_TOKEN_FILE", str(token))
        for _ in range(100):  # the TCP listener may come up just after the socket
            try:
                with _mlp_session(None, name="over-tcp") as session:
                    loss = session.step(*SPEC.batch(0))
                break
            except DaemonUnavailableError:
                threading.Event().wait(0.05)
        assert loss.item() > 0
        monkeypatch.delenv("SALUS_TOKEN_FILE")
        with pytest.raises(DaemonError) as info:
            Client().status()
        assert info.value.code == "UNAUTHENTICATED"
        monkeypatch.setenv("SALUS_TOKEN_FILE", str(tmp_path / "missing"))
        with pytest.raises(DaemonError, match="cannot read the token file"):
            Client()

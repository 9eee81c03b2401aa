"""Feeds and fetches through a feed buffer (a file shared with salusd on its Unix socket)
give exactly what the gRPC byte stream gives; salusd accepts only a private regular file
of the caller's, keeps every range inside it, and survives a client that shrinks it."""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from daemon import Daemon

import salus
import salus.torch as st
from salus.client import Client, Iteration
from salus.reference import reference_runs
from salus.v1 import session_pb2


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


def _train(daemon, feed_buffer: bool):
    spec = reference_runs()["cnn"].spec
    model = spec.model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [spec.batch(k) for k in range(6)]
    batches.append(tuple(t[:3] for t in spec.batch(6)))  # a smaller last batch
    with st.TrainSession(model, spec.loss_fn, optimizer, batches[0], address=daemon.address,
                         feed_buffer=feed_buffer, admission_timeout=10) as session:
        assert session.feed_buffer == feed_buffer
        losses = [session.step(*b) for b in batches[:3]]
        losses += list(session.steps(batches[3:], depth=2))
        return losses, session.state_dict()


def test_training_through_a_feed_buffer_is_bit_identical(daemon):
    bytes_losses, bytes_state = _train(daemon, feed_buffer=False)
    losses, state = _train(daemon, feed_buffer=True)
    assert [loss.item() for loss in losses] == [loss.item() for loss in bytes_losses]
    for name, value in bytes_state.items():
        assert torch.equal(state[name], value), name


def test_batches_in_any_layout_go_through_a_feed_buffer_alike(daemon):
    # Contiguous batches are copied in one memmove, others (here channels-last images, a
    # view of every other row) through torch: the same steps either way.
    spec = reference_runs()["cnn"].spec
    batches = [spec.batch(k) for k in range(3)]
    strided = [(x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
                torch.stack([y, y], dim=1)[:, 0]) for x, y in batches]
    assert not any(t.is_contiguous() for b in strided for t in b)
    runs = []
    for batch_list in (batches, strided):
        model = spec.model(0)
        with st.TrainSession(model, spec.loss_fn, torch.optim.SGD(model.parameters(), lr=0.05),
                             batch_list[0], address=daemon.address, feed_buffer=True,
                             admission_timeout=10) as session:
            runs.append([session.step(*b) for b in batch_list])
    assert [loss.item() for loss in runs[0]] == [loss.item() for loss in runs[1]]


def test_inference_through_a_feed_buffer_is_bit_identical(daemon):
    spec = reference_runs()["gpt"].spec
    model = spec.model(0)
    x = spec.batch(0)[0]
    results = {}
    for feed_buffer in (False, True):
        with st.InferenceSession(model, x, address=daemon.address,
                                 feed_buffer=feed_buffer) as serve:
            results[feed_buffer] = [serve(x), serve(x[:2])]
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def _open(client: Client):
    spec = reference_runs()["mlp"].spec
    model = spec.model(0)
    traced = salus.trace_train_step(model, spec.loss_fn,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    spec.batch(0))
    initial = [(t.id, st.tensor_bytes(traced.initial_state[t.name]))
               for t in traced.to_graph().tensors if t.name in traced.initial_state]
    return client.open(traced.to_graph(), initial, name="buffers"), traced, spec


def _attach(client, session, path):
    return client.sessions_stub.AttachBuffer(
        session_pb2.AttachBufferRequest(session=session.id, path=str(path)),
        metadata=client.metadata)


def test_only_a_private_regular_file_of_the_caller_is_attached(daemon, tmp_path):
    with Client(daemon.address) as client:
        session, _, _ = _open(client)
        shared = tmp_path / "shared"
        shared.write_bytes(b"\0" * 4096)
        os.chmod(shared, 0o644)
        with pytest.raises(grpc.RpcError) as e:
            _attach(client, session, shared)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "mode 644" in e.value.details()
        link = tmp_path / "link"
        os.chmod(shared, 0o600)
        link.symlink_to(shared)
        with pytest.raises(grpc.RpcError) as e:
            _attach(client, session, link)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            _attach(client, session, tmp_path)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:  # a session that is not there
            client.sessions_stub.AttachBuffer(
                session_pb2.AttachBufferRequest(session=session.id + 12345, path=str(shared)),
                metadata=client.metadata)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert _attach(client, session, shared).size == 4096
        session.close()


def test_ranges_stay_inside_the_buffer_and_a_shrunk_file_fails_only_its_iteration(
        daemon, tmp_path):
    with Client(daemon.address) as client:
        session, traced, spec = _open(client)
        x, y = spec.batch(0)
        feeds = [st.tensor_bytes(x), st.tensor_bytes(y)]
        buffer = session.attach_buffer(1 << 16)
        buffer.view[:len(feeds[0])] = feeds[0]
        buffer.view[4096:4096 + len(feeds[1])] = feeds[1]
        good = [(0, len(feeds[0])), (4096, len(feeds[1]))]
        assert session.run(Iteration([], feed_ranges=good, fetch_ranges=[(8192, 4)])
                           ).fetches == []
        # The first step's loss landed in the buffer: the same bytes as the loss of the
        # same first step of a twin session through the byte stream.
        twin, _, _ = _open(client)
        assert bytes(buffer.view[8192:8196]) == twin.run(feeds).fetches[0]
        twin.close()
        with pytest.raises(salus.DaemonError, match="outside the feed buffer"):
            session.run(Iteration([], feed_ranges=[(0, len(feeds[0])), ((1 << 16) - 8, 64)]))
        with pytest.raises(salus.DaemonError, match="fetches have"):
            session.run(Iteration([], feed_ranges=good, fetch_ranges=[(8192, 8)]))
        with pytest.raises(salus.DaemonError, match="not both"):
            session.run(Iteration(feeds, feed_ranges=good))
        session.close()


def test_a_client_that_shrinks_its_file_fails_only_its_own_iteration(daemon, tmp_path):
    with Client(daemon.address) as client:
        session, _, spec = _open(client)
        x, y = spec.batch(0)
        feeds = [st.tensor_bytes(x), st.tensor_bytes(y)]
        path = tmp_path / "feeds"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 16)
        os.pwrite(fd, feeds[0], 0)
        os.pwrite(fd, feeds[1], 4096)
        os.close(fd)
        assert _attach(client, session, path).size == 1 << 16
        ranges = [(0, len(feeds[0])), (4096, len(feeds[1]))]
        session.run(Iteration([], feed_ranges=ranges))
        os.truncate(path, 100)
        with pytest.raises(salus.DaemonError, match="reading the feed buffer"):
            session.run(Iteration([], feed_ranges=ranges))
        # The daemon and the session go on.
        assert len(session.run(feeds).fetches[0]) == 4
        session.close()

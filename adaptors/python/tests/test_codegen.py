"""The committed protobuf and gRPC code matches proto/salus/v1/."""

import pytest

from salus import _codegen


def test_committed_protobuf_code_is_up_to_date():
    pytest.importorskip("grpc_tools", reason="regenerating needs grpcio-tools")
    stale = _codegen.stale_files()
    assert not stale, (f"{', '.join(stale)} differ from proto/salus/v1/: "
                       "run `python -m salus._codegen`")


def test_every_proto_and_service_is_generated():
    protos = sorted(p.relative_to(_codegen.PROTO_ROOT).as_posix()
                    for p in (_codegen.PROTO_ROOT / "salus" / "v1").glob("*.proto"))
    assert sorted(_codegen.PROTOS) == protos
    for proto in protos:
        has_service = "\nservice " in (_codegen.PROTO_ROOT / proto).read_text()
        assert (proto in _codegen.SERVICES) == has_service, proto


def test_generated_module_imports_and_has_the_schema():
    from salus.v1 import graph_pb2

    graph = graph_pb2.Graph(version=1)
    assert graph_pb2.DType.Name(graph_pb2.DTYPE_BF16) == "DTYPE_BF16"
    assert {f.name for f in graph.DESCRIPTOR.fields} == {
        "version", "tensors", "nodes", "fetches", "updates", "precision"}


def test_service_stubs_import_inside_the_package():
    from salus.v1 import admin_pb2, admin_pb2_grpc, graph_pb2, session_pb2, session_pb2_grpc

    open_session = session_pb2.OpenSession(graph=graph_pb2.Graph(version=1))
    assert open_session.graph.version == 1
    assert set(session_pb2.DESCRIPTOR.services_by_name["Sessions"].methods_by_name) == {
        "Open", "Run", "RunStream", "ReadTensors", "WriteTensors", "Close", "AddProgram",
        "AttachBuffer", "Serve", "Infer"}
    assert set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name) == {
        "Status", "ListSessions", "SetPolicy", "Drain", "Watch", "SetOffline"}
    assert hasattr(session_pb2_grpc, "SessionsStub") and hasattr(admin_pb2_grpc, "AdminStub")

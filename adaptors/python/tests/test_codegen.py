"""The committed protobuf code matches graph.proto."""

from salus import _codegen


def test_committed_protobuf_code_is_up_to_date():
    stale = _codegen.stale_files()
    assert not stale, (f"{', '.join(stale)} differ from proto/salus/v1/graph.proto: "
                       "run `python -m salus._codegen`")


def test_generated_module_imports_and_has_the_schema():
    from salus.v1 import graph_pb2

    graph = graph_pb2.Graph(version=1)
    assert graph_pb2.DType.Name(graph_pb2.DTYPE_BF16) == "DTYPE_BF16"
    assert {f.name for f in graph.DESCRIPTOR.fields} == {
        "version", "tensors", "nodes", "fetches", "updates"}

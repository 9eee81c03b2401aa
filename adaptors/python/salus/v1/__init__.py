"""Generated protobuf code of the salus API, version 1 (see salus._codegen): the graph IR
(``graph_pb2``), the session and admin services (``session_pb2``, ``admin_pb2``) and their
gRPC stubs (``session_pb2_grpc``, ``admin_pb2_grpc``)."""

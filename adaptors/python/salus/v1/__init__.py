"""Generated protobuf code of the salus IR, version 1 (see salus._codegen)."""

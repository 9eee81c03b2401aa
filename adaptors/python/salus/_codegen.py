"""Regenerates the committed protobuf and gRPC code of the salus API.

``python -m salus._codegen`` rewrites ``salus/v1/*_pb2.py`` and ``*_pb2.pyi`` from every
proto in ``proto/salus/v1/`` (the graph IR, the ``Sessions`` and ``Admin`` services) and
the gRPC stubs ``session_pb2_grpc.py`` and ``admin_pb2_grpc.py``, with grpc_tools'
bundled ``protoc``. ``proto/`` is the include root, so the generated modules import each
other as ``salus.v1.graph_pb2`` and work inside this package. The test suite regenerates
into a temporary directory and fails when the committed files differ.

The generated code is made independent of the generator's version, so that it imports
with every grpcio and protobuf release salus supports (``pyproject.toml``), not only
those at least as new as the generator: protoc's ``ValidateProtobufRuntimeVersion`` call
and its "Protobuf Python Version" line, and grpc_tools' ``GRPC_GENERATED_VERSION`` guard
(which refuses any older grpcio), are taken out (:func:`without_version_guards`). What
remains uses only APIs that the oldest supported releases have (protobuf's ``builder``,
grpcio's ``_registered_method``), which scripts/test-torch-versions.sh checks. The same
files come out of every grpcio-tools release from 1.84 on, so the staleness check holds
whichever one is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # adaptors/python
PROTO_ROOT = PACKAGE_ROOT.parent.parent / "proto"
PROTOS = ["salus/v1/graph.proto", "salus/v1/session.proto", "salus/v1/admin.proto"]
# Protos that define services: they get gRPC stubs too.
SERVICES = ["salus/v1/session.proto", "salus/v1/admin.proto"]
# The IR's op list travels with the package, for installs outside the source tree.
COPIED = ["salus/v1/ops.txt"]
GENERATED = ([p.replace(".proto", suffix) for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi")]
             + [p.replace(".proto", "_pb2_grpc.py") for p in SERVICES] + COPIED)


def _protoc(args: list[str]) -> None:
    # In its own process: grpc_tools links its own protobuf, which crashes beside another
    # copy loaded in this one (TensorFlow's, once salus.tf was imported).
    out = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", *args],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}: {out.stderr}")


# protoc's check that the protobuf runtime is at least the generator's version.
_PROTOBUF_GUARD = re.compile(
    r"^# Protobuf Python Version: .*\n"
    r"|^from google\.protobuf import runtime_version as _runtime_version\n"
    r"|^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", re.MULTILINE)
# grpc_tools' check that grpcio is at least the generator's version, and its import.
_GRPC_GUARD = re.compile(
    r"^import warnings\n"
    r"|^GRPC_GENERATED_VERSION = .*\n(?:.*\n)*?^if _version_not_supported:\n"
    r"(?:    .*\n)+\n?", re.MULTILINE)


def without_version_guards(path: Path) -> None:
    """Takes the generator's version checks out of one generated module (see the module
    docstring); fails when there is none to take out, so that a new generator's changed
    output is noticed."""
    text = path.read_text()
    guard = _GRPC_GUARD if path.name.endswith("_grpc.py") else _PROTOBUF_GUARD
    stripped, count = guard.subn("", text)
    assert count >= 2, f"{path}: the generator's version check is not where it was"
    assert "_version" not in stripped.replace("_registered_method", ""), path
    path.write_text(stripped)


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every proto into ``out_dir`` (as a package root); returns the
    generated files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc([f"--python_out={out_dir}", f"--pyi_out={out_dir}",
             *[str(PROTO_ROOT / p) for p in PROTOS]])
    _protoc([f"--grpc_python_out={out_dir}", *[str(PROTO_ROOT / p) for p in SERVICES]])
    for path in COPIED:
        (out_dir / path).write_bytes((PROTO_ROOT / path).read_bytes())
    for g in GENERATED:
        if g.endswith(".py"):
            without_version_guards(out_dir / g)
    return [out_dir / g for g in GENERATED]


def stale_files() -> list[str]:
    """The committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [g for g in GENERATED
                if not (PACKAGE_ROOT / g).exists()
                or (Path(tmp) / g).read_bytes() != (PACKAGE_ROOT / g).read_bytes()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report whether the committed files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for g in stale:
            print(f"stale: {g}")
        return 1 if stale else 0
    for path in generate(PACKAGE_ROOT):
        print(f"wrote {path.relative_to(PACKAGE_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerates the committed protobuf code of the salus IR.

``python -m salus._codegen`` rewrites ``salus/v1/graph_pb2.py`` and ``graph_pb2.pyi``
from ``proto/salus/v1/graph.proto`` with grpc_tools' bundled ``protoc``. The test suite
regenerates into a temporary directory and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # adaptors/python
PROTO_ROOT = PACKAGE_ROOT.parent.parent / "proto"
PROTOS = ["salus/v1/graph.proto"]
GENERATED = ["salus/v1/graph_pb2.py", "salus/v1/graph_pb2.pyi"]


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every proto into ``out_dir`` (as a package root); returns the
    generated files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            *[str(PROTO_ROOT / p) for p in PROTOS]]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
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

#!/usr/bin/env bash
# Runs the Python adaptor against the oldest stack salus supports, next to the pinned one
# in .venv (scripts/python-env.sh): PyTorch 2.11 + torchvision 0.26, grpcio 1.84,
# protobuf 5.29 and Python 3.12, the stack of a common GPU image. Not part of
# scripts/test.sh (it downloads about 3 GB once and runs for several minutes).
#
#   scripts/test-torch-versions.sh [PYTEST_ARGS...]
#
# 1. creates (or reuses) the environment $SALUS_VENVS/torch-<version> (default
#    SALUS_VENVS=.venvs in the repository root): the versions below, pytest, numpy;
# 2. builds a wheel of adaptors/python, installs it there with pip resolving its declared
#    dependencies against these versions (so pyproject's lower bounds are checked), and
#    imports salus.torch, salus.client and the gRPC stubs from outside the source tree;
# 3. runs the tests that trace, lower and run PyTorch steps (tracing, optimizers, parity
#    with eager PyTorch, sessions on real salusd processes, their errors) against the
#    source tree, or the tests named by PYTEST_ARGS.
#
# Override the stack with TORCH, TORCHVISION, GRPCIO, PROTOBUF and PYTHON (an
# interpreter). The session tests take salusd from SALUSD, else build it with cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TORCH=${TORCH:-2.11.0}
TORCHVISION=${TORCHVISION:-0.26.0}
GRPCIO=${GRPCIO:-1.84.0}
PROTOBUF=${PROTOBUF:-5.29.6}
PYTHON=${PYTHON:-python3.12}
venvs=${SALUS_VENVS:-$root/.venvs}
venv=$venvs/torch-$TORCH
pins=("torch==$TORCH" "torchvision==$TORCHVISION" "grpcio==$GRPCIO" "protobuf==$PROTOBUF")
want=$(printf '%s\n' "${pins[@]}" | sha256sum | cut -d' ' -f1)

if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$venvs"
    "$PYTHON" -m venv "$venv"
fi
py=$venv/bin/python
if [ "$(cat "$venv/.salus-stamp" 2>/dev/null)" != "$want" ]; then
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet "${pins[@]}" pytest numpy build
    echo "$want" > "$venv/.salus-stamp"
fi

# The wheel, installed with its declared dependencies held to this stack.
dist=$(mktemp -d)
trap 'rm -rf "$dist"' EXIT
"$py" -m build --wheel --outdir "$dist" adaptors/python > "$dist/build.log" 2>&1 \
    || { cat "$dist/build.log"; exit 1; }
printf '%s\n' "${pins[@]}" > "$dist/constraints.txt"
"$py" -m pip uninstall --quiet --yes salus 2>/dev/null || true
"$py" -m pip install --quiet -c "$dist/constraints.txt" "$dist"/salus-*.whl
(cd "$dist" && "$py" - <<'EOF'
import google.protobuf, grpc, torch
import salus, salus.client, salus.torch
from salus.v1 import admin_pb2_grpc, session_pb2_grpc
assert "site-packages" in salus.__file__, salus.__file__
print(f"wheel imports: salus from {salus.__file__}; torch {torch.__version__}, "
      f"grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")
EOF
)

if [ $# -eq 0 ]; then
    set -- adaptors/python/tests/test_codegen.py adaptors/python/tests/test_lower.py \
        adaptors/python/tests/test_optim.py adaptors/python/tests/test_parity.py \
        adaptors/python/tests/test_torch_sessions.py adaptors/python/tests/test_torch_errors.py \
        adaptors/python/tests/test_attention_dropout.py
fi
PYTHONPATH=$root/adaptors/python "$py" -m pytest -q -p no:cacheprovider "$@"

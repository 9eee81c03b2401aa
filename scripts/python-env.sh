#!/usr/bin/env bash
# Creates (or reuses) the Python environment in .venv: torch, torchvision, grpcio,
# grpcio-tools, protobuf, pytest, and the salus package from adaptors/python (editable).
# Reinstalls only when adaptors/python/requirements-dev.txt or pyproject.toml changed.
# PyTorch's wheel pulls the CUDA runtime packages: the first run downloads about 3 GB and
# the environment takes about 8 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
reqs=adaptors/python/requirements-dev.txt
stamp=$venv/.salus-stamp
want=$(cat "$reqs" adaptors/python/pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # No wheel cache: it would hold a second copy of those gigabytes on the same disk.
    export PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1
    # uv fetches and unpacks the wheels in parallel: a new environment in about 40 s
    # where pip takes about 110 s (the same packages, the same versions). Where uv cannot
    # (an index or certificate only pip is configured for), pip does it.
    uv=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python")
    if ! { "$venv/bin/python" -m pip install --quiet uv==0.13.9 && "${uv[@]}" -r "$reqs" &&
        "${uv[@]}" --no-deps -e adaptors/python; }; then
        echo "python-env: uv failed; installing with pip" >&2
        "$venv/bin/python" -m pip install --quiet -r "$reqs"
        "$venv/bin/python" -m pip install --quiet --no-deps -e adaptors/python
    fi
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"

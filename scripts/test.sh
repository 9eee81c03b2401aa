#!/usr/bin/env bash
# Runs every check salus has: formatting, lints with warnings denied, all Rust tests, and
# the Python adaptor's tests against real PyTorch. Needs Rust 1.95 and Python 3.11; builds
# everything and creates (or reuses) the Python environment in .venv itself.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
./scripts/check-attrs.sh
./scripts/check-file-sizes.sh
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
python=$(./scripts/python-env.sh)
"$python" -m pytest adaptors/python/tests -q --durations=15

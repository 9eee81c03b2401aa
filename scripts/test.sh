#!/usr/bin/env bash
# Runs every check salus has: formatting, lints with warnings denied, all Rust tests, and
# the Python adaptor's tests against real PyTorch. Needs Rust 1.95 and Python 3.11; builds
# everything and creates (or reuses) the Python environment in .venv itself.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python environment (on a fresh machine mostly downloads) is made while Rust builds.
env_out=$(mktemp) env_err=$(mktemp)
./scripts/python-env.sh >"$env_out" 2>"$env_err" &
env_pid=$!
trap 'kill "$env_pid" 2>/dev/null || true; rm -f "$env_out" "$env_err"' EXIT
cargo fmt --all -- --check
./scripts/check-attrs.sh
./scripts/check-file-sizes.sh
phase() { echo "test.sh: $1 after ${SECONDS} s" >&2; }
cargo clippy --workspace --all-targets --locked -- -D warnings
phase "lints"
# Every binary the Python tests run, built with the features the Rust tests resolve: a
# `cargo build -p` of one package resolves them apart and rebuilds dozens of crates.
cargo build --workspace --locked --bins --examples --tests
phase "build"
cargo test --workspace --locked
phase "Rust tests"
export SALUSD="$PWD/target/debug/salusd" SALUS_BENCH="$PWD/target/debug/salus-bench"
export SALUS_REPLAY="$PWD/target/debug/examples/replay_reference"
env_status=0
wait "$env_pid" || env_status=$?
cat "$env_err" >&2
if [ "$env_status" -ne 0 ]; then
    echo "test.sh: scripts/python-env.sh failed (exit $env_status)" >&2
    exit "$env_status"
fi
python=$(cat "$env_out")
phase "Python environment"
# Two workers, each taking a whole test file at a time (a file's daemons and traces stay
# in one process); the tests that measure rates or wall time run after them, alone. Each
# worker's PyTorch gets half the cores (OpenMP's threads; its default is every core):
# two workers with a thread per core each and their daemons beside them took 456 s on two
# cores, against 290 s so.
threads=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads} "$python" -m pytest adaptors/python/tests -q \
    -n 2 --dist loadfile -m "not solo" --durations=15
phase "Python tests"
"$python" -m pytest adaptors/python/tests -q -m solo --durations=5

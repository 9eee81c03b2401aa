#!/usr/bin/env bash
# Runs every check salus has: formatting, lints with warnings denied, all tests.
# Needs only a Rust toolchain (1.95); builds everything it tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked

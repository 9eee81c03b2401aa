#!/usr/bin/env bash
# Fails if a hand-written Rust source file is longer than 1,000 lines: a file should fit
# in a head. Tests (`tests/` folders and `tests.rs` modules) are exempt; generated code
# lives under target/ and is not looked at.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=1000
long=$(find crates benches -name '*.rs' -not -path '*/target/*' -not -path '*/tests/*' \
    -not -name 'tests.rs' -print0 | xargs -0 wc -l | awk -v limit=$limit \
    '$2 != "total" && $1 > limit { print $2 ": " $1 " lines" }')
if [[ -n "$long" ]]; then
    echo "check-file-sizes: hand-written Rust files over $limit lines (split them):"
    echo "$long"
    exit 1
fi
echo "check-file-sizes: every hand-written Rust file is at most $limit lines"

#!/usr/bin/env bash
# Builds the fuzz targets (fuzz/, cargo-fuzz on the nightly toolchain) and runs each for a
# given time, one after the other; prints each target's executions, time and rate, and
# stops at the first crash (its input is under fuzz/artifacts/TARGET/). Not part of
# scripts/test.sh.
#
#   ./scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]    # default: 60 s, every target
#
# Needs `rustup toolchain install nightly` and `cargo install cargo-fuzz`. Builds without a
# sanitizer and with debug assertions (overflow checks: the code is safe Rust, so
# AddressSanitizer finds little and costs half the speed). The working corpus grows in
# fuzz/corpus/TARGET (not committed); the committed seeds in fuzz/seeds/TARGET are read too.
# docs/operations.md, "Fuzzing", says what each target covers.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(graph graph_ops rpc)
fi
flags=(--sanitizer none --debug-assertions)
cargo +nightly fuzz build "${flags[@]}"
for target in "${targets[@]}"; do
    corpus=(fuzz/corpus/"$target")
    mkdir -p "${corpus[0]}"
    [[ -d fuzz/seeds/$target ]] && corpus+=(fuzz/seeds/"$target")
    log=$(mktemp)
    status=0
    start=$(date +%s)
    cargo +nightly fuzz run "${flags[@]}" "$target" "${corpus[@]}" -- \
        -max_total_time="$seconds" -print_final_stats=1 -timeout=20 >"$log" 2>&1 || status=$?
    took=$(($(date +%s) - start))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    echo "$target: ${runs:-?} executions in ${took} s (${rate:-?} exec/s), exit $status"
    if [[ $status -eq 72 ]]; then
        echo "$target: interrupted (a signal from outside), no crash"
        rm -f "$log"
        exit "$status"
    fi
    if [[ $status -ne 0 ]]; then
        grep -m1 -A3 'panicked' "$log" || tail -n 20 "$log"
        rm -f "$log"
        exit "$status"
    fi
    rm -f "$log"
done

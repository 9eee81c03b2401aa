#!/usr/bin/env bash
# Builds salus and runs its main job. Until the daemon lands, the main job is the
# simulator: the Salus experiments on the scheduling core that salusd will drive.
# Arguments go to salus-sim; without any, it runs the long training experiment.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p salus-sim
if [ "$#" -eq 0 ]; then
    set -- experiment training
fi
exec ./target/release/salus-sim "$@"

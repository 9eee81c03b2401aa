#!/usr/bin/env bash
# Builds salus and starts its main job: salusd on the default device (GPU 0 when one is
# usable, else the CPU with a 4 GiB arena), listening on the default socket. Arguments go to salusd (`--help` lists
# them). Stop it with Ctrl-C: it finishes running iterations and removes its socket.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p salusd -p salusctl
exec ./target/release/salusd "$@"

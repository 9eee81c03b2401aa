#!/usr/bin/env bash
# Four training jobs through one salusd (its default policy) against the same four as
# plain PyTorch processes, on GPU 0, in one run of about 60-90 s: benches/share_e2e.py.
#
#   ./scripts/gpu-check.sh prepare      # here: release salusd into .gpu/
#   ./scripts/gpu/share.sh              # there, from the repository root; .gpu/ carried along
#
# Needs python3 with torch (CUDA), torchvision and grpcio. Writes $OUT/share.json (or
# .gpu/out/share.json) and the bench's log beside it; prints a short table. SECONDS_PER_PHASE
# (default 20) sets how long each phase trains after warm-up.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.gpu/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=adaptors/python${PYTHONPATH:+:$PYTHONPATH}
salusd=${SALUSD:-.gpu/salusd}
[ -x "$salusd" ] || { echo "share.sh: no $salusd (run ./scripts/gpu-check.sh prepare)"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# salusd must find the CUDA libraries; if it cannot start on the GPU as things are, put
# them on LD_LIBRARY_PATH (scripts/cuda-libs.sh) and try once more.
preflight() {
    local sock=/tmp/salus-share-preflight.sock
    rm -f "$sock"
    "$salusd" --socket "$sock" --device cuda:0 --memory 1GiB > "$out/preflight.log" 2>&1 &
    local pid=$!
    for _ in $(seq 200); do
        [ -S "$sock" ] && { kill -TERM "$pid"; wait "$pid" 2>/dev/null; return 0; }
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    return 1
}
if ! preflight; then
    echo "salusd did not start on cuda:0 as is:"; tail -n 5 "$out/preflight.log"
    set +u  # cuda-libs.sh is not written for nounset
    # shellcheck source=scripts/cuda-libs.sh
    source scripts/cuda-libs.sh
    set -u
    preflight || { echo "salusd cannot start on cuda:0:"; tail -n 20 "$out/preflight.log"; exit 1; }
fi

timeout 420 python3 benches/share_e2e.py --salusd "$salusd" --device cuda \
    --seconds "${SECONDS_PER_PHASE:-20}" --json > "$out/share.json" 2> "$out/share.log"
rc=$?
echo "share_e2e rc=$rc"
if [ $rc -ne 0 ]; then
    tail -n 40 "$out/share.log"
    exit $rc
fi
python3 -c "
import json, sys
sys.path.insert(0, 'benches')
import share_e2e
share_e2e.print_table(json.load(open('$out/share.json')))
"

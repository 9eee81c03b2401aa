#!/usr/bin/env bash
# Where the GPU time goes: `salus-bench profile` for resnet18, resnet50 (224 px, batch 32),
# the stock nn.TransformerEncoder (with its dropout, then without: the IR has no
# native_dropout yet) and the GPT-style decoder at sequence 512, width 768.
#
# On the GPU host, from the repository root, with the binaries that
# `./scripts/gpu-check.sh prepare` put in .gpu/ and PyTorch with CUDA importable by python3
# (the salus package is taken from adaptors/python; tracing does not need grpcio):
#
#   ./scripts/gpu/profile.sh                 # the targets above: about 2-3 minutes
#   ./scripts/gpu/profile.sh mlp gpt         # other models (see salus-bench profile --help)
#   SALUS_CUDA_ATTENTION=tiled OUT=.gpu/out-tiled ./scripts/gpu/profile.sh transformer_nodrop gpt512
#                                            # f32 attention's forward in register tiles,
#                                            # to compare with the cuBLAS default
#
# Writes $OUT (default .gpu/out): profile.json (salus-bench profile --json), profile.err
# (progress and PyTorch's log), profile.txt (the tables); prints the tables at the end.
# If the loader cannot find libnvrtc/libcublas by itself, source scripts/cuda-libs.sh first.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.gpu/out}
mkdir -p "$out"
bench=.gpu/salus-bench
if [ ! -x "$bench" ]; then
    echo "no $bench: run ./scripts/gpu-check.sh prepare on the build machine first" >&2
    exit 2
fi
export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1 PYTHONPATH=adaptors/python
export SALUS_PYTHON=${SALUS_PYTHON:-python3}
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(resnet18 resnet50 transformer transformer_nodrop gpt512)
args=()
for m in "${models[@]}"; do args+=(--model "$m"); done

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
"$SALUS_PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== salus-bench profile ${models[*]}"
start=$(date +%s)
# The whole run stays under the limit: a stuck step fails it rather than the lease.
timeout --kill-after=10 "${PROFILE_TIMEOUT:-420}" "$bench" profile --json \
    --dir "${PROFILE_DIR:-/tmp/salus-profile}" --iterations "${PROFILE_ITERATIONS:-10}" \
    "${args[@]}" > "$out/profile.json" 2> "$out/profile.err"
rc=$?
echo "rc=$rc after $(( $(date +%s) - start )) s"
if [ $rc -ne 0 ]; then
    echo "-- last lines of $out/profile.err"
    tail -25 "$out/profile.err"
    cat "$out/profile.json"
    exit $rc
fi
grep -E "^(torch_profile|salus-bench profile):" "$out/profile.err"
"$bench" profile --from "$out/profile.json" > "$out/profile.txt"
cat "$out/profile.txt"

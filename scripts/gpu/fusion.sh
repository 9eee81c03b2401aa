#!/usr/bin/env bash
# The fused pointwise kernels and the row kernels (softmax, layer norm, reductions) on the
# GPU, in under two minutes. From the repository root on the GPU host, with the binaries
# `./scripts/gpu-check.sh prepare` put in .gpu/ (the cuda and ops test binaries):
#
#   ./scripts/gpu/fusion.sh
#
# Runs tests/cuda.rs (training steps, fused chains with fusion on and off, with and without
# CUDA graphs; row kernels at row lengths 1, 31, 32, 1000, 1025, 4096 against the CPU), then
# the op tests on the GPU with fusion on and off (SALUS_CUDA_FUSION=0). Logs go to $OUT (or
# .gpu/out); the summary to stdout. Exits non-zero when a step fails.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-.gpu/out}
mkdir -p "$out"
for bin in cuda ops; do
    [ -x ".gpu/$bin" ] || { echo "no .gpu/$bin: run ./scripts/gpu-check.sh prepare first" >&2; exit 2; }
done
export RUST_BACKTRACE=1
# A fresh kernel cache: the generated kernels are compiled here, not taken from an old run.
export SALUS_NVRTC_CACHE=${SALUS_NVRTC_CACHE:-$(mktemp -d /tmp/salus-nvrtc-fusion.XXXXXX)}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
status=0
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/fusion-$name.log" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || status=1
    echo "== $name: rc=$rc in $((SECONDS - start))s"
    grep -E "^test .*(FAILED|ok)$|test result|panicked at|running unfused" "$out/fusion-$name.log" | head -40
}
step cuda 45 .gpu/cuda --test-threads=1 --nocapture
step ops-fusion-on 40 env SALUS_TEST_DEVICE=cuda .gpu/ops --test-threads=4
step ops-fusion-off 30 env SALUS_TEST_DEVICE=cuda SALUS_CUDA_FUSION=0 .gpu/ops --test-threads=4 \
    softmax layer_norm sums_means binary unary
echo "== logs in $out/fusion-*.log; $( [ $status -eq 0 ] && echo all passed || echo FAILURES )"
exit $status

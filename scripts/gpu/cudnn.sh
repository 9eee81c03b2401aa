#!/usr/bin/env bash
# The cuDNN checks on a GPU host, in under 2 minutes: whether the CUDA device loads cuDNN
# (and from where), cuDNN convolutions against the CPU device (forward, both backwards,
# strides, padding, dilation, groups, 1-3 spatial dims; f32 without TF32, f16/bf16
# loosely), every workspace inside the planned E, the CUDA device tests and every op test
# on the GPU, and salusd's status line.
#
#   ./scripts/gpu-check.sh prepare      # on the build host: binaries into .gpu/
#   OUT=/some/dir ./scripts/gpu/cudnn.sh   # on the GPU host, from the repository root
#
# Logs go to $OUT (or .gpu/out); a summary ends the output. If the loader cannot find
# libnvrtc/libcublas by itself, source scripts/cuda-libs.sh first. cuDNN is looked for on
# the loader path, in CUDA's folders, in the nvidia-cudnn pip wheel, and through python3
# (docs/operations.md); SALUS_CUDNN_DIR names its folder outright.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.gpu/out}
mkdir -p "$out"
export RUST_BACKTRACE=1 RUST_LOG=${RUST_LOG:-info}
summary=()
note() { summary+=("$1"); echo "$1"; }
for bin in cudnn cuda ops salusd salusctl; do
    [ -x ".gpu/$bin" ] || { echo "missing .gpu/$bin: run ./scripts/gpu-check.sh prepare" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import nvidia.cudnn, os; print('nvidia-cudnn wheel:', list(nvidia.cudnn.__path__)[0])" \
    2>/dev/null | tee "$out/wheel.txt" || echo "no nvidia-cudnn wheel importable by python3"

echo "== cuDNN convolutions against the CPU"
timeout 90 .gpu/cudnn --test-threads=1 --nocapture > "$out/cudnn.log" 2>&1
rc=$?
grep -E "^test |test result|panicked|uses cuDNN|has no cuDNN|skipped" "$out/cudnn.log" | head -20
loaded=$(grep -m1 -oE "uses cuDNN [0-9.]+( from [^ ]+)?|has no cuDNN: .*" "$out/cudnn.log")
note "cuDNN: ${loaded:-unknown (see $out/cudnn.log)}"
note "cudnn tests: rc=$rc $(grep -m1 -E 'test result' "$out/cudnn.log")"

echo "== CUDA device tests"
timeout 60 .gpu/cuda --test-threads=1 > "$out/cuda.log" 2>&1
rc=$?
grep -E "test result|panicked" "$out/cuda.log"
note "cuda tests: rc=$rc $(grep -m1 -E 'test result' "$out/cuda.log")"

echo "== every op test on the GPU"
SALUS_TEST_DEVICE=cuda timeout 60 .gpu/ops --test-threads=4 > "$out/ops.log" 2>&1
rc=$?
grep -E "test result|panicked at" "$out/ops.log" | head -10
note "ops on the GPU: rc=$rc $(grep -m1 -E 'test result' "$out/ops.log")"

echo "== salusd on the GPU"
sock=/tmp/salus-cudnn-check.sock
rm -f "$sock"
.gpu/salusd --socket "$sock" --memory 4GiB > "$out/salusd.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
status=$(timeout 10 .gpu/salusctl --socket "$sock" status 2>&1 | head -1)
kill -TERM "$pid" 2>/dev/null && wait "$pid"
grep -iE "cudnn|convolutions use" "$out/salusd.log" | head -3
note "salusd: ${status:-no status}"

echo
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"

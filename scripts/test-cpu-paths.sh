#!/usr/bin/env bash
# Runs the tests that compare salus with eager PyTorch under each x86-64 code path PyTorch's
# CPU libraries can take, so that their tolerances are shown to hold on other CPUs than
# this one. Which kernels MKL (products), oneDNN (convolutions) and ATen (pointwise,
# reductions) pick depends on the CPU's vendor and instruction sets: an Intel Xeon with
# AVX-512 and an AMD EPYC with AVX2 sum in different orders, and PyTorch's float32 results
# differ between them. Each library can be told which path to take:
#
#   oldest  MKL_CBWR=COMPATIBLE  ONEDNN_MAX_CPU_ISA=SSE41        ATEN_CPU_CAPABILITY=default
#   avx2    MKL_CBWR=AVX2        ONEDNN_MAX_CPU_ISA=AVX2         ATEN_CPU_CAPABILITY=avx2
#   avx512  MKL_CBWR=AVX512      ONEDNN_MAX_CPU_ISA=AVX512_CORE  ATEN_CPU_CAPABILITY=avx512
#
# A path the CPU lacks is skipped (avx512 needs avx512f). salus' own kernels pick theirs by
# instruction set alone (never by vendor), so the paths above are where two x86-64
# machines with the same instruction sets differ. Not part of scripts/test.sh: it runs the
# numerical tests once per path (about 10 minutes in all on 2 cores).
#
#   scripts/test-cpu-paths.sh [PATH ...] [-- PYTEST_ARGS...]
#
# The tests take salusd from SALUSD, else build it with cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
paths=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    paths+=("$1")
    shift
done
[ "${1:-}" = "--" ] && shift
[ ${#paths[@]} -eq 0 ] && paths=(oldest avx2 avx512)
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(adaptors/python/tests/test_parity.py adaptors/python/tests/test_optimizers.py
           adaptors/python/tests/test_amp.py adaptors/python/tests/test_torch_loops.py
           adaptors/python/tests/test_custom_steps.py -q)
fi
python=$(./scripts/python-env.sh)
if [ -z "${SALUSD:-}" ]; then
    cargo build --locked -q -p salusd
    export SALUSD=$PWD/target/debug/salusd
fi
failed=()
for path in "${paths[@]}"; do
    case $path in
        oldest) env=(MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default) ;;
        avx2) env=(MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2) ;;
        avx512)
            if ! grep -qw avx512f /proc/cpuinfo; then
                echo "== avx512: skipped, this CPU has no AVX-512"
                continue
            fi
            env=(MKL_CBWR=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512) ;;
        *) echo "unknown path $path (oldest, avx2, avx512)" >&2; exit 2 ;;
    esac
    echo "== $path: ${env[*]}"
    env "${env[@]}" "$python" -c "import torch; print('ATen CPU capability:', torch.backends.cpu.get_cpu_capability())"
    if ! env "${env[@]}" "$python" -m pytest "${tests[@]}"; then
        failed+=("$path")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed on: ${failed[*]}" >&2
    exit 1
fi

#!/usr/bin/env bash
# The GPU checks, for a host with a GPU and CUDA 12.8+ but without Rust (such as a lent
# GPU machine). Two halves:
#
#   ./scripts/gpu-check.sh prepare   # here: build the release test binaries (cuda, cudnn,
#                                    # ops, half_ops; scripts/gpu/cudnn.sh runs the cuDNN checks), the replay
#                                    # example, salusd, salusctl and salus-bench into .gpu/
#   ./scripts/gpu-check.sh run       # there, from the repository root (.gpu/ carried
#                                    # along): CUDA tests (background pieces among them),
#                                    # every op test on the GPU, salusd
#                                    # on the GPU, 10-step parity of the four target models
#                                    # with PyTorch on the same GPU (TF32 off), mixed
#                                    # precision (tests/test_amp.py) through salusd on the
#                                    # GPU against CPU eager autocast, the bench
#   ./scripts/gpu-check.sh run --no-bench   # the same without the bench (a correctness
#                                    # check that fits a short lease)
#   ./scripts/gpu-check.sh speed     # there: the transformer models' profiles (the stock
#                                    # encoder with and without dropout, the GPT decoder)
#                                    # with f32 attention through
#                                    # cuBLAS, then in register tiles (SALUS_CUDA_ATTENTION)
#   ./scripts/gpu-check.sh amp-bench # there: bf16 autocast steps of resnet50, vit_b_16
#                                    # and the GPT decoder against eager PyTorch autocast
#                                    # on the same GPU (salus-bench cuda --amp bf16)
#   ./scripts/gpu-check.sh protection # there: background iterations in pieces, with SM
#                                    # partitions and paced (tests/cuda_background.rs), then
#                                    # benches/online_offline.py with salusd on the GPU
#                                    # (offline lanes on low-priority streams and SM
#                                    # partitions, NVML load read where the host has it)
#   ./scripts/gpu-check.sh host-cpu  # there: the numerical tests on the host's own CPU
#                                    # (another vendor than the development machine's,
#                                    # perhaps), with its CPU model; needs pytest and
#                                    # torchvision
#
# Logs go to $OUT (or .gpu/out). PyTorch must be importable by python3 for the parity
# check and the bench. If the loader cannot find libnvrtc/libcublas by itself, source
# scripts/cuda-libs.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    set -e
    mkdir -p .gpu
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
    bins=$(cargo test --release --locked -p salus-testkit --test cuda --test cudnn --test ops \
        --test half_ops --test cuda_background --no-run \
        --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
    while read -r name path; do cp "$path" ".gpu/$name"; done <<< "$bins"
    cargo build --release --locked -p salusd -p salusctl -p salus-bench
    cargo build --release --locked -p salus-testkit --example replay_reference
    cp target/release/salusd target/release/salusctl target/release/salus-bench \
        target/release/examples/replay_reference .gpu/
    strip .gpu/* 2>/dev/null || true
    du -sh .gpu
    ;;
run)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    export RUST_BACKTRACE=1 PYTHONUNBUFFERED=1 PYTHONPATH=adaptors/python
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    echo "== CUDA device tests"
    timeout 150 .gpu/cuda --test-threads=1 --nocapture > "$out/cuda.log" 2>&1
    echo "rc=$?"; grep -E "^test |test result|panicked|^background lane" "$out/cuda.log"
    echo "== background iterations in pieces (SM partitions)"
    timeout 120 .gpu/cuda_background --test-threads=1 --nocapture > "$out/background.log" 2>&1
    echo "rc=$?"; grep -E "^test |test result|panicked|^background_" "$out/background.log"
    echo "== every op test on the GPU"
    SALUS_TEST_DEVICE=cuda timeout 100 .gpu/ops --test-threads=4 > "$out/ops.log" 2>&1
    echo "rc=$?"; grep -E "test result|panicked at" "$out/ops.log"
    echo "== every op the autocast-traced models run in f16 and bf16, on the GPU"
    SALUS_TEST_DEVICE=cuda timeout 100 .gpu/half_ops --test-threads=4 > "$out/half_ops.log" 2>&1
    echo "rc=$?"; grep -E "test result|panicked at" "$out/half_ops.log"
    echo "== salusd --device cuda:0"
    .gpu/salusd --socket /tmp/salus-gpu-check.sock --memory 8GiB > "$out/salusd.log" 2>&1 &
    for _ in $(seq 100); do [ -S /tmp/salus-gpu-check.sock ] && break; sleep 0.1; done
    .gpu/salusctl --socket /tmp/salus-gpu-check.sock status | head -2
    kill -TERM $! && wait
    echo "== 10 steps of the target models against PyTorch on the same GPU (TF32 off)"
    timeout 300 python3 -c "
import torch
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
from salus import reference
reference.main(['/tmp/salus-gpu-ref', '--steps', '10', '--device', 'cuda'])" > "$out/reference.log" 2>&1
    for m in mlp cnn gpt resnet18; do
        timeout 60 .gpu/replay_reference "/tmp/salus-gpu-ref/$m" --device cuda \
            > "$out/$m.json" 2> "$out/$m.err" || echo "$m failed: $(tail -1 "$out/$m.err")"
    done
    python3 benches/gpu_parity.py /tmp/salus-gpu-ref "$out"
    echo "== mixed precision through salusd on the GPU (tests/test_amp.py; needs pytest)"
    if python3 -c "import pytest" 2>/dev/null; then
        SALUSD=.gpu/salusd timeout 400 python3 -m pytest adaptors/python/tests/test_amp.py -q \
            > "$out/amp.log" 2>&1
        echo "rc=$?"; tail -5 "$out/amp.log"
    else
        echo "skipped: pytest is not installed"
    fi
    [ "${2:-}" = "--no-bench" ] && exit 0
    echo "== salus-bench cuda"
    SALUS_PYTHON=python3 timeout 300 .gpu/salus-bench cuda --json --dir /tmp/salus-gpu-bench \
        > "$out/bench.json" 2> "$out/bench.err"
    echo "rc=$?"; cat "$out/bench.json"
    ;;
speed)
    out=${OUT:-.gpu/out}
    for attention in cublas tiled; do
        echo "== profile, f32 attention: $attention"
        SALUS_CUDA_ATTENTION=$attention OUT="$out/speed-$attention" PROFILE_TIMEOUT=240 \
            ./scripts/gpu/profile.sh transformer transformer_nodrop gpt512
    done
    ;;
amp-bench)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    echo "== salus-bench cuda --amp bf16"
    SALUS_PYTHON=python3 timeout 400 .gpu/salus-bench cuda --amp bf16 --json \
        --dir /tmp/salus-gpu-amp-bench --iterations 10 \
        --model resnet50 --model vit_b_16 --model gpt512 \
        > "$out/amp_bench.json" 2> "$out/amp_bench.err"
    echo "rc=$?"; cat "$out/amp_bench.json"; tail -5 "$out/amp_bench.err"
    ;;
protection)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
    for green in 1 0; do
        echo "== background iterations in pieces (SALUS_CUDA_GREEN=$green)"
        SALUS_CUDA_GREEN=$green timeout 120 .gpu/cuda_background --test-threads=1 --nocapture \
            > "$out/background_$green.log" 2>&1
        echo "rc=$?"; grep -E "^test |test result|panicked|^background_" "$out/background_$green.log"
    done
    echo "== a served model under open-loop load beside two trainers, salusd on the GPU"
    timeout 300 python3 benches/online_offline.py --device cuda:0 --seconds 15 --load 0.3 \
        --trainers 2 --salusd .gpu/salusd --json > "$out/protection.json" 2> "$out/protection.err"
    echo "rc=$?"; cat "$out/protection.json"; tail -5 "$out/protection.err"
    ;;
host-cpu)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    export PYTHONPATH=adaptors/python
    echo "== the numerical tests on this host's CPU"
    grep -m1 "model name" /proc/cpuinfo
    python3 -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
    SALUSD=.gpu/salusd CUDA_VISIBLE_DEVICES= timeout 500 python3 -m pytest -q \
        adaptors/python/tests/test_parity.py adaptors/python/tests/test_optimizers.py \
        adaptors/python/tests/test_torch_loops.py > "$out/host_cpu.log" 2>&1
    echo "rc=$?"; tail -5 "$out/host_cpu.log"
    ;;
*)
    echo "usage: $0 prepare|run|amp-bench|protection|host-cpu" >&2
    exit 2
    ;;
esac

"""Compares replays of the target models on the GPU (replay_reference --device cuda)
with PyTorch's steps on the same GPU (the reference runs' manifests): the largest relative
loss error over the steps and the worst final tensor, as in test_cpu_engine.py.

    python benches/gpu_parity.py REFERENCE_DIR REPLAY_DIR
"""
import json, sys
from pathlib import Path
ref = Path(sys.argv[1]); out = Path(sys.argv[2])
for model in ["mlp", "cnn", "gpt", "resnet18"]:
    manifest = json.loads((ref / model / "manifest.json").read_text())
    ours = json.loads((out / f"{model}.json").read_text())
    loss_rel = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(ours["losses"], manifest["losses"]))
    worst = max(((e["max_abs"] / max(1.0, e["max_value"]), n) for n, e in ours["final"].items()))
    print(f"{model:9s} steps {len(ours['losses'])} loss rel err {loss_rel:.2e}  worst final {worst[0]:.2e} ({worst[1]})")

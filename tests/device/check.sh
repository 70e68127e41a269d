#!/usr/bin/env bash
# Every GPU test, on the lent GPU machine. Runs each test binary that pack.sh carried with its
# ignored (GPU) tests included and QUIRE_REQUIRE_GPU=1, so a missing GPU is a failure, not a skip;
# exits non-zero if any binary fails. The `::wgpu` forms of the tests run too (through NVIDIA's
# Vulkan driver) when the set was packed with PACK_WGPU=1 and .dev/vk.tar is carried; otherwise
# they are skipped (CI runs them on lavapipe).
# Usage: bash tests/device/check.sh [NAME] (NAME: the unpacked binary set, default "new").
set -euo pipefail
source "$(dirname "$0")/common.sh"
set_name=${1:-new}
B=$W/$set_name
gpu_stamp
model_ready || { echo "check.sh: the default model is missing (carry .dev/model.part1 and .dev/model.part2)"; exit 1; }
export QUIRE_REQUIRE_GPU=1
export QUIRE_PARITY_MODEL=$HOME/.cache/quire/SmolLM2-135M-Instruct.Q4_1.gguf
# HF parity against transformers (PyTorch on the GPU machine): tests/hf writes the reference logits.
if python3 -c 'import torch, transformers' 2>/dev/null; then
    python3 tests/hf/cuda_check.py --out /root/hf-cuda > "$OUT/hf-ref.log" 2>&1 && export QUIRE_HF_CUDA_DIR=/root/hf-cuda
fi
[ -n "${QUIRE_HF_CUDA_DIR:-}" ] || echo "check.sh: no transformers here: HF parity tests will fail (QUIRE_REQUIRE_GPU=1)"
skip=(--skip ::wgpu)
if [ -f "$B/WGPU" ]; then
    vk_setup && skip=()
fi
failed=0
for t in "$B"/tests/*; do
    name=$(basename "$t")
    if "$t" --include-ignored --skip exp8_exhaustive "${skip[@]}" --test-threads 1 > "$OUT/check-$name.log" 2>&1; then
        echo "ok     $name: $(grep -E '^test result' "$OUT/check-$name.log" | tail -1)"
    else
        echo "FAILED $name (log: check-$name.log):"
        grep -E '^test .* FAILED|panicked|^test result' "$OUT/check-$name.log" | head -20
        failed=1
    fi
done
[ "$failed" = 0 ] && echo "check.sh: every GPU test binary passed" || { echo "check.sh: failures above"; exit 1; }

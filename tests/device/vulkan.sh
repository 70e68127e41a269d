#!/usr/bin/env bash
# The wgpu side-by-side table on the lent GPU machine, through NVIDIA's Vulkan driver: quire
# --backend wgpu against llama.cpp's Vulkan backend (and quire --backend cuda) on the same files in
# the same call. The machine has NVIDIA's Vulkan ICD but not the loader; the loader, the Vulkan
# headers and a shader compiler travel as Debian packages in .dev/vk.tar (made on the development
# machine: see PERF.md's "wgpu on the H100" section for how). Subcommands, so a run can be split
# over calls of at most 10 minutes:
#   bash tests/device/vulkan.sh setup          # unpack the loader (every call starts with it)
#   bash tests/device/vulkan.sh llamacpp       # build llama.cpp with -DGGML_VULKAN=ON (~8 min), binaries to $OUT
#   bash tests/device/vulkan.sh models         # 8B f16 and Q4_K_M random-weight files (needs llama-quantize)
#   bash tests/device/vulkan.sh peer           # llama.cpp Vulkan rows
#   bash tests/device/vulkan.sh quire [NAME]   # quire --backend wgpu rows (binary set NAME, default new)
# Results: $OUT/vk-*.json (llama-bench compatible JSON) and printed tables.
set -euo pipefail
source "$(dirname "$0")/common.sh"
LV=/root/lc/llama.cpp/build-vk/bin
F16=$W/llama3-8b-f16.gguf
Q4KM=$W/llama3-8b-q4_k_m.gguf
REPS=${REPS:-3}
tag() { basename "$1" .gguf; }

vk_setup

cmd=${1:-}
shift || true
case "$cmd" in
setup)
    echo "Vulkan loader unpacked; ICD $VK_DRIVER_FILES"
    ;;
llamacpp)
    if [ ! -x "$LV/llama-bench" ]; then
        if [ -f .dev/llama-vk.tar.xz.aa ]; then
            # Carried back from an earlier call (the files from $OUT come back in parts of < 16 MiB).
            mkdir -p "$LV" && cat .dev/llama-vk.tar.xz.* | tar -xJf - -C "$LV"
        else
            mkdir -p /root/lc && [ -d /root/lc/llama.cpp ] || tar -xJf .dev/llamacpp-src.tar.xz -C /root/lc
            tar -xJf /root/vk/ggml-vulkan.tar.xz -C /root/lc/llama.cpp/ggml/src
            for d in pocs app; do mkdir -p /root/lc/llama.cpp/$d && touch /root/lc/llama.cpp/$d/CMakeLists.txt; done
            cd /root/lc/llama.cpp
            cmake -B build-vk -DGGML_VULKAN=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
                -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/cmake-vk.log" 2>&1 \
                || { tail -30 "$OUT/cmake-vk.log"; exit 1; }
            grep -E "GLSLC|glslc|Vulkan" "$OUT/cmake-vk.log" | head -20
            cmake --build build-vk -j 16 --target llama-bench llama-batched-bench llama-quantize > "$OUT/build-vk.log" 2>&1 \
                || { tail -30 "$OUT/build-vk.log"; exit 1; }
            cd - > /dev/null
            tar -cJf - -C "$LV" llama-bench llama-batched-bench llama-quantize | split -b 15M - "$OUT/llama-vk.tar.xz."
            ls -la "$OUT"/llama-vk.tar.xz.*
        fi
    fi
    "$LV/llama-bench" --list-devices 2>&1 | tail -5 || true
    ;;
models)
    Q=$W/${1:-new}/quire
    [ -f "$F16" ] || "$Q" make-model --preset llama3-8b --dtype f16 "$F16" 2>&1 | tail -1
    [ -f "$Q4KM" ] || "$LV/llama-quantize" "$F16" "$Q4KM" Q4_K_M > "$OUT/quantize.log" 2>&1
    ls -la "$F16" "$Q4KM"
    ;;
peer)
    for f in "$F16" "$Q4KM"; do
        "$LV/llama-bench" -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r "$REPS" -o json > "$OUT/vk-peer-$(tag "$f").json"
        python3 -c "import json,sys; [print(r['model_type'], r['n_prompt'], r['n_gen'], round(r['avg_ts'],1), '±', round(r['stddev_ts'],1), r['gpu_info'], r['backends']) for r in json.load(open(sys.argv[1]))]" "$OUT/vk-peer-$(tag "$f").json"
    done
    ;;
quire)
    name=${1:-new}
    Q=$W/$name/quire
    "$Q" adapters
    for f in "$F16" "$Q4KM"; do
        "$Q" bench -m "$f" --backend wgpu -p 512 -n 128 -r "$REPS" -o json > "$OUT/vk-$name-$(tag "$f").json" \
            2> "$OUT/vk-$name-$(tag "$f").log" || tail -5 "$OUT/vk-$name-$(tag "$f").log"
        python3 -c "import json,sys; [print(r['model_type'], r['n_prompt'], r['n_gen'], round(r['avg_ts'],1), '±', round(r['stddev_ts'],1)) for r in json.load(open(sys.argv[1]))]" "$OUT/vk-$name-$(tag "$f").json" || true
    done
    ;;
*)
    sed -n '2,13p' "$0"; exit 2 ;;
esac

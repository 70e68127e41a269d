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
#   bash tests/device/vulkan.sh quire [NAME]   # quire rows, wgpu then CUDA (binary set NAME, default new)
#   bash tests/device/vulkan.sh batched [NAME] # 64 sequences decoding, wgpu then CUDA
#   bash tests/device/vulkan.sh micro [NAME]   # roofline, GEMV/GEMM microbenchmarks, attn-bench, profile
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
    # tg128 and pp512 of both files on wgpu (plain, and chain decode of 16 steps per submission),
    # then the same files on quire's CUDA backend (same call, same machine).
    name=${1:-new}
    Q=$W/$name/quire
    "$Q" adapters
    for f in "$F16" "$Q4KM"; do
        for be in wgpu cuda; do
            chain=(); [ "$be" = wgpu ] && chain=(--chain 16)
            "$Q" bench -m "$f" --backend "$be" -p 512 -n 128 -r "$REPS" "${chain[@]}" -o json \
                > "$OUT/vk-$name-$be-$(tag "$f").json" 2> "$OUT/vk-$name-$be-$(tag "$f").log" \
                || { tail -5 "$OUT/vk-$name-$be-$(tag "$f").log"; continue; }
            python3 -c "import json,sys; [print(sys.argv[2], r['model_type'], 'pp', r['n_prompt'], 'tg', r['n_gen'], r.get('test',''), round(r['avg_ts'],1), '±', round(r['stddev_ts'],1)) for r in json.load(open(sys.argv[1]))]" "$OUT/vk-$name-$be-$(tag "$f").json" "$be"
        done
    done
    ;;
batched)
    name=${1:-new}
    Q=$W/$name/quire
    for be in wgpu cuda; do
        echo "quire bench $(tag "$F16") -b 64 --backend $be:"
        "$Q" bench -m "$F16" --backend "$be" -p 512 -n 128 -b 64 -r 1 2>&1 | grep -E "^\| (llama|qwen)|rror" || true
    done
    ;;
micro)
    # The adapter's ceilings and each kernel family's microbenchmark (GPU timestamps).
    name=${1:-new}
    B=$W/$name
    "$B/quire" roofline --backend wgpu 2>&1 | tail -15 || true
    "$B/wgpu_gemv_bench" --types f16,q4_0,q4_k,q6_k,q8_0 2>&1 | tail -30 || true
    "$B/wgpu_gemm_bench" 2>&1 | tail -30 || true
    echo "attn-bench seed config (B16 Hq16 Hkv8 D128 block 32, 1,024 keys):"
    "$B/quire" attn-bench --backend wgpu --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 \
        --max-blocks 64 --active-blocks 32 --repeats 200 --csv "$OUT/attn-seed.csv" 2>&1 | tail -12 || true
    echo "attn-bench decode B16 L4096 (Hq32 Hkv8 D128 block 16):"
    "$B/quire" attn-bench --backend wgpu --batch 16 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 16 \
        --max-blocks 256 --active-blocks 256 --repeats 100 2>&1 | tail -12 || true
    "$B/quire" profile -m "$F16" --backend wgpu -p 512 -d 512 -r 3 2>&1 | tail -40 || true
    ;;
*)
    sed -n '2,15p' "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# The wgpu one-token decode step on Llama-3-8B f16 (random weights) through Vulkan: binary sets
# (pack.sh with PACK_WGPU=1, renamed bin-NAME.tar.xz) measured alternately in one call.
#   bash .dev/wgd/wgpu_decode.sh "old new" [attn]
# The device tool sends the session's checkout, not a helper's worktree: copy this script, the
# binary sets and .dev/vk.tar into .dev/wgd of that checkout (git-ignored) and carry .dev/wgd.
# tg128 (`quire bench -p 0 -n 128 -r 2`) of each set twice, alternating; the last set with
# --chain 16; `quire profile -p 16 -d 512 -r 3` of each set;
# with `attn`, wgpu_decode_bench's split targets for one decode row. Logs in $OUT.
set -uo pipefail
# A helper's files travel in .dev/wgd of the session's checkout (carry it): this script, the
# binary sets (bin-NAME.tar.xz) and the Vulkan loader packages (vk.tar).
D=${WGD:-.dev/wgd}
source tests/device/common.sh
for t in "$D"/bin-*.tar.xz; do
    name=$(basename "$t" .tar.xz); name=${name#bin-}
    rm -rf "${W:?}/$name" && mkdir -p "$W/$name" && tar -xJf "$t" -C "$W/$name"
done
if [ ! -f /root/vk.done ]; then
    mkdir -p /root/vk && tar -xf "$D/vk.tar" -C /root/vk
    for f in /root/vk/vkdebs/*.deb; do dpkg -x "$f" /; done
    ldconfig && touch /root/vk.done
fi
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json WGPU_BACKEND=vulkan
sets=(${1:-old new})
last=${sets[${#sets[@]}-1]}
F=$W/llama3-8b-f16.gguf
[ -f "$F" ] || "$W/$last/quire" make-model --preset llama3-8b --dtype f16 "$F" > "$OUT/make.log" 2>&1
tg() {
    local name=$1; shift
    "$W/$name/quire" bench -m "$F" --backend wgpu -p 0 -n 128 -r 2 "$@" > "$OUT/tg.log" 2>&1
    grep -E "tg128" "$OUT/tg.log" | tail -1 | awk -F'|' '{print $8}'
    grep -iE "error|panic" "$OUT/tg.log" | head -3
}
: > "$OUT/summary.txt"
for round in 1 2; do
    for s in "${sets[@]}"; do
        echo "tg128 round $round $s: $(tg "$s")" | tee -a "$OUT/summary.txt"
    done
done
echo "tg128 $last --chain 16: $(tg "$last" --chain 16)" | tee -a "$OUT/summary.txt"
for s in "${sets[@]}"; do
    "$W/$s/quire" profile -m "$F" --backend wgpu -p 16 -d 512 -r 3 > "$OUT/prof-$s.txt" 2>&1
done
if [ "${2:-}" = attn ]; then
    "$W/$last/wgpu_decode_bench" --shapes 1:32:8:128:16:128,1:32:8:128:16:512,1:32:8:128:16:1024,1:32:8:128:16:4096,16:16:8:128:32:1024 \
        --keys 2 --targets 16,32,64,128,256,512,1024 --samples 10 --no-ops > "$OUT/attn.txt" 2>&1
    grep -E "^##|\*" "$OUT/attn.txt"
fi
for s in "${sets[@]}"; do
    echo "== profile $s"; grep -E "decode|wgpu:|matmul|attn|rms|rope|outside|step" "$OUT/prof-$s.txt" | tail -22
done
cat "$OUT/summary.txt"

# Sourced by check.sh and bench.sh on the lent GPU machine (repository root, binaries built on the
# development machine and carried in .dev/ by pack.sh). Sets W (work folder), Q (quire), LB
# (llama.cpp's binaries) and the library path; unpacks what the call carried.
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0
# NCCL for tensor-parallel groups: PyTorch's nvidia-nccl wheel ships libnccl.so.2.
nccl_lib=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "nccl", "lib"))' 2>/dev/null || true)
[ -n "$nccl_lib" ] && [ -d "$nccl_lib" ] && export LD_LIBRARY_PATH=$nccl_lib:$LD_LIBRARY_PATH
W=${QUIRE_DEV_DIR:-/root/quire-dev}
OUT=${OUT:-/tmp/out}
LB=/root/lc/llama.cpp/build/bin
mkdir -p "$W" "$OUT"
# .dev/bin-NAME.tar.xz unpacks into $W/NAME (NAME: "new", or "old" for a before/after pair).
for t in .dev/bin-*.tar.xz; do
    [ -f "$t" ] || continue
    name=$(basename "$t" .tar.xz); name=${name#bin-}
    rm -rf "${W:?}/$name" && mkdir -p "$W/$name" && tar -xJf "$t" -C "$W/$name"
done
# Test binaries read tests/data under the checkout they were built in (pack.sh records it).
for r in "$W"/*/BUILD_ROOT; do
    [ -f "$r" ] || continue
    root=$(cat "$r")
    [ -e "$root" ] || { mkdir -p "$(dirname "$root")" && ln -s "$PWD" "$root"; }
done
# The default model travels in two parts over two calls (one call carries at most 64 MiB).
for p in .dev/model.part*; do [ -f "$p" ] && cp "$p" "$W/"; done
model_ready() {
    local dst=$HOME/.cache/quire/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$dst" ] && return 0
    [ -f "$W/model.part1" ] && [ -f "$W/model.part2" ] || return 1
    mkdir -p "$(dirname "$dst")" && cat "$W"/model.part1 "$W"/model.part2 > "$dst"
}
gpu_stamp() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
}

# Vulkan for the wgpu backend: NVIDIA's ICD is there, the loader is not; it travels as Debian
# packages in .dev/vk.tar (see vulkan.sh). Unpacked once per machine.
vk_setup() {
    if [ ! -f /root/vk.done ]; then
        [ -f .dev/vk.tar ] || { echo "vk_setup: carry .dev/vk.tar (the Vulkan loader packages)"; return 1; }
        mkdir -p /root/vk && tar -xf .dev/vk.tar -C /root/vk
        for f in /root/vk/vkdebs/*.deb; do dpkg -x "$f" /; done
        ldconfig
        touch /root/vk.done
    fi
    export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
    [ -f "$VK_DRIVER_FILES" ] || VK_DRIVER_FILES=$(ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json 2>/dev/null | head -1)
    export WGPU_BACKEND=vulkan
}

#!/usr/bin/env bash
# The CUDA checks and timings, run on the lent GPU machine from the repository root with the
# binaries built here carried in .dev/ (see PERF.md, "CUDA"). Stage 1 needs .dev/bin.tar.xz;
# stage 2 also the default model, carried in two parts (.dev/model.part1, .dev/model.part2)
# because one call carries at most 64 MiB.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
W=/root/quire-dev
OUT=${OUT:-/tmp/out}
mkdir -p "$W" "$OUT"
# Test binaries look for tests/data under the build machine's checkout path.
mkdir -p /work && [ -e /work/main ] || ln -s "$PWD" /work/main
[ -f .dev/bin.tar.xz ] && tar -xJf .dev/bin.tar.xz -C "$W"
for p in .dev/model.part*; do [ -f "$p" ] && cp "$p" "$W/"; done
Q=$W/quire
# The device's checkout may lag: stamp results with the commit the binaries were built from.
[ -f "$W/COMMIT" ] && export QUIRE_COMMIT=$(cat "$W/COMMIT")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
# The three random f16 files of real shapes, written once per machine.
make_models() {
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
    done
}
# The decode attention goals' configurations (issue 6), each beside PyTorch's SDPA in the same call.
attn_goals() {
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "parity paged|^\| paged"
    python3 tests/device/sdpa_bench.py 16 1024 16 8 128 f16
    local cfg
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "parity paged|^\| paged"
        python3 tests/device/sdpa_bench.py $1 $2 32 8 128 bf16
    done
}
case "${1:-1}" in
0) ;;  # unpack and keep the carried files only
1)
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | tail -8
    for preset in smollm2-135m llama3.2-1b; do
        "$Q" make-model --preset $preset --dtype f16 "$W/$preset-f16.gguf" 2>&1 | tail -1
    done
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 --csv "$OUT/attn-seed.csv" 2>&1 | tail -8
    python3 tests/device/sdpa_bench.py 16 1024 16 8 128 f16
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "parity paged|^\| paged|^\| dense"
        python3 tests/device/sdpa_bench.py $1 $2 32 8 128 bf16
    done
    for preset in smollm2-135m llama3.2-1b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 512 -n 128 -r 5 2>&1 | grep -E "^\||build"
    done
    ;;
attn)
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep "test result"
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "parity paged|^\| paged|^\| dense|splits"
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "parity paged|^\| paged|splits"
    done
    ;;
2)
    cat "$W"/model.part* > "$W/smollm2-q4_1.gguf"
    sha256sum "$W/smollm2-q4_1.gguf"
    QUIRE_PARITY_MODEL="$W/smollm2-q4_1.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -vE "^\s*$" | tail -40
    "$Q" bench -m "$W/smollm2-q4_1.gguf" --backend cuda -p 512 -n 128 -r 5 2>&1 | grep -E "^\||build"
    ;;
bench)
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" make-model --preset $preset --dtype f16 "$W/$preset-f16.gguf" 2>&1 | tail -1
    done
    "$Q" generate -m "$W/llama3.2-1b-f16.gguf" --backend cuda --prompt "hello world" --max-tokens 8 2>&1 | tail -1
    for m in smollm2-135m-f16 llama3.2-1b-f16 llama3-8b-f16; do
        "$Q" bench -m "$W/$m.gguf" --backend cuda -p 512 -n 128 -r 5 2>&1 | grep -E "^\| llama"
        QUIRE_CUDA_GRAPHS=0 "$Q" bench -m "$W/$m.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed 's/$/  (graphs off)/'
    done
    "$Q" bench -m "$W/llama3-8b-f16.gguf" --backend cuda -p 512 -n 128 -b 64 -r 3 2>&1 | grep -E "^\| llama"
    ;;
quant)
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_quant --test-threads 1 2>&1 | grep -E "^test |test result|panicked|rror" | head -30
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked"
    "$W"/cuda_matmul_bench --reps 100
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" make-model --preset $preset --dtype q4_0 "$W/$preset-q4_0.gguf" 2>&1 | tail -1
    done
    for m in smollm2-135m-q4_0 llama3.2-1b-q4_0 llama3-8b-q4_0; do
        "$Q" bench -m "$W/$m.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama"
    done
    ;;
llamacpp)  # build llama.cpp's CUDA peer (.dev/llamacpp-src.tar.xz, pruned sdist) in the foreground:
    # background processes end with the call (~4.5 min on 16 cores)
    mkdir -p /root/lc && tar -xJf .dev/llamacpp-src.tar.xz -C /root/lc
    # llama.cpp's CMakeLists adds pocs/ unconditionally; a pruned tar without it fails to configure.
    mkdir -p /root/lc/llama.cpp/pocs && touch /root/lc/llama.cpp/pocs/CMakeLists.txt
    (cd /root/lc/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        > /root/lc/cmake.log 2>&1 && cmake --build build -j 16 --target llama-bench llama-batched-bench \
        > /root/lc/build.log 2>&1; echo "llama.cpp build rc $?" >> /root/lc/build.log)
    tail -1 /root/lc/build.log
    ;;
checks)
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_quant --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | head
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops 2>&1 | grep -E "test result|panicked"
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "^test |test result|panicked|worst"
    python3 tests/hf/cuda_check.py --out /root/hf-cuda 2>&1 | grep -E "^  |python"
    QUIRE_HF_CUDA_DIR=/root/hf-cuda QUIRE_REQUIRE_GPU=1 "$W"/hf_cuda --nocapture 2>&1 | grep -E "rel err|test result|panicked|parts"
    "$Q" make-model --preset qwen3-30b-a3b --layers 2 --dtype q4_0 "$W/moe2.gguf" 2>&1 | tail -1
    QUIRE_PARITY_MODEL="$W/moe2.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture teacher 2>&1 | grep -E "CUDA|CPU|test result|panicked"
    "$Q" roofline --backend cuda 2>&1 | tail -4
    "$Q" make-model --preset llama3.2-1b --dtype f16 "$W/llama3.2-1b-f16.gguf" 2>&1 | tail -1
    "$Q" bench -m "$W/llama3.2-1b-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\||ceilings"
    ;;
sbs)  # side by side with llama.cpp's CUDA build (stage llamacpp first)
    LB=/root/lc/llama.cpp/build/bin
    tail -2 /root/lc/build.log
    specs=("llama3-8b f16" "llama3.2-1b f16" "smollm2-135m f16")
    [ -n "${SBS_MOE:-}" ] && specs+=("qwen3-30b-a3b q4_0")  # the 17 GB MoE file: SBS_MOE=1
    for spec in "${specs[@]}"; do
        set -- $spec
        f="$W/$1-$2.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $1 --dtype $2 "$f" 2>&1 | tail -1
        "$LB"/llama-bench -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)"
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)"
    done
    "$LB"/llama-batched-bench -m "$W/llama3-8b-f16.gguf" -ngl 99 -fa 1 -c 50000 -npp 512 -ntg 128 -npl 64 2>&1 | grep -E "^\|" | tail -2
    "$Q" bench -m "$W/llama3-8b-f16.gguf" --backend cuda -p 512 -n 128 -b 64 -r 3 2>&1 | grep -E "^\| llama"
    ;;
kern)  # the decode attention kernel: parity tests, attn-bench beside SDPA, f16 matmul timings
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED|worst" | head -12
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "parity paged|^\| paged|^\| dense|splits"
    python3 tests/device/sdpa_bench.py 16 1024 16 8 128 f16
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "parity paged|^\| paged|splits"
        python3 tests/device/sdpa_bench.py $1 $2 32 8 128 bf16
    done
    "$W"/cuda_matmul_bench --reps 100 2>&1 | tail -30
    ;;
e2e)  # end to end, f16 shapes
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)"
    done
    "$Q" bench -m "$W/llama3-8b-f16.gguf" --backend cuda -p 512 -n 128 -b 64 -r 3 2>&1 | grep -E "^\| llama"
    ;;
pf)  # the prefill kernel: parity, attn-bench prefill mode, 8B pp512 end to end with its profile
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED|worst" | head -20
    for cfg in "1 512 512" "4 2048 512" "16 1024 64"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --mode prefill --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 16 --max-blocks $(( $2 / 16 )) --active-blocks $(( $2 / 16 )) --query-len $3 --repeats 50 2>&1 | grep -E "parity paged|^\| paged|splits"
    done
    for preset in llama3-8b llama3.2-1b smollm2-135m; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)"
    done
    "$Q" profile -m "$W/llama3-8b-f16.gguf" --backend cuda -p 512 -r 3 2>&1 | head -60
    ;;
chain)  # chain decode: parity with step-by-step decoding, then tg128 with and without chains
    for d in f16 q4_0; do
        f="$W/smollm2-135m-$d.gguf"
        "$Q" make-model --preset smollm2-135m --dtype $d "$f" 2>&1 | tail -1
        QUIRE_PARITY_MODEL="$f" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture chain 2>&1 | grep -E "chain decode|test result|panicked"
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| (llama|qwen)"
    done
    "$Q" generate -m "$W/smollm2-135m-f16.gguf" --backend cuda --prompt "hello" --max-tokens 8 2>&1 | tail -1
    ;;
gemv)  # the one-token GEMV: parity, microbenchmark beside cuBLAS, tg128 with it on and off
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "^test |test result|panicked"
    "$W"/cuda_matmul_bench --reps 100 2>&1 | grep -E "F16|shape|---"
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| (llama|qwen)"
        QUIRE_CUDA_GEMV=0 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)" | sed 's/$/  (cuBLAS)/'
    done
    "$Q" profile -m "$W/smollm2-135m-f16.gguf" --backend cuda -p 16 -r 3 2>&1 | sed -n '/decode step/,$p' | head -20
    ;;
sample)  # sampling on the GPU: kernel against the host sampler, engine wiring, a sampled generation
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_sample --test-threads 1 --nocapture 2>&1 | grep -vE "^\s*$" | tail -25
    f="$W/smollm2-135m-f16.gguf"
    [ -f "$f" ] || "$Q" make-model --preset smollm2-135m --dtype f16 "$f" 2>&1 | tail -1
    QUIRE_PARITY_MODEL="$f" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture sampling chain 2>&1 | grep -E "differ|chain decode|test result|panicked" | tail -8
    QUIRE_PARITY_MODEL="$f" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture chain 2>&1 | grep -E "test result|panicked"
    "$Q" generate -m "$f" --backend cuda --prompt "hello" --max-tokens 64 --temperature 0.8 --top-k 40 --top-p 0.95 --seed 3 2>&1 | tail -1
    "$Q" generate -m "$f" --backend cuda --prompt "hello" --max-tokens 64 2>&1 | tail -1
    ;;
recheck)  # after refactors: kernel parity, K-quant matmul timings, one attention and one e2e number
    for t in cuda_attention cuda_quant cuda_ops; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 2>&1 | grep -E "test result|panicked"
    done
    "$W"/cuda_matmul_bench --reps 100 2>&1 | grep -E "Q4_K|Q5_K|Q6_K|Q4_0 \|"
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 16 --max-blocks 256 --active-blocks 256 --repeats 100 2>&1 | grep -E "parity paged|^\| paged"
    "$Q" make-model --preset llama3.2-1b --dtype f16 "$W/llama3.2-1b-f16.gguf" 2>&1 | tail -1
    "$Q" bench -m "$W/llama3.2-1b-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama"
    ;;
diag)  # CUDA vs CPU on a truncated default model (.dev/smol-2l.gguf: its first 2 layers)
    QUIRE_PARITY_MODEL=.dev/smol-2l.gguf QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture teacher 2>&1 | grep -E "CUDA|CPU|test result"
    ;;
kq)  # stored-weights parity (default model, carried in two parts) and K-quants on CUDA
    cat "$W"/model.part* > "$W/smollm2-q4_1.gguf"
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_quant --test-threads 1 2>&1 | grep -E "^test |test result|panicked|rror" | head -30
    QUIRE_PARITY_MODEL="$W/smollm2-q4_1.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "CUDA|parts at|test result|panicked" | head -40
    "$Q" generate -m "$W/smollm2-q4_1.gguf" --backend cuda --prompt "The capital of France is" --max-tokens 16 2>&1 | tail -2
    for t in q4_k q6_k; do
        "$Q" quantize "$W/smollm2-q4_1.gguf" "$W/smollm2-$t.gguf" --type $t 2>&1 | tail -1
        QUIRE_PARITY_MODEL="$W/smollm2-$t.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture teacher 2>&1 | grep -E "CUDA vs|test result|panicked"
    done
    "$Q" make-model --preset llama3.2-1b --dtype f16 "$W/llama3.2-1b-f16.gguf" 2>&1 | tail -1
    for t in q4_k q5_k q6_k; do
        "$Q" quantize "$W/llama3.2-1b-f16.gguf" "$W/llama3.2-1b-$t.gguf" --type $t 2>&1 | tail -1
        "$Q" bench -m "$W/llama3.2-1b-$t.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama"
    done
    ;;
parity)
    cat "$W"/model.part* > "$W/smollm2-q4_1.gguf"
    QUIRE_PARITY_MODEL="$W/smollm2-q4_1.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "CUDA|CPU|parts at|test result|panicked" | head -40
    "$Q" generate -m "$W/smollm2-q4_1.gguf" --backend cuda --prompt "The capital of France is" --max-tokens 32 2>&1 | tail -2
    "$Q" bench -m "$W/smollm2-q4_1.gguf" --backend cuda -p 512 -n 128 -r 5 2>&1 | grep -E "^\| llama"
    ;;
pdl)  # programmatic dependent launch and the pipelined GEMV: parity, then tg128 on/off in one call
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked"
    QUIRE_CUDA_GEMV_FUSE_K=16384 QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 gemv 2>&1 | grep -E "test result|panicked" | sed 's/$/  (all inputs fused)/'
    for c in 0 1; do
        QUIRE_CUDA_GEMV_CTAS=$c QUIRE_CUDA_GEMV_FUSE_K=16384 QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 gemv 2>&1 | grep -E "test result|panicked" | sed "s/\$/  (fused, $c CTAs per SM)/"
    done
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED"
    make_models
    f="$W/smollm2-135m-f16.gguf"
    QUIRE_PARITY_MODEL="$f" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "CUDA|parts at|chain decode|test result|panicked" | head -20
    "$W"/cuda_matmul_bench --reps 100 2>&1 | grep -E "F16|shape|---"
    QUIRE_CUDA_GEMV_CTAS=0 "$W"/cuda_matmul_bench --reps 100 2>&1 | grep -E "F16" | sed 's/$/  (one group per warp)/'
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        for env in "X=1" "QUIRE_CUDA_PDL=0" "QUIRE_CUDA_GEMV_CTAS=0" "QUIRE_CUDA_GEMV_FUSE_K=16384" "QUIRE_CUDA_GEMV_CTAS=0 QUIRE_CUDA_PDL=0"; do
            env $env "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)" | sed "s/\$/  ($env)/"
        done
    done
    "$Q" bench -m "$W/llama3-8b-f16.gguf" --backend cuda -p 512 -n 128 -b 64 -r 3 2>&1 | grep -E "^\| llama"
    ;;
dec)  # fused RoPE + in-kernel split merge in paged_decode, GEMV shapes: parity, then timings
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED|worst" | head -20
    for sh in 1x8 2x4 1x16 2x8 4x4 4x2; do
        QUIRE_CUDA_GEMV_SHAPE=$sh QUIRE_CUDA_GEMV_FUSE_K=16384 QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked" | sed "s/\$/  (shape $sh)/"
    done
    make_models
    f="$W/smollm2-135m-f16.gguf"
    QUIRE_PARITY_MODEL="$f" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "CUDA|parts at|chain decode|test result|panicked" | head -20
    for sh in 1x8 2x4 1x16 2x8 4x4 4x2; do
        QUIRE_CUDA_GEMV_SHAPE=$sh "$W"/cuda_matmul_bench --reps 100 2>&1 | grep -E "F16 gemv" | sed "s/\$/  ($sh)/"
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)"
    done
    QUIRE_CUDA_PDL=0 "$Q" bench -m "$W/smollm2-135m-f16.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed 's/$/  (PDL off)/'
    for sh in 1x8 2x4 1x16 2x8 4x4 4x2; do
        QUIRE_CUDA_GEMV_SHAPE=$sh "$Q" bench -m "$W/llama3.2-1b-f16.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($sh)/"
    done
    for sh in 1x8 2x4 1x16 2x8; do
        QUIRE_CUDA_GEMV_SHAPE=$sh "$Q" bench -m "$W/llama3-8b-f16.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($sh)/"
    done
    "$Q" profile -m "$W/smollm2-135m-f16.gguf" --backend cuda -p 16 -r 3 2>&1 | sed -n '/decode step/,$p' | head -16
    ;;
tune)  # decode attention options and GEMV shapes, end to end (tg128), after the parity checks
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed 's/$/  (cuda_attention)/'
    QUIRE_CUDA_DECODE_MERGE=0 QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 decode 2>&1 | grep -E "test result|panicked|FAILED" | sed 's/$/  (cuda_attention decode, merge by attention_reduce)/'
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked" | sed 's/$/  (cuda_ops)/'
    make_models
    for env in "X=1" "QUIRE_CUDA_GRAPH_CTX=max QUIRE_CUDA_FUSED_ROPE=0 QUIRE_CUDA_DECODE_MERGE=0"; do
        env $env QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on|f16-dequantized|test result|panicked" | sed "s/\$/  ($env)/"
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        for env in "X=1" "QUIRE_CUDA_FUSED_ROPE=0" "QUIRE_CUDA_DECODE_MERGE=0" "QUIRE_CUDA_FUSED_ROPE=0 QUIRE_CUDA_DECODE_MERGE=0" "QUIRE_CUDA_GRAPH_CTX=max" "QUIRE_CUDA_GRAPH_CTX=max QUIRE_CUDA_FUSED_ROPE=0 QUIRE_CUDA_DECODE_MERGE=0" \
                   "QUIRE_CUDA_GEMV_SHAPE=2x4" "QUIRE_CUDA_GEMV_SHAPE=1x8" "QUIRE_CUDA_GEMV_SHAPE=2x4,1x8" "QUIRE_CUDA_GEMV_SHAPE=4x4" "QUIRE_CUDA_GEMV_SHAPE=4x2,2x4" "QUIRE_CUDA_GEMV_SHAPE=rowbytes"; do
            env $env "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| (llama|qwen)" | sed "s/\$/  ($env)/"
        done
    done
    ;;
final)  # the closing checks in one call after `0` + `llamacpp`: parity, decode attention vs SDPA, side by side
    bash "$0" parity
    attn_goals
    bash "$0" sbs
    for preset in smollm2-135m llama3.2-1b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed 's/$/  (-p 0)/'
    done
    for preset in llama3.2-1b llama3-8b; do
        for k in 0 2048 4096; do
            QUIRE_CUDA_GEMV_FUSE_K=$k "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p 0, fused inputs up to $k)/"
        done
    done
    ;;
pcheck)  # does a prompt test before tg128 slow it? separate processes, clocks and temperatures after each
    for preset in smollm2-135m llama3-8b; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        for p in 0 512 0 512; do
            "$Q" bench -m "$f" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p $p)/"
            nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,temperature.memory,power.draw,clocks_throttle_reasons.active --format=csv,noheader
        done
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 --chain 0 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p 512 again)/"
        QUIRE_CUDA_PDL=0 "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p 512, PDL off)/"
        QUIRE_CUDA_PDL=0 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p 0, PDL off)/"
    done
    ;;
mcheck)  # decode attention with the in-kernel merge against attention_reduce; a small prompt before tg128
    for m in 1 0; do
        export QUIRE_CUDA_DECODE_MERGE=$m
        "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "^\| paged|splits" | sed "s/\$/  (merge $m, seed)/"
        for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
            set -- $cfg
            "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "^\| paged|splits" | sed "s/\$/  (merge $m, B$1 L$2)/"
        done
    done
    unset QUIRE_CUDA_DECODE_MERGE
    f="$W/smollm2-135m-f16.gguf"
    "$Q" make-model --preset smollm2-135m --dtype f16 "$f" 2>&1 | tail -1
    for p in 0 16 64 512; do
        "$Q" bench -m "$f" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama.*tg128" | sed "s/\$/  (-p $p)/"
    done
    ;;
confirm)  # the defaults after stage final: parity of both merge paths, attention vs the goals, tg128
    for m in 0 1; do
        QUIRE_CUDA_DECODE_MERGE=$m QUIRE_REQUIRE_GPU=1 "$W"/cuda_attention --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed "s/\$/  (cuda_attention, in-kernel merge $m)/"
    done
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "parity paged|^\| paged"
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "parity paged|^\| paged"
    done
    make_models
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on|f16-dequantized|test result|panicked"
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        for p in 0 512; do
            "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  (-p $p)/"
        done
    done
    ;;
trace)  # the decode timeline (QUIRE_CUDA_TRACE=1) beside untraced and chained tg128
    make_models
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset)/"
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset, chain 16)/"
        QUIRE_CUDA_TRACE=1 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 > "$OUT/trace-$preset.txt" 2>&1
        grep -E "^\| llama|steps ending|trace:" "$OUT/trace-$preset.txt" | sed "s/\$/  ($preset, traced)/"
        grep -E "^\| [a-z]" "$OUT/trace-$preset.txt" | grep -v "^| model" | head -14
        QUIRE_CUDA_TRACE=1 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 --chain 16 > "$OUT/trace-chain-$preset.txt" 2>&1
        grep -E "steps ending|trace:" "$OUT/trace-chain-$preset.txt" | sed "s/\$/  ($preset, traced chain)/"
        grep -E "^\| [a-z]" "$OUT/trace-chain-$preset.txt" | grep -v "^| model" | head -6
    done
    ;;
s17a)  # stop 17: decode attention's prologue before the wait, the GLU GEMV; per-kernel timelines
    make_models
    for t in cuda_ops cuda_attention; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 > "$OUT/$t.txt" 2>&1
        grep -E "test result|panicked|FAILED" "$OUT/$t.txt" | sed "s/\$/  ($t)/"
    done
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on|f16-dequantized|test result|panicked"
    tl() {  # label, env..., model: a traced tg128 into $OUT/tl-<label>.txt
        local label=$1 f=$2; shift 2
        env "$@" QUIRE_CUDA_TRACE=1 "$Q" bench -m "$W/$f-f16.gguf" --backend cuda -p 0 -n 128 -r 2 > "$OUT/tl-$label.txt" 2>&1
    }
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset)/"
        QUIRE_CUDA_GEMV_GLU=0 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset, GLU off)/"
        QUIRE_CUDA_GEMV_GLU_SHAPE=2x8 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset, GLU 2x8)/"
        tl $preset-default $preset X=1
        for sh in 1x8 2x4 2x8 1x16 4x4; do tl $preset-$sh $preset QUIRE_CUDA_GEMV_SHAPE=$sh; done
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        grep -E "paged_decode|attention_reduce" "$OUT/tl-$preset-default.txt" | sed "s/\$/  ($preset)/"
    done
    ;;
s17b)  # stop 17: split argmax, rope tables read before the wait, decode split sweep at short context
    make_models
    for t in cuda_ops cuda_attention cuda_sample; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 > "$W/$t.txt" 2>&1
        grep -E "test result|panicked|FAILED" "$W/$t.txt" | sed "s/\$/  ($t)/"
    done
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on|f16-dequantized|chain|test result|panicked"
    "$Q" generate -m "$W/llama3.2-1b-f16.gguf" --backend cuda --prompt "hello world" --max-tokens 64 2>&1 | tail -2
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset)/"
        for tiles in 1 2; do for merge in 0 1; do
            QUIRE_CUDA_DECODE_MIN_TILES=$tiles QUIRE_CUDA_DECODE_MERGE=$merge "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset, min tiles $tiles, merge $merge)/"
        done; done
        QUIRE_CUDA_TRACE=1 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 2 > "$OUT/tl-$preset.txt" 2>&1
    done
    QUIRE_CUDA_TRACE=1 "$Q" bench -m "$W/smollm2-135m-f16.gguf" --backend cuda -p 512 -n 128 -r 2 > "$OUT/tl-smollm2-135m-p512.txt" 2>&1
    ;;
s17c)  # stop 17: min tiles 2, 2x4 for the 8B q/k/v and o, pinned metadata; the carveout and a prompt first
    make_models
    for t in cuda_ops cuda_attention; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 > "$W/$t.txt" 2>&1
        grep -E "test result|panicked|FAILED" "$W/$t.txt" | sed "s/\$/  ($t)/"
    done
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on f16|f16-dequantized|test result|panicked"
    for cfg in "16 4096 16" "64 8192 16" "1 4096 16"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch $1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size $3 --max-blocks $(( $2 / $3 )) --active-blocks $(( $2 / $3 )) --repeats 100 2>&1 | grep -E "^\| paged" | sed "s/\$/  (B$1 L$2)/"
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        f="$W/$preset-f16.gguf"
        for p in 0 512; do
            "$Q" bench -m "$f" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset -p $p)/"
        done
        [ $preset = llama3-8b ] && continue
        for co in 0 100; do for p in 0 512; do
            QUIRE_CUDA_CARVEOUT=$co "$Q" bench -m "$f" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  ($preset -p $p, carveout $co)/"
        done; done
        QUIRE_CUDA_TRACE=1 "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 2 > "$OUT/tl-$preset.txt" 2>&1
    done
    ;;
final17)  # stop 17's closing checks after `0` + `llamacpp`: parity, decode attention vs SDPA, side by side
    bash "$0" parity
    attn_goals
    bash "$0" sbs
    ;;
final17b)  # after final17 (model.part2 carried): parity on the default model, decode alone, module loading
    bash "$0" parity
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 0 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| llama" | sed 's/$/  (-p 0)/'
    done
    for p in 0 512; do
        CUDA_MODULE_LOADING=EAGER "$Q" bench -m "$W/smollm2-135m-f16.gguf" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  (-p $p, eager module loading)/"
    done
    ;;
s17d)  # stop 17: small steps keep their own activations (tg128 after a prompt), the defaults checked
    make_models
    for t in cuda_ops cuda_attention; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 > "$W/$t.txt" 2>&1
        grep -E "test result|panicked|FAILED" "$W/$t.txt" | sed "s/\$/  ($t)/"
    done
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on f16|f16-dequantized|test result|panicked"
    "$Q" attn-bench --backend cuda --batch 1 --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 16 --max-blocks 256 --active-blocks 256 --repeats 100 2>&1 | grep -E "^\| paged" | sed "s/\$/  (B1 L4096)/"
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        for p in 0 512; do
            "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p $p -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  ($preset -p $p)/"
        done
    done
    ;;
shapes17)  # stop 17: the one-token GEMV shape for matrices of few rows, end to end
    for preset in llama3.2-1b smollm2-135m; do
        f="$W/$preset-f16.gguf"
        [ -f "$f" ] || "$Q" make-model --preset $preset --dtype f16 "$f" 2>&1 | tail -1
        for sh in default 1x8,2x4 2x8,2x4 4x4,2x4 default; do
            if [ $sh = default ]; then e=X=1; else e=QUIRE_CUDA_GEMV_SHAPE=$sh; fi
            env $e "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -r 3 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset, $sh)/"
        done
    done
    ;;
confirm17)  # stop 17's final defaults: parity on the random 135M file, tg128 with and without a prompt
    make_models
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked" | sed 's/$/  (cuda_ops)/'
    QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on f16|f16-dequantized|test result|panicked"
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 0 -n 128 -r 5 --chain 16 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset -p 0)/"
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  ($preset -p 512)/"
    done
    ;;
final18|final19|final20)  # stop 18's and 19's closing checks after `llamacpp` (model.part1 carried): decode attention vs SDPA, side by side
    attn_goals
    bash "$0" sbs
    ;;
final18b|final19b|final20b)  # after final18/19 (model.part2 carried): parity on the default model, kernel tests, decode alone and chained
    bash "$0" parity
    for t in cuda_ops cuda_attention cuda_sample; do
        QUIRE_REQUIRE_GPU=1 "$W"/$t --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed "s/\$/  ($t)/"
    done
    for preset in smollm2-135m llama3.2-1b llama3-8b; do
        "$Q" bench -m "$W/$preset-f16.gguf" --backend cuda -p 0 -n 128 -r 3 --chain 16 2>&1 | grep -E "^\| llama" | sed "s/\$/  ($preset -p 0)/"
    done
    ;;
s19c)  # stop 19: the 135M output in rounds on a persistent grid, 1x8 for one-wave short matrices (1B o), one decode split up to 128 keys (8B)
    make_models
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed 's/$/  (cuda_ops)/'
    QUIRE_CUDA_GEMV_HOST_ROUNDS=1 QUIRE_CUDA_GEMV_WAVE1X8=1 QUIRE_CUDA_DECODE_SHORT_TILES=4 QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on f16|f16-dequantized|test result|panicked"
    b() { "$Q" bench -m "$W/$1-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  ($1 $2)/"; }
    for v in 0 1 1 0 0 1; do QUIRE_CUDA_GEMV_HOST_ROUNDS=$v b smollm2-135m "rounds=$v"; done
    for v in 0 1 1 0 0 1; do QUIRE_CUDA_GEMV_WAVE1X8=$v b llama3.2-1b "wave1x8=$v"; done
    for v in 2 4 4 2; do QUIRE_CUDA_DECODE_SHORT_TILES=$v b llama3-8b "short_tiles=$v"; done
    QUIRE_CUDA_GEMV_WAVE1X8=1 QUIRE_CUDA_DECODE_SHORT_TILES=4 b llama3-8b "wave1x8=1 short_tiles=4"
    QUIRE_CUDA_GEMV_WAVE1X8=1 QUIRE_CUDA_DECODE_SHORT_TILES=4 b llama3.2-1b "wave1x8=1 short_tiles=4"
    QUIRE_CUDA_GEMV_HOST_ROUNDS=1 QUIRE_CUDA_GEMV_WAVE1X8=1 QUIRE_CUDA_DECODE_SHORT_TILES=4 b smollm2-135m "all three"
    for v in 0 1; do
        QUIRE_CUDA_GEMV_HOST_ROUNDS=$v QUIRE_CUDA_GEMV_WAVE1X8=$v QUIRE_CUDA_TRACE=1 "$Q" bench -m "$W/smollm2-135m-f16.gguf" --backend cuda -p 512 -n 128 -r 3 > "$OUT/trace-135m-r$v.txt" 2>&1
        grep -E "host_r" "$OUT/trace-135m-r$v.txt" | sed "s/\$/  (135M traced rounds=$v)/"
        QUIRE_CUDA_GEMV_WAVE1X8=$v QUIRE_CUDA_TRACE=1 "$Q" bench -m "$W/llama3.2-1b-f16.gguf" --backend cuda -p 512 -n 128 -r 3 > "$OUT/trace-1b-w$v.txt" 2>&1
        grep -E "^\| [a-z]" "$OUT/trace-1b-w$v.txt" | grep -v "^| model" | head -8 | sed "s/\$/  (1B traced wave1x8=$v)/"
    done
    ;;
s20d)  # stop 20's switches against the defaults: EARLY GEMV forms (off, every row length), mapped metadata (off)
    make_models
    QUIRE_REQUIRE_GPU=1 "$W"/cuda_ops --test-threads 1 2>&1 | grep -E "test result|panicked|FAILED" | sed 's/$/  (cuda_ops)/'
    e="QUIRE_CUDA_GEMV_EARLY=all"
    env $e QUIRE_PARITY_MODEL="$W/smollm2-135m-f16.gguf" QUIRE_REQUIRE_GPU=1 "$W"/cuda_engine --test-threads 1 --nocapture 2>&1 | grep -E "greedy on f16|f16-dequantized|test result|panicked" | sed "s/\$/  ($e)/"
    b() { local m=$1; shift; env "$@" "$Q" bench -m "$W/$m-f16.gguf" --backend cuda -p 512 -n 128 -r 3 2>&1 | grep -E "^\| llama" | grep tg | sed "s/\$/  ($m $*)/"; }
    for m in llama3.2-1b llama3-8b smollm2-135m; do
        for r in 1 2; do
            b $m X=1
            b $m QUIRE_CUDA_GEMV_EARLY=0
            b $m QUIRE_CUDA_GEMV_EARLY=all
            b $m QUIRE_CUDA_META_MAPPED=0
        done
    done
    ;;
checks20)  # stop 20's defaults on the other paths: K-quants, kernels, HF architectures against transformers (also with EARLY on for every row length), MoE
    bash "$0" checks
    QUIRE_CUDA_GEMV_EARLY=all QUIRE_HF_CUDA_DIR=/root/hf-cuda QUIRE_REQUIRE_GPU=1 "$W"/hf_cuda --nocapture 2>&1 | grep -E "rel err|test result|panicked" | sed 's/$/  (EARLY all)/'
    ;;
esac

#!/usr/bin/env bash
# The CUDA side-by-side table, on the lent GPU machine: quire against llama.cpp on the same files
# in the same call (f16, Q4_K_M, Qwen3-30B-A3B, 64 sequences decoding, depth 8000) and serving
# (quire serve-bench against `quire serve` and `llama-server`). Each part is a subcommand, so a
# run can be split over calls of at most 10 minutes while the machine stays warm:
#   bash tests/device/bench.sh llamacpp     # build llama.cpp from .dev/llamacpp-src.tar.xz (~5 min)
#   bash tests/device/bench.sh models       # random-weight files of real shapes (+ Q4_K_M by llama-quantize)
#   bash tests/device/bench.sh peer         # llama.cpp's rows
#   bash tests/device/bench.sh quire [NAME] # quire's rows with binary set NAME (default new; "old" for before/after)
#   bash tests/device/bench.sh serve [NAME] # serving, quire then llama-server
#   bash tests/device/bench.sh attn [NAME]  # paged decode attention beside PyTorch SDPA (4 shapes)
#   bash tests/device/bench.sh table [A] [B]# ratios B/A per file (quire compare), default peer vs new
# Results: $OUT/bench-*.json (llama-bench compatible JSON), $OUT/serve-*.json, printed tables.
set -euo pipefail
source "$(dirname "$0")/common.sh"
F16=$W/llama3-8b-f16.gguf
# Q4KM may name another 4-bit K-quant file (e.g. one from `quire quantize --type q4_k`) where
# llama-quantize is not built.
Q4KM=${Q4KM:-$W/llama3-8b-q4_k_m.gguf}
MOE=$W/qwen3-30b-a3b-q4_0.gguf
REPS=${REPS:-3}

files() { echo "$F16 $Q4KM $MOE"; }
tag() { basename "$1" .gguf; }

cmd=${1:-}
shift || true
case "$cmd" in
llamacpp)
    [ -x "$LB/llama-bench" ] && { echo "llama.cpp already built"; exit 0; }
    mkdir -p /root/lc && tar -xJf .dev/llamacpp-src.tar.xz -C /root/lc
    # The pruned source lacks pocs/ and app/, which CMakeLists.txt adds unconditionally. It must keep
    # scripts/ui-assets.cmake: llama-server's build runs it (offline it embeds no UI).
    for d in pocs app; do mkdir -p /root/lc/llama.cpp/$d && touch /root/lc/llama.cpp/$d/CMakeLists.txt; done
    cd /root/lc/llama.cpp
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > /root/lc/cmake.log 2>&1
    cmake --build build -j "$(nproc)" --target llama-bench llama-batched-bench llama-quantize llama-server \
        > /root/lc/build.log 2>&1 || { tail -30 /root/lc/build.log; exit 1; }
    git -C /root/lc/llama.cpp rev-parse --short HEAD 2>/dev/null || true
    ls "$LB"
    ;;
models)
    Q=$W/${1:-new}/quire
    [ -f "$F16" ] || "$Q" make-model --preset llama3-8b --dtype f16 "$F16" 2>&1 | tail -1
    [ -f "$MOE" ] || "$Q" make-model --preset qwen3-30b-a3b --dtype q4_0 "$MOE" 2>&1 | tail -1
    if [ -x "$LB/llama-quantize" ]; then
        [ -f "$Q4KM" ] || "$LB/llama-quantize" "$F16" "$Q4KM" Q4_K_M > "$OUT/quantize.log" 2>&1
    else
        echo "no llama-quantize yet: run 'bench.sh llamacpp', then 'models' again for $Q4KM"
    fi
    ls -la "$W"/*.gguf
    ;;
peer)
    gpu_stamp
    for f in $(files); do
        "$LB/llama-bench" -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r "$REPS" -o json > "$OUT/bench-peer-$(tag "$f").json"
        "$LB/llama-bench" -m "$f" -ngl 99 -fa 1 -p 0 -n 128 -d 8000 -r "$REPS" -o json > "$OUT/bench-peer-$(tag "$f")-d8000.json"
    done
    for f in $F16 $Q4KM; do
        echo "llama-batched-bench $(tag "$f"), 64 sequences (pp 512, tg 128):"
        "$LB/llama-batched-bench" -m "$f" -ngl 99 -fa 1 -c 50000 -npp 512 -ntg 128 -npl 64 2>&1 | grep -E "^\|" | tail -2
    done
    echo "llama-batched-bench $(tag "$MOE"), 16 sequences:"
    "$LB/llama-batched-bench" -m "$MOE" -ngl 99 -fa 1 -c 12000 -npp 512 -ntg 128 -npl 16 2>&1 | grep -E "^\|" | tail -2
    ;;
quire)
    name=${1:-new}
    Q=$W/$name/quire
    gpu_stamp
    for f in $(files); do
        "$Q" bench -m "$f" --backend cuda -p 512 -n 128 -r "$REPS" -o json > "$OUT/bench-$name-$(tag "$f").json"
        "$Q" bench -m "$f" --backend cuda -p 0 -n 128 -d 8000 -r "$REPS" -o json > "$OUT/bench-$name-$(tag "$f")-d8000.json"
    done
    for spec in "$F16 64" "$Q4KM 64" "$MOE 16"; do
        set -- $spec
        echo "quire bench $(tag "$1") -b $2:"
        "$Q" bench -m "$1" --backend cuda -p 512 -n 128 -b "$2" -r "$REPS" 2>&1 | grep -E "^\| (llama|qwen)"
    done
    ;;
serve)
    name=${1:-new}
    Q=$W/$name/quire
    load=(--concurrency 64 --input-len 150 --output-len 256 --range-ratio 0.5 --duration 30 --ramp 0)
    wait_up() { for _ in $(seq 120); do curl -sf "$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
    "$Q" serve -m "$Q4KM" --backend cuda --port 8080 > "$OUT/serve-quire.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8080 || { tail "$OUT/serve-quire.log"; exit 1; }
    "$Q" serve-bench --url http://127.0.0.1:8080 "${load[@]}" --json "$OUT/serve-$name-q4_k_m.json" 2>&1 | tail -25
    kill "$pid"; wait "$pid" || true
    "$LB/llama-server" -m "$Q4KM" -ngl 99 -fa on -np 64 -c 65536 --port 8081 > "$OUT/serve-llama.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8081 || { tail "$OUT/serve-llama.log"; exit 1; }
    "$Q" serve-bench --url http://127.0.0.1:8081 "${load[@]}" --json "$OUT/serve-peer-q4_k_m.json" 2>&1 | tail -25
    kill "$pid"; wait "$pid" || true
    ;;
attn)
    Q=$W/${1:-new}/quire
    "$Q" attn-bench --backend cuda --batch 16 --q-heads 16 --kv-heads 8 --head-dim 128 --block-size 32 \
        --max-blocks 64 --active-blocks 32 --repeats 200 2>&1 | grep -E "parity paged|^\| paged"
    python3 tests/device/sdpa_bench.py 16 1024 16 8 128 f16
    for cfg in "16 4096" "64 8192" "1 4096"; do
        set -- $cfg
        "$Q" attn-bench --backend cuda --batch "$1" --q-heads 32 --kv-heads 8 --head-dim 128 --block-size 16 \
            --max-blocks $(($2 / 16)) --active-blocks $(($2 / 16)) --repeats 100 2>&1 | grep -E "parity paged|^\| paged"
        python3 tests/device/sdpa_bench.py "$1" "$2" 32 8 128 bf16
    done
    ;;
table)
    # One row per test in both result sets: B's and A's t/s (mean ± sd over repetitions) and B/A.
    a=${1:-peer}; b=${2:-new}
    python3 - "$OUT" "$a" "$b" <<'PY'
import glob, json, os, sys
out, a, b = sys.argv[1:]
def load(path):
    rows = {}
    for r in json.load(open(path)):
        p, g, d = r.get("n_prompt", 0), r.get("n_gen", 0), r.get("n_depth", 0)
        name = (f"pp{p}" if p else "") + ("+" if p and g else "") + (f"tg{g}" if g else "") + (f" @ d{d}" if d else "")
        rows[name] = (r["avg_ts"], r.get("stddev_ts", 0.0), r.get("build_commit", "?"))
    return rows
print(f"| file | test | {a} t/s | {b} t/s | {b}/{a} |")
print("|---|---|---:|---:|---:|")
for fa in sorted(glob.glob(f"{out}/bench-{a}-*.json")):
    fb = fa.replace(f"bench-{a}-", f"bench-{b}-")
    if not os.path.exists(fb):
        continue
    ra, rb = load(fa), load(fb)
    tag = os.path.basename(fa)[len(f"bench-{a}-"):-5]
    for t in ra:
        if t in rb:
            (ma, sa, _), (mb, sb, _) = ra[t], rb[t]
            print(f"| {tag} | {t} | {ma:,.1f} ± {sa:,.1f} | {mb:,.1f} ± {sb:,.1f} | {mb / ma:.3f} |")
PY
    ;;
*)
    sed -n '2,13p' "$0"; exit 2 ;;
esac

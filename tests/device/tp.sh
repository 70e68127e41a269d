#!/usr/bin/env bash
# Tensor parallelism on a lent multi-GPU machine (issue 27): quire's `--tensor-parallel-size N`
# beside llama.cpp's split modes on the same random-weight files, GPUs and call. Each part is a
# subcommand, so a run can be split over calls of at most 10 minutes while the machine stays warm:
#   bash tests/device/bench.sh llamacpp    # build llama.cpp (CUDA) once per machine
#   bash tests/device/tp.sh models         # Llama-3-8B and Llama-3-70B f16 files (70B: 141 GB)
#   bash tests/device/tp.sh tests [NAME]   # the tp tests, then the engine suites as groups of 2 and 4 GPUs
#   bash tests/device/tp.sh two [NAME]     # 8B: 1 GPU against 2, alternating rounds (tg128, pp512, 64 seqs)
#   bash tests/device/tp.sh quire [NAME]   # 70B over 4 GPUs: pp512, tg128, 64 sequences decoding
#   bash tests/device/tp.sh peer           # llama.cpp on the 70B: -sm layer and -sm row, llama-batched-bench
#   bash tests/device/tp.sh serve [NAME]   # 70B serving, 64 in flight: quire serve TP 4, then llama-server
# NAME is the binary set pack.sh made (default new). Results: $OUT/tp-*.json and printed tables.
set -euo pipefail
source "$(dirname "$0")/common.sh"
F8=$W/llama3-8b-f16.gguf
F70=$W/llama3-70b-f16.gguf
GPUS=$(nvidia-smi -L | wc -l)

cmd=${1:-}
shift || true
Q=$W/${1:-new}/quire
case "$cmd" in
models)
    gpu_stamp
    [ -f "$F8" ] || "$Q" make-model --preset llama3-8b --dtype f16 "$F8" 2>&1 | tail -1
    [ -f "$F70" ] || "$Q" make-model --preset llama3-70b --dtype f16 "$F70" 2>&1 | tail -1
    ls -la "$F8" "$F70"
    ;;
tests)
    model_ready || { echo "tp.sh tests: carry .dev/model.part1 and .dev/model.part2 first"; exit 1; }
    export QUIRE_REQUIRE_GPU=1 QUIRE_PARITY_MODEL=$HOME/.cache/quire/SmolLM2-135M-Instruct.Q4_1.gguf
    B=$W/${1:-new}/tests
    "$B/tp" --include-ignored --test-threads 1 2>&1 | grep -E "^test |test result"
    for n in 2 4; do
        [ "$n" -le "$GPUS" ] || continue
        for t in batching spec_executors; do
            echo "== $t, CUDA executors as groups of $n GPUs"
            QUIRE_TEST_TENSOR_PARALLEL=$n "$B/$t" --include-ignored --test-threads 1 ::cuda 2>&1 |
                grep -E "^test |test result|panicked" | head -20
        done
    done
    ;;
two)
    for r in 1 2 3; do
        for n in 1 2; do
            echo "== round $r, $n GPU(s)"
            "$Q" bench -m "$F8" --backend cuda --tensor-parallel-size "$n" -p 0 -n 128 -r 3 \
                -o json > "$OUT/tp-8b-tg-$n-$r.json" 2>"$OUT/tp-8b-tg-$n-$r.log" || tail -5 "$OUT/tp-8b-tg-$n-$r.log"
            python3 -c 'import json,sys; [print("  tg128 %.1f ± %.1f" % (r["avg_ts"], r["stddev_ts"])) for r in json.load(open(sys.argv[1]))]' \
                "$OUT/tp-8b-tg-$n-$r.json"
        done
    done
    for n in 1 2; do
        "$Q" bench -m "$F8" --backend cuda --tensor-parallel-size "$n" -p 512 -n 0 -r 3 2>&1 | grep -E "^\|"
        "$Q" bench -m "$F8" --backend cuda --tensor-parallel-size "$n" -p 0 -n 64 -b 64 -r 1 2>&1 | grep -E "^\|"
    done
    ;;
quire)
    "$Q" bench -m "$F70" --backend cuda --tensor-parallel-size 4 -p 512 -n 128 -r 2 -o json \
        > "$OUT/tp-70b-quire.json" 2>"$OUT/tp-70b-quire.log" || tail -5 "$OUT/tp-70b-quire.log"
    cat "$OUT/tp-70b-quire.json"
    "$Q" bench -m "$F70" --backend cuda --tensor-parallel-size 4 -p 0 -n 64 -b 64 -r 1 2>&1 | grep -E "^\|"
    ;;
peer)
    [ -x "$LB/llama-bench" ] || { echo "tp.sh peer: run 'bench.sh llamacpp' first"; exit 1; }
    for sm in layer row; do
        echo "== llama-bench -sm $sm"
        "$LB/llama-bench" -m "$F70" -ngl 99 -fa 1 -sm "$sm" -p 512 -n 128 -r 2 -o json \
            > "$OUT/tp-70b-peer-$sm.json" 2>"$OUT/tp-70b-peer-$sm.log" || tail -5 "$OUT/tp-70b-peer-$sm.log"
        python3 -c 'import json,sys; [print("  n_prompt %d n_gen %d: %.2f ± %.2f" % (r["n_prompt"], r["n_gen"], r["avg_ts"], r["stddev_ts"])) for r in json.load(open(sys.argv[1]))]' \
            "$OUT/tp-70b-peer-$sm.json" || true
    done
    echo "== llama-batched-bench, 64 sequences"
    "$LB/llama-batched-bench" -m "$F70" -ngl 99 -fa 1 -c 33000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 64 \
        > "$OUT/tp-70b-batched.log" 2>&1 || true
    grep -E "^\|" "$OUT/tp-70b-batched.log" | tail -3
    ;;
serve)
    load=(--concurrency 64 --input-len 150 --output-len 256 --range-ratio 0.5 --duration 30 --ramp 0)
    wait_up() { for _ in $(seq 300); do curl -sf "$1/health" > /dev/null && return 0; sleep 1; done; return 1; }
    "$Q" serve -m "$F70" --backend cuda --tensor-parallel-size 4 --port 8080 > "$OUT/tp-serve-quire.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8080 || { tail "$OUT/tp-serve-quire.log"; kill "$pid"; exit 1; }
    "$Q" serve-bench --url http://127.0.0.1:8080 "${load[@]}" --json "$OUT/tp-serve-quire.json" 2>&1 | tail -25
    kill "$pid"; wait "$pid" || true
    "$LB/llama-server" -m "$F70" -ngl 99 -fa on -np 64 -c 65536 --port 8081 > "$OUT/tp-serve-llama.log" 2>&1 &
    pid=$!
    wait_up http://127.0.0.1:8081 || { tail "$OUT/tp-serve-llama.log"; kill "$pid"; exit 1; }
    "$Q" serve-bench --url http://127.0.0.1:8081 "${load[@]}" --json "$OUT/tp-serve-peer.json" 2>&1 | tail -25
    kill "$pid"; wait "$pid" || true
    ;;
*)
    sed -n 2,12p "$0"
    exit 2
    ;;
esac

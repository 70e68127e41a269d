#!/usr/bin/env bash
# Builds the CUDA binaries on this (GPU-less) machine and packs them, stripped, into .dev/bin.tar.xz
# for tests/device/run.sh on the lent GPU machine (.dev/ is git-excluded; one call carries 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
cargo build --release -p quire --features cuda
cargo build --release -p quire-backend --features cuda --example cuda_matmul_bench
cargo test --release -p quire-backend --features cuda --test cuda_attention --test cuda_ops --test cuda_quant --test cuda_sample --no-run 2>&1 |
    grep -oE '\([^)]*/(cuda_attention|cuda_ops|cuda_quant|cuda_sample)-[0-9a-f]+\)' | tr -d '()' > /tmp/quire-test-bins
cargo test --release -p quire-engine --features cuda --test cuda --test hf_cuda --no-run 2>&1 |
    grep -oE '\([^)]*/(hf_cuda|cuda)-[0-9a-f]+\)' | tr -d '()' >> /tmp/quire-test-bins
stage=$(mktemp -d)
cp "$CARGO_TARGET_DIR/release/quire" "$CARGO_TARGET_DIR/release/examples/cuda_matmul_bench" "$stage/"
while read -r bin; do
    name=$(basename "$bin" | sed -E 's/-[0-9a-f]+$//')
    [ "$name" = cuda ] && name=cuda_engine
    cp "$bin" "$stage/$name"
done < /tmp/quire-test-bins
strip "$stage"/*
git rev-parse --short HEAD > "$stage/COMMIT"  # run.sh stamps results with it
mkdir -p .dev
tar -cJf .dev/bin.tar.xz -C "$stage" .
ls -la "$stage" .dev/bin.tar.xz
rm -rf "$stage"

#!/usr/bin/env bash
# Builds the CUDA binaries on this (GPU-less) machine and packs them, stripped, into
# .dev/bin-NAME.tar.xz for check.sh and bench.sh on the lent GPU machine (.dev/ is git-ignored;
# one call carries 64 MiB). PACK_TESTS=0 leaves the test binaries out; PACK_WGPU=1 builds quire with
# the wgpu backend too (one binary for the CUDA and the Vulkan rows) and adds the wgpu examples. NAME defaults to "new"; pack a baseline checkout as "old" for a
# before/after pair in one call. Layout: quire, cuda_matmul_bench, COMMIT, tests/<test binary>.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:-new}
dest=${2:-$PWD/.dev}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
features=cuda
[ "${PACK_WGPU:-0}" = 1 ] && features=cuda,wgpu
cargo build --release -p quire --features "$features"
cargo build --release -p quire-backend --features cuda --example cuda_matmul_bench
stage=$(mktemp -d)
mkdir -p "$stage/tests"
cp "$CARGO_TARGET_DIR/release/quire" "$CARGO_TARGET_DIR/release/examples/cuda_matmul_bench" "$stage/"
if [ "${PACK_WGPU:-0}" = 1 ]; then
    for ex in crates/backend/examples/wgpu_*.rs; do
        ex=$(basename "$ex" .rs)
        cargo build --release -p quire-backend --features wgpu --example "$ex"
        cp "$CARGO_TARGET_DIR/release/examples/$ex" "$stage/"
    done
fi
# Every test binary of the crates that hold GPU tests (their GPU tests are #[ignore]d unless run
# with --include-ignored, which check.sh does).
test_features=quire-backend/cuda,quire-engine/cuda
[ "${PACK_WGPU:-0}" = 1 ] && test_features=$test_features,quire-backend/wgpu,quire-engine/wgpu
[ "${PACK_TESTS:-1}" = 0 ] || cargo test --release -p quire-backend -p quire-engine --features "$test_features" \
    --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"] and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r tname exe; do cp "$exe" "$stage/tests/$tname"; done
strip "$stage"/quire "$stage"/cuda_matmul_bench "$stage"/wgpu_* "$stage"/tests/* 2>/dev/null || true
git rev-parse --short HEAD > "$stage/COMMIT"
[ "${PACK_WGPU:-0}" = 1 ] && touch "$stage/WGPU"
pwd > "$stage/BUILD_ROOT"  # test binaries read tests/data under this path
mkdir -p "$dest"
tar -cJf "$dest/bin-$name.tar.xz" -C "$stage" .
ls -la "$stage" "$stage/tests" "$dest/bin-$name.tar.xz"
rm -rf "$stage"

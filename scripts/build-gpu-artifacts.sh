#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU host into .device/ (git-ignored): release
# binaries, the GPU test executable, the Python wheel and the HIP-on-NVIDIA forwarding library
# (lib/libkvd-hip-nvidia.so, for gpu-check.sh's hip steps) and a static fio (fio/fio, for
# scripts/device-disk.sh: the GPU host has none), stripped to fit the device tool's 64 MiB
# transfer limit.
set -euo pipefail
cd "$(dirname "$0")/.."
# The traces a replay reads (scripts/device-disk-replay.sh) are copied in by hand: kept.
rm -rf .device/bin .device/wheels .device/lib .device/fio .device/out && mkdir -p .device/bin .device/wheels
cargo build --release --locked -p kvd-server -p kvd-benches
test_exe=$(cargo test --release --locked -p kvd-server --features gpu-tests --test gpu --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
TARGET=$(scripts/target-dir.sh)
cp "$TARGET/release/kvd" "$TARGET/release/kvd-bench" "$test_exe" .device/bin/
mv .device/bin/"$(basename "$test_exe")" .device/bin/gpu-tests
strip .device/bin/*
scripts/hip-nvidia/build.sh .device/lib
# Not fatal: without it scripts/device-disk.sh compares with dd instead, and says so.
scripts/build-fio.sh .device/fio/fio || echo "build-fio.sh failed: .device has no fio (device-disk.sh falls back to dd)"
# maturin from PATH, else from a virtualenv here (scripts/test.sh installs it into one).
MATURIN=$(command -v maturin || ls .venv*/bin/maturin 2>/dev/null | head -1 || true)
if [ -n "$MATURIN" ] && [ -f connector-py/pyproject.toml ]; then
  "$MATURIN" build --release --locked -m connector-py/Cargo.toml -o .device/wheels 2>&1 | tail -2
fi
du -sh .device

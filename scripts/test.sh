#!/usr/bin/env bash
# kvd's test suite: lints, Rust unit/property/integration tests against the real kvd binary,
# and (when Python is present) the Python package's tests against a real kvd.
# GPU tests live behind the `gpu-tests` feature and run on a GPU host: scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked
echo "== gpu-tests sentinel (reports the skip on machines without a GPU)"
cargo test -p kvd-gpu --features gpu-tests --locked --test gpu -- --nocapture sentinel

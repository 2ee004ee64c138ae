#!/usr/bin/env bash
# kvd's test suite, as CI runs it on a fresh machine without a GPU:
#   lints; Rust unit, property and integration tests (the real kvd binary, memfd memory standing
#   in for GPU memory); the GPU-test sentinel; the connector's Rust unit tests; the Python
#   package built with maturin, type-checked (mypy --strict, its stubs against the built module
#   by stubtest) and tested with pytest against a real kvd (including libzmq interoperability
#   through pyzmq); the fuzz targets over their committed corpora, and a few seconds of fuzzing
#   the connector's settings; the deploy kit and these scripts; the disk and L2 benchmarks once
#   each, small; the connector inside vLLM 0.33's and 0.26's own scheduler and model-runner
#   plumbing, on the CPU.
# GPU tests run on a GPU host instead: scripts/build-gpu-artifacts.sh, then scripts/gpu-check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never RUST_BACKTRACE=1
# What the tests need beyond Rust (scripts/install-test-deps.sh lists it: ROCm's HIP headers,
# g++, python3-dev, redis-server, prometheus, openssl, ...): installed through apt when missing,
# or the one command to run is printed.
scripts/install-test-deps.sh
# Where cargo puts what it builds: target/, or CARGO_TARGET_DIR (or a cargo config) elsewhere.
TARGET=$(scripts/target-dir.sh)
# CI machines differ in disk (a run has died of a full disk installing vLLM): say what there is.
df -h . "${TMPDIR:-/tmp}" | sed 's/^/== disk: /'

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked --features kvd-server/gpu-tests -- -D warnings
echo "== import layers (server/tests/layers.rs): no circles, no import running back up"; cargo test --locked -p kvd-server --test layers -- --nocapture
echo "== cargo test"
cargo test --locked
echo "== GPU tests: the sentinel says whether they can run here"
cargo test --locked -p kvd-server --features gpu-tests --test gpu -- --nocapture --exact sentinel
# Not a default member (its cdylib is built by maturin); its test binary links libpython, which
# Debian ships in python3-dev (scripts/install-test-deps.sh installs it).
echo "== kvd-connector unit tests"
cargo test --locked -p kvd-connector
echo "== HIP backend: declarations against ROCm's headers, the NVIDIA forwarding library"
scripts/check-hip-abi.sh

echo "== Python package"
VENV=${KVD_TEST_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "maturin>=1.9,<2" "pytest>=7" "pyzmq>=25" "mypy>=2.4,<3" numpy pyyaml
rm -rf dist/wheels
"$VENV/bin/maturin" build --locked -m connector-py/Cargo.toml -o dist/wheels
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps dist/wheels/kvd-*.whl
# Configured in connector-py/pyproject.toml; stubtest imports the installed module.
echo "== mypy --strict; stubtest: kvd/_native.pyi against the built kvd._native"
(cd connector-py && "../$VENV/bin/python" -m mypy --strict python/kvd && "../$VENV/bin/python" -m mypy.stubtest kvd._native)
# The kvd the Python tests start: the debug build `cargo test` just made.
export KVD_BIN="$TARGET/debug/kvd"
(cd connector-py && "../$VENV/bin/python" -m pytest -q -p no:cacheprovider tests)
# The operator kit (deploy/): dashboard and alert names against a live kvd, promtool and
# systemd-analyze where installed, the Dockerfile's steps through build-steps.py (a debug build
# whose cache persists in $TARGET/docker-steps-cache).
echo "== deploy: dashboard, alerts, systemd unit, Dockerfile, DaemonSet"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider deploy/tests
# These scripts themselves: the target directory wherever cargo puts it, install-test-deps.sh
# against stand-ins for apt-get and systemctl.
echo "== scripts"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider scripts/tests

# A short fuzzing run of the connector's settings parser (the Rust targets' corpora replay in
# `cargo test -p kvd-fuzz` above; scripts/fuzz.sh is the long run).
echo "== fuzz: kv_connector_extra_config, 10 s of atheris"
"$VENV/bin/python" -m pip install -q "atheris>=2.3,<4"
FUZZ_TMP=$(mktemp -d)
cp connector-py/fuzz/corpus/config/* "$FUZZ_TMP/"
"$VENV/bin/python" connector-py/fuzz/config_fuzz.py "$FUZZ_TMP" -max_total_time=10 -rss_limit_mb=1024 \
  -timeout=10 -artifact_prefix="$FUZZ_TMP/" 2>&1 | tail -3
rm -rf "$FUZZ_TMP"
# The static fio that scripts/device-disk.sh carries to the GPU host (which has none): it
# builds (Debian's source, ~40 s on 2 cores), is static, runs with an empty environment, and its
# io_uring engine writes and verifies bytes.
echo "== build-fio.sh: a static fio with io_uring for the GPU host"
FIO_TMP=$(mktemp -d)
scripts/build-fio.sh "$FIO_TMP/fio"
(cd / && env -i "$FIO_TMP/fio" --name=ci --ioengine=io_uring --iodepth=8 --bs=1m --size=64m \
  --filename="$FIO_TMP/ci.bin" --rw=write --verify=crc32c --do_verify=1 --output-format=terse >/dev/null)
# The Rust benchmarks that need no GPU, once each at a small size, against that fio and a real
# Redis: their figures belong in benches/RESULTS.md and are not judged here, but a benchmark
# that no longer runs shows here (the disk one stopped at its first load from 91f11e5's
# admission, which writes no chunk stored once and never read, until session 37 noticed).
echo "== kvd-bench disk and l2, once each, small"
cargo build --locked -p kvd-benches
"$TARGET/debug/kvd-bench" disk --kvd "$KVD_BIN" --fio "$FIO_TMP/fio" --gib 0.5 --pool-gib 0.25 \
  --tokens 256 --dir "$FIO_TMP/disk"
"$TARGET/debug/kvd-bench" l2 --kvd "$KVD_BIN" --tokens 256
rm -rf "$FIO_TMP"
# The benchmarks' own logic (the node benchmark's router, replay and report, against a stand-in
# engine: what runs on the GPU host is only checked for shape here).
echo "== benches/tests"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider benches/tests
# The contract with vLLM, on the CPU: vLLM's own scheduler, grouping, layer classes and model-
# runner plumbing drive the connector against a real kvd (scripts/vllm-conformance.sh). vLLM
# 0.33 runs every suite; 0.26 (what the GPU host runs) the engine loop, the rest skip there.
# Each release has its own virtualenv (~9.5 GB each, ~7 minutes from PyPI; pip's cache is off,
# and scripts/pip_staged_install.py installs a few wheels at a time, so the disk holds each once
# and never all its downloaded wheels beside it: ~10 GB at the peak). KVD_TEST_VLLM=0 skips them for a quick local run.
if [ "${KVD_TEST_VLLM:-1}" != 0 ]; then
  WHEEL=$(ls dist/wheels/kvd-*.whl)
  # On CI the Rust build (~11 GB) goes before the two vLLM environments arrive, and the first
  # environment before the second, so the disk holds at most one of them at a time. The kvd the
  # conformance tests start is the same debug build, kept outside the target directory.
  if [ -n "${CI:-}" ]; then
    KVD_CI_DIR=$(mktemp -d)
    cp "$KVD_BIN" "$KVD_CI_DIR/kvd"
    export KVD_BIN=$KVD_CI_DIR/kvd
    echo "== CI: freeing the Rust build before vLLM ($(du -sh "$TARGET" | cut -f1))"
    cargo clean
  fi
  echo "== vLLM 0.33 conformance (CPU)"
  PIP_NO_CACHE_DIR=1 KVD_WHEEL=$WHEEL scripts/vllm-conformance.sh "${KVD_VLLM_VENV:-.venv-vllm}"
  if [ -n "${CI:-}" ]; then
    rm -rf "${KVD_VLLM_VENV:-.venv-vllm}"
  fi
  echo "== vLLM 0.26 conformance (CPU)"
  PIP_NO_CACHE_DIR=1 KVD_WHEEL=$WHEEL VLLM_VERSION=0.26.0 scripts/vllm-conformance.sh "${KVD_VLLM026_VENV:-.venv-vllm026}"
else
  echo "== vLLM conformance: skipped (KVD_TEST_VLLM=0)"
fi
echo "== all tests passed"

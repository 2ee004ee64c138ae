#!/usr/bin/env bash
# Runs kvd's GPU checks on a GPU host from prebuilt artifacts (the GPU host has no Rust):
#   scripts/build-gpu-artifacts.sh      # on the build machine: binaries, test executables, wheel
#   scripts/gpu-check.sh [DIR] [STEPS]  # on the GPU host; DIR defaults to .device
# STEPS is a comma list of: info,rust,python,bench,populate (default: all). Logs go to $OUT
# when it is set (the device tool's output folder), else to DIR/out.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device}
STEPS=${2:-info,rust,python,bench,populate}
OUTDIR=${OUT:-$DIR/out}
mkdir -p "$OUTDIR"
BIN=$DIR/bin
export KVD_BIN=$PWD/$BIN/kvd RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
status=0

if has info; then
  echo "== machine"
  nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv | tee "$OUTDIR/gpus.csv"
  nproc; free -g | head -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
fi
if has rust; then
  echo "== rust GPU tests"
  "$BIN/gpu-tests" --test-threads 1 --nocapture 2>&1 | tee "$OUTDIR/rust-gpu-tests.log" | grep -E "^test |test result|panicked|GPU memory back|SKIPPED|assert" || true
  grep -q "test result: ok" "$OUTDIR/rust-gpu-tests.log" || status=1
fi
if has python && [ -d "$DIR/wheels" ]; then
  echo "== python GPU tests"
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvd-site "$DIR"/wheels/*.whl && export PYTHONPATH=/tmp/kvd-site
  python3 -m pytest -q -x connector-py/tests -m gpu -p no:cacheprovider 2>&1 | tee "$OUTDIR/python-gpu-tests.log" | tail -20
  grep -qE "passed" "$OUTDIR/python-gpu-tests.log" && ! grep -qE "failed|error" "$OUTDIR/python-gpu-tests.log" || status=1
fi
if has populate; then
  echo "== pool population and pinning"
  "$BIN/kvd-bench" populate --gib 16 2>&1 | tee "$OUTDIR/populate.md"
  for gib in 16 64; do
    timeout 300 "$BIN/kvd" serve --l1-size-gb $gib --port 0 --http-port 0 --fd-socket /tmp/kvd-pin.sock > "$OUTDIR/pin-$gib.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "ready in" "$OUTDIR/pin-$gib.log" && break; sleep 0.5; done
    grep -E "populated|pinned|ready in" "$OUTDIR/pin-$gib.log"
    kill -TERM $pid; wait $pid
  done
fi
if has bench; then
  echo "== control-plane benchmark"
  "$BIN/kvd-bench" control --seconds 3 2>&1 | tee "$OUTDIR/control.md"
  if [ -f benches/dataplane.py ] && [ -n "${PYTHONPATH:-}" ]; then
    echo "== data-plane benchmark"
    python3 benches/dataplane.py --kvd "$KVD_BIN" 2>&1 | tee "$OUTDIR/dataplane.md"
  fi
fi
exit $status

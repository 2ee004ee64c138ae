#!/usr/bin/env bash
# Runs kvd's GPU checks on a GPU host from prebuilt artifacts (the GPU host has no Rust):
#   scripts/build-gpu-artifacts.sh      # on the build machine: binaries, test executables, wheel
#   scripts/gpu-check.sh [DIR] [STEPS]  # on the GPU host; DIR defaults to .device
# STEPS is a comma list of: info,rust,python,bench,populate (default: all of these) and multigpu
# (benches/multigpu.py on every visible GPU: one kvd, one client process per GPU; about 3 minutes
# on 4 GPUs, bounded by MULTIGPU_TIMEOUT). Logs go to $OUT when it is set (the device tool's
# output folder), else to DIR/out.
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
  echo "== rust GPU tests (one process each, 150 s watchdog; kvd logs in \$OUT/kvd-logs)"
  mkdir -p /tmp/kvd-logs
  export KVD_TEST_LOG_DIR=/tmp/kvd-logs
  for t in ${RUST_TESTS:-sentinel gpu::every_layout_and_dtype_round_trips_bit_exact_on_the_gpu gpu::a_store_waits_for_the_clients_event_not_the_host gpu::vmm_memory_is_refused_with_the_allocator_setting_and_the_fix gpu::vmm_memory_of_many_chunks_round_trips_by_descriptor gpu::tp2_two_processes_on_two_gpus_share_one_kvd gpu::a_sigkilled_clients_gpu_memory_returns_within_10s gpu::a_sigkilled_clients_vmm_memory_returns_within_10s}; do
    log="$OUTDIR/rust-${t//:/_}.log"
    start=$(date +%s)
    timeout -k 5 ${RUST_TIMEOUT:-150} "$BIN/gpu-tests" --exact "$t" --nocapture --test-threads 1 > "$log" 2>&1
    rc=$?
    echo "$t: rc=$rc in $(( $(date +%s) - start )) s; $(grep -E 'test result|GPU memory back|SKIPPED|GPU tests will' "$log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || { status=1; grep -E "panicked|assert" -A3 "$log" | head -12; }
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && { echo "watchdog fired: skipping the remaining Rust GPU tests"; break; }
  done
  unset KVD_TEST_LOG_DIR
  tar czf "$OUTDIR/kvd-logs.tgz" -C /tmp kvd-logs
fi
if [ -d "$DIR/wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvd-site "$DIR"/wheels/*.whl && export PYTHONPATH=/tmp/kvd-site
fi
if has python; then
  echo "== python GPU tests"
  timeout -k 5 ${PY_TIMEOUT:-420} python3 -m pytest -v -rs -rP connector-py/tests/test_gpu.py -m gpu -p no:cacheprovider ${PY_TESTS:-} 2>&1 | tee "$OUTDIR/python-gpu-tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|GPU memory|client GPU" || true
  # Every GPU test must pass: a skip here means a missing GPU or torch, which is a failure.
  grep -qE "[0-9]+ passed" "$OUTDIR/python-gpu-tests.log" && ! grep -qE "failed|error|skipped" "$OUTDIR/python-gpu-tests.log" || status=1
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
  if [ -n "${PYTHONPATH:-}" ]; then
    echo "== data-plane benchmark"
    timeout -k 5 ${BENCH_TIMEOUT:-400} python3 benches/dataplane.py --kvd "$KVD_BIN" ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/dataplane.md"
  fi
fi
if has multigpu; then
  echo "== multi-GPU benchmark (one kvd, one client process per GPU)"
  if [ -n "${PYTHONPATH:-}" ]; then
    timeout -k 10 ${MULTIGPU_TIMEOUT:-420} python3 benches/multigpu.py --kvd "$KVD_BIN" --kvd-log "$OUTDIR/kvd-multigpu.log" ${MULTIGPU_ARGS:-} 2>&1 | tee "$OUTDIR/multigpu.md"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    echo "multigpu: no kvd wheel in $DIR/wheels (scripts/build-gpu-artifacts.sh builds it)"
    status=1
  fi
fi
exit $status

#!/usr/bin/env bash
# Runs kvd's GPU checks on a GPU host from prebuilt artifacts (the GPU host has no Rust):
#   scripts/build-gpu-artifacts.sh      # on the build machine: binaries, test executables, wheel
#   scripts/gpu-check.sh [DIR] [STEPS]  # on the GPU host; DIR defaults to .device
# STEPS is a comma list of: info,rust,python,bench,populate (default: all of these), multigpu
# (benches/multigpu.py on every visible GPU: one kvd, one client process per GPU; about 3 minutes
# on 4 GPUs, bounded by MULTIGPU_TIMEOUT), hip,hip-python, and, on hosts with the memory or
# sockets for them, growth (a 180 GiB pool growing while copies run; GROWTH_GIB sets the size)
# and numa (local vs remote pool placement). Logs go to $OUT when it is set (the device tool's
# output folder), else to DIR/out.
#
# vllm: kvd inside real vLLM 0.26 (scripts/vllm_engine_check.py: issue 19's scenario token for
# token under both model runners, kvd restarted mid-run, TP2 where there are 2 GPUs; ~3-5 min);
# vllm-bench: benches/engine.py, the arms table (~6 min). Both need vLLM installed first, in
# $VLLM_SITE (default /tmp/vsite), and its model config in $VLLM_MODEL (default /tmp/vparts/model):
# scripts/device-vllm.sh 1 … 6, then install (one device command each).
#
# bench-ab: the data-plane benchmark's main table (1 and 8 requests in flight) for a "before"
# kvd ($BEFORE_KVD, default DIR-before/bin/kvd: build it with scripts/build-gpu-artifacts.sh at
# the older commit and move .device to .device-before) and this DIR's kvd, alternated
# before, after, before, after in one run so that both see the same machine; ~3 minutes with the
# default $AB_ARGS, which bench-ab-summary.py turns into one before/after table.
#
# hip, hip-python: on an NVIDIA host, the Rust and Python GPU tests again with kvd and the
# client on the HIP backend, through HIP's NVIDIA platform (DIR/lib/libkvd-hip-nvidia.so over
# the CUDA runtime in torch's wheel). On an AMD host use scripts/gpu-check-amd.sh, which runs
# the usual steps with KVD_GPU_BACKEND=hip on ROCm itself.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device}
STEPS=${2:-info,rust,python,bench,populate}
# The GPU runtime the steps use: KVD_GPU_BACKEND=hip on AMD hosts (gpu-check-amd.sh sets it).
OUTDIR=${OUT:-$DIR/out}
mkdir -p "$OUTDIR"
BIN=$DIR/bin
export KVD_BIN=$PWD/$BIN/kvd RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
status=0

if has info; then
  echo "== machine"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv | tee "$OUTDIR/gpus.csv"
  elif command -v rocm-smi >/dev/null; then
    rocm-smi --showproductname --showuniqueid --showmeminfo vram --showdriverversion | tee "$OUTDIR/gpus.txt"
  fi
  nproc; free -g | head -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", getattr(torch.version, "hip", None), "gpus", torch.cuda.device_count())'
fi
# Runs the Rust GPU tests, one process each; $1 names the run in log file names.
rust_tests() {
  local run=$1
  echo "== rust GPU tests, $run (one process each, 150 s watchdog; kvd logs in \$OUT/kvd-logs-$run.tgz)"
  rm -rf /tmp/kvd-logs && mkdir -p /tmp/kvd-logs
  export KVD_TEST_LOG_DIR=/tmp/kvd-logs
  for t in ${RUST_TESTS:-sentinel gpu::every_layout_and_dtype_round_trips_bit_exact_on_the_gpu gpu::a_store_waits_for_the_clients_event_not_the_host gpu::vmm_memory_is_refused_with_the_allocator_setting_and_the_fix gpu::vmm_memory_of_many_chunks_round_trips_by_descriptor gpu::tp2_two_processes_on_two_gpus_share_one_kvd gpu::a_sigkilled_clients_gpu_memory_returns_within_10s gpu::a_sigkilled_clients_vmm_memory_returns_within_10s}; do
    log="$OUTDIR/rust-$run-${t//:/_}.log"
    start=$(date +%s)
    timeout -k 5 ${RUST_TIMEOUT:-150} "$BIN/gpu-tests" --exact "$t" --nocapture --test-threads 1 > "$log" 2>&1
    rc=$?
    echo "$t: rc=$rc in $(( $(date +%s) - start )) s; $(grep -E 'test result|GPU memory back|SKIPPED|GPU tests will' "$log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || { status=1; grep -E "panicked|assert" -A3 "$log" | head -12; }
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && { echo "watchdog fired: skipping the remaining Rust GPU tests"; break; }
  done
  unset KVD_TEST_LOG_DIR
  # Which backend each kvd the tests started used, as kvd logged it.
  grep -h "GPU backend:" /tmp/kvd-logs/* 2>/dev/null | sed 's/.*GPU backend:/kvd used GPU backend:/' | sort | uniq -c
  tar czf "$OUTDIR/kvd-logs-$run.tgz" -C /tmp kvd-logs
}
# HIP's NVIDIA platform: kvd and the tests load DIR/lib/libkvd-hip-nvidia.so as the HIP
# runtime; it needs the CUDA runtime (libcudart.so.13) that torch's wheel ships.
hip_on_nvidia() {
  local cudart
  cudart=$(python3 -c 'import glob, os, site
for d in site.getsitepackages():
    for p in sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so.1*"))):
        print(os.path.dirname(p)); raise SystemExit' 2>/dev/null)
  [ -n "$cudart" ] || cudart=/usr/local/cuda/lib64
  export KVD_GPU_BACKEND=hip KVD_HIP_LIBRARY=$PWD/$DIR/lib/libkvd-hip-nvidia.so
  export LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "HIP on NVIDIA: $KVD_HIP_LIBRARY over $cudart/libcudart.so.13"
}
if has rust; then
  rust_tests "${KVD_GPU_BACKEND:-cuda}"
fi
if [ -d "$DIR/wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvd-site "$DIR"/wheels/*.whl && export PYTHONPATH=/tmp/kvd-site
fi
# Runs the Python GPU tests; $1 names the run in the log file name.
python_tests() {
  local log="$OUTDIR/python-gpu-tests-$1.log"
  echo "== python GPU tests, $1"
  timeout -k 5 ${PY_TIMEOUT:-420} python3 -m pytest -v -rs -rP connector-py/tests/test_gpu.py -m gpu -p no:cacheprovider ${PY_TESTS:-} 2>&1 | tee "$log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|GPU memory|client GPU" || true
  # Every GPU test must pass: a skip here means a missing GPU or torch, which is a failure.
  grep -qE "[0-9]+ passed" "$log" && ! grep -qE "failed|error|skipped" "$log" || status=1
}
if has python; then
  python_tests "${KVD_GPU_BACKEND:-cuda}"
fi
if has hip || has hip-python; then
  ( hip_on_nvidia
    has hip && rust_tests hip-on-nvidia
    has hip-python && python_tests hip-on-nvidia
    exit $status ) || status=1
fi
if has populate; then
  echo "== pool population and pinning"
  "$BIN/kvd-bench" populate --gib 16 2>&1 | tee "$OUTDIR/populate.md"
  for gib in 16 64; do
    timeout 300 "$BIN/kvd" serve --l1-size-gb $gib --port 0 --http-port 0 --fd-socket /tmp/kvd-pin.sock > "$OUTDIR/pin-$gib.log" 2>&1 &
    pid=$!
    for _ in $(seq 600); do grep -q "L1 pool full" "$OUTDIR/pin-$gib.log" && break; sleep 0.5; done
    grep -E "ready in|L1 pool full|stopped growing|failed" "$OUTDIR/pin-$gib.log"
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
if has bench-ab; then
  BEFORE_KVD=${BEFORE_KVD:-$PWD/$DIR-before/bin/kvd}
  echo "== data plane, before ($BEFORE_KVD) and after ($KVD_BIN), alternated"
  if [ ! -x "$BEFORE_KVD" ] || [ -z "${PYTHONPATH:-}" ]; then
    echo "bench-ab: needs $BEFORE_KVD and a kvd wheel in $DIR/wheels"
    status=1
  else
    for pass in before-1 after-1 before-2 after-2; do
      bin=$KVD_BIN; [[ $pass == before-* ]] && bin=$BEFORE_KVD
      timeout -k 5 ${AB_TIMEOUT:-150} python3 benches/dataplane.py --kvd "$bin" \
        ${AB_ARGS:---pool-gib 24 --quick --sections table --seconds 1 --only llama-3.1-8b,llama-3.1-70b-tp8,deepseek-mla-b64 --layouts BLNHC --inflight 1,8} \
        2>&1 | tee "$OUTDIR/dataplane-$pass.md" | grep -E "^\| " || status=1
    done
    python3 scripts/bench-ab-summary.py "$OUTDIR"/dataplane-{before,after}-*.md | tee "$OUTDIR/dataplane-ab.md"
  fi
fi
if has growth; then
  echo "== pool growth: time to first hit, to a full pool, copies while the pool grows"
  free -g | head -2
  timeout -k 5 ${GROWTH_TIMEOUT:-560} python3 benches/pool_growth.py --kvd "$KVD_BIN" --pool-gib ${GROWTH_GIB:-180} --kvd-log "$OUTDIR/growth-kvd.log" 2>&1 | tee "$OUTDIR/growth.md"
  grep -q "first store+hit" "$OUTDIR/growth.md" || status=1
fi
if has numa; then
  echo "== NUMA placement: GPU 0's stores on its own node, then on another (same run)"
  for n in /sys/devices/system/node/node*; do echo "$(basename "$n"): CPUs $(cat "$n/cpulist")"; done
  nvidia-smi topo -m 2>&1 | head -12
  for mode in auto remote; do
    timeout -k 5 ${NUMA_TIMEOUT:-200} python3 benches/dataplane.py --kvd "$KVD_BIN" --sections table --only llama-3.1-8b,deepseek-mla-b64 --layouts BLNHC,LBNHC --inflight 1,8 --kvd-args="--numa $mode" --kvd-log "$OUTDIR/numa-$mode-kvd.log" 2>&1 | tee "$OUTDIR/numa-$mode.md"
    grep -E "NUMA node" "$OUTDIR/numa-$mode-kvd.log" | sed "s/^/# $mode: /"
  done
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
# Real vLLM: its wheels in $VLLM_SITE beside the kvd wheel gpu-check installed above.
vllm_ready() {
  VSITE=${VLLM_SITE:-/tmp/vsite}
  if [ -z "${PYTHONPATH:-}" ] || ! PYTHONPATH=$PYTHONPATH:$VSITE python3 -c 'import vllm, kvd.vllm' 2>/dev/null; then
    echo "$1: vLLM 0.26 is not importable from $VSITE, or there is no kvd wheel in $DIR/wheels (scripts/device-vllm.sh 1..6, install)"
    return 1
  fi
}
if has vllm; then
  echo "== real vLLM 0.26 + kvd: issue 19's scenario, restart, TP2 (scripts/vllm_engine_check.py)"
  if vllm_ready vllm; then
    PYTHONPATH=$PYTHONPATH:$VSITE timeout -k 10 ${VLLM_TIMEOUT:-590} python3 scripts/vllm_engine_check.py --kvd "$KVD_BIN" \
      --model "${VLLM_MODEL:-/tmp/vparts/model}" --out "$OUTDIR" ${VLLM_ARGS:-} 2>&1 | tee "$OUTDIR/vllm-engine-check.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    status=1
  fi
fi
if has vllm-bench; then
  echo "== real vLLM 0.26: the arms on the agentic traces (benches/engine.py)"
  if vllm_ready vllm-bench; then
    PYTHONPATH=$PYTHONPATH:$VSITE timeout -k 10 ${VLLM_BENCH_TIMEOUT:-590} python3 benches/engine.py --kvd "$KVD_BIN" \
      --model "${VLLM_MODEL:-/tmp/vparts/model}" --out "$OUTDIR" ${VLLM_BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/engine.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  else
    status=1
  fi
fi
exit $status

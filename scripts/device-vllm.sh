#!/usr/bin/env bash
# On the GPU host (no network, no Rust), from the device tool's copy of the checkout: brings vLLM
# 0.26 over in the six parts ../shared/vllm-gpu/fetch.sh cut (each ≤ 58 MiB, under the tool's
# 64 MiB per command), installs it with kvd's wheel, and runs the real-engine check or bench.
# One command per call; /tmp survives between calls while the machine stays warm (~30 s idle).
#
#   scripts/device-vllm.sh 1 … 6              carry .vllm-gpu/partN; copies it into $VPARTS
#   scripts/device-vllm.sh install            carry .device; vLLM into $VSITE, the kvd wheel into
#                                             $KSITE, .device/bin/kvd into /tmp/kvd-bin (~60 s)
#   scripts/device-vllm.sh run check [ARGS]   scripts/vllm_engine_check.py (issue 19's scenario; ~3-5 min)
#   scripts/device-vllm.sh run hybrid [ARGS]  the same check's kvd round trip on the hybrid models in
#                                             benches/models (Gemma 3 sliding window, NemotronH Mamba2);
#                                             ≤ 5 min, ends HYBRID CHECK OK. Four models now (Qwen3-Next,
#                                             DeepSeek-V4 too) do not fit one call's 290 s: name them, e.g.
#                                             run hybrid --scenarios gemma3-swa,nemotronh-mamba, then
#                                             run hybrid --scenarios qwen3-next-tiny --budget-s 560
#                                             --scenario-timeout 540 --start-timeout 420
#   scripts/device-vllm.sh run bench [ARGS]   benches/engine.py (the arms table; ~6 min)
#   scripts/device-vllm.sh run smoke [KV]     vllm-gpu's smoke.py (KV: none, offload, example, JSON)
#   scripts/device-vllm.sh lmcache            carry .lmcache-gpu (scripts/node-bench-prep.sh makes it here);
#                                             LMCache 0.5.6 into /tmp/lmc-site, /tmp/lmc_shim.so, one
#                                             server start so the bench's is not its first (~1-2 min)
#   scripts/device-vllm.sh run node [ARGS]    benches/node.py: E engines behind a router, arms none,
#                                             offload, lmcache, kvd; --quick fits one call (~8 min);
#                                             --passes 3 gives three samples a start, --routers sticky:1,
#                                             sticky:4,sticky:16 --engines 1 the one-engine ladder;
#                                             four 8B engines fit an H100 at --gpu-blocks 1024
#                                             --gpu-mem 0.96 (72.8 of 80 GB, session 22); the
#                                             restart against its control: --engines 2 --arms kvd
#                                             --routers sticky --restart-arms kvd --warm
#                                             --restart-control --step-log (~90 s a --repeats eager,
#                                             ~140 s with --cudagraphs); with
#                                             --probe-tokens 4096 the replacement's readiness probe
#                                             is a prefill the size of the resumed turn's (session 34's
#                                             eager residual: a fresh process's first large prefill?
#                                             session 35: no); --model benches/models/llama70b
#                                             --quantization fp8 needs .device/extra-wheels and
#                                             fits an H100 at --gpu-blocks 1024 --gpu-mem 0.97
#                                             (session 37: all four arms, --passes 2, ~330 s;
#                                             rotate --arms between calls: kvd and the
#                                             OffloadingConnector ran slower when first);
#                                             --arms kvd-base,kvd --kvd-base $PWD/.device/bin/kvd-base
#                                             runs an older kvd build (copied into .device/bin by
#                                             hand) beside the current one in the same call;
#                                             --kvd-base .device/bin/kvd --kvd-base-extra
#                                             '{"kvd.layout":"BLNHC"}' one setting against another
#   scripts/device-vllm.sh run two [ARGS]     the engine check's two-engine scenario (~2-3 min)
#   scripts/device-vllm.sh run hit [ARGS]     benches/hit_ttft.py: a kvd hit's TTFT against a GPU hit's
#                                             and the copy at the link's ceiling; cold TTFT against
#                                             no connector (~2-3 min)
#   scripts/device-vllm.sh run serve [ARGS]   scripts/vllm_serve_warm.py: `python -m kvd.warm` against a real
#                                             `vllm serve` restarted on one kvd (needs .device/extra-wheels from
#                                             scripts/vllm-extra-wheels.sh, installed by install; ~2-3 min)
#   scripts/device-vllm.sh status             what is installed so far
#   scripts/device-vllm.sh v33 N              carry .vllm033-gpu/partNN (scripts/vllm033-bundle.sh made
#                                             it here): vLLM 0.33 with torch 2.14, one part a call
#   scripts/device-vllm.sh v33 install        carry .device; unpacks the parts into $V33SITE (~1 min)
#   VLLM033=1 scripts/device-vllm.sh run …    any run step on vLLM 0.33 (torch 2.14) instead of 0.26
# Logs and results go to $OUT (the device tool's output folder) when it is set, else .device/out.
set -euo pipefail
cd "$(dirname "$0")/.."
VPARTS=${VPARTS:-/tmp/vparts}
V33PARTS=${V33PARTS:-/tmp/v33parts}
V33SITE=${V33SITE:-/tmp/v33site}
if [ -n "${VLLM033:-}" ]; then VSITE=$V33SITE; else VSITE=${VSITE:-/tmp/vsite}; fi
KSITE=${KSITE:-/tmp/kvd-site}
KBIN=/tmp/kvd-bin
LMC_SITE=${LMC_SITE:-/tmp/lmc-site}
WHEEL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
export OUT=${OUT:-$PWD/.device/out}
mkdir -p "$OUT"

# The device tool brings back at most 8 files from $OUT: a node run leaves ~20 (three logs and a
# JSON an arm). Run the step, then pack everything but the reports (*.md) into one archive.
run_packed() {
    local rc=0
    "$@" || rc=$?
    # sample_host's samplers stop before their files are packed.
    if [ -n "${SAMPLERS:-}" ]; then kill $SAMPLERS 2>/dev/null || true; wait $SAMPLERS 2>/dev/null || true; fi
    local files
    files=$(cd "$OUT" && find . -maxdepth 1 -type f ! -name '*.md' ! -name 'out.tgz' -printf '%P\n')
    if [ -n "$files" ]; then
        (cd "$OUT" && tar czf out.tgz --remove-files -T - <<< "$files")
        echo "# $(wc -l <<< "$files") files of $OUT packed into out.tgz (the reports, *.md, beside it)"
    fi
    exit "$rc"
}

# Samples the GPU (nvidia-smi), /proc/stat and /proc/vmstat into $OUT until run_packed stops them.
sample_host() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,clocks.mem,power.draw,temperature.gpu \
      --format=csv -lms 500 > "$OUT/gpu-samples.csv" 2>/dev/null &
    SAMPLERS="$! ${SAMPLERS:-}"
  fi
  # With /proc/stat's cpu line, the kernel's compaction and huge-page counters: pinned pools
  # (kvd's, LMCache's) are unmovable, and an engine's page faults may stall compacting around them.
  (while sleep 0.5; do
     echo "$(date +%s.%N) $(head -1 /proc/stat) |$(grep -E '^(compact_stall|compact_fail|thp_fault_alloc|thp_fault_fallback|thp_collapse_alloc) ' /proc/vmstat | tr '\n' ' ')"
   done > "$OUT/cpu-samples.txt") &
  SAMPLERS="$! ${SAMPLERS:-}"
}

vllm_env() {
  export PYTHONPATH=$KSITE:$VSITE${PYTHONPATH:+:$PYTHONPATH}
  # A .pth file on PYTHONPATH is not read: CuTe DSL's (vLLM 0.33's DeepSeek-V4) adds this folder.
  if [ -d "$VSITE/nvidia_cutlass_dsl/dsl_packages" ]; then PYTHONPATH=$PYTHONPATH:$VSITE/nvidia_cutlass_dsl/dsl_packages; fi
  # torch 2.14 links NCCL entry points the host's NCCL lacks (scripts/nccl-missing.c).
  if [ -n "${VLLM033:-}" ] && [ -f "$VSITE/libnccl-missing.so" ]; then export LD_PRELOAD=$VSITE/libnccl-missing.so; fi
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1 VLLM_MODEL=${VLLM_MODEL:-$VPARTS/model}
  # Multi-GPU hosts: NVLink multicast off (the device tool's KINDS.md).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [ -z "${KVD_BIN:-}" ]; then
    if [ -x .device/bin/kvd ]; then KVD_BIN=$PWD/.device/bin/kvd; elif [ -x "$KBIN/kvd" ]; then KVD_BIN=$KBIN/kvd; fi
  fi
  export KVD_BIN=${KVD_BIN:-}
}

case "${1:-}" in
  [1-6])
    src=.vllm-gpu/part$1
    [ -d "$src" ] || { echo "no $src here: carry it with this command (carry: [\"$src\"])"; exit 1; }
    mkdir -p "$VPARTS" && cp -r "$src"/. "$VPARTS"/
    echo "part $1 copied: $(ls "$VPARTS" | wc -l) files, $(du -sh "$VPARTS" | cut -f1) in $VPARTS"
    ;;
  install)
    if PYTHONPATH=$VSITE python3 -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.26.0")' 2>/dev/null; then
      echo "vLLM 0.26.0 already in $VSITE"
    else
      missing=""
      [ -f "$VPARTS/install.sh" ] || missing="part1"
      for s in aa ab ac ad ae; do [ -f "$VPARTS/$WHEEL.part-$s" ] || [ -f "$VPARTS/$WHEEL" ] || missing="$missing $WHEEL.part-$s"; done
      [ -z "$missing" ] || { echo "missing in $VPARTS: $missing (run: scripts/device-vllm.sh N for each part first)"; exit 1; }
      bash "$VPARTS/install.sh" "$VSITE"
    fi
    ls .device/wheels/kvd-*.whl >/dev/null 2>&1 || { echo "no kvd wheel in .device/wheels: carry .device (scripts/build-gpu-artifacts.sh)"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$KSITE" .device/wheels/kvd-*.whl
    # What `vllm serve` and quantization need beyond LLM() (scripts/vllm-extra-wheels.sh).
    if ls .device/extra-wheels/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target "$VSITE" .device/extra-wheels/*.whl
    fi
    mkdir -p "$KBIN" && cp .device/bin/kvd "$KBIN/kvd"
    vllm_env
    python3 -c 'import vllm, kvd, kvd.vllm, torch; print("vllm", vllm.__version__, "| kvd", kvd.__file__, "| torch", torch.__version__, "cuda", torch.version.cuda)'
    "$KBIN/kvd" --version
    ;;
  run)
    vllm_env
    step=${2:-}
    set -- "${@:3}"
    [ -n "$KVD_BIN" ] || { echo "no kvd binary (.device/bin/kvd or $KBIN/kvd): run install with .device carried"; exit 1; }
    case "$step" in
      check) run_packed python3 scripts/vllm_engine_check.py --kvd "$KVD_BIN" --model "$VLLM_MODEL" --out "$OUT" "$@" ;;
      # Two engines of ~40 s start each plus seven 12k-token prompts: 290 s in all, at most 170 s
      # for the first so that the second still runs.
      hybrid) run_packed python3 scripts/vllm_engine_check.py --scenarios hybrid --kvd "$KVD_BIN" --out "$OUT" \
                 --budget-s 290 --scenario-timeout 170 --start-timeout 150 "$@" ;;
      bench) run_packed python3 benches/engine.py --kvd "$KVD_BIN" --model "$VLLM_MODEL" --out "$OUT" "$@" ;;
      smoke) run_packed python3 "$VPARTS/smoke.py" --model "$VLLM_MODEL" --kv "${1:-none}" ;;
      # The model is the 8B shape in benches/models unless --model says otherwise; LMCache from
      # `lmcache` above (the arm is reported skipped without it).
      # Beside it, the GPU's clocks and utilisation and the host's CPU counters (steal included)
      # and compaction stalls every 0.5 s: session 21's one-engine ladder had kvd's steps slower
      # where kvd did nothing, and only such samples tell the machine's drift from the engine's.
      node) sample_host; run_packed python3 benches/node.py --kvd "$KVD_BIN" --out "$OUT" --lmcache-site "$LMC_SITE" "$@" ;;
      two) run_packed python3 scripts/vllm_engine_check.py --scenarios two --kvd "$KVD_BIN" --model "$VLLM_MODEL" \
              --out "$OUT" "$@" ;;
      # The 8B shape in benches/models unless --model says otherwise.
      hit) run_packed python3 benches/hit_ttft.py --kvd "$KVD_BIN" --out "$OUT" "$@" ;;
      # `python -m kvd.warm` against a real `vllm serve`, restarted (the 1B shape; ~2-3 min).
      serve) run_packed python3 scripts/vllm_serve_warm.py --kvd "$KVD_BIN" --model "$VLLM_MODEL" --out "$OUT" "$@" ;;
      *) echo "run what? check, hybrid, bench, smoke, node, two, hit or serve"; exit 2 ;;
    esac
    ;;
  lmcache)
    [ -f .lmcache-gpu/setup.sh ] || { echo "no .lmcache-gpu/setup.sh here: run scripts/node-bench-prep.sh on the dev machine and carry .lmcache-gpu"; exit 1; }
    PYTHONPATH=$VSITE python3 -c 'import vllm' 2>/dev/null || { echo "vLLM is not in $VSITE yet: run install first"; exit 1; }
    bash .lmcache-gpu/setup.sh .lmcache-gpu "$LMC_SITE"
    vllm_env
    # Its first start compiles (8-50 s, ../shared/lmcache-gpu): pay that here, not in a bench arm.
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    health="http://127.0.0.1:$((port + 1))/healthcheck"
    LD_PRELOAD=/tmp/lmc_shim.so PYTHONPATH=$PYTHONPATH:$LMC_SITE LMCACHE_TRACK_USAGE=false \
      setsid python3 -m lmcache.cli.main server --l1-size-gb 1 --eviction-policy LRU --port "$port" \
      --http-port $((port + 1)) --max-gpu-workers 1 > "$OUT/lmcache-warm.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    until python3 -c "import urllib.request as u, sys; sys.exit(u.urlopen('$health', timeout=2).status != 200)" 2>/dev/null; do
      kill -0 "$pid" 2>/dev/null || { echo "lmcache server exited; $OUT/lmcache-warm.log:"; tail -20 "$OUT/lmcache-warm.log"; exit 1; }
      if [ $(( $(date +%s) - t0 )) -ge 150 ]; then
        echo "lmcache server not healthy in 150 s:"; tail -20 "$OUT/lmcache-warm.log"; kill -- -"$pid" 2>/dev/null || true; exit 1
      fi
      sleep 1
    done
    echo "lmcache server healthy $(( $(date +%s) - t0 )) s after its first start"
    kill -- -"$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    ;;
  v33)
    case "${2:-}" in
      install)
        if PYTHONPATH=$V33SITE python3 -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' 2>/dev/null; then
          echo "vLLM 0.33.0 already in $V33SITE"
        else
          ls "$V33PARTS"/vllm033.tar.zst.part-* >/dev/null 2>&1 && [ -f "$V33PARTS/SHA256SUMS" ] \
            || { echo "no parts in $V33PARTS: run scripts/device-vllm.sh v33 N for each part first"; exit 1; }
          want=$(cut -d' ' -f1 "$V33PARTS/SHA256SUMS")
          got=$(cat "$V33PARTS"/vllm033.tar.zst.part-* | sha256sum | cut -d' ' -f1)
          [ "$want" = "$got" ] || { echo "parts incomplete or damaged: sha256 $got, want $want ($(ls "$V33PARTS" | tr '\n' ' '))"; exit 1; }
          python3 -m pip install -q --no-index --no-deps --target /tmp/zst-site "$V33PARTS"/zstandard-*.whl
          mkdir -p "$V33SITE"
          cat "$V33PARTS"/vllm033.tar.zst.part-* | PYTHONPATH=/tmp/zst-site python3 -c \
            'import sys, zstandard; zstandard.ZstdDecompressor(max_window_size=1 << 27).copy_stream(sys.stdin.buffer, sys.stdout.buffer)' \
            | tar -C "$V33SITE" -xf -
          cp "$V33PARTS/libnccl-missing.so" "$V33SITE/"
        fi
        ls .device/wheels/kvd-*.whl >/dev/null 2>&1 || { echo "no kvd wheel in .device/wheels: carry .device (scripts/build-gpu-artifacts.sh)"; exit 1; }
        python3 -m pip install -q --no-index --no-deps --upgrade --target "$KSITE" .device/wheels/kvd-*.whl
        mkdir -p "$KBIN" && cp .device/bin/kvd "$KBIN/kvd"
        VLLM033=1 VSITE=$V33SITE vllm_env
        python3 -c 'import torch, vllm, kvd.vllm, cutlass, tilelang; print("vllm", vllm.__version__, "| torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "| nccl", torch.cuda.nccl.version())'
        ;;
      [0-9]*)
        src=.vllm033-gpu/part$(printf '%02d' "$((10#$2))")
        [ -d "$src" ] || { echo "no $src here: carry it with this command (carry: [\"$src\"])"; exit 1; }
        mkdir -p "$V33PARTS" && cp -r "$src"/. "$V33PARTS"/
        echo "$src copied: $(ls "$V33PARTS" | wc -l) files, $(du -sh "$V33PARTS" | cut -f1) in $V33PARTS"
        ;;
      *) echo "v33 what? a part number or install"; exit 2 ;;
    esac
    ;;
  status)
    ls "$VPARTS" 2>/dev/null | sed 's/^/parts: /' | head -40
    PYTHONPATH=$KSITE:$VSITE python3 -c 'import vllm, kvd; print("vllm", vllm.__version__, "kvd from", kvd.__file__)' 2>&1 | tail -1
    ls -la "$KBIN" .device/bin 2>/dev/null || true
    ;;
  *)
    sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"
    exit 2
    ;;
esac

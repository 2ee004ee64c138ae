#!/usr/bin/env bash
# The disk tier at GPU rates: the agentic replay (MLA geometry, half B, 25% L1) with a disk
# tier holding every chunk, for .device/bin/kvd and .device/main/kvd-main (an older build, with
# its wheel beside it, if put there), and without a disk, one after another (RUNS picks which, in order). Run it on
# the device machine after scripts/build-gpu-artifacts.sh and copying the traces to
# .device/traces; reports go to $OUT. On the H200 a pair takes ~100 s: REPEATS=3 runs RUNS three
# times in one call, alternating (reports NAME-1 … NAME-3), within one call's 600 s; FIRST=3
# REPEATS=3 runs only the third round (a second call, where three rounds outrun one call).
# new-disk-q64 fixes the write reserve at 64 MiB (--disk-write-queue-mb), against the paced one;
# new-disk-maxN paces it up to N MiB (--disk-write-reserve-max-mb) instead of an eighth of L1.
# DUMP=1 also keeps what kvd was sent (agentic.py --dump-events), for replay_events offline,
# packed with xz in events.tar.xz (the lookups' chunk lists repeat turn after turn).
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a folder for the reports (the device tool sets it)}"
echo "== $(date -u +%H:%M:%S) $(nproc) cores; $(lscpu | grep 'Model name' | head -1); $(df -h /tmp | tail -1)"
[ -d /tmp/kvd-site/kvd ] || { python3 -m pip install -q --no-index --no-deps --target /tmp/kvd-site .device/wheels/*.whl; cp connector-py/python/kvd/*.py /tmp/kvd-site/kvd/; }
# The older build's connector is its own wheel (.device/main/*.whl, with its Python files): the
# protocol may differ.
if [ -f .device/main/kvd-main ] && [ ! -d /tmp/kvd-site-main/kvd ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvd-site-main .device/main/*.whl
fi
run() { # name binary extra...
  local name=$1 bin=$2 site=/tmp/kvd-site; shift 2
  case $bin in kvd-main) bin=../main/kvd-main; site=/tmp/kvd-site-main ;; esac
  rm -rf /tmp/kvd-agentic-disk
  echo "== $(date -u +%H:%M:%S) $name"
  PYTHONPATH=$site timeout 200 python3 benches/agentic.py --kvd .device/bin/$bin --trace-dir .device/traces --half B \
    --geometry deepseek-mla --gpu-blocks 4096 --token-scale 16 --pool-frac 0.25 --eviction prefix-reuse \
    --json $OUT/$name.jsonl ${DUMP:+--dump-events $OUT/$name.events} "$@" > $OUT/$name.md 2>&1
  tail -16 $OUT/$name.md | cut -c1-420
}
n=${REPEATS:-1}
for i in $(seq "${FIRST:-1}" "$n"); do
  for r in ${RUNS:-new-disk main-disk new-nodisk}; do
    name=$r; [ "$n" = 1 ] || name=$r-$i
    case $r in
      new-disk) run "$name" kvd --disk-dir /tmp/kvd-agentic-disk ;;
      main-disk) run "$name" kvd-main --disk-dir /tmp/kvd-agentic-disk ;;
      new-disk-q64) run "$name" kvd --disk-dir /tmp/kvd-agentic-disk --kvd-arg=--disk-write-queue-mb=64 ;;
      new-disk-max*) run "$name" kvd --disk-dir /tmp/kvd-agentic-disk --kvd-arg=--disk-write-reserve-max-mb=${r#new-disk-max} ;;
      new-nodisk) run "$name" kvd ;;
    esac
  done
done
# The device tool brings back at most 8 files: the reports stay, the event logs go in one archive.
if [ "$n" != 1 ]; then (cd "$OUT" && tar -czf replays-jsonl.tgz --remove-files ./*.jsonl); fi
if [ -n "${DUMP:-}" ]; then (cd "$OUT" && XZ_OPT=-9T0 tar -cJf events.tar.xz --remove-files ./*.events.*.txt && ls -la events.tar.xz); fi
echo "== $(date -u +%H:%M:%S) done"

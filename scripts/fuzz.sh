#!/usr/bin/env bash
# The long fuzzing run (CI only replays the committed corpora: `cargo test -p kvd-fuzz`, and a few
# seconds of atheris in scripts/test.sh). Targets: wire_request, wire_reply, zmtp, fd_header,
# geometry (Rust, AFL++ through cargo-afl on the pinned stable toolchain) and config (Python,
# atheris). Each runs until it has made EXECS executions (default 10 million) or, with --minutes,
# for at most that long; a crash or hang fails the run.
#
#   scripts/fuzz.sh [--execs N] [--minutes T] [--jobs J] [--mem-mb M] [--update-corpus] [TARGET...]
#       build here (needs `cargo install cargo-afl --locked && cargo afl config --build`) and run
#   scripts/fuzz.sh --package DIR
#       build, and put everything a machine without Rust or network needs into DIR: the
#       harness, afl-fuzz/afl-showmap/afl-cmin.bash, the corpora, config_fuzz.py and atheris wheels
#   DIR/fuzz.sh [--execs N] [--jobs J] [TARGET...]
#       run from such a DIR (its own copy of this script), e.g. .device-fuzz (git-ignored, about
#       45 MB, so it travels to the GPU host on its own rather than inside .device)
#
# Results go to $FUZZ_OUT (default fuzz-out in cargo's target directory): per target AFL's fuzzer_stats or
# libFuzzer's log, crashes/ and hangs/. --update-corpus minimizes each AFL queue (afl-cmin) back
# into fuzz/corpus/TARGET and copies libFuzzer's into connector-py/fuzz/corpus/config.
set -euo pipefail

EXECS=10000000
MINUTES=0
JOBS=$(nproc)
MEM_MB=512
UPDATE=0
PACKAGE=""
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --execs) EXECS=$2; shift 2 ;;
    --minutes) MINUTES=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --mem-mb) MEM_MB=$2; shift 2 ;;
    --update-corpus) UPDATE=1; shift ;;
    --package) PACKAGE=$2; shift 2 ;;
    -h|--help) sed -n 2,23p "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) TARGETS+=("$1"); shift ;;
  esac
done
ALL=(wire_request wire_reply zmtp fd_header geometry config)
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${ALL[@]}")

HERE=$(cd "$(dirname "$0")" && pwd)
if [ -x "$HERE/kvd-fuzz" ]; then
  # A packaged run: everything lies beside this script.
  BIN=$HERE AFL=$HERE CORPUS=$HERE/corpus PYFUZZ=$HERE/config_fuzz.py
  PY=${PYTHON:-python3}
  if ! "$PY" -c "import atheris" 2>/dev/null; then
    VENV=$HERE/venv
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --no-index --find-links "$HERE/wheels" atheris
    PY=$VENV/bin/python
  fi
  OUT=${FUZZ_OUT:-$HERE/out}
else
  ROOT=$(cd "$HERE/.." && pwd)
  cd "$ROOT"
  command -v cargo-afl >/dev/null || {
    echo "fuzz.sh: cargo-afl is missing; install it with: cargo install cargo-afl --locked && cargo afl config --build" >&2
    exit 2
  }
  # cargo afl builds with AFL's instrumentation on the pinned toolchain (no nightly needed).
  cargo afl build --release --locked -p kvd-fuzz --features afl
  TARGET=$("$ROOT/scripts/target-dir.sh")
  BIN=$TARGET/release
  AFL=$(dirname "$(find "$HOME/.local/share/afl.rs" -path '*/bin/afl-fuzz' | head -1)")
  CORPUS=$ROOT/fuzz/corpus PYFUZZ=$ROOT/connector-py/fuzz/config_fuzz.py
  OUT=${FUZZ_OUT:-$TARGET/fuzz-out}
  PY=${PYTHON:-$ROOT/.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  if [ -n "$PACKAGE" ]; then
    mkdir -p "$PACKAGE/wheels" "$PACKAGE/corpus"
    cp "$BIN/kvd-fuzz" "$AFL/afl-fuzz" "$AFL/afl-showmap" "$AFL/afl-cmin.bash" "$PYFUZZ" "$0" "$PACKAGE/"
    mkdir -p "$PACKAGE/python/kvd"
    cp "$ROOT/connector-py/python/kvd/config.py" "$PACKAGE/python/kvd/"
    # config_fuzz.py finds config.py at ../python/kvd from its own directory; in the package it
    # sits at DIR, so give it the same shape.
    mkdir -p "$PACKAGE/py" && mv "$PACKAGE/config_fuzz.py" "$PACKAGE/py/" && ln -sf py/config_fuzz.py "$PACKAGE/config_fuzz.py"
    cp -r "$ROOT/fuzz/corpus/." "$PACKAGE/corpus/"
    cp -r "$ROOT/connector-py/fuzz/corpus/config" "$PACKAGE/corpus/"
    # atheris for the Python versions named (the GPU host has 3.12); about 35 MB a wheel.
    for v in ${FUZZ_PY_VERSIONS:-3.12}; do
      "$PY" -m pip download -q --only-binary=:all: --no-deps --python-version "$v" \
        --platform manylinux2014_x86_64 -d "$PACKAGE/wheels" atheris || true
    done
    echo "packaged into $PACKAGE; run: $PACKAGE/fuzz.sh --execs $EXECS"
    exit 0
  fi
fi
mkdir -p "$OUT"
AFL_TIME=() PY_TIME=()
if [ "$MINUTES" != 0 ]; then
  AFL_TIME=(-V "$((MINUTES * 60))") PY_TIME=(-max_total_time="$((MINUTES * 60))")
fi
export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1

run_afl() {
  local t=$1 o=$OUT/$1
  rm -rf "$o" && mkdir -p "$o"
  # -m: the harness's address-space limit; -t: ms per input before it counts as a hang;
  # -E: stop after about EXECS executions.
  "$AFL/afl-fuzz" -i "$CORPUS/$t" -o "$o" -m "$MEM_MB" -t 1000 -E "$EXECS" "${AFL_TIME[@]}" -- "$BIN/kvd-fuzz" "$t" \
    > "$o/afl.log" 2>&1 || { echo "$t: afl-fuzz failed, see $o/afl.log" >&2; tail -20 "$o/afl.log" >&2; return 1; }
  if [ "$UPDATE" = 1 ] && [ -n "${ROOT:-}" ]; then
    rm -rf "$o/min"
    AFL_PATH=$AFL PATH=$AFL:$PATH "$AFL/afl-cmin.bash" -i "$o/default/queue" -o "$o/min" -m "$MEM_MB" -- "$BIN/kvd-fuzz" "$t" > "$o/cmin.log" 2>&1
    # Never replace a corpus with an empty minimization.
    [ -n "$(ls -A "$o/min" 2>/dev/null)" ] || { echo "$t: afl-cmin kept nothing, see $o/cmin.log" >&2; return 1; }
    rm -rf "$ROOT/fuzz/corpus/$t" && cp -r "$o/min" "$ROOT/fuzz/corpus/$t"
  fi
}

run_atheris() {
  local o=$OUT/config
  rm -rf "$o" && mkdir -p "$o/queue" "$o/crashes"
  cp "$CORPUS/config/"* "$o/queue/" 2>/dev/null || cp "$ROOT/connector-py/fuzz/corpus/config/"* "$o/queue/"
  "$PY" "$PYFUZZ" "$o/queue" -atheris_runs="$EXECS" -rss_limit_mb="$MEM_MB" -timeout=10 "${PY_TIME[@]}" \
    -artifact_prefix="$o/crashes/" > "$o/fuzz.log" 2>&1 || { echo "config: atheris found a failure, see $o/fuzz.log" >&2; return 1; }
  if [ "$UPDATE" = 1 ] && [ -n "${ROOT:-}" ]; then
    # libFuzzer keeps its corpus directory reduced as it goes (atheris's -merge=1 keeps nothing).
    local dst=$ROOT/connector-py/fuzz/corpus/config
    rm -rf "$dst" && cp -r "$o/queue" "$dst"
  fi
}

pids=() names=() failed=0
for t in "${TARGETS[@]}"; do
  case " ${ALL[*]} " in *" $t "*) ;; *) echo "fuzz.sh: unknown target $t; targets: ${ALL[*]}" >&2; exit 2 ;; esac
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  if [ "$t" = config ]; then run_atheris & else run_afl "$t" & fi
  pids+=($!) names+=("$t")
done
for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=1; done

printf '%-14s %12s %10s %8s %6s\n' target execs exec/s crashes hangs
for t in "${TARGETS[@]}"; do
  if [ "$t" = config ]; then
    log=$OUT/config/fuzz.log
    # atheris ends with "Done N in T second(s)"; a run cut short has only "#N" progress lines.
    execs=$(grep -oE '^Done [0-9]+' "$log" | grep -oE '[0-9]+' || true)
    [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)
    rate=$(grep -oE 'exec/s: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)
    crashes=$(find "$OUT/config/crashes" -type f | wc -l)
    printf '%-14s %12s %10s %8s %6s\n' "$t" "${execs:-?}" "${rate:-?}" "$crashes" "-"
  else
    s=$OUT/$t/default/fuzzer_stats
    get() { awk -F' *: *' -v k="$1" '$1==k {print $2}' "$s" 2>/dev/null; }
    printf '%-14s %12s %10s %8s %6s\n' "$t" "$(get execs_done)" "$(get execs_per_sec)" "$(get saved_crashes)" "$(get saved_hangs)"
    [ "$(get saved_crashes)" = 0 ] && [ "$(get saved_hangs)" = 0 ] || failed=1
  fi
done
exit $failed

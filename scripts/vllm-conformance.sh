#!/usr/bin/env bash
# vLLM conformance check of the kvd connector, on CPU (no GPU needed):
#
#   scripts/vllm-conformance.sh [VENV] [PYTEST ARGS...]
#
# 1. makes the virtual environment VENV (default .venv-vllm) unless it exists, and installs the
#    pinned vLLM (VLLM_VERSION, default 0.33.0) into it unless that version is already there.
#    This is big: about 4.3 GB downloaded, 9.5 GB on disk, about 7 minutes (torch with its CUDA
#    wheels comes along; vLLM imports and schedules fine without a GPU), installed a few wheels
#    at a time so that the disk peaks at ~10 GB, not ~14 (scripts/pip_staged_install.py);
# 2. builds the kvd wheel with maturin and installs it into VENV (the maturin on PATH, else one
#    installed into VENV);
# 3. builds the kvd server (cargo build -p kvd-server; PROFILE=release for a release build),
#    unless KVD_BIN names one already built;
# 4. runs connector-py/tests/test_vllm_conformance.py (0.33 only: its layout API) and
#    test_vllm_engine.py (both releases): KvdConnector loaded through vLLM's KVConnectorFactory
#    and driven by vLLM's own v1 Scheduler and model-runner plumbing against a real kvd process;
#    then test_vllm_observability.py (kvd in vLLM's /metrics and KV events),
#    test_vllm_multiconnector.py (kvd under MultiConnector, PD beside NixlConnector) and
#    test_vllm_models.py (0.33 only: DeepSeek-V4, Gemma-3, Gemma-4 and Qwen3-Next with the KV
#    cache specs vLLM's own layer classes make, evicted, preempted, kvd restarted and stopped).
#    VLLM_VERSION=0.26.0 checks the older release the GPU host runs.
#
# Environment: PYTHON (the interpreter that makes VENV; vLLM 0.33 needs 3.11 to 3.14),
# VLLM_VERSION, PROFILE (debug or release), KVD_WHEEL (a kvd wheel to install instead of
# building one), KVD_BIN (a kvd server to start instead of building one). Exits non-zero if anything fails, or if vLLM cannot be
# imported (the tests would otherwise be skipped, which is not a pass here).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
[ $# -gt 0 ] && shift
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PROFILE=${PROFILE:-debug}
PY=$VENV/bin/python

# --- 1. the environment with the pinned vLLM
if [ ! -x "$PY" ]; then
  echo "== creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if "$PY" -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "== vLLM $VLLM_VERSION is already in $VENV"
else
  echo "== installing vLLM $VLLM_VERSION into $VENV (large; takes a few minutes)"
  df -h "$VENV" | sed 's/^/== disk: /'
  # A few wheels at a time: one `pip install` holds all 4.3 GB of wheels until it ends, on top
  # of what they unpack to (scripts/pip_staged_install.py).
  "$PY" scripts/pip_staged_install.py "vllm==$VLLM_VERSION"
fi
"$PY" -c "import pytest, zmq" 2>/dev/null || "$PY" -m pip install "pytest>=7" "pyzmq>=25"

# --- 2. the kvd wheel (KVD_WHEEL: one already built, e.g. by scripts/test.sh)
if [ -n "${KVD_WHEEL:-}" ]; then
  echo "== installing the kvd wheel $KVD_WHEEL"
  "$PY" -m pip install --force-reinstall --no-deps "$KVD_WHEEL"
elif command -v maturin >/dev/null; then
  MATURIN=maturin
else
  "$PY" -m pip install "maturin>=1.9,<2"
  MATURIN=$VENV/bin/maturin
fi
if [ -z "${KVD_WHEEL:-}" ]; then
  DIST=$(mktemp -d)
  trap 'rm -rf "$DIST"' EXIT
  echo "== building the kvd wheel"
  "$MATURIN" build --release -m connector-py/Cargo.toml -o "$DIST"
  "$PY" -m pip install --force-reinstall --no-deps "$DIST"/kvd-*.whl
fi

# --- 3. the kvd server (KVD_BIN: one already built, e.g. by scripts/test.sh)
if [ -n "${KVD_BIN:-}" ]; then
  [ -x "$KVD_BIN" ] || { echo "KVD_BIN=$KVD_BIN is not an executable kvd; unset it to build one here" >&2; exit 1; }
else
  echo "== building kvd ($PROFILE)"
  if [ "$PROFILE" = release ]; then
    cargo build --release -p kvd-server
  else
    cargo build -p kvd-server
  fi
  export KVD_BIN=$(scripts/target-dir.sh)/$PROFILE/kvd
fi

# --- 4. the conformance tests
"$PY" - <<EOF
import vllm, kvd, kvd.vllm
assert vllm.__version__ == "$VLLM_VERSION", vllm.__version__
print("== vLLM", vllm.__version__, "| kvd", kvd.__version__, "from", kvd.__file__, "| kvd server", "$KVD_BIN")
EOF
# The model is a local config.json; nothing needs the network. The connector's layout must win.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
unset VLLM_KV_CACHE_LAYOUT
"$PY" -m pytest -m vllm connector-py/tests/test_vllm_conformance.py connector-py/tests/test_vllm_observability.py \
  connector-py/tests/test_vllm_multiconnector.py connector-py/tests/test_vllm_engine.py \
  connector-py/tests/test_vllm_models.py -v -rs -p no:cacheprovider "$@"

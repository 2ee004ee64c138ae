#!/usr/bin/env bash
# On the dev machine (it downloads): what the node benchmark's LMCache arm needs on the GPU host,
# in .lmcache-gpu — LMCache 0.5.6 and the wheels it lacks there (../shared/lmcache-gpu/fetch.sh,
# ~23 MiB) and that folder's setup.sh, which `scripts/device-vllm.sh lmcache` runs there. The
# folder is git-ignored locally (.git/info/exclude), so it travels only when a call carries it.
#
#   scripts/node-bench-prep.sh [SHARED_LMCACHE_DIR]     (default ../shared/lmcache-gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-../shared/lmcache-gpu}
[ -f "$SRC/fetch.sh" ] && [ -f "$SRC/setup.sh" ] || { echo "no fetch.sh and setup.sh in $SRC: pass the lmcache-gpu folder"; exit 1; }
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.lmcache-gpu/' "$EXCLUDE" 2>/dev/null || echo '/.lmcache-gpu/' >> "$EXCLUDE"
if ! ls .lmcache-gpu/lmcache-0.5.6-*.whl >/dev/null 2>&1; then
  bash "$SRC/fetch.sh" .lmcache-gpu
fi
cp "$SRC/setup.sh" .lmcache-gpu/setup.sh
chmod +x .lmcache-gpu/setup.sh
echo "ready to carry: .lmcache-gpu ($(du -sh .lmcache-gpu | cut -f1), $(ls .lmcache-gpu/*.whl | wc -l) wheels + setup.sh)"
git status --short --ignored .lmcache-gpu | head -2

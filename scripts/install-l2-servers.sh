#!/usr/bin/env bash
# Installs what the L2 tests start: a Valkey or Redis server with cluster mode and its CLI
# (Debian 12 packages redis-server 7.0 and redis-tools). Idempotent: does nothing when both are
# already on PATH, so a warm CI machine pays no apt time.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if { have valkey-server || have redis-server; } && { have valkey-cli || have redis-cli; }; then
  exit 0
fi
SUDO=
if [ "$(id -u)" -ne 0 ]; then
  have sudo || { echo "install redis-server and redis-tools (or valkey) as root: the L2 tests need them" >&2; exit 1; }
  SUDO=sudo
fi
echo "== installing redis-server and redis-tools for the L2 tests"
$SUDO apt-get update -qq
# The package's service is not needed (the tests start their own servers on free ports).
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  redis-server redis-tools >/dev/null

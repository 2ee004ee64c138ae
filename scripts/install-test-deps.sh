#!/usr/bin/env bash
# Installs what scripts/test.sh needs beyond Rust, or says the one command that does. Idempotent:
# when everything is there it does nothing (no apt time on a warm machine).
#   - ROCm's HIP headers and a C++ compiler (libamdhip64-dev, g++): scripts/check-hip-abi.sh
#     compiles kvd's HIP declarations against them (Debian ships ROCm 5.2);
#   - python3-dev: `cargo test -p kvd-connector` links libpython (pyo3), whose link name
#     (libpython3.11.so) only python3-dev has; python3-venv for the test virtualenv;
#   - redis-server and redis-tools (or Valkey): the L2 tests start real servers and clusters;
#   - openssl: the L2 TLS tests make a throwaway CA and server certificate at test time;
#   - promtool (prometheus) and systemd-analyze (systemd): deploy/tests check the alert rules
#     and the systemd unit with them.
# Rust crates come through cargo, maturin, pytest, pyzmq and mypy through pip in a virtualenv.
# The services redis-server and prometheus would start (now and at every boot) are not
# wanted: the tests start their own servers on free ports. None is started while installing
# (a policy-rc.d that refuses, which Debian's maintainer scripts ask first, whether systemd
# runs or not), and each is disabled after: `systemctl disable --now` where systemd runs,
# `systemctl disable` (which works without it) where it does not.
# KVD_TEST_DEPS_ROOT stands in for / (scripts/tests runs this against stand-ins).
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
pkgs=()
if ! python3 -c 'import os, sys, sysconfig as s; sys.exit(not os.path.exists(os.path.join(s.get_config_var("LIBDIR"), s.get_config_var("LDLIBRARY"))))' 2>/dev/null; then
  pkgs+=(python3-dev)
fi
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  pkgs+=(python3-venv)
fi
if ! [ -f /usr/include/hip/hip_runtime_api.h ]; then
  pkgs+=(libamdhip64-dev)
fi
have c++ || pkgs+=(g++)
{ have valkey-server || have redis-server; } || pkgs+=(redis-server)
{ have valkey-cli || have redis-cli; } || pkgs+=(redis-tools)
have openssl || pkgs+=(openssl)
have promtool || pkgs+=(prometheus)
have systemd-analyze || pkgs+=(systemd)
# (Not `ldd | grep -q`: under pipefail grep's early exit fails the pipeline.)
if have redis-server && ! ldd "$(command -v redis-server)" 2>/dev/null | grep libssl >/dev/null; then
  echo "warning: this redis-server is built without TLS; the L2 TLS tests will fail (Debian's has it)" >&2
fi
[ ${#pkgs[@]} -eq 0 ] && exit 0

cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${pkgs[*]}"
SUDO=
if [ "$(id -u)" -ne 0 ]; then
  if have sudo && sudo -n true 2>/dev/null; then
    SUDO="sudo"
  else
    echo "scripts/test.sh needs: ${pkgs[*]}. Install them as root, then run it again:" >&2
    echo "  sudo sh -c '$cmd'" >&2
    exit 1
  fi
fi
if ! have apt-get; then
  echo "scripts/test.sh needs ${pkgs[*]} (Debian/Ubuntu names); install them with your package manager" >&2
  exit 1
fi
services=()
for p in "${pkgs[@]}"; do
  case $p in
    redis-server | prometheus) services+=("$p") ;;
  esac
done
root=${KVD_TEST_DEPS_ROOT:-}
policy=$root/usr/sbin/policy-rc.d
if [ ${#services[@]} -gt 0 ]; then
  # An image's own policy-rc.d (Docker's refuses every start) is kept and put back.
  if [ -e "$policy" ]; then $SUDO mv "$policy" "$policy.kvd-saved"; fi
  restore() {
    $SUDO rm -f "$policy"
    if [ -e "$policy.kvd-saved" ]; then $SUDO mv "$policy.kvd-saved" "$policy"; fi
  }
  trap restore EXIT
  printf '#!/bin/sh\n# scripts/install-test-deps.sh: start no service while it installs.\nexit 101\n' \
    | $SUDO tee "$policy" >/dev/null
  $SUDO chmod 0755 "$policy"
fi
echo "== installing ${pkgs[*]} (apt-get)"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null
if [ ${#services[@]} -gt 0 ]; then
  if [ -d "$root/run/systemd/system" ]; then
    disable=(disable --now)
  else
    disable=(disable)
  fi
  if ! have systemctl; then
    echo "note: no systemctl: ${services[*]} may start at boot; disable them with your init system" >&2
  elif ! $SUDO systemctl "${disable[@]}" "${services[@]}" >/dev/null 2>&1; then
    echo "warning: could not disable ${services[*]} (systemctl ${disable[*]}); the tests do not need them" >&2
  fi
fi

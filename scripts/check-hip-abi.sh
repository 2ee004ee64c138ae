#!/usr/bin/env bash
# Keeps kvd's HIP backend honest without an AMD GPU (CI runs this from scripts/test.sh):
#  1. compiles kvd's HIP declarations (gpu/src/hip/sys.rs, through hip::abi) against ROCm's own
#     hip_runtime_api.h: every entry point's prototype, struct size and constant kvd relies on;
#     and resolves every entry point from ROCm's runtime library (Debian's libamdhip64.so.5);
#  2. builds the forwarding library that runs the HIP backend on NVIDIA GPUs
#     (scripts/hip-nvidia/) and checks that it exports every entry point kvd loads.
# ROCm's headers: KVD_ROCM_INCLUDE, else /opt/rocm/include, else /usr/include (Debian's
# libamdhip64-dev, ROCm 5.2, which scripts/install-test-deps.sh installs).
set -euo pipefail
cd "$(dirname "$0")/.."
inc=${KVD_ROCM_INCLUDE:-}
if [ -z "$inc" ]; then
  for d in /opt/rocm/include /usr/include; do
    [ -f "$d/hip/hip_runtime_api.h" ] && { inc=$d; break; }
  done
fi
if [ -z "$inc" ]; then
  echo "no ROCm headers (hip/hip_runtime_api.h): install libamdhip64-dev or set KVD_ROCM_INCLUDE" >&2
  exit 1
fi
echo "== kvd's HIP declarations against $inc/hip/hip_runtime_api.h ($(grep -E 'define HIP_VERSION_(MAJOR|MINOR) ' "$inc/hip/hip_version.h" | awk '{print $3}' | paste -sd.))"
KVD_ROCM_INCLUDE=$inc cargo test --locked -q -p kvd-gpu hip::abi::tests::declarations_match_the_rocm_headers -- --ignored --exact
echo "== every entry point kvd loads, resolved from ROCm's runtime (${KVD_ROCM_LIB:-libamdhip64.so.5})"
cargo test --locked -q -p kvd-gpu hip::abi::tests::the_rocm_runtime_exports_every_entry_point -- --ignored --exact
echo "== the HIP-on-NVIDIA forwarding library"
# Under cargo's target directory (CARGO_TARGET_DIR where set), beside build.sh's cache.
cache=$(scripts/target-dir.sh)/hip-nvidia
out=$cache/lib
scripts/hip-nvidia/build.sh "$out"
LD_LIBRARY_PATH=$cache/cuda/lib:$cache/stub \
  KVD_HIP_NVIDIA_LIB=$out/libkvd-hip-nvidia.so \
  cargo test --locked -q -p kvd-gpu hip::abi::tests::the_nvidia_forwarding_library_exports_every_entry_point -- --ignored --exact

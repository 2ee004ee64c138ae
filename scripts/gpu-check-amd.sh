#!/usr/bin/env bash
# The AMD check, for the first MI300X/MI355X host: the same GPU tests and benchmarks as
# scripts/gpu-check.sh, with kvd and the client on the HIP backend over ROCm itself.
#   scripts/build-gpu-artifacts.sh             # on a build machine (x86-64, no ROCm needed)
#   scripts/gpu-check-amd.sh [DIR] [STEPS]     # on the AMD host; DIR defaults to .device
# Needs ROCm (libamdhip64.so.6 or .7 on the loader path, /dev/kfd and /dev/dri visible) and a
# ROCm build of PyTorch for the Python tests and the data-plane benchmark. Logs go to $OUT, else
# DIR/out; kvd logs which backend it uses ("GPU backend: HIP ...") and the step summary counts it.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v rocm-smi >/dev/null && ! ls /opt/rocm*/lib/libamdhip64.so* >/dev/null 2>&1; then
  echo "no ROCm here (no rocm-smi, no /opt/rocm*/lib/libamdhip64.so*); this check is for AMD GPU hosts" >&2
  exit 1
fi
# ROCm installs the runtime under /opt/rocm/lib, which is not always on the loader path.
for d in /opt/rocm/lib /opt/rocm-*/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} && break
done
export KVD_GPU_BACKEND=hip
exec scripts/gpu-check.sh "${1:-.device}" "${2:-info,rust,python,bench,populate}"

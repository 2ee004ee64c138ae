#!/usr/bin/env bash
# Builds libkvd-hip-nvidia.so (kvd's HIP backend on an NVIDIA GPU; see kvd_hip_nvidia.c) into
# OUTDIR (default .device/lib), for x86-64 Linux with CUDA 13 at run time (the H200 host's
# driver and the libcudart.so.13 inside torch's wheel).
#
# Needs gcc and pip. NVIDIA's CUDA 13.0 headers and libcudart.so.13 come from PyPI's
# nvidia-cuda-runtime and nvidia-cuda-crt wheels, cached in hip-nvidia/ under cargo's target
# directory (target/, or CARGO_TARGET_DIR); nothing
# from CUDA is installed on this machine. libcuda.so.1 (the driver) is linked through an empty
# stub with its soname, so the library names it as a dependency and the host's driver
# provides it at run time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/.device/lib}
cache=$("$root/scripts/target-dir.sh")/hip-nvidia
cuda=$cache/cuda
mkdir -p "$out" "$cache"
if [ ! -f "$cuda/include/cuda.h" ] || [ ! -f "$cuda/include/crt/host_defines.h" ]; then
  rm -rf "$cache/wheels" "$cuda" && mkdir -p "$cache/wheels" "$cuda"
  python3 -m pip download -q --no-deps -d "$cache/wheels" \
    "nvidia-cuda-runtime>=13.0,<13.1" "nvidia-cuda-crt>=13.0,<13.1"
  for w in "$cache"/wheels/*.whl; do python3 -m zipfile -e "$w" "$cache/unpacked"; done
  cp -r "$cache"/unpacked/nvidia/cu13/include "$cuda/include"
  mkdir -p "$cuda/lib" && cp "$cache"/unpacked/nvidia/cu13/lib/libcudart.so.13 "$cuda/lib/"
fi
mkdir -p "$cache/stub"
echo 'void kvd_libcuda_stub(void) {}' > "$cache/stub/stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cache/stub/libcuda.so.1" "$cache/stub/stub.c"
gcc -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden \
  -I"$cuda/include" -o "$out/libkvd-hip-nvidia.so" "$here/kvd_hip_nvidia.c" \
  -Wl,--no-as-needed -L"$cuda/lib" -l:libcudart.so.13 -L"$cache/stub" -l:libcuda.so.1 \
  -Wl,-soname,libkvd-hip-nvidia.so
# Every symbol left undefined must come from CUDA's two libraries or libc.
bad=$(nm -D --undefined-only "$out/libkvd-hip-nvidia.so" | awk '{print $2}' \
  | grep -Ev '^(cuda|cu)[A-Z]|^(memcpy|memset)(@|$)|^__|^_ITM_' || true)
if [ -n "$bad" ]; then echo "unexpected undefined symbols: $bad" >&2; exit 1; fi
exported=$(nm -D --defined-only "$out/libkvd-hip-nvidia.so" | awk '$2=="T"{print $3}' | grep -c '^hip')
echo "built $out/libkvd-hip-nvidia.so: $exported hip* entry points; needs $(readelf -d "$out/libkvd-hip-nvidia.so" | grep NEEDED | sed 's/.*\[\(.*\)\]/\1/' | tr '\n' ' ')"

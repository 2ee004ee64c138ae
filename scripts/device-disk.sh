#!/usr/bin/env bash
# On the GPU host (no network, no Rust), from the device tool's copy of the checkout with
# .device carried (scripts/build-gpu-artifacts.sh built .device/bin/kvd and kvd-bench): the
# disk tier's write and read rate next to fio on the same file in the same run, and the
# lookup → L1 latency of one 32 MiB chunk (`kvd-bench disk`, benches/src/disk.rs).
#
#   scripts/device-disk.sh [DIR]     DIR: a directory on the drive to measure (default: the
#                                    checkout's filesystem, or /tmp when that is not tmpfs)
#   KVD_DISK_GIB=N                   GiB kvd stores (default: sized from the probe, 5..24)
#   KVD_DISK_POOL_GIB=N              kvd's L1 (default 4; its eighth, up to 1 GiB, is how much
#                                    of the eviction stream waits for the disk at once)
#   KVD_DISK_KVDS="kvd kvd-main"     kvd binaries in .device/bin to measure in turn (default kvd)
#   KVD_DISK_FIXEDBUFS=0             skip fio alone with plain vs registered buffers
#
# fio: the one on PATH, else .device/fio/fio (static, built by scripts/build-fio.sh, which
# build-gpu-artifacts.sh runs: the GPU host has no fio and no network), io_uring engine at the
# same block size (1024 KiB) and queue depth (32) as kvd. Without either it says so and compares
# with dd (O_DIRECT, the same block size, one I/O in flight: a floor, not the drive's rate at
# depth). It sizes the run from a 1 GiB dd probe of
# the drive so that the whole of it fits in about three minutes (kvd-bench is cut off at 190 s,
# and fio's four 2 GiB runs after it at 10 s each, so the script stays under 4 minutes), and in
# the disk's free space.
# Everything it prints is also in $OUT/device-disk.txt (the device tool's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/.device/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device-disk.txt") 2>&1

BIN=$PWD/.device/bin
for b in kvd kvd-bench; do
  [ -x "$BIN/$b" ] || { echo "no $BIN/$b: run scripts/build-gpu-artifacts.sh here and carry .device"; exit 1; }
done

pick_dir() {
  if [ -n "${1:-}" ]; then echo "$1"; return; fi
  for d in "$PWD/.device/disk-bench" /tmp/kvd-disk-bench; do
    mkdir -p "$d"
    case "$(findmnt -no FSTYPE -T "$d" 2>/dev/null || echo unknown)" in
      tmpfs|ramfs|overlay) continue ;;
      *) echo "$d"; return ;;
    esac
  done
  echo "$PWD/.device/disk-bench"
}
DIR=$(pick_dir "${1:-}")
mkdir -p "$DIR"

echo "== machine: $(hostname) $(uname -r), $(nproc) cores, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "== directory: $DIR on $(findmnt -no SOURCE,FSTYPE -T "$DIR" 2>/dev/null || echo '?')"
df -h "$DIR" | tail -1
lsblk -d -o NAME,MODEL,SIZE,ROTA,TRAN 2>/dev/null || true
echo "== kvd: $("$BIN/kvd" --version 2>/dev/null || echo '?')"

FIO=$(command -v fio 2>/dev/null || true)
if [ -z "$FIO" ] && [ -x "$PWD/.device/fio/fio" ]; then FIO=$PWD/.device/fio/fio; fi
if [ -n "$FIO" ] && ! "$FIO" --enghelp 2>/dev/null | grep -qx '[[:space:]]*io_uring'; then
  echo "== $FIO has no io_uring engine (or does not run): not used"
  FIO=
fi
if [ -n "$FIO" ]; then
  BASE=fio
  echo "== baseline: $FIO, $("$FIO" --version) (io_uring, 1024 KiB × 32 in flight, as kvd)"
else
  BASE=dd
  echo "== baseline: fio is not on PATH; comparing with dd instead (O_DIRECT, 1024 KiB blocks, one I/O in flight — a floor for the drive, not its rate at queue depth 32)"
fi

# Probe: 1 GiB written with O_DIRECT, for the run's size.
probe=$DIR/probe.bin
t0=$(date +%s.%N)
dd if=/dev/zero of="$probe" bs=1M count=1024 oflag=direct status=none
t1=$(date +%s.%N)
rm -f "$probe"
gbps=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", 1.073741824 / (b - a) }')
# The run moves about 5.5 × (GIB + 2.5) GiB (fio: three writes of the file and one read;
# kvd: its writes, reads and L1 fills); keep it near 150 s at the probe's rate, in 5..24 GiB
# (kvd-bench needs more than its L1, 4 GiB unless KVD_DISK_POOL_GIB says, plus two requests),
# and the file (GIB + 2.5 GiB) under half the free space.
free_gib=$(df --output=avail -B1G "$DIR" | tail -1 | tr -d ' ')
GIB=${KVD_DISK_GIB:-$(awk -v r="$gbps" -v f="$free_gib" 'BEGIN {
  g = 150 * r / 5.5 / 1.073741824 - 2.5
  if (g > 24) g = 24
  if (g > f / 2 - 2.5) g = f / 2 - 2.5
  if (g < 5) g = 5
  printf "%d", g }')}
echo "== probe: dd O_DIRECT write at $gbps GB/s; $free_gib GiB free; kvd-bench disk --gib $GIB"

# KVD_DISK_KVDS="kvd kvd-main kvd": kvd binaries in .device/bin measured in turn by the same
# kvd-bench (a before/after in one run; the default measures kvd once).
for k in ${KVD_DISK_KVDS:-kvd}; do
  echo "== kvd-bench disk --kvd $BIN/$k ($(date -u +%H:%M:%S))"
  timeout 190 "$BIN/kvd-bench" disk --kvd "$BIN/$k" --dir "$DIR" --gib "$GIB" \
    --qd 32 --io-kb 1024 --pool-gib "${KVD_DISK_POOL_GIB:-4}" --baseline "$BASE" ${FIO:+--fio "$FIO"} || echo "kvd-bench disk failed or ran out of time (rc $?)"
  rm -rf "$DIR/kvd-bench.disk" "$DIR/kvd-bench.disk.index"
done

# Whether registered buffers matter on this drive at all: fio alone, --fixedbufs off and on
# (kvd registers its pool; the kvd-bench line above says how many of its I/Os were fixed).
if [ "$BASE" = fio ] && [ "${KVD_DISK_FIXEDBUFS:-1}" = 1 ]; then
  echo "== fio alone, 2 GiB, 1024 KiB × 32, O_DIRECT: plain vs registered buffers (--fixedbufs)"
  for fb in 0 1; do
    for rw in write read; do
      timeout 10 "$FIO" --name=fb --ioengine=io_uring --filename="$DIR/fio-fixedbufs.bin" \
        --rw=$rw --bs=1024k --iodepth=32 --direct=1 --size=2g --fixedbufs=$fb \
        --output-format=terse --terse-version=3 \
        | awk -F';' -v fb=$fb -v rw=$rw '{ bw = (rw == "read") ? $7 : $48
            printf "fio %-5s fixedbufs=%s: %.2f GB/s, user CPU %s, system CPU %s\n", rw, fb, bw * 1024 / 1e9, $88, $89 }' \
        || echo "fio $rw fixedbufs=$fb failed"
    done
  done
  rm -f "$DIR/fio-fixedbufs.bin"
fi

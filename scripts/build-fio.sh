#!/usr/bin/env bash
# Builds a self-contained fio into DEST (default .device/fio/fio) for hosts that have none: the
# GPU host has no package manager access, so scripts/device-disk.sh runs this binary, carried in
# .device, to compare kvd's disk tier with fio on the same file (benches/src/disk.rs).
#
# Source: Debian bookworm's fio (3.33 in 2026; the orig tarball, whose hashes apt checks against the
# signed Sources index; Debian's own patches only touch packaging). It is fetched with apt into
# private lists under the cache directory: the machine's apt sources are left as they are.
# Configured static (glibc), without -march=native (the binary runs on another CPU), without the
# optional engines that would pull in shared libraries (numa, rdma, rados, gluster, pmem, nfs…):
# fio's io_uring engine needs no liburing, and libaio is not needed either. The static glibc
# binary warns at link time about dlopen (external engines) and getaddrinfo (network engines);
# neither is used here. Stripped: about 3 MiB.
#
#   scripts/build-fio.sh [DEST]     KVD_FIO_CACHE=DIR: where sources and the build are kept
#                                   (default target/fio-build), so a second run only copies
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$(realpath -m "${1:-.device/fio/fio}")
CACHE=$(realpath -m "${KVD_FIO_CACHE:-target/fio-build}")
mkdir -p "$CACHE"
src() { find "$CACHE" -maxdepth 1 -name 'fio-[0-9]*' -type d | sort | tail -1; }

if [ -z "$(src)" ] || [ ! -x "$(src)/fio" ]; then
  mkdir -p "$CACHE/apt/lists/partial" "$CACHE/apt/parts"
  # The mirror this machine's apt already uses (its first Debian source), asked for sources.
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || { echo "build-fio.sh: apt has no Debian source configured; fio's source comes from it" >&2; exit 1; }
  cat > "$CACHE/apt/src.sources" <<EOS
Types: deb-src
URIs: $mirror
Suites: $(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
  apt_opts=(-o "Dir::Etc::SourceList=$CACHE/apt/src.sources" -o "Dir::Etc::SourceParts=$CACHE/apt/parts"
            -o "Dir::State::Lists=$CACHE/apt/lists" -o APT::Sandbox::User=root)
  if ! ls "$CACHE"/fio_*.orig.tar.gz >/dev/null 2>&1; then
    apt-get "${apt_opts[@]}" update -qq
    (cd "$CACHE" && apt-get "${apt_opts[@]}" source --download-only -qq fio)
  fi
  find "$CACHE" -maxdepth 1 -name 'fio-[0-9]*' -type d -exec rm -rf {} +
  tar -C "$CACHE" -xzf "$(ls "$CACHE"/fio_*.orig.tar.gz | sort | tail -1)"
  (
    cd "$(src)"
    ./configure --build-static --disable-native --disable-numa --disable-rdma --disable-rados \
      --disable-rbd --disable-http --disable-gfapi --disable-pmem --disable-xnvme --disable-libzbc \
      --disable-tcmalloc --disable-dfs --disable-libnfs --disable-lex > configure.out
    make -j"$(nproc)" fio > make.out 2>&1 || { tail -30 make.out; exit 1; }
  )
fi
mkdir -p "$(dirname "$DEST")"
strip -o "$DEST" "$(src)/fio"
# It must run with nothing from this machine: no dynamic loader, no environment.
if readelf -l "$DEST" | grep -q INTERP; then
  echo "build-fio.sh: $DEST is dynamically linked" >&2
  exit 1
fi
(cd / && env -i "$DEST" --enghelp | grep -qx '[[:space:]]*io_uring') || {
  echo "build-fio.sh: $DEST does not run with an empty environment, or has no io_uring engine" >&2
  exit 1
}
echo "fio: $DEST ($("$DEST" --version), $(du -h "$DEST" | cut -f1), static, io_uring engine)"

#!/usr/bin/env python3
"""Installs requirements into the running interpreter's environment a batch of wheels at a time,
so that the disk never holds every downloaded wheel beside every installed file.

pip keeps each wheel it downloads until the whole command ends (in its cache, or under
PIP_NO_CACHE_DIR in a temporary folder per wheel): `pip install vllm==0.33.0` peaks at its 4.3 GB
of wheels on top of the 9.5 GB they unpack to, and a CI run died of it ("[Errno 28] No space
left on device"). Here pip resolves once (`pip install --dry-run
--report`), then installs exactly the files it chose, by URL with their sha256, `--no-deps`, in
batches of at most --batch-mb downloaded: the peak is the installed size plus one batch. The
result is the resolver's own set, checked at the end by `pip check`.

    .venv-vllm/bin/python scripts/pip_staged_install.py vllm==0.33.0
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    """One file pip chose: its name, its URL (with the hash pip must verify) and its size."""

    name: str
    url: str
    size: int | None


def planned(report: dict[str, object]) -> list[tuple[str, str]]:
    """(name, url#sha256=...) of every file a `pip install --report` would install."""
    out = []
    for item in report["install"]:  # type: ignore[attr-defined]
        info = item["download_info"]
        url = info["url"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        if "sha256" in hashes:
            url = f"{url.split('#')[0]}#sha256={hashes['sha256']}"
        out.append((item["metadata"]["name"], url))
    return out


def size_of(url: str) -> int | None:
    """The file's size from the index's Content-Length, or None where the index does not say."""
    try:
        req = urllib.request.Request(url.split("#")[0], method="HEAD")
        with urllib.request.urlopen(req, timeout=30) as resp:
            n = resp.headers.get("Content-Length")
            return int(n) if n else None
    except (OSError, ValueError):
        return None


def batches(wheels: list[Wheel], limit: int) -> list[list[Wheel]]:
    """Wheels in batches of at most `limit` bytes, largest first; a wheel over the limit, or of
    unknown size, goes alone."""
    out: list[list[Wheel]] = []
    current: list[Wheel] = []
    total = 0
    for w in sorted(wheels, key=lambda w: -(w.size if w.size is not None else limit + 1)):
        size = w.size if w.size is not None else limit + 1
        if current and total + size > limit:
            out.append(current)
            current, total = [], 0
        current.append(w)
        total += size
    if current:
        out.append(current)
    return out


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requirements", nargs="+", help="what `pip install` would be given")
    ap.add_argument("--batch-mb", type=int, default=600, help="most megabytes of wheels one pip command downloads")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        print(f"== resolving {' '.join(args.requirements)}", flush=True)
        pip("install", "--quiet", "--dry-run", "--report", report_path, *args.requirements)
        with open(report_path) as f:
            files = planned(json.load(f))
    if not files:
        print("== nothing to install", flush=True)
        return
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        sizes = list(ex.map(size_of, [u for _, u in files]))
    wheels = [Wheel(n, u, s) for (n, u), s in zip(files, sizes)]
    plan = batches(wheels, args.batch_mb << 20)
    known = sum(s for s in sizes if s)
    print(f"== {len(wheels)} files, {known / 1e9:.1f} GB to download, in {len(plan)} pip commands", flush=True)
    for i, batch in enumerate(plan, 1):
        mb = sum(w.size or 0 for w in batch) / 1e6
        print(f"== [{i}/{len(plan)}] {mb:.0f} MB: {' '.join(w.name for w in batch[:6])}"
              f"{' ...' if len(batch) > 6 else ''}", flush=True)
        pip("install", "--quiet", "--no-deps", *(w.url for w in batch))
    pip("check")


if __name__ == "__main__":
    main()

"""The node benchmark's arms (``benches/node.py``): what each runs beside its engines, the
``kv_transfer_config`` every engine gets, the environment the engines need, and what the
arm's server says about a cell; and the link's copy ceiling kvd's copy rate is set against.

All arms get the same CPU memory in total (``--cpu-gib``): vLLM's OffloadingConnector is in
every engine and so gets a share per engine; LMCache MP and kvd are one server for the node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import vllm_harness as vh
from kvd.testing import free_port  # below the ephemeral range: no connection takes it first

ARMS = ("none", "offload", "lmcache", "kvd", "kvd-base")
GIB = 1 << 30


def chunk_tokens(token_scale: int) -> int:
    """kvd's and LMCache's chunk: 256 trace tokens, so either sees the unscaled trace's chunks."""
    return max(16, 256 // token_scale)


class Arm:
    """No offload: vLLM recomputes what its GPU prefix cache lost."""

    name = "none"

    def __init__(self, args, label: str) -> None:
        self.args = args
        self.label = label

    def unavailable(self) -> str:
        """Why this arm cannot run here ("" when it can)."""
        return ""

    def start(self, engines: int, timeout_s: float) -> float | None:
        """Starts the arm's server, if it has one; seconds until it was ready."""
        return None

    def kv(self, slot: int, engines: int) -> dict | None:
        return None

    def env(self) -> dict[str, str]:
        return {}

    def server_metrics(self) -> dict[str, float]:
        return {}

    def server_delta(self, before: dict[str, float], after: dict[str, float]) -> dict:
        return {}

    def stop(self) -> str:
        """Stops the server; the last lines of its log."""
        return ""


class Offload(Arm):
    """vLLM's OffloadingConnector (CPU) in every engine, ``--cpu-gib`` / E each."""

    name = "offload"

    def kv(self, slot: int, engines: int) -> dict | None:
        return vh.kv_transfer("offload", cpu_bytes=int(self.args.cpu_gib * GIB / engines))


def warm_group(slot: int) -> str:
    """The replica name (``kvd.warm_group``) of an engine slot under ``--warm``."""
    return f"slot{slot}"


class Kvd(Arm):
    """One ``kvd serve`` for the node, ``--cpu-gib`` of pool."""

    name = "kvd"

    def __init__(self, args, label: str) -> None:
        super().__init__(args, label)
        self.server: vh.KvdServer | None = None

    @property
    def binary(self) -> str:
        return self.args.kvd

    def unavailable(self) -> str:
        if not self.binary or not os.access(self.binary, os.X_OK):
            return f"no kvd binary at {self.binary!r} (scripts/device-vllm.sh install with .device carried)"
        return ""

    def start(self, engines: int, timeout_s: float) -> float | None:
        t0 = time.monotonic()
        self.server = vh.KvdServer(self.binary, self.args.cpu_gib, chunk_tokens(self.args.token_scale),
                                   os.path.join(self.args.out, f"{self.label}-kvd.log"))
        self.server.start(timeout_s)
        return round(time.monotonic() - t0, 2)

    @property
    def extra(self) -> str:
        """The arm's kv_connector_extra_config, as JSON (may be empty)."""
        return self.args.kvd_extra

    def kv(self, slot: int, engines: int) -> dict | None:
        extra = json.loads(self.extra) if self.extra else None
        if getattr(self.args, "warm", False):
            # Each slot is a replica whose name outlives its engine (node.py --warm).
            extra = {**(extra or {}), "kvd.warm_group": warm_group(slot)}
        return vh.kv_transfer("kvd", kvd_url=self.server.url if self.server else "tcp://127.0.0.1:PORT", kvd_extra=extra)

    def server_metrics(self) -> dict[str, float]:
        return self.server.metrics() if self.server else {}

    def server_delta(self, before: dict[str, float], after: dict[str, float]) -> dict:
        return kvd_delta(before, after)

    def stop(self) -> str:
        if self.server is None:
            return ""
        self.server.kill(signal.SIGTERM)
        return "".join(list(self.server.tail)[-5:])


class KvdBase(Kvd):
    """kvd again, from another build (``--kvd-base``): a change and the code before it measured
    in one call, where the machine, the tokens and the order effects are shared."""

    name = "kvd-base"

    @property
    def binary(self) -> str:
        return self.args.kvd_base

    @property
    def extra(self) -> str:
        base = getattr(self.args, "kvd_base_extra", None)
        return self.args.kvd_extra if base is None else base


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def slowest_bound(d: dict[str, float], hist: str, direction: str) -> float | None:
    """The upper bound of the histogram bucket that holds the slowest of a direction's
    observations in ``d`` (a difference of two scrapes), in seconds: the slowest took at most
    this. ``inf`` when it is past the last finite bound, None when nothing was observed."""
    pre = f'{hist}_bucket{{direction="{direction}",le="'
    buckets = sorted((float(k[len(pre):-2]), v) for k, v in d.items() if k.startswith(pre))
    total = d.get(f'{hist}_count{{direction="{direction}"}}', 0.0)
    if not buckets or total <= 0:
        return None
    return next(le for le, n in buckets if n >= total)


def kvd_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """What kvd did in a cell: bytes each way, the chunk hit rate of lookups, and the copy rate:
    bytes over the summed time of the copy jobs (``kvd_copy_duration_seconds``, from submission
    to completion, which includes a job's wait on the device for the engine's event), per
    direction — a floor on a job's own rate; jobs that overlap share the link. With it, the
    copy thread's time submitting jobs (``kvd_copy_submit_duration_seconds``) and its slowest
    job's bucket: one thread per GPU submits both directions in order, so a submission that
    blocks (a driver queue full of stores waiting for the forward pass) holds up the retrieve a
    forward pass is waiting for."""
    d = vh.diff(after, before)
    s = vh.kvd_summary(d)
    out = {k: s[k] for k in ("retrieved_gib", "stored_gib", "lookup_chunks_hit", "lookup_chunks_miss",
                             "store_chunks_refused", "evictions", "request_errors")}
    for direction, gib in (("h2d", s["retrieved_gib"]), ("d2h", s["stored_gib"])):
        secs = _sum(d, f'kvd_copy_duration_seconds_sum{{direction="{direction}"}}')
        jobs = _sum(d, f'kvd_copy_duration_seconds_count{{direction="{direction}"}}')
        out[f"{direction}_copy_s"] = secs
        out[f"{direction}_copies"] = jobs
        out[f"{direction}_gbps"] = gib * GIB / secs / 1e9 if secs > 0 else None
        out[f"{direction}_submit_s"] = _sum(d, f'kvd_copy_submit_duration_seconds_sum{{direction="{direction}"}}')
        out[f"{direction}_submit_slowest_s"] = slowest_bound(d, "kvd_copy_submit_duration_seconds", direction)
    asked = s["lookup_chunks_hit"] + s["lookup_chunks_miss"]
    out["chunk_hit_rate"] = s["lookup_chunks_hit"] / asked if asked else None
    return out


class Lmcache(Arm):
    """One LMCache MP server for the node (``../shared/lmcache-gpu``), vLLM's in-tree
    ``LMCacheMPConnector`` in every engine."""

    name = "lmcache"

    def __init__(self, args, label: str) -> None:
        super().__init__(args, label)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.http = 0
        self.log_path = os.path.join(args.out, f"{label}-lmcache.log")

    def unavailable(self) -> str:
        if not os.path.isdir(os.path.join(self.args.lmcache_site, "lmcache")):
            return f"LMCache not installed in {self.args.lmcache_site} (scripts/device-vllm.sh lmcache with .lmcache-gpu carried)"
        if not os.path.isfile(self.args.lmcache_shim):
            return f"no {self.args.lmcache_shim} (scripts/device-vllm.sh lmcache builds it)"
        return ""

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {"LD_PRELOAD": self.args.lmcache_shim, "LMCACHE_TRACK_USAGE": "false",
                "PYTHONPATH": f"{path}:{self.args.lmcache_site}" if path else self.args.lmcache_site}

    def start(self, engines: int, timeout_s: float) -> float | None:
        t0 = time.monotonic()
        self.port, self.http = free_port(), free_port()
        cmd = [sys.executable, "-m", "lmcache.cli.main", "server", "--l1-size-gb", f"{self.args.cpu_gib:g}",
               "--eviction-policy", "LRU", "--port", str(self.port), "--http-port", str(self.http),
               "--chunk-size", str(chunk_tokens(self.args.token_scale)),
               "--max-gpu-workers", str(self.args.lmcache_workers or engines)]
        log = open(self.log_path, "a")
        log.write(f"==== {' '.join(cmd)}\n")
        log.flush()
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, **self.env()), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited {self.proc.returncode}: {self._tail()}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.http}/healthcheck", timeout=2).status == 200:
                    return round(time.monotonic() - t0, 2)
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"lmcache server not healthy within {timeout_s:.0f} s: {self._tail()}")

    def kv(self, slot: int, engines: int) -> dict | None:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port or "PORT"},
                "kv_load_failure_policy": "recompute"}

    def server_metrics(self) -> dict[str, float]:
        if not self.http:
            return {}
        try:
            return vh.prom_text(vh.fetch(f"http://127.0.0.1:{self.http}/metrics"))
        except Exception:
            return {}

    def server_delta(self, before: dict[str, float], after: dict[str, float]) -> dict:
        d = vh.diff(after, before)
        # Its counters, as it names them (whatever moved), for the record.
        moved = {k: v for k, v in d.items() if v and not k.endswith(("_created", "_bucket")) and "lmcache" in k.lower()}
        return dict(sorted(moved.items())[:40])

    def _tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(l.strip() for l in f.readlines()[-6:])
        except OSError:
            return ""

    def stop(self) -> str:
        if self.proc is None:
            return ""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return self._tail()


def make_arm(name: str, args, label: str) -> Arm:
    return {"none": Arm, "offload": Offload, "lmcache": Lmcache, "kvd": Kvd, "kvd-base": KvdBase}[name](args, label)


LINK_PROBE = r"""
import json, torch
n = 1 << 30
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
out = {"device": torch.cuda.get_device_name(0)}
for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    best = None
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst.copy_(src, non_blocking=True); b.record(); b.synchronize()
        s = a.elapsed_time(b) / 1000
        best = s if best is None else min(best, s)
    out[name + "_gbps"] = round(n / best / 1e9, 1)
print("LINK " + json.dumps(out))
"""


def measure_link(out_dir: str, timeout_s: float = 120.0) -> dict | None:
    """The copy ceiling of pinned host memory to GPU 0 and back (1 GiB, the best of five), in a
    process of its own so that this one holds no CUDA context."""
    try:
        r = subprocess.run([sys.executable, "-c", LINK_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    for line in r.stdout.splitlines():
        if line.startswith("LINK "):
            return json.loads(line[5:])
    with open(os.path.join(out_dir, "link.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    return {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:200]}"}

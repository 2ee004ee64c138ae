"""What kvd's GPU benchmarks share (benches/dataplane.py, benches/multigpu.py): the geometries,
starting kvd under a deadline, its metrics, /proc readings of its CPU time, memory and
descriptors, and nvidia-smi's per-process GPU memory.

Nothing here imports torch, so multigpu.py's --host mode runs where torch is not installed.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request

CHUNK = 256
GIB = 1 << 30

GEOMETRIES = {
    # name: (layers, kv heads per shard, content (K‖V or MLA latent), block tokens)
    "llama-3.1-8b": (32, 8, 256, 16),
    "llama-3.1-70b-tp8": (80, 1, 256, 16),
    "deepseek-mla-b16": (61, 1, 576, 16),
    "deepseek-mla-b64": (61, 1, 576, 64),
}


def start_kvd(binary: str, pool_gib: float, log_path: str | None, extra: tuple[str, ...] = (),
              timeout_s: float = 600.0, echo: bool = True, on_first_line=None) -> tuple[subprocess.Popen, str, str]:
    """Starts `kvd serve` on free ports and waits for "ready in"; returns (process, zmq url,
    http host:port). Raises with kvd's last log lines if it exits or is not ready in time.
    `on_first_line` is called once kvd has logged its first line (its flags are resolved)."""
    fd = f"/tmp/kvd-bench-{os.getpid()}-{time.monotonic_ns()}.fd.sock"
    p = subprocess.Popen(
        [binary, "serve", "--l1-size-gb", str(pool_gib), "--port", "0", "--http-port", "0", "--fd-socket", fd,
         "--chunk-tokens", str(CHUNK), *extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    log = open(log_path, "w") if log_path else None
    found: dict[str, str] = {}
    tail: collections.deque[str] = collections.deque(maxlen=12)
    ended = threading.Event()

    def pump() -> None:
        first = True
        for line in p.stderr:
            tail.append(line)
            if log:
                log.write(line)
                log.flush()
            if first and on_first_line is not None:
                first = False
                on_first_line()
            if "ready" in found:
                continue
            m = re.search(r"listening for clients on (tcp://\S+)", line)
            if m:
                found["url"] = m.group(1)
            m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
            if m:
                found["http"] = m.group(1)
            if echo and ("populated" in line or "pinned" in line):
                print("#", line.strip().split("  ")[-1], flush=True)
            if "ready in" in line:
                found["ready"] = line
                ended.set()
        ended.set()

    threading.Thread(target=pump, daemon=True).start()
    ended.wait(timeout_s)
    if "ready" not in found or "url" not in found or "http" not in found:
        p.kill()
        p.wait()
        raise RuntimeError(f"kvd did not become ready within {timeout_s:.0f} s (exit {p.returncode}); its last lines: "
                           + " | ".join(l.strip() for l in tail))
    return p, found["url"], found["http"]


def kvd_metrics(http: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of kvd's Prometheus samples by name."""
    body = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    out = {n: 0.0 for n in names}
    for line in body.splitlines():
        for n in names:
            if line.startswith(n) and line[len(n)] in " {":
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def healthz(http: str) -> tuple[int, str]:
    """Status code and body of kvd's /healthz (0 when it does not answer)."""
    try:
        r = urllib.request.urlopen(f"http://{http}/healthz", timeout=5)
        return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def cpu_seconds_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each of `pid`'s threads so far, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        # Fields 14 and 15 of stat(5) (utime, stime), counted after the name's ")".
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) `pid` has used so far, its ended threads included."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    """Descriptors `pid` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def mappings_of(pid: int, needle: str) -> int:
    """Memory mappings of `pid` whose path contains `needle` (e.g. a memfd's name)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(needle in line for line in f)


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field in bytes (0 if absent)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def gpu_mem_by_gpu(pid: int) -> dict[str, int]:
    """MiB of GPU memory nvidia-smi attributes to `pid`, by GPU index."""
    try:
        index = dict(l.split(", ") for l in subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10).stdout.strip().splitlines())
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return {}
    by: dict[str, int] = {}
    for line in out.strip().splitlines():
        try:
            p_, uuid, m = (x.strip() for x in line.split(","))
            if int(p_) != pid:
                continue
            mib = int(m)
        except ValueError:
            continue  # "[N/A]" where the driver cannot say
        key = f"GPU {index.get(uuid, uuid)}"
        by[key] = by.get(key, 0) + mib
    return by


def gpu_mem_of(pid: int) -> int:
    """MiB of GPU memory nvidia-smi attributes to `pid` (all GPUs)."""
    return sum(gpu_mem_by_gpu(pid).values())

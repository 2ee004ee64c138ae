"""What the real-engine runs share (``scripts/vllm_engine_check.py``, ``benches/engine.py``): the
environment vLLM 0.26 needs on the GPU host, a kvd process that can be killed and started again
on the same port, the KV-connector configurations of each arm, an ``LLM`` built the same way
for every arm, a generate loop with a deadline, and vLLM's own counters.

Written against vLLM 0.26.0's source (``vllm/entrypoints/llm.py``, ``vllm/v1/metrics/``,
``vllm/config/kv_transfer.py``); nothing here imports vLLM or torch at import time, so the
trace and table code of the scripts runs on machines without either.

Why a step loop instead of ``LLM.generate``: ``generate`` loops until the engine has no
unfinished request, so a livelocked scheduler (issue 19) hangs it forever. ``run_requests``
drives ``LLM.enqueue`` + ``llm_engine.step()`` itself and gives up at a deadline, and a
``Watchdog`` thread fires even when one ``step()`` never returns (with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` a step blocks on the engine-core process's output queue).
"""

from __future__ import annotations

import collections
import faulthandler
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Must be in the environment before vLLM is imported (the engine-core and worker processes
#: inherit it). flashinfer is not in the offline wheel set: without the first, the sampler's
#: constructor imports it and fails. No network on the GPU host: no usage stats, no hub.
VLLM_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def set_vllm_env() -> None:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)


def default_model() -> str:
    """The dummy-weight Llama config: $VLLM_MODEL, else where scripts/device-vllm.sh puts it."""
    for p in (os.environ.get("VLLM_MODEL"), "/tmp/vparts/model", os.path.join(ROOT, ".vllm-gpu/part1/model"),
              "/work/shared/vllm-gpu/model"):
        if p and os.path.isfile(os.path.join(p, "config.json")):
            return p
    return "/tmp/vparts/model"


def default_kvd() -> str:
    for p in (os.environ.get("KVD_BIN"), os.path.join(ROOT, ".device/bin/kvd"), "/tmp/kvd-bin/kvd",
              os.path.join(ROOT, "target/release/kvd")):
        if p and os.access(p, os.X_OK):
            return p
    return os.path.join(ROOT, ".device/bin/kvd")


def gpu_count() -> int:
    """GPUs visible to this process, without initialising CUDA here (vLLM forks workers)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip()])
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


def say(*parts: object) -> None:
    print(*parts, flush=True)


# --- kvd -----------------------------------------------------------------------------------


class KvdServer:
    """A ``kvd serve`` child. ``start`` waits for its endpoints; ``kill`` + ``start`` again keeps
    the ZMQ port (what a connector configured with ``kvd.url`` reconnects to)."""

    def __init__(self, binary: str, pool_gib: float, chunk_tokens: int, log_path: str | None = None,
                 extra: Iterable[str] = ()) -> None:
        self.binary = binary
        self.pool_gib = pool_gib
        self.chunk_tokens = chunk_tokens
        self.log_path = log_path
        self.extra = list(extra)
        self.port = 0
        self.url = ""
        self.http = ""
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> None:
        if not os.access(self.binary, os.X_OK):
            raise RuntimeError(f"no kvd binary at {self.binary}: build it with scripts/build-gpu-artifacts.sh "
                               "(.device/bin/kvd) or pass --kvd")
        fd = f"/tmp/kvd-engine-{os.getpid()}.fd.sock"
        cmd = [self.binary, "serve", "--l1-size-gb", str(self.pool_gib), "--port", str(self.port),
               "--http-port", "0", "--fd-socket", fd, "--chunk-tokens", str(self.chunk_tokens), *self.extra]
        log = open(self.log_path, "a") if self.log_path else None
        if log:
            log.write(f"==== start {self.starts + 1}: {' '.join(cmd)}\n")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        found: dict[str, str] = {}
        ready = threading.Event()
        proc = self.proc

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                self.tail.append(line)
                if log:
                    log.write(line)
                    log.flush()
                m = re.search(r"listening for clients on tcp://\S+:(\d+)", line)
                if m:
                    found["port"] = m.group(1)
                m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
                if m:
                    found["http"] = m.group(1)
                # kvd serves from its first slabs while the pool grows ("ready in ...").
                if "ready in" in line or "L1 pool full" in line:
                    found["ready"] = line
                if {"ready", "port", "http"} <= found.keys():
                    ready.set()
            ready.set()

        threading.Thread(target=pump, name="kvd-log", daemon=True).start()
        ready.wait(timeout_s)
        if "ready" not in found or "port" not in found or "http" not in found:
            self.kill()
            raise RuntimeError(f"kvd did not become ready within {timeout_s:.0f} s; its last lines: "
                               + " | ".join(l.strip() for l in self.tail))
        self.port = int(found["port"])
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.http = found["http"]
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while healthz(self.http)[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvd's /healthz did not answer 200 within {timeout_s:.0f} s: {healthz(self.http)}")
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def metrics(self, names: Iterable[str] = ()) -> dict[str, float]:
        """kvd's Prometheus samples, ``name{labels}`` -> value (all of them, or those of ``names``)."""
        return prom_text(fetch(f"http://{self.http}/metrics"), tuple(names))

    def total(self, name: str) -> float:
        """The sum of a metric's samples over its labels."""
        return sum(v for k, v in self.metrics((name,)).items())


def fetch(url: str, timeout_s: float = 5.0) -> str:
    return urllib.request.urlopen(url, timeout=timeout_s).read().decode()


def healthz(http: str) -> tuple[int, str]:
    try:
        r = urllib.request.urlopen(f"http://{http}/healthz", timeout=5)
        return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def prom_text(body: str, names: tuple[str, ...] = ()) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in body.splitlines():
        if not line or line[0] == "#":
            continue
        key, _, value = line.rpartition(" ")
        base = key.split("{", 1)[0]
        if names and base not in names:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


KVD_COUNTERS = ("kvd_bytes_retrieved_total", "kvd_bytes_stored_total", "kvd_lookups_total",
                "kvd_lookup_chunks_total", "kvd_store_chunks_total", "kvd_retrieve_chunks_total",
                "kvd_evictions_total", "kvd_request_errors_total", "kvd_registered_workers", "kvd_pins_expired_total")


def kvd_summary(m: dict[str, float]) -> dict[str, float]:
    """The few kvd figures the reports print, from ``KvdServer.metrics``."""
    def s(prefix: str) -> float:
        return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))

    return {
        "retrieved_gib": s("kvd_bytes_retrieved_total") / (1 << 30),
        "stored_gib": s("kvd_bytes_stored_total") / (1 << 30),
        "lookups_hit": s('kvd_lookups_total{result="hit"}'),
        "lookups_miss": s('kvd_lookups_total{result="miss"}'),
        "lookup_chunks_hit": s('kvd_lookup_chunks_total{result="hit"}'),
        "lookup_chunks_miss": s('kvd_lookup_chunks_total{result="miss"}'),
        "retrieve_chunks_loaded": s('kvd_retrieve_chunks_total{outcome="loaded"}'),
        "retrieve_chunks_missing": s('kvd_retrieve_chunks_total{outcome="missing"}'),
        "store_chunks_stored": s('kvd_store_chunks_total{outcome="stored"}'),
        "store_chunks_refused": s('kvd_store_chunks_total{outcome="refused_pool_full"}'),
        "evictions": s("kvd_evictions_total"),
        "request_errors": s("kvd_request_errors_total"),
        "registered_workers": s("kvd_registered_workers"),
    }


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# --- the arms' KV-transfer configurations ---------------------------------------------------


def kv_transfer(arm: str, *, kvd_url: str = "", cpu_bytes: int = 0, kvd_extra: dict | None = None,
                offload_extra: dict | None = None) -> dict | None:
    """``kv_transfer_config`` of an arm, as a dict (``LLM`` turns it into a ``KVTransferConfig``).
    ``kv_load_failure_policy="recompute"``: a failed load is recomputed, never an error to the
    user (0.26's default is "fail")."""
    if arm == "none":
        return None
    if arm == "kvd":
        extra = {"kvd.url": kvd_url, **(kvd_extra or {})}
        return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm", "kv_role": "kv_both",
                "kv_connector_extra_config": extra, "kv_load_failure_policy": "recompute"}
    if arm == "offload":
        # vllm/v1/kv_offload/cpu/spec.py: cpu_bytes_to_use (required, all ranks together);
        # chunk = one GPU block unless block_size / blocks_per_chunk is given.
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": int(cpu_bytes), **(offload_extra or {})},
                "kv_load_failure_policy": "recompute"}
    if arm == "simple":
        # vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py
        return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": int(cpu_bytes), **(offload_extra or {})},
                "kv_load_failure_policy": "recompute"}
    raise ValueError(f"unknown arm {arm!r} (none, offload, simple, kvd)")


def make_llm(model: str, kv: dict | None, *, gpu_blocks: int, max_model_len: int, tp: int = 1,
             enforce_eager: bool = True, gpu_mem: float = 0.85, block_size: int = 16, **extra: Any):
    """``vllm.LLM`` with dummy weights, token-id prompts, the prefix cache on, a fixed number of
    GPU KV blocks (``num_gpu_blocks_override``) and stats on (``get_metrics`` needs them, and
    so do ``RequestOutput.metrics``' TTFTs). ``block_size`` is the attention groups' (a hybrid
    Mamba model needs its attention page at least the Mamba state's: 256 tokens for kvd)."""
    from vllm import LLM

    return LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
        tensor_parallel_size=tp,
        gpu_memory_utilization=gpu_mem,
        max_model_len=max_model_len,
        num_gpu_blocks_override=gpu_blocks,
        block_size=block_size,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=kv,
        **extra,
    )


def greedy(max_tokens: int, kv_transfer_params: dict | None = None):
    """Greedy sampling of ``max_tokens`` tokens; ``kv_transfer_params`` reach the connector as an
    OpenAI request's do (``SamplingParams.extra_args``)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra)


# --- vLLM's counters -----------------------------------------------------------------------


def vllm_metrics(llm) -> dict[str, float]:
    """vLLM's counters and gauges from ``LLM.get_metrics()``, ``name{k=v,...}`` -> value
    (histograms as ``name:count`` and ``name:sum``)."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    out: dict[str, float] = {}
    for m in llm.get_metrics():
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
        key = f"{m.name}{{{labels}}}" if labels else m.name
        if isinstance(m, (Counter, Gauge)):
            out[key] = out.get(key, 0.0) + float(m.value)
        elif isinstance(m, Histogram):
            out[key + ":count"] = out.get(key + ":count", 0.0) + m.count
            out[key + ":sum"] = out.get(key + ":sum", 0.0) + m.sum
    return out


def prompt_sources(m: dict[str, float]) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` by source: local_compute, local_cache_hit (GPU prefix
    cache), external_kv_transfer (the connector). Counted once per request, when first
    scheduled (vllm/v1/core/sched/scheduler.py), so a preempted request's recomputation is not
    in local_compute."""
    out = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for k, v in m.items():
        if k.startswith("vllm:prompt_tokens_by_source{"):
            src = re.search(r"source=([a-z_]+)", k)
            if src:
                out[src.group(1)] = out.get(src.group(1), 0.0) + v
    return out


CONNECTOR_METRIC = re.compile(r"kvd|kv_connector|kv_transfer|offload|external_prefix|nixl", re.I)


def connector_metrics(m: dict[str, float]) -> dict[str, float]:
    """vLLM's metrics about KV connectors (those a connector exports through
    ``build_prom_metrics`` and vLLM's external prefix-cache counters)."""
    return {k: v for k, v in m.items() if CONNECTOR_METRIC.search(k) and not k.startswith("vllm:prompt_tokens")}


# --- driving the engine --------------------------------------------------------------------


class Stall(RuntimeError):
    """A generate did not finish by its deadline; ``done`` holds what finished before it."""

    def __init__(self, msg: str, done: list | None = None) -> None:
        super().__init__(msg)
        self.done = done or []


class Watchdog:
    """One deadline at a time; when it passes, ``on_fire`` prints what it can, every thread's
    stack is dumped, and the process exits with 3 — a hang becomes a failure with a reason."""

    def __init__(self, on_fire: Callable[[str], None] | None = None) -> None:
        self.on_fire = on_fire
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._label = ""
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def arm(self, label: str, seconds: float) -> None:
        with self._lock:
            self._label, self._deadline = label, time.monotonic() + seconds

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                label = self._label
            if not late:
                continue
            say(f"STALL: {label} did not finish by its deadline (the watchdog fired; a step() never returned "
                "or the engine kept stepping without finishing it)")
            try:
                if self.on_fire:
                    self.on_fire(label)
            except Exception as e:  # diagnostics must not stop the exit
                say(f"(diagnostics failed: {e!r})")
            faulthandler.dump_traceback(all_threads=True)
            sys.stdout.flush()
            os._exit(3)


@dataclass
class Finished:
    """A finished request as the reports need it."""

    tag: Any
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    e2e_s: float
    finish: str | None
    submitted: float


@dataclass
class Pending:
    tag: Any
    submitted: float
    prompt_tokens: int


def _key(request_id: str) -> str:
    # LLM hands out "N" and the engine answers with it; enqueue returns "N-<8 random chars>".
    return str(request_id).split("-", 1)[0]


@dataclass
class Driver:
    """Submits prompts through ``LLM.enqueue`` and steps the engine until they finish.

    ``submit`` may be called from ``on_finish`` (closed-loop users submit their next turn when
    the previous one finishes)."""

    llm: Any
    pending: dict[str, Pending] = field(default_factory=dict)
    steps: int = 0

    def submit(self, tokens: list[int], max_tokens: int, tag: Any = None) -> str:
        t = time.time()
        rid = self.llm.enqueue([{"prompt_token_ids": list(tokens)}], greedy(max_tokens), use_tqdm=False)[0]
        self.pending[_key(rid)] = Pending(tag, t, len(tokens))
        return rid

    def run(self, timeout_s: float, on_finish: Callable[[Finished], None] | None = None,
            label: str = "requests", diagnose: Callable[[], str] | None = None) -> list[Finished]:
        eng = self.llm.llm_engine
        done: list[Finished] = []
        deadline = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() > deadline:
                why = diagnose() if diagnose else ""
                ids = list(self.pending)
                try:
                    eng.abort_request(ids)
                except Exception as e:
                    why += f"; abort failed: {e!r}"
                self.pending.clear()
                raise Stall(f"{label}: {len(ids)} request(s) unfinished after {timeout_s:.0f} s ({self.steps} engine "
                            f"steps){'; ' + why if why else ''}", done)
            outs = eng.step()
            self.steps += 1
            for o in outs:
                if not o.finished:
                    continue
                p = self.pending.pop(_key(o.request_id), None)
                if p is None:
                    continue
                now = time.time()
                m = o.metrics
                ttft = getattr(m, "first_token_latency", None) if m is not None else None
                c = o.outputs[0]
                f = Finished(p.tag, list(c.token_ids), p.prompt_tokens, int(o.num_cached_tokens or 0),
                             float(ttft) if ttft else None, now - p.submitted, c.finish_reason, p.submitted)
                done.append(f)
                if on_finish:
                    on_finish(f)
        return done


def scheduler_state(llm) -> str:
    """What the scheduler holds (in-process engines only: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
    except AttributeError:
        return "scheduler not in this process (VLLM_ENABLE_V1_MULTIPROCESSING=1)"
    parts = []
    reads = [
        lambda: f"waiting {len(sched.waiting)}, running {len(sched.running)}",
        lambda: f"free GPU blocks {sched.kv_cache_manager.block_pool.get_num_free_blocks()}",
        lambda: "requests: " + ", ".join(
            f"{rid[:16]} {getattr(r.status, 'name', r.status)} computed {r.num_computed_tokens}/{r.num_tokens}"
            for rid, r in list(sched.requests.items())[:12]),
    ] + [lambda a=a: f"{a}: {len(getattr(sched, a))}"
         for a in ("finished_recving_kv_req_ids", "failed_recving_kv_req_ids", "deferred_frees")]
    for read in reads:
        try:
            parts.append(read())
        except Exception as e:  # one unreadable field must not hide the others
            parts.append(f"({e!r})")
    return "; ".join(parts)

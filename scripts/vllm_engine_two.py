"""The engine check's two-engine scenario (``scripts/vllm_engine_check.py --scenarios two``):
two vLLM engines, each its own process (``benches/node_engine.py``), on one kvd — what a node
with two replicas behind a load balancer is. A prefix one engine computed must come back to the
other from kvd with the same greedy tokens as the first engine's own GPU prefix cache gives,
both ways, and kvd must count the hits.

1. A computes prompt P (12,289 tokens: 48 kvd chunks + 1) and stores it; P again on A is a GPU
   prefix-cache hit: its tokens are the reference.
2. B, which never saw P, asks for it: vLLM counts the prompt as the connector's
   (``external_kv_transfer``), kvd counts 48 chunk hits and retrieves the bytes, and the tokens
   equal A's. P again on B (now from the blocks kvd filled) gives them again.
3. The same the other way: B computes Q, A gets it from kvd, tokens equal B's.
4. B is stopped: kvd lets go of its registration while A stays registered.

Both engines share one GPU (``gpu_memory_utilization`` 0.4 each, the KV cache fixed by
``num_gpu_blocks_override`` and ``kv_cache_memory_bytes``), or take one each on a host with two.
Prints "| " lines and a RESULT line as the other scenarios do.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benches"))

import vllm_harness as vh  # noqa: E402
from node_engine import BLOCK, EngineError, EngineProc, kv_bytes_per_token  # noqa: E402

CHUNK = 256
PROMPT_LEN = 48 * CHUNK + 1
GPU_BLOCKS = 2048
MAX_OUT = 16


def out(*parts: object) -> None:
    print("|", *parts, flush=True)


def prompt(seed: int, vocab: int) -> list[int]:
    rng = random.Random(7_000_003 * seed + 29)
    return [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]


class TwoEngines:
    #: The engine program (default ``benches/node_engine.py``; a stand-in for vLLM in a test).
    program: str | None = None

    def __init__(self, args) -> None:
        self.args = args
        self.checks: list[tuple[str, bool, str]] = []
        self.events: queue.Queue = queue.Queue()
        self.kvd: vh.KvdServer | None = None
        self.engines: dict[str, EngineProc] = {}
        self.n = 0
        try:
            with open(os.path.join(args.model, "config.json")) as f:
                self.vocab = int(json.load(f)["vocab_size"])
        except (OSError, KeyError, ValueError):
            self.vocab = 32000
        self.kvpt = kv_bytes_per_token(args.model)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        out(f"CHECK {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        return ok

    def result(self, status: str, reason: str = "") -> None:
        print("RESULT " + json.dumps({"status": status, "reason": reason,
                                      "checks": [{"name": n, "ok": o, "detail": d} for n, o, d in self.checks]}), flush=True)

    def kvd_sample(self, key: str) -> float:
        assert self.kvd is not None
        return sum(v for k, v in self.kvd.metrics((key.split("{")[0],)).items() if k == key or key == k.split("{")[0])

    def wait_for(self, cond, timeout_s: float) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if cond():
                    return time.monotonic() - t0
            except Exception:
                pass
            time.sleep(0.2)
        return None

    def gen(self, name: str, label: str, tokens: list[int], timeout_s: float | None = None) -> dict:
        """One request on engine ``name`` to the end; what served its prompt, by that engine's counters."""
        e = self.engines[name]
        m0 = e.metrics()
        self.n += 1
        rid = f"{name}/{self.n}"
        t0 = time.monotonic()
        e.submit(rid, tokens, MAX_OUT)
        deadline = t0 + (timeout_s or self.args.gen_timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"{label}: no answer from engine {name} within {timeout_s or self.args.gen_timeout:.0f} s")
            try:
                slot, inc, ev = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if ev.get("ev") == "exit" and slot == e.slot:
                raise EngineError(f"{label}: engine {name} exited (rc {ev.get('rc')}); log {e.log_path}: {e.tail(6)}")
            if ev.get("id") == rid:
                break
        src = vh.diff(vh.prompt_sources(e.metrics()), vh.prompt_sources(m0))
        rec = {"tokens": ev.get("tokens") or [], "s": time.monotonic() - t0, "gpu_hit": int(src["local_cache_hit"]),
               "external": int(src["external_kv_transfer"]), "computed": int(src["local_compute"])}
        out(f"engine {name}, {label}: {rec['s']:.2f} s; GPU prefix cache {rec['gpu_hit']}, connector {rec['external']}, "
            f"computed {rec['computed']}; first tokens {rec['tokens'][:6]}")
        return rec

    def start(self) -> None:
        a = self.args
        self.kvd = vh.KvdServer(a.kvd, a.pool_gib, CHUNK, os.path.join(a.out, "kvd-two.log"))
        self.kvd.start()
        out(f"kvd at {self.kvd.url} (http {self.kvd.http}), pool {a.pool_gib} GiB, chunks of {CHUNK} tokens")
        kv = vh.kv_transfer("kvd", kvd_url=self.kvd.url, kvd_extra=json.loads(a.kvd_extra) if a.kvd_extra else None)
        gpus = vh.gpu_count() or 1
        for i, name in enumerate("AB"):
            cfg = {"model": a.model, "kv": kv, "gpu_blocks": GPU_BLOCKS, "max_model_len": 16384,
                   "gpu_mem": 0.85 if gpus >= 2 else 0.4, "cudagraphs": a.cudagraphs,
                   "llm": {"kv_cache_memory_bytes": GPU_BLOCKS * BLOCK * self.kvpt}}
            # Same process group as this scenario: the check's parent ends both with it.
            self.engines[name] = EngineProc(i, 0, cfg, self.events, os.path.join(a.out, f"engine-two-{name}.log"),
                                            env={"CUDA_VISIBLE_DEVICES": str(i if gpus >= 2 else 0)}, new_session=False,
                                            program=self.program)
        out(f"two engines on {'GPUs 0 and 1' if gpus >= 2 else 'one GPU'}, kv_transfer_config {json.dumps(kv)}")
        for e in self.engines.values():
            e.wait_imported(a.start_timeout)
        for name, e in self.engines.items():
            r = e.build(a.start_timeout)
            out(f"engine {name}: vLLM {r.get('vllm')} built in {r.get('build_s')} s ({e.imported_s} s to import)")

    def across(self, src: str, dst: str, tokens: list[int], label: str) -> None:
        """``tokens`` computed on ``src``, then asked of ``dst``: from kvd, same tokens."""
        stored = 'kvd_store_chunks_total{outcome="stored"}'
        s0 = self.kvd_sample(stored)
        self.gen(src, f"{label} first (computed, stored)", tokens, self.args.first_timeout)
        took = self.wait_for(lambda: self.kvd_sample(stored) - s0 >= 48, 20)
        self.check(f"kvd stored {label} from engine {src}", took is not None, f"{self.kvd_sample(stored) - s0:.0f} chunks")
        ref = self.gen(src, f"{label} again (GPU prefix cache)", tokens)
        self.check(f"{label} again on engine {src} is a GPU prefix-cache hit", ref["gpu_hit"] >= PROMPT_LEN - 1 - CHUNK,
                   f"{ref['gpu_hit']} of {PROMPT_LEN}")
        hit0 = self.kvd_sample('kvd_lookup_chunks_total{result="hit"}')
        got0 = self.kvd_sample("kvd_bytes_retrieved_total")
        back = self.gen(dst, f"{label}, which this engine never saw", tokens, self.args.first_timeout)
        self.check(f"engine {dst} took {label}'s prefix from the connector (vLLM's external_kv_transfer)",
                   back["external"] >= PROMPT_LEN - 1 - CHUNK and back["gpu_hit"] == 0,
                   f"connector {back['external']}, GPU hit {back['gpu_hit']}, computed {back['computed']}")
        self.check(f"{label} on engine {dst}, from kvd: the same greedy tokens as engine {src}'s GPU prefix cache",
                   back["tokens"] == ref["tokens"], f"{back['tokens']} vs {ref['tokens']}")
        self.wait_for(lambda: self.kvd_sample("kvd_bytes_retrieved_total") > got0, 5)
        hits = self.kvd_sample('kvd_lookup_chunks_total{result="hit"}') - hit0
        got = self.kvd_sample("kvd_bytes_retrieved_total") - got0
        expect = back["external"] * self.kvpt
        self.check(f"kvd counted {label}'s hits for engine {dst}", hits >= 48 and got >= 0.95 * expect,
                   f"{hits:.0f} chunk hits, {got / (1 << 20):.0f} MiB retrieved (expected ~{expect / (1 << 20):.0f} MiB)")
        again = self.gen(dst, f"{label} once more (the blocks kvd filled)", tokens)
        self.check(f"{label} again on engine {dst}: the same tokens", again["tokens"] == ref["tokens"],
                   f"GPU hit {again['gpu_hit']}, connector {again['external']}")

    def run(self) -> int:
        try:
            self.start()
            took = self.wait_for(lambda: self.kvd_sample("kvd_registered_workers") >= 2, 15)
            workers = self.kvd_sample("kvd_registered_workers")
            self.check("both engines registered with kvd", took is not None, f"kvd_registered_workers {workers:.0f}")
            self.across("A", "B", prompt(1, self.vocab), "P")
            self.across("B", "A", prompt(2, self.vocab), "Q")
            self.engines["B"].stop()
            left = self.wait_for(lambda: self.kvd_sample("kvd_registered_workers") <= workers - 1, 15)
            self.check("kvd let go of the stopped engine's registration", left is not None,
                       f"kvd_registered_workers {self.kvd_sample('kvd_registered_workers'):.0f}")
            out("kvd: " + ", ".join(f"{k} {v:.3g}" for k, v in vh.kvd_summary(self.kvd.metrics()).items()))
        except Exception as e:  # kvd or an engine that did not start or answer: a failed check with its reason
            self.check("the engines ran", False, f"{type(e).__name__}: {str(e)[:600]}")
        finally:
            for e in self.engines.values():
                e.kill()
            if self.kvd is not None:
                self.kvd.kill(signal.SIGTERM)
        failed = [n for n, ok, _ in self.checks if not ok]
        self.result("failed" if failed else "passed", "; ".join(failed))
        return 1 if failed else 0


def run(args) -> int:
    return TwoEngines(args).run()

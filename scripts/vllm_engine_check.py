#!/usr/bin/env python3
"""kvd inside real vLLM 0.26 on a GPU host: issue 19's hang scenario, token for token, with
kvd restarted mid-run, under both model runners and TP2 (scripts/gpu-check.sh step `vllm`).

  PYTHONPATH=/tmp/kvd-site:/tmp/vsite python3 scripts/vllm_engine_check.py \
      [--kvd .device/bin/kvd] [--model /tmp/vparts/model] [--scenarios v1,v2,tp2] [--out DIR]
  ... --scenarios hybrid [--models-dir benches/models] [--block-size N]
  ... --scenarios two      (two engines on one kvd: a prefix from one comes back to the other)

Each scenario runs in a child process of its own (a fresh engine, the model runner chosen by
VLLM_USE_V2_MODEL_RUNNER before vLLM is imported, its own kvd), the engine in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so a stall can print the scheduler's queues):

1. `num_gpu_blocks_override=2048` (32,768 tokens of GPU KV), greedy, 16 tokens per prompt.
   Prompt A of 12,289 tokens (48 kvd chunks of 256 + 1, so the GPU prefix cache and kvd both
   hit the same 12,288 tokens) is stored to kvd; A again is served by the GPU prefix cache;
   four other 12,289-token prompts push A out of the GPU (the second of them is where the
   engine livelocked in issue 19); A once more is served from kvd: its tokens must equal the
   GPU-prefix-cache run's, vLLM must count the prompt as external_kv_transfer and
   kvd_bytes_retrieved_total must grow. A a fourth time (now from the GPU blocks kvd filled)
   must give the same tokens again. Then four such prompts at once (4 × 770 blocks of the
   2,048: vLLM queues or preempts while the connector loads and stores) must all finish.
2. kvd is SIGKILLed: a new prompt must still finish (misses, no waiting); kvd starts again on
   the same port: the connector must register again by itself, and a prompt stored to the new
   kvd, pushed out of the GPU and asked again must come back from it, tokens equal.
3. TP2: `tensor_parallel_size=2`. vLLM 0.26 refuses two ranks on one GPU ("World size (2) is
   larger than the number of available GPUs (1)"); then the scenario is reported SKIPPED with
   vLLM's reason, and it runs (steps 1 and 2, both ranks registered with kvd) on a 2-GPU host.

4. hybrid (``--scenarios hybrid``, or the model names: gemma3-swa, nemotronh-mamba,
   qwen3-next-tiny, deepseek-v4-tiny): the
   round trip of step 1 (A stored, A from the GPU prefix cache, four other prompts, A from kvd,
   tokens equal; no concurrent run, no restart) on each of ``benches/vllm_hybrid.py``'s hybrid
   KV-cache models: Gemma 3's sliding window beside full attention (16-token blocks), a
   dense NemotronH, Mamba2 beside attention, with 256-token blocks and mamba_cache_mode
   "align" (vLLM's Mamba prefix caching, the state at block boundaries), Qwen3-Next's Gated
   DeltaNet state beside attention (the same), and DeepSeek-V4's sliding window, compressed
   (C4 with its indexer, C128) MLA and compressor states (256- to 4-token blocks). The KV-cache groups
   vLLM made are printed, and why kvd turned itself off where it did. A model vLLM refuses at
   start is SKIPPED with vLLM's first lines; the last line then says HYBRID CHECK OK.

5. two (``--scenarios two``; ``scripts/vllm_engine_two.py``): two engines, each its own vLLM
   process, on one kvd. A 12,289-token prompt computed by engine A comes back to engine B from
   kvd — vLLM counts it as the connector's, kvd counts 48 chunk hits and the bytes — with the
   same greedy tokens as A's own GPU prefix cache gives; then the same from B to A; then B is
   stopped and kvd lets go of its registration.

Every generate has a deadline (a step loop that gives up and prints the scheduler's state), and
a watchdog thread ends the process with every thread's stack if one step never returns.
vLLM's metrics about the connector (``build_prom_metrics``: ``get_kv_connector_stats``) are
printed where the connector exports any, and checked to move if they name kvd.
Exit status 0 only if every scenario that ran passed; the last line says ENGINE CHECK OK.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benches"))

import vllm_harness as vh  # noqa: E402
import vllm_hybrid as vhy  # noqa: E402

CHUNK = 256
PROMPT_LEN = 48 * CHUNK + 1  # 12,289
GPU_BLOCKS = 2048
MAX_OUT = 16
VOCAB = 32000

SCENARIOS = {
    # name: (VLLM_USE_V2_MODEL_RUNNER, tensor_parallel_size)
    "v1": ("0", 1),
    "v2": ("1", 1),
    "tp2": ("0", 2),
    # Two engines, each its own process (scripts/vllm_engine_two.py).
    "two": ("0", 1),
}
#: Hybrid models run under the v1 model runner, one GPU.
HYBRID_RUNNER = "0"


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    """A deterministic prompt of ``n`` token ids, distinct for each seed."""
    rng = random.Random(1_000_003 * seed + 17)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def out(*parts: object) -> None:
    # "| " marks the lines the parent shows; vLLM's own log goes to the scenario's log file.
    print("|", *parts, flush=True)


class Scenario:
    """One engine, one kvd, the checks so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.checks: list[tuple[str, bool, str]] = []
        self.kvd: vh.KvdServer | None = None
        self.llm = None
        self.watchdog = vh.Watchdog(self._on_stall)
        self.gens = 0
        #: KV bytes a token of the model moves, for the expectation printed beside
        #: kvd_bytes_retrieved_total (None: not one figure, as for a sliding window or a state).
        self.kv_kib_per_token: float | None = 64.0

    # -- reporting

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, bool(ok), detail))
        out(f"CHECK {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        return ok

    def _kvd_line(self) -> str:
        if self.kvd is None or self.kvd.proc is None or self.kvd.proc.poll() is not None:
            return "kvd: not running"
        try:
            s = vh.kvd_summary(self.kvd.metrics())
        except Exception as e:
            return f"kvd metrics unreadable: {e!r}"
        return "kvd: " + ", ".join(f"{k} {v:.3g}" for k, v in s.items())

    def _on_stall(self, label: str) -> None:
        out(f"STALL in {label}: {vh.scheduler_state(self.llm) if self.llm is not None else 'engine not built'}")
        out(self._kvd_line())
        if self.kvd is not None:
            self.kvd.kill()
        self.result("stall", f"{label} did not finish (watchdog)")

    def result(self, status: str, reason: str = "") -> None:
        print("RESULT " + json.dumps({"status": status, "reason": reason,
                                      "checks": [{"name": n, "ok": o, "detail": d} for n, o, d in self.checks]}), flush=True)

    # -- engine

    def gen(self, label: str, tokens: list[int], max_tokens: int = MAX_OUT, timeout_s: float | None = None,
            quiet: bool = False) -> dict:
        """One request to the end under a deadline; what served its prompt, by vLLM's counters."""
        timeout_s = timeout_s or self.args.gen_timeout
        self.gens += 1
        m0 = vh.vllm_metrics(self.llm)
        t0 = time.monotonic()
        self.watchdog.arm(label, timeout_s + self.args.watchdog_margin)
        try:
            d = vh.Driver(self.llm)
            d.submit(tokens, max_tokens, label)
            fin = d.run(timeout_s, label=label, diagnose=lambda: vh.scheduler_state(self.llm))[0]
        finally:
            self.watchdog.disarm()
        dt = time.monotonic() - t0
        m1 = vh.vllm_metrics(self.llm)
        src = vh.diff(vh.prompt_sources(m1), vh.prompt_sources(m0))
        rec = {"label": label, "s": dt, "tokens": fin.token_ids, "cached": fin.cached_tokens,
               "gpu_hit": int(src["local_cache_hit"]), "external": int(src["external_kv_transfer"]),
               "computed": int(src["local_compute"]), "metrics_after": m1}
        if not quiet:
            out(f"{label}: {dt:.2f} s, prompt {len(tokens)}: GPU prefix cache {rec['gpu_hit']}, connector "
                f"{rec['external']}, computed {rec['computed']} (num_cached_tokens {fin.cached_tokens}); "
                f"first tokens {fin.token_ids[:6]}")
        return rec

    def gen_many(self, label: str, prompts: list[list[int]], timeout_s: float | None = None) -> list[vh.Finished]:
        """Several requests in flight at once, under one deadline; results in submission order."""
        timeout_s = timeout_s or self.args.gen_timeout * 2
        t0 = time.monotonic()
        self.watchdog.arm(label, timeout_s + self.args.watchdog_margin)
        try:
            d = vh.Driver(self.llm)
            for i, p in enumerate(prompts):
                d.submit(p, MAX_OUT, i)
            done = d.run(timeout_s, label=label, diagnose=lambda: vh.scheduler_state(self.llm))
        finally:
            self.watchdog.disarm()
        out(f"{label}: {len(done)} requests in {time.monotonic() - t0:.2f} s; num_cached_tokens "
            f"{[f.cached_tokens for f in sorted(done, key=lambda f: f.tag)]}")
        return sorted(done, key=lambda f: f.tag)

    def wait_for(self, what: str, cond, timeout_s: float, poke=None) -> float | None:
        """Seconds until ``cond()`` held, or None; ``poke()`` runs between tries."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                if cond():
                    return time.monotonic() - t0
            except Exception:
                pass
            if poke:
                poke()
            else:
                time.sleep(0.2)
        out(f"gave up waiting for {what} after {timeout_s:.0f} s")
        return None

    def kvd_total(self, name: str) -> float:
        assert self.kvd is not None
        return self.kvd.total(name)

    def kvd_sample(self, key: str) -> float:
        assert self.kvd is not None
        return sum(v for k, v in self.kvd.metrics((key.split("{")[0],)).items() if k == key)

    # -- the scenario

    def round_trip(self, name: str, target: list[int], pushers: list[list[int]], from_kvd: bool) -> None:
        """Store ``target``, hit it in the GPU, push it out with ``pushers``, get it back."""
        stored = 'kvd_store_chunks_total{outcome="stored"}'
        stored0 = self.kvd_sample(stored) if from_kvd else 0.0
        first = self.gen(f"{name} first (stored)", target, timeout_s=self.args.first_timeout)
        if from_kvd:
            # 48 chunks of 256 tokens (per rank: TP2 stores 96 shards).
            took = self.wait_for(f"kvd to store {name}'s 48 chunks", lambda: self.kvd_sample(stored) - stored0 >= 48, 20)
            self.check(f"kvd stored {name}", took is not None,
                       f"{self.kvd_sample(stored) - stored0:.0f} chunks stored"
                       + (f" ({took:.1f} s after the request finished)" if took is not None else ""))
        hit = self.gen(f"{name} again (GPU prefix cache)", target)
        self.check(f"{name} again is a GPU prefix-cache hit", hit["gpu_hit"] >= PROMPT_LEN - 1 - CHUNK,
                   f"{hit['gpu_hit']} of {PROMPT_LEN} tokens from the GPU prefix cache")
        for i, p in enumerate(pushers):
            self.gen(f"push {i + 1}/{len(pushers)} (another {PROMPT_LEN}-token prompt)", p)
        retrieved0 = self.kvd_total("kvd_bytes_retrieved_total") if from_kvd else 0.0
        back = self.gen(f"{name} after leaving the GPU", target)
        self.check(f"{name} left the GPU prefix cache", back["gpu_hit"] < PROMPT_LEN - 1 - CHUNK,
                   f"{back['gpu_hit']} tokens still hit in the GPU (the pushes must evict it)")
        self.check(f"{name} served by the connector (vLLM's external_kv_transfer)", back["external"] >= CHUNK,
                   f"{back['external']} tokens")
        self.check(f"{name} from the connector: same tokens as from the GPU prefix cache",
                   back["tokens"] == hit["tokens"], f"{back['tokens']} vs {hit['tokens']}")
        if from_kvd:
            grew = self.wait_for("kvd_bytes_retrieved_total to grow",
                                 lambda: self.kvd_total("kvd_bytes_retrieved_total") > retrieved0, 5)
            got = self.kvd_total("kvd_bytes_retrieved_total") - retrieved0
            expect = (f" (expected ~{back['external'] * self.kv_kib_per_token / 1024:.0f} MiB at "
                      f"{self.kv_kib_per_token:.0f} KiB/token)" if self.kv_kib_per_token else "")
            self.check("kvd_bytes_retrieved_total grew", grew is not None, f"+{got / (1 << 20):.0f} MiB{expect}")
        again = self.gen(f"{name} once more (GPU blocks the connector filled)", target)
        self.check(f"{name} from the blocks the connector filled: same tokens", again["tokens"] == hit["tokens"],
                   f"GPU hit {again['gpu_hit']}, connector {again['external']}")
        out(f"{name}: full prefill vs prefix-cache run: {'same' if first['tokens'] == hit['tokens'] else 'differ'} "
            "(informative: a full prefill and a 1-token prefill over cached KV may round differently)")
        self.connector_metrics(back["metrics_after"])

    def connector_metrics(self, m: dict[str, float]) -> None:
        cm = vh.connector_metrics(m)
        if not cm:
            out("vLLM metrics about the connector: none exported")
            return
        out("vLLM metrics about the connector: " + ", ".join(f"{k} {v:.6g}" for k, v in sorted(cm.items())))
        kvd_named = {k: v for k, v in cm.items() if "kvd" in k.lower()}
        if kvd_named:
            self.check("vLLM's kvd metrics move", any(v > 0 for v in kvd_named.values()),
                       ", ".join(f"{k} {v:.6g}" for k, v in sorted(kvd_named.items())))

    def restart(self) -> None:
        assert self.kvd is not None
        workers = self.kvd_total("kvd_registered_workers")
        self.check("kvd holds the connector's registered KV cache(s) before the restart", workers >= 1,
                   f"kvd_registered_workers {workers:.0f}")
        out(f"killing kvd (SIGKILL) with {workers:.0f} registered KV cache(s)")
        self.kvd.kill(signal.SIGKILL)
        down = self.gen("new prompt while kvd is down", prompt(900))
        self.check("vLLM serves while kvd is down", len(down["tokens"]) == MAX_OUT, f"{down['s']:.1f} s")
        self.kvd.start()
        out(f"kvd started again on port {self.kvd.port} (http {self.kvd.http})")
        pokes = itertools.count(901)

        def poke() -> None:
            # Small new prompts, in case the connector notices the new kvd only when it is used.
            self.gen("poke", prompt(next(pokes), 2 * CHUNK + 1), 1, quiet=True)
            time.sleep(1.0)

        took = self.wait_for("the connector to register with the restarted kvd",
                             lambda: self.kvd_total("kvd_registered_workers") >= max(1.0, workers), 60, poke)
        self.check("the connector registered again with the restarted kvd", took is not None,
                   f"{self.kvd_total('kvd_registered_workers'):.0f} of {workers:.0f} KV caches"
                   + (f" after {took:.1f} s" if took is not None else ""))
        self.round_trip("G", prompt(20), [prompt(21 + i) for i in range(4)], from_kvd=True)

    def run(self) -> int:
        a = self.args
        if a.child in vhy.MODELS:
            return self.run_hybrid(a.child)
        runner, tp = SCENARIOS[a.child]
        if a.arm == "kvd":
            disk = []
            if a.kvd_disk:
                os.makedirs(os.path.join(a.kvd_disk, a.child), exist_ok=True)
                # LRU, so that A, the oldest prompt, is what the pushes send to the disk: kvd's
                # default policy may keep A (looked up before it was stored) and let a push go
                # instead, and then A never comes back from the disk (seen on the H200, 2026-12-03).
                disk = ["--disk", os.path.join(a.kvd_disk, a.child, "d0"), "--disk-size-gb", str(a.kvd_disk_gib),
                        "--eviction", "lru"]
            self.kvd = vh.KvdServer(a.kvd, a.pool_gib, CHUNK, os.path.join(a.out, f"kvd-{a.child}.log"), extra=disk)
            self.kvd.start()
            out(f"kvd at {self.kvd.url} (http {self.kvd.http}), pool {a.pool_gib} GiB, chunks of {CHUNK} tokens"
                + (f", disk tier {' '.join(disk)}" if disk else ""))
        extra = json.loads(a.kvd_extra) if a.kvd_extra else {}
        kv = vh.kv_transfer(a.arm, kvd_url=self.kvd.url if self.kvd else "", cpu_bytes=int(a.pool_gib * (1 << 30)),
                            kvd_extra=extra)
        out(f"scenario {a.child}: VLLM_USE_V2_MODEL_RUNNER={runner}, tensor_parallel_size={tp}, "
            f"num_gpu_blocks_override={GPU_BLOCKS}, kv_transfer_config {json.dumps(kv)}")
        t0 = time.monotonic()
        self.watchdog.arm("engine start", a.start_timeout)
        try:
            self.llm = vh.make_llm(a.model, kv, gpu_blocks=GPU_BLOCKS, max_model_len=16384, tp=tp,
                                   enforce_eager=not a.cudagraphs)
        except Exception as e:
            self.watchdog.disarm()
            msg = str(e).strip()
            # ParallelConfig's refusal may come wrapped in a pydantic ValidationError: find its line.
            line = re.search(r"[^\n]*(World size|available GPUs)[^\n]*", msg)
            first = line.group(0).strip() if line else (msg.splitlines()[0] if msg else repr(e))
            # Only vLLM's refusal of more ranks than GPUs is a skip; anything else is a failure.
            if tp > 1 and vh.gpu_count() < tp and line is not None and not isinstance(e, ImportError):
                out(f"SKIPPED tp{tp}: vLLM 0.26 refuses {tp} ranks on {vh.gpu_count()} GPU(s): {type(e).__name__}: {first}")
                self.result("skipped", f"vLLM refuses tensor_parallel_size={tp} on {vh.gpu_count()} GPU(s): {first} "
                            "(run on a host with 2 GPUs, e.g. nvidia-h200-x2)")
                return 0
            raise
        self.watchdog.disarm()
        import vllm

        out(f"vLLM {vllm.__version__} ready in {time.monotonic() - t0:.1f} s")
        self.round_trip("A", prompt(1), [prompt(2 + i) for i in range(4)], from_kvd=a.arm == "kvd")
        if a.arm == "kvd" and a.kvd_disk:
            # The pool holds fewer than the five prompts: A left L1 for the disk, and the lookup
            # answered with the disk's chunks while the load waited for their reads.
            hits = self.kvd_sample('kvd_disk_lookup_chunks_total{result="hit"}')
            self.check("A came back from kvd's disk tier", hits > 0,
                       f"{hits:.0f} chunks read back from disk, "
                       f"{self.kvd_total('kvd_disk_load_timeouts_total'):.0f} loads past the deadline, "
                       f"{self.kvd_total('kvd_disk_rejected_values_total'):.0f} values rejected")
        # Under block pressure with requests in flight together: B (stored by the round trip, out of
        # the GPU by now) and three new prompts need 4 × 770 blocks of the 2,048.
        ref = self.gen("B again (reference for the concurrent run)", prompt(2))
        many = self.gen_many("B and three new prompts at once", [prompt(2)] + [prompt(40 + i) for i in range(3)])
        self.check("four 12,289-token requests at once under GPU-block pressure all finish", len(many) == 4,
                   f"{len(many)} of 4")
        # Informative only: batched with other prefills, B's last token runs through GEMMs of
        # other shapes, which may round differently (the checked comparisons above are 1 request each).
        out(f"B in the concurrent run vs alone: {'same tokens' if many and many[0].token_ids == ref['tokens'] else 'tokens differ'}")
        if a.arm == "kvd" and not a.no_restart:
            self.restart()
        if a.arm == "kvd":
            out(self._kvd_line())
        failed = [n for n, ok, _ in self.checks if not ok]
        self.result("failed" if failed else "passed", "; ".join(failed))
        return 1 if failed else 0

    def run_hybrid(self, name: str) -> int:
        """Step 1's round trip on one hybrid KV-cache model (the module header, item 4)."""
        a = self.args
        hm = vhy.MODELS[name]
        model = vhy.model_dir(name, a.models_dir)
        block = a.block_size or hm.block_size
        self.kv_kib_per_token = None
        self.kvd = vh.KvdServer(a.kvd, a.pool_gib, CHUNK, os.path.join(a.out, f"kvd-{name}.log"))
        self.kvd.start()
        out(f"kvd at {self.kvd.url} (http {self.kvd.http}), pool {a.pool_gib} GiB, chunks of {CHUNK} tokens")
        extra = json.loads(a.kvd_extra) if a.kvd_extra else {}
        kv = vh.kv_transfer("kvd", kvd_url=self.kvd.url, kvd_extra=extra)
        out(f"model {name}: {hm.about}; {model}; block_size {block}, num_gpu_blocks_override {hm.gpu_blocks}, "
            f"{json.dumps(hm.llm)}; kv_transfer_config {json.dumps(kv)}")
        t0 = time.monotonic()
        self.watchdog.arm("engine start", a.start_timeout)
        try:
            self.llm = vh.make_llm(model, kv, gpu_blocks=hm.gpu_blocks, max_model_len=16384, block_size=block,
                                   enforce_eager=not a.cudagraphs, **hm.llm)
        except Exception as e:
            # vLLM refusing the model (a config it cannot parse, a kernel this host lacks) is a
            # skip with its reason: the other model still runs. An error raised in kvd's own
            # code is kvd's failure, never a skip.
            self.watchdog.disarm()
            if vhy.raised_in_kvd(e):
                raise
            lines = [l.strip() for l in (str(e).strip() or repr(e)).splitlines() if l.strip()][:4]
            why = f"{type(e).__name__}: " + " | ".join(lines)
            out(f"SKIPPED {name}: vLLM did not start it: {why}")
            self.result("skipped", f"vLLM did not start {name}: {why[:600]}")
            return 0
        self.watchdog.disarm()
        import vllm

        out(f"vLLM {vllm.__version__} ready in {time.monotonic() - t0:.1f} s")
        facts = vhy.engine_facts(self.llm)
        out(vhy.describe_groups(facts))
        print("FACTS " + json.dumps(facts, default=str), flush=True)
        if facts.get("block_size") not in (None, block):
            out(f"vLLM changed the attention block size from {block} to {facts['block_size']}")
        misfit = vhy.chunk_fit(facts, CHUNK)
        self.check(f"kvd's {CHUNK}-token chunk is whole blocks of every group", misfit is None, misfit or "")
        off = facts.get("connector_off")
        if off:
            out(f"kvd connector ERROR: kvd: offloading is off for this model, vLLM serves without it: {off}")
        on = not off and facts.get("connector") == "KvdConnector"
        self.check("the kvd connector is on for this model", on,
                   off or facts.get("error") or f"{facts.get('connector')}, {len(facts.get('groups', []))} groups")
        if off:
            # Without kvd there is no round trip to check; one prompt twice still shows that the
            # engine runs the model (its kernels) and that its own prefix cache serves it.
            first = self.gen("A first (kvd off)", prompt(1), timeout_s=a.first_timeout)
            hit = self.gen("A again (GPU prefix cache)", prompt(1))
            out(f"engine without kvd: A again {hit['gpu_hit']} tokens from the GPU prefix cache, tokens "
                f"{'same' if first['tokens'] == hit['tokens'] else 'differ'}")
        else:
            n = vhy.pushes_to_evict(facts, PROMPT_LEN)
            self.round_trip("A", prompt(1), [prompt(2 + i) for i in range(n)], from_kvd=True)
        out(self._kvd_line())
        failed = [n for n, ok, _ in self.checks if not ok]
        self.result("failed" if failed else "passed", "; ".join(failed))
        return 1 if failed else 0


def child(args: argparse.Namespace) -> int:
    if args.child == "two":
        import vllm_engine_two

        return vllm_engine_two.run(args)
    s = Scenario(args)
    try:
        return s.run()
    except vh.Stall as e:
        out(f"STALL: {e}")
        out(s._kvd_line())
        s.result("stall", str(e))
        return 3
    except Exception as e:
        import traceback

        traceback.print_exc()
        s.result("error", f"{type(e).__name__}: {str(e).strip()[:400]}")
        return 1
    finally:
        if s.kvd is not None:
            s.kvd.kill(signal.SIGTERM)
        # No interpreter shutdown: vLLM's exit hooks can wait on workers; the parent kills this
        # process group once it has the result.
        sys.stdout.flush()
        sys.stderr.flush()


def parent(args: argparse.Namespace) -> int:
    os.makedirs(args.out, exist_ok=True)
    names = scenario_names(args.scenarios)
    hybrid_only = all(n in vhy.MODELS for n in names)
    what = (f"kvd {args.kvd}; models from {args.models_dir}" if hybrid_only
            else f"arm {args.arm}; kvd {args.kvd}; model {args.model}")
    print(f"# vLLM {'hybrid' if hybrid_only else 'engine'} check: scenarios {', '.join(names)}; {what}; "
          f"logs in {args.out}", flush=True)
    t_start = time.monotonic()
    results: dict[str, dict] = {}
    for n in names:
        left = args.budget_s - (time.monotonic() - t_start)
        if left < 60:
            results[n] = {"status": "not run", "reason": f"the {args.budget_s:.0f} s budget is spent"}
            print(f"[{n}] not run: budget spent", flush=True)
            continue
        runner = HYBRID_RUNNER if n in vhy.MODELS else SCENARIOS[n][0]
        env = dict(os.environ, **vh.VLLM_ENV)
        env["VLLM_USE_V2_MODEL_RUNNER"] = runner
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiproc else "0"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", n] + child_args(args)
        log_path = os.path.join(args.out, f"engine-{n}.log")
        t0 = time.monotonic()
        res = run_child(cmd, env, log_path, n, min(args.scenario_timeout, left))
        res["seconds"] = round(time.monotonic() - t0, 1)
        results[n] = res
        print(f"[{n}] {res['status'].upper()} in {res['seconds']} s" + (f": {res['reason']}" if res.get("reason") else ""),
              flush=True)
    with open(os.path.join(args.out, "vllm-hybrid-check.json" if hybrid_only else "vllm-engine-check.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = {n: r for n, r in results.items() if r["status"] not in ("passed", "skipped")}
    if hybrid_only:
        return vhy.summary(results, bad)
    print("== vLLM engine check")
    for n, r in results.items():
        print(f"{n}: {r['status']}" + (f" — {r['reason']}" if r.get("reason") else ""))
    if bad:
        print(f"ENGINE CHECK FAILED: {', '.join(bad)}")
        return 1
    skipped = [n for n, r in results.items() if r["status"] == "skipped"]
    print("ENGINE CHECK OK" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    return 0


def scenario_names(spec: str) -> list[str]:
    """``--scenarios``: a comma list of scenario and hybrid-model names; ``hybrid`` is every
    hybrid model."""
    names: list[str] = []
    for n in (n for n in spec.split(",") if n):
        names += list(vhy.MODELS) if n == "hybrid" else [n]
    for n in names:
        if n not in SCENARIOS and n not in vhy.MODELS:
            sys.exit(f"--scenarios: unknown {n!r}; known: {', '.join([*SCENARIOS, 'hybrid', *vhy.MODELS])}")
    return names


def child_args(args: argparse.Namespace) -> list[str]:
    out_args = ["--kvd", args.kvd, "--model", args.model, "--out", args.out, "--arm", args.arm,
                "--pool-gib", str(args.pool_gib), "--gen-timeout", str(args.gen_timeout),
                "--first-timeout", str(args.first_timeout), "--start-timeout", str(args.start_timeout),
                "--watchdog-margin", str(args.watchdog_margin)]
    if args.kvd_extra:
        out_args += ["--kvd-extra", args.kvd_extra]
    if args.kvd_disk:
        out_args += ["--kvd-disk", args.kvd_disk, "--kvd-disk-gib", str(args.kvd_disk_gib)]
    if args.no_restart:
        out_args.append("--no-restart")
    if args.cudagraphs:
        out_args.append("--cudagraphs")
    if args.models_dir != vhy.MODELS_DIR:
        out_args += ["--models-dir", args.models_dir]
    if args.block_size:
        out_args += ["--block-size", str(args.block_size)]
    return out_args


def run_child(cmd: list[str], env: dict, log_path: str, name: str, timeout_s: float) -> dict:
    """Runs one scenario; shows its "| " lines, keeps the rest in ``log_path``."""
    result: dict | None = None
    facts: dict | None = None
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        import selectors

        sel = selectors.DefaultSelector()
        assert p.stdout is not None
        sel.register(p.stdout, selectors.EVENT_READ)
        tail: list[str] = []
        timed_out = False
        while True:
            if time.monotonic() > deadline:
                timed_out = True
                break
            if not sel.select(timeout=1.0):
                if p.poll() is not None:
                    break
                continue
            line = p.stdout.readline()
            if not line or (result is not None and p.poll() is not None):
                break
            log.write(line)
            tail = (tail + [line])[-40:]
            if line.startswith("| "):
                print(f"[{name}] {line[2:]}", end="", flush=True)
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif line.startswith("FACTS "):  # hybrid models: the KV-cache groups vLLM made
                facts = json.loads(line[6:])
            elif line.startswith(("STALL", "Traceback", "Fatal Python error", "Thread 0x", "Current thread")) or (
                    "offloading is off for this model" in line):  # the last: KvdConnector turned itself off
                print(f"[{name}] {line}", end="", flush=True)
            elif "KV Transfer metrics" in line:
                # vLLM's periodic log of the connector's get_kv_connector_stats (where it has any).
                print(f"[{name}] vLLM log: {line.split('KV Transfer metrics', 1)[1].strip(': ')}", end="", flush=True)
        if timed_out:
            os.killpg(p.pid, signal.SIGKILL)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        try:  # what the scenario left behind: vLLM's TP workers, a kvd
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        return {"status": "stall", "reason": f"no result within {timeout_s:.0f} s (killed; log {log_path})"}
    if result is None:
        print(f"[{name}] exited {rc} without a result; the last lines of {log_path}:")
        print("".join(f"[{name}]   {l}" for l in tail), end="", flush=True)
        return {"status": "error", "reason": f"exit {rc} without a result (log {log_path})"}
    if result["status"] not in ("passed", "skipped"):
        print(f"[{name}] the last lines of {log_path}:")
        print("".join(f"[{name}]   {l}" for l in tail[-15:]), end="", flush=True)
    result["rc"] = rc
    if facts is not None:
        result["engine"] = facts
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--model", default=vh.default_model())
    ap.add_argument("--scenarios", default="v1,v2,tp2",
                    help=f"comma list of {', '.join(SCENARIOS)} (two: not by default), hybrid (= {', '.join(vhy.MODELS)})")
    ap.add_argument("--models-dir", default=vhy.MODELS_DIR, help="where the hybrid models' config.json folders are")
    ap.add_argument("--block-size", type=int, default=0,
                    help="hybrid models: the attention block size (default: each model's, benches/vllm_hybrid.py)")
    ap.add_argument("--arm", default="kvd", choices=("kvd", "offload"),
                    help="offload: the same scenario with vLLM's OffloadingConnector, as a reference (no restart)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, ".device/out"))
    ap.add_argument("--pool-gib", type=float, default=8.0, help="kvd's pool (offload arm: cpu_bytes_to_use)")
    ap.add_argument("--kvd-disk", default="", help="give kvd a disk tier in this folder (with a small --pool-gib, "
                    "prompt A leaves L1 for the disk and must come back from it)")
    ap.add_argument("--kvd-disk-gib", type=float, default=16.0, help="the disk tier's size")
    ap.add_argument("--kvd-extra", default="", help='more kv_connector_extra_config as JSON, e.g. \'{"kvd.layout":"none"}\'')
    ap.add_argument("--gen-timeout", type=float, default=60.0, help="seconds one generate may take")
    ap.add_argument("--first-timeout", type=float, default=120.0, help="... the first of a prompt (warm-up)")
    ap.add_argument("--start-timeout", type=float, default=240.0, help="seconds the engine may take to start")
    ap.add_argument("--watchdog-margin", type=float, default=30.0,
                    help="seconds past a generate's deadline before the watchdog ends a step that never returns")
    ap.add_argument("--scenario-timeout", type=float, default=280.0)
    ap.add_argument("--budget-s", type=float, default=560.0, help="all scenarios together")
    ap.add_argument("--no-restart", action="store_true", help="skip the kvd restart")
    ap.add_argument("--multiproc", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=1 (no scheduler dump on a stall)")
    ap.add_argument("--cudagraphs", action="store_true", help="CUDA graphs and torch.compile (default: enforce_eager)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        vh.set_vllm_env()
        os._exit(child(args))
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

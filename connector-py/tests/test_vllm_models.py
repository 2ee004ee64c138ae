"""The kvd connector on models as vLLM 0.33 itself builds them: every KV cache spec comes from
vLLM's own layer classes (``vllm_specs.py``: DeepSeek-V4's cache layers and attention, Gemma-3's
and Gemma-4's ``Attention`` layers, Qwen3-Next's GatedDeltaNet), grouped by vLLM's own
``get_kv_cache_groups``, driven by vLLM's real scheduler (``vllm_engine.py``) against a real kvd.
No test here writes a shape of its own.

Prompts are not chunk multiples; kvd is evicted from (vLLM's prefix cache emptied), restarted
while vLLM holds a prefix whose end is not on a chunk boundary, and paused (SIGSTOP) while a
sliding-window request prefills. Every byte a load writes, and vLLM's null block, are checked.

Run with ``scripts/vllm-conformance.sh`` (vLLM 0.33: DeepSeek-V4's layer classes and the
hybrid allocator under a connector exist from that release on).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any, Callable

import pytest

vllm = pytest.importorskip("vllm")
if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 33):
    pytest.skip("models as vLLM builds them need vLLM >= 0.33 (DeepSeek-V4's classes, hybrid groups "
                "under a connector)", allow_module_level=True)

from vllm.v1.request import RequestStatus  # noqa: E402

import vllm_specs  # noqa: E402
from conftest import Kvd  # noqa: E402
from kvd.testing import until  # noqa: E402
from vllm_engine import Engine, entry_blocks, vllm_config  # noqa: E402

pytestmark = pytest.mark.vllm


@dataclasses.dataclass(frozen=True)
class Model:
    """One model as the tests run it: kvd's chunk, the engine's block size and blocks, its
    specs from vLLM's classes, and the scheduler's token budget per step."""

    chunk: int
    block: int
    blocks: int
    specs: Callable[..., dict[str, Any]]
    max_batched: int = 256
    #: Tokens of the prompts: several chunks and a part of one.
    prompt: int = 0
    #: vLLM keeps the state of state groups only where a step ends on a block boundary.
    mamba: bool = False

    def engine(self, url: str, max_batched: int | None = None, blocks: int | None = None) -> Engine:
        vc = vllm_config(url, self.block, self.chunk, max_batched=max_batched or self.max_batched)
        if self.mamba:
            vc.cache_config.mamba_cache_mode = "align"
        return Engine(vc, self.specs(vc), blocks or self.blocks)


MODELS = {
    # A cut of DeepSeek-V4's own config (its first 6 decoder layers): 7 KV cache groups, one of
    # them three layer shapes; 256-token blocks, 4-token hash blocks.
    "deepseek-v4": Model(256, 256, 256, lambda vc: vllm_specs.dsv4_specs(vc, 6), max_batched=512, prompt=5 * 256 + 100),
    "gemma3": Model(32, 16, 256, vllm_specs.gemma3_specs, prompt=7 * 32 + 20),
    "gemma4": Model(32, 16, 256, vllm_specs.gemma4_specs, prompt=7 * 32 + 20),
    # vLLM keeps a state group's state only where a step ends, on a block boundary: kvd can serve
    # a hit of n chunks only if some step ended at chunk n's end. With kvd's chunk the block
    # size (as it must be for vLLM's large hybrid blocks, which 256 does not divide), every
    # step's end is one; with 32-token chunks over 16-token blocks this prompt got no hit.
    "qwen3-next": Model(16, 16, 256, vllm_specs.qwen3_next_specs, prompt=14 * 16 + 20, mamba=True),
}


def _running_after_load(e: Engine, req_id: str) -> Callable[[], bool]:
    return lambda: (e.s.requests.get(req_id) is not None and e.s.requests[req_id].status == RequestStatus.RUNNING
                    and e.s.requests[req_id].num_computed_tokens > 0)


def _hit(e: Engine) -> int:
    return int(e.s.connector._sched.stats["hit_tokens"])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_prompt_that_left_vllms_cache_comes_back_from_kvd(kvd_factory, model):
    """Evicted from vLLM's cache (its prefix cache emptied), a prompt of several chunks and a
    part comes back from kvd: every whole chunk before its last token, every byte checked."""
    m = MODELS[model]
    k = kvd_factory("--chunk-tokens", str(m.chunk))
    e = m.engine(k.url)
    try:
        assert e.s.connector.disabled is None, e.s.connector.disabled
        a = list(range(100, 100 + m.prompt))
        e.add("a", a)
        e.run(lambda: e.finished("a"), timeout=60, what="a finishing")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache()
        full = (len(a) - 1) // m.chunk
        e.add("a2", a, max_tokens=3)
        e.run(_running_after_load(e, "a2"), timeout=60, what="a2 running")
        assert _hit(e) == full * m.chunk, (
            f"kvd supplied {_hit(e)} tokens of a's {full * m.chunk} (groups "
            f"{[type(g.kv_cache_spec).__name__ for g in e.kvc.kv_cache_groups]}, subs {e.s.connector._sched.subs})")
        w = e.worker._worker.stats
        assert w["missing_chunks"] == 0 and w["failed_loads"] == 0 and w["loaded_chunks"] > 0, w
        assert e.check_kv("a2", full * m.chunk) > 0
        e.run(lambda: e.finished("a2"), timeout=60, what="a2 finishing")
    finally:
        e.close()


def test_deepseek_v4_at_full_depth_comes_back_from_kvd(kvd_factory):
    """DeepSeek-V4's own config at its full depth (43 decoder layers: vLLM makes 5 groups)."""
    k = kvd_factory("--chunk-tokens", "256")
    vc = vllm_config(k.url, 256, 256, max_batched=512)
    e = Engine(vc, vllm_specs.dsv4_specs(vc), 64)
    try:
        assert e.s.connector.disabled is None, e.s.connector.disabled
        a = list(range(100, 100 + 3 * 256 + 50))
        e.add("a", a)
        e.run(lambda: e.finished("a"), timeout=120, what="a finishing")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=2)
        e.run(_running_after_load(e, "a2"), timeout=120, what="a2 running")
        assert _hit(e) == 3 * 256
        w = e.worker._worker.stats
        assert w["missing_chunks"] == 0 and w["failed_loads"] == 0, w
        assert e.check_kv("a2", 3 * 256) > 0
    finally:
        e.close()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_preempted_request_resumes_from_kvd(kvd_factory, model):
    """vLLM preempts a decoding request and empties its prefix cache: it resumes from kvd, every
    loaded byte checked (and, for a state group, the state it resumes from)."""
    m = MODELS[model]
    k = kvd_factory("--chunk-tokens", str(m.chunk))
    e = m.engine(k.url)
    try:
        a = list(range(100, 100 + m.prompt))
        e.add("a", a, max_tokens=30)
        e.run(lambda: e.s.requests["a"].num_computed_tokens >= len(a) + 5, timeout=60, what="a decoding")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache(reset_running_requests=True)
        assert e.s.requests["a"].status == RequestStatus.PREEMPTED
        full = len(a) // m.chunk
        e.run(lambda: e.s.requests["a"].status == RequestStatus.RUNNING and e.s.requests["a"].num_computed_tokens >= full * m.chunk,
              timeout=60, what="a resumed")
        assert _hit(e) >= full * m.chunk, f"kvd supplied {_hit(e)} tokens of {full * m.chunk}"
        assert e.check_kv("a", full * m.chunk) > 0
        e.run(lambda: e.finished("a"), timeout=60, what="a finishing")
        w = e.worker._worker.stats
        assert w["failed_loads"] == 0 and w["missing_chunks"] == 0 and w["loaded_chunks"] > 0, w
    finally:
        e.close()


@pytest.mark.parametrize("extra", ["a-chunk", "10-tokens"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_after_kvd_restarts_the_prefix_vllm_holds_comes_back_from_the_new_kvd(kvd_factory, model, extra, request):
    """kvd restarts while vLLM holds a's prefix, whose end is not on a chunk boundary (vLLM's
    own hit of b is a part of a chunk past a's whole ones). b extends a by a chunk, or by 10
    tokens (so b ends inside the chunk after vLLM's hit), and stores what vLLM still holds of it
    in the new kvd; once the prefix left vLLM's cache, c gets all of b's whole chunks from kvd,
    every byte checked."""
    if extra == "10-tokens" and model in ("gemma3", "gemma4"):
        # Issue 33 c, not possible through vLLM's connector API: vLLM's own hit of b ends at
        # 240 tokens (7.5 chunks), and at b's admission vLLM keeps only the window before 240
        # (tokens 177 on): chunk 7's window (tokens 161-223) has lost block 10 to vLLM's free
        # list before the connector sees b, and b computes only to 254, short of chunk 8. So no
        # entry the hit needs can be stored; it would take the cached block vLLM freed (not in
        # b's block table). DeepSeek-V4 (its window is a chunk's tail) and Qwen3-Next pass.
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=(
            "issue 33 c: a sliding window wider than a chunk's tail, vLLM's own hit ending mid-chunk "
            "and the request ending before the next chunk: nothing of the window can be stored")))
    m = MODELS[model]
    k = kvd_factory("--chunk-tokens", str(m.chunk))
    port = k.port
    e = m.engine(k.url)
    k2 = None
    try:
        k.stop()
        a = list(range(100, 100 + m.prompt))
        e.add("a", a)
        e.run(lambda: e.finished("a"), timeout=60, what="a served without kvd")
        w = e.worker._worker
        epoch = w._epoch
        k2 = Kvd(k.tmp, "--chunk-tokens", str(m.chunk), port=port)
        until(lambda: e.s.connector._sched.conn.client() is not None and w._epoch > epoch
              and all(r is not None for r in w.registrations), 10, "the connector registered with the new kvd")
        b = a + list(range(7000, 7000 + (m.chunk if extra == "a-chunk" else 10)))
        e.add("b", b)
        e.run(lambda: e.finished("b"), timeout=60, what="b finishing")
        e.run(lambda: not w.has_pending(), what="b's stores done")
        assert e.s.reset_prefix_cache()
        c = b + [5]
        before = _hit(e)
        full = len(b) // m.chunk
        e.add("c", c, max_tokens=3)
        e.run(_running_after_load(e, "c"), timeout=60, what="c running")
        assert _hit(e) - before == full * m.chunk, (
            f"the new kvd supplied {_hit(e) - before} of b's {full * m.chunk} tokens")
        assert w.stats["failed_loads"] == 0 and w.stats["missing_chunks"] == 0, w.stats
        assert e.check_kv("c", full * m.chunk) > 0
        e.run(lambda: e.finished("c"), timeout=60, what="c finishing")
    finally:
        e.close()
        if k2 is not None:
            k2.stop()


#: Models with sliding windows for the lagging-kvd test, on few blocks so that vLLM hands a's
#: freed window blocks to b at once: (model, blocks, a's tokens, b's tokens, a step's tokens).
LAGGING = {
    "deepseek-v4": ("deepseek-v4", 96, 5 * 256 + 20, 1000, 1024),
    "gemma3": ("gemma3", 120, 300, 100, 256),
    "gemma4": ("gemma4", 80, 300, 100, 256),
}


@pytest.mark.parametrize("case", sorted(LAGGING))
def test_kvd_stopped_while_a_sliding_window_request_prefills_costs_hits_never_bytes(kvd_factory, case):
    """kvd is stopped (SIGSTOP) from the store of a's first steps until after b, which vLLM gives
    a's freed window blocks, has computed: the connector's hold of b's forward gives up only
    past the stores' deadline (its reply timeout is short here, 1 s), and kvd, woken, copies
    none of them. A later request on a's prompt may lose hits; every byte it loads is a's."""
    name, blocks, n_a, n_b, step = LAGGING[case]
    m = MODELS[name]
    k = kvd_factory("--chunk-tokens", str(m.chunk))
    e = m.engine(k.url, max_batched=step, blocks=blocks)
    sched, w = e.s.connector._sched, e.worker._worker
    sched.config = dataclasses.replace(sched.config, lookup_timeout_s=0.0)
    w.config = dataclasses.replace(w.config, request_timeout_s=1.0)
    woken = threading.Event()
    try:
        save = w.save
        stopped: list[list[list[int]]] = []

        def stop_kvd_then_save(meta: Any) -> None:
            if not stopped and any(op.req_id == "a" for op in meta.stores):
                stopped.append(e._blocks("a"))
                k.sigstop()
                # Long enough for a hold that gives up after each reply timeout in turn (the
                # connector before the deadlines) to let b run first, on every model here.
                threading.Timer(w.config.store_deadline_s + 8,
                                lambda: (os.kill(k.proc.pid, signal.SIGCONT), woken.set())).start()
            save(meta)

        w.save = stop_kvd_then_save
        a = list(range(100, 100 + n_a))
        e.add("a", a)
        e.run(lambda: bool(stopped), what="a's first store")
        first = e.s.requests["a"].num_computed_tokens // m.chunk  # chunks a's first step stored
        e.add("b", list(range(5000, 5000 + n_b)))
        e.run(lambda: "b" in e.s.requests and e.s.requests["b"].num_computed_tokens > 0, timeout=30, what="b computed")
        assert not woken.is_set(), "b computed only after kvd woke: the race was not set up"
        sliding = [g for g, info in enumerate(sched.groups) if info.sliding]
        taken = {blk for g in sliding for blk in e._blocks("b")[g] if blk}
        # The chunks of a whose stored window blocks b now writes into.
        hit = sorted({c for g in sliding for c in range(first)
                      for blk in stopped[0][g][slice(*entry_blocks(sched, sched.groups[g], c))] if blk in taken})
        assert hit, "vLLM gave b none of a's stored window blocks: the race was not set up"
        woken.wait(30)
        e.run(lambda: e.finished("a") and e.finished("b"), timeout=60, what="a and b finishing")
        e.run(lambda: not w.has_pending(), timeout=30, what="stores done")
        sched.config = dataclasses.replace(sched.config, lookup_timeout_s=2.0)
        until(lambda: sched.conn.client() is not None and all(r is not None for r in w.registrations), 10,
              "the connector connected to kvd again")
        # A prompt whose hit would end at such a chunk, so that its window is one b wrote into.
        assert e.s.reset_prefix_cache()
        e.add("a2", a[: (hit[-1] + 1) * m.chunk + 1], max_tokens=3)
        e.run(_running_after_load(e, "a2"), timeout=60, what="a2 running")
        loaded = e.s.requests["a2"].num_computed_tokens
        assert w.stats["failed_loads"] == 0, w.stats
        assert e.check_kv("a2", loaded) > 0
        e.run(lambda: e.finished("a2"), timeout=60, what="a2 finishing")
    finally:
        os.kill(k.proc.pid, signal.SIGCONT)
        e.close()

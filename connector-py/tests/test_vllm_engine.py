"""The kvd connector inside vLLM's engine loop (vllm_engine.py: vLLM's real Scheduler, its own
model-runner connector plumbing, a real kvd), for vLLM 0.33 and 0.26 alike.

Run with ``scripts/vllm-conformance.sh`` (VLLM_VERSION=0.26.0 for the older release).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvd.testing import until  # noqa: E402
from vllm_engine import EOS, Engine, attention, vllm_config  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK, CHUNK = 16, 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def full_attention_engine(url: str, num_blocks: int, **extra) -> Engine:
    return Engine(vllm_config(url, BLOCK, CHUNK, **extra), {name: attention(BLOCK) for name in LAYERS}, num_blocks)


def test_a_full_cache_waits_for_delayed_frees_without_a_forward_pass(kvd):
    """vLLM 0.26 on the H200 livelocked here: a finished request's blocks stay held until kvd's
    stores of them are done (delayed free), and the next request needs those very blocks, so
    the steps that follow schedule nothing. vLLM then runs no forward pass and calls no
    wait_for_save, only start_load_kv and get_finished; the delayed frees must complete there."""
    e = full_attention_engine(kvd.url, num_blocks=24)  # 24 blocks: 384 tokens
    try:
        a = list(range(100, 400))  # 300 tokens: 19 blocks, 9 whole chunks
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing (its delayed free done)")
        assert e.s.connector._sched.stats["stored_chunks"] == 9

        # Two requests that each need 19 of the 24 blocks: the second can only run once the
        # first's blocks are freed, through steps that schedule nothing.
        b = list(range(1000, 1300))
        c = list(range(2000, 2300))
        e.add("b", b)
        e.add("c", c)
        e.run(lambda: e.finished("b") and e.finished("c"), what="b and c finishing")
        assert kvd.metric('kvd_store_chunks_total{outcome="stored"}') == 27, "a, b and c: 9 chunks each"

        # a again: vLLM's prefix cache lost it to b and c, kvd has it.
        e.add("a2", a, max_tokens=3)
        e.run(lambda: e.s.requests.get("a2") is not None and e.s.requests["a2"].status == RequestStatus.RUNNING
              and e.s.requests["a2"].num_computed_tokens >= 9 * CHUNK, what="a2 loaded from kvd")
        assert e.check_kv("a2", 9 * CHUNK) == 9 * CHUNK * len(LAYERS)
        assert e.s.connector._sched.stats["hit_tokens"] >= 9 * CHUNK
        e.run(lambda: e.finished("a2"), what="a2 finishing")
    finally:
        e.close()


def test_kvd_stopping_mid_run_never_stalls_the_engine(kvd_factory):
    """kvd is killed while requests run and stores are in flight: every request finishes, the
    delayed frees included, and later requests are served as misses."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    e = full_attention_engine(k.url, num_blocks=64)
    try:
        e.add("a", list(range(100, 400)), max_tokens=4)
        e.step()
        k.stop()
        e.add("b", list(range(500, 800)))
        e.run(lambda: e.finished("a") and e.finished("b"), timeout=20, what="a and b finishing without kvd")
    finally:
        e.close()


# ---------------------------------------------------------------------------------------------
# hybrid caches


def _spec_class(name: str):
    import vllm.v1.kv_cache_interface as kvi

    cls = getattr(kvi, name, None)
    if cls is None:
        pytest.skip(f"this vLLM has no {name}")
    return cls


def gemma3_specs(window: int = 64) -> dict:
    """Gemma-3's pattern: five sliding-window layers to one full-attention layer."""
    import torch

    swa = _spec_class("SlidingWindowSpec")
    specs = {}
    for i in range(6):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 6 == 5:
            specs[name] = attention(BLOCK)
        else:
            specs[name] = swa(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)
    return specs


def gemma3_engine(url: str, num_blocks: int, window: int = 64) -> Engine:
    return Engine(vllm_config(url, BLOCK, CHUNK), gemma3_specs(window), num_blocks)


def gemma4_engine(url: str, num_blocks: int, window: int = 64) -> Engine:
    """Gemma-4's pattern: five sliding-window layers to one full-attention layer whose heads are
    twice as wide (``global_head_dim`` 512 beside ``head_dim`` 256, vllm/models gemma4.py), so the
    two kinds of group have pages of two sizes."""
    import torch

    swa = _spec_class("SlidingWindowSpec")
    specs = {}
    for i in range(12):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 6 == 5:
            specs[name] = attention(BLOCK, head_size=128)
        else:
            specs[name] = swa(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=window)
    return Engine(vllm_config(url, BLOCK, CHUNK), specs, num_blocks)


def _loaded_from_kvd(e: Engine, req_id: str, tokens: int):
    return lambda: (e.s.requests.get(req_id) is not None and e.s.requests[req_id].status == RequestStatus.RUNNING
                    and e.s.requests[req_id].num_computed_tokens >= tokens)


def test_sliding_window_model_round_trips_only_the_window(kvd):
    e = gemma3_engine(kvd.url, num_blocks=256)
    try:
        kinds = [type(g.kv_cache_spec).__name__ for g in e.kvc.kv_cache_groups]
        sched = e.s.connector._sched
        # vLLM 0.26 turns the hybrid allocator off under a KV connector: one full-attention
        # group whose spec records the window, every block kept. 0.33 keeps the groups.
        hybrid = len(e.kvc.kv_cache_groups) > 1
        if hybrid:
            assert [g.sliding for g in sched.groups].count(True) >= 1, kinds
        else:
            assert getattr(e.kvc.kv_cache_groups[0].kv_cache_spec, "sliding_window", None) == 64, kinds
        a = list(range(100, 400))  # 300 tokens: 9 whole chunks, over two steps
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing")
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=3)
        e.run(_loaded_from_kvd(e, "a2", 9 * CHUNK), what="a2 loaded from kvd")
        assert e.worker._worker.stats["missing_chunks"] == 0 and e.worker._worker.stats["failed_loads"] == 0, (
            "the reported hit is loadable in every group")
        assert e.check_kv("a2", 9 * CHUNK) > 0
        blocks = e._blocks("a2")
        sliding = [g for g, info in enumerate(sched.groups) if info.sliding]
        assert all(0 in blocks[g][:9 * CHUNK // BLOCK] for g in sliding), "vLLM keeps only the window's blocks"
        assert bool(sliding) == hybrid
        e.run(lambda: e.finished("a2"), what="a2 finishing")
    finally:
        e.close()


def test_sliding_window_chunks_are_stored_late_only_from_blocks_vllm_holds(kvd_factory):
    """kvd restarts while vLLM still holds a prefix: the connector catches up on the chunks it
    could not store: every chunk in the full-attention group, and in each sliding-window group
    only the chunks of the window vLLM still holds (its earlier blocks are freed, maybe reused).
    That is all a hit needs there: the prefix then comes back whole from the new kvd."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    port = k.port
    e = gemma3_engine(k.url, num_blocks=256)
    try:
        k.stop()
        a = list(range(100, 400))
        e.add("a", a, max_tokens=40)
        e.run(lambda: e.s.requests["a"].num_computed_tokens >= 300, what="a's prompt computed without kvd")
        w = e.worker._worker
        epoch = w._epoch  # before the restart: the connector may register again at once
        k2 = _restart(k, port)
        until(lambda: e.s.connector._sched.conn.client() is not None and w._epoch > epoch
              and all(r is not None for r in w.registrations), 10, "the connector registered with the new kvd")
        assert "a" in e.s.requests, "a is still decoding"
        e.run(lambda: e.finished("a"), timeout=20, what="a finishing with kvd back")
        groups = e.s.connector._sched.groups
        full, sliding = sum(not g.sliding for g in groups), sum(g.sliding for g in groups)
        # The window (64 tokens) at a's decode position (~300 computed) holds the blocks of
        # tokens 237 onwards: chunks 7 and 8 of the prompt are whole in it.
        assert k2.metric('kvd_store_chunks_total{outcome="stored"}') == 9 * full + 2 * sliding, (
            "every chunk late in the full-attention group, the window's two in each sliding group")
        e.add("b", a, max_tokens=1)  # vLLM's prefix cache holds a: no load expected, only a check
        e.run(lambda: e.finished("b"), what="b finishing")
        assert e.s.reset_prefix_cache()
        before = e.s.connector._sched.stats["hit_tokens"]
        e.add("a2", a, max_tokens=2)
        e.run(_loaded_from_kvd(e, "a2", 9 * CHUNK), what="a2 loaded from the new kvd")
        assert e.s.connector._sched.stats["hit_tokens"] - before == 9 * CHUNK, "the whole prefix came from kvd"
        assert e.worker._worker.stats["failed_loads"] == 0 and e.worker._worker.stats["missing_chunks"] == 0
        assert e.check_kv("a2", 9 * CHUNK) > 0
        e.run(lambda: e.finished("a2"), what="a2 finishing")
        k2.stop()
    finally:
        e.close()


def _restart(k, port):
    from conftest import Kvd

    return Kvd(k.tmp, "--chunk-tokens", str(CHUNK), port=port)


def test_an_unsupported_model_serves_without_kvd_and_says_so_once(kvd, caplog):
    """Llama-4's chunked local attention beside full attention: kvd does not key that group,
    so the connector is off from the start, with one line, and vLLM serves every request."""
    import torch

    local = _spec_class("ChunkedLocalAttentionSpec")
    specs = {f"model.layers.{i}.self_attn.attn": attention(BLOCK) for i in range(0, 4, 3)}
    for i in (1, 2):
        specs[f"model.layers.{i}.self_attn.attn"] = local(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                                           dtype=torch.bfloat16, attention_chunk_size=64)
    with caplog.at_level("ERROR", logger="kvd"):
        try:
            e = Engine(vllm_config(kvd.url, BLOCK, CHUNK), specs, 256)
        except Exception as ex:  # vLLM itself may refuse this made-up shape on CPU
            pytest.skip(f"vLLM's planner refused the chunked-local specs: {ex}")
    try:
        if len(e.kvc.kv_cache_groups) < 2:
            pytest.skip("this vLLM folds chunked local attention into one full-attention group")
        lines = [r.getMessage() for r in caplog.records if "offloading is off" in r.getMessage()]
        assert len(lines) == 1 and "ChunkedLocalAttentionSpec" in lines[0], lines
        e.add("a", list(range(100, 400)))
        e.run(lambda: e.finished("a"), what="a served without kvd")
        assert kvd.metric('kvd_store_chunks_total{outcome="stored"}') == 0
    finally:
        e.close()


def mamba_hybrid_engine(url: str, num_blocks: int, **extra) -> Engine:
    """Qwen3-Next's pattern: three linear-attention (Mamba-style state) layers to one full
    attention layer, with vLLM's prefix caching for state groups on (``mamba_cache_mode``
    "align": the state after each step that ends on a block boundary is kept in that block)."""
    import torch

    mamba = _spec_class("MambaSpec")
    specs = {}
    for i in range(8):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = attention(BLOCK)
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba(block_size=BLOCK, shapes=((4, 64), (2, 64)),
                                                          dtypes=(torch.bfloat16, torch.bfloat16),
                                                          mamba_cache_mode="align")
    vc = vllm_config(url, BLOCK, CHUNK, **extra)
    vc.cache_config.mamba_cache_mode = "align"
    try:
        e = Engine(vc, specs, num_blocks)
    except (AssertionError, ValueError, NotImplementedError) as ex:
        pytest.fail(f"vLLM's planner refused the Mamba-hybrid specs on CPU: {ex!r}")
    if len(e.kvc.kv_cache_groups) < 2:
        e.close()
        pytest.skip("this vLLM runs Mamba hybrids with one KV cache group under a connector")
    return e


def test_mamba_hybrid_round_trips_its_states_and_attention(kvd):
    """A state group's chunk is the state at the chunk's end, stored when a step ends there; a
    later request starts from the state kvd loads (checked byte for byte by the stand-in
    forward, as vLLM's kernels would read it) beside the attention chunks before it."""
    e = mamba_hybrid_engine(kvd.url, num_blocks=256)
    try:
        sched = e.s.connector._sched
        assert e.s.connector.disabled is None, e.s.connector.disabled
        assert [g.state for g in sched.groups].count(True) >= 1
        a = list(range(100, 400))  # 300 tokens: vLLM ends steps at 256 and 288 (block boundaries)
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing")
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=3)
        e.run(_loaded_from_kvd(e, "a2", 9 * CHUNK), what="a2 loaded from kvd")
        w = e.worker._worker.stats
        assert w["missing_chunks"] == 0 and w["failed_loads"] == 0, w
        assert ("a2", 9 * CHUNK) in e.resumed_states, "a2 started from the state kvd loaded"
        assert e.check_kv("a2", 9 * CHUNK) > 0
        e.run(lambda: e.finished("a2"), what="a2 finishing")
        # The next turn of the conversation: the prompt grows; kvd serves the state at 288.
        assert e.s.reset_prefix_cache()
        b = a + list(range(7000, 7100))
        loaded = e.worker._worker.stats["loaded_chunks"]
        e.add("b", b)
        e.run(lambda: e.finished("b"), what="b finishing")
        assert ("b", 9 * CHUNK) in e.resumed_states, "b started from the state kvd loaded"
        assert e.worker._worker.stats["loaded_chunks"] > loaded and e.worker._worker.stats["failed_loads"] == 0
    finally:
        e.close()


def test_a_preempted_mamba_hybrid_request_resumes_from_kvd(kvd):
    """vLLM preempts a running request and empties its prefix cache; the request resumes from
    kvd's attention chunks and state, and the stand-in forward checks the state it resumes from."""
    e = mamba_hybrid_engine(kvd.url, num_blocks=256)
    try:
        a = list(range(100, 400))
        e.add("a", a, max_tokens=30)
        e.run(lambda: e.s.requests["a"].num_computed_tokens >= 305, what="a decoding")
        until(lambda: kvd.metric('kvd_store_chunks_total{outcome="stored"}') > 0, 5, "a's chunks stored")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache(reset_running_requests=True)
        assert e.s.requests["a"].status == RequestStatus.PREEMPTED
        e.run(lambda: e.finished("a"), what="a resumed and finished")
        assert any(r == "a" for r, _ in e.resumed_states), "a resumed from a state"
        w = e.worker._worker.stats
        assert w["failed_loads"] == 0 and w["loaded_chunks"] > 0, w
    finally:
        e.close()


def test_mamba_state_of_a_local_prefix_is_stored_after_kvd_restarts(kvd_factory):
    """kvd restarts while vLLM holds a's prefix (and its state) in its own cache: the next
    request starting from that prefix stores the state vLLM hit, so kvd can serve it later."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    port = k.port
    e = mamba_hybrid_engine(k.url, num_blocks=256)
    try:
        k.stop()
        a = list(range(100, 400))
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a served without kvd")
        w = e.worker._worker
        epoch = w._epoch  # before the restart: the connector may register again at once
        k2 = _restart(k, port)
        until(lambda: e.s.connector._sched.conn.client() is not None and w._epoch > epoch
              and all(r is not None for r in w.registrations), 10, "the connector registered with the new kvd")
        b = a + list(range(7000, 7040))
        e.add("b", b)  # vLLM's own cache holds a's first 288 tokens and the state there
        e.run(lambda: e.finished("b"), what="b finishing")
        assert ("b", 9 * CHUNK) in e.resumed_states, "b started from vLLM's local state"
        assert e.s.reset_prefix_cache()
        e.add("c", a + list(range(8000, 8040)))
        e.run(_loaded_from_kvd(e, "c", 9 * CHUNK), what="c loaded from the restarted kvd")
        assert ("c", 9 * CHUNK) in e.resumed_states
        assert e.worker._worker.stats["failed_loads"] == 0
        e.run(lambda: e.finished("c"), what="c finishing")
        k2.stop()
    finally:
        e.close()


def test_a_failed_load_of_a_hybrid_model_is_recomputed_not_a_crash(kvd_factory, caplog):
    """kvd dies between the lookup and the load of a Gemma-3-style model (several KV cache
    groups). vLLM 0.33 refuses block-level load errors for such models (RuntimeError), so the
    connector reports the failed request instead; vLLM recomputes it, and asks kvd no more.
    vLLM 0.26 can be told nothing for such a model (it crashes on block ids of several
    groups): there the connector says so in an ERROR line and vLLM serves on."""
    from kvd.vllm import KVConnectorTransferResults

    k = kvd_factory("--chunk-tokens", str(CHUNK))
    e = gemma3_engine(k.url, num_blocks=256)
    try:
        a = list(range(100, 400))
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache()
        w = e.worker._worker
        start_load = w.start_load

        def kill_kvd_then_load(meta):
            if meta.loads and k.proc.poll() is None:
                k.stop()
            start_load(meta)

        w.start_load = kill_kvd_then_load
        e.add("a2", a, max_tokens=3)
        with caplog.at_level("ERROR", logger="kvd"):
            e.run(lambda: e.finished("a2"), timeout=30, what="a2 recomputed and finished")
        assert w.stats["failed_loads"] >= 1 and w.stats["loaded_chunks"] == 0, w.stats
        told = [r for r in caplog.records if "cannot be told" in r.getMessage()]
        assert bool(told) == (KVConnectorTransferResults is None), told
        st = e.s.connector._sched._reqs.get("a2")
        assert st is None or st.failed_from is None, "the one miss a failure earns was spent"
    finally:
        e.close()


def test_gemma4_style_model_with_two_page_sizes_round_trips(kvd):
    """The two kinds of group differ in page size (and vLLM may give them different block
    sizes to even the pages out): both keys must agree between scheduler and workers, or
    nothing would ever hit (472 chunks stored and 0 loaded, before)."""
    e = gemma4_engine(kvd.url, num_blocks=256)
    try:
        kinds = [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes)
                 for g in e.kvc.kv_cache_groups]
        assert e.s.connector.disabled is None, e.s.connector.disabled
        a = list(range(100, 400))
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing")
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=3)
        e.run(_loaded_from_kvd(e, "a2", 9 * CHUNK), what=f"a2 loaded from kvd (groups {kinds})")
        w = e.worker._worker.stats
        assert w["missing_chunks"] == 0 and w["failed_loads"] == 0 and w["loaded_chunks"] > 0, w
        assert e.check_kv("a2", 9 * CHUNK) > 0
        e.run(lambda: e.finished("a2"), what="a2 finishing")
    finally:
        e.close()


def test_a_preempted_sliding_window_request_resumes_from_kvd(kvd):
    """Gemma-3: vLLM preempts a running request and empties its prefix cache; it resumes from
    kvd with the window's blocks (checked byte for byte) and finishes."""
    e = gemma3_engine(kvd.url, num_blocks=256)
    try:
        a = list(range(100, 400))
        e.add("a", a, max_tokens=30)
        e.run(lambda: e.s.requests["a"].num_computed_tokens >= 305, what="a decoding")
        e.run(lambda: not e.worker._worker.has_pending(), what="a's stores done")
        assert e.s.reset_prefix_cache(reset_running_requests=True)
        assert e.s.requests["a"].status == RequestStatus.PREEMPTED
        e.run(_loaded_from_kvd(e, "a", 9 * CHUNK), what="a resumed from kvd")
        assert e.check_kv("a", 9 * CHUNK) > 0
        e.run(lambda: e.finished("a"), what="a finishing")
        w = e.worker._worker.stats
        assert w["failed_loads"] == 0 and w["loaded_chunks"] > 0, w
    finally:
        e.close()


@pytest.mark.parametrize("mode", ["async", "auto"])
def test_kvd_stopped_with_loads_in_flight_and_a_request_parked_never_wedges_vllm(kvd_factory, mode):
    """vLLM's scheduler can stall at "Running: 0, Waiting: N" when a request parked by a
    connector's "ask again" holds no blocks while asynchronous loads queued behind it hold the
    blocks it needs (vllm-project/vllm#57841, #57104, #53868). Here the GPU blocks are nearly
    all taken, two requests' loads are in flight, and kvd stops (SIGSTOP) as they are submitted,
    so their loads do not finish and a third request's lookup is not answered (it is parked,
    asked again each step). No request may wait on kvd without bound: the lookup is answered
    as a miss after ``lookup_timeout_s``, the loads fail after their deadline (kvd can then no
    longer write the blocks) and are recomputed, and every request finishes, kvd still stopped.
    Loaded synchronously (``auto``), the loads hold their step's forward until their deadline
    instead, and the same holds."""
    import os
    import signal
    import time

    k = kvd_factory("--chunk-tokens", str(CHUNK))
    # (The presence filter off: it would answer d, a prompt kvd never saw, without kvd.)
    e = Engine(vllm_config(k.url, BLOCK, CHUNK, **{"kvd.request_timeout_s": 2.0, "kvd.lookup_timeout_s": 1.0,
                                                    "kvd.load_mode": mode, "kvd.presence": False}),
               {name: attention(BLOCK) for name in LAYERS}, num_blocks=48)
    w = e.worker._worker
    prompts = {r: list(range(1000 * (i + 1), 1000 * (i + 1) + 300)) for i, r in enumerate("ab")}
    try:
        for r, p in prompts.items():
            e.add(r, p)
        e.run(lambda: all(e.finished(r) for r in prompts), what="a and b stored")
        e.run(lambda: not w.has_pending(), what="their stores done")
        assert e.s.reset_prefix_cache()
        start_load = w.start_load

        def stop_kvd_then_load(meta):
            if meta.loads and not stopped:
                stopped.append(time.monotonic())
                k.sigstop()
            start_load(meta)

        stopped: list[float] = []
        w.start_load = stop_kvd_then_load
        matched = e.s.connector.get_num_new_matched_tokens
        asked_again: list[str] = []

        unready: list[str] = []

        def record(request, computed):
            got = matched(request, computed)
            if got[0] is None:
                asked_again.append(request.request_id)
            elif not e.s.connector._sched.workers_ready:
                unready.append(request.request_id)
            return got

        e.s.connector.get_num_new_matched_tokens = record
        for r, p in prompts.items():
            e.add(r + "2", p, max_tokens=4)
        e.run(lambda: bool(stopped), what="the loads submitted")
        e.add("d", list(range(9000, 9300)), max_tokens=4)  # its lookup meets a stopped kvd
        e.run(lambda: all(e.finished(r) for r in ("a2", "b2", "d")), timeout=60,
              what="every request finishing while kvd is stopped")
        took = time.monotonic() - stopped[0]
        # Asynchronous loads: d's lookup meets the stopped kvd and is parked. Synchronous ones
        # held the step until their deadline, and the worker dropped its connection then: the
        # scheduler, told so, answers d as a miss without asking kvd.
        if mode == "async":
            assert "d" in asked_again, "d was never parked: the scenario was not set up"
        else:
            assert "d" in asked_again or "d" in unready, "d met neither a stopped kvd nor a worker without it"
        assert w.stats["failed_loads"] >= 1, w.stats
        print(f"every request finished {took:.1f} s after kvd stopped; d asked again {asked_again.count('d')} times; "
              f"failed loads {w.stats['failed_loads']}")
        # Bounded by the loads' deadline (request_timeout_s) and grace, not by kvd coming back.
        assert took < 2.0 + 1.0 + 10, f"{took:.1f} s"
    finally:
        os.kill(k.proc.pid, signal.SIGCONT)
        e.close()


def _stored_in_kvd_only(e: Engine, tokens: list[int], req_id: str = "a") -> None:
    """Runs a request to its end, waits for its stores, and empties vLLM's prefix cache: the
    prefix is then kvd's alone."""
    e.add(req_id, tokens)
    e.run(lambda: e.finished(req_id), what=f"{req_id} finishing")
    e.run(lambda: not e.worker._worker.has_pending(), what=f"{req_id}'s stores done")
    assert e.s.reset_prefix_cache()


# ---------------------------------------------------------------------------------------------
# failed loads


def test_a_load_that_fails_every_time_is_one_miss_not_a_loop(kvd_factory):
    """Every load fails here, the same way each time: its deadline (``load_timeout_s``, a
    microsecond) has passed when kvd's copy thread reaches it, so kvd copies nothing and answers
    Expired, while every lookup still finds the prefix. With ``kv_load_failure_policy=
    recompute`` vLLM recomputes what failed and asks the connector again; answering that lookup
    with the same hit looped the request between lookup and failed load for ever
    (vllm-project/vllm#55297). The request's next lookup is a miss for the failed part, once:
    one failed load, one expired copy in kvd, and the request finishes."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    e = Engine(vllm_config(k.url, BLOCK, CHUNK, **{"kvd.load_timeout_s": 1e-6}),
               {name: attention(BLOCK) for name in LAYERS}, num_blocks=64)
    w = e.worker._worker
    try:
        a = list(range(100, 400))
        _stored_in_kvd_only(e, a)
        e.add("b", a, max_tokens=3)
        e.run(lambda: e.finished("b"), timeout=20, what="b recomputed and finished")
        assert w.stats["failed_loads"] == 1 and w.stats["loaded_chunks"] == 0, w.stats
        assert k.metric('kvd_copies_expired_total{direction="h2d"}') == 1
        assert e.s.connector._sched.stats["hit_tokens"] == 9 * CHUNK, "one hit offered, not one per lap"
    finally:
        e.close()


@pytest.mark.parametrize("model", ["full-attention", "gemma3"])
def test_a_failed_load_costs_one_miss_and_the_request_hits_again_later(kvd_factory, model):
    """kvd is stopped while a request's load is in flight and wakes after the load's deadline:
    the load fails (kvd copies nothing after the deadline) and vLLM recomputes the request.
    That failure is a miss once, not for the request's life: preempted later (vLLM emptying
    its prefix cache), the request resumes from kvd, every loaded byte checked. Gemma-3's
    groups are reported to vLLM >= 0.33 as a failed request (vLLM refuses block ids of
    several groups)."""
    import signal
    import threading

    from kvd.vllm import KVConnectorTransferResults

    if model == "gemma3" and KVConnectorTransferResults is None:
        pytest.skip("vLLM < 0.33 cannot be told of a failed load of a model of several KV cache groups")
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    extra = {"kvd.load_timeout_s": 0.5, "kvd.store_deadline_s": 10.0}
    specs = ({name: attention(BLOCK) for name in LAYERS} if model == "full-attention"
             else gemma3_specs())
    e = Engine(vllm_config(k.url, BLOCK, CHUNK, **extra), specs, num_blocks=256)
    w = e.worker._worker
    try:
        a = list(range(100, 400))
        _stored_in_kvd_only(e, a)
        start_load = w.start_load
        woken = threading.Event()

        def stop_kvd_then_load(meta):
            if meta.loads and not woken.is_set() and not stopped:
                stopped.append(True)
                k.sigstop()
                threading.Timer(2.0, lambda: (k.proc.send_signal(signal.SIGCONT), woken.set())).start()
            start_load(meta)

        stopped: list[bool] = []
        w.start_load = stop_kvd_then_load
        e.add("b", a, max_tokens=40)
        e.run(lambda: w.stats["failed_loads"] == 1, timeout=20, what="b's load failing")
        e.run(lambda: e.s.requests["b"].num_computed_tokens >= len(a) + 2, timeout=20, what="b recomputed, decoding")
        assert w.stats["loaded_chunks"] == 0, w.stats
        assert woken.wait(10)
        # The worker dropped its connection at the timeout; it is back once it has registered,
        # and the scheduler offers hits again once a step's worker metadata has said so.
        e.run(lambda: w.conn.client() is not None and all(r is not None for r in w.registrations)
              and e.s.connector._sched.workers_ready, what="the worker connected again")
        e.run(lambda: not w.has_pending(), what="b's stores done")
        assert e.s.reset_prefix_cache(reset_running_requests=True)
        assert e.s.requests["b"].status == RequestStatus.PREEMPTED
        e.run(_loaded_from_kvd(e, "b", 9 * CHUNK), what="b resumed from kvd")
        assert w.stats["loaded_chunks"] > 0 and w.stats["failed_loads"] == 1, w.stats
        assert e.check_kv("b", 9 * CHUNK) > 0
        e.run(lambda: e.finished("b"), what="b finishing")
    finally:
        k.proc.send_signal(signal.SIGCONT)
        e.close()


# ---------------------------------------------------------------------------------------------
# synchronous loads


#: For tests that count steps: how long vLLM's scheduler waits for kvd's lookup answer before
#: asking again in a later step, which would add steps that are the CI machine's load, not the
#: load path's.
LOOKUP_WAIT_S = 5.0


def _steps_to_first_token(e: Engine, req_id: str, tokens: list[int]) -> int:
    e.add(req_id, tokens, max_tokens=2)
    for n in range(1, 200):
        e.step()
        r = e.s.requests.get(req_id)
        if r is None or r.num_output_tokens >= 1:
            return n
    raise AssertionError(f"{req_id} had no token after 200 steps")


@pytest.mark.parametrize("mode", ["auto", "async"])
def test_a_kvd_hit_costs_no_engine_step_over_a_gpu_hit(kvd_factory, mode):
    """A request whose prefix vLLM's GPU cache holds is computed in the step that schedules it.
    With an asynchronous load a kvd hit first parks the request until the copy is done and is
    computed a step later at best (on the H200 that step cost ~26 ms of TTFT beyond the copy);
    loaded synchronously (``load_mode`` auto, one KV cache group) it is computed in the step
    that loads it, the forward ordered after kvd's copy, every loaded byte checked."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    # Steps are counted: the scheduler waits for kvd's answer (~0.1 ms idle, several ms on a
    # loaded 2-core CI machine) rather than asking again a step later after 2 ms, the default.
    e = Engine(vllm_config(k.url, BLOCK, CHUNK, **{"kvd.load_mode": mode, "kvd.lookup_wait_s": LOOKUP_WAIT_S}),
               {name: attention(BLOCK) for name in LAYERS}, num_blocks=256)
    w = e.worker._worker
    try:
        a = list(range(100, 400))
        e.add("a", a)
        e.run(lambda: e.finished("a"), what="a finishing")
        e.run(lambda: not w.has_pending(), what="a's stores done")
        gpu = _steps_to_first_token(e, "b", a + list(range(5000, 5040)))
        e.run(lambda: e.finished("b") and not w.has_pending(), what="b finishing")
        assert e.s.reset_prefix_cache()
        c = a + list(range(6000, 6040))
        e.add("c", c, max_tokens=2)
        steps, loaded = 0, 0
        while e.s.requests["c"].num_output_tokens < 1:
            e.step()
            steps += 1
            r = e.s.requests["c"]
            if r.status == RequestStatus.RUNNING and r.num_computed_tokens >= 9 * CHUNK and not loaded:
                loaded = e.check_kv("c", 9 * CHUNK)
            assert steps < 200
        assert loaded == 9 * CHUNK * len(LAYERS), "every token kvd loaded, checked"
        assert w.stats["loaded_chunks"] == 9 and w.stats["failed_loads"] == 0, w.stats
        assert gpu == 1
        if mode == "auto":
            assert steps == gpu, f"kvd hit: {steps} steps to the first token, GPU hit: {gpu}; {e.s.connector._sched.stats}"
        else:
            assert steps > gpu, "the asynchronous load parks the request for at least a step"
    finally:
        e.close()


def test_a_burst_of_hits_loads_synchronously_only_within_the_steps_budget(kvd_factory):
    """Three requests kvd holds arrive together (a restarted engine's conversations coming back).
    A synchronous load holds the whole step's forward for its copy, so with ``load_mode`` auto
    only the hits within ``sync_load_tokens`` load in the step that computes them; the others
    are parked (WAITING_FOR_REMOTE_KVS) and join the batch as their own copies are done. Every
    loaded byte is checked; budget 0 loads everything asynchronously, no budget (the default)
    everything synchronously."""
    prefixes = {r: list(range(1000 * i, 1000 * i + 300)) for i, r in enumerate("abc", start=1)}  # 9 chunks each
    for budget, sync in ((9 * CHUNK, {"a"}), (0, set()), (None, set(prefixes))):
        k = kvd_factory("--chunk-tokens", str(CHUNK))
        extra = {"kvd.lookup_wait_s": LOOKUP_WAIT_S} | ({} if budget is None else {"kvd.sync_load_tokens": budget})
        e = Engine(vllm_config(k.url, BLOCK, CHUNK, **extra),
                   {name: attention(BLOCK) for name in LAYERS}, num_blocks=256)
        w = e.worker._worker
        try:
            for r, p in prefixes.items():
                e.add(f"{r}0", p)
            e.run(lambda: all(e.finished(f"{r}0") for r in prefixes) and not w.has_pending(), what="the prefixes stored")
            assert e.s.reset_prefix_cache()
            for r, p in prefixes.items():
                e.add(r, p + list(range(7000, 7040)), max_tokens=2)
            e.step()
            status = {r: e.s.requests[r].status for r in prefixes}
            assert {r for r, st in status.items() if st == RequestStatus.RUNNING} == sync, status
            assert all(st == RequestStatus.WAITING_FOR_REMOTE_KVS for r, st in status.items() if r not in sync), status
            checked = {r: e.check_kv(r, 9 * CHUNK) for r in sync}
            while len(checked) < len(prefixes):
                e.step()
                for r in set(prefixes) - set(checked):
                    q = e.s.requests[r]
                    if q.status == RequestStatus.RUNNING and q.num_computed_tokens >= 9 * CHUNK:
                        checked[r] = e.check_kv(r, 9 * CHUNK)
            assert checked == dict.fromkeys(prefixes, 9 * CHUNK * len(LAYERS)), "every token kvd loaded, checked"
            e.run(lambda: all(e.finished(r) for r in prefixes), what="the three finishing")
            assert w.stats["loaded_chunks"] == 27 and w.stats["failed_loads"] == 0, w.stats
        finally:
            e.close()


def test_engines_configured_with_other_layouts_share_one_kvd_but_no_keys(kvd):
    """Engines of one node upgraded one at a time may ask vLLM for different KV layouts (on
    vLLM 0.26 the default ``kvd.layout`` went from BLNHC to vLLM's own): their pages hold the
    same bytes in other orders, so their keys must differ, or kvd would refuse the second
    engine's registration (a fingerprint registered again with another layout) and leave it
    without offloading. vLLM 0.33 resolves each engine's layout by name (its allocator's views,
    here); on vLLM 0.26 BLNHC is the cross-layer buffer its GPU model runner allocates, which
    this harness does not: there the keys must differ all the same."""
    specs = {name: attention(BLOCK) for name in LAYERS}
    a = Engine(vllm_config(kvd.url, BLOCK, CHUNK, **{"kvd.layout": "BLNHC"}), specs, num_blocks=256)
    b = Engine(vllm_config(kvd.url, BLOCK, CHUNK, **{"kvd.layout": "none"}), specs, num_blocks=256)
    wa, wb = a.worker._worker, b.worker._worker
    try:
        assert wa.groups[0].fingerprint != wb.groups[0].fingerprint
        p = list(range(100, 400))  # 300 tokens: 9 whole chunks and 12 tokens
        for e, w, name in ((a, wa, "a"), (b, wb, "b")):
            e.add(name, p)
            e.run(lambda: e.finished(name) and not w.has_pending(), what=f"{name} stored")
        assert kvd.metric('kvd_store_chunks_total{outcome="stored"}') == 18, "9 chunks under each engine's keys"
        assert b.s.connector._sched.stats["hit_tokens"] == 0, "b found nothing of a's under its keys"
        for e, w, name in ((a, wa, "a2"), (b, wb, "b2")):
            assert e.s.reset_prefix_cache()
            e.add(name, p + list(range(5000, 5040)), max_tokens=2)
            e.run(lambda: e.s.requests[name].num_computed_tokens >= 9 * CHUNK, what=f"{name} loaded from kvd")
            assert e.check_kv(name, 9 * CHUNK) == 9 * CHUNK * len(LAYERS), "every loaded byte its own engine's"
            assert w.stats["loaded_chunks"] == 9 and w.stats["failed_loads"] == 0, w.stats
            e.run(lambda: e.finished(name), what=f"{name} finishing")
    finally:
        a.close()
        b.close()


def test_no_hit_is_offered_while_a_worker_cannot_load(kvd_factory):
    """A worker connected to kvd but without its registrations (kvd restarted and has not taken
    them back yet, e.g. while it populates its pool; here vLLM's sleep-mode unregister) would
    fail every load, and vLLM would recompute the request a step later. The workers say so in
    their step metadata, and the scheduler offers no hit until they can load again; then the
    same prefix comes from kvd, every loaded byte checked."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    e = Engine(vllm_config(k.url, BLOCK, CHUNK), {name: attention(BLOCK) for name in LAYERS}, num_blocks=256)
    w, sched = e.worker._worker, e.s.connector._sched
    try:
        a = list(range(100, 400))
        e.add("a", a)
        e.run(lambda: e.finished("a") and not w.has_pending(), what="a stored")
        e.worker.unregister_kv_caches()
        e.step()  # the step's worker metadata tells the scheduler
        assert not w.ready() and not sched.workers_ready
        assert e.s.reset_prefix_cache()
        hits = sched.stats["hit_tokens"]
        e.add("b", a + list(range(5000, 5040)), max_tokens=2)
        e.run(lambda: e.finished("b"), what="b computed without kvd")
        assert sched.stats["hit_tokens"] == hits, "no hit offered"
        assert w.stats["failed_loads"] == 0, "so no load failed"

        # The workers can load again while the engine is idle (vLLM takes no step without
        # work, so no step metadata says so): the next request waits one step for their word,
        # then loads.
        e.worker.restore_kv_caches()
        assert w.ready() and not sched.workers_ready
        assert e.s.reset_prefix_cache()
        time.sleep(0.3)
        c = a + list(range(6000, 6040))
        e.add("c", c, max_tokens=2)
        e.run(lambda: e.s.requests["c"].status == RequestStatus.RUNNING and e.s.requests["c"].num_computed_tokens >= 9 * CHUNK,
              what="c loaded from kvd")
        assert e.check_kv("c", 9 * CHUNK) == 9 * CHUNK * len(LAYERS)
        assert sched.stats["hit_tokens"] == hits + 9 * CHUNK and sched.workers_ready
        assert w.stats["failed_loads"] == 0, w.stats
        e.run(lambda: e.finished("c"), what="c finishing")
    finally:
        e.close()


def test_kvd_stopped_during_a_synchronous_load_holds_the_step_briefly_and_vllm_recomputes(kvd_factory):
    """kvd stops (SIGSTOP) as a synchronous load is sent: the step's forward waits for kvd's
    answer only until the load's deadline (``sync_load_timeout_s``) and the grace after it, kvd
    starts no copy after the deadline, the blocks are reported failed, and vLLM recomputes them
    in the running request; its bytes are then the computed ones."""
    import signal
    import time

    from kvd.worker import COPY_GRACE_S

    k = kvd_factory("--chunk-tokens", str(CHUNK))
    e = Engine(vllm_config(k.url, BLOCK, CHUNK, **{"kvd.sync_load_timeout_s": 0.2}),
               {name: attention(BLOCK) for name in LAYERS}, num_blocks=256)
    w = e.worker._worker
    try:
        a = list(range(100, 400))
        _stored_in_kvd_only(e, a)
        start_load = w.start_load
        held: list[float] = []

        def stop_kvd_then_load(meta):
            if meta.loads and not held:
                assert all(op.sync for op in meta.loads)
                k.sigstop()
                t = time.monotonic()
                start_load(meta)
                held.append(time.monotonic() - t)
                return
            start_load(meta)

        w.start_load = stop_kvd_then_load
        e.add("b", a + list(range(7000, 7030)), max_tokens=4)
        e.run(lambda: bool(held), what="b's load")
        k.proc.send_signal(signal.SIGCONT)
        assert 0.2 <= held[0] <= 0.2 + COPY_GRACE_S + 1.0, f"the forward was held {held[0]:.2f} s"
        assert w.stats["failed_loads"] == 1 and w.stats["loaded_chunks"] == 0, w.stats
        e.run(lambda: e.s.requests["b"].num_computed_tokens >= 330, what="b recomputed")
        assert e.check_kv("b", 330) == 330 * len(LAYERS), "the recomputed bytes, not a stale load"
        assert k.metric('kvd_copies_expired_total{direction="h2d"}') == 1, "kvd, woken, copied nothing"
        e.run(lambda: e.finished("b"), what="b finishing")
    finally:
        k.proc.send_signal(signal.SIGCONT)
        e.close()


def test_a_replacement_warmed_from_kvd_serves_the_next_turn_from_its_gpu_cache(kvd_factory):
    """A rolling restart with a warm (``kvd.warm_group``, ``python -m kvd.warm``). Engine A, the
    replica "replica-0", serves a conversation's turn; kvd remembers the prompt (not a prompt
    shorter than a chunk, which kvd could hold nothing of, nor one aborted before its prefill).
    A stops; its replacement B, the same replica, is warmed before traffic: the prompts kvd
    recalls go to B as the warm tool's HTTP bodies become requests in vLLM's server
    (``CompletionRequest.to_sampling_params``), and each loads from kvd, every byte checked;
    B does not remember them again. The conversation's next turn then finds its prefix in B's
    GPU prefix cache: computed in the step that schedules it, with no kvd hit and no load."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from kvd.warm import completion_body, recall

    k = kvd_factory("--chunk-tokens", str(CHUNK))
    extra = {"kvd.warm_group": "replica-0", "kvd.lookup_wait_s": LOOKUP_WAIT_S}
    turn1 = list(range(100, 400))  # 300 tokens: 9 whole chunks and 12 more
    a = full_attention_engine(k.url, 256, **extra)
    try:
        a.add("t1", turn1, max_tokens=3)
        a.add("short", list(range(7000, 7020)))
        a.add("gone", list(range(5000, 5400)))
        a.s.finish_requests("gone", RequestStatus.FINISHED_ABORTED)  # before any step: nothing computed
        a.run(lambda: a.finished("t1") and a.finished("short") and not a.worker._worker.has_pending(),
              what="turn 1 finishing, its stores done")
    finally:
        a.close()
    prompts = until(lambda: recall(k.url, "replica-0") or None)
    assert [(p.tokens, p.salt) for p in prompts] == [(turn1, "")]

    b = full_attention_engine(k.url, 256, **extra)
    w = b.worker._worker
    try:
        for i, p in enumerate(prompts):
            # Two tokens (--output-tokens 2) keep the request running a step after its load, so
            # that its blocks can be read here.
            body = CompletionRequest.model_validate(completion_body("llama", p, 2))
            # vLLM's server passes the max_tokens it resolved (the body's, within the model's length).
            assert body.max_tokens == 2
            b.add(f"warm{i}", p.tokens, sp=body.to_sampling_params(max_tokens=body.max_tokens))
        loaded = 0

        def warm_loaded() -> bool:
            nonlocal loaded
            r = b.s.requests.get("warm0")
            if r is not None and r.status == RequestStatus.RUNNING and r.num_computed_tokens >= 9 * CHUNK and not loaded:
                loaded = b.check_kv("warm0", 9 * CHUNK)
            return b.finished("warm0") and not w.has_pending()

        b.run(warm_loaded, what="the warm request finishing")
        assert loaded == 9 * CHUNK * len(LAYERS), "every token the warm loaded from kvd, checked"
        assert w.stats["loaded_chunks"] == 9 and w.stats["failed_loads"] == 0, w.stats
        sched = b.s.connector._sched
        assert sched.stats["remembered"] == 0 and not sched._remembering, "the warm's replay is not remembered again"
        hits = sched.stats["hit_tokens"]

        turn2 = turn1 + list(range(9000, 9050))
        assert _steps_to_first_token(b, "t2", turn2) == 1, "the next turn is a GPU hit: no step waits for a load"
        assert b.check_kv("t2", 9 * CHUNK) == 9 * CHUNK * len(LAYERS)
        assert b.s.connector._sched.stats["hit_tokens"] == hits and w.stats["loaded_chunks"] == 9, (
            "the next turn's prefix came from B's GPU cache, not from kvd")
        b.run(lambda: b.finished("t2"), what="turn 2 finishing")
        # Traffic's next turn is remembered, in place of the turn it extends.
        until(lambda: [p.tokens for p in recall(k.url, "replica-0")] == [turn2], what="turn 2 remembered")
    finally:
        b.close()


def test_what_is_remembered_of_vllms_own_requests():
    """``_rememberable`` on vLLM's ``Request``: a prompt never computed (aborted while waiting) is
    not remembered; one finished by an in-flight step after a preemption reset its computed
    tokens to 0 (vLLM's ``stopped_preempted_reqs``) is, for its output says it was computed; a
    warm's replay (the tool's body through vLLM's ``CompletionRequest``) is not."""
    from vllm import SamplingParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.request import Request

    from kvd.vllm import _rememberable
    from kvd.warm import Prompt, completion_body

    prompt = list(range(100, 400))

    def request(sp: SamplingParams) -> Request:
        sp.update_from_generation_config({}, EOS)
        return Request(request_id="r", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None)

    waiting = request(SamplingParams(max_tokens=4))
    assert not _rememberable(waiting), "nothing of its prompt was computed"
    waiting.num_computed_tokens = len(prompt)
    assert _rememberable(waiting)
    preempted = request(SamplingParams(max_tokens=4))
    preempted.append_output_token_ids(7)
    preempted.num_computed_tokens = 0
    assert _rememberable(preempted), "its output says its prompt was computed"
    body = CompletionRequest.model_validate(completion_body("llama", Prompt(prompt, "", 0.0)))
    warm = request(body.to_sampling_params(max_tokens=body.max_tokens))
    warm.num_computed_tokens = len(prompt)
    assert not _rememberable(warm), "a warm's replay"


def test_the_warm_tools_requests_are_what_vllms_completions_api_takes(kvd):
    """``kvd.warm``'s HTTP side against vLLM's own request model: every body it posts validates as
    vLLM's ``CompletionRequest`` (token ids as the prompt, one token, the cache salt, the warm's
    mark in ``kv_transfer_params``). The server is a stand-in that parses with vLLM's class; a
    real ``vllm serve`` runs on a GPU only."""
    import array
    import http.server
    import json
    import threading

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from kvd import _native
    from kvd.testing import free_port
    from kvd.warm import engine_model, http_submit, recall, warm

    c = _native.Client(kvd.url, "test", role="tool")
    prompts = {"": list(range(100, 400)), "tenant-a": list(range(500, 540))}
    for salt, tokens in prompts.items():
        c.remember("replica-0", salt, array.array("I", tokens).tobytes()).result(5)
    got: list = []

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "llama8b", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                got.append(CompletionRequest.model_validate(body))
            except Exception as e:  # noqa: BLE001 - vLLM answers 400 for what it cannot parse
                self._send(400, {"error": str(e)})
                return
            self._send(200, {"choices": [{"text": ""}]})

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        done = warm(recall(kvd.url, "replica-0"), http_submit(url, engine_model(url, 5.0), 5.0), concurrency=1)
    finally:
        srv.shutdown()
    assert done.prompts == 2 and done.tokens == 340
    assert {(r.cache_salt or "", tuple(r.prompt)) for r in got} == {(s, tuple(t)) for s, t in prompts.items()}
    assert all(r.max_tokens == 1 and r.model == "llama8b" for r in got)
    # The warm's mark reaches the engine's request (Request.kv_transfer_params) as vLLM's server
    # passes it: in the sampling parameters' extra_args.
    assert all(r.to_sampling_params(max_tokens=64).extra_args == {"kv_transfer_params": {"kvd.warm": True}} for r in got)


def test_blocks_vllm_writes_before_the_forward_are_read_from_its_scheduler_output():
    """vLLM zeroes new blocks (models with Mamba layers) and runs its copy-on-write copies (a
    prefix hit ending inside a block) on the model's stream before the forward pass: a load into
    one of those blocks must wait for that stream (``KvdConfig.load_overlap``). Read from this
    vLLM's own SchedulerOutput and KVCacheBlockCopy."""
    import kvd.vllm
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    assert kvd.vllm._written_before_forward(out) == set()
    out.new_block_ids_to_zero = [3, 4]
    out.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=7, dst_block_id=9)]
    assert kvd.vllm._written_before_forward(out) == {3, 4, 9}


def test_loads_wait_for_the_model_stream_where_vllm_may_keep_more_steps_in_flight(kvd):
    """vLLM defers a freed block's return only for a loading role, and a drafter or several
    pipeline stages keep more steps in flight than the connector's margin: there every load
    waits for the model's stream. Read from this vLLM's own config objects."""
    vc = vllm_config(kvd.url, BLOCK, CHUNK)
    import kvd.vllm  # (binds the package over the fixture's name)

    assert kvd.vllm._no_overlap(vc) is None
    vc.kv_transfer_config.kv_role = "kv_producer"
    assert kvd.vllm._no_overlap(vc) == "kv_role 'kv_producer'"
    vc.kv_transfer_config.kv_role = "kv_both"
    vc.parallel_config.pipeline_parallel_size = 2
    assert kvd.vllm._no_overlap(vc) == "pipeline_parallel_size 2"

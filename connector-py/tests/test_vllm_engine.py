"""The kvd connector inside vLLM's engine loop (vllm_engine.py: vLLM's real Scheduler, its own
model-runner connector plumbing, a real kvd), for vLLM 0.33 and 0.26 alike.

Run with ``scripts/vllm-conformance.sh`` (VLLM_VERSION=0.26.0 for the older release).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvd.testing import until  # noqa: E402
from vllm_engine import Engine, attention, vllm_config  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK, CHUNK = 16, 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def full_attention_engine(url: str, num_blocks: int) -> Engine:
    return Engine(vllm_config(url, BLOCK, CHUNK), {name: attention(BLOCK) for name in LAYERS}, num_blocks)


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


def gemma3_engine(url: str, num_blocks: int, window: int = 64) -> Engine:
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


def test_sliding_window_chunks_are_not_stored_late_from_freed_blocks(kvd_factory):
    """kvd restarts while vLLM still holds a prefix: the connector catches up on the chunks it
    could not store, but never in a sliding-window group, whose early blocks vLLM has freed."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    port = k.port
    e = gemma3_engine(k.url, num_blocks=256)
    try:
        k.stop()
        a = list(range(100, 400))
        e.add("a", a, max_tokens=40)
        e.run(lambda: e.s.requests["a"].num_computed_tokens >= 300, what="a's prompt computed without kvd")
        k2 = _restart(k, port)
        w = e.worker._worker
        epoch = w._epoch
        until(lambda: e.s.connector._sched.conn.client() is not None and w._epoch > epoch
              and all(r is not None for r in w.registrations), 10, "the connector registered with the new kvd")
        assert "a" in e.s.requests, "a is still decoding"
        e.run(lambda: e.finished("a"), timeout=20, what="a finishing with kvd back")
        full = sum(not g.sliding for g in e.s.connector._sched.groups)
        assert k2.metric('kvd_store_chunks_total{outcome="stored"}') == 9 * full, (
            "the late chunks went to the full-attention group only")
        e.add("b", a, max_tokens=1)  # vLLM's prefix cache holds a: no load expected, only a check
        e.run(lambda: e.finished("b"), what="b finishing")
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=2)
        e.run(lambda: e.s.requests.get("a2") is not None and e.s.requests["a2"].status == RequestStatus.RUNNING,
              what="a2 running")
        assert e.worker._worker.stats["failed_loads"] == 0
        e.check_kv("a2", e.s.requests["a2"].num_computed_tokens // CHUNK * CHUNK)
        e.run(lambda: e.finished("a2"), what="a2 finishing")
        k2.stop()
    finally:
        e.close()


def _restart(k, port):
    from conftest import Kvd

    return Kvd(k.tmp, "--chunk-tokens", str(CHUNK), port=port)


def test_an_unsupported_model_serves_without_kvd_and_says_so_once(kvd, caplog):
    """A Mamba hybrid (Qwen3-Next-style): kvd cannot key its state group yet, so the connector
    is off from the start, with one line, and vLLM serves every request."""
    import torch

    mamba = _spec_class("MambaSpec")
    specs = {f"model.layers.{i}.self_attn.attn": attention(BLOCK) for i in range(0, 4, 3)}
    for i in (1, 2):
        specs[f"model.layers.{i}.linear_attn"] = mamba(block_size=BLOCK, shapes=((4, 64), (2, 64)),
                                                      dtypes=(torch.bfloat16, torch.bfloat16),
                                                      mamba_cache_mode="align")
    with caplog.at_level("ERROR", logger="kvd"):
        try:
            e = Engine(vllm_config(kvd.url, BLOCK, CHUNK), specs, 256)
        except Exception as ex:  # vLLM itself may refuse this made-up shape on CPU
            pytest.skip(f"vLLM's planner refused the Mamba-hybrid specs: {ex}")
    try:
        lines = [r.getMessage() for r in caplog.records if "offloading is off" in r.getMessage()]
        assert len(lines) == 1 and "MambaSpec" in lines[0], lines
        e.add("a", list(range(100, 400)))
        e.run(lambda: e.finished("a"), what="a served without kvd")
        assert kvd.metric('kvd_store_chunks_total{outcome="stored"}') == 0
    finally:
        e.close()


def dsv4_specs() -> dict:
    """DeepSeek-V4's cache kinds, with the arguments its layer classes give them
    (vllm/models/deepseek_v4/: attention.py, compressor.py; sparse_swa.py), at a small depth:
    C4 and C128 compressed MLA attention, the C4 indexer, the sliding-window MLA attention and
    the compressor's sliding-window state. Block size 256, as DeepSeek-V4 runs."""
    import torch

    mla = _spec_class("MLAAttentionSpec")
    swa = _spec_class("SlidingWindowMLASpec")
    if "tokens_per_state" not in getattr(mla, "__dataclass_fields__", {}):
        pytest.skip("this vLLM's MLA spec has no tokens_per_state (DeepSeek-V4 needs vLLM 0.33)")
    specs = {}
    for i, ratio in enumerate((4, 128, 4, 128)):
        p = f"model.layers.{i}"
        specs[f"{p}.attn.mla_attn"] = mla(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=512,
                                           dtype=torch.uint8, tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla",
                                           alignment=576, model_version="deepseek_v4", state_content_bytes=584)
        if ratio == 4:
            specs[f"{p}.attn.indexer.k_cache"] = mla(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=132,
                                                      dtype=torch.uint8, tokens_per_state=4, alignment=576)
        specs[f"{p}.attn.swa"] = swa(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
                                     sliding_window=128, cache_dtype_str="fp8_ds_mla", state_content_bytes=584)
        specs[f"{p}.attn.compressor.state"] = swa(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=1024,
                                                  dtype=torch.bfloat16, sliding_window=128, alignment=576)
    return specs


def test_deepseek_v4_round_trips_every_group(kvd_factory):
    k = kvd_factory("--chunk-tokens", "256")
    try:
        e = Engine(vllm_config(k.url, 256, 256, max_batched=2048), dsv4_specs(), 64)
    except (AssertionError, ValueError, NotImplementedError) as ex:
        pytest.fail(f"vLLM's planner refused DeepSeek-V4's specs on CPU: {ex!r}")
    try:
        groups = [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in e.kvc.kv_cache_groups]
        assert e.worker._worker is not None and e.s.connector.disabled is None, e.s.connector.disabled
        a = list(range(100, 1400))  # 1300 tokens: 5 chunks of 256
        e.add("a", a)
        e.run(lambda: e.finished("a"), timeout=30, what="a finishing")
        subs = e.s.connector._sched.subs
        assert subs == e.worker._worker.subs, "the scheduler learnt every group's registrations"
        assert e.s.reset_prefix_cache()
        e.add("a2", a, max_tokens=3)
        e.run(_loaded_from_kvd(e, "a2", 5 * 256), timeout=30, what=f"a2 loaded from kvd (groups {groups}, subs {subs})")
        w = e.worker._worker.stats
        assert w["missing_chunks"] == 0 and w["failed_loads"] == 0, w
        assert e.check_kv("a2", 5 * 256) > 0
        e.run(lambda: e.finished("a2"), timeout=30, what="a2 finishing")
    finally:
        e.close()

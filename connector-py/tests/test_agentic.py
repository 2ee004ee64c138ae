"""The agentic-trace replay (benches/agentic.py) in its short mode: host memory shared with a
real kvd, three small traces kept in benches/traces, an engine with so few GPU blocks that turns
are loaded back from kvd. Every loaded byte is checked, and kvd's hits are compared with pure
Python references over the chunk events kvd was sent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"
sys.path.insert(0, str(BENCHES))

import agentic  # noqa: E402
import agentic_trace as at  # noqa: E402

from conftest import kvd_binary  # noqa: E402

SHORT = ["--host", "--trace-dir", str(BENCHES / "traces"), "--geometry", "tiny", "--slab-mb", "2", "--exact", "--quiet"]


def replay(*extra: str) -> list[agentic.Result]:
    return agentic.run(agentic.parse(["--kvd", kvd_binary(), *SHORT, *extra]))["tiny"]


def test_loads_are_bit_exact_and_hits_match_a_pool_that_never_evicts():
    # 300 blocks of 16 tokens: less than the three users' contexts, so turns are loaded back.
    (r,) = replay("--eviction", "lru", "--gpu-blocks", "300", "--pool-frac", "4")
    s = r.stats
    assert r.turns == 40 and s.steps > 0
    assert len(s.loads) > 0 and s.kvd_hit_tokens > 0, "some turns were loaded from kvd"
    assert s.mismatched_bytes == 0
    assert s.checked_tokens == s.kvd_hit_tokens, "every loaded token was checked"
    layers, heads, content = agentic.GEOMETRIES["tiny"][:3]
    assert r.checked_bytes == s.kvd_hit_tokens * layers * heads * content * 2
    assert r.metrics.get("kvd_evictions_total", 0) == 0
    # kvd was sent every store before each lookup (exact mode): it must hit exactly what a pool
    # that keeps every stored chunk would.
    hits, asked = at.unbounded(r.events)
    assert (r.tap_hits, r.tap_asked) == (hits, asked)
    assert at.belady(r.events, r.capacity_chunks) == (hits, asked), "MIN with room for all"
    assert s.gpu_hit_tokens + s.kvd_hit_tokens + s.computed_prompt_tokens >= s.prompt_tokens


def test_a_gpu_short_of_blocks_preempts_and_loads_stay_exact():
    # 250 blocks: loaded turns wait for blocks, the prefix cache loses blocks between a lookup
    # and the allocation, requests are preempted (this found a stale-answer bug in KvdScheduler).
    (r,) = replay("--eviction", "lru", "--gpu-blocks", "250", "--pool-frac", "4")
    s = r.stats
    assert r.turns == 40 and len(s.loads) > 0
    assert s.load_failures == 0 and s.mismatched_bytes == 0
    assert s.checked_tokens == s.kvd_hit_tokens
    assert (r.tap_hits, r.tap_asked) == at.unbounded(r.events)


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_a_small_pool_evicts_and_still_loads_only_what_was_stored(policy):
    # 64-token chunks of 16 KiB: kvd's smallest pool (2 MiB) holds 128 of the ~450 chunks.
    (r,) = replay("--eviction", policy, "--gpu-blocks", "1200", "--token-scale", "4", "--pool-frac", "0.1")
    s = r.stats
    assert r.capacity_chunks == 128
    assert r.metrics.get("kvd_evictions_total", 0) > 0
    assert s.mismatched_bytes == 0 and s.checked_tokens == s.kvd_hit_tokens
    hits, asked = at.unbounded(r.events)
    assert r.tap_asked == asked and r.tap_hits <= hits
    bel, _ = at.belady(r.events, r.capacity_chunks)
    assert bel <= hits


def test_reference_caches_on_a_known_sequence():
    # Chains 1-2-3 and 10-11 stored, then looked up a, b, a: with room for three chunks LRU
    # keeps the newest (3, 10, 11: only b hits), MIN keeps 1-2-3 (a hits twice).
    ev: list[at.Event] = [("store", [1, 2, 3]), ("store", [10, 11]), ("lookup", [1, 2, 3]), ("lookup", [10, 11]), ("lookup", [1, 2, 3])]
    assert at.unbounded(ev) == (8, 8)
    assert at.lru(ev, 3) == (2, 8)
    hits, asked = at.belady(ev, 3)
    assert (hits, asked) == (6, 8)


def test_a_step_that_runs_while_a_request_waits_on_kvd_lasts_a_real_step():
    # Paced (not --exact): the replay's steps run no model, so without padding a load in flight
    # spans many times the steps a real engine would take, each a whole --step-s of trace time.
    paced = [a for a in SHORT if a != "--exact"]
    args = ["--eviction", "lru", "--gpu-blocks", "300", "--pool-frac", "4", "--step-wall-ms", "20"]
    (r,) = agentic.run(agentic.parse(["--kvd", kvd_binary(), *paced, *args]))["tiny"]
    s = r.stats
    assert len(s.loads) > 0 and s.mismatched_bytes == 0
    assert 0 < s.padded_steps < s.steps
    assert s.padded_s >= s.padded_steps * 0.020, "each step run while a request waited lasted 20 ms"
    (r0,) = agentic.run(agentic.parse(["--kvd", kvd_binary(), *paced, *args[:-1], "0"]))["tiny"]
    assert r0.stats.padded_steps == 0 and len(r0.stats.loads) > 0, "--step-wall-ms 0: the replay before session 26"

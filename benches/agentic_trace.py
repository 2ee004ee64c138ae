"""The agentic traces as a workload, and the reference caches kvd's hit rate is judged against.

Traces (``/work/shared/traces/README.md``) describe each prompt as 64-token blocks of hash ids,
equal ids being equal content, scoped to one trace. A replay turns them into token ids, with
``scale`` folding each 64-token block into ``64 / scale`` tokens: with kvd's chunk also divided by
``scale`` (256 / scale tokens), a chunk still covers four trace blocks, so the chunk sequence —
what eviction sees — is the one of the unscaled trace, while the tokens, bytes and compute of the
replay shrink by ``scale``.

A token's KV content is a function of its prefix: every token carries a 63-bit *seed*, the mix of
the chained hash of the trace blocks up to its own and its offset in that block (equal ids are
equal tokens, so equal seeds mean equal prefixes). The replay writes KV bytes from seeds and
checks every loaded byte against them.

Sub-agent conversations are conversations of their own, starting when the parent's trace says.
"""

from __future__ import annotations

import gzip
import heapq
import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

TRACE_BLOCK = 64
VOCAB = 128_000
M64 = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A 63-bit mix of integers (splitmix64 steps), stable across processes."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & M64)) * 0xBF58476D1CE4E5B9 & M64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & M64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


@dataclass
class Turn:
    """One request of a conversation."""

    #: Seconds since the conversation started.
    t: float
    #: The prompt as trace blocks.
    hash_ids: list[int]
    #: Prompt tokens in the trace (the last block may be partial).
    tokens_in: int
    #: Output tokens in the trace.
    tokens_out: int


@dataclass
class Conversation:
    """A user (or a sub-agent) sending its turns one after the other."""

    name: str
    #: The trace whose hash-id scope it shares (sub-agents share their parent's).
    trace: str
    #: Seconds after its trace started.
    start: float
    turns: list[Turn] = field(default_factory=list)


def trace_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".json.gz"))


def load(path: str, max_turns: int | None = None) -> list[Conversation]:
    """The conversations of one trace: the main one and each sub-agent's (at most ``max_turns``
    turns each)."""
    with gzip.open(path) as f:
        d = json.load(f)
    trace = d["id"]
    out = [Conversation(trace, trace, 0.0)]
    for r in d["requests"]:
        if r["type"] == "subagent":
            sub = Conversation(f"{trace}/{r.get('agent_id', len(out))}", trace, float(r["t"]))
            sub.turns = [Turn(float(q["t"]), list(q["hash_ids"]), int(q["in"]), int(q["out"])) for q in r["requests"] if q.get("hash_ids")]
            out.append(sub)
        elif r.get("hash_ids"):
            out[0].turns.append(Turn(float(r["t"]), list(r["hash_ids"]), int(r["in"]), int(r["out"])))
    for c in out:
        del c.turns[max_turns or len(c.turns):]
    return [c for c in out if c.turns]


class Tokens:
    """Token ids and seeds of prompts, from (trace, hash id), ``64 / scale`` tokens a block."""

    def __init__(self, scale: int) -> None:
        if TRACE_BLOCK % scale:
            raise ValueError(f"--token-scale {scale}: must divide {TRACE_BLOCK}")
        self.scale = scale
        self.per_block = TRACE_BLOCK // scale
        self._ids: dict[tuple[str, int], np.ndarray] = {}
        self._chain: dict[tuple[int, int], int] = {}
        self._offsets = np.arange(self.per_block, dtype=np.int64)

    def block_ids(self, trace: str, hid: int) -> np.ndarray:
        k = (trace, hid)
        v = self._ids.get(k)
        if v is None:
            rng = np.random.default_rng(mix(hash_str(trace), hid))
            v = self._ids[k] = rng.integers(0, VOCAB, self.per_block, dtype=np.int64)
        return v

    def prompt(self, trace: str, turn: Turn) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, seeds) of a turn's prompt."""
        n_blocks = len(turn.hash_ids)
        last = turn.tokens_in - TRACE_BLOCK * (n_blocks - 1)
        last = min(self.per_block, max(1, -(-last // self.scale)))
        ids = np.concatenate([self.block_ids(trace, h) for h in turn.hash_ids])
        chain, chains = hash_str(trace), np.empty(n_blocks, dtype=np.int64)
        for i, h in enumerate(turn.hash_ids):
            k = (chain, h)
            c = self._chain.get(k)
            if c is None:
                c = self._chain[k] = mix(chain, h)
            chains[i] = chain = c
        seeds = token_seeds(chains, self._offsets)
        cut = len(ids) - (self.per_block - last)
        return ids[:cut], seeds[:cut]


def hash_str(s: str) -> int:
    return mix(*s.encode())


def token_seeds(chains: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Seeds of the tokens of blocks with these chained hashes: one per (block, offset)."""
    x = (chains[:, None].astype(np.uint64) ^ (offsets[None, :].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(1)).astype(np.int64).reshape(-1)


def generated_seeds(prompt_seeds: np.ndarray, count: int) -> np.ndarray:
    """Seeds of ``count`` generated tokens after a prompt (a function of the prompt)."""
    base = np.uint64(int(prompt_seeds[-1]))
    x = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)) ^ base
    x = x * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(1)).astype(np.int64)


# --- reference caches over the chunk events kvd saw ----------------------------------------

#: An event as kvd saw it: ("lookup", chunk keys) or ("store", chunk keys).
Event = tuple[str, Sequence[int]]


def prefix_hits(keys: Sequence[int], present) -> int:
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def unbounded(events: Iterable[Event]) -> tuple[int, int]:
    """(hit chunks, looked-up chunks) of a pool that never evicts (LRU with no bound)."""
    seen: set[int] = set()
    hits = asked = 0
    for kind, keys in events:
        if kind == "store":
            seen.update(keys)
        else:
            hits += prefix_hits(keys, seen)
            asked += len(keys)
    return hits, asked


def belady(events: Sequence[Event], capacity: int, per_lookup: list[int] | None = None) -> tuple[int, int]:
    """(hit chunks, looked-up chunks) of Belady's MIN with ``capacity`` chunks over the same
    lookups and stores: a stored chunk is kept only if it is asked for again sooner than some
    chunk held, which then goes (the one asked for latest; of those asked for by the same lookup, the one deepest
    in the prompt, so that kept chunks stay prefixes). Hits are counted as kvd counts them: the
    leading run of a lookup's chunks that are held. With ``per_lookup``, each lookup's hit chunks
    are appended to it, in event order."""
    INF = 1 << 62
    # For each event, each key's next use: (event index, position in that lookup), backwards.
    nexts: list[list[tuple[int, int]]] = [[] for _ in events]
    upcoming: dict[int, tuple[int, int]] = {}
    for i in range(len(events) - 1, -1, -1):
        kind, keys = events[i]
        nexts[i] = [upcoming.get(k, (INF, 0)) for k in keys]
        if kind == "lookup":
            for pos, k in enumerate(keys):
                upcoming[k] = (i, pos)
    held: dict[int, tuple[int, int]] = {}  # key -> its next use
    heap: list[tuple[int, int, int]] = []  # (-event, -position, key); stale entries skipped
    hits = asked = 0

    def offer(k: int, nu: tuple[int, int]) -> None:
        if k in held:
            held[k] = nu
            heapq.heappush(heap, (-nu[0], -nu[1], k))
            return
        if nu[0] >= INF or capacity <= 0:
            return
        while len(held) >= capacity:
            e, p, victim = heap[0]
            if held.get(victim) != (-e, -p):
                heapq.heappop(heap)
                continue
            if (-e, -p) <= nu:
                return  # every chunk held is needed sooner: do not keep this one
            heapq.heappop(heap)
            del held[victim]
        held[k] = nu
        heapq.heappush(heap, (-nu[0], -nu[1], k))

    for i, (kind, keys) in enumerate(events):
        if kind == "lookup":
            h = prefix_hits(keys, held)
            hits += h
            asked += len(keys)
            if per_lookup is not None:
                per_lookup.append(h)
            for k, nu in zip(keys, nexts[i]):
                if k in held:
                    offer(k, nu)
            continue
        for k, nu in zip(keys, nexts[i]):
            offer(k, nu)
    return hits, asked


def lru(events: Iterable[Event], capacity: int) -> tuple[int, int]:
    """(hit chunks, looked-up chunks) of LRU with ``capacity`` chunks, reads refreshing the
    chunks of the prefix hit (as kvd touches them); for checking the replay."""
    from collections import OrderedDict

    held: OrderedDict[int, None] = OrderedDict()
    hits = asked = 0
    for kind, keys in events:
        if kind == "lookup":
            n = prefix_hits(keys, held)
            for k in keys[:n]:
                held.move_to_end(k)
            hits += n
            asked += len(keys)
            continue
        for k in keys:
            if k in held:
                continue
            if len(held) >= capacity:
                held.popitem(last=False)
            held[k] = None
    return hits, asked

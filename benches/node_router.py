"""Where each request of the node benchmark (``benches/node.py``) goes, and the closed-loop
replay of the agentic conversations through a router to E engines.

The router is what sits in front of a node's engines:

- ``round-robin``: the next engine for every request, whatever conversation it belongs to —
  what a Kubernetes Service (kube-proxy in IPVS round-robin mode) does. A conversation's next
  turn usually lands on another engine than its last one, so only a cache shared by the node
  holds its prefix there.
- ``least-loaded``: the engine with the fewest requests in flight (then the fewest prompt
  tokens in flight), ties broken round-robin — a load balancer's "least request".
- ``random``: an engine drawn uniformly for every request (seeded) — kube-proxy's default
  iptables mode.
- ``sticky``: a conversation always goes to the same engine (conversation index modulo E, the
  next engine up while it is down) — session affinity, the control: each engine's own GPU
  cache sees every turn of its conversations.

Nothing here imports vLLM: engines are anything with ``submit(rid, tokens, max_tokens)``,
``abort()`` and an ``incarnation``, answering on a shared queue of ``(slot, incarnation,
event)``; ``benches/tests/test_node.py`` drives it with fake engines.
"""

from __future__ import annotations

import math
import queue
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence

POLICIES = ("round-robin", "least-loaded", "random", "sticky")


class Router:
    """Picks an engine slot for a request; told when requests start and finish."""

    def __init__(self, policy: str, slots: int, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router {policy!r}: one of {', '.join(POLICIES)}")
        if slots < 1:
            raise ValueError("a router needs at least one engine")
        self.policy = policy
        self.slots = slots
        self.up = [True] * slots
        self.inflight = [0] * slots
        self.inflight_tokens = [0] * slots
        self._next = 0
        self._rng = random.Random(seed)

    def set_up(self, slot: int, up: bool) -> None:
        """An engine leaves (drained for a restart) or comes back."""
        self.up[slot] = up

    def _ring(self, start: int) -> list[int]:
        return [s for s in ((start + i) % self.slots for i in range(self.slots)) if self.up[s]]

    def pick(self, conv: int) -> int:
        ring = self._ring(conv % self.slots if self.policy == "sticky" else self._next)
        if not ring:
            raise RuntimeError("no engine is up")
        if self.policy == "sticky":
            return ring[0]
        if self.policy == "round-robin":
            s = ring[0]
        elif self.policy == "random":
            return self._rng.choice(sorted(ring))
        else:
            s = min(ring, key=lambda x: (self.inflight[x], self.inflight_tokens[x]))  # min keeps the ring's order on ties
        self._next = (s + 1) % self.slots
        return s

    def started(self, slot: int, tokens: int) -> None:
        self.inflight[slot] += 1
        self.inflight_tokens[slot] += tokens

    def finished(self, slot: int, tokens: int) -> None:
        self.inflight[slot] -= 1
        self.inflight_tokens[slot] -= tokens


class Engine(Protocol):
    incarnation: int

    def submit(self, rid: Any, tokens: list[int], max_tokens: int) -> None: ...

    def abort(self) -> None: ...


@dataclass
class Row:
    """One finished request."""

    conv: int
    turn: int
    slot: int
    incarnation: int
    prompt: int
    out: int
    ttft_s: float | None
    e2e_s: float
    queued_s: float | None
    cached: int
    #: The conversation's previous turn ran on another engine (or another incarnation of it).
    moved: bool
    #: Seconds from the replay's start to this request's end.
    t_done_s: float
    tokens: list[int] = field(default_factory=list)
    #: The engine's step count when the request reached it (None from engines before session 35).
    enq_step: int | None = None


@dataclass
class Outcome:
    rows: list[Row]
    status: str
    wall_s: float
    requests: int

    def as_dict(self) -> dict:
        return {"status": self.status, "wall_s": self.wall_s, "requests": self.requests,
                "rows": [asdict(r) for r in self.rows]}


def replay(users: Sequence[Sequence[tuple[list[int], int]]], turns: range, router: Router,
           engines: dict[int, Engine], events: "queue.Queue", timeout_s: float, label: str,
           last: dict[int, tuple[int, int]] | None = None) -> Outcome:
    """Every user's turns in ``turns``, closed loop (a user's next turn goes out when its last
    one finishes; all users start at once), each through ``router``. ``last`` maps a user to
    the (slot, incarnation) of its previous turn, carried from an earlier phase; it is updated."""
    last = {} if last is None else last
    nxt = {u: turns.start for u in range(len(users)) if turns.start < min(turns.stop, len(users[u]))}
    stop = {u: min(turns.stop, len(users[u])) for u in nxt}
    total = sum(stop[u] - turns.start for u in nxt)
    inflight: dict[str, tuple[int, int, int, int]] = {}  # rid -> (user, turn, slot, prompt tokens)
    rows: list[Row] = []
    t0 = time.monotonic()

    def send(u: int) -> None:
        t = nxt[u]
        tokens, out = users[u][t]
        s = router.pick(u)
        rid = f"{label}/{u}/{t}"
        inflight[rid] = (u, t, s, len(tokens))
        router.started(s, len(tokens))
        engines[s].submit(rid, list(tokens), out)
        nxt[u] = t + 1

    for u in nxt:
        send(u)
    status = "ok"
    deadline = t0 + timeout_s
    while inflight:
        left = deadline - time.monotonic()
        if left <= 0:
            status = f"timed out: {len(inflight)} of {total} requests unfinished after {timeout_s:.0f} s"
            for s in {v[2] for v in inflight.values()}:
                try:
                    engines[s].abort()
                except Exception:
                    pass
            for _, _, s, n in inflight.values():
                router.finished(s, n)
            break
        try:
            slot, inc, ev = events.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        kind = ev.get("ev")
        if kind == "exit":
            if slot in engines and engines[slot].incarnation == inc:
                status = f"error: engine {slot} exited (rc {ev.get('rc')}) with {len(inflight)} requests in flight"
                for _, _, s, n in inflight.values():
                    router.finished(s, n)
                break
            continue
        rec = inflight.pop(ev.get("id"), None)
        if rec is None:
            continue  # a late answer from an earlier cell or an engine replaced since
        u, t, s, n = rec
        router.finished(s, n)
        if kind != "done":
            continue
        prev = last.get(u)
        last[u] = (s, inc)
        rows.append(Row(u, t, s, inc, n, len(ev.get("tokens") or []), ev.get("ttft_s"), float(ev.get("e2e_s") or 0.0),
                        ev.get("queued_s"), int(ev.get("cached") or 0), prev is not None and prev != (s, inc),
                        round(time.monotonic() - t0, 4), list(ev.get("tokens") or []), ev.get("enq_step")))
        if nxt[u] < stop[u] and status == "ok":
            send(u)
    return Outcome(rows, status, time.monotonic() - t0, total)


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile of xs, linearly interpolated (None for no samples)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(rows: Sequence[Row] | Sequence[dict], wall_s: float) -> dict:
    """Throughput and TTFT of a set of finished requests over ``wall_s``."""
    rs = [r if isinstance(r, dict) else asdict(r) for r in rows]
    ttfts = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
    ptoks = sum(r["prompt"] for r in rs)
    otoks = sum(r["out"] for r in rs)
    moved = [r["moved"] for r in rs if r["turn"] > 0]
    return {
        "done": len(rs), "prompt_tokens": ptoks, "output_tokens": otoks,
        "tok_s": (ptoks + otoks) / wall_s if wall_s > 0 else None,
        "out_tok_s": otoks / wall_s if wall_s > 0 else None,
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
        "e2e_p50_s": pct([r["e2e_s"] for r in rs], 0.5),
        "moved": sum(moved) / len(moved) if moved else None,
    }


def simulate(policy: str, users: Sequence[Sequence[tuple[list[int], int]]], slots: int,
             tokens_per_s: float = 20_000.0) -> dict:
    """The router on the workload without engines (``node.py --dry-run``): each engine serves
    its requests one at a time, a request taking prompt tokens / ``tokens_per_s``; returns the
    requests each engine got and the share of turns sent to another engine than their
    conversation's last. Only an indication: real engines batch."""
    import heapq

    r = Router(policy, slots)
    free_at = [0.0] * slots
    nxt = [0] * len(users)
    last: dict[int, int] = {}
    per = [0] * slots
    moved = later = 0
    heap: list[tuple[float, int, int]] = []  # (done at, user, slot)

    def send(u: int, now: float) -> None:
        nonlocal moved, later
        tokens, _ = users[u][nxt[u]]
        s = r.pick(u)
        r.started(s, len(tokens))
        per[s] += 1
        if nxt[u] > 0:
            later += 1
            moved += last.get(u) != s
        last[u] = s
        free_at[s] = max(free_at[s], now) + len(tokens) / tokens_per_s
        heapq.heappush(heap, (free_at[s], u, s))
        nxt[u] += 1

    for u in range(len(users)):
        if users[u]:
            send(u, 0.0)
    while heap:
        t, u, s = heapq.heappop(heap)
        r.finished(s, len(users[u][nxt[u] - 1][0]))
        if nxt[u] < len(users[u]):
            send(u, t)
    return {"requests_per_engine": per, "moved": moved / later if later else None}

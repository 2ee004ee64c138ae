"""Remembered prompts and ``python -m kvd.warm`` against a real kvd: what the scheduler remembers
under ``kvd.warm_group``, what kvd keeps and hands back, and the warm tool as an operator runs
it. The tool's HTTP side talks to a small server standing in for vLLM's OpenAI endpoint (it
records the bodies it gets); the real engine's side of a warm is in test_vllm_engine.py, with
vLLM's own scheduler."""

from __future__ import annotations

import array
import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvd import _native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.scheduler import GroupInfo, KvdScheduler
from kvd.testing import free_port, until
from kvd.warm import Prompt, WarmFailed, recall, warm

CHUNK = 32  # the kvd fixture runs with --chunk-tokens 32


def client(url: str) -> _native.Client:
    return _native.Client(url, "test", role="tool", connect_timeout=2.0, request_timeout=5.0)


def put(c: _native.Client, group: str, tokens: list[int], salt: str = "") -> int:
    pending = c.remember(group, salt, array.array("I", tokens).tobytes())
    assert pending is not None, "nothing in flight: the remember is sent"
    return pending.result(5)


def test_kvd_hands_back_the_newest_prompts_and_a_later_turn_replaces_its_earlier_ones(kvd):
    c = client(kvd.url)
    a1 = list(range(1000, 1100))
    assert put(c, "r0", a1) == 1
    assert put(c, "r0", list(range(5000, 5040)), salt="tenant") == 2
    assert put(c, "r1", [7] * 50) == 1
    # a's next turn extends a1: kvd keeps the later turn only.
    a2 = a1 + list(range(9000, 9060))
    assert put(c, "r0", a2) == 2
    (salt, tokens, age_ms), held = c.recall("r0", 0).result(5)
    assert (salt, tokens, held) == ("", a2, 2) and 0 <= age_ms < 60_000
    (salt, tokens, _), _ = c.recall("r0", 1).result(5)
    assert (salt, tokens) == ("tenant", list(range(5000, 5040)))
    assert c.recall("r0", 2).result(5) == (None, 2)
    assert c.recall("nobody", 0).result(5) == (None, 0)
    # Through the library: newest first, within a token budget.
    got = recall(kvd.url, "r0")
    assert [p.tokens for p in got] == [a2, list(range(5000, 5040))] and got[1].salt == "tenant"
    assert [p.tokens for p in recall(kvd.url, "r0", max_tokens=100)] == [list(range(5000, 5040))]
    assert [p.tokens for p in recall(kvd.url, "r0", max_prompts=1)] == [a2]


def test_bad_groups_and_a_kvd_that_remembers_nothing_are_refused_with_the_fix(kvd_factory):
    k = kvd_factory("--chunk-tokens", "32", "--recall-mb", "0")
    c = client(k.url)
    with pytest.raises(_native.ServerError, match="--recall-mb"):
        put(c, "r0", [1, 2, 3])
    with pytest.raises(_native.ServerError, match="1 to 256 bytes"):
        c.recall("", 0).result(5)
    with pytest.raises(ValueError, match="32-bit token ids"):
        c.remember("r0", "", b"\x01\x02\x03")
    # The session survives every refusal.
    assert c.recall("r0", 0).result(5) == (None, 0)


def test_kvd_refuses_a_bad_recall_mb_naming_the_range(tmp_path):
    from conftest import kvd_binary

    out = subprocess.run([kvd_binary(), "serve", "--recall-mb", "-1", "--l1-size-gb", "0.25"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "--recall-mb" in out.stderr, out.stderr


def scheduler(url: str, **kw) -> KvdScheduler:
    kw.setdefault("request_timeout_s", 5.0)
    cfg = KvdConfig(url=url, chunk_tokens=CHUNK, connect_timeout_s=1.0, **kw)
    return KvdScheduler(cfg, [GroupInfo(0xC0DE, 16, (0,), 1)], Connection(cfg, "sched", "scheduler"))


def test_the_scheduler_remembers_prompts_of_a_chunk_or_more_under_its_group(kvd):
    s = scheduler(kvd.url, warm_group="replica-a")
    until(lambda: s.conn.client() is not None)
    c = client(kvd.url)
    s.remember(list(range(100, 140)), None)
    s.remember(list(range(200, 210)), None)  # under a chunk: kvd could hold none of it
    # Remembers go out from the client's runtime, each on its own: one held before the next is
    # sent, so that "newer" below means what this test sent later.
    until(lambda: c.recall("replica-a", 0).result(5)[1] == 1)
    s.remember(list(range(300, 364)), "salted")
    until(lambda: c.recall("replica-a", 0).result(5)[1] == 2)
    assert [p.tokens for p in recall(kvd.url, "replica-a")] == [list(range(300, 364)), list(range(100, 140))]
    assert recall(kvd.url, "replica-a")[0].salt == "salted"
    s.remember(list(range(400, 440)), None)  # reads the earlier replies
    until(lambda: (s.remember([], None), s.stats["remembered"])[1] >= 2)
    # Without a group nothing is sent.
    quiet = scheduler(kvd.url)
    until(lambda: quiet.conn.client() is not None)
    quiet.remember(list(range(100, 140)), None)
    assert c.recall("replica-a", 0).result(5)[1] == 3


def test_remembering_never_waits_for_a_stopped_kvd_and_keeps_few_in_flight(kvd_factory):
    """vLLM's scheduler calls ``remember`` in its loop: with kvd stopped (SIGSTOP) mid-run, 50
    prompts of 500,000 tokens (2 MB each, enough to fill the socket's buffers) return at once;
    at most 16 are in flight and the rest are skipped; once kvd runs again the scheduler
    remembers again."""
    k = kvd_factory("--chunk-tokens", "32")
    s = scheduler(k.url, warm_group="replica-a", request_timeout_s=30.0)
    until(lambda: s.conn.client() is not None)
    c = s.conn.client()
    big = list(range(500_000))
    k.sigstop()
    try:
        t0 = time.monotonic()
        for i in range(50):
            s.remember(big[:-i] if i else big, None)
        took = time.monotonic() - t0
        assert took < 5.0, f"50 remembers took {took:.1f} s with kvd stopped"
        assert 1 <= len(s._remembering) <= 16, len(s._remembering)
        assert c.remember("replica-a", "", array.array("I", big).tobytes()) is None, "the 17th is not sent"
    finally:
        os.kill(k.proc.pid, signal.SIGCONT)
    until(lambda: (s.remember([], None), s.stats["remembered"] >= 1)[1], 30)
    s.remember(list(range(7, 47)), None)
    until(lambda: recall(k.url, "replica-a", max_prompts=1)[0].tokens == list(range(7, 47)), 30)


def test_a_refused_remember_is_logged_once_and_never_raises(kvd_factory, caplog):
    k = kvd_factory("--chunk-tokens", "32", "--recall-mb", "0")
    s = scheduler(k.url, warm_group="replica-a")
    until(lambda: s.conn.client() is not None)
    with caplog.at_level(logging.WARNING, logger="kvd"):
        for i in range(5):
            s.remember(list(range(i, i + 40)), None)
        until(lambda: (s.remember([], None), any("did not remember" in r.message for r in caplog.records))[1])
        for i in range(3):
            s.remember(list(range(i, i + 40)), None)
    warned = [r for r in caplog.records if "did not remember" in r.message]
    assert len(warned) == 1 and "--recall-mb" in warned[0].message and "replica-a" in warned[0].message
    assert s.stats["remembered"] == 0


class _Engine(http.server.ThreadingHTTPServer):
    """Stands in for vLLM's OpenAI endpoint: lists one model, answers completions, records them."""

    def __init__(self, fail: bool = False) -> None:
        self.bodies: list[dict] = []
        self.fail = fail
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _json(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._json(200, {"data": [{"id": "llama-test"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if outer.fail:
                    self._json(400, {"error": {"message": "prompt too long"}})
                else:
                    self._json(200, {"choices": [{"text": "x"}]})

        super().__init__(("127.0.0.1", free_port()), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def warm_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvd.warm", *args], capture_output=True, text=True, timeout=60)


def warm_into_engine(kvd_url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """``python -m kvd.warm`` of group r0 into a stand-in engine: its result and the bodies posted."""
    engine = _Engine()
    try:
        out = warm_cli("--url", kvd_url, "--group", "r0", "--engine", engine.url, *args)
    finally:
        engine.shutdown()
    return out, engine.bodies


def test_the_warm_tool_sends_the_newest_prompts_oldest_first_with_their_salts(kvd):
    c = client(kvd.url)
    prompts = [list(range(i * 1000, i * 1000 + 40 + i)) for i in range(4)]
    for i, p in enumerate(prompts):
        put(c, "r0", p, salt="s" if i == 1 else "")
    out, bodies = warm_into_engine(kvd.url, "--max-prompts", "3", "--concurrency", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("kvd.warm: ok: 3 prompts of group 'r0' (126 tokens) sent to ") and "(llama-test)" in out.stdout
    # The three newest, oldest first, so the newest is the last the engine's cache takes.
    assert [b["prompt"] for b in bodies] == prompts[1:]
    # One token each (what loads the prefix), marked as a warm's so that the replacement's
    # connector does not remember them again.
    assert all(b["model"] == "llama-test" and b["max_tokens"] == 1 for b in bodies)
    assert all(b["kv_transfer_params"] == {"kvd.warm": True} and b["ignore_eos"] is True for b in bodies)
    assert [b.get("cache_salt") for b in bodies] == ["s", None, None]
    out, bodies = warm_into_engine(kvd.url, "--max-prompts", "1", "--output-tokens", "2")
    assert out.returncode == 0, out.stderr
    assert [(b["prompt"], b["max_tokens"]) for b in bodies] == [(prompts[3], 2)]
    out = warm_cli("--url", kvd.url, "--group", "r0", "--engine", "http://x", "--output-tokens", "0")
    assert out.returncode == 2 and "--output-tokens must be 1 or more" in out.stderr, out.stderr


def test_the_warm_tool_fails_clearly_and_an_empty_group_warms_nothing(kvd):
    engine = _Engine(fail=True)
    try:
        out = warm_cli("--url", kvd.url, "--group", "empty", "--engine", engine.url)
        assert out.returncode == 0 and "ok: 0 prompts" in out.stdout, out.stderr
        put(client(kvd.url), "r0", list(range(40)))
        out = warm_cli("--url", kvd.url, "--group", "r0", "--engine", engine.url)
        assert out.returncode == 1 and "HTTP 400" in out.stderr and "prompt too long" in out.stderr, out.stderr
    finally:
        engine.shutdown()
    port = free_port()
    out = warm_cli("--url", kvd.url, "--group", "r0", "--engine", f"http://127.0.0.1:{port}", "--timeout", "2")
    assert out.returncode == 1 and "is the engine up" in out.stderr, out.stderr
    out = warm_cli("--url", f"tcp://127.0.0.1:{port}", "--group", "r0", "--engine", "http://x", "--model", "m",
                   "--timeout", "1")
    assert out.returncode == 1 and "is `kvd serve` running there" in out.stderr, out.stderr


def test_warm_runs_every_prompt_before_raising_the_first_failure():
    seen: list[int] = []

    def submit(p: Prompt) -> None:
        seen.append(p.tokens[0])
        if p.tokens[0] == 2:
            raise WarmFailed("engine said no")

    with pytest.raises(WarmFailed, match="engine said no"):
        warm([Prompt([i], "", 0.0) for i in (3, 2, 1)], submit, concurrency=1)
    assert seen == [1, 2, 3]

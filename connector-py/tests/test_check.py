"""``python -m kvd.check``: the install check without a GPU, run as a user runs it, against a real
kvd and against a port where nothing listens."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from kvd.testing import free_port


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvd.check", *args], capture_output=True, text=True, timeout=60)


def test_the_check_round_trips_a_chunk_through_a_running_kvd(kvd):
    before = kvd.metric("kvd_bytes_retrieved_total")
    out = check("--url", kvd.url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"kvd.check: ok: {kvd.url} ") and "bytes equal" in out.stdout, out.stdout
    assert out.stdout.count("\n") == 1 and out.stderr == ""
    # The bytes went through kvd: one chunk of the fixture's 32 tokens, 2 layers of 2 heads × 64
    # bf16 values (8 KiB a layer), and the registration is gone with the check.
    assert kvd.metric("kvd_bytes_retrieved_total") - before == 32 * 2 * 64 * 2 * 2
    assert kvd.metric("kvd_registered_workers") == 0


def test_the_check_fails_clearly_where_nothing_listens():
    port = free_port()
    t = time.monotonic()
    out = check("--url", f"tcp://127.0.0.1:{port}", "--timeout", "1")
    assert time.monotonic() - t < 20
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"kvd.check: FAILED: cannot reach kvd at tcp://127.0.0.1:{port}"), out.stderr
    assert "is `kvd serve` running there" in out.stderr and out.stderr.count("\n") == 1


def test_a_url_that_is_no_zmq_endpoint_is_a_usage_error():
    out = check("--url", "http://127.0.0.1:8080")
    assert out.returncode == 2 and "expected tcp://HOST:PORT or ipc://PATH" in out.stderr


def test_free_port_hands_out_distinct_ports_below_the_ephemeral_range():
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3 and all(6000 <= p < 12000 for p in ports), ports
    # Each is free: a test binds it.
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))

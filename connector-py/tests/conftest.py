"""Fixtures: a real kvd process on free ports (the binary from $KVD_BIN or the workspace's
target directory), and helpers to restart it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kvd_binary() -> str:
    env = os.environ.get("KVD_BIN")
    if env:
        return env
    built = [p for p in (ROOT / "target" / prof / "kvd" for prof in ("release", "debug")) if p.exists()]
    if not built:
        pytest.fail("no kvd binary: build it with `cargo build -p kvd-server` or set KVD_BIN")
    return str(max(built, key=lambda p: p.stat().st_mtime))


class Kvd:
    """A kvd child process; ``url`` is its ZMQ endpoint."""

    def __init__(self, tmp: Path, *args: str, port: int = 0, fd_socket: Path | None = None, wait_ready: bool = True) -> None:
        self.tmp = tmp
        self.fd_socket = fd_socket or tmp / f"fd-{time.monotonic_ns()}.sock"
        cmd = [
            kvd_binary(), "serve", "--port", str(port), "--http-port", "0",
            "--fd-socket", str(self.fd_socket), "--log-level", "info",
        ]
        if "--l1-size-gb" not in args:
            cmd += ["--l1-size-gb", "0.25"]
        cmd += list(args)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.log: list[str] = []
        self.url = ""
        self.http = ""
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening for clients on (tcp://\S+)", line)
                if m:
                    self.url = m.group(1)
                m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
                if m:
                    self.http = m.group(1)
                # The whole pool, not just its first slabs, so tests that fill it see all of it.
                if "L1 pool full" in line or (not wait_ready and self.url and self.http):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(30):
            self.stop()
            pytest.fail("kvd did not become ready:\n" + "".join(self.log))

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def metric(self, name: str) -> float:
        import urllib.request

        body = urllib.request.urlopen(f"http://{self.http}/metrics", timeout=5).read().decode()
        total = 0.0
        for line in body.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def sigstop(self) -> None:
        """Stops the process (SIGSTOP) and returns once every thread has stopped. kill()
        returns sooner: the kernel wakes one thread to begin the group stop and the others stop
        only after it has run, so on a busy machine a request sent in that gap was answered."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        tasks = f"/proc/{self.proc.pid}/task"

        def state(t: str) -> str:
            try:
                with open(f"{tasks}/{t}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:  # a thread gone meanwhile holds nothing up
                return "T"

        until = time.monotonic() + 5
        while not all(state(t) in ("T", "t") for t in os.listdir(tasks)):
            assert time.monotonic() < until, "kvd did not stop within 5 s"
            time.sleep(0.001)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture
def kvd(tmp_path: Path):
    k = Kvd(tmp_path, "--chunk-tokens", "32")
    yield k
    k.stop()


@pytest.fixture
def kvd_factory(tmp_path: Path):
    started: list[Kvd] = []

    def make(*args: str, port: int = 0, fd_socket: Path | None = None, wait_ready: bool = True) -> Kvd:
        k = Kvd(tmp_path, *args, port=port, fd_socket=fd_socket, wait_ready=wait_ready)
        started.append(k)
        return k

    yield make
    for k in started:
        k.stop()

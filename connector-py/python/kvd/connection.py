"""A kvd connection that survives kvd: when kvd is unreachable or restarts, the connector warns
once, behaves as a cache miss, and reconnects in the background with exponential backoff;
workers register their caches again on every reconnect. vLLM never waits for it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvd import _native
from kvd.config import KvdConfig

log = logging.getLogger("kvd")


class Connection:
    """Holds the current client, if any, and a thread that replaces a broken one."""

    def __init__(self, config: KvdConfig, name: str, role: str, *, connect_now: bool = True) -> None:
        self.config = config
        self.name = name
        self.role = role
        self._client: _native.Client | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hooks: list[Callable[[_native.Client], None]] = []
        self._warned = False
        self._retry_at: float | None = None
        self.connects = 0
        if connect_now:
            self._try_connect()
        self._thread = threading.Thread(target=self._run, name=f"kvd-reconnect-{role}", daemon=True)
        self._thread.start()

    def on_connect(self, hook: Callable[[_native.Client], None]) -> None:
        """Runs ``hook(client)`` now if connected, and after every reconnection."""
        self._hooks.append(hook)
        client = self.client()
        if client is not None:
            self._run_hook(hook, client)

    def client(self) -> _native.Client | None:
        """The live client, or None while kvd is unreachable (never blocks)."""
        c = self._client
        if c is not None and not c.connected():
            self.lost("the connection broke")
            return None
        return c

    def retry_hooks(self, delay_s: float) -> None:
        """Runs the connect hooks again after ``delay_s`` (a hook that kvd refused for now, e.g.
        a registration while kvd still populates its pool)."""
        self._retry_at = time.monotonic() + delay_s
        self._wake.set()

    def lost(self, why: object) -> None:
        """Drops the client after a failure; the background thread reconnects."""
        with self._lock:
            if self._client is None:
                return
            self._client = None
        self._warn(f"lost kvd at {self.config.url} ({why}); serving without it until it is back")
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._client = None

    def _warn(self, msg: str) -> None:
        if not self._warned:
            log.warning("kvd: %s", msg)
            self._warned = True
        else:
            log.debug("kvd: %s", msg)

    def _run_hook(self, hook: Callable[[_native.Client], None], client: _native.Client) -> bool:
        """Runs a hook; False if the connection was lost meanwhile."""
        try:
            hook(client)
        except _native.ConnectionLost as e:
            self.lost(e)
            return False
        except Exception:  # a hook must not kill the reconnect thread
            log.exception("kvd: connection hook failed")
        return True

    def _try_connect(self) -> bool:
        try:
            client = _native.Client(
                self.config.url,
                self.name,
                role=self.role,
                connect_timeout=self.config.connect_timeout_s,
                request_timeout=self.config.request_timeout_s,
                fd_socket=self.config.fd_socket,
            )
        except _native.KvdError as e:
            self._warn(f"cannot reach kvd at {self.config.url} ({e}); serving without it, retrying in the background")
            return False
        # The hooks (the worker's registrations) run before the client is handed out: a load
        # sent on the new connection with the old connection's registrations would fail.
        for hook in list(self._hooks):
            if not self._run_hook(hook, client) or not client.connected():
                self._warn(f"lost kvd at {self.config.url} while setting up the connection; retrying")
                return False
        with self._lock:
            self._client = client
        self.connects += 1
        if self._warned:
            log.warning("kvd: connected to %s again", self.config.url)
            self._warned = False
        return True

    def _run(self) -> None:
        backoff = self.config.reconnect_min_s
        while not self._stop.is_set():
            if self._client is not None:
                self._wake.wait(0.5)
                self._wake.clear()
                client = self._client
                if client is not None and not client.connected():
                    self.lost("the connection broke")
                elif client is not None and self._retry_at is not None and time.monotonic() >= self._retry_at:
                    self._retry_at = None
                    for hook in list(self._hooks):
                        self._run_hook(hook, client)
                continue
            if self._try_connect():
                backoff = self.config.reconnect_min_s
                continue
            deadline = time.monotonic() + backoff
            while not self._stop.is_set() and time.monotonic() < deadline:
                self._wake.wait(min(0.5, deadline - time.monotonic()))
                self._wake.clear()
            backoff = min(backoff * 2, self.config.reconnect_max_s)

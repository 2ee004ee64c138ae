"""Host-memory KV caches shaped exactly like vLLM's, for tests and tools on machines without a
GPU: a ``kvd.HostBuffer`` (a memfd kvd maps as "device" memory) and per-layer views with the
shape and strides vLLM 0.33's ``allocate_kv_cache`` gives each layer."""

from __future__ import annotations

import itertools
import os
import socket
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Sequence, TypeVar

from kvd._native import HostBuffer

ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")


@dataclass
class HostView:
    """A tensor-like view into a HostBuffer (offsets and strides in elements)."""

    buffer: HostBuffer
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    elem: int
    device = SimpleNamespace(type="host")

    def data_ptr(self) -> int:
        return self.buffer.ptr + self.offset * self.elem

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def element_size(self) -> int:
        return self.elem


def order_strides(order: str, layers: int, blocks: int, heads: int, block_tokens: int, content: int) -> tuple[int, dict[str, int]]:
    """The elements of a whole cache laid out in physical order ``order`` (letters L, B, H, N, C,
    outermost first) and each letter's stride in elements."""
    if sorted(order) != sorted("LBHNC"):
        raise ValueError(f"{order}: a layout is a permutation of L, B, H, N, C")
    size = {"L": layers, "B": blocks, "H": heads, "N": block_tokens, "C": content}
    stride: dict[str, int] = {}
    acc = 1
    for c in reversed(order):
        stride[c] = acc
        acc *= size[c]
    return acc, stride


def vllm_cache(order: str, layers: int, blocks: int, heads: int, block_tokens: int, content: int, elem: int = 2) -> tuple[HostBuffer, list[HostView]]:
    """One buffer and ``layers`` views of ``[blocks, heads, tokens, content]`` in physical order
    ``order`` (letters L, B, H, N, C, outermost first), as vLLM 0.33 lays them out."""
    acc, stride = order_strides(order, layers, blocks, heads, block_tokens, content)
    buf = HostBuffer(acc * elem)
    views = [
        HostView(buf, l * stride["L"], (blocks, heads, block_tokens, content), (stride["B"], stride["H"], stride["N"], stride["C"]), elem)
        for l in range(layers)
    ]
    return buf, views


def block_bytes(view: HostView, block: int) -> bytes:
    """Every byte of one block of one layer, in (head, token, content) order."""
    _, h, n, c = view.shape
    sb, sh, sn, sc = view.strides
    e = view.elem
    out = bytearray()
    for hi in range(h):
        for ni in range(n):
            base = view.offset + block * sb + hi * sh + ni * sn
            if sc == 1:
                out += view.buffer.read(base * e, c * e)
            else:
                for ci in range(c):
                    out += view.buffer.read((base + ci * sc) * e, e)
    return bytes(out)


def blocks_bytes(views: Sequence[HostView], blocks: Sequence[int]) -> list[bytes]:
    """``block_bytes`` of every layer for each block in ``blocks``."""
    return [b"".join(block_bytes(v, b) for v in views) for b in blocks]


T = TypeVar("T")


def until(pred: Callable[[], T], timeout: float = 5.0, what: str = "condition", interval: float = 0.005) -> T:
    """Polls ``pred`` until it returns something truthy and returns that; fails the test naming
    ``what`` once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(interval)


#: Ports ``free_port`` hands out: below Linux's ephemeral range (32768-60999 by default), so no
#: outgoing connection takes one between the check and the caller's bind, and below the ports
#: kvd's Rust tests give Redis servers (12000-21999, their cluster bus ports 10000 higher).
_PORTS = range(6000, 12000)
_next_port = itertools.count((os.getpid() * 7919) % len(_PORTS))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a test to bind. A port the kernel picks (``bind``
    to 0) comes from the ephemeral range, where any outgoing connection may take it before the
    test binds it; these are walked from a start of this process's own and never handed out
    twice by one process."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_next_port) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {_PORTS.start}-{_PORTS.stop - 1} on 127.0.0.1")

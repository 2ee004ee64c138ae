"""KV caches shaped as vLLM 0.33 allocates them — one buffer, per-layer ``[blocks, heads, tokens,
content]`` views in a physical order such as BLNHC — on a GPU (torch) or in host memory (a
``kvd.HostBuffer``, so benches/multigpu.py --host runs without torch), and what the multi-GPU
benchmark does to them: fill with a seeded pattern, poison a block range, compare two block
ranges byte for byte. Also the copy ceilings: contiguous pinned copies timed over a fixed span
that starts at a given instant, so that several processes can run them at once.

Block ranges are ``(first, count)`` in block ids; every layer's bytes of those blocks count.
"""

from __future__ import annotations

import time

from kvd.layout import describe

from gpubench import GIB


def _strides(order: str, sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    stride, acc = {}, 1
    for c in reversed(order):
        stride[c] = acc
        acc *= sizes[c]
    return stride, acc


class TorchKv:
    """A KV cache on GPU `ordinal`: an int8 buffer and int16 per-layer views (2-byte elements as
    bf16; integers so that comparisons are bitwise, NaN payloads included)."""

    device = "cuda"

    def __init__(self, order: str, geo: tuple, blocks: int, ordinal: int) -> None:
        import torch

        self.torch = torch
        layers, heads, content, block = geo
        self.block_tokens = block
        self.dev = torch.device("cuda", ordinal)
        stride, acc = _strides(order, {"L": layers, "B": blocks, "H": heads, "N": block, "C": content})
        self.buf = torch.empty(acc * 2, dtype=torch.int8, device=self.dev)
        typed = self.buf.view(torch.int16)
        self.views = [
            torch.as_strided(typed, (blocks, heads, block, content), (stride["B"], stride["H"], stride["N"], stride["C"]), l * stride["L"])
            for l in range(layers)
        ]
        self.spec = describe(self.views)
        self.nbytes = acc * 2

    def stream(self) -> int:
        return int(self.torch.cuda.current_stream(self.dev).cuda_stream)

    def fill(self, seed: int) -> None:
        """A pattern of the byte index and `seed` (integer arithmetic only, so every GPU computes
        the same bytes); no product overflows 63 bits."""
        torch = self.torch
        u = self.buf.view(torch.uint8)
        step = 1 << 26
        for lo in range(0, u.numel(), step):
            hi = min(u.numel(), lo + step)
            i = torch.arange(lo, hi, device=self.dev, dtype=torch.int64)
            x = (i & 0xFFFFFF) * 0x9E3779B1 + (i >> 24) * 0x85EBCA77 + (seed & 0xFFFFF) * 0x27D4EB2F
            x = x ^ (x >> 21)
            x = (x & 0xFFFFFF) * 0x2545F491
            u[lo:hi] = ((x >> 16) & 0xFF).to(torch.uint8)
        self.sync()

    def poison(self, first: int, count: int, value: int = 0x3C3C) -> None:
        for v in self.views:
            v[first:first + count].fill_(value)

    def same(self, a: int, b: int, count: int) -> bool:
        torch = self.torch
        return all(torch.equal(v[a:a + count], v[b:b + count]) for v in self.views)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dev)

    def close(self) -> None:
        self.views = []
        self.buf = None
        self.torch.cuda.empty_cache()


class HostKv:
    """The same cache in a kvd.HostBuffer (a memfd kvd maps as "device" memory: device "host")."""

    device = "host"

    def __init__(self, order: str, geo: tuple, blocks: int, ordinal: int = 0) -> None:
        from kvd.testing import vllm_cache

        layers, heads, content, block = geo
        self.block_tokens = block
        self.buf, self.views = vllm_cache(order, layers, blocks, heads, block, content)
        self.spec = describe(self.views)
        self.nbytes = self.buf.size

    def stream(self) -> int:
        return 0

    def fill(self, seed: int) -> None:
        self.buf.fill_random(2 * seed + 1)

    def _runs(self, first: int, count: int) -> list[tuple[int, int]]:
        """(offset, length) byte runs covering blocks [first, first + count) of every layer."""
        runs = []
        for v in self.views:
            _, h, n, c = v.shape
            sb, sh, sn, sc = v.strides
            e = v.elem
            if sc != 1:
                raise ValueError("HostKv compares layouts whose content dimension is innermost")
            inner = sn == c and (h == 1 or sh == n * c)
            if inner and sb == h * n * c:
                runs.append(((v.offset + first * sb) * e, count * h * n * c * e))
            elif inner:
                runs += [((v.offset + b * sb) * e, h * n * c * e) for b in range(first, first + count)]
            else:
                runs += [((v.offset + b * sb + hi * sh + ni * sn) * e, c * e)
                         for b in range(first, first + count) for hi in range(h) for ni in range(n)]
        return runs

    def poison(self, first: int, count: int, value: int = 0x3C) -> None:
        for off, length in self._runs(first, count):
            self.buf.write(off, bytes([value & 0xFF]) * length)

    def same(self, a: int, b: int, count: int) -> bool:
        return all(self.buf.read(oa, la) == self.buf.read(ob, lb) for (oa, la), (ob, lb) in zip(self._runs(a, count), self._runs(b, count)))

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self.views = []


def make_cache(mode: str, order: str, geo: tuple, blocks: int, ordinal: int):
    """A TorchKv on GPU `ordinal` (mode "cuda") or a HostKv (mode "host")."""
    return TorchKv(order, geo, blocks, ordinal) if mode == "cuda" else HostKv(order, geo, blocks, ordinal)


class Ceilings:
    """Contiguous pinned copies of `size_bytes` on one GPU: device→host, host→device, and both
    at once on two streams, each timed over a fixed span (the same kind of copy as
    dataplane.ceilings(), which takes the best of three 4 GiB copies instead)."""

    def __init__(self, ordinal: int, size_bytes: int = GIB) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda", ordinal)
        self.n = size_bytes
        self.d = [torch.empty(size_bytes, dtype=torch.uint8, device=self.dev) for _ in range(2)]
        self.h = [torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.s = [torch.cuda.Stream(self.dev) for _ in range(2)]
        for fn in (self._d2h, self._h2d, self._both):
            fn()
        torch.cuda.synchronize(self.dev)

    def _d2h(self) -> int:
        with self.torch.cuda.stream(self.s[0]):
            self.h[0].copy_(self.d[0], non_blocking=True)
        return self.n

    def _h2d(self) -> int:
        with self.torch.cuda.stream(self.s[1]):
            self.d[1].copy_(self.h[1], non_blocking=True)
        return self.n

    def _both(self) -> int:
        return self._d2h() + self._h2d()

    def run(self, start_at: float, seconds: float) -> dict[str, float]:
        """GB/s of each kind, the kinds run one after another from `start_at` (a
        time.monotonic() instant, the same in every process), `seconds` each."""
        out = {}
        for k, (name, fn) in enumerate((("d2h", self._d2h), ("h2d", self._h2d), ("both", self._both))):
            begin = start_at + k * (seconds + 0.1)
            time.sleep(max(0.0, begin - time.monotonic()))
            moved, t0 = 0, time.monotonic()
            while True:
                moved += fn() + fn()
                for s in self.s:
                    s.synchronize()
                t = time.monotonic() - t0
                if t >= seconds:
                    break
            out[name] = moved / t / 1e9
        return out

    def close(self) -> None:
        self.d = self.h = []
        self.torch.cuda.empty_cache()
        host_empty = getattr(self.torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()

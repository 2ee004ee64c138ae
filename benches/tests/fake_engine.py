#!/usr/bin/env python3
"""A stand-in for vLLM behind ``node_engine``'s protocol, for ``test_node.py``: prefix caching
by 16-token blocks in a bounded GPU cache (LRU), and, when the engine's kv config names the
connector "Fake", a cache the node's engines share (a folder, one file per block) — enough to
tell a router that keeps a conversation's prefix from one that loses it, and a restarted
engine that finds its conversations in the shared cache from one that recomputes them.
Requests run one at a time; a computed token costs ``S_PER_TOKEN``."""

from __future__ import annotations

import collections
import hashlib
import os
import sys
import time
import zlib
from array import array
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import node_engine as ne  # noqa: E402

BLOCK = 16
S_PER_TOKEN = 2e-5
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")


class FakeLLM:
    def __init__(self, cfg: dict) -> None:
        kv = cfg.get("kv") or {}
        self.shared = kv.get("kv_connector_extra_config", {}).get("fake.dir") if kv.get("kv_connector") == "Fake" else None
        self.capacity = int(cfg["gpu_blocks"])
        self.gpu: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.counts = dict.fromkeys(SOURCES, 0.0)
        self.queue: list[tuple[str, list[int], int, float]] = []
        #: How many requests arrived with each ``kv_transfer_params`` key (what vLLM hands the connector).
        self.kv_keys: collections.Counter[str] = collections.Counter()
        self.n = 0
        self.llm_engine = self

    def enqueue(self, prompts, params, use_tqdm=False):
        self.n += 1
        n, kv = params
        self.kv_keys.update(kv or {})
        self.queue.append((str(self.n), list(prompts[0]["prompt_token_ids"]), n, time.time()))
        return [f"{self.n}-abcdefgh"]

    def abort_request(self, ids) -> None:
        keys = {str(i).split("-", 1)[0] for i in ids}
        self.queue = [q for q in self.queue if q[0] not in keys]

    def _blocks(self, tokens: list[int]) -> list[bytes]:
        out, h = [], b""
        for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            h = hashlib.blake2b(h + array("i", tokens[i:i + BLOCK]).tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def step(self):
        if not self.queue:
            return []
        key, tokens, n, arrived = self.queue.pop(0)
        blocks = self._blocks(tokens)
        gpu = 0
        while gpu < len(blocks) and blocks[gpu] in self.gpu:
            gpu += 1
        ext = gpu
        while self.shared and ext < len(blocks) and os.path.exists(os.path.join(self.shared, blocks[ext].hex())):
            ext += 1
        hit, loaded = gpu * BLOCK, (ext - gpu) * BLOCK
        computed = len(tokens) - hit - loaded
        time.sleep(computed * S_PER_TOKEN)
        first = time.time() - arrived
        for b in blocks:
            self.gpu[b] = None
            self.gpu.move_to_end(b)
            if self.shared:
                open(os.path.join(self.shared, b.hex()), "w").close()
        while len(self.gpu) > self.capacity:
            self.gpu.popitem(last=False)
        for k, v in zip(SOURCES, (hit, loaded, computed), strict=True):
            self.counts[k] += v
        seed = zlib.crc32(array("i", tokens).tobytes())
        out = SimpleNamespace(token_ids=[(seed + i) % 32000 for i in range(n)], finish_reason="length")
        return [SimpleNamespace(request_id=key, finished=True, metrics=SimpleNamespace(first_token_latency=first),
                                outputs=[out], num_cached_tokens=hit + loaded)]


def metrics(llm: FakeLLM) -> dict:
    out = {f"vllm:prompt_tokens_by_source{{source={k}}}": v for k, v in llm.counts.items()}
    out.update({f"fake:requests_with_kv_param{{key={k}}}": float(v) for k, v in llm.kv_keys.items()})
    return out


BACKEND = ne.Backend(load=lambda: "fake", build=FakeLLM, metrics=metrics, params=lambda n, kv=None: (int(n), kv))

if __name__ == "__main__":
    ne.main(BACKEND)

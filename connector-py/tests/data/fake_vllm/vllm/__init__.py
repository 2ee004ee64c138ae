"""A stand-in for vLLM's offline API, just enough of it for scripts/vllm_engine_check.py and
benches/engine.py to run their control flow on machines without vLLM or a GPU
(connector-py/tests/test_engine_scripts.py puts this folder first on PYTHONPATH).

What it models: ``LLM.enqueue`` + ``llm_engine.step()`` finishing a request two steps after it
arrives, a GPU prefix cache of ``num_gpu_blocks_override`` 16-token blocks (LRU), a connector
that holds every block it saw (when ``kv_transfer_config`` is set), ``get_metrics()`` with
``vllm:prompt_tokens_by_source``, and vLLM's refusal of more ranks than GPUs. Tokens are a
function of the prompt, so equal prompts give equal tokens. ``FAKE_STALL=N``: from the N-th
request on, steps never finish anything; ``FAKE_BLOCK=N``: the step blocks for an hour;
``FAKE_NO_CONNECTOR=1``: the connector serves nothing.
"""

import collections
import hashlib
import os
import time

from vllm.v1.metrics.reader import Counter

__version__ = "0.26.0+fake"
BLOCK = 16


class SamplingParams:
    def __init__(self, max_tokens=16, **_):
        self.max_tokens = max_tokens


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    def __init__(self, llm):
        self.llm = llm
        self.queue = []
        self.sources = collections.Counter()
        sched = _Obj(waiting=[], running=[], requests={})
        self.engine_core = _Obj(engine_core=_Obj(scheduler=sched))
        self.vllm_config = _Obj(scheduler_config=_Obj(max_num_seqs=256, max_num_batched_tokens=8192, async_scheduling=False))

    def step(self):
        calls = self.llm.requests
        if os.environ.get("FAKE_BLOCK") and calls >= int(os.environ["FAKE_BLOCK"]):
            time.sleep(3600)
        if os.environ.get("FAKE_STALL") and calls >= int(os.environ["FAKE_STALL"]):
            time.sleep(0.005)
            return []
        outs, keep = [], []
        for r in self.queue:
            r["steps"] -= 1
            (keep if r["steps"] > 0 else outs).append(r)
        self.queue = keep
        return [self._finish(r) for r in outs]

    def _finish(self, r):
        llm, toks = self.llm, r["tokens"]
        keys, h = [], b""
        for i in range((len(toks) - 1) // BLOCK):
            h = hashlib.sha1(h + repr(toks[i * BLOCK:(i + 1) * BLOCK]).encode()).digest()
            keys.append(h)
        gpu = next((i for i, k in enumerate(keys) if k not in llm.gpu), len(keys))
        ext = 0
        if llm.kv:
            ext = next((i for i, k in enumerate(keys[gpu:]) if k not in llm.external), len(keys) - gpu)
        for k in keys:
            llm.gpu.pop(k, None)
            llm.gpu[k] = True
            if llm.kv:
                llm.external.add(k)
        while len(llm.gpu) > llm.capacity:
            llm.gpu.popitem(last=False)
        self.sources["local_cache_hit"] += BLOCK * gpu
        self.sources["external_kv_transfer"] += BLOCK * ext
        self.sources["local_compute"] += len(toks) - BLOCK * (gpu + ext)
        completion = _Obj(token_ids=[(sum(toks) + i) % 997 for i in range(r["n"])], finish_reason="length")
        return _Obj(finished=True, request_id=r["id"], outputs=[completion], num_cached_tokens=BLOCK * (gpu + ext),
                    metrics=_Obj(first_token_latency=1e-6 * len(toks)))

    def abort_request(self, ids):
        self.queue = [r for r in self.queue if r["id"] not in ids]


class LLM:
    def __init__(self, model, **kw):
        if kw.get("tensor_parallel_size", 1) > 1:
            raise ValueError("1 validation error for ParallelConfig\n  Value error, World size (2) is larger than the "
                             "number of available GPUs (1) in this node.")
        self.kv = None if os.environ.get("FAKE_NO_CONNECTOR") else kw.get("kv_transfer_config")
        self.capacity = kw["num_gpu_blocks_override"]
        self.gpu = collections.OrderedDict()
        self.external = set()
        self.requests = 0
        self.llm_engine = _Engine(self)

    def enqueue(self, prompts, sampling_params, use_tqdm=True):
        self.requests += 1
        rid = str(self.requests)
        self.llm_engine.queue.append({"id": rid, "tokens": prompts[0]["prompt_token_ids"],
                                      "n": sampling_params.max_tokens, "steps": 2})
        return [f"{rid}-0f0f0f0f"]  # vLLM appends 8 random characters to the id it hands back

    def get_metrics(self):
        out = [Counter(name="vllm:prompt_tokens_by_source", labels={"engine": "0", "source": k}, value=v)
               for k, v in self.llm_engine.sources.items()]
        return out + [Counter(name="vllm:num_preemptions", labels={"engine": "0"}, value=0)]

"""vLLM's engine loop on CPU, with the real parts wherever vLLM has them.

- the real v1 ``Scheduler`` (with its ``KvdConnector`` made by vLLM's factory, scheduler role);
- a worker-role ``KvdConnector``, also made by vLLM's factory and installed as vLLM's KV
  transfer group, driven through vLLM's own ``KVConnectorModelRunnerMixin`` exactly as its model
  runner drives it: ``kv_connector_no_forward`` for a step that schedules nothing (no
  ``wait_for_save`` there), the ``_get_kv_connector_output`` context around a forward pass;
- host KV memory (``kvd.HostBuffer``, which kvd maps as it maps GPU memory) for every KV cache
  tensor vLLM's planner asked for, shared by the layers vLLM says share it.

What stands in for the model is the forward pass: it writes, for every token it computes, KV
bytes that are a function of the token's whole prefix, its layer and head; for a state layer
(Mamba, ``mamba_cache_mode="align"``) it writes, at the end of a step that ends on a block
boundary, the state after that prefix into the boundary's block, and reads it back at the start
of a request's first step, as vLLM's Mamba kernels start from it. So every byte kvd loads can be
checked against what the forward pass would have written, and the null block (id 0) must stay
zero. Used by test_vllm_engine.py with vLLM 0.33 and 0.26.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.26
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # type: ignore[no-redef]
try:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
except ImportError:  # pragma: no cover
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # type: ignore[no-redef]
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash

import kvd
from kvd.testing import HostView

MODEL = Path(__file__).parent / "data" / "tiny-llama"  # config.json only
EOS = 2
init_none_hash(sha256)


def attention(block: int, heads: int = 2, head_size: int = 64) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)


def vllm_config(url: str, block: int, chunk: int, max_batched: int = 256, **extra: Any) -> VllmConfig:
    mc = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=4096,
                         is_encoder_decoder=False)
    cc = CacheConfig(block_size=block, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.vllm", kv_role="kv_both",
                          kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"kvd.url": url, "kvd.chunk_tokens": chunk, **extra})
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt,
                    device_config=DeviceConfig("cpu"))
    # vLLM turns its hybrid allocator off on CPU platforms (for its kernels); the scheduler,
    # the grouping and the connector calls are the same Python either way, so turn it back on
    # to see hybrid models as a GPU runs them. (vLLM 0.26 turns it off under any connector.)
    if getattr(vc.scheduler_config, "disable_hybrid_kv_cache_manager", None) and supports_hma_config(kt):
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vc


def supports_hma_config(kt: KVTransferConfig) -> bool:
    check = getattr(KVConnectorFactory, "supports_hma_config", None)
    return bool(check and check(kt))


def entry_blocks(sched: Any, info: Any, c: int) -> tuple[int, int]:
    """Block indices [first, end) in the request's block table that chunk ``c``'s entry holds in
    a sliding group (``kvd.groups.window_entry``: the chunk's tail, or all of it)."""
    per = sched.chunk_tokens // info.block_tokens
    return (c + 1) * per - (sched._tail(info) or per), (c + 1) * per


def token_kv(prefix: bytes, layer: str, head: int, nbytes: int) -> bytes:
    """The KV bytes the stand-in forward pass writes for one token of one layer and head."""
    d = hashlib.blake2b(prefix + layer.encode() + head.to_bytes(2, "little"), digest_size=64).digest()
    return (d * (nbytes // 64 + 1))[:nbytes]


def _resolve_layout(vc: VllmConfig, specs: list[Any]) -> None:
    """What vLLM 0.33's engine core does before planning: resolve one KV layout, the
    connector's preference among what the backends accept (0.26 has no such step)."""
    try:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    except ImportError:
        return
    resolve_kv_cache_layout(vc, [[l.name for l in get_supported_kv_cache_layouts([])]], specs)


def _vllm_views(vc: VllmConfig, kvc: Any) -> dict[str, Any] | None:
    """Each layer's view as vLLM 0.33's allocator makes it (on the meta device: shapes, strides
    and offsets only), or None where this vLLM has no such allocator."""
    try:
        from vllm.v1.worker.utils import allocate_kv_cache
    except ImportError:
        return None
    layout = vc.cache_config.get_resolved_kv_cache_layout()
    return dict(allocate_kv_cache(kvc, torch.device("meta"), layout))


@dataclass
class Layer:
    name: str
    group: int
    view: HostView
    spec: Any

    @property
    def block_tokens(self) -> int:
        return int(self.spec.block_size)

    @property
    def modelled(self) -> bool:
        """Attention layers: the stand-in forward writes their KV token by token."""
        return hasattr(self.spec, "num_kv_heads")

    @property
    def state(self) -> bool:
        """A Mamba layer: one state per block, written at a step's end on a block boundary."""
        return type(self.spec).__name__ == "MambaSpec"

    def state_offset(self, block: int) -> int:
        return (self.view.offset + block * self.view.strides[0]) * self.view.elem

    @property
    def state_bytes(self) -> int:
        return self.view.shape[3] * self.view.elem

    @property
    def rows(self) -> int:
        """Rows of states per block: block_tokens, or fewer for a compressed layer."""
        return int(self.view.shape[2])

    @property
    def per_row(self) -> int:
        return self.block_tokens // self.rows

    def offset(self, block: int, head: int, p: int) -> int:
        """Byte offset of token ``p``'s row (its state's) of ``head`` in ``block``."""
        sb, sh, sn, _ = self.view.strides
        return (self.view.offset + block * sb + head * sh + ((p % self.block_tokens) // self.per_row) * sn) * self.view.elem

    @property
    def row_bytes(self) -> int:
        return self.view.shape[3] * self.view.elem


def layer_view(buf: Any, spec: Any, size: int) -> HostView:
    """A [blocks, heads, rows, content] view of a whole KV cache tensor, block-outermost (the
    order vLLM's attention backends lay one layer's tensor out in)."""
    heads = int(getattr(spec, "num_kv_heads", 1))
    rows = int(getattr(spec, "storage_block_size", spec.block_size))
    page = int(spec.page_size_bytes)
    elem = 2 if page % (rows * heads * 2) == 0 else 1
    c = page // (rows * heads * elem)
    return HostView(buf, 0, (size // page, heads, rows, c), (page // elem, c, heads * c, 1), elem)


@dataclass
class Engine:
    """One engine: scheduler, worker connector, host KV cache."""

    vc: VllmConfig
    specs: dict[str, Any]
    num_blocks: int
    s: Scheduler = field(init=False)
    worker: Any = field(init=False)
    layers: list[Layer] = field(init=False)
    steps: int = 0
    #: Per request: the chained prefix digest of every token so far.
    digests: dict[str, list[bytes]] = field(default_factory=dict)
    #: States the stand-in forward started a request from: (request, tokens before it).
    resumed_states: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _resolve_layout(self.vc, list(self.specs.values()))
        # Prefix-cache hashes cover the smallest block of any group (DeepSeek-V4: 64-token
        # sliding-window blocks beside 256-token compressed ones).
        self.hash_block = math.gcd(*(int(sp.block_size) for sp in self.specs.values()))
        groups = get_kv_cache_groups(self.vc, self.specs)
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        per_group = max(len(g.layer_names) for g in groups)
        kvc = get_kv_cache_config_from_groups(self.vc, groups, available_memory=self.num_blocks * page * per_group)
        self.vc.cache_config.num_gpu_blocks = kvc.num_blocks
        self.kvc = kvc
        # As the engine core does: the scheduler gets the workers' config with each group's
        # UniformTypeKVCacheSpecs wrapper replaced by its first layer's spec.
        self.s = Scheduler(vllm_config=self.vc, kv_cache_config=generate_scheduler_kv_cache_config([kvc]), structured_output_manager=StructuredOutputManager(self.vc),
                           log_stats=True, **self._block_sizes())
        self.worker = KVConnectorFactory.create_connector(config=self.vc, role=KVConnectorRole.WORKER, kv_cache_config=kvc)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        group_of = {name: g for g, grp in enumerate(kvc.kv_cache_groups) for name in grp.layer_names}
        # Each layer's spec as the planner left it (page sizes unified across groups).
        spec_of = {}
        for grp in kvc.kv_cache_groups:
            inner = getattr(grp.kv_cache_spec, "kv_cache_specs", None)
            for name in grp.layer_names:
                spec_of[name] = inner[name] if isinstance(inner, dict) else grp.kv_cache_spec
        self.layers = []
        real = _vllm_views(self.vc, kvc)
        if real is not None:
            # vLLM 0.33: one backing allocation; every layer's [B, H, N, C] view into it, with
            # the shape, strides and offset vLLM's own allocate_kv_cache gives it.
            buf = kvd.HostBuffer(kvc.kv_cache_tensors[0].size)
            self.buffers = [buf]
            for name, t in real.items():
                view = HostView(buf, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), int(t.element_size()))
                self.layers.append(Layer(name, group_of[name], view, spec_of[name]))
        else:
            # vLLM 0.26: one tensor per KVCacheTensor, aliased by the layers that share it.
            self.buffers = []
            for t in kvc.kv_cache_tensors:
                buf = kvd.HostBuffer(t.size)
                self.buffers.append(buf)
                for name in t.shared_by:
                    self.layers.append(Layer(name, group_of[name], layer_view(buf, spec_of[name], t.size), spec_of[name]))
        self.worker.register_kv_caches({l.name: l.view for l in self.layers})
        self.hasher = get_request_block_hasher(self.hash_block, sha256)

    def _block_sizes(self) -> dict[str, int]:
        """The scheduler's granularity (the LCM of the groups' block sizes) and, where this
        vLLM takes it apart, the prefix-hash block (their GCD)."""
        # The planner may have changed a group's block size to even out page sizes (vLLM 0.26
        # gives Gemma-4-style sliding groups 32-token blocks beside 16-token full attention).
        sizes = [int(g.kv_cache_spec.block_size) for g in self.kvc.kv_cache_groups]
        if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters:
            return {"block_size": math.lcm(*sizes), "hash_block_size": self.hash_block}
        return {"block_size": math.lcm(self.vc.cache_config.block_size, *sizes)}

    # --- requests ---------------------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1, sp: SamplingParams | None = None) -> None:
        """A request of ``tokens``, with ``max_tokens`` (or ``sp``, e.g. from vLLM's
        ``CompletionRequest.to_sampling_params``)."""
        sp = sp or SamplingParams(max_tokens=max_tokens)
        sp.update_from_generation_config({}, EOS)
        self.s.add_request(Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=sp,
                                   pooling_params=None, block_hasher=self.hasher))

    def _digest(self, req: Request, upto: int) -> list[bytes]:
        d = self.digests.setdefault(req.request_id, [])
        h = d[-1] if d else b""
        for tok in req.all_token_ids[len(d):upto]:
            h = hashlib.blake2b(h + int(tok).to_bytes(8, "little"), digest_size=16).digest()
            d.append(h)
        return d

    # --- the loop ---------------------------------------------------------------------------

    def step(self) -> Any:
        """One engine step, as vLLM's EngineCore and model runner do it."""
        # vLLM's model-runner plumbing finds the worker connector in a process-wide global:
        # this engine's, where a test runs two.
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        out = self.s.schedule()
        self.steps += 1
        if out.total_num_scheduled_tokens == 0:
            mro = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.vc)
        else:
            if out.preempted_req_ids:
                self.worker.handle_preemptions(out.kv_connector_metadata)
            with set_forward_context(None, self.vc), KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv:
                sampled = self._forward(out)
            ids = list(out.num_scheduled_tokens)
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[sampled.get(r, []) for r in ids], logprobs=None,
                                    prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv)
        self.s.update_from_output(out, mro)
        self.check_null_block()
        return out

    def _blocks(self, req_id: str) -> list[list[int]]:
        return [list(b) for b in self.s.kv_cache_manager.get_blocks(req_id).get_block_ids()]

    def _forward(self, out: Any) -> dict[str, list[int]]:
        """Writes the KV of every token the step computes; samples a token for each request
        whose prompt is done."""
        sampled: dict[str, list[int]] = {}
        # Tokens computed before the step (the scheduler has already advanced the requests).
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        # A request starts from a stored state in its first step (new, or resumed after a
        # preemption): the one in the block of the boundary it starts at, as vLLM's kernels do.
        starting = {r.req_id for r in out.scheduled_new_reqs} | set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.s.requests[req_id]
            start = computed[req_id]
            digests = self._digest(req, start + n)
            blocks = self._blocks(req_id)
            for layer in (l for l in self.layers if l.state):
                if req_id in starting and start:
                    self.check_state(req_id, layer, blocks, start, digests)
                end = start + n
                if end % layer.block_tokens == 0:
                    b = blocks[layer.group][end // layer.block_tokens - 1]
                    assert b != 0, f"{req_id}: the state after token {end} of {layer.name} would go to the null block"
                    layer.view.buffer.write(layer.state_offset(b), token_kv(digests[end - 1], layer.name, 0, layer.state_bytes))
            if starting and req_id in starting and start and any(l.state for l in self.layers):
                self.resumed_states.append((req_id, start))
            for layer in self.layers:
                if not layer.modelled:
                    continue
                for p in range(start, start + n):
                    if (p + 1) % layer.per_row and p + 1 != start + n:
                        continue  # a compressed row is written with its state's last token
                    b = blocks[layer.group][p // layer.block_tokens]
                    assert b != 0, f"{req_id}: token {p} of {layer.name} would be computed into the null block"
                    for h in range(layer.view.shape[1]):
                        layer.view.buffer.write(layer.offset(b, h, p), token_kv(digests[p], layer.name, h, layer.row_bytes))
            if start + n >= req.num_tokens:
                sampled[req_id] = [1000 + int.from_bytes(digests[-1][:2], "little") % 1000]
        return sampled

    # --- checks -----------------------------------------------------------------------------

    def check_state(self, req_id: str, layer: Layer, blocks: list[list[int]], start: int, digests: list[bytes]) -> None:
        """The state a request starts from after ``start`` tokens (vLLM's prefix cache or kvd's
        load put it there) is the one the forward pass wrote after that very prefix."""
        assert start % layer.block_tokens == 0, f"{req_id} starts mid-block ({start}) in state layer {layer.name}"
        b = blocks[layer.group][start // layer.block_tokens - 1]
        assert b != 0, f"{req_id}: the state it starts from after {start} tokens is the null block"
        got = layer.view.buffer.read(layer.state_offset(b), layer.state_bytes)
        assert got == token_kv(digests[start - 1], layer.name, 0, layer.state_bytes), (
            f"{req_id}: the state of {layer.name} after {start} tokens (block {b}) holds other bytes")

    def check_null_block(self) -> None:
        for layer in (l for l in self.layers if l.state):
            assert layer.view.buffer.read(layer.state_offset(0), layer.state_bytes) == bytes(layer.state_bytes), (
                f"the null block of state layer {layer.name} was written")
        zero = {}
        for layer in (l for l in self.layers if l.modelled):
            z = zero.setdefault(layer.row_bytes, bytes(layer.row_bytes))
            for h in range(layer.view.shape[1]):
                for r in range(layer.rows):
                    got = layer.view.buffer.read(layer.offset(0, h, r * layer.per_row), layer.row_bytes)
                    assert got == z, f"the null block of {layer.name} was written (head {h}, row {r})"

    def check_kv(self, req_id: str, upto: int) -> int:
        """Checks every byte of the request's first ``upto`` tokens in every block vLLM holds
        for them (a sliding window's null blocks excepted); returns the tokens checked."""
        req = self.s.requests[req_id]
        digests = self._digest(req, upto)
        blocks = self._blocks(req_id)
        checked = 0
        for layer in (l for l in self.layers if l.modelled):
            for p in range(layer.per_row - 1, upto, layer.per_row):
                b = blocks[layer.group][p // layer.block_tokens]
                if b == 0:
                    continue
                for h in range(layer.view.shape[1]):
                    got = layer.view.buffer.read(layer.offset(b, h, p), layer.row_bytes)
                    assert got == token_kv(digests[p], layer.name, h, layer.row_bytes), (
                        f"{req_id}: token {p} of {layer.name} (block {b}) holds other bytes")
                checked += 1
        return checked

    def run(self, until: Any, timeout: float = 10.0, what: str = "condition") -> None:
        """Steps until ``until()`` holds; fails, naming ``what``, after ``timeout`` seconds or
        10,000 steps (a livelocked engine keeps stepping)."""
        deadline = time.monotonic() + timeout
        for _ in range(10_000):
            if until():
                return
            self.step()
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        waiting = {r: q.status.name for r, q in self.s.requests.items()}
        raise AssertionError(f"{what} not reached after {self.steps} steps; requests: {waiting}; "
                             f"free blocks {self.s.kv_cache_manager.block_pool.get_num_free_blocks()}")

    def finished(self, req_id: str) -> bool:
        return req_id not in self.s.requests

    def close(self) -> None:
        self.worker.shutdown()
        self.s.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None

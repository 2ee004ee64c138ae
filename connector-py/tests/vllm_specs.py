"""KV-cache specs of hybrid models (DeepSeek-V4, Gemma-3, Gemma-4, Qwen3-Next) made by vLLM 0.33's
own layer classes, for ``vllm_engine.Engine(vc, specs, num_blocks)``.

Nothing here writes a KVCacheSpec. Each layer is one of vLLM's own (``Attention``; Qwen3-Next's
``QwenGatedDeltaNetAttention``), built under ``set_current_vllm_config(vc)`` from the model's
transformers config (small dimensions, the model's real layer pattern) the way vLLM's model file
builds it, and each spec is what vLLM's model runner makes of the layer: its
``get_kv_cache_spec(vc)``, customised for its attention backend (gpu_model_runner.py
``get_kv_cache_spec``). So block size, KV dtype and ``mamba_cache_mode`` are those of ``vc``.

What stands in for the GPU, and why:

- the attention backend: vLLM on a machine without a GPU (its UnspecifiedPlatform) picks none, so
  the layers are given the one vLLM's CUDA platform puts first on an H200 (``FLASH_ATTN``,
  vllm/platforms/cuda.py ``_get_backend_priorities``). It decides the sliding-window block size.
- ``current_platform.current_device()``, which that platform lacks and the GDN layer calls once
  (for its norm's weight): it is the CPU while the layers are built.

The GDN layer picks its prefill kernel by platform. Here (no CUDA) that is Triton; on an H200 it is
FlashInfer, whose layers also export mid-prefill checkpoints (``num_prefill_checkpoint_blocks=1``,
alignment 64) and make vLLM align the block size to 64, unless vLLM is started with
``--additional-config '{"gdn_prefill_backend": "triton"}'``.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from kvd.testing import free_port
from transformers import Gemma3TextConfig, Gemma4TextConfig, Qwen3NextConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec
from vllm.v1.worker.utils import customize_attention_spec

#: The attention backend the layers get (see the module docstring).
BACKEND = "FLASH_ATTN"
#: Small dimensions, so the layers build in moments on a CPU: 2 KV heads of 64, bf16 (the
#: engine's model dtype).
SMALL: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, vocab_size=1000,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def gemma3_specs(vc: VllmConfig, num_layers: int = 6, window: int = 64,
                 backend: str = BACKEND) -> dict[str, KVCacheSpec]:
    """Gemma-3: transformers' ``Gemma3TextConfig`` makes the layer types (``sliding_window_pattern``
    6: five sliding layers to one full), and each layer's ``Attention`` gets the window exactly
    where vLLM's gemma3.py ``Gemma3Attention`` gives it one."""
    cfg = Gemma3TextConfig(num_hidden_layers=num_layers, sliding_window=window, **SMALL)
    root = _root(vc)
    with _building(vc):
        layers = [_attention(vc, cfg, root, i, cfg.head_dim, cfg.num_key_value_heads, backend)
                  for i in range(num_layers)]
    return _specs(vc, {layer.layer_name: layer for layer in layers})


def gemma4_specs(vc: VllmConfig, num_layers: int = 12, window: int = 64, head_dim: int = 64,
                 global_head_dim: int = 128, backend: str = BACKEND) -> dict[str, KVCacheSpec]:
    """Gemma-4: five sliding layers to one full, whose heads are wider (``global_head_dim``;
    512 beside 256 in the real models, 128 beside 64 here). Each layer's head size and KV heads
    are read from ``config.per_layer_config[i]`` as vLLM's gemma4.py ``Gemma4DecoderLayer`` does.
    (No KV-shared layers: ``num_kv_shared_layers`` is 0, as in the large Gemma-4 models.)"""
    small = {**SMALL, "head_dim": head_dim}
    cfg = Gemma4TextConfig(num_hidden_layers=num_layers, sliding_window=window,
                           global_head_dim=global_head_dim, **small)
    root = _root(vc)
    with _building(vc):
        layers = [_attention(vc, cfg, root, i, cfg.per_layer_config[i].head_dim,
                             cfg.per_layer_config[i].num_key_value_heads, backend)
                  for i in range(num_layers)]
    return _specs(vc, {layer.layer_name: layer for layer in layers})


def qwen3_next_specs(vc: VllmConfig, num_layers: int = 8, backend: str = BACKEND) -> dict[str, KVCacheSpec]:
    """Qwen3-Next: transformers' ``Qwen3NextConfig`` makes the layer types (``full_attention_interval``
    4: three linear-attention layers to one full). A linear-attention layer is vLLM's
    ``QwenGatedDeltaNetAttention`` as qwen3_next.py ``Qwen3NextDecoderLayer`` builds it, its
    MambaSpec its own; a full-attention layer is vLLM's ``Attention`` with the config's heads.

    Sets on ``vc`` what vLLM sets for every hybrid model before building it (its
    ``MambaModelConfig.verify_and_update_config``): with prefix caching on, ``mamba_cache_mode``
    "align" and ``mamba_block_size`` = ``block_size``. vLLM's platform would also pad the Mamba
    page to the attention page (``mamba_page_size_padded``, ``_align_hybrid_block_size``), which
    needs a ModelConfig of Qwen3-Next itself; it is left unset (the planner unifies the pages)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.models.config import MambaModelConfig

    # Conv state (3, 192) and recurrent state (2, 32, 32) in bf16: 5248 bytes, under the 8192 of
    # a 16-token attention block, so vLLM would keep the engine's block size.
    cfg = Qwen3NextConfig(num_hidden_layers=num_layers, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=32, linear_value_head_dim=32, **SMALL)
    MambaModelConfig.verify_and_update_config(vc)
    root = _root(vc)
    layers: dict[str, Any] = {}
    with _building(vc), _current_device():
        _init_distributed()
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                name = f"{root}.layers.{i}.linear_attn"
                layers[name] = QwenGatedDeltaNetAttention(cfg, vllm_config=vc, prefix=name,
                                                          gqa_interleaved_layout=True)
            else:
                layer = _attention(vc, cfg, root, i, cfg.head_dim, cfg.num_key_value_heads, backend)
                layers[layer.layer_name] = layer
    return _specs(vc, layers)


def dsv4_specs(vc: VllmConfig, num_layers: int | None = None) -> dict[str, KVCacheSpec]:
    """DeepSeek-V4 from its own transformers config (``DeepseekV4Config``: the real layer types,
    compress rates, head sizes, window; ``num_layers`` cuts it, None is its full depth of 43),
    with the cache layers vLLM's ``DeepseekV4Attention`` makes for each layer (attention.py):
    the sliding-window cache (``DeepseekV4SWACache``), and for a compressed layer (compress rate
    4 or 128) its compressed MLA cache and its compressor's state cache
    (``CompressorStateCache``), and for a rate-4 layer the indexer's key cache
    (``DeepseekV4IndexerCache``, fp8 keys with their scales) and the indexer compressor's state.
    Each spec is that layer's ``get_kv_cache_spec(vc)``. The attention's own spec is
    ``DeepseekV4Attention.get_kv_cache_spec`` run on the fields it reads (its constructor makes
    CUDA events and cannot run on a CPU). The cache dtype is fp8_ds_mla, as DeepSeek-V4 runs on
    FlashMLA (vLLM writes it back onto the cache config, ``_resolve_dsv4_kv_cache_dtype``)."""
    from types import SimpleNamespace

    from transformers import DeepseekV4Config
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    cfg = DeepseekV4Config() if num_layers is None else DeepseekV4Config(num_hidden_layers=num_layers)
    cc = vc.cache_config
    cc.cache_dtype = "fp8_ds_mla"
    root = _root(vc)
    specs: dict[str, KVCacheSpec] = {}
    with _building(vc):
        for i, kind in enumerate(cfg.layer_types[: cfg.num_hidden_layers]):
            p = f"{root}.layers.{i}.attn"
            ratio = max(1, cfg.compress_rates.get(kind, 0))
            caches: list[Any] = [DeepseekV4SWACache(head_dim=cfg.head_dim, window_size=cfg.sliding_window,
                                                    dtype=torch.uint8, prefix=f"{p}.swa_cache", cache_config=cc)]
            if ratio > 1:
                attn = SimpleNamespace(compress_ratio=ratio, kv_cache_dtype="fp8_ds_mla", head_dim=cfg.head_dim,
                                       kv_cache_torch_dtype=torch.uint8)
                specs[p] = DeepseekV4Attention.get_kv_cache_spec(attn, vc)  # type: ignore[arg-type]
                overlap = 1 + (ratio == 4)  # DeepseekCompressor's coff
                caches.append(CompressorStateCache(state_dim=2 * overlap * cfg.head_dim, dtype=torch.float32,
                                                   compress_ratio=ratio, prefix=f"{p}.compressor.state_cache"))
            if ratio == 4:  # only C4 layers have the sparse-attention indexer
                ih = cfg.index_head_dim
                caches.append(DeepseekV4IndexerCache(head_dim=ih + ih // 128 * 4, dtype=torch.uint8,
                                                     prefix=f"{p}.indexer.k_cache", cache_config=cc,
                                                     compress_ratio=ratio))
                caches.append(CompressorStateCache(state_dim=2 * 2 * ih, dtype=torch.float32, compress_ratio=ratio,
                                                   prefix=f"{p}.indexer.compressor.state_cache"))
            for c in caches:
                specs[c.prefix] = c.get_kv_cache_spec(vc)
    return specs


# --- vLLM's steps ------------------------------------------------------------------------------


def _attention(vc: VllmConfig, cfg: Any, root: str, i: int, head_dim: int, kv_heads: int,
               backend: str) -> Attention:
    """Layer ``i``'s ``Attention`` as vLLM's Gemma and Qwen3-Next model files make it: a window
    only where the config's layer type is "sliding_attention" (gemma3.py, gemma4.py)."""
    window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
    return Attention(cfg.num_attention_heads, head_dim, head_dim**-0.5, num_kv_heads=kv_heads,
                     cache_config=vc.cache_config, per_layer_sliding_window=window,
                     prefix=f"{root}.layers.{i}.self_attn.attn",
                     attn_backend=AttentionBackendEnum[backend].get_class())


def _specs(vc: VllmConfig, layers: dict[str, Any]) -> dict[str, KVCacheSpec]:
    """vLLM's model runner's ``get_kv_cache_spec`` (gpu_model_runner.py), for these layers."""
    specs: dict[str, KVCacheSpec] = {}
    for name, layer in layers.items():
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue  # uses another layer's KV cache: no spec of its own
        spec = layer.get_kv_cache_spec(vc)
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if spec is not None:
            specs[name] = spec
    return specs


def _root(vc: VllmConfig) -> str:
    """A module root no layer of ``vc`` has yet ("model", then "model2", ...): layer names are
    unique in ``vc``'s ``static_forward_context``, with one integer each (extract_layer_index)."""
    used = {name.split(".", 1)[0] for name in vc.compilation_config.static_forward_context}
    roots = itertools.chain(["model"], (f"model{n}" for n in itertools.count(2)))
    return next(r for r in roots if r not in used)


@contextmanager
def _building(vc: VllmConfig) -> Iterator[None]:
    """As vLLM's model loader builds a model: ``vc`` current, the model dtype the default."""
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype):
        yield


@contextmanager
def _current_device() -> Iterator[None]:
    """The CPU as ``current_platform.current_device()`` where the platform has none."""
    if hasattr(type(current_platform), "current_device"):
        yield
        return
    from unittest import mock

    with mock.patch.object(type(current_platform), "current_device",
                           staticmethod(lambda: torch.device("cpu")), create=True):
        yield


def _init_distributed() -> None:
    """vLLM's distributed state (one rank, gloo), once per process: the GDN layer asks for its
    tensor-parallel size and rank."""
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    port = free_port()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ensure_model_parallel_initialized(1, 1)

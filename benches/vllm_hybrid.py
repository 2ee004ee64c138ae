"""The hybrid KV-cache models of the real-engine check (``scripts/vllm_engine_check.py
--scenarios hybrid``): which dummy-weight config, and how the engine must be started so that
kvd's 256-token chunks are whole blocks of every KV-cache group and a 12,289-token prompt leaves
the GPU after others push it out (``pushes_to_evict``); what vLLM made of it (its KV-cache
groups, read from the in-process engine); and the check's closing summary.

The configs are ``benches/models/<name>/config.json`` (weights are vLLM's ``load_format="dummy"``).
The GPU block counts were found with vLLM 0.26's own scheduler and KV-cache manager on CPU, no
model (``benches/vllm_hybrid_plan.py`` does it again): the second run of A is a 12,288-token GPU
prefix-cache hit, and after four other 12,289-token prompts A's hit is 0. vLLM 0.33's hybrid
allocator gives all groups one pool, so there the check counts the pushes from the groups vLLM made.

Like ``vllm_harness``, nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(ROOT, "benches", "models")


@dataclass(frozen=True)
class HybridModel:
    """One hybrid model and the engine settings its check needs."""

    #: What the model exercises, for the report.
    about: str
    #: Tokens per block of the attention groups (``LLM(block_size=...)``).
    block_size: int
    #: ``num_gpu_blocks_override``: small enough that four other prompts push A out.
    gpu_blocks: int
    #: More ``LLM(...)`` keywords.
    llm: dict[str, Any] = field(default_factory=dict)


MODELS: dict[str, HybridModel] = {
    # 12 layers, 5 sliding (512-token window) to 1 full, as Gemma 3: six KV-cache groups of two
    # layers (five SlidingWindowSpec, one FullAttentionSpec), 16-token blocks. 2,048 tokens a
    # step: a step's sliding groups hold their window plus the step's tokens (a whole 12k
    # prompt in one step would need ~4,600 blocks); 3,072 blocks of 64 KiB (2,048 did not admit
    # A at all in the CPU run).
    "gemma3-swa": HybridModel(
        about="Gemma3ForCausalLM, sliding window 512 (5:1 with full attention)",
        block_size=16,
        gpu_blocks=3072,
        llm={"max_num_batched_tokens": 2048},
    ),
    # NemotronH, dense ("M-M-*-M-M-*-": Mamba2, MLP, attention; no MoE): one attention group and
    # two Mamba2 groups of two layers. 256-token blocks: the attention page (8 KV heads of 128,
    # bf16: 1 MiB) is above the Mamba2 state (269 KiB with its float32 SSM state), which vLLM
    # pads to it (platforms/interface.py::_align_hybrid_block_size). mamba_cache_mode "align":
    # vLLM keeps the state at block boundaries, what kvd stores; left to itself vLLM picks "all"
    # for this model (it supports Mamba prefix caching), which kvd refuses. A prompt holds ~51
    # blocks: 160 keep three prompts.
    "nemotronh-mamba": HybridModel(
        about="NemotronHForCausalLM (dense), Mamba2 + attention, mamba_cache_mode align",
        block_size=256,
        gpu_blocks=160,
        llm={"mamba_cache_mode": "align"},
    ),
    # Qwen3-Next, 6 layers "L L F L L F": Gated DeltaNet linear attention (a MambaSpec of
    # mamba_type gdn_attention: a conv state and a 8 x 128 x 128 bf16 recurrent state, 268 KiB)
    # beside gated full attention (2 KV heads of 256: 512 KiB a 256-token page); MoE of 8
    # experts, 2 a token. The same group shape as NemotronH's (one attention group, two state
    # groups of two layers), so the same 256-token blocks and 160 of them. mamba_cache_mode
    # "align": vLLM refuses "all" for Qwen3-Next (qwen3_next.py, Qwen3NextForCausalLM.__init__).
    # gdn_prefill_backend "triton": on sm90 "auto" picks FlashInfer's JIT GDN prefill
    # (qwen_gdn_linear_attn.py::_resolve_gdn_prefill_backend), and flashinfer is not installed
    # on the GPU host.
    "qwen3-next-tiny": HybridModel(
        about="Qwen3NextForCausalLM, Gated DeltaNet linear attention + full attention, mamba_cache_mode align",
        block_size=256,
        gpu_blocks=160,
        llm={"mamba_cache_mode": "align", "gdn_prefill_backend": "triton"},
    ),
    # DeepSeek-V4, 4 layers with compress ratios 0, 4, 128, 4 (the fifth entry is the MTP
    # layer's, unused): every layer a 128-token sliding window (SlidingWindowMLASpec, 64-token
    # blocks), C4 layers a compressed MLA cache (MLAAttentionSpec, compress_ratio 4) with the
    # lightning indexer's own compressed key cache, the C128 layer one of compress_ratio 128,
    # and the compressors' state caches (4- and 8-token blocks). The real model's head shapes
    # (64 heads of 512, rope 64, indexer 64 x 128, o_groups 8) because the FlashMLA sparse
    # kernels and the fp8 paths key on them; fp8 block-quantized linears (quantization_config)
    # with fp8 experts (expert_dtype "fp8": the float32 block scales the sm90 DeepGEMM recipe
    # reads). 256-token blocks: DeepseekSparseSWABackend's preferred size, and C128 needs a
    # multiple of 128. kv_cache_dtype "fp8": the FlashMLA path stores fp8_ds_mla and asserts an
    # fp8 cache (models/deepseek_v4/attention.py::_resolve_dsv4_kv_cache_dtype). 512 tokens a
    # step: the state groups' small blocks hold a whole step's tokens. The block count was not
    # planned on CPU (vllm_hybrid_plan.py cannot build DSV4's layer specs without its kernels).
    # On the H200 with vLLM 0.33 (session 14) 1,024 blocks admitted the 16k request; vLLM made 5
    # groups (2 sliding MLA of 64-token blocks, the compressed MLA of 256, the compressor states
    # of 4 and 8) and set the scheduler's block to 4; 22 pushes (pushes_to_evict) evicted A.
    # DeepSeek-V4 needs vLLM 0.33 (VLLM033=1 in scripts/device-vllm.sh): 0.26's model imports
    # kernels the host lacks.
    "deepseek-v4-tiny": HybridModel(
        about="DeepseekV4ForCausalLM: SWA + C4 (indexer) + C128 compressed sparse MLA, fp8",
        block_size=256,
        gpu_blocks=1024,
        llm={"kv_cache_dtype": "fp8", "max_num_batched_tokens": 512},
    ),
}


def model_dir(name: str, models_dir: str = MODELS_DIR) -> str:
    return os.path.join(models_dir, name)


def engine_facts(llm: Any) -> dict[str, Any]:
    """What vLLM made of the model: the cache settings it settled on and each KV-cache group
    (spec type, block size, page bytes, window, layers), from the in-process engine core
    (VLLM_ENABLE_V1_MULTIPROCESSING=0); an ``error`` entry where it cannot be read."""
    facts: dict[str, Any] = {}
    try:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        cc = core.vllm_config.cache_config
    except AttributeError as e:
        return {"error": f"engine core not in this process ({e})"}
    for k in ("block_size", "num_gpu_blocks", "mamba_cache_mode", "mamba_block_size", "mamba_page_size_padded"):
        facts[k] = getattr(cc, k, None)
    facts["hybrid_allocator"] = not getattr(core.vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", True)
    groups = []
    for g in sched.kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        try:
            page = int(spec.page_size_bytes)
        except (AttributeError, NotImplementedError, TypeError, AssertionError):  # not every spec type has one
            page = None
        groups.append({
            "type": type(spec).__name__,
            "block_size": getattr(spec, "block_size", None),
            "page_bytes": page,
            "window": getattr(spec, "sliding_window", None),
            "layers": len(g.layer_names),
        })
    facts["groups"] = groups
    connector = sched.get_kv_connector() if hasattr(sched, "get_kv_connector") else getattr(sched, "connector", None)
    facts["connector"] = type(connector).__name__ if connector is not None else None
    # KvdConnector.disabled: why kvd turned itself off for this model (None when it serves).
    facts["connector_off"] = getattr(connector, "disabled", None)
    return facts


def describe_groups(facts: dict[str, Any]) -> str:
    """One line: ``3 KV cache groups: 2 x MambaSpec (256-token blocks, 2 layers, 1024 KiB pages); ...``."""
    if "error" in facts:
        return f"KV cache groups unreadable: {facts['error']}"
    kinds: dict[str, int] = {}  # alike groups once, with their count, in vLLM's order
    for g in facts["groups"]:
        page = f", {g['page_bytes'] // 1024} KiB pages" if g["page_bytes"] else ""
        window = f", window {g['window']}" if g["window"] else ""
        kind = f"{g['type']} ({g['block_size']}-token blocks, {g['layers']} layers{window}{page})"
        kinds[kind] = kinds.get(kind, 0) + 1
    parts = [f"{n} x {k}" for k, n in kinds.items()]
    return (f"{len(facts['groups'])} KV cache groups: " + "; ".join(parts)
            + f" | block_size {facts['block_size']}, num_gpu_blocks {facts['num_gpu_blocks']}, "
            f"mamba_cache_mode {facts['mamba_cache_mode']}, mamba_page_size_padded {facts['mamba_page_size_padded']}, "
            f"hybrid allocator {'on' if facts['hybrid_allocator'] else 'off'}")


def chunk_fit(facts: dict[str, Any], chunk_tokens: int) -> str | None:
    """Why kvd's chunk is not whole blocks of every group, or None."""
    if "error" in facts:
        return None
    bad = [f"{g['type']} ({g['block_size']}-token blocks)" for g in facts["groups"]
           if g["block_size"] and chunk_tokens % int(g["block_size"])]
    return f"{', '.join(bad)} do not divide kvd's {chunk_tokens}-token chunk" if bad else None


def pushes_to_evict(facts: dict[str, Any], prompt_tokens: int, least: int = 4) -> int:
    """How many other prompts of ``prompt_tokens`` push a first one out of vLLM's GPU prefix
    cache. vLLM 0.33's hybrid allocator gives every group blocks from one pool of
    ``num_gpu_blocks`` and evicts the least recently freed first; a prompt takes at least
    ``ceil(prompt_tokens / block_size)`` blocks of every group but a Mamba one (a few state blocks
    a request), so the group of the largest blocks bounds it, and one more prompt than the pool
    holds of those is enough. With 0.26's block counts (planned on CPU for its per-group pools)
    that is ``least``."""
    if "error" in facts or not facts.get("num_gpu_blocks"):
        return least
    per = [-(-prompt_tokens // int(g["block_size"])) for g in facts["groups"]
           if g["block_size"] and "Mamba" not in g["type"]]
    if not per:
        return least
    return max(least, -(-int(facts["num_gpu_blocks"]) // min(per)) + 1)


def raised_in_kvd(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) passed through the kvd package."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(f"{os.sep}kvd{os.sep}" in fr.filename for fr in traceback.extract_tb(cur.__traceback__)):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def summary(results: dict[str, dict], bad: dict[str, dict]) -> int:
    """One PASS / FAIL / SKIPPED line per model, its KV-cache groups, then HYBRID CHECK OK only
    if every model that ran passed."""
    word = {"passed": "PASS", "skipped": "SKIPPED", "failed": "FAIL"}
    print("== vLLM hybrid check")
    for n, r in results.items():
        print(f"{word.get(r['status'], 'FAIL')} {n} ({r['status']}, {r.get('seconds', 0)} s)"
              + (f": {r['reason']}" if r.get("reason") else ""))
        if r.get("engine"):
            print(f"    {describe_groups(r['engine'])}")
            if r["engine"].get("connector_off"):
                print(f"    kvd connector ERROR: offloading is off for this model: {r['engine']['connector_off']}")
    ran = [n for n, r in results.items() if r["status"] not in ("skipped", "not run")]
    if bad:
        print(f"HYBRID CHECK FAILED: {', '.join(bad)}")
        return 1
    if not ran:
        print("HYBRID CHECK: nothing ran (every model skipped)")
        return 1
    skipped = [n for n, r in results.items() if r["status"] == "skipped"]
    print("HYBRID CHECK OK" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    return 0


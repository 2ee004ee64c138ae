"""What kvd needs to know of one vLLM KV-cache group, read from vLLM's spec objects by name and
attribute (so this module imports neither vLLM nor torch).

vLLM's hybrid allocator splits a model's layers into groups (``vllm/v1/kv_cache_interface.py``):
full attention and MLA keep every block of a request; a sliding window keeps only the blocks of
its window (the rest of the block table is the null block, and blocks leaving the window are
freed while the request runs); Mamba and linear attention keep a state, not blocks of tokens: with prefix caching on
(``mamba_cache_mode="align"``) vLLM keeps the state after each step that ends on a block boundary
in that boundary's block (``vllm/v1/worker/mamba_utils.py``: the state after ``p`` tokens is in
block ``p / block_size - 1``). kvd stores that state once per chunk boundary a step ends on, and a
hit of ``n`` chunks needs only the state of chunk ``n - 1`` (plus every attention chunk). A group's facts are read from its *first* layer spec: the
scheduler's ``KVCacheConfig`` carries exactly that spec where the workers' carry a
``UniformTypeKVCacheSpecs`` wrapper around it (``generate_scheduler_kv_cache_config``), so both
sides derive the same facts and hence the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Spec classes whose blocks hold every token of a request (a `FullAttentionSpec` with a
#: `sliding_window` set is one: the hybrid allocator was off and every block is kept).
_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
#: Spec classes whose blocks leave the request while it runs: a sliding window, and R-SWA, whose
#: gap blocks between the prompt and the decode window are freed each decode step.
_SLIDING = ("SlidingWindowSpec", "SlidingWindowMLASpec", "RSWASpec")
#: Spec classes of state groups (Mamba, linear attention, short convolutions).
_STATE = ("MambaSpec",)
#: Known and not supported, with the reason given at start.
_UNSUPPORTED = {
    "ChunkedLocalAttentionSpec": "a chunked local attention group",
    "CrossAttentionSpec": "a cross-attention (encoder-decoder) group",
    "EncoderOnlyAttentionSpec": "an encoder-only attention group",
}


@dataclass(frozen=True)
class GroupFacts:
    """One KV-cache group as both sides of the connector see it."""

    #: "full" (every block kept), "sliding", "state" (a Mamba-style group: one state per chunk
    #: boundary, see the module header), or "ignored": a group that holds nothing a later
    #: request reads at a chunk boundary (vLLM does not prefix-cache it, or rebuilds it after a
    #: connector's load), so kvd neither stores nor loads it.
    kind: str
    #: One copy of the KV for all TP ranks (MLA, a replicated state): stored by rank 0, read by every rank.
    mla: bool
    #: Tokens per block in vLLM's block table.
    block_tokens: int
    #: Tokens per stored state (DeepSeek-V4's compressed attention; 1 for plain caches).
    tokens_per_state: int
    #: The sliding window in tokens: None unless ``kind`` is "sliding", and None for R-SWA,
    #: which keeps the prompt's blocks like full attention and frees a gap of generated ones.
    window: int | None
    #: The spec's class name and fields, for the fingerprint.
    identity: tuple[object, ...]


def first_spec(spec: Any) -> Any:
    """The group's first layer spec: the spec itself, or the first one a
    ``UniformTypeKVCacheSpecs`` wraps (as the scheduler's config carries it)."""
    specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(specs, dict) and specs:
        return next(iter(specs.values()))
    return spec


def _classes(spec: Any) -> list[str]:
    return [c.__name__ for c in type(spec).__mro__]


def group_facts(spec: Any, transferable: bool = True) -> GroupFacts | str:
    """The facts of a group with this spec, or a sentence saying why kvd cannot store it.
    ``transferable`` is the group's ``enable_kv_transfer`` (vLLM 0.33: False for replicas vLLM
    rebuilds after a load)."""
    spec = first_spec(spec)
    names = _classes(spec)
    if not transferable or getattr(spec, "prefix_cacheable", True) is False:
        # DeepSeek-V4's compression ring holds the raw keys of the token group still being
        # compressed; at a chunk boundary (a multiple of every compression ratio) it is empty.
        return GroupFacts("ignored", False, int(spec.block_size), 1, None, (type(spec).__name__, "ignored"))
    for cls, why in _UNSUPPORTED.items():
        if cls in names:
            return f"{type(spec).__name__} is {why}"
    if any(n in names for n in _STATE):
        return _state_facts(spec)
    if any(n in names for n in _SLIDING):
        kind = "sliding"
    elif any(n in names for n in _FULL):
        kind = "full"
    else:
        return f"{type(spec).__name__} is a KV cache spec kvd does not know"
    block = int(spec.block_size)
    # vLLM 0.26 calls it compress_ratio; later releases tokens_per_state.
    raw = getattr(spec, "tokens_per_state", None) or getattr(spec, "compress_ratio", None) or 1
    per_state = int(raw)
    if per_state < 1 or per_state != raw:
        return f"{type(spec).__name__} stores several states per token, which kvd does not key"
    window: int | None = None
    if kind == "sliding" and "RSWASpec" not in names:
        window = int(spec.sliding_window)
    identity: tuple[object, ...] = (
        type(spec).__name__,
        block,
        per_state,
        window,
        getattr(spec, "num_kv_heads", None),
        getattr(spec, "head_size", None),
        str(getattr(spec, "dtype", None)),
        str(getattr(spec, "kv_quant_mode", None)),
        _page_bytes(spec),
    )
    if window is not None:
        # What a sliding group's entry holds (``window_entry``) is part of what its keys mean.
        identity += ("window-tail",)
    return GroupFacts(kind, "MLA" in "".join(names), block, per_state, window, identity)


def _state_facts(spec: Any) -> GroupFacts | str:
    """A Mamba-style group: supported when vLLM caches its states at block boundaries and keeps
    no speculative or mid-chunk checkpoint blocks (whose places in the block table move)."""
    name = type(spec).__name__
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"{name} has mamba_cache_mode={mode!r}: vLLM keeps no state a later request can start from; "
                f"start vLLM with --enable-prefix-caching (mamba_cache_mode 'align') to offload this model")
    for field in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if int(getattr(spec, field, 0) or 0):
            return f"{name} has {field}={getattr(spec, field)}, whose state blocks kvd does not place yet"
    block = int(spec.block_size)
    identity = (
        name,
        block,
        tuple(tuple(int(d) for d in shape) for shape in getattr(spec, "shapes", ())),
        tuple(str(d) for d in getattr(spec, "dtypes", ())),
        str(getattr(spec, "mamba_type", None)),
        _page_bytes(spec),
    )
    # A replicated state (every TP rank holds all of it) is stored once, like MLA.
    return GroupFacts("state", bool(getattr(spec, "tp_replicated", False)), block, 1, None, identity)


def _page_bytes(spec: Any) -> int | None:
    try:
        return int(spec.page_size_bytes)
    except (AttributeError, NotImplementedError, TypeError, AssertionError):
        return None


def window_blocks(window: int, block_tokens: int) -> int:
    """Blocks of a sliding-window group that vLLM keeps at a chunk boundary: those holding the
    ``window - 1`` tokens before it, which the next token attends to. vLLM frees the blocks of
    ``max(0, computed - window + 1)`` tokens (``get_num_skipped_tokens``, floor division by the
    block size), so at ``n`` computed tokens, a multiple of the block size, it keeps the
    ``ceil((window - 1) / block_tokens)`` blocks before ``n``."""
    return max(1, -(-(window - 1) // block_tokens))


def window_entry(window: int, block_tokens: int, chunk_tokens: int) -> int | None:
    """Blocks a sliding-window group's chunk entry holds when the window fits in one chunk: the
    chunk's last ``window_blocks`` blocks, all a hit ending at the chunk's end reads (DeepSeek-V4:
    a 128-token window in 64-token blocks is 2 of a 256-token chunk's 4 blocks, half the bytes).
    None when the window spans a chunk or more (Gemma-3's 512 or 1024 tokens): entries are
    then whole chunks, and a hit needs the chunks its window overlaps. Also None when the tail
    is not a whole fraction of the chunk (kvd's registration divides a chunk into equal blocks),
    which keeps whole chunks too."""
    per = chunk_tokens // block_tokens
    k = window_blocks(window, block_tokens)
    return k if k < per and per % k == 0 else None


def unsupported(facts: list[GroupFacts | str]) -> str | None:
    """Why the connector must stay off for a model with these groups (a hit must be loadable in
    every group, so one unsupported group rules out every hit), or None."""
    for g, f in enumerate(facts):
        if isinstance(f, str):
            return f"KV cache group {g}: {f}"
    return None


def state_chunk_advice(state_block_tokens: list[tuple[int, int]], chunk_tokens: int) -> str | None:
    """Why a state group (``(group, block tokens)``) may get few hits at this chunk size: vLLM
    keeps a state only where a step ends (on a block boundary), and kvd serves a hit of ``n``
    chunks only with the state at chunk ``n``'s end, so with chunks larger than the block only
    steps that happen to end on a chunk boundary leave one (a prompt of 7.5 chunks prefilled in
    one step leaves none). None when every state group's block is the chunk."""
    for g, b in state_block_tokens:
        if b < chunk_tokens:
            return (f"KV cache group {g} keeps Mamba-style states in {b}-token blocks, and vLLM keeps a state only "
                    f"where a step ends: with kvd's {chunk_tokens}-token chunks only steps that end on a chunk "
                    f"boundary leave a state kvd can serve, so many prompts get no hit; start kvd with "
                    f"--chunk-tokens {b} for a hit at every step's end")
    return None


def chunk_mismatch(block_tokens: list[int], chunk_tokens: int) -> str | None:
    """Why kvd's chunk size cannot key these groups (a chunk must be whole blocks of each)."""
    for g, b in enumerate(block_tokens):
        if chunk_tokens % b:
            return (f"KV cache group {g} has {b}-token blocks, which do not divide kvd's {chunk_tokens}-token "
                    f"chunks; start kvd with --chunk-tokens set to a multiple of {b}")
    return None

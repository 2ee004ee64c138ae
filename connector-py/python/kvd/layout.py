"""From the per-layer KV tensors vLLM hands a connector to the layout kvd needs.

vLLM 0.33 gives every attention layer a 4-D view ``[num_blocks, heads, tokens, content]`` into
one int8 buffer, in one of six physical orders (LBNHC, LBHNC, BLNHC, ...); older releases gave
FlashAttention ``(2, blocks, tokens, heads, dim)``, FlashInfer ``(blocks, 2, tokens, heads,
dim)`` and MLA ``(blocks, tokens, 576)`` tensors. This module reads shape, strides and addresses
only — it works on torch tensors and on any object with ``data_ptr()``, ``shape``, ``stride()``
and ``element_size()`` — and never copies.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence


class TensorLike(Protocol):
    """What the layout code needs of a tensor."""

    shape: Sequence[int]

    def data_ptr(self) -> int: ...

    def stride(self) -> Sequence[int]: ...

    def element_size(self) -> int: ...


class LayoutError(ValueError):
    """The KV tensors have a shape or layout kvd cannot register."""


@dataclass(frozen=True)
class KvLayoutSpec:
    """A registration-ready description: the layout dict kvd's protocol takes and each layer's
    block-0 address."""

    layout: dict[str, int]
    layer_ptrs: list[int]
    kind: str  # "vllm-0.33", "flash-attn", "flash-infer" or "mla"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (all planes)."""
        l = self.layout
        return l["kv_planes"] * l["heads"] * l["block_tokens"] * l["content"] * l["elem_bytes"]


def _dims(t: TensorLike) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    shape = tuple(int(s) for s in t.shape)
    strides = tuple(int(s) for s in t.stride())
    return shape, strides, int(t.element_size())


def by_shape(views: Sequence[TensorLike]) -> list[list[TensorLike]]:
    """A group's layers split by shape, strides and dtype, in order of first appearance: one
    list for a group of like layers; several where vLLM packs layers of different shapes into
    one group (DeepSeek-V4's indexer and compressed-attention layers share block tables)."""
    out: dict[tuple[tuple[int, ...], tuple[int, ...], int], list[TensorLike]] = {}
    for v in views:
        out.setdefault(_dims(v), []).append(v)
    return list(out.values())


def describe(views: Sequence[TensorLike], kind: str | None = None, block_span: int | None = None,
             state: bool = False) -> KvLayoutSpec:
    """The layout of a group of layers that share shape, strides and dtype.

    ``kind`` resolves the one ambiguous case (5-D tensors with 2 blocks): "flash-attn" or
    "flash-infer". ``block_span`` is the tokens of a request one block covers (the group's
    block size); a tensor with fewer rows per block is compressed, one state per
    ``block_span / rows`` tokens (DeepSeek-V4's C4 and C128 attention and their indexer).
    ``state`` marks a state group's tensors (Mamba: ``[blocks, ...]``, one state per block, laid
    out densely within it), described as one row of content per block.
    """
    if not views:
        raise LayoutError("no KV tensors to register")
    shape, strides, elem = _dims(views[0])
    for v in views[1:]:
        if _dims(v) != (shape, strides, elem):
            raise LayoutError(
                "these layers differ in shape, strides or dtype "
                f"({_dims(v)} vs {(shape, strides, elem)}); describe each shape apart (by_shape)"
            )
    s = [x * elem for x in strides]
    planes, plane_stride = 1, 0
    if state and len(shape) >= 2 and not (len(shape) == 4 and shape[1] == shape[2] == 1):
        # A state tensor of vLLM < 0.33 (conv or SSM state): [blocks, ...], dense per block.
        inner, dense = 1, True
        for size, stride in reversed(list(zip(shape[1:], strides[1:]))):
            dense = dense and (size == 1 or stride == inner)
            inner *= size
        if not dense:
            raise LayoutError(f"a state tensor of shape {shape} and strides {strides} is not dense within a block")
        shape, s = (shape[0], 1, 1, inner), [s[0], inner * elem, inner * elem, elem]
    if len(shape) == 4:
        # vLLM >= 0.33: [blocks, heads, tokens, content].
        b, h, n, c = shape
        bs, hs, ns, cs = s
        kind = "vllm-0.33"
    elif len(shape) == 3:
        # MLA before 0.33: [blocks, tokens, 576].
        b, n, c = shape
        bs, ns, cs = s
        h, hs = 1, 0
        kind = "mla"
    elif len(shape) == 5:
        fa = shape[0] == 2 and (shape[1] != 2 or kind == "flash-attn")
        fi = shape[1] == 2 and not fa
        if fa:
            planes, b, n, h, c = shape
            plane_stride, bs, ns, hs, cs = s
            kind = "flash-attn"
        elif fi:
            b, planes, n, h, c = shape
            bs, plane_stride, ns, hs, cs = s
            kind = "flash-infer"
        else:
            raise LayoutError(f"5-D KV tensor of shape {shape} has no K/V dimension of size 2")
    else:
        raise LayoutError(f"KV tensor of shape {shape} is not a layout kvd knows")
    if elem not in (1, 2, 4, 8):
        raise LayoutError(f"element size {elem} is not 1, 2, 4 or 8 bytes")
    state_tokens = 1
    if block_span is not None and block_span != n:
        if n <= 0 or block_span % n:
            raise LayoutError(f"a block of {block_span} tokens cannot be {n} rows of states (shape {shape})")
        state_tokens = block_span // n
    layout = {
        "elem_bytes": elem,
        "num_blocks": b,
        "kv_planes": planes,
        "heads": h,
        "block_tokens": n,
        "content": c,
        "block_stride_bytes": bs,
        "plane_stride_bytes": plane_stride,
        "head_stride_bytes": hs if h > 1 else 0,
        "token_stride_bytes": ns,
        "content_stride_bytes": cs,
        "state_tokens": state_tokens,
    }
    return KvLayoutSpec(layout=layout, layer_ptrs=[int(v.data_ptr()) for v in views], kind=kind)


def gpu_api() -> str:
    """The GPU runtime this process's PyTorch was built for: "hip" on a ROCm build
    (``torch.version.hip``), else "cuda". ``KVD_GPU_BACKEND=hip|cuda`` overrides it (kvd's GPU
    tests run the HIP path on NVIDIA GPUs through HIP's NVIDIA platform this way)."""
    forced = os.environ.get("KVD_GPU_BACKEND", "")
    if forced in ("cuda", "hip"):
        return forced
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return "hip" if getattr(version, "hip", None) else "cuda"


def device_of(t: Any) -> str:
    """"cuda" (or "hip" under ROCm: see gpu_api) for GPU tensors, "host" for kvd.HostBuffer
    views; anything else is refused. PyTorch names ROCm GPUs "cuda" too."""
    dev = getattr(t, "device", None)
    kind = getattr(dev, "type", dev)
    if kind == "cuda":
        return gpu_api()
    if kind == "host":
        return "host"
    raise LayoutError(f"KV tensors on device {kind!r}: kvd offloads CUDA KV caches (or kvd.HostBuffer views in tests)")

"""Layout detection from tensor shapes and strides, for every layout vLLM produces."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvd.layout import LayoutError, describe, device_of
from kvd.testing import ORDERS, vllm_cache


@dataclass
class Fake:
    ptr: int
    shape: tuple
    strides: tuple
    elem: int = 2
    device = SimpleNamespace(type="cuda")

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return self.strides

    def element_size(self):
        return self.elem


@pytest.mark.parametrize("order", ORDERS)
def test_vllm_033_layouts(order):
    # Llama-3.1-8B TP1: 32 layers, 8 KV heads, K‖V content 256, block 16.
    buf, views = vllm_cache(order, 32, 8, 8, 16, 256)
    spec = describe(views)
    l = spec.layout
    assert (l["num_blocks"], l["heads"], l["block_tokens"], l["content"], l["kv_planes"]) == (8, 8, 16, 256, 1)
    assert spec.block_bytes == 65536
    assert spec.layer_ptrs[0] == buf.ptr
    if order.startswith("BL"):
        assert l["block_stride_bytes"] == 2 << 20, "block-outermost: one block of all layers is contiguous"
    assert device_of(views[0]) == "host"


def test_pre_033_flash_attn_flash_infer_and_mla_shapes():
    # FlashAttention: (2, blocks, tokens, heads, dim), contiguous.
    fa = describe([Fake(4096, (2, 100, 16, 8, 128), (100 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1))])
    assert fa.kind == "flash-attn" and fa.layout["kv_planes"] == 2
    assert fa.layout["plane_stride_bytes"] == 100 * 16 * 8 * 128 * 2
    # FlashInfer: (blocks, 2, tokens, heads, dim).
    fi = describe([Fake(4096, (100, 2, 16, 8, 128), (2 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1))])
    assert fi.kind == "flash-infer" and fi.layout["plane_stride_bytes"] == 16 * 8 * 128 * 2
    # MLA: (blocks, tokens, 576).
    mla = describe([Fake(4096, (100, 64, 576), (64 * 576, 576, 1))])
    assert mla.kind == "mla" and mla.layout["heads"] == 1 and mla.block_bytes == 64 * 576 * 2


def test_mismatched_layers_and_unknown_shapes_are_refused():
    a = Fake(0, (10, 2, 16, 64), (2048, 1024, 64, 1))
    b = Fake(0, (10, 2, 16, 64), (2048, 64, 128, 1))
    with pytest.raises(LayoutError, match="differ"):
        describe([a, b])
    with pytest.raises(LayoutError):
        describe([Fake(0, (10, 20), (20, 1))])
    with pytest.raises(LayoutError):
        describe([])
    with pytest.raises(LayoutError, match="device"):
        device_of(SimpleNamespace(device=SimpleNamespace(type="cpu")))


def test_gpu_tensors_use_hip_under_a_rocm_torch(monkeypatch):
    gpu_tensor = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    monkeypatch.delenv("KVD_GPU_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(version=SimpleNamespace(cuda="13.0", hip=None)))
    assert device_of(gpu_tensor) == "cuda"
    # A ROCm build of PyTorch still calls its GPUs "cuda" but sets torch.version.hip.
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(version=SimpleNamespace(cuda=None, hip="6.4.43482")))
    assert device_of(gpu_tensor) == "hip"
    monkeypatch.setenv("KVD_GPU_BACKEND", "cuda")
    assert device_of(gpu_tensor) == "cuda"
    monkeypatch.setenv("KVD_GPU_BACKEND", "hip")
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(version=SimpleNamespace(cuda="13.0", hip=None)))
    assert device_of(gpu_tensor) == "hip"

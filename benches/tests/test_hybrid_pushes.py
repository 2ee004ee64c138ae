"""``vllm_hybrid.pushes_to_evict``: how many other prompts the real-engine hybrid check sends to
push its first prompt out of vLLM's GPU prefix cache, from the KV-cache groups vLLM 0.33 made of
each model on the H200 (session 14's FACTS lines, abridged)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vllm_hybrid as vhy  # noqa: E402

PROMPT = 48 * 256 + 1


def group(kind: str, block: int) -> dict:
    return {"type": kind, "block_size": block, "page_bytes": None, "window": None, "layers": 2}


def test_qwen3_next_one_pool_of_160_blocks_needs_five_prompts_of_49():
    facts = {"num_gpu_blocks": 160,
             "groups": [group("MambaSpec", 256), group("MambaSpec", 256), group("FullAttentionSpec", 256)]}
    # The Mamba groups hold a few states a request; the attention group 49 blocks a prompt:
    # 4 x 49 = 196 > 160 already, one more for the first prompt's own blocks.
    assert vhy.pushes_to_evict(facts, PROMPT) == 5


def test_deepseek_v4_counts_its_largest_blocks_not_its_small_state_windows():
    facts = {"num_gpu_blocks": 1024,
             "groups": [group("SlidingWindowMLASpec", 64), group("SlidingWindowMLASpec", 64),
                        group("MLAAttentionSpec", 256), group("SlidingWindowMLASpec", 4),
                        group("SlidingWindowMLASpec", 8)]}
    # 49 of the 256-token blocks a prompt: ceil(1024 / 49) = 21, and one more.
    assert vhy.pushes_to_evict(facts, PROMPT) == 22


def test_without_facts_the_planned_four():
    assert vhy.pushes_to_evict({"error": "engine core not in this process"}, PROMPT) == 4
    assert vhy.pushes_to_evict({"num_gpu_blocks": 64, "groups": [group("FullAttentionSpec", 16)]}, PROMPT) == 4

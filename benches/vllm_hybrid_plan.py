#!/usr/bin/env python3
"""What vLLM 0.26 makes of each hybrid model of ``vllm_hybrid.MODELS``, on a machine without a
GPU: the engine config (``EngineArgs.create_engine_config``, then the block-size alignment that
a GPU worker does for hybrid Mamba models), the KV-cache groups, and the round trip of
``vllm_engine_check.py --scenarios hybrid`` through vLLM's real scheduler and KV-cache manager
with no model behind them: how many tokens of A the GPU prefix cache serves the second time and
after four other prompts. That is how ``vllm_hybrid.MODELS``' GPU block counts were chosen.

  /work/main/.venv-vllm26/bin/python benches/vllm_hybrid_plan.py [--models gemma3-swa,...]
  PYTHONPATH=/tmp/vllm026/src /work/main/.venv-vllm/bin/python benches/vllm_hybrid_plan.py   (the vLLM 0.26
      wheel unzipped there; any torch: nothing here runs a kernel)

vLLM picks its platform from the GPUs it finds; with none it cannot build an engine config. So
this pretends to be CUDA on an H200 (capability 9.0) far enough for config code, which never
touches the device, and leaves vLLM's CUDA extensions unloaded: the layer specs are built here
from the config as the model's layers build them (attention: ``Attention.get_kv_cache_spec``;
NemotronH's Mamba2: ``MambaMixer2.get_kv_cache_spec`` and Qwen3-Next's Gated DeltaNet:
``GatedDeltaNetAttention.get_kv_cache_spec``, with the model's state shapes and dtypes;
DeepSeek-V4: ``deepseek_v4_specs``), and FlashAttention's kernel block sizes are named rather
than imported. The Qwen3-Next and DeepSeek-V4 model classes are stood in for
(``stand_in_models``): their modules cannot be imported without libcuda. What this cannot show:
kernels, the KV connector at work (kvd's native module is not loaded; what its ``kvd/groups.py``
says of the groups is printed: the facts it keys them by, or why it would turn itself off), and
memory on the device.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS_PY = os.path.join(os.path.dirname(HERE), "connector-py", "python", "kvd", "groups.py")
sys.path.insert(0, HERE)

import vllm_hybrid as vhy  # noqa: E402

PROMPT_LEN = 48 * 256 + 1


def pretend_h200() -> type:
    """Installs a CUDA platform that answers config questions as an H200 would."""
    # vllm.platforms.cuda imports the stable-ABI extension only to register ops.
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm import platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class PretendH200(CudaPlatformBase):
        #: While True the platform says "not CUDA": modules that probe CUDA kernels when imported
        #: (quantization utils, via the scheduler) then skip the probe.
        importing = False

        def is_cuda(self) -> bool:
            return not self.importing

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return None if cls.importing else DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (pretend)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    platforms._current_platform = PretendH200()
    PretendH200.importing = True
    import vllm.v1.core.sched.scheduler  # noqa: F401
    PretendH200.importing = False
    return PretendH200


def stand_in_models() -> None:
    """Without libcuda, vLLM's registry cannot import the Qwen3-Next and DeepSeek-V4 modules to
    inspect them (they load CUDA extensions; so does the flash-attention package that the
    quantization configs import): the registry is given classes with the real ones' vLLM
    interfaces instead (qwen3_next.py: HasInnerState, SupportsLoRA, SupportsPP, IsHybrid,
    SupportsEagle3; models/deepseek_v4/nvidia/model.py: SupportsPP, SupportsEagle3,
    MixtureOfExperts), and the flash-attention package the three names config code imports."""
    import torch.nn as nn
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import (
        HasInnerState, IsHybrid, MixtureOfExperts, SupportsEagle3, SupportsLoRA, SupportsPP)
    from vllm.model_executor.models.registry import _RegisteredModel

    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        fa = types.ModuleType("vllm.vllm_flash_attn")
        fa.compile_flash_attn_varlen_func_from_specs = fa.flash_attn_varlen_func = fa.get_scheduler_metadata = None
        sys.modules["vllm.vllm_flash_attn"] = fa

    class Generates(nn.Module):  # what vLLM checks of a text-generation model
        def embed_input_ids(self, input_ids): ...
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None): ...
        def compute_logits(self, hidden_states): ...

    class Qwen3NextForCausalLM(Generates, HasInnerState, SupportsLoRA, SupportsPP, IsHybrid, SupportsEagle3):
        pass

    class DeepseekV4ForCausalLM(Generates, SupportsPP, SupportsEagle3, MixtureOfExperts):
        pass

    for cls in (Qwen3NextForCausalLM, DeepseekV4ForCausalLM):
        ModelRegistry.models[cls.__name__] = _RegisteredModel.from_model_cls(cls)


def engine_config(name: str, platform: type):
    """The VllmConfig ``LLM(...)`` would run ``name`` with, block sizes aligned as on a GPU."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.attention.backend import MultipleOf

    hm = vhy.MODELS[name]

    class FlashAttentionKernelSizes:  # vllm/v1/attention/backends/flash_attn.py, without its extension
        @staticmethod
        def get_supported_kernel_block_sizes() -> list:
            return [MultipleOf(16)]

    vc = EngineArgs(model=vhy.model_dir(name), skip_tokenizer_init=True, load_format="dummy", max_model_len=16384,
                    enable_prefix_caching=True, block_size=hm.block_size, num_gpu_blocks_override=hm.gpu_blocks,
                    enforce_eager=True, seed=0, **hm.llm).create_engine_config(UsageContext.LLM_CLASS)
    if vc.model_config.is_hybrid:
        with_state_classmethods(vc)
        platform._align_hybrid_block_size(vc, FlashAttentionKernelSizes)
    return vc


def with_state_classmethods(vc) -> None:
    """vLLM's alignment asks the model class for its state shapes; importing NemotronH's module
    loads CUDA layers, so its two classmethods (nemotron_h.py) are given here."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models import ModelRegistry

    class NemotronHState:
        @classmethod
        def get_mamba_state_dtype_from_config(cls, vc):
            cc = vc.cache_config
            return MambaStateDtypeCalculator.mamba2_state_dtype(vc.model_config.dtype, cc.mamba_cache_dtype,
                                                                cc.mamba_ssm_cache_dtype)

        @classmethod
        def get_mamba_state_shape_from_config(cls, vc):
            hf = vc.model_config.hf_config
            return MambaStateShapeCalculator.mamba2_state_shape(
                intermediate_size=hf.mamba_num_heads * hf.mamba_head_dim,
                tp_world_size=vc.parallel_config.tensor_parallel_size,
                n_groups=hf.n_groups, num_heads=hf.mamba_num_heads, head_dim=hf.mamba_head_dim,
                state_size=hf.ssm_state_size, conv_kernel=hf.conv_kernel, num_spec=vc.num_speculative_tokens)

    class Qwen3NextState:  # qwen3_next.py, the same two classmethods for Gated DeltaNet
        @classmethod
        def get_mamba_state_dtype_from_config(cls, vc):
            cc = vc.cache_config
            return MambaStateDtypeCalculator.gated_delta_net_state_dtype(vc.model_config.dtype, cc.mamba_cache_dtype,
                                                                         cc.mamba_ssm_cache_dtype)

        @classmethod
        def get_mamba_state_shape_from_config(cls, vc):
            hf = vc.model_config.hf_text_config
            return MambaStateShapeCalculator.gated_delta_net_state_shape(
                vc.parallel_config.tensor_parallel_size, hf.linear_num_key_heads, hf.linear_num_value_heads,
                hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim, vc.num_speculative_tokens)

    state = {"NemotronHForCausalLM": NemotronHState, "Qwen3NextForCausalLM": Qwen3NextState}
    arch = vc.model_config.architecture
    assert arch in state, arch
    ModelRegistry.resolve_model_cls = lambda *a, **k: (state[arch], arch)


def layer_specs(vc) -> dict:
    """Each layer's KV-cache spec, as the model's layers would report it."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    mc, cc, hf = vc.model_config, vc.cache_config, vc.model_config.hf_config
    attn = {"block_size": cc.block_size, "num_kv_heads": mc.get_num_kv_heads(vc.parallel_config),
            "head_size": mc.get_head_size(), "dtype": mc.dtype}
    specs = {}
    if mc.architecture == "Gemma3ForCausalLM":
        for i, t in enumerate(hf.layer_types):
            specs[f"model.layers.{i}.self_attn.attn"] = (
                SlidingWindowSpec(**attn, sliding_window=hf.sliding_window) if t == "sliding_attention"
                else FullAttentionSpec(**attn))
        return specs
    if mc.architecture == "DeepseekV4ForCausalLM":
        return deepseek_v4_specs(vc)
    cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    if mc.architecture == "Qwen3NextForCausalLM":
        for i, t in enumerate(hf.layer_types):
            if t == "full_attention":
                specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(**attn)
            else:
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    shapes=cls.get_mamba_state_shape_from_config(vc), dtypes=cls.get_mamba_state_dtype_from_config(vc),
                    block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode=cc.mamba_cache_mode, num_speculative_blocks=0)
        return specs
    for i, c in enumerate(hf.hybrid_override_pattern):
        if c == "*":
            specs[f"model.layers.{i}.mixer.attn"] = FullAttentionSpec(**attn)
        elif c == "M":
            specs[f"model.layers.{i}.mixer"] = MambaSpec(
                shapes=cls.get_mamba_state_shape_from_config(vc), dtypes=cls.get_mamba_state_dtype_from_config(vc),
                block_size=cc.mamba_block_size, page_size_padded=cc.mamba_page_size_padded, mamba_type="mamba2",
                mamba_cache_mode=cc.mamba_cache_mode, num_speculative_blocks=0)
    return specs


def deepseek_v4_specs(vc) -> dict:
    """DeepSeek-V4's KV-cache layers as models/deepseek_v4/ builds them for the FlashMLA path
    (sm90's default): in every layer a sliding-window cache (sparse_swa.py, DeepseekV4SWACache:
    64-token blocks); in a layer of compress ratio 4 or 128 the compressed MLA cache
    (attention.py, DeepseekV4Attention.get_kv_cache_spec) and its compressor's state cache
    (compressor.py, CompressorStateCache: 4- or 8-token blocks, a window of 8 or 128); in a
    ratio-4 layer also the indexer's key cache (128 fp8 + 4 scale bytes a row, ratio 4) and its
    compressor's state. The model's first layer sets cache_dtype to fp8_ds_mla (attention.py,
    _resolve_dsv4_kv_cache_dtype); the MTP layer (the last ratio) is built only for speculative
    decoding."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode

    cc, hf = vc.cache_config, vc.model_config.hf_config
    assert cc.cache_dtype.startswith("fp8"), f"DeepSeek-V4's FlashMLA path needs an fp8 KV cache, not {cc.cache_dtype}"
    cc.cache_dtype = "fp8_ds_mla"
    fp8 = {"cache_dtype_str": "fp8_ds_mla", "alignment": 576}
    v4 = {**fp8, "model_version": "deepseek_v4", "kv_quant_mode": get_kv_quant_mode("fp8_ds_mla")}
    specs = {}

    def state(prefix: str, head_dim: int, ratio: int) -> None:
        coff = 1 + (ratio == 4)
        specs[f"{prefix}.state_cache"] = SlidingWindowMLASpec(
            block_size=4 if ratio == 4 else 8, num_kv_heads=1, head_size=2 * coff * head_dim, dtype=torch.float32,
            sliding_window=coff * ratio, alignment=576)

    for i in range(hf.num_hidden_layers):
        p = f"model.layers.{i}.attn"
        ratio = max(1, hf.compress_ratios[i])
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=64, num_kv_heads=1, head_size=hf.head_dim, dtype=torch.uint8,
            sliding_window=hf.sliding_window, **v4)
        if ratio == 1:
            continue
        specs[f"{p}.mla_attn"] = MLAAttentionSpec(
            block_size=cc.block_size, num_kv_heads=1, head_size=hf.head_dim, dtype=torch.uint8, compress_ratio=ratio, **v4)
        state(f"{p}.compressor", hf.head_dim, ratio)
        if ratio == 4:
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=cc.block_size, num_kv_heads=1, head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4,
                dtype=torch.uint8, compress_ratio=4, alignment=576)
            state(f"{p}.indexer.compressor", hf.index_head_dim, 4)
    return specs


def kvd_groups(path: str):
    """The connector's ``kvd/groups.py``, loaded alone (the ``kvd`` package needs its native module)."""
    spec = importlib.util.spec_from_file_location("kvd_groups", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvd_groups"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def plan(name: str, platform: type, groups_py) -> bool:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    hm = vhy.MODELS[name]
    vc = engine_config(name, platform)
    cc = vc.cache_config
    specs = layer_specs(vc)
    groups = get_kv_cache_groups(vc, specs)
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    per_group = max(len(g.layer_names) for g in groups)
    kvc = get_kv_cache_config_from_groups(vc, groups, available_memory=hm.gpu_blocks * page * per_group)
    cc.num_gpu_blocks = kvc.num_blocks
    print(f"== {name}: block_size {cc.block_size}, mamba_cache_mode {cc.mamba_cache_mode}, mamba_block_size "
          f"{cc.mamba_block_size}, mamba_page_size_padded {cc.mamba_page_size_padded}, max_num_batched_tokens "
          f"{vc.scheduler_config.max_num_batched_tokens}, hybrid allocator "
          f"{'off' if vc.scheduler_config.disable_hybrid_kv_cache_manager else 'on'}, {kvc.num_blocks} blocks")
    for g, grp in enumerate(kvc.kv_cache_groups):
        s = grp.kv_cache_spec
        print(f"  group {g}: {type(s).__name__}, {s.block_size}-token blocks, {s.page_size_bytes // 1024} KiB pages, "
              f"window {getattr(s, 'sliding_window', None)}, layers {grp.layer_names}")

    sched_kvc = generate_scheduler_kv_cache_config([kvc])
    facts = [groups_py.group_facts(g.kv_cache_spec, getattr(g, "enable_kv_transfer", True))
             for g in sched_kvc.kv_cache_groups]
    for g, f in enumerate(facts):
        print(f"  kvd, group {g}: " + (f"{f.kind}, {f.block_tokens}-token blocks" if not isinstance(f, str) else f))
    off = groups_py.unsupported(facts)
    print(f"  kvd: {'offloading is off for this model: ' + off if off else 'on for every group'}")

    init_none_hash(sha256)
    # As EngineCore does: the scheduler's block is the LCM of the groups' blocks, prefix-cache
    # hashes are taken every GCD of them (DeepSeek-V4's groups have 4- to 256-token blocks).
    sched_block, hash_block = resolve_kv_cache_block_sizes(sched_kvc, vc)
    sched = Scheduler(vllm_config=vc, kv_cache_config=sched_kvc, structured_output_manager=StructuredOutputManager(vc),
                      log_stats=True, block_size=sched_block, hash_block_size=hash_block)
    # What the engine check will print of the engine, read the way it reads an in-process LLM.
    core = types.SimpleNamespace(scheduler=sched, vllm_config=vc)
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=core)))
    print(f"  engine check will print: {vhy.describe_groups(vhy.engine_facts(llm))}")
    hasher = get_request_block_hasher(hash_block, sha256)
    ids = iter(range(1 << 30))

    def run(label: str, tokens: list[int]) -> int:
        """One request to its end; the tokens its first scheduling found in the GPU prefix cache."""
        rid = f"r{next(ids)}"
        sp = SamplingParams(max_tokens=16, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        sched.add_request(Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                                  block_hasher=hasher))
        hit, chunks = None, []
        for _ in range(5000):
            if rid not in sched.requests:
                break
            out = sched.schedule()
            hit = next((r.num_computed_tokens for r in out.scheduled_new_reqs if r.req_id == rid), hit)
            chunks += [out.num_scheduled_tokens[rid]] if rid in out.num_scheduled_tokens else []
            reqs = list(out.num_scheduled_tokens)
            done = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens else []
                    for r in reqs]
            index = {r: i for i, r in enumerate(reqs)}
            sched.update_from_output(out, ModelRunnerOutput(req_ids=reqs, req_id_to_index=index, sampled_token_ids=done,
                                                            logprobs=None, prompt_logprobs_dict={}, pooler_output=None))
        else:
            print(f"  {label}: never finished (scheduled chunks {chunks[:8]}): too few blocks to admit it")
            return -1
        print(f"  {label}: GPU prefix cache {hit} of {len(tokens)} tokens; tokens a step {chunks[:4]}"
              f"{' ...' if len(chunks) > 4 else ''}")
        return int(hit or 0)

    def prompt(seed: int) -> list[int]:  # vllm_engine_check.prompt
        rng = random.Random(1_000_003 * seed + 17)
        return [rng.randrange(3, 32000) for _ in range(PROMPT_LEN)]

    run("A first", prompt(1))
    again = run("A again", prompt(1))
    for i in range(4):
        run(f"push {i + 1}/4", prompt(2 + i))
    after = run("A after the pushes", prompt(1))
    ok = again >= PROMPT_LEN - 1 - 256 and 0 <= after < PROMPT_LEN - 1 - 256
    print(f"  {'ok' if ok else 'NOT OK'}: A hits the GPU prefix cache again ({again}) and leaves it after four "
          f"pushes ({after})")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(vhy.MODELS))
    ap.add_argument("--kvd-groups", default=GROUPS_PY,
                    help="the connector's groups.py to ask (default: this checkout's)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    platform = pretend_h200()
    stand_in_models()
    groups_py = kvd_groups(args.kvd_groups)
    results = {n: plan(n, platform, groups_py) for n in args.models.split(",") if n}
    print("PLAN OK" if all(results.values()) else f"PLAN NOT OK: {[n for n, ok in results.items() if not ok]}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

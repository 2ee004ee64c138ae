#!/usr/bin/env bash
# Here (the dev machine, with network): packs vLLM 0.33.0 and what it needs beyond the GPU host's
# image for the host (Python 3.12, torch 2.11.0+cu130, no network) into parts of at most 54 MiB,
# one part per device call (the device tool takes 64 MiB a call, the checkout included: 60 MiB
# parts were refused).
#
#   scripts/vllm033-bundle.sh DIR        (DIR git-ignored, e.g. .vllm033-gpu; ~5 min, ~2.5 GB in /tmp)
#
# vLLM 0.33 pins torch 2.14.0, which pins triton 3.8, cuDNN 9.24, NCCL 2.30.7, cuSPARSELt 0.8.1 and
# CUDA 13.0.3 libraries. The host has CUDA 13.0.2, cuDNN 9.19, NCCL 2.28.9, cuSPARSELt 0.8.0 and
# nvshmem 3.4.5 (torch 2.11's pins). Only torch, triton and vLLM travel; the CUDA libraries are the
# host's: same sonames and major versions. NCCL 2.28.9 lacks 11 entry points torch 2.14 links, and
# Python loads extensions with RTLD_NOW, so libtorch_cuda.so would not load: scripts/nccl-missing.c
# defines them (an engine on one GPU never calls them) and is preloaded for vLLM 0.33 runs. NCCL
# 2.30.7 is not in the package registry (2.27.7 and 2.32.x are). cuDNN 9.19 under a torch built for
# 9.24 refuses only cuDNN work (torch.backends.cudnn's version check); these models do none.
#
# Everything is installed here into one site folder (pip --target for the host's platform), less
# what an engine on an H200 never loads (FlashAttention 2, which sm90 does not use; the vllm-rs
# frontend binary; Triton's Blackwell ptxas and the CUPTI libraries only its profiler loads), then
# packed with zstd (-12 --long=27: 30% smaller than the wheels' deflate). Kernel packages the
# models need (DeepSeek-V4, Qwen3-Next) are named in KERNELS below.
#
# On the host: scripts/device-vllm.sh v33 N (one part a call), then v33 install.
set -euo pipefail
D=${1:?usage: vllm033-bundle.sh DIR}
mkdir -p "$D"
D=$(cd "$D" && pwd)
W=${WORK:-/tmp/vllm033-bundle}
PIP=${PIP:-python3 -m pip}
PLAT="--python-version 3.12 --implementation cp --only-binary=:all: --no-deps"
for p in 2_5 1 2014 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35 2_39; do
  case $p in 1|2014) PLAT="$PLAT --platform manylinux${p}_x86_64" ;; *) PLAT="$PLAT --platform manylinux_${p}_x86_64" ;; esac
done
PLAT="$PLAT --platform any"

# The big three, then what vLLM 0.33 imports that the host's image lacks (the closure of vLLM's
# Requires-Dist less the host's packages, ../.library/device/KINDS.md, and less what an offline
# engine never imports: the OpenAI/Anthropic servers' extras, OpenTelemetry, video decoders,
# FlashInfer, which the host never had). torchvision must match torch (the host's 0.26 is for
# 2.11), transformers 5.20 for DeepSeek-V4's config (the host has 5.17).
BIG="torch==2.14.0 triton==3.8.0 vllm==0.33.0"
SMALL="annotated-types==0.8.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 cffi==2.1.1
compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2
httpx2-jsfetch==1.0 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3
mistral-common==1.13.1 msgspec==0.23.0 nvtx==0.2.15 openai==3.60.0 orjson==3.13.0 oss-harmony==0.0.11
outlines-core==0.2.14
partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycparser==3.12
pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 python-json-logger==4.2.0 pyzmq==27.3.0
referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
torchvision==0.29.0 transformers==5.20.2 truststore==0.10.5 typing-inspection==0.4.5 watchfiles==1.3.0
xgrammar==0.2.8"
# DeepSeek-V4 on CUDA: its hyper-connection kernels are TileLang (model_executor/kernels/mhc), and
# its compressor for 512-wide heads is CuTe DSL on every CUDA arch (models/deepseek_v4/compressor.py),
# which imports quack; Qwen3-Next's start imports quack too.
# nvidia-cutlass-dsl asks for its CUDA 12 libraries by default; the host is CUDA 13.
KERNELS=${KERNELS:-"tilelang==0.1.12 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0
nvidia-cutlass-dsl-libs-cu13==4.8.0 quack-kernels==0.6.5"}

mkdir -p "$W/wheels"
for w in $BIG $SMALL $KERNELS; do
  $PIP download -q $PLAT -d "$W/wheels" "$w"
done
# zstandard travels as a wheel of its own: the host may have no zstd.
$PIP download -q $PLAT -d "$W" zstandard==0.25.0
rm -rf "$W/site"
$PIP install -q --no-compile --ignore-requires-python --target "$W/site" $PLAT "$W"/wheels/*.whl
( cd "$W/site" && rm -rf bin vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs \
    triton/backends/nvidia/lib/cupti-blackwell triton/backends/nvidia/lib/cupti \
    triton/backends/nvidia/bin/ptxas-blackwell triton/instrumentation/libGPUInstrumentationTestLib.so \
    torch/bin/protoc* torch/testing/_internal/generated )
du -sh "$W/site"
rm -rf "$D"/part* "$D/vllm033.tar.zst"
tar -C "$W/site" -cf - . | zstd -q -T0 -12 --long=27 -o "$D/vllm033.tar.zst"
( cd "$D" && sha256sum vllm033.tar.zst > SHA256SUMS && split -b 54m -d -a 2 vllm033.tar.zst vllm033.tar.zst.part- \
    && rm vllm033.tar.zst )
n=1
for p in "$D"/vllm033.tar.zst.part-*; do
  q=$(printf '%02d' $n); mkdir -p "$D/part$q"; mv "$p" "$D/part$q/"; n=$((n + 1))
done
last="$D/part$(printf %02d $((n - 1)))"  # the smallest part
cp "$D/SHA256SUMS" "$W"/zstandard-*.whl "$last/"
${CC:-cc} -shared -fPIC -O1 -o "$last/libnccl-missing.so" "$(dirname "$0")/nccl-missing.c"
du -sh "$D"/part*
echo "$((n - 1)) parts in $D: scripts/device-vllm.sh v33 1 … v33 $((n - 1)), then v33 install"

#!/usr/bin/env bash
# Downloads what `vllm serve` (vLLM 0.26's OpenAI server) imports beyond what LLM() needs and the
# GPU host has (../shared/vllm-gpu/fetch.sh brings LLM()'s set) into .device/serve-wheels
# (git-ignored, ~1.5 MiB): `scripts/device-vllm.sh install` installs them when they are there,
# and `scripts/device-vllm.sh run serve` needs them. The list is what a walk of vLLM 0.26's
# imports from vllm.entrypoints.cli.main and openai.api_server found missing on the host
# (uvicorn, watchfiles, prometheus-fastapi-instrumentator, model-hosting-container-standards)
# and their own requirements the host lacks (jmespath, supervisor).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.device/serve-wheels
rm -rf "$D" && mkdir -p "$D"
for w in "uvicorn==0.55.0" "watchfiles==1.3.0" "prometheus-fastapi-instrumentator==8.1.0" \
         "model-hosting-container-standards==0.1.16" "jmespath==1.1.0" "supervisor==4.3.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$D" "$w"
done
du -sh "$D"

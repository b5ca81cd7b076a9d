#!/usr/bin/env bash
# The GPU checks of a lent device machine: on-device tests, a plain LLM() run, decode latency at the Qwen3-0.6B and
# Llama-3-8B shapes. First, here: `python scripts/device_pack.py` (wheels and a model that fit the tool's 64 MiB).
# Then, through the device tool, in the repository root with `.device` carried:
#   bash scripts/device_check.sh STEP...         # steps: device tests smoke qwen 8b host
# A call runs at most 600 s and a fresh machine compiles everything, so on one run `tests` alone (up to 400 s), then
# `smoke qwen 8b` (up to 340 s) in a second call while the machine is warm. `device` is tests/device alone (240 s);
# `host` (up to 240 s) is bench_host at the 8B shape, for a third call.
# Logs and JSON land in $OUT (the tool's folder; ./out/device elsewhere), one log per step, at most 8 files.
set -uo pipefail
out=${OUT:-out/device}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .device/whl/*.whl \
  || { echo "run scripts/device_pack.py first and carry .device"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/.device/pkgs:$PWD" PYTHONUNBUFFERED=1

# A step runs under its own time limit, so a hang costs that step only; its whole log is kept, its tail printed.
failed=0
step() {
  local name=$1 limit=$2 code
  shift 2
  echo "== $name: $* (limit ${limit}s, $(date +%T))"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  code=$?
  echo "== $name: exit $code ($(date +%T))"
  tail -n "${TAIL:-30}" "$out/$name.log"
  [ "$code" = 0 ] || failed=$((failed + 1))
}

[ $# -gt 0 ] || { echo "usage: bash scripts/device_check.sh STEP...  (device tests smoke qwen 8b host; see the header)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
for name in "$@"; do
  case $name in
    # tests/device, then the kernel tests with GPU cases (the CPU kernels' tests would spend minutes building
    # numba handlers on the device's host); `device` alone is the quick check.
    device) step device 240 env JAXINFER_TEST_DEVICE=1 python3 -m pytest -q -p no:cacheprovider -rs tests/device ;;
    tests) step tests 400 env JAXINFER_TEST_DEVICE=1 python3 -m pytest -q -p no:cacheprovider -rs tests/device \
      tests/kernels/test_paged_{dispatch,kernels,lowering,write_kv}.py tests/kernels/test_{pool_rows,kernel_guards,kernel_prebuild}.py ;;
    smoke) step smoke 90 python3 scripts/device_smoke.py ;;
    qwen) step qwen 90 python3 -m benchmarks.bench_latency --shape qwen3-0.6b --sections decode --batch 1 \
      --out "$out/qwen.json" ;;
    8b) step 8b 160 python3 -m benchmarks.bench_latency --shape llama3-8b --sections decode --batch 1,64 \
      --out "$out/8b.json" ;;
    # Overlap scheduling on and off, with the device's idle time between steps (bench_latency runs it off): on an
    # H200 the engine added 9.6 ms to a 9.9 ms batch-64 8B step without overlap, where this CPU's host needs <1 ms.
    host) step host 240 python3 -m benchmarks.bench_host --shape llama3-8b --sections offline --batch 1,64 \
      --steps 16 --warmup-steps 4 --bare-iters 8 --out "$out/host.json" ;;
    *) echo "unknown step $name"; failed=$((failed + 1)) ;;
  esac
done
echo "== $failed step(s) failed"
[ "$failed" = 0 ]

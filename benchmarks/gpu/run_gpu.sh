#!/usr/bin/env bash
# On a GPU machine, from the repository root, with the wheels of benchmarks/gpu/fetch_wheels.sh in .whl/: install
# them beside the machine's torch, run the GRPO benchmark against TRL on the GPU with a Qwen2.5-0.5B-shaped model
# built in code (hf rollouts on both sides), then the GPU-marked tests. Logs under $OUT (default /tmp/gpu-out):
# env.txt, tests.log, bench.log (its last line is the benchmark's JSON). Record what they show in docs/gpu_runs.md.
#   TESTS_S / BENCH_S: seconds for each part (default 180 / 330); BENCH_ARGS: more benchmark options.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "run_gpu: installing .whl/ failed" >&2; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, trl; print(sys.version.split()[0], 'torch', torch.__version__,
  'transformers', transformers.__version__, 'trl', trl.__version__, 'cuda', torch.cuda.is_available())"; } 2>&1 \
  | tee "$OUT/env.txt"
# the benchmark first (it has never run on a GPU), then the tests
# shellcheck disable=SC2086
timeout "${BENCH_S:-330}" python3 benchmarks/bench_grpo_vs_trl.py --device cuda --sizes qwen2.5-0.5b \
  --workloads short long --workers 1 --precision bfloat16 --prompts 16 --samples 8 --completion 128 \
  --warmup 1 --steps 3 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# one pytest per package (each has its own pytest settings and markers), all within TESTS_S seconds
deadline=$(( $(date +%s) + ${TESTS_S:-180} ))
for tests in packages/core/tests/test_platforms.py packages/engine-fsdp/tests/test_fsdp_engine.py \
             packages/engine-fsdp/tests/test_ulysses.py packages/engine-megatron/tests/test_cuda.py \
             packages/diffusion/tests/test_cuda.py; do
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 10 ] || { echo "run_gpu: no time left for $tests"; continue; }
  echo "== $tests"
  timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider "$tests"
done 2>&1 | tee "$OUT/tests.log"

#!/usr/bin/env bash
# The wheels a GPU machine without a package registry needs for the GPU checks (docs/gpu_runs.md): polyrl's own
# packages, built here, and the lock's versions of what the machine's image lacks or has in other versions
# (CPython 3.12, x86-64 Linux), into .whl/ at the repository root (git-ignored through .git/info/exclude).
# Then, on the GPU machine, from the repository root: bash benchmarks/gpu/run_gpu.sh (with .whl carried there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
for pkg in core engine-fsdp engine-megatron diffusion; do
  "$PY" -m build --no-isolation --wheel --quiet --outdir .whl "packages/$pkg"
done
# what the image lacks (tensordict, omegaconf, TRL and datasets) and what polyrl is tested with (transformers...)
names="tensordict omegaconf antlr4-python3-runtime transformers tokenizers huggingface_hub safetensors accelerate
       peft datasets dill multiprocess megatron-core diffusers httpx2 httpcore2 truststore importlib_metadata pyvers"
specs=()
for name in $names; do
  spec=$(grep -i "^${name}==" requirements/lock.txt) || { echo "fetch_wheels: $name is not in requirements/lock.txt" >&2; exit 1; }
  specs+=("$spec")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}" "trl==${TRL_VERSION:-1.16.0}"
ls .whl
du -sh .whl

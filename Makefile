# vt: make demo (both stages on the tiny model + real clips), make test (the whole suite, CPU only).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/demo.toml
SET ?=
FAMILY ?= ltx-video
# pytest-xdist workers of `make test` (a test may start up to 8 ranks of its own)
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup system lint format demo test bench gpu-check precompute train pipeline assets clean

$(VENV)/.installed: pyproject.toml
	@started=$$(date +%s); set -e; \
	$(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q torch==2.13.0; \
	$(PY) -m pip install -q -e '.[dev]'; \
	touch $@; \
	echo "bootstrap (virtualenv and packages): $$(( $$(date +%s) - started )) s"

setup: $(VENV)/.installed

runs/data/clips/.done: $(VENV)/.installed scripts/fetch_sample_clips.py
	$(PY) scripts/fetch_sample_clips.py runs/data/clips
	touch $@

runs/data/raw/.done: runs/data/clips/.done scripts/make_sample_shards.py
	$(PY) scripts/make_sample_shards.py --clips runs/data/clips --out runs/data/raw
	touch $@

runs/models/%-tiny/.done: $(VENV)/.installed scripts/make_tiny_model.py
	$(PY) scripts/make_tiny_model.py --family $* runs/models/$*-tiny
	touch $@

assets: runs/data/raw/.done runs/models/$(FAMILY)-tiny/.done

demo: assets
	rm -rf runs/demo
	$(VENV)/bin/vt-precompute --help >/dev/null
	scripts/pipeline.sh $(CONFIG) $(SET)
	@echo "demo finished: open runs/demo/report.html (also loss.png, lora/, validation/, metrics.jsonl)"

pipeline: assets
	scripts/pipeline.sh $(CONFIG) $(SET)

precompute: assets
	$(VENV)/bin/vt-precompute run $(CONFIG) $(SET)

train: assets
	$(VENV)/bin/vt-train run $(CONFIG) $(SET)

# The system packages some tests run (Slurm's daemons, Chromium), installed before the suite's clock starts; where
# they cannot be, those tests say why.
system:
	@started=$$(date +%s); \
	scripts/ensure_slurm.sh >/dev/null || echo "Slurm not installed: the Slurm tests will say why"; \
	scripts/ensure_browser.sh >/dev/null || echo "Chromium not installed: the page tests will say why"; \
	echo "system packages: $$(( $$(date +%s) - started )) s"

# The tree as ruff formats and checks it (pyproject.toml [tool.ruff]); `make format` fixes what it can.
lint: setup
	$(VENV)/bin/ruff format --check --quiet . && $(VENV)/bin/ruff check --quiet .

format: setup
	$(VENV)/bin/ruff format --quiet . && $(VENV)/bin/ruff check --fix --quiet .

test: setup system lint
	@started=$$(date +%s); status=0; \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=40 tests || status=$$?; \
	echo "suite: $$(( $$(date +%s) - started )) s (from the first test's start-up, bootstrap and system packages apart)"; \
	exit $$status

bench: assets
	$(PY) scripts/bench.py
	$(PY) scripts/bench_memory.py

# One GPU: attention backends, AC, compile, fp8 (docs/benchmarks.md); `make gpu-check GPU_ARGS=--dry` on a CPU.
gpu-check: setup
	scripts/gpu_check.sh $(GPU_ARGS)

clean:
	rm -rf runs .cache

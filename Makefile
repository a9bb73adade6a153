# memproxy: `make serve` runs the proxy on the embedded default; `make test` runs the whole suite.
# Both create .venv on first use. The Dockerfile runs the same install steps.

# The interpreter .venv (and LiteLLM's bench venv) is made from: the operating system's own Python 3.11-3.13 when
# it has venv, else python3 from PATH; PYTHON=... overrides. Distribution builds are compiled with PGO and LTO,
# as is the python:3.11 image the Dockerfile starts from; a CPython built without --enable-optimizations (pyenv's
# default, first on PATH on this project's machine) runs the read path's Python slower (`make bench-profile`, c=1:
# 6.4 against 5.3 ms of CPU a request), so the benches measured a slower interpreter than the container ships.
SYSTEM_PYTHON = $(shell /usr/bin/python3 -c 'import sys, ensurepip, venv; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))' 2>/dev/null && echo /usr/bin/python3)
PYTHON ?= $(or $(SYSTEM_PYTHON),python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
CONSTRAINTS := constraints.txt
export HF_HUB_OFFLINE := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: serve test install install-test lint bench-overhead bench-store bench-locomo bench-readpath bench-scale bench-profile bench-load bench-cluster test-cluster bench-writes bench-cache bench-screens clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.runtime: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(PIP) install --quiet -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.test: pyproject.toml $(CONSTRAINTS) $(VENV)/.runtime
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $@

tests/node/node_modules/.installed: tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund
	touch $@

# Headless Chromium for the web page's end-to-end test (Debian packages; CI runs as root).
$(VENV)/.chromium: | $(BIN)/python
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	else apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; fi
	touch $@

# nginx for the cluster test (Debian package; CI runs as root).
$(VENV)/.nginx: | $(BIN)/python
	@if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then :; \
	else apt-get update -qq && (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light \
	|| DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx); fi
	touch $@

install: $(VENV)/.runtime

install-test: $(VENV)/.test tests/node/node_modules/.installed $(VENV)/.chromium

# The allocator settings the Dockerfile sets too (docs/operations.md, "Memory (RSS)"); the environment's win.
serve: install
	ARROW_DEFAULT_MEMORY_POOL=$${ARROW_DEFAULT_MEMORY_POOL:-system} MALLOC_MMAP_THRESHOLD_=$${MALLOC_MMAP_THRESHOLD_:-131072} \
		MALLOC_ARENA_MAX=$${MALLOC_ARENA_MAX:-2} $(BIN)/memproxy serve $(ARGS)

test: install-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# 3 replicas on moto's S3 server behind nginx with deploy/nginx/memproxy.conf (tests/test_cluster.py).
test-cluster: $(VENV)/.test $(VENV)/.nginx
	MEMPROXY_TEST_CLUSTER=1 $(BIN)/python -m pytest tests/test_cluster.py $(PYTEST_ARGS)

# ruff check, ruff format --check and mypy --strict ([tool.mypy]: proxy, insights); all three run, then any failure fails.
LINT_PATHS := proxy insights tests bench scripts
lint: $(VENV)/.test
	@status=0; \
	$(BIN)/ruff check $(LINT_PATHS) || status=1; \
	$(BIN)/ruff format --check $(LINT_PATHS) || status=1; \
	$(BIN)/python -m mypy || status=1; \
	exit $$status

bench-overhead: install-test
	$(BIN)/python bench/overhead.py

bench-store: install-test
	$(BIN)/python bench/store.py

bench-locomo: install-test
	$(BIN)/python bench/locomo.py

bench-readpath: install-test
	$(BIN)/python bench/readpath.py

bench-scale: install-test
	$(BIN)/python bench/scale.py

# py-spy on memproxy under load (ARGS="--mode off --concurrency 1" for the proxy alone).
bench-profile: install-test
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test,bench]'
	$(BIN)/python bench/profile.py $(ARGS)

# LiteLLM's proxy for the side-by-side load bench, in its own venv (never in the project's).
bench/.venv-litellm/bin/litellm:
	$(PYTHON) -m venv bench/.venv-litellm
	bench/.venv-litellm/bin/python -m pip install --quiet --upgrade pip
	bench/.venv-litellm/bin/python -m pip install --quiet 'litellm[proxy]==1.108.7'

bench-load: install-test bench/.venv-litellm/bin/litellm
	$(BIN)/python bench/load.py $(ARGS)

bench-cluster: $(VENV)/.test $(VENV)/.nginx
	$(BIN)/python bench/cluster.py $(ARGS)

# The write side: 10 min of sustained full-mode chat, then LoCoMo replayed for the memory side's cost
# (ARGS="--mode replay" or "--minutes 2" for shorter runs).
bench-writes: install-test
	$(BIN)/python bench/writes.py $(ARGS)

# LoCoMo replayed as growing chats: the provider's prompt cache and the bill, per placement (bench/results/cache.json).
bench-cache: install-test
	$(BIN)/python -m bench.cache $(ARGS)

# Labelled secrets and instruction plants (recall) and LoCoMo's turns (false positives) through the screens.
bench-screens: install
	$(BIN)/python bench/screens.py $(ARGS)

clean:
	rm -rf $(VENV) tests/node/node_modules .pytest_cache

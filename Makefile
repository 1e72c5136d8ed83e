# loopgate: two commands on a fresh machine.
#   make demo   - the main job on this machine (MuJoCo reach, CPU inference)
#   make test   - lint, type checks and every test layer
# Both create .venv and install what they need; `make install` is idempotent.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU machines must get PyTorch's CPU build: a plain `torch` from PyPI is a multi-GB
# CUDA build. Local wheels (find-links) or PyTorch's CPU index provide it.
TORCH_INDEX ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu*),,$(if $(shell command -v nvidia-smi 2>/dev/null),,--extra-index-url https://download.pytorch.org/whl/cpu))
EXTRAS ?= gateway,dev,train,export,ros2,console,ray
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
# mjlab (Isaac Lab's env API on MuJoCo Warp) pins mujoco~=3.11, which cannot share .venv
# (MuJoCo 4): it gets its own venv, where env workers run (env.python), with loopgate's
# `worker` extra only. torch is held at the pinned CPU build while mjlab resolves.
MJLAB_VENV := .venv-mjlab
MJLAB_PY := $(MJLAB_VENV)/bin/python
MJLAB_STAMP := $(MJLAB_VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
export MUJOCO_GL ?= egl

.PHONY: install mjlab-venv system-deps demo test lint typecheck test-unit test-conformance test-integration test-e2e bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# System libraries: Mesa EGL and OSMesa for headless MuJoCo rendering; Debian's
# Chromium for the console's browser tests (Playwright drives /usr/bin/chromium).
system-deps:
	@missing=""; \
	for lib in libEGL.so.1 libOSMesa.so; do ldconfig -p | grep -q "$$lib" || missing="$$missing $$lib"; done; \
	if [ -n "$$missing" ]; then \
	  pkgs="libegl1 libgl1-mesa-dri libosmesa6"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs; \
	  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs; \
	  else echo "warning: missing$$missing; install: apt-get install $$pkgs (MuJoCo cameras need it)"; fi; \
	fi
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else echo "warning: /usr/bin/chromium missing; install: apt-get install chromium (the console's browser tests need it)"; fi; \
	fi

$(STAMP): $(PY) pyproject.toml Makefile
	$(MAKE) --no-print-directory system-deps
	$(PIP) install --quiet $(TORCH_INDEX) "torch==2.13.0"
	$(PIP) install --quiet $(TORCH_INDEX) -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

$(MJLAB_PY):
	$(PYTHON) -m venv $(MJLAB_VENV)
	$(MJLAB_PY) -m pip install --quiet --upgrade pip

$(MJLAB_STAMP): $(MJLAB_PY) pyproject.toml Makefile
	echo "torch==2.13.0" > $(MJLAB_VENV)/constraints.txt
	$(MJLAB_PY) -m pip install --quiet $(TORCH_INDEX) "torch==2.13.0"
	$(MJLAB_PY) -m pip install --quiet $(TORCH_INDEX) -c $(MJLAB_VENV)/constraints.txt -e ".[worker,mjlab,venv-test]"
	rm -f $(MJLAB_VENV)/.installed-*
	touch $(MJLAB_STAMP)

mjlab-venv: $(MJLAB_STAMP)

install: $(STAMP) $(MJLAB_STAMP)

# The main job needs only .venv (not the mjlab venv the tests use).
demo: $(STAMP)
	$(VENV)/bin/loopgate up configs/reach_sim.yaml

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy

# pytest exits 5 when it collected nothing: that is a failure here, never a pass.
define run_pytest
	$(PY) -m pytest $(1) $(PYTEST_ARGS); code=$$?; \
	if [ $$code -eq 5 ]; then echo "pytest collected no tests for: $(1)"; exit 1; fi; exit $$code
endef

# TEST_WORKERS pytest workers (pytest-xdist): whole experiments (e2e: trainers, clusters,
# chaos) run one after another on one of them, first; the other layers, mostly waits on
# processes and sockets, share the workers (tests/conftest.py groups them).
TEST_WORKERS ?= 2
test: lint typecheck
	@$(call run_pytest,-n $(TEST_WORKERS) --dist loadgroup tests)

test-unit: install
	@$(call run_pytest,-m unit tests)
test-conformance: install
	@$(call run_pytest,-m conformance tests)
test-integration: install
	@$(call run_pytest,-m integration tests)
test-e2e: install
	@$(call run_pytest,-m e2e tests)

bench: install
	$(VENV)/bin/loopgate bench

clean:
	rm -rf $(VENV) $(MJLAB_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Two commands for a new user: `make demo` and `make test`. Both create .venv (Python 3.12) when missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The compile-check venvs: jax's real TPU compiler (libtpu) and CUDA compiler (plugin + ptxas) run
# ahead of time on this CPU host. They live apart from .venv so that `make demo` never loads them.
AOT_TPU_VENV ?= .venv-tpu-aot
AOT_GPU_VENV ?= .venv-gpu-aot
# The oldest supported end (Python 3.11, jax 0.10.2 and the libtpu it pins): the kernel's compile checks
# run there too. The project goes in without its dependencies (the compile needs jax and kda_plugin).
AOT_TPU_OLD_VENV ?= .venv-tpu-aot-jax0102
PYTHON311 ?= $(shell command -v python3.11 2>/dev/null || echo python3.11)
# pyenv shims pick 3.12 from .python-version; fall back to any python3.12 on PATH.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || echo python3.12)
PYTEST_WORKERS ?= 2
# Whole test files per xdist worker, in collection order (tests/conftest.py puts the longest first and
# the compile checks last): a module's fixtures (a server, a compiled engine, converted checkpoints)
# are built once, not once per worker as with the default per-test `load` distribution (faster:
# docs/performance.md, "Demo and tools").
# (`--dist loadgroup` would group by xdist_group marks, but with pytest 9.2 and xdist 3.8 it silently
# groups nothing: xdist renames item._nodeid, which pytest 9.2 no longer reads.)
PYTEST_DIST ?= --dist loadfile --no-loadscope-reorder
# Extra pytest arguments, e.g. `make test PYTEST_ARGS='-k scoring -x'`. The slowest tests are listed at the end.
PYTEST_ARGS ?= --durations=15
# Tests find the compile venvs through these (tests/aot/conftest.py); under `make test` a missing or
# broken compile venv fails the tests instead of skipping them.
AOT_ENV := KDA_AOT_REQUIRED=1 KDA_AOT_TPU_PYTHON=$(CURDIR)/$(AOT_TPU_VENV)/bin/python \
  KDA_AOT_GPU_PYTHON=$(CURDIR)/$(AOT_GPU_VENV)/bin/python \
  KDA_AOT_TPU_JAX0102_PYTHON=$(CURDIR)/$(AOT_TPU_OLD_VENV)/bin/python

.PHONY: demo test test-slow install install-aot bench clean

# $(call venv_recipe,DIR,EXTRAS): create DIR with Python 3.12 and install the project with EXTRAS.
# --no-compile: Python byte-compiles a module when it is first imported; compiling every file of
# about 2 GB of wheels up front costs more CPU than the install itself.
define venv_recipe
	@test -x $(1)/bin/python || $(PYTHON312) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet --no-compile -e '.[$(2)]'
	@touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml
	$(call venv_recipe,$(VENV),test)

$(AOT_TPU_VENV)/.installed: pyproject.toml
	$(call venv_recipe,$(AOT_TPU_VENV),aot-tpu)

$(AOT_GPU_VENV)/.installed: pyproject.toml
	$(call venv_recipe,$(AOT_GPU_VENV),aot-gpu)

$(AOT_TPU_OLD_VENV)/.installed: pyproject.toml
	@test -x $(AOT_TPU_OLD_VENV)/bin/python || $(PYTHON311) -m venv $(AOT_TPU_OLD_VENV)
	$(AOT_TPU_OLD_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(AOT_TPU_OLD_VENV)/bin/python -m pip install --quiet --no-compile 'jax[tpu]==0.10.2'
	$(AOT_TPU_OLD_VENV)/bin/python -m pip install --quiet --no-compile --no-deps -e .
	@touch $@

install: $(VENV)/.installed

install-aot: $(AOT_TPU_VENV)/.installed $(AOT_GPU_VENV)/.installed $(AOT_TPU_OLD_VENV)/.installed

demo: install
	$(PY) -m tools.demo

# The compile venvs (about 1 GB of wheels) install in the background while the suite starts: the tests
# that need them run last (tests/conftest.py) and wait for the install (tests/aot/conftest.py reads
# its exit status from AOT_INSTALL_RC; a failed install fails them, with the log's tail).
AOT_INSTALL_LOG := .aot-install.log
# The stack: 64 MiB instead of 8 (a guess at the cause, not proven): twice an xdist
# worker died with SIGSEGV/SIGABRT inside XLA's CPU compile of a training step (tests/train), which
# deep recursion on the default 8 MiB stack would explain; the same tests pass when run alone.
define test_recipe
	@rm -f $(AOT_INSTALL_LOG).rc
	@( $(MAKE) --no-print-directory install-aot > $(AOT_INSTALL_LOG) 2>&1; echo $$? > $(AOT_INSTALL_LOG).rc ) & \
	ulimit -s 65536 2>/dev/null || true; \
	rc=0; $(AOT_ENV) KDA_AOT_INSTALL_RC=$(CURDIR)/$(AOT_INSTALL_LOG).rc \
	  $(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_DIST) -m $(1) $(PYTEST_ARGS) tests || rc=$$?; wait; exit $$rc
endef

test: install
	$(call test_recipe,"not slow")

test-slow: install
	$(call test_recipe,slow)

bench: install
	$(PY) tools/benchmark_kda.py

clean:
	rm -rf $(VENV) $(AOT_TPU_VENV) $(AOT_GPU_VENV) $(AOT_TPU_OLD_VENV) .pytest_cache .hypothesis $(AOT_INSTALL_LOG) $(AOT_INSTALL_LOG).rc

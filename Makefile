# Two commands for a new user: `make demo` and `make test`. Both create .venv (Python 3.12) when missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# pyenv shims pick 3.12 from .python-version; fall back to any python3.12 on PATH.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || echo python3.12)
PYTEST_WORKERS ?= 2

.PHONY: demo test test-slow install bench clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m tools.demo

test: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m slow tests

bench: install
	$(PY) tools/benchmark_kda.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

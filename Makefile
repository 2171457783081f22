# `make demo` and `make test` do all the set-up on a fresh machine: virtualenv, install, run.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) -e .
	touch $@

# torch first, pinned: it is the local CPU build, and nothing else may pull a CUDA one.
$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/harvest demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest

bench: $(VENV)/.installed-test
	$(BIN)/python bench/forward.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

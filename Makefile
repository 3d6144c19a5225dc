# `make demo` and `make test` set everything up from nothing (a .venv beside this file).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ortfuse-installed
# test workers: one per core, at most 4 (each imports torch and builds its own tiny zoo); TEST_JOBS=0 runs in-process
TEST_JOBS ?= auto

.PHONY: demo test install native clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

native: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

demo: $(STAMP)
	$(PY) -m ortfuse demo

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --maxprocesses 4 tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

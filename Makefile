# `make demo` and `make test` set themselves up from nothing: a .venv with what each needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_BASE := $(VENV)/.stamp-base
STAMP_TEST := $(VENV)/.stamp-test

.PHONY: demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP_BASE): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[models]"
	touch $@

$(STAMP_TEST): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@ $(STAMP_BASE)

demo: $(STAMP_BASE)
	$(PY) -m jaxkv.demo

test: $(STAMP_TEST)
	$(PY) -m pytest -q

bench: $(STAMP_TEST)
	$(PY) benchmarks/bench_update.py

clean:
	rm -rf $(VENV)

# `make demo` and `make test` set themselves up from nothing: a .venv with what each needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP_BASE := $(VENV)/.stamp-base
STAMP_TEST := $(VENV)/.stamp-test

.PHONY: demo demo-caches cpu-kernel test test-fast bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP_BASE): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[models]"
	touch $@

$(STAMP_TEST): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,bench]"
	touch $@ $(STAMP_BASE)

# The main job on the embedded default model: stream Python-like text, then a summary line.
demo: $(STAMP_BASE)
	$(PY) -m jaxkv generate "def fibonacci(" --max-new-tokens 120

# The cache vocabulary by hand (no model).
demo-caches: $(STAMP_BASE)
	$(PY) -m jaxkv.demo

# The CPU attention kernel, built before the tests (once per machine, cached; about 45 s of g++
# on a new machine; without a compiler it warns and the XLA path is tested), so that the two
# pytest workers do not both compile it on their first attention call.
cpu-kernel: $(STAMP_TEST)
	$(PY) -c "import jaxkv._kernels as k; k.available()"

# Two workers: the machine this runs on has two cores (each worker holds ~4 GiB, so not -n auto).
# The whole suite and the notebooks: what CI runs (.ci/run); it lists the 15 slowest tests.
test: cpu-kernel
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15 tests --nbmake notebooks

# The inner loop: the suite without the tests marked slow (transformers references,
# subprocesses, README blocks, the longest generation checks) and without the notebooks.
test-fast: cpu-kernel
	$(PY) -m pytest -q -n 2 -m "not slow" tests

# Every benchmark, each printing its table and writing benchmarks/results/*.json.
bench: $(STAMP_TEST)
	$(PY) benchmarks/bench_update.py
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_cache_kinds.py
	$(PY) benchmarks/bench_kernel_kinds.py
	$(PY) benchmarks/bench_capacity.py
	$(PY) benchmarks/bench_generate.py
	$(PY) benchmarks/bench_compile.py
	$(PY) benchmarks/bench_serving.py
	$(PY) benchmarks/bench_speculative.py
	$(PY) benchmarks/bench_demo.py
	$(PY) benchmarks/bench_persist.py
	$(PY) benchmarks/bench_paged.py
	$(PY) benchmarks/bench_offload.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_first_call.py
	$(PY) benchmarks/bench_penalties.py

clean:
	rm -rf $(VENV)

import os

# Deterministic, quiet CPU runs; tests that need several devices start a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is mostly XLA compiling hundreds of small programs, and most of that is
# LLVM optimizing machine code the tests run once. JAX's switch for that (LLVM at -O0, no
# expensive passes) cuts it by ~40%: 87 tests of five files took 120 s instead of 210 s. Set
# here so subprocesses (the CLI, 8-device scripts, notebook kernels) inherit it; the checks
# on compiled programs (no cache-sized copies, XLA's memory plan) pass either way.
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the suite fully optimized.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Two more compile-time switches, same reasoning: XLA:CPU's older fusion emitters, which
# compile faster than its MLIR ones, and HLO op locations without Python tracebacks (Python's
# own tracebacks are unchanged). The whole suite, back to back: 10:03 with JAX's defaults and
# 6:32 with these; 5:50 and 9:25 in the other order (README "Tests"). JAX's defaults:
# XLA_FLAGS=--xla_cpu_use_fusion_emitters=true JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS=1
# JAX_TRACEBACK_IN_LOCATIONS_LIMIT=100.
# Only for the jaxlib releases known to have the flag: XLA exits the process on an unknown
# XLA_FLAGS entry, and the H200's jax 0.11.2 (where XLA retired the older CPU emitters) ended
# pytest during collection with status 1 and no message while plain scripts ran.
def _jaxlib_before(major, minor):
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("jaxlib").split(".")
        return (int(parts[0]), int(parts[1])) < (major, minor)
    except (PackageNotFoundError, ValueError, IndexError):
        return False


if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and _jaxlib_before(0, 11):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run: CI cannot flake on a rare draw, and
# a failure reproduces. (Run with HYPOTHESIS_PROFILE=explore for fresh random examples.)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import sys  # noqa: E402

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: over ~5 s on the 2-core machine; `make test-fast` leaves these out (`make test` runs all)"
    )


def pytest_collection_modifyitems(config, items):
    # Long tests first (the README script, the notebooks, subprocess and transformers tests):
    # pytest-xdist hands out tests in collection order, so a long test collected last can keep
    # one worker busy after the other has finished. Stable: file order is kept otherwise.
    def late(item):
        return not (item.get_closest_marker("slow") or item.nodeid.startswith("notebooks/"))

    items.sort(key=late)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The transformers references run torch on this 2-core machine beside pytest's other
    # worker and XLA's own threads: with its default thread count a tiny generate took
    # 16-18 s instead of 0.1 s. Set once torch has been imported by a test.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _no_persistent_compilation_cache():
    # `jaxkv.cli.main` turns on JAX's persistent compilation cache for its process (the CLI's
    # cold start). Called in a pytest worker without JAXKV_COMPILATION_CACHE=0, it turned it
    # on for every later test of that worker: each of ~1300 programs was then written to
    # ~/.cache/jaxkv/xla (and read back on the next run), so the suite measured and wrote
    # outside its own directory. Tests that run the CLI in-process set that variable.
    yield
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_compilation_cache_dir:
        directory = jax.config.jax_compilation_cache_dir
        jax.config.update("jax_compilation_cache_dir", None)
        pytest.fail(f"this test turned on JAX's persistent compilation cache ({directory}); "
                    "set JAXKV_COMPILATION_CACHE=0 before calling jaxkv.cli.main in-process")

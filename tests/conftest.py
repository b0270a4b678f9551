import os

# Deterministic, quiet CPU runs; tests that need several devices start a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run: CI cannot flake on a rare draw, and
# a failure reproduces. (Run with HYPOTHESIS_PROFILE=explore for fresh random examples.)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The transformers references run torch on this 2-core machine beside pytest's other
    # worker and XLA's own threads: with its default thread count a tiny generate took
    # 16-18 s instead of 0.1 s. Set once torch has been imported by a test.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield

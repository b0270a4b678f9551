import os

# Deterministic, quiet CPU runs; tests that need several devices start a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run: CI cannot flake on a rare draw, and
# a failure reproduces. (Run with HYPOTHESIS_PROFILE=explore for fresh random examples.)
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

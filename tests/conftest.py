import os

# Deterministic, quiet CPU runs; tests that need several devices start a subprocess.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

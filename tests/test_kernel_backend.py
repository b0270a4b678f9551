"""The native CPU kernel is built and registered only for computations that run on CPU:
tracing attention for a GPU or TPU default device never runs the C++ compiler."""

import jax
import jax.numpy as jnp
import pytest

from jaxkv import _kernels
from jaxkv.attention.blockwise import blockwise_attend

ARGS = (jnp.ones((1, 2, 1, 16)), jnp.ones((1, 1, 8, 16)), jnp.ones((1, 1, 8, 16)))
KW = dict(q_positions=jnp.array([[4]], jnp.int32), kv_lengths=jnp.array([5], jnp.int32))


@pytest.fixture
def builds(monkeypatch):
    """Forgets any earlier build and records each call of the builder (which then fails,
    as a build without a compiler would)."""
    calls = []

    def build(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("test builder: no compiler here")

    monkeypatch.setattr(_kernels, "_state", {})
    monkeypatch.setattr(_kernels, "build", build)
    monkeypatch.delenv("JAXKV_CPU_KERNEL", raising=False)
    return calls


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_other_backends_never_build_the_kernel(platform, builds, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    jaxpr = jax.make_jaxpr(lambda *a: blockwise_attend(*a, **KW))(*ARGS)
    assert builds == []
    assert _kernels.TARGET not in str(jaxpr)  # the XLA loop alone, no custom call
    with pytest.raises(ValueError, match=f"default device is a {platform} device"):
        blockwise_attend(*ARGS, implementation="kernel", **KW)
    assert builds == []


def test_cpu_backend_builds_the_kernel(builds, monkeypatch):
    """The control: the same patched builder is reached when the backend is CPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.warns(RuntimeWarning, match="kernel is unavailable"):
        jax.make_jaxpr(lambda *a: blockwise_attend(*a, **KW))(*ARGS)
    assert len(builds) == 1

"""Random operation sequences: DynamicCache (the HF reference semantics) and the NumPy
model agree.

StaticCache and the other kinds run random programs against the NumPy model in
test_conformance.py (under jit, ragged, with overflow and NaN/inf in unused slots); the
batch-changing row ops they do not draw are checked in test_cache.py."""

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_checks import assert_matches_reference
from jaxkv import DynamicCache
from reference import ReferenceCache

LAYERS, HEADS, HEAD_DIM, MAX_BATCH = 2, 2, 3, 6


def _op(draw, batch: int):
    kind = draw(
        st.sampled_from(["update", "update", "update", "crop", "reorder", "select", "repeat", "reset"])
    )
    if kind == "update":
        t = draw(st.integers(1, 4))
        return ("update", draw(st.integers(0, LAYERS - 1)), t)
    if kind == "crop":
        return ("crop", draw(st.integers(-5, 14)))
    if kind == "reorder":
        return ("reorder", draw(st.permutations(range(batch))))
    if kind == "select":
        return ("select", draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch)))
    if kind == "repeat":
        return ("repeat", draw(st.integers(1, max(1, MAX_BATCH // batch))))
    return ("reset",)


@st.composite
def programs(draw):
    batch = draw(st.integers(1, 3))
    ops, b = [], batch
    for _ in range(draw(st.integers(1, 14))):
        op = _op(draw, b)
        ops.append(op)
        if op[0] == "select":
            b = len(op[1])
        elif op[0] == "repeat":
            b *= op[1]
    return batch, ops, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_dynamic_matches_numpy_model(program):
    batch, ops, seed = program
    rng = np.random.default_rng(seed)
    cache, ref = DynamicCache(num_layers=LAYERS), ReferenceCache(LAYERS, batch)
    for op in ops:
        if op[0] == "update":
            _, layer, t = op
            keys = rng.standard_normal((ref.batch, HEADS, t, HEAD_DIM)).astype(np.float32)
            values = rng.standard_normal((ref.batch, HEADS, t, HEAD_DIM)).astype(np.float32)
            cache, got_k, got_v = cache.update(keys, values, layer)
            assert got_k.shape[2] == ref.length(layer, 0) + t
            ref.update(layer, keys, values)
        elif op[0] == "crop":
            cache = cache.crop(op[1])
            ref.crop(op[1])
        elif op[0] == "reorder":
            cache = cache.reorder_cache(jnp.array(op[1], jnp.int32))
            ref.select(op[1])
        elif op[0] == "select":
            cache = cache.batch_select_indices(jnp.array(op[1], jnp.int32))
            ref.select(op[1])
        elif op[0] == "repeat":
            cache = cache.batch_repeat_interleave(op[1])
            ref.repeat(op[1])
        else:
            cache = cache.reset()
            ref.reset()
        assert_matches_reference(cache, ref, heads=HEADS, head_dim=HEAD_DIM)

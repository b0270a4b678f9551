"""Random operation sequences: DynamicCache, StaticCache and the NumPy model agree."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_checks import assert_matches_reference
from jaxkv import DynamicCache, StaticCache
from reference import ReferenceCache

LAYERS, HEADS, HEAD_DIM, CAPACITY, MAX_BATCH = 2, 2, 3, 12, 6


def _op(draw, batch: int, ragged: bool):
    kind = draw(
        st.sampled_from(["update", "update", "update", "crop", "reorder", "select", "repeat", "reset"])
    )
    if kind == "update":
        t = draw(st.integers(1, 4))
        num_new = draw(st.lists(st.integers(0, t), min_size=batch, max_size=batch)) if ragged else None
        return ("update", draw(st.integers(0, LAYERS - 1)), t, num_new)
    if kind == "crop":
        if ragged and draw(st.booleans()):
            return ("crop", draw(st.lists(st.integers(-5, 14), min_size=batch, max_size=batch)))
        return ("crop", draw(st.integers(-5, 14)))
    if kind == "reorder":
        return ("reorder", draw(st.permutations(range(batch))))
    if kind == "select":
        return ("select", draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch)))
    if kind == "repeat":
        return ("repeat", draw(st.integers(1, max(1, MAX_BATCH // batch))))
    return ("reset",)


@st.composite
def programs(draw, ragged: bool):
    batch = draw(st.integers(1, 3))
    ops, b = [], batch
    for _ in range(draw(st.integers(1, 14))):
        op = _op(draw, b, ragged)
        ops.append(op)
        if op[0] == "select":
            b = len(op[1])
        elif op[0] == "repeat":
            b *= op[1]
    return batch, ops, draw(st.integers(0, 2**31 - 1))


def _run(cache, ref, ops, seed, *, static: bool):
    rng = np.random.default_rng(seed)
    for op in ops:
        if op[0] == "update":
            _, layer, t, num_new = op
            keys = rng.standard_normal((ref.batch, HEADS, t, HEAD_DIM)).astype(np.float32)
            values = rng.standard_normal((ref.batch, HEADS, t, HEAD_DIM)).astype(np.float32)
            if static:
                counts = [t] * ref.batch if num_new is None else num_new
                if any(ref.length(layer, b) + n > CAPACITY for b, n in enumerate(counts)):
                    with pytest.raises(ValueError, match="overflow"):
                        cache.update(keys, values, layer, num_new=None if num_new is None else jnp.array(num_new))
                    continue
                cache, _, _ = cache.update(keys, values, layer, num_new=None if num_new is None else jnp.array(num_new))
            else:
                cache, got_k, got_v = cache.update(keys, values, layer)
                assert got_k.shape[2] == ref.length(layer, 0) + t
            ref.update(layer, keys, values, num_new)
        elif op[0] == "crop":
            cache = cache.crop(op[1] if isinstance(op[1], int) else jnp.array(op[1], jnp.int32))
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
    return cache


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(ragged=False))
def test_dynamic_and_static_match_numpy_model(program):
    batch, ops, seed = program
    # A dynamic cache has no capacity; skip programs the static one would overflow on.
    _run(DynamicCache(num_layers=LAYERS), ReferenceCache(LAYERS, batch), ops, seed, static=False)
    static = StaticCache.init(
        num_layers=LAYERS, batch_size=batch, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_length=CAPACITY
    )
    final = _run(static, ReferenceCache(LAYERS, batch), ops, seed, static=True)
    assert not final.flags.any()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(ragged=True))
def test_static_ragged_matches_numpy_model(program):
    batch, ops, seed = program
    static = StaticCache.init(
        num_layers=LAYERS, batch_size=batch, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_length=CAPACITY
    )
    _run(static, ReferenceCache(LAYERS, batch), ops, seed, static=True)

"""Claims of the README checked against the code, where the code was wrong.

README "Overflow policy": indices and counts wider than int32 "are range-checked in their
own dtype, so ``2**32 + 1`` is refused, never row 1". ``PagedCache``'s own index-taking
methods (``retain`` / ``release`` page ids, ``attach_prefix`` row / count, ``take_rows`` /
``merge_rows`` rows) narrowed a NumPy int64 to int32 before checking it, so ``2**32 + 5``
pinned page 5, attached to row 1, or merged a sub-cache's row into row 1. The reference is
plain arithmetic: the valid ids are ``[0, num_pages)`` and ``[0, batch_size)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import PagedCache

WIDE = 2**32  # an int64 offset that int32 narrowing would silently drop


def _cache():
    cache = PagedCache.init(num_layers=1, batch_size=3, num_kv_heads=1, head_dim=2, max_length=8, page_size=2,
                            num_pages=8)
    k = jnp.ones((3, 1, 3, 2))
    cache, _, _ = cache.update(k, k, 0, num_new=jnp.array([3, 1, 2]))  # rows hold 3, 1, 2 tokens
    return cache


def test_retain_and_release_refuse_wide_page_ids_instead_of_wrapping():
    cache = _cache()
    pinned = cache.retain(np.array([5]))
    before = np.asarray(pinned.refcount).copy()
    with pytest.raises(ValueError, match="outside"):
        cache.retain(np.array([WIDE + 5], np.int64))  # was: pinned page 5
    with pytest.raises(ValueError, match="outside"):
        pinned.release(np.array([WIDE + 5], np.int64))  # was: released page 5's pin
    np.testing.assert_array_equal(pinned.refcount, before)


def test_attach_prefix_refuses_a_wide_row_or_count_instead_of_wrapping():
    cache = _cache().reset(jnp.array([False, True, False]))  # row 1 empty
    page = cache.row_pages(0)[0]
    cache = cache.retain(np.array([page]))
    with pytest.raises(ValueError, match="out of range"):
        cache.attach_prefix(np.int64(WIDE + 1), np.array([page]), 2)  # was: attached to row 1
    with pytest.raises(ValueError, match="num_tokens"):
        cache.attach_prefix(1, np.array([page]), np.int64(WIDE + 2))  # was: 2 tokens
    ok = cache.attach_prefix(1, np.array([page]), 2)  # the valid call still works
    assert ok.seq_lengths(0).tolist() == [3, 2, 2]


def test_take_and_merge_rows_treat_a_wide_row_as_padding():
    cache = _cache()
    lengths = np.asarray(cache.seq_lengths(0)).tolist()  # [3, 1, 2]
    # Padding (>= batch) is an empty row (no pages, length 0): the wide index is padding, not row 1.
    sub = cache.take_rows(np.array([0, WIDE + 1], np.int64))
    assert lengths[1] != 0 and np.asarray(sub.seq_lengths(0)).tolist() == [lengths[0], 0]
    assert (np.asarray(sub.block_table)[1] == -1).all()
    # Merging drops padding entries: row 1 must keep its own state.
    sub = cache.take_rows(np.array([0, 2]))
    merged = cache.merge_rows(np.array([0, WIDE + 1], np.int64), sub)
    assert np.asarray(merged.seq_lengths(0)).tolist() == lengths
    np.testing.assert_array_equal(merged.block_table, cache.block_table)

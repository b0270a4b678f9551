"""What only a paged cache does: page allocation, sharing, copy-on-write, running out.

The generic protocol (update/crop/reset/reorder/select under jit, vmap, scan, donation,
pickling, NaN poisoning of unused page slots) is in ``test_conformance.py`` for the
``paged`` and ``paged-int8`` kinds. Here: page accounting (every refcount equals the
block-table entries plus pins naming the page), forks sharing pages, copy-on-write of only
the written page, the out-of-pages policy, prefix pages attached to a new row, rows put
from another pool, int4 pages against QuantizedCache's codec, 16-bit pages written in
place. Attention is checked against a float64 NumPy softmax over the tokens each row
was given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import INVALID, OUT_OF_PAGES, OVERFLOW, CacheError, PagedCache, QuantizedCache, StaticCache
from jaxkv.attention import attend_view
from reference import numpy_attention

L, H, HQ, D, PS = 2, 2, 4, 8, 4


def paged(batch=3, max_length=16, num_pages=None, **kw):
    return PagedCache.init(
        num_layers=L, batch_size=batch, num_kv_heads=H, head_dim=D, max_length=max_length, page_size=PS,
        num_pages=num_pages, **kw,
    )


def states(rng, batch, t):
    return jnp.asarray(rng.standard_normal((batch, H, t, D)), jnp.float32)


@jax.jit
def write_all(cache, k, num_new=None):
    """Writes ``k`` (values ``k * 0.5``) into every layer, under jit (eager writes are
    checked where the eager errors are the point)."""
    for layer in range(L):
        cache = cache.update(k, k * 0.5, layer, num_new=num_new)[0]
    return cache


@jax.jit
def _attend_all(cache, q):
    return [attend_view(q, cache.view(i), q_positions=cache.seq_lengths(i)[:, None]) for i in range(L)]


def assert_accounting(cache, pins=None):
    """refcount[p] == (block-table entries naming p) + pins; free pages are named by no row."""
    table, refcount = np.asarray(cache.block_table), np.asarray(cache.refcount)
    expected = np.bincount(table[table >= 0], minlength=cache.num_pages)
    if pins is not None:
        expected = expected + np.bincount(np.asarray(pins, int), minlength=cache.num_pages)
    np.testing.assert_array_equal(refcount, expected)
    lengths = np.asarray(cache.lengths).max(axis=0)
    for b, n in enumerate(lengths):  # a row holds exactly the pages its longest layer reaches
        held = (table[b] >= 0).sum()
        assert held >= -(-n // PS), (b, n, table[b])


def attention_matches(cache, tokens):
    """Each row's attention (a query after its last token) against NumPy over ``tokens[b]``
    (the keys that row was given, [n_b, H, D]; values are keys * 0.5)."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((cache.batch_size, HQ, 1, D)).astype(np.float32)
    for layer, got in enumerate(_attend_all(cache, jnp.asarray(q))):
        lengths = np.asarray(cache.seq_lengths(layer))
        for b, row in enumerate(tokens):
            assert lengths[b] == len(row)
            if not len(row):
                continue
            k = np.asarray(row).transpose(1, 0, 2)[None]  # [1, H, n, D]
            want = numpy_attention(q[b : b + 1], k, k * 0.5, np.array([[len(row)]]), np.array([len(row)]))
            np.testing.assert_allclose(np.asarray(got[b : b + 1]), want, atol=2e-5, rtol=1e-4)


def test_fork_shares_pages_and_a_write_copies_only_the_written_page():
    rng = np.random.default_rng(0)
    cache = paged(batch=1, num_pages=12)
    prompt = states(rng, 1, 10)  # pages: 4 + 4 + 2 tokens
    cache = write_all(cache, prompt)
    assert cache.free_pages == 9
    forked = cache.batch_repeat_interleave(3)
    assert forked.free_pages == 9  # no page copied
    np.testing.assert_array_equal(forked.block_table, np.repeat(np.asarray(cache.block_table), 3, axis=0))
    assert_accounting(forked)
    assert np.asarray(forked.refcount)[np.asarray(cache.block_table)[0, :3]].tolist() == [3, 3, 3]

    step = states(rng, 3, 1)
    out = write_all(forked, step)
    # All three holders wrote into the shared last page: two copies, the first row kept it.
    assert out.free_pages == 7
    table = np.asarray(out.block_table)
    assert (table[:, :2] == table[0, :2]).all()  # the full pages stay shared
    assert len({table[0, 2], table[1, 2], table[2, 2]}) == 3
    assert_accounting(out)
    base = [np.asarray(prompt)[0].transpose(1, 0, 2)[i] for i in range(10)]
    attention_matches(out, [base + [np.asarray(step)[b, :, 0]] for b in range(3)])

    # The parent's view of the shared pages is untouched by the children's writes.
    attention_matches(cache, [base])


def test_beams_in_a_pool_of_one_page_per_beam_never_run_out():
    """Beam search's pattern: fan out, then reorder (with repeats) and write a token each
    step. With the page a row writes into shared, one holder keeps it and the others copy,
    so B * K pages always suffice; attention equals a StaticCache doing the same."""
    rng = np.random.default_rng(11)
    batch, beams = 2, 3
    pages = paged(batch=batch, max_length=PS * 3, num_pages=batch * beams * 3)
    static = StaticCache.init(num_layers=L, batch_size=batch, num_kv_heads=H, head_dim=D, max_length=PS * 3)
    k = states(rng, batch, 6)
    pages, static = (write_all(c, k, jnp.array([6, 3])).batch_repeat_interleave(beams) for c in (pages, static))
    for _ in range(5):
        idx = jnp.asarray(np.concatenate([rng.integers(0, beams, beams) + b * beams for b in range(batch)]))
        step = states(rng, batch * beams, 1)
        pages, static = (write_all(c.reorder_cache(idx), step) for c in (pages, static))
        assert not np.asarray(pages.flags).any()
        assert_accounting(pages)
        q = jnp.asarray(rng.standard_normal((batch * beams, HQ, 1, D)), jnp.float32)
        for got, want in zip(_attend_all(pages, q), _attend_all(static, q)):
            np.testing.assert_allclose(got, want, atol=1e-6)


def test_out_of_pages_is_an_error_eagerly_and_a_flag_under_jit():
    rng = np.random.default_rng(2)
    cache = write_all(paged(batch=3, num_pages=4), states(rng, 3, 0))  # empty, pool of 4 pages
    k = states(rng, 3, 12)
    with pytest.raises(ValueError, match=r"out of pages: row 1 needs 2 new page\(s\) of 4 tokens, but the pool has 4"):
        cache.update(k, k, 0, num_new=jnp.array([12, 8, 1]))
    out = write_all(cache, k, jnp.array([12, 8, 1]))
    # Row 0 takes 3 pages; row 1 (2 pages) does not fit and stores nothing; row 2 fits.
    np.testing.assert_array_equal(out.seq_lengths(1), [12, 0, 1])
    np.testing.assert_array_equal(out.out_of_pages, [False, True, False])
    assert (np.asarray(out.flags) & OUT_OF_PAGES).tolist() == [0, OUT_OF_PAGES, 0]
    assert not out.overflowed.any()
    with pytest.raises(CacheError, match=r"rows \[1\] found no free page"):
        out.check()
    host = np.asarray(k)
    attention_matches(out, [list(host[0].transpose(1, 0, 2)), [], list(host[2].transpose(1, 0, 2)[:1])])
    assert_accounting(out)
    freed = out.reset(jnp.array([True, False, False]))
    assert freed.free_pages == 3 and not freed.out_of_pages[0]
    assert out.reset().free_pages == 4


def test_crop_returns_pages_and_a_write_after_crop_into_a_shared_page_copies_it():
    rng = np.random.default_rng(3)
    k = states(rng, 1, 11)
    cache = write_all(paged(batch=1, num_pages=8), k).batch_repeat_interleave(2)
    cropped = cache.crop(jnp.array([5, 11]))  # row 0 keeps 5 tokens: its third page is released
    assert cropped.free_pages == 8 - 3
    assert_accounting(cropped)
    new = states(rng, 2, 1)
    out = write_all(cropped, new, jnp.array([1, 0]))  # row 0 writes position 5, inside the shared page 1
    assert_accounting(out)
    host = list(np.asarray(k)[0].transpose(1, 0, 2))
    attention_matches(out, [host[:5] + [np.asarray(new)[0, :, 0]], host])  # row 1 still sees its own page 1


def test_prefix_pages_attach_to_a_new_row_and_pins_keep_them():
    rng = np.random.default_rng(4)
    k = states(rng, 2, 9)
    cache = write_all(paged(batch=2, num_pages=8), k, jnp.array([9, 0]))
    prefix = cache.row_pages(0)[:2]  # the two full pages: 8 tokens
    pinned = cache.retain(prefix)
    assert_accounting(pinned, pins=prefix)
    dropped = pinned.reset(jnp.array([True, False]))
    assert dropped.free_pages == 8 - 2  # the pinned pages survive the row
    attached = jax.jit(lambda c, p: c.attach_prefix(1, p, 8))(dropped, jnp.asarray(prefix))
    assert_accounting(attached, pins=prefix)
    host = list(np.asarray(k)[0].transpose(1, 0, 2))
    attention_matches(attached, [[], host[:8]])
    more = write_all(attached, k, jnp.array([0, 1]))  # position 8 goes to a fresh page
    assert_accounting(more, pins=prefix)
    assert more.release(prefix).refcount[jnp.asarray(prefix)].tolist() == [1, 1]
    with pytest.raises(ValueError, match="not empty"):
        more.attach_prefix(1, prefix, 8)
    with pytest.raises(ValueError, match="num_tokens=7 must be the pages' tokens"):
        dropped.attach_prefix(1, prefix, 7)
    with pytest.raises(ValueError, match="include a free page"):
        cache.attach_prefix(1, [5], 4)
    with pytest.raises(ValueError, match=r"pages \[7\] are not pinned"):
        cache.release([7])
    with pytest.raises(ValueError, match=r"pages \[0\] are not pinned"):  # row 0's own page: no pin to release
        cache.release(cache.row_pages(0)[:1])


def test_put_rows_copies_pages_into_fresh_ones():
    rng = np.random.default_rng(5)
    big = write_all(paged(batch=3, num_pages=9), states(rng, 3, 5))
    k = states(rng, 2, 6)
    small = write_all(paged(batch=2, num_pages=4), k)
    out = big.put_rows(jnp.array([2, 0]), small)
    assert_accounting(out)
    # Called again eagerly with the same shapes, it compiles nothing (its admission scan's
    # body was a closure made per call: one new program every call; review 81).
    compiles = []

    def listen(event, _, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for _ in range(2):
            jax.block_until_ready(big.put_rows(jnp.array([2, 0]), small).refcount)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [], compiles
    host = np.asarray(k)
    np.testing.assert_array_equal(out.seq_lengths(0), [6, 5, 6])
    attention_matches(out.batch_select_indices(jnp.array([2, 0])), [list(host[b].transpose(1, 0, 2)) for b in range(2)])
    with pytest.raises(ValueError, match="put_rows: out of pages"):
        write_all(paged(batch=3, num_pages=5), states(rng, 3, 8), jnp.array([0, 8, 8])).put_rows(jnp.array([0, 1]), small)
    # Under jit an out-of-range row (-1 included) is dropped, takes no page and flags every row.
    out = jax.jit(lambda c, r: c.put_rows(r, small))(big, jnp.array([-1, 3]))
    assert_accounting(out)
    np.testing.assert_array_equal(out.refcount, big.refcount)
    np.testing.assert_array_equal(out.seq_lengths(0), big.seq_lengths(0))
    assert ((np.asarray(out.flags) & INVALID) != 0).all()
    # A masked entry (a fixed-size batch's padding) takes no page and flags nothing, eagerly
    # (where an out-of-range row would raise) and under jit.
    for call in (lambda c, r, m: c.put_rows(r, small, mask=m), jax.jit(lambda c, r, m: c.put_rows(r, small, mask=m))):
        out = call(big, jnp.array([3, 1]), jnp.array([False, True]))
        assert_accounting(out)
        assert not np.asarray(out.flags).any()
        np.testing.assert_array_equal(out.seq_lengths(0), [5, 6, 5])
        attention_matches(out.batch_select_indices(jnp.array([1])), [list(host[1].transpose(1, 0, 2))])
    # Rows of a pool of other heads or head_dim are refused (the pool is free to be smaller).
    for other, axis in ((dict(num_kv_heads=1), r"heads 1 \(this cache 2\)"), (dict(head_dim=2 * D), rf"packed {2 * D} ")):
        args = dict(num_layers=L, batch_size=1, num_kv_heads=H, head_dim=D, max_length=16, page_size=PS) | other
        with pytest.raises(ValueError, match=rf"PagedStorage.keys .*: {axis}"):
            big.put_rows(jnp.array([1]), PagedCache.init(**args))


def test_int4_pages_read_like_the_quantized_cache():
    rng = np.random.default_rng(6)
    k = states(rng, 2, 7)
    pages = write_all(paged(batch=2, bits=4, num_pages=6), k)
    flat = QuantizedCache.init(num_layers=L, batch_size=2, num_kv_heads=H, head_dim=D, max_length=16, bits=4)
    flat = write_all(flat, k)
    q = jnp.asarray(rng.standard_normal((2, HQ, 1, D)), jnp.float32)
    for layer in range(L):
        pos = pages.seq_lengths(layer)[:, None]
        np.testing.assert_allclose(
            attend_view(q, pages.view(layer), q_positions=pos), attend_view(q, flat.view(layer), q_positions=pos),
            atol=1e-6,
        )
        np.testing.assert_array_equal(pages[layer][0][:, :, :7], flat[layer][0][:, :, :7])


def test_quantized_pages_keys_are_their_codes():
    """``cache.keys`` of int8 / int4 pages bitcast the codes to the float dtype: four int8
    codes became one float32 (shape [L, P, H, ps], values like 7e37), no error."""
    for bits, dtype in ((8, jnp.float32), (8, jnp.bfloat16), (4, jnp.float32)):
        head_dim = {8: 4, 4: 8}[bits] if dtype == jnp.float32 else 2  # 4 (2) bytes a row: the silent case
        cache = PagedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=head_dim, max_length=4,
                                page_size=2, bits=bits, dtype=dtype)
        k = jnp.arange(1, head_dim + 1, dtype=jnp.float32).reshape(1, 1, 1, head_dim)
        cache = cache.update(k, k, 0)[0]
        for got, stored in ((cache.keys, cache.stores[0].keys), (cache.values, cache.stores[0].values)):
            assert got.dtype == stored.dtype and got.shape == stored.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(stored))


def test_bf16_pages_are_written_in_place():
    cache = paged(batch=2, max_length=4096, dtype=jnp.bfloat16)
    k = jnp.ones((2, H, 1, D), jnp.bfloat16)
    step = jax.jit(lambda c, k: c.update(k, k, 1)[0], donate_argnums=0)
    hlo = step.lower(cache, k).compile().as_text()
    pool = "[" + ",".join(map(str, cache.stores[0].keys.shape)) + "]"
    assert not [line for line in hlo.splitlines() if f"f32{pool}" in line or (" copy(" in line and pool in line)]
    out = step(cache, k)
    assert out.keys.dtype == jnp.bfloat16 and float(out[1][0][0, 0, 0, 0]) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        PagedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=8, page_size=6)
    with pytest.raises(ValueError, match="bits must be None"):
        paged(bits=3)
    with pytest.raises(ValueError, match="outside"):
        paged().retain([99])


def test_a_hand_built_view_of_another_page_size_is_refused():
    """The loop reads a block from one page or whole pages, which needs power-of-two pages
    (PagedCache.init refuses others); a hand-built view of 24-token pages was read from the
    wrong slots (a block clamped inside one page), silently."""
    from jaxkv.attention.blockwise import paged_blockwise_attend
    from jaxkv.caches.views import PagedView

    pool = jnp.ones((1, 3, H, 24, D), jnp.float32)
    empty = jnp.zeros((1, 3, H, 0))
    view = PagedView(pool, pool, empty, empty, jnp.arange(3, dtype=jnp.int32)[None], 0, jnp.array([60], jnp.int32),
                     None, jnp.float32, jnp.float32)
    for implementation in ("auto", "xla"):
        with pytest.raises(ValueError, match="page size must be a power of two, got 24"):
            paged_blockwise_attend(jnp.ones((1, HQ, 1, D)), view, q_positions=jnp.array([[59]]), block_size=16,
                                   implementation=implementation)


def test_a_row_writing_nothing_copies_no_shared_page():
    """Forked rows share a partial page. A take_rows padding entry (a copy of the last row,
    counted by no refcount) or a row with num_new 0 must not copy it: the copy took a count
    away from the shared page, and the other holder's next write went into it in place."""
    rng = np.random.default_rng(13)
    forked = write_all(paged(batch=1, num_pages=8), states(rng, 1, 6)).batch_repeat_interleave(2)
    assert forked.free_pages == 6  # both rows hold the same 2 pages, the second partial
    rows, k = jnp.array([0, 2]), states(rng, 2, 1)  # 2: padding, a copy of row 1
    step = jax.jit(lambda c, k, n: c.merge_rows(rows, write_all(c.take_rows(rows), k, n)))
    out = step(forked, k, jnp.array([1, 0]))
    assert_accounting(out)
    k1 = states(rng, 2, 1)
    out = write_all(out, k1, jnp.array([0, 1]))  # row 1's own 7th token
    assert_accounting(out)
    host = list(np.asarray(states(np.random.default_rng(13), 1, 6))[0].transpose(1, 0, 2))
    attention_matches(out, [host + [np.asarray(k)[0, :, 0]], host + [np.asarray(k1)[1, :, 0]]])
    idle = write_all(forked, k, jnp.array([0, 0]))
    assert idle.free_pages == 6 and (np.asarray(idle.block_table) == np.asarray(forked.block_table)).all()


def test_a_step_on_taken_rows_equals_the_step_on_the_whole_cache():
    """take_rows / merge_rows: a step over some rows (padding included) moves no pages and
    leaves the cache as the same step over every row with num_new 0 for the others."""
    rng = np.random.default_rng(12)
    cache = write_all(paged(batch=3, num_pages=12), states(rng, 3, 5), jnp.array([5, 2, 4]))
    k = states(rng, 3, 6)
    rows = jnp.array([2, 0, 3])  # 3: padding (num_new 0), dropped on merge
    step = jax.jit(lambda c, k, n: c.merge_rows(rows, write_all(c.take_rows(rows), k, n)))
    got = step(cache, k, jnp.array([6, 1, 0]))
    want = write_all(cache, k[jnp.array([1, 0, 0])], jnp.array([1, 0, 6]))
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert_accounting(got)
    q = jnp.asarray(rng.standard_normal((3, HQ, 1, D)), jnp.float32)
    for a, b in zip(_attend_all(got, q), _attend_all(want, q)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_padding_of_take_rows_holds_no_page_so_a_shared_page_is_copied_not_overwritten():
    """Rows 0 and 1 share a partial page; row 0 has written past the fork. A step on row 1
    alone, padded to two rows, must copy the page: row 0 (outside the sub-cache) keeps its
    token. The padding used to carry row 1's block table, counted as a second holder, and
    the in-place rule let row 1 overwrite row 0's token."""
    cache = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=8, page_size=4,
                            num_pages=4)
    ones = jnp.ones((2, 1, 2, 2))
    cache, _, _ = cache.update(ones, ones, 0, num_new=jnp.array([2, 0]))
    cache = cache.batch_select_indices(jnp.array([0, 0]))  # both rows: the same page, 2 tokens
    ten = jnp.full((2, 1, 1, 2), 10.0)
    cache, _, _ = cache.update(ten, ten, 0, num_new=jnp.array([1, 0]))  # row 0: position 2 is 10
    rows = jnp.array([1, 2])  # 2 == batch_size: padding
    flagged = dataclasses.replace(cache, flags=jnp.array([0, OVERFLOW], jnp.int32))
    assert np.asarray(flagged.take_rows(rows).flags).tolist() == [OVERFLOW, 0]  # padding: empty, no flag of its own
    sub = cache.take_rows(rows)
    minus = jnp.full((2, 1, 1, 2), -7.0)
    sub, _, _ = sub.update(minus, minus, 0, num_new=jnp.array([1, 0]))
    merged = cache.merge_rows(rows, sub)
    keys, values = merged[0]
    np.testing.assert_array_equal(np.asarray(keys)[:, 0, :3, 0], [[1, 1, 10], [1, 1, -7]])
    np.testing.assert_array_equal(np.asarray(values)[:, 0, :3, 0], [[1, 1, 10], [1, 1, -7]])
    table = np.asarray(merged.block_table)
    assert table[0, 0] != table[1, 0]  # row 1 got its own copy of the page
    assert np.asarray(sub.block_table)[1].tolist() == [-1, -1] and np.asarray(sub.lengths)[:, 1].tolist() == [0]
    assert np.asarray(merged.refcount).tolist().count(1) == 2


def test_attach_prefix_under_jit_checks_what_the_eager_call_checks_and_flags_the_row():
    cache = PagedCache.init(num_layers=1, batch_size=3, num_kv_heads=1, head_dim=2, max_length=8, page_size=4,
                            num_pages=6)
    k = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 1, 4, 2)
    cache, _, _ = cache.update(k, k, 0, num_new=jnp.array([4, 0, 2]))
    page = cache.row_pages(0)[0]
    cache = cache.retain(jnp.array([page]))
    attach = jax.jit(lambda c, row, pages, n: c.attach_prefix(row, pages, n))
    good = attach(cache, jnp.int32(1), jnp.array([page]), jnp.int32(4))
    eager = cache.attach_prefix(1, np.array([page]), 4)
    for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(good.flags).tolist() == [0, 0, 0]
    free_page = int(np.flatnonzero(np.asarray(cache.refcount) == 0)[0])
    for row, pages, n, why in [
        (1, [page], 8, "more tokens than the pages hold"),
        (1, [page], 3, "fewer"),
        (2, [page], 4, "row not empty"),
        (1, [free_page], 4, "a free page"),
        (1, [7], 4, "a page id out of range"),
        (1, [-1, page], 4, "a -1 before a page: positions 0-3 would read page 0"),
    ]:
        with pytest.raises(ValueError):
            cache.attach_prefix(row, np.array(pages), n)
        bad = attach(cache, jnp.int32(row), jnp.array(pages), jnp.int32(n))
        want_flags = [0, 0, 0]
        want_flags[row] = INVALID
        assert np.asarray(bad.flags).tolist() == want_flags, why
        np.testing.assert_array_equal(np.asarray(bad.lengths), np.asarray(cache.lengths), err_msg=why)
        np.testing.assert_array_equal(np.asarray(bad.block_table), np.asarray(cache.block_table), err_msg=why)
        np.testing.assert_array_equal(np.asarray(bad.refcount), np.asarray(cache.refcount), err_msg=why)


def test_a_row_named_twice_in_take_rows_is_an_error_eagerly_and_padding_under_jit():
    """Named twice, a row's pages had two holders inside the step, and the in-place rule let
    it overwrite a page shared with a row outside the sub-cache (same scenario as the
    padding test above)."""
    cache = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=8, page_size=4,
                            num_pages=4)
    ones = jnp.ones((2, 1, 2, 2))
    cache, _, _ = cache.update(ones, ones, 0, num_new=jnp.array([2, 0]))
    cache = cache.batch_select_indices(jnp.array([0, 0]))
    ten = jnp.full((2, 1, 1, 2), 10.0)
    cache, _, _ = cache.update(ten, ten, 0, num_new=jnp.array([1, 0]))
    with pytest.raises(ValueError, match=r"rows \[1\] appear more than once"):
        cache.take_rows(np.array([1, 1]))

    @jax.jit
    def step(cache, rows):
        sub = cache.take_rows(rows)
        minus = jnp.full((2, 1, 1, 2), -7.0)
        sub, _, _ = sub.update(minus, minus, 0, num_new=jnp.array([1, 0]))
        return cache.merge_rows(rows, sub)

    keys, _ = step(cache, jnp.array([1, 1]))[0]
    np.testing.assert_array_equal(np.asarray(keys)[:, 0, :3, 0], [[1, 1, 10], [1, 1, -7]])


def test_a_page_attached_at_another_block_is_copied_before_a_write_it_would_show():
    """attach_prefix may put a page at another block of another row (here row 0's second page
    as row 1's first). The in-place rule compared the holders' lengths as if the page sat at
    the same block in both: row 0 (6 tokens, writing its 7th into slot 2 of that page) counted
    row 1's 4 tokens as "before it" and wrote in place, so row 1's third token read 99.
    Holders are now compared by the slots of the page each sees; a StaticCache given the same
    tokens is the reference."""
    ps, shape = 4, dict(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=1, max_length=16)
    paged = PagedCache.init(**shape, page_size=ps, num_pages=8)
    static = StaticCache.init(**shape)
    tokens = jnp.arange(1, 9, dtype=jnp.float32).reshape(1, 1, 8, 1).repeat(2, 0)
    paged, _, _ = paged.update(tokens, tokens, 0, num_new=jnp.array([8, 0]))
    static, _, _ = static.update(tokens, tokens, 0, num_new=jnp.array([8, 0]))
    page = paged.block_table[0, 1]  # row 0's tokens 5..8
    paged = paged.retain(page[None]).attach_prefix(1, page[None], 4).release(page[None])
    static, _, _ = static.update(tokens[:, :, 4:], tokens[:, :, 4:], 0, num_new=jnp.array([0, 4]))
    assert int(paged.refcount[page]) == 2
    paged, static = paged.crop(6), static.crop(6)
    new = jnp.full((2, 1, 1, 1), 99.0)
    for _ in range(2):  # row 0 writes slot 2, then 3, of the shared page; row 1 writes nothing
        paged, _, _ = paged.update(new, new, 0, num_new=jnp.array([1, 0]))
        static, _, _ = static.update(new, new, 0, num_new=jnp.array([1, 0]))
    for row, n in ((0, 8), (1, 4)):
        np.testing.assert_array_equal(np.asarray(paged[0][0][row, 0, :n]), np.asarray(static[0][0][row, 0, :n]))
    assert int(paged.refcount[page]) == 1  # row 0 took a copy; row 1 keeps the original


def test_release_under_jit_frees_no_row_page_and_flags():
    """Eagerly, releasing a page no pin holds is a ValueError. Under jit it was applied: a
    row's own page went to count 0 while the row still read it, the next write of another
    row took it and overwrote the row's tokens, and no flag was set; a free page went to
    count -1 and was never free again. Now such a release is skipped and every row flagged
    INVALID; a pinned page still releases, and a bad id is flagged (retain too)."""
    cache = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=1, max_length=8, page_size=4,
                            num_pages=4)
    tokens = jnp.arange(1, 5, dtype=jnp.float32).reshape(1, 1, 4, 1).repeat(2, 0)
    cache, _, _ = cache.update(tokens, tokens, 0, num_new=jnp.array([4, 0]))
    own = cache.block_table[0, :1]
    with pytest.raises(ValueError, match="not pinned"):
        cache.release(own)
    release, retain = jax.jit(lambda c, p: c.release(p)), jax.jit(lambda c, p: c.retain(p))
    for pages in (own, jnp.array([3]), jnp.array([5]), jnp.array([-7])):  # own, free, out of range
        after = release(cache, pages)
        np.testing.assert_array_equal(np.asarray(after.refcount), np.asarray(cache.refcount))
        assert (np.asarray(after.flags) & INVALID).all(), pages
    pinned = retain(cache, own)
    assert int(pinned.refcount[own[0]]) == 2 and not np.asarray(pinned.flags).any()
    back = release(pinned, jnp.array([own[0], -1]))  # -1 is ignored, not an error
    np.testing.assert_array_equal(np.asarray(back.refcount), np.asarray(cache.refcount))
    assert not np.asarray(back.flags).any()
    twice = release(pinned, jnp.array([own[0], own[0]]))  # one pin released twice: refused whole
    np.testing.assert_array_equal(np.asarray(twice.refcount), np.asarray(pinned.refcount))
    assert (np.asarray(twice.flags) & INVALID).all()
    assert (np.asarray(retain(cache, jnp.array([9])).flags) & INVALID).all()
    # concrete page ids on a traced cache take the same flag (they used to fail to trace)
    closed = jax.jit(lambda c: c.release(np.asarray(own)))(cache)
    assert (np.asarray(closed.flags) & INVALID).all() and int(closed.refcount[own[0]]) == 1
    # after the refused release (flags cleared by hand), another row's write takes another page
    kept = release(cache, own)
    other, _, _ = dataclasses.replace(kept, flags=jnp.zeros_like(kept.flags)).update(
        tokens * 0 + 99, tokens * 0 + 99, 0, num_new=jnp.array([0, 4]))
    np.testing.assert_array_equal(np.asarray(other[0][0][0, 0, :4, 0]), [1, 2, 3, 4])


def test_first_free_pages_equal_numpy():
    """The allocator's search for the n lowest free page ids (blocked, for speed) against
    np.flatnonzero: pools not a multiple of the block, smaller than it, fuller than n."""
    from jaxkv.caches.paged import _first_free

    rng = np.random.default_rng(0)
    for num_pages, n, share in [(1, 1, 0.5), (7, 4, 0.5), (256, 9, 0.02), (300, 5, 0.99), (1000, 40, 0.01),
                                (4096, 3, 0.0), (4097, 16, 0.3)]:
        for _ in range(3):
            refcount = np.where(rng.random(num_pages) < share, 0, rng.integers(1, 4, num_pages)).astype(np.int32)
            ids, num_free = _first_free(jnp.asarray(refcount), n)
            want = np.flatnonzero(refcount == 0)[:n]
            want = np.concatenate([want, np.full(n - len(want), num_pages)])
            np.testing.assert_array_equal(np.asarray(ids), want, err_msg=f"{num_pages} pages, n {n}")
            assert int(num_free) == int((refcount == 0).sum())


def test_a_page_a_padding_row_took_is_released_on_merge():
    """A write into a padding row of a take_rows sub-cache (negative entries are padding too)
    took a fresh page; merge_rows dropped the row and left the page counted with no row
    holding it, lost to the pool (review 77). Eagerly and under jit."""
    cache = PagedCache.init(num_layers=1, batch_size=3, num_kv_heads=1, head_dim=2, max_length=4, page_size=2,
                            num_pages=6)
    two = jnp.ones((3, 1, 2, 2))
    cache = cache.update(two, two, 0)[0]  # each row: one full page
    one = jnp.ones((2, 1, 1, 2))
    for rows, run in ((np.array([0, -1]), lambda f, *a: f(*a)), (jnp.array([0, 3]), lambda f, *a: jax.jit(f)(*a))):
        merged = run(lambda c, r: c.merge_rows(r, c.take_rows(r).update(one, one, 0)[0]), cache, rows)
        assert np.asarray(merged.lengths[0]).tolist() == [3, 2, 2]
        assert_accounting(merged)
        assert merged.free_pages == 2  # 3 rows' pages and row 0's second page
    # Merged at other entries than taken (rows [0, 1] taken, row 1's entry merged as padding):
    # its pages are row 1's too, counted once by take_rows; releasing them freed a page row 1
    # still reads, and row 0's next write took it (review 82). Counts stay at what rows hold.
    sub = cache.take_rows(jnp.array([0, 1]))
    sub = sub.update(jnp.full((2, 1, 1, 2), 5.0), jnp.full((2, 1, 1, 2), 5.0), 0, num_new=jnp.array([1, 0]))[0]
    merged = cache.merge_rows(jnp.array([0, 3]), sub)
    assert_accounting(merged)
    merged = merged.update(jnp.full((3, 1, 2, 2), 9.0), jnp.full((3, 1, 2, 2), 9.0), 0, num_new=jnp.array([1, 0, 0]))[0]
    assert_accounting(merged)
    assert (np.asarray(merged[0][0])[1, 0, :2] == 1.0).all()  # row 1 still reads its own tokens


def test_merge_rows_takes_one_entry_per_sub_row():
    """A 1-row sub-cache merged at 2 rows was copied onto both: row 1 read row 0's tokens and
    its own page leaked, check() passing (review 84). A count other than the sub's rows, or a
    sub that is not a PagedCache, is a named error."""
    cache = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=4, page_size=2,
                            num_pages=4)
    cache = cache.update(jnp.ones((2, 1, 2, 2)), jnp.ones((2, 1, 2, 2)), 0)[0]
    sub = cache.take_rows(jnp.array([0]))
    with pytest.raises(ValueError, match=r"rows must name one entry per row of sub \(1\), got shape \[2\]"):
        cache.merge_rows(jnp.array([0, 1]), sub)
    with pytest.raises(TypeError, match="sub must be the PagedCache take_rows returned, got StaticCache"):
        cache.merge_rows(jnp.array([0]), StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2,
                                                           max_length=4))
    assert_accounting(cache.merge_rows(jnp.array([0]), sub))

"""One conformance suite for every cache kind (the container protocol, written once).

Every test here is parametrized over the kinds: StaticCache, SlidingWindowCache,
QuantizedCache (int8 with a residual), HybridCache, an EncoderDecoderCache (static self
part) and PagedCache (float pages, and int8 pages). Kind-specific behaviour (ring eviction, quantization error bounds, cross
attention) lives in the kind's own test file.

The reference is ``tests/reference.py``: a NumPy model that stores every token of every
layer and row in Python lists, plus, for ring layers, the first position still held.
"""

from __future__ import annotations

import dataclasses
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import INVALID, OVERFLOW, CacheError, DynamicCache
from jaxkv.attention import attend_view
from jaxkv.caches import (
    FULL,
    NO_POSITION,
    SLIDING,
    CrossAttentionCache,
    EncoderDecoderCache,
    HybridCache,
    PagedCache,
    PagedStorage,
    QuantizedCache,
    RingStorage,
    SlidingWindowCache,
    StaticCache,
)
from jaxkv.caches._bits import to_bits
from reference import ReferenceCache, crop_target

L, B, H, HQ, D, S = 2, 3, 2, 4, 8, 12  # L != B: a mixed-up axis cannot pass
W, EXTRA = 4, 2  # ring window and rollback slots
E = 3  # encoder tokens


def _static():
    return StaticCache.init(num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S)


KINDS = {
    "static": _static,
    "sliding": lambda: SlidingWindowCache.init(
        num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, window=W, extra_slots=EXTRA
    ),
    "quantized": lambda: QuantizedCache.init(
        num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S, bits=8, residual_length=3
    ),
    # A residual as long as the capacity: every token is read exactly (attention patches the
    # residual over the codes block by block), so it must match the reference tightly.
    "quantized-exact": lambda: QuantizedCache.init(
        num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S, bits=4, residual_length=S
    ),
    "hybrid": lambda: HybridCache.init(
        layer_types=[SLIDING, FULL], batch_size=B, num_kv_heads=H, head_dim=D, max_length=S, window=W,
        extra_slots=EXTRA,
    ),
    # Pages of 4 tokens, 3 per row; the pool holds B * 3 pages, so forks (select) share
    # pages and writes into shared ones copy them, but a row never lacks a page.
    "paged": lambda: PagedCache.init(
        num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S, page_size=4
    ),
    "paged-int8": lambda: PagedCache.init(
        num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S, page_size=4, bits=8
    ),
    "encdec": lambda: EncoderDecoderCache.create(
        _static(),
        CrossAttentionCache.from_layers([(jnp.ones((B, H, E, D)), jnp.ones((B, H, E, D)))] * L),
    ),
}
# Ring layers per kind: layer -> (window, slots).
RINGS = {"sliding": {0: (W, W + EXTRA), 1: (W, W + EXTRA)}, "hybrid": {0: (W, W + EXTRA)}}
CAPACITY = {
    "static": S, "quantized": S, "quantized-exact": S, "hybrid": S, "encdec": S, "sliding": None, "paged": S,
    "paged-int8": S,
}
# int8 codes: each element is within scale / 2 = max|x| / 254 of the truth; attention
# outputs over N(0, 1) data stay within this (the exact residual makes it smaller).
ATOL = {"quantized": 5e-2, "paged-int8": 5e-2}
kinds = pytest.mark.parametrize("kind", list(KINDS))
# int8 pages differ from float pages only in the codec (quantize on write, dequantize per
# block on read): the fuzz puts them through every op; the rest of the protocol (jit, vmap,
# scan, donation, flags, serialization) is the page layout, checked on "paged".
protocol_kinds = pytest.mark.parametrize("kind", [k for k in KINDS if k != "paged-int8"])


def rand(rng, t, batch=B):
    return rng.standard_normal((batch, H, t, D)).astype(np.float32)


class KindReference(ReferenceCache):
    """``ReferenceCache`` plus, for ring layers, the first position each row still holds."""

    def __init__(self, kind, batch=B):
        super().__init__(L, batch)
        self.rings = RINGS.get(kind, {})
        self.capacity = CAPACITY[kind]
        self.start = [[0] * batch for _ in range(L)]

    def update(self, layer, keys, values, num_new=None):
        batch, _, t, _ = keys.shape
        n = [t if num_new is None else int(num_new[b]) for b in range(batch)]
        if self.capacity is not None and layer not in self.rings:  # tokens past capacity are dropped
            n = [min(k, self.capacity - self.length(layer, b)) for b, k in enumerate(n)]
        super().update(layer, keys, values, n)
        if layer in self.rings:
            slots = self.rings[layer][1]
            self.start[layer] = [max(s, self.length(layer, b) - slots) for b, s in enumerate(self.start[layer])]

    def loses(self, amounts) -> bool:
        """Whether ``crop(amounts)`` needs a position a ring layer evicted."""
        for layer, (window, _) in self.rings.items():
            for b in range(self.batch):
                n = self.length(layer, b)
                target = crop_target(amounts[b], n)
                # the next query (position target) reads positions first..target-1 from the cache
                first = max(0, target - window + 1)
                if target < n and first < target and self.start[layer][b] > first:
                    return True
        return False

    def crop(self, amounts):
        super().crop(amounts)
        self.start = [[min(s, self.length(i, b)) for b, s in enumerate(row)] for i, row in enumerate(self.start)]

    def select(self, indices):
        super().select(indices)
        self.start = [[row[i] for i in indices] for row in self.start]

    def reset_rows(self, rows):
        for b, r in enumerate(rows):
            if r:
                for layer in range(L):
                    self.rows[layer][b] = []
                    self.start[layer][b] = 0

    def attention(self, layer, q):
        """float64 [B, HQ, 1, D]: a query at the next position over what the layer holds."""
        window = self.rings.get(layer, (None, None))[0]
        out = np.zeros(q.shape)
        for b in range(self.batch):
            tokens = self.rows[layer][b]
            n = len(tokens)
            visible = [p for p in range(n) if window is None or n - p < window]
            if not visible:
                continue
            k = np.stack([tokens[p][0] for p in visible], axis=1).astype(np.float64)  # [H, N, D]
            v = np.stack([tokens[p][1] for p in visible], axis=1).astype(np.float64)
            for h in range(HQ):
                logits = k[h // (HQ // H)] @ q[b, h, 0].astype(np.float64) / np.sqrt(D)
                w = np.exp(logits - logits.max())
                out[b, h, 0] = (w / w.sum()) @ v[h // (HQ // H)]
        return out


# ---------------------------------------------------------------- ops, jitted once per kind

_jitted: dict = {}


def op(kind, name, fn, **jit_kwargs):
    key = (kind, name)
    if key not in _jitted:
        _jitted[key] = jax.jit(fn, **jit_kwargs)
    return _jitted[key]


def do_update(kind, cache, layer, k, v, num_new):
    fn = op(kind, f"update{layer}_{k.shape[2]}", lambda c, k, v, n: c.update(k, v, layer, num_new=n)[0])
    return fn(cache, k, v, jnp.asarray(num_new, jnp.int32))


def attention_of(kind, cache, layer, q):
    positions = cache.seq_lengths(layer)[:, None]
    window = RINGS.get(kind, {}).get(layer, (None,))[0]
    fn = op(kind, f"attend{layer}", lambda c, q, p: attend_view(q, c.view(layer), q_positions=p, sliding_window=window))
    return np.asarray(fn(cache, q, positions))


def poison_unused(cache):
    """NaN/inf in every slot that holds no token: attention must never see them."""

    def poison_store(store, lengths):
        if isinstance(store, PagedStorage):
            return poison_pages(store, lengths)
        if isinstance(store, RingStorage):
            from jaxkv.caches.ring import slot_positions

            pos = jax.vmap(lambda n, s: slot_positions(n, s, store.num_slots))(lengths, store.starts)  # [L, B, C]
            unused = (pos == 2**31 - 1)[:, :, None, :, None]
        else:
            slots = jnp.arange(store.keys.shape[3])
            unused = (slots[None, None, :] >= lengths[:, :, None])[:, :, None, :, None]
        if store.keys.dtype in (jnp.int8, jnp.uint8):  # codes cannot be NaN: poison their scales
            nan, inf = (to_bits(jnp.asarray(x), store.scale_dtype) for x in (jnp.nan, jnp.inf))
            return dataclasses.replace(
                store,
                key_scales=jnp.where(unused[..., 0], nan, store.key_scales),
                value_scales=jnp.where(unused[..., 0], inf, store.value_scales),
            )
        return dataclasses.replace(
            store, keys=jnp.where(unused, jnp.nan, store.keys), values=jnp.where(unused, jnp.inf, store.values)
        )

    own = cache.self_attention if isinstance(cache, EncoderDecoderCache) else cache
    stores = tuple(
        poison_store(store, own.lengths[own._layers_of(i)]) for i, store in enumerate(own.stores)
    )
    own = dataclasses.replace(own, stores=stores)
    return dataclasses.replace(cache, self_attention=own) if isinstance(cache, EncoderDecoderCache) else own


def poison_pages(store, lengths):
    """NaN/inf in every page slot no row holds a token in (rows share pages: a slot past
    one row's length may hold another row's token)."""
    ps = store.page_size
    table = np.asarray(store.block_table)
    used = np.zeros((store.num_layers, store.num_pages, ps), bool)
    for layer, row_lengths in enumerate(np.asarray(lengths)):
        for b, n in enumerate(row_lengths):
            for p in range(n):
                used[layer, table[b, p // ps], p % ps] = True
    unused = jnp.asarray(~used)[:, :, None, :, None]  # [L, P, 1, ps, 1]
    if store.bits is not None:
        nan, inf = (to_bits(jnp.asarray(x), store.scale_dtype) for x in (jnp.nan, jnp.inf))
        return dataclasses.replace(
            store,
            key_scales=jnp.where(unused[..., 0], nan, store.key_scales),
            value_scales=jnp.where(unused[..., 0], inf, store.value_scales),
        )
    return dataclasses.replace(
        store, keys=jnp.where(unused, jnp.nan, store.keys), values=jnp.where(unused, jnp.inf, store.values)
    )


def lengths_of(cache):
    return np.asarray(jnp.stack([cache.seq_lengths(i) for i in range(L)]))


# ------------------------------------------------------------------------- the fuzz test


@st.composite
def programs(draw):
    ops = []
    for _ in range(draw(st.integers(3, 10))):
        kind = draw(st.sampled_from(["update"] * 5 + ["crop", "reset", "reorder", "select", "overflow"]))
        if kind == "update":
            t = draw(st.sampled_from((1, 3)))
            ops.append(("update", draw(st.integers(0, L - 1)), t, draw(st.lists(st.integers(0, t), min_size=B, max_size=B))))
        elif kind == "crop":
            amounts = st.one_of(st.integers(-4, S + 2), st.sampled_from([0, 2**31, -(2**31), 2**40]))
            ops.append(("crop", draw(st.lists(amounts, min_size=B, max_size=B))))
        elif kind == "reset":
            ops.append(("reset", draw(st.lists(st.booleans(), min_size=B, max_size=B))))
        elif kind == "reorder":
            ops.append(("reorder", draw(st.permutations(range(B)))))
        elif kind == "select":
            ops.append(("select", draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B))))
        else:
            ops.append(("overflow", draw(st.integers(0, L - 1))))
    return ops, draw(st.integers(0, 2**31 - 1))


@kinds
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(program=programs())
def test_random_programs_match_numpy_model(kind, program):
    """Random op sequences under jit, NaN/inf in every unused slot, against the NumPy model:
    the lengths, the flags and the attention every layer gives."""
    ops, seed = program
    rng = np.random.default_rng(seed)
    cache, ref = KINDS[kind](), KindReference(kind)
    overflowed = np.zeros(B, bool)
    q = rng.standard_normal((B, HQ, 1, D)).astype(np.float32)
    for name, *args in ops:
        if name == "update":
            layer, t, num_new = args
            k, v = rand(rng, t), rand(rng, t)
            cap = CAPACITY[kind] if layer not in ref.rings else None
            totals = [ref.length(layer, b) + num_new[b] for b in range(B)]
            if cap is not None and max(totals) > cap:
                with pytest.raises(ValueError, match="overflow"):
                    cache.update(k, v, layer, num_new=jnp.asarray(num_new, jnp.int32))  # eagerly: refused
                overflowed |= np.asarray(totals) > cap  # under jit: dropped and flagged
            cache = do_update(kind, cache, layer, k, v, num_new)
            ref.update(layer, k, v, num_new)
        elif name == "overflow":
            (layer,) = args
            if CAPACITY[kind] is None or layer in ref.rings:
                continue
            k = rand(rng, 3)
            room = [CAPACITY[kind] - ref.length(layer, b) for b in range(B)]
            num_new = [min(3, r + 1) if r < 3 else 0 for r in room]  # rows with little room overflow by one
            overflowed |= np.asarray([n > r for n, r in zip(num_new, room)])
            cache = do_update(kind, cache, layer, k, k, num_new)
            ref.update(layer, k, k, num_new)
        elif name == "crop":
            (amounts,) = args
            if ref.loses(amounts):
                with pytest.raises(ValueError, match="evicted"):
                    cache.crop(np.asarray(amounts, np.int64))
                continue
            clamped = np.clip(np.asarray(amounts, np.int64), -(2**31 - 1), 2**31 - 1).astype(np.int32)
            cache = op(kind, "crop", lambda c, m: c.crop(m))(cache, jnp.asarray(clamped))
            ref.crop(amounts)
        elif name == "reset":
            (rows,) = args
            cache = op(kind, "reset", lambda c, r: c.reset(r))(cache, jnp.asarray(rows))
            ref.reset_rows(rows)
            overflowed &= ~np.asarray(rows)
        else:  # reorder / select: same batch size
            (idx,) = args
            cache = op(kind, name, lambda c, i: c.batch_select_indices(i))(cache, jnp.asarray(idx, jnp.int32))
            ref.select(list(idx))
            overflowed = overflowed[list(idx)]
        cache = poison_unused(cache)
        np.testing.assert_array_equal(lengths_of(cache), [[ref.length(i, b) for b in range(B)] for i in range(L)])
        np.testing.assert_array_equal((np.asarray(cache.flags) & OVERFLOW) != 0, overflowed)
        assert not (np.asarray(cache.flags) & INVALID).any()
        for layer in range(L):
            got = attention_of(kind, cache, layer, q)
            assert np.isfinite(got).all(), (kind, layer, name)
            np.testing.assert_allclose(got, ref.attention(layer, q), atol=ATOL.get(kind, 2e-5), rtol=1e-4)


# --------------------------------------------------------------- protocol, kind by kind


def filled(kind, seed=0):
    rng = np.random.default_rng(seed)
    cache = KINDS[kind]()
    for layer in range(L):
        k = rand(rng, 3)
        cache, _, _ = cache.update(k, k, layer, num_new=jnp.array([3, 2, 1]))
    return cache


def program(cache, k):
    """A fixed op sequence through the public vocabulary."""
    cache, _, _ = cache.update(k, k, 0, num_new=jnp.array([1, 0, 1]))
    cache = cache.crop(jnp.array([-1, 0, 2]))
    cache = cache.reorder_cache(jnp.array([1, 0, 2]))
    cache = cache.batch_select_indices(jnp.array([0, 0, 2]))
    cache = cache.reset(jnp.array([False, True, False]))
    cache = cache.batch_repeat_interleave(2).batch_select_indices(jnp.array([1, 2, 5]))
    cache, _, _ = cache.update(k, k, 1)
    return cache


@protocol_kinds
def test_eager_equals_jit(kind):
    cache, k = filled(kind), jnp.asarray(rand(np.random.default_rng(1), 1))
    chex.assert_trees_all_close(program(cache, k), jax.jit(program)(cache, k))


@protocol_kinds
def test_an_eager_update_compiles_at_most_one_program(kind):
    # Op by op, a first eager update of a new shape compiled ~40 small programs (~150 for
    # a paged pool); as one jitted program it compiles one, and none for another layer of
    # the same storage (a hybrid cache's two layers live in two storages: one each).
    compiles = []

    def listen(event, _, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    cache = KINDS[kind]()
    k = jnp.asarray(rand(np.random.default_rng(5), 2, batch=B))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first, _, _ = cache.update(k, k, 0, num_new=np.array([2, 1, 0]))
        second, keys, _ = first.update(k, k, 1)
        jax.block_until_ready(keys)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) <= (2 if kind == "hybrid" else 1), compiles  # 0 when an earlier test compiled it
    assert np.asarray(first.seq_lengths(0)).tolist() == [2, 1, 0]
    assert np.asarray(second.seq_lengths(1)).tolist() == [2, 2, 2]


def test_eager_ops_hand_back_the_buffers_they_leave_alone():
    # A jitted call returns fresh buffers for every output; the eager programs return the
    # leaves an op passes through as the very inputs: a crop, a reset and a fork of a page
    # pool move no data (and a hybrid update leaves the other storage's buffers as they are).
    k = jnp.asarray(rand(np.random.default_rng(6), 3))
    static = KINDS["static"]().update(k, k, 0)[0]
    assert static.crop(jnp.array([1, 2, 0])).keys is static.keys
    assert static.reset(jnp.array([True, False, False])).values is static.values
    paged = KINDS["paged"]().update(k, k, 0)[0]
    fork = paged.batch_repeat_interleave(2)
    assert fork.stores[0].keys is paged.stores[0].keys and fork.free_pages == paged.free_pages
    assert paged.reorder_cache(jnp.array([2, 0, 1])).stores[0].values is paged.stores[0].values
    hybrid = KINDS["hybrid"]()
    touched = hybrid.groups[0]
    after = hybrid.update(k, k, 0)[0]
    for i, (before, now) in enumerate(zip(hybrid.stores, after.stores)):
        same = [a is b for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(now))]
        assert (not any(same)) if i == touched else all(same), (i, same)


@protocol_kinds
def test_vmap_matches_a_loop(kind):
    caches = [filled(kind, seed) for seed in (0, 1)]
    ks = jnp.asarray(np.stack([rand(np.random.default_rng(s), 1) for s in (2, 3)]))
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
    # Both under jit (one program each; the eager path is test_eager_equals_jit's).
    out = jax.jit(jax.vmap(program))(stacked, ks)
    one = jax.jit(program)
    for i, cache in enumerate(caches):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], out), one(cache, ks[i]))


@protocol_kinds
def test_scan_over_layers_matches_unrolled(kind):
    cache, k = filled(kind), jnp.asarray(rand(np.random.default_rng(4), 2))

    def body(cache, layer):
        return cache.update(k, k, layer)[0], None

    if kind == "hybrid":  # its layers have two shapes: the layer is picked at trace time
        with pytest.raises(TypeError, match="must be a Python int"):
            jax.lax.scan(body, cache, jnp.arange(L))
        return
    scanned, _ = jax.jit(lambda c: jax.lax.scan(body, c, jnp.arange(L)))(cache)

    @jax.jit
    def unrolled(cache):
        for layer in range(L):
            cache = cache.update(k, k, layer)[0]
        return cache

    chex.assert_trees_all_close(scanned, unrolled(cache))


@protocol_kinds
def test_donated_decode_step_compiles_once_and_copies_nothing(kind):
    traces = []

    def step(cache, k):
        traces.append(1)
        for layer in range(L):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    jitted = jax.jit(step, donate_argnums=0)
    cache, k = filled(kind), jnp.ones((B, H, 1, D))
    before = lengths_of(cache)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
    for _ in range(3):
        old = cache
        cache = jitted(cache, k)
        assert all(x.is_deleted() for x in jax.tree.leaves(old))
    np.testing.assert_array_equal(lengths_of(cache), before + 3)  # three fill levels...
    assert len(traces) == 1 and jitted._cache_size() == 1  # ...one program (traced and compiled once)
    # Every buffer was written in place: XLA aliased each donated leaf to its output...
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)] == pointers
    # ...and the program copies none of them on the way (a pass-through cond, a slice then
    # concatenate, a bf16 round trip would show up as a copy of a cache-sized buffer).
    hlo = jitted.lower(cache, k).compile().as_text()
    big = {"[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(cache) if x.ndim >= 4 and x.size}
    assert not [line for line in hlo.splitlines() if " copy(" in line and any(shape in line for shape in big)]


@protocol_kinds
def test_overflow_policy(kind):
    """Eagerly an overflow is an error; under jit the tokens past capacity are dropped (never
    clamped onto the last slot), the rows flagged, and each layer holds exactly what the
    NumPy model holds: the old tokens and the first new ones that fit. A second overflowing
    write changes nothing."""
    rng = np.random.default_rng(7)
    cache, ref = KINDS[kind](), KindReference(kind)
    for layer in range(L):
        k = rand(rng, 3)
        cache = do_update(kind, cache, layer, k, k, [3, 2, 1])
        ref.update(layer, k, k, [3, 2, 1])
    k, v = rand(rng, S), rand(rng, S)
    if CAPACITY[kind] is None:  # a ring never overflows
        assert not cache.update(k, v, 0)[0].overflowed.any()
        return
    layer = 1  # a bounded layer of every bounded kind
    with pytest.raises(ValueError, match=rf"overflow in layer {layer}, row 0: it holds 3 tokens"):
        cache.update(k, v, layer)
    q = rng.standard_normal((B, HQ, 1, D)).astype(np.float32)
    out = do_update(kind, cache, layer, k, v, [S] * B)
    ref.update(layer, k, v, [S] * B)  # keeps the first S - n new tokens of a row holding n
    np.testing.assert_array_equal(out.seq_lengths(layer), [S] * B)
    np.testing.assert_array_equal(out.overflowed, [True] * B)
    for again in (False, True):
        poisoned = poison_unused(out)
        for i in range(L):
            np.testing.assert_allclose(attention_of(kind, poisoned, i, q), ref.attention(i, q),
                                       atol=ATOL.get(kind, 2e-5), rtol=1e-4, err_msg=f"layer {i}, again={again}")
        if not again:  # a full layer takes nothing more
            out = do_update(kind, out, layer, v, k, [S] * B)
            np.testing.assert_array_equal(lengths_of(out), [[ref.length(i, b) for b in range(B)] for i in range(L)])
    with pytest.raises(CacheError, match=r"rows \[0, 1, 2\] overflowed"):
        out.check()
    assert not out.reset().overflowed.any()


@kinds
def test_dense_reads_are_zero_where_no_token_is(kind):
    """``LayerView`` promises zeros in the slots that hold no token, and users mask the dense
    arrays of ``update`` / ``cache[i]`` themselves (``softmax(mask) @ values``): contiguous,
    quantized and paged reads handed back whatever the buffer held there (the NaN of a
    rolled-back token; for pages, the page another row wrote, read for a block with none)."""
    rng = np.random.default_rng(11)
    cache = KINDS[kind]()
    for layer in range(L):
        k = rand(rng, 3)
        cache = do_update(kind, cache, layer, k, k, [3, 1, 0])
    cache = poison_unused(cache)
    for layer in range(L):
        k = rand(rng, 1)
        _, view = cache.update_view(k, k, layer, num_new=jnp.array([1, 1, 0]))
        empty = (np.asarray(view.slot_positions()) == NO_POSITION)[:, None, :, None]
        held = (3 + 1, 1 + 1, 0)
        got = {"update_view": (view.keys, view.values), "cache[layer]": cache[layer][:2]}  # encdec: 4 arrays
        for where, (keys, values) in got.items():
            for name, x in (("keys", keys), ("values", values)):
                x = np.asarray(x, np.float32)
                mask = np.broadcast_to(empty, x.shape) if where == "update_view" else np.broadcast_to(
                    np.arange(x.shape[2])[None, None, :, None] >= np.asarray(cache.seq_lengths(layer))[:, None, None, None],
                    x.shape)
                assert np.isfinite(x).all(), f"{where} {name} of layer {layer}: non-finite"
                assert not x[mask].any(), f"{where} {name} of layer {layer}: nonzero where no token is"
        assert (~empty[:, 0, :, 0]).sum(axis=1).tolist() == [min(n, view.keys.shape[2]) for n in held]


@protocol_kinds
def test_traced_bad_indices_empty_the_row_and_flag_it(kind):
    cache = filled(kind)
    out = jax.jit(lambda c, i: c.reorder_cache(i))(cache, jnp.array([-1, 0, 1]))  # -1 must not wrap to row 2
    np.testing.assert_array_equal(out.seq_lengths(0), [0, 3, 2])
    np.testing.assert_array_equal((np.asarray(out.flags) & INVALID) != 0, [True, False, False])
    with pytest.raises(CacheError, match=r"rows \[0\] got an out-of-range index"):
        out.check()


@protocol_kinds
def test_traced_bad_layer_or_num_new_writes_nothing_and_flags(kind):
    cache, k = filled(kind), jnp.ones((B, H, 2, D))
    if kind != "hybrid":  # a hybrid cache takes static layer indices only
        for bad in (L, -1):  # (-1's flag was unchecked: review 74)
            out = jax.jit(lambda c, i: c.update(k, k, i)[0])(cache, jnp.int32(bad))
            np.testing.assert_array_equal(lengths_of(out), lengths_of(cache))
            assert ((np.asarray(out.flags) & INVALID) != 0).all(), bad
        # A bad traced layer reads as an empty layer, never as a clamped or wrapped one.
        read = jax.jit(lambda c, i: (c.seq_lengths(i), c.view(i).slot_positions()))
        for bad in (L, -1):
            lengths, positions = read(cache, jnp.int32(bad))
            np.testing.assert_array_equal(lengths, [0] * B)
            assert (np.asarray(positions) == NO_POSITION).all(), (bad, positions)
            # So does the view the write returns (what attention reads next): it held layer 0's tokens.
            written = jax.jit(lambda c, i: c.update_view(k, k, i)[1].slot_positions())(cache, jnp.int32(bad))
            assert (np.asarray(written) == NO_POSITION).all(), (bad, written)
    out = jax.jit(lambda c, n: c.update(k, k, 1, num_new=n)[0])(cache, jnp.array([1, 3, -1], jnp.int32))
    np.testing.assert_array_equal(out.seq_lengths(1), [4, 2, 1])  # bad counts write nothing
    np.testing.assert_array_equal((np.asarray(out.flags) & INVALID) != 0, [False, True, True])


def test_dynamic_cache_bad_traced_row_is_nan_not_a_wrapped_row():
    cache = DynamicCache.from_legacy_cache([(jnp.ones((2, 1, 2, 2)), jnp.ones((2, 1, 2, 2)))])
    for fn in (lambda c, i: c.reorder_cache(i), lambda c, i: c.batch_select_indices(i)):
        keys = jax.jit(fn)(cache, jnp.array([-1, 0]))[0][0]
        assert np.isnan(keys[0]).all() and (keys[1] == 1).all()


@protocol_kinds
def test_crop_rule(kind):
    cache = filled(kind)  # rows hold 3, 2 and 1 tokens in every layer
    np.testing.assert_array_equal(lengths_of(cache.crop(jnp.array([-2, 0, 1])))[0], [1, 2, 1])  # 0 drops nothing
    np.testing.assert_array_equal(lengths_of(cache.crop(0))[0], [3, 2, 1])
    np.testing.assert_array_equal(lengths_of(cache.crop(np.uint64(2**64 - 1)))[0], [3, 2, 1])  # not -1
    for huge in (2**31, np.int64(2**32 + 2), 2**70):  # clamped, never wrapped
        np.testing.assert_array_equal(lengths_of(cache.crop(huge))[0], [3, 2, 1])
        np.testing.assert_array_equal(lengths_of(cache.crop(-huge))[0], [0, 0, 0])
    with jax.enable_x64(True):
        np.testing.assert_array_equal(lengths_of(cache.crop(jnp.asarray([2**32 + 2, -(2**33), 0])))[0], [3, 0, 1])
        np.testing.assert_array_equal(lengths_of(jax.jit(lambda c, m: c.crop(m))(cache, jnp.int64(2**32 + 1)))[0], [3, 2, 1])


def test_dynamic_crop_is_per_layer_like_transformers():
    k = jnp.ones((1, 1, 4, 2))
    cache = DynamicCache(num_layers=3).update(k, k, 1)[0].update(k[:, :, :2], k[:, :, :2], 2)[0]
    out = cache.crop(-1)  # layer 0 unseeded: the others lose one token each
    assert [out.get_seq_length(i) for i in range(3)] == [0, 3, 1]
    assert [cache.crop(0).get_seq_length(i) for i in range(3)] == [0, 4, 2]
    assert cache.crop(2**40).get_seq_length(1) == 4 and cache.crop(-(2**40)).get_seq_length(1) == 0


@protocol_kinds
def test_check_on_a_stacked_cache_names_the_row(kind):
    stacked = jax.tree.map(lambda *x: jnp.stack(x), filled(kind), filled(kind))
    out = jax.vmap(lambda c, i: c.reorder_cache(i))(stacked, jnp.array([[0, 1, 2], [0, 5, 2]]))
    with pytest.raises(CacheError, match=r"rows \[\(1, 1\)\] got an out-of-range index"):
        out.check()


@protocol_kinds
def test_pickle_round_trip(kind):
    cache = filled(kind)
    back = pickle.loads(pickle.dumps(cache))
    assert type(back) is type(cache)
    chex.assert_trees_all_equal(back, cache)
    assert jax.tree.structure(back) == jax.tree.structure(cache)
    # copy.copy / deepcopy went through pickling's host round trip, so they failed under jit
    # and on an abstract cache; an abstract one pickled, then failed to load.
    import copy

    for dup in (copy.copy(cache), copy.deepcopy(cache)):
        assert type(dup) is type(cache)
        chex.assert_trees_all_equal(dup, cache)
    jax.jit(lambda c: jax.tree.leaves(copy.deepcopy(c)) + jax.tree.leaves(copy.copy(c)))(cache)
    abstract = jax.eval_shape(lambda: cache)
    assert jax.tree.structure(copy.deepcopy(abstract)) == jax.tree.structure(cache)
    if not isinstance(cache, DynamicCache):
        with pytest.raises(TypeError, match="cannot pickle"):
            pickle.dumps(abstract)


@protocol_kinds
def test_flax_serialization_round_trip(kind):
    from flax import serialization

    import jaxkv.nnx  # noqa: F401  (a flax integration module registers the kinds with flax)

    cache = filled(kind)
    back = serialization.from_bytes(KINDS[kind](), serialization.to_bytes(cache))
    assert type(back) is type(cache)
    chex.assert_trees_all_equal(back, cache)
    with pytest.raises(ValueError, match="was saved as"):  # another shape: a clear error, not garbage
        serialization.from_bytes(filled(kind).batch_select_indices(jnp.array([0])), serialization.to_bytes(cache))


def test_dynamic_cache_flax_round_trip_lets_only_the_length_differ():
    from flax import serialization

    import jaxkv.nnx  # noqa: F401

    def dyn(t, dtype=jnp.float32, batch=1):
        k = jnp.arange(batch * H * t * D, dtype=dtype).reshape(batch, H, t, D)
        return DynamicCache.from_legacy_cache([(k, k + 1)] * L)

    saved = serialization.to_bytes(dyn(5))
    back = serialization.from_bytes(dyn(3), saved)  # a target of another length: the saved one
    assert back.get_seq_length(0) == 5
    chex.assert_trees_all_equal(back, dyn(5))
    for other, what in ((dyn(3, jnp.bfloat16), r"saved as float32\[1, 2, 5, 8\], the target holds bfloat16"),
                        (dyn(3, batch=2), r"the target holds float32\[2, 2, 3, 8\] \(only the sequence axis")):
        with pytest.raises(ValueError, match=what):
            serialization.from_bytes(other, saved)
    state = {k: np.ones((7,), np.int8) for k in jaxkv.serialization.to_state_dict(dyn(3))}
    with pytest.raises(ValueError, match=r"saved as int8\[7\]"):
        jaxkv.serialization.from_state_dict(dyn(3), state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_caches_are_written_in_place(dtype):
    """XLA:CPU rewrites a whole bf16/f16 array around an in-place write; a 16-bit cache is
    stored as its bits so that a decode step touches one slot, not the capacity."""
    cache = StaticCache.init(num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=4096, dtype=dtype)
    k = jnp.ones((B, H, 1, D), dtype)
    step = jax.jit(lambda c, k: c.update(k, k, 1)[0], donate_argnums=0)
    hlo = step.lower(cache, k).compile().as_text()
    full = f"[{L},{B},{H},4096,{D}]"
    # Before: f32 copies of the whole cache, converted there and back around the write.
    assert not [line for line in hlo.splitlines() if f"f32{full}" in line or (" copy(" in line and full in line)]
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
    out = step(cache, k)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(out)] == pointers
    assert out.keys.dtype == jnp.dtype(dtype) and (out.keys[1, :, :, 0] == 1).all()


def test_float64_without_x64_is_a_float32_cache_that_says_so():
    """JAX makes float64 arrays float32 unless jax_enable_x64 is on. The caches kept the asked
    float64 as their dtype: a StaticCache stored its float32 buffers as 16-bit patterns on the
    first update (an internal broadcast error), a QuantizedCache said float64 and gave float32."""
    assert not jax.config.jax_enable_x64
    k = jnp.ones((1, H, 2, D))
    for kind in (StaticCache, QuantizedCache, SlidingWindowCache):
        size = {"window": 4} if kind is SlidingWindowCache else {"max_length": 4}
        cache = kind.init(num_layers=1, batch_size=1, num_kv_heads=H, head_dim=D, dtype=jnp.float64, **size)
        cache, keys, values = cache.update(k, k, 0)
        assert cache.dtype == jnp.float32 and keys.dtype == values.dtype == jnp.float32, kind
        atol = 1 / 254 if kind is QuantizedCache else 0  # int8 codes: within max|x| / 254
        written = np.abs(np.asarray(keys) - 1) <= atol  # the two tokens' slots (a ring's may be any two)
        assert written.sum() == 2 * H * D and (np.asarray(keys)[~written] == 0).all(), kind


@pytest.mark.parametrize("kind", ["static", "quantized", "paged-int8"])
def test_a_view_can_leave_jit_and_be_a_cond_result(kind):
    """A view's dtypes and bit width are tree metadata: as NamedTuple leaves they made
    ``jit(lambda c: c.view(0))`` fail with "returned a value of type Float32DType"."""
    cache = filled(kind)
    eager = cache.view(1)
    out = jax.jit(lambda c: c.view(1))(cache)
    assert type(out) is type(eager)
    chex.assert_trees_all_equal(out.dense(), eager.dense())
    picked = jax.jit(lambda c, p: jax.lax.cond(p, lambda: c.view(0), lambda: c.view(1)))(cache, False)
    chex.assert_trees_all_equal(picked.dense(), eager.dense())

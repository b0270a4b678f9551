"""DynamicCache (the HF reference semantics: its vocabulary, growing shapes, legacy
conversion) and what is specific to StaticCache (slot = position, crop moves no data,
overflow drops and never clamps, no cache-sized copies, x64, conversions, error messages).

The protocol every kind shares (random op programs against the NumPy model, eager == jit,
vmap, scan over layers, donation, the overflow policy, traced bad row indices, the crop
rule, pickling) is tested once per kind in test_conformance.py."""

import dataclasses
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_checks import assert_matches_reference
from jaxkv import INVALID, OVERFLOW, CacheError, DynamicCache, StaticCache
from reference import ReferenceCache

L, B, H, D, S = 3, 2, 2, 4, 16


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def states(t, *, batch=B, seed=0, dtype=jnp.float32):
    """Keys and values that differ from each other (so a k/v mix-up shows)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    keys = jax.random.normal(k1, (batch, H, t, D), dtype)
    values = jax.random.normal(k2, (batch, H, t, D), dtype) + 10.0
    return keys, values


def empty_static(**kw):
    args = dict(num_layers=L, batch_size=B, num_kv_heads=H, head_dim=D, max_length=S)
    args.update(kw)
    return StaticCache.init(**args)


def filled_static():
    cache = empty_static()
    for layer in range(L):
        k, v = states(5, seed=layer)
        cache, _, _ = cache.update(k, v, layer, num_new=jnp.array([5, 3]))
    return cache


def filled_dynamic():
    cache = DynamicCache()
    for layer in range(L):
        k, v = states(5, seed=layer)
        cache, _, _ = cache.update(k, v, layer)
    return cache


# ----------------------------------------------------------------------- DynamicCache


def test_dynamic_construction_and_protocol():
    assert len(DynamicCache()) == 0
    cache = DynamicCache(num_layers=4)
    assert len(cache) == 4 and cache.get_seq_length(3) == 0 and cache.get_max_length() is None
    k, v = states(3)
    cache2, keys, values = cache.update(k, v, 2)
    assert cache.get_seq_length(2) == 0  # the old cache is unchanged
    assert cache2.get_seq_length(2) == 3 and cache2.get_seq_length(0) == 0
    chex.assert_trees_all_equal((keys, values), (k, v))
    cache3, _, _ = cache2.update(k, v, 6)  # grows the layer list
    assert len(cache3) == 7 and cache3.get_seq_length(6) == 3
    legacy = filled_dynamic().to_legacy_cache()
    again = DynamicCache.from_legacy_cache(legacy)
    chex.assert_trees_all_equal(again.to_legacy_cache(), legacy)
    assert [kv[0].shape for kv in again] == [(B, H, 5, D)] * L
    np.testing.assert_array_equal(again[1][1], legacy[1][1])


def test_dynamic_update_concatenates_and_keeps_dtype():
    k, v = states(2, dtype=jnp.bfloat16)
    cache, _, _ = DynamicCache().update(k, v, 0)
    k32, v32 = states(3, seed=1)
    cache, keys, values = cache.update(k32, v32, 0)
    assert keys.dtype == jnp.bfloat16 and values.dtype == jnp.bfloat16
    np.testing.assert_array_equal(keys[:, :, 2:], k32.astype(jnp.bfloat16))
    np.testing.assert_array_equal(values[:, :, :2], v)


def test_dynamic_crop_semantics():
    cache = filled_dynamic()
    assert cache.crop(3).get_seq_length() == 3
    assert cache.crop(-2).get_seq_length(2) == 3
    assert cache.crop(-9).get_seq_length() == 0
    assert cache.crop(5).get_seq_length() == 5 and cache.crop(50).get_seq_length() == 5
    # 0 drops nothing (transformers: crop(0) is a no-op; crop(-n) with n == 0 must be too).
    assert [cache.crop(0).get_seq_length(i) for i in range(L)] == [5] * L
    empty = cache.crop(-5)
    assert [empty.get_seq_length(i) for i in range(L)] == [0] * L
    k, v = states(2, seed=7)
    _, keys, _ = empty.update(k, v, 0)
    np.testing.assert_array_equal(keys, k)


def test_dynamic_row_ops():
    cache = filled_dynamic()
    k0 = cache[0][0]
    np.testing.assert_array_equal(cache.reorder_cache(jnp.array([1, 0]))[0][0], k0[::-1])
    np.testing.assert_array_equal(cache.batch_select_indices(jnp.array([1]))[0][0], k0[1:])
    rep = cache.batch_repeat_interleave(2)[0][0]
    np.testing.assert_array_equal(rep, k0[jnp.array([0, 0, 1, 1])])
    assert len(cache.reset()) == L and cache.reset().get_seq_length() == 0


def test_dynamic_under_jit_compiles_once_per_length():
    traces = []

    @jax.jit
    def step(cache, k, v):
        traces.append(1)
        cache, _, _ = cache.update(k, v, 0)
        return cache

    cache = DynamicCache(num_layers=1)
    k, v = states(1)
    for _ in range(3):
        cache = step(cache, k, v)
    assert cache.get_seq_length() == 3
    assert len(traces) == 3  # one per new length: growing shapes, as documented
    ref = DynamicCache(num_layers=1)
    for _ in range(3):
        ref, _, _ = ref.update(k, v, 0)
    chex.assert_trees_all_equal(cache, ref)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c, k, v: c.update(k[0], v[0], 0), ValueError, "rank 4"),
        (lambda c, k, v: c.update(k, v[:, :, :1], 0), ValueError, "same shape"),
        (lambda c, k, v: c.update(k[:, :1], v[:, :1], 0), ValueError, "kv_heads=1 but the cache holds kv_heads=2"),
        (lambda c, k, v: c.update(k[:1], v[:1], 1), ValueError, "batch=1"),
        (lambda c, k, v: c.update(k, v, -1), ValueError, "layer_idx must be >= 0"),
        (lambda c, k, v: c.update(k, v, 0.5), TypeError, "layer_idx must be a Python int"),
        (lambda c, k, v: c.update(k.astype(jnp.int32), v, 0), TypeError, "floating dtype"),
        (lambda c, k, v: c.reorder_cache(jnp.array([0, 2])), ValueError, "row index 2"),
        (lambda c, k, v: c.reorder_cache(jnp.array([0])), ValueError, "one entry per row"),
        (lambda c, k, v: c.batch_select_indices(jnp.array([-1])), ValueError, "out of range"),
        (lambda c, k, v: c.batch_select_indices(jnp.array([0.0])), ValueError, "1-D integer"),
        (lambda c, k, v: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c, k, v: c.batch_repeat_interleave(2**31), ValueError, r"repeats must be < 2\*\*31"),
        (lambda c, k, v: c.crop(jnp.array([1, 2])), TypeError, "per-row rollback use StaticCache"),
        (lambda c, k, v: c[5], IndexError, "out of range"),
        (lambda c, k, v: DynamicCache(num_layers=2)[0], ValueError, "not been seeded"),
        (lambda c, k, v: c.get_seq_length(-1), ValueError, "layer_idx must be an int >= 0, got -1"),
        (lambda c, k, v: c.positions(-2), ValueError, r"num_tokens must be an int >= 0 .*got -2"),
        (lambda c, k, v: c.reorder_cache(np.array([2**32 + 1, 0])), ValueError, "row index 4294967297"),
    ],
)
def test_dynamic_bad_input(call, exc, match):
    cache = DynamicCache(num_layers=2)
    k, v = states(2)
    cache, _, _ = cache.update(k, v, 0)
    with pytest.raises(exc, match=match):
        call(cache, k, v)


# ------------------------------------------------------------------------ StaticCache


def test_static_init_and_protocol():
    cache = empty_static(dtype=jnp.bfloat16)
    assert len(cache) == L and cache.get_max_length() == S and cache.get_seq_length() == 0
    assert cache.keys.shape == (L, B, H, S, D) and cache.dtype == jnp.bfloat16
    assert cache.lengths.dtype == jnp.int32 and cache.flags.dtype == jnp.int32
    keys, values = cache[1]
    assert keys.shape == values.shape == (B, H, S, D)
    assert len(list(cache)) == L


def test_static_per_row_lengths_and_positions():
    cache = empty_static()
    k, v = states(4)
    np.testing.assert_array_equal(cache.positions(4), [[0, 1, 2, 3]] * 2)
    cache, keys, values = cache.update(k, v, 0, num_new=jnp.array([4, 2]))
    np.testing.assert_array_equal(cache.seq_lengths(0), [4, 2])
    assert cache.get_seq_length(0) == 4 and cache.get_seq_length(1) == 0
    np.testing.assert_array_equal(keys[0, :, :4], k[0])
    np.testing.assert_array_equal(values[1, :, :2], v[1, :, :2])
    assert not np.asarray(keys[1, :, 2:]).any()  # tokens past num_new are not stored
    np.testing.assert_array_equal(cache.positions(2, 0), [[4, 5], [2, 3]])


def test_all_layers_of_one_pass_write_at_the_same_positions():
    cache = empty_static()
    k, v = states(3)
    cache, _, _ = cache.update(k, v, 0, num_new=jnp.array([3, 1]))
    positions = cache.positions(2, 0)
    for layer in range(L):  # a full forward pass: layer 0 is updated first
        if layer:
            cache, _, _ = cache.update(k, v, layer, num_new=jnp.array([3, 1]))
    k2, v2 = states(2, seed=4)
    for layer in range(L):
        cache, keys, _ = cache.update(k2, v2, layer)
        for b in range(B):
            p = np.asarray(positions[b])
            np.testing.assert_array_equal(np.asarray(keys[b])[:, p], np.asarray(k2[b]))
    np.testing.assert_array_equal(cache.lengths, [[5, 3]] * L)


def test_static_crop_is_exact_and_moves_no_data():
    k, v = states(6)
    base = empty_static()
    cache, _, _ = base.update(k, v, 0)
    cropped = cache.crop(jnp.array([2, 4]))
    assert cropped.keys is cache.keys  # no data moved
    k2, v2 = states(3, seed=2)
    after, _, _ = cropped.update(k2, v2, 0)
    ref = ReferenceCache(L, B)
    ref.update(0, np.asarray(k), np.asarray(v), [2, 4])
    ref.update(0, np.asarray(k2), np.asarray(v2))
    assert_matches_reference(after, ref, heads=H, head_dim=D)
    np.testing.assert_array_equal(cache.crop(-2).seq_lengths(0), [4, 4])
    np.testing.assert_array_equal(cache.crop(0).seq_lengths(0), [6, 6])  # 0 drops nothing
    np.testing.assert_array_equal(cache.crop(-6).seq_lengths(0), [0, 0])
    np.testing.assert_array_equal(cache.crop(99).seq_lengths(0), [6, 6])


def test_select_and_repeat_change_the_batch_size():
    # The conformance fuzz keeps the batch size (reorder, same-size select); batch-changing
    # row ops and reset() without rows are checked against the data here.
    cache = filled_static()
    sel = cache.batch_select_indices(jnp.array([1, 1, 0]))
    assert sel.batch_size == 3 and sel.lengths[0].tolist() == [3, 3, 5]
    np.testing.assert_array_equal(sel.keys, cache.keys[:, jnp.array([1, 1, 0])])
    rep = cache.batch_repeat_interleave(2)
    assert rep.lengths[0].tolist() == [5, 5, 3, 3]
    np.testing.assert_array_equal(rep.values[:, 2], cache.values[:, 1])
    assert cache.reset().get_seq_length() == 0


K3, V3 = states(2, seed=3)  # computed eagerly once: jit must see the same inputs


def test_every_dynamic_op_eager_equals_jit():
    def ops(cache):
        k, v = K3, V3
        return dict(
            update=cache.update(k, v, 1),
            crop=cache.crop(-2),
            reorder=cache.reorder_cache(jnp.array([1, 0])),
            select=cache.batch_select_indices(jnp.array([1])),
            repeat=cache.batch_repeat_interleave(2),
            reset=cache.reset(),
        )

    cache = filled_dynamic()
    chex.assert_trees_all_equal(ops(cache), jax.jit(ops)(cache))


def test_different_fill_levels_share_one_compilation():
    traces = []

    @jax.jit
    def step(cache, k, v):
        traces.append(1)
        return cache.update(k, v, 0)[0]

    k, v = states(1)
    step(empty_static(), k, v)
    step(filled_static(), k, v)
    step(filled_static().crop(jnp.array([1, 0])), k, v)
    assert len(traces) == 1
    assert jax.tree.structure(empty_static()) == jax.tree.structure(filled_static())


def test_donated_update_hlo_has_no_cache_sized_copy():
    cache = empty_static(max_length=512)
    k, v = states(1)

    def step(cache, k, v):
        return cache.update(k, v, 1)[0]

    hlo = jax.jit(step, donate_argnums=0).lower(cache, k, v).compile().as_text()
    buffer_shape = f"f32[{L},{B},{H},512,{D}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and buffer_shape in line]
    assert not copies, copies
    assert buffer_shape in hlo


# --------------------------------------------------------------------------- overflow


def test_jit_overflow_drops_writes_keeps_last_slot_and_sets_flag():
    cache = empty_static(max_length=4)
    k, v = states(3)
    cache, _, _ = cache.update(k, v, 0, num_new=jnp.array([1, 3]))
    k2, v2 = states(2, seed=11)
    with pytest.raises(ValueError, match=r"layer 0, row 1: it holds 3 tokens and 2 new would make 5 > max_length=4"):
        cache.update(k2, v2, 0)  # eagerly refused; under jit:
    out, keys, _ = jax.jit(lambda c, k, v: c.update(k, v, 0))(cache, k2, v2)
    np.testing.assert_array_equal(out.seq_lengths(0), [3, 4])
    np.testing.assert_array_equal(out.overflowed, [False, True])
    assert int(out.flags[1]) & OVERFLOW
    # Row 1 had one free slot (3): it takes the first new token, the second is dropped,
    # never clamped onto slot 3.
    np.testing.assert_array_equal(keys[1, :, 3], k2[1, :, 0])
    np.testing.assert_array_equal(keys[1, :, :3], cache.keys[0, 1, :, :3])
    np.testing.assert_array_equal(keys[0, :, 1:3], k2[0])  # row 0 had room
    full = out
    again, keys3, _ = jax.jit(lambda c, k, v: c.update(k, v, 0))(full, k2, v2)
    np.testing.assert_array_equal(keys3[1], keys[1])  # a full row is left exactly as it was
    with pytest.raises(CacheError, match=r"rows \[0, 1\] overflowed max_length=4"):
        again.check()
    # The HF-style exports have no flags to carry the overflow: they refuse, or a round trip
    # through a DynamicCache would pass check() with the dropped tokens forgotten.
    for export in (again.to_dynamic, again.to_legacy_cache):
        with pytest.raises(CacheError, match=r"StaticCache\.to_(dynamic|legacy_cache): .*overflowed.*no flags"):
            export()
    assert again.reset().check() is not None


def test_a_stack_of_caches_is_refused_outside_vmap():
    """``jax.tree.map(jnp.stack, ...)`` of caches is what vmap takes; outside vmap its row and
    layer ops read the stack axis as layers (``lengths[layer]``) and the layer axis as rows:
    ``seq_lengths(1)`` gave the second cache's lengths, and ``reorder_cache`` swapped layers
    when L == B. They raise now; under vmap they equal a loop over the caches; check() still
    takes the stack."""
    caches = [filled_static(), filled_static().crop(2)]
    stack = jax.tree.map(lambda *x: jnp.stack(x), *caches)
    for op in (lambda c: c.seq_lengths(1), lambda c: c.reorder_cache(jnp.array([1, 0])), lambda c: c.crop(1),
               lambda c: c.update(*states(1), 0), lambda c: c.batch_size, lambda c: c.view(0)):
        with pytest.raises(ValueError, match=r"stack of caches \(lengths \[2, 3, 2\]"):
            op(stack)
    got = jax.vmap(lambda c: c.reorder_cache(jnp.array([1, 0])).seq_lengths(1))(stack)
    np.testing.assert_array_equal(got, [c.reorder_cache(jnp.array([1, 0])).seq_lengths(1) for c in caches])
    assert stack.check() is stack


def test_traced_bad_layer_or_num_new_writes_nothing_and_flags():
    # (A traced bad row index: test_conformance.py, every kind.)
    cache = filled_static()
    k, v = states(1)
    for layer in (L, -1):  # past the end and negative (-1 was checked by its lengths alone: review 74)
        bad_layer, _, _ = jax.jit(lambda c, i: c.update(k, v, i))(cache, jnp.int32(layer))
        chex.assert_trees_all_equal(bad_layer.keys, cache.keys)
        chex.assert_trees_all_equal(bad_layer.lengths, cache.lengths)
        assert (np.asarray(bad_layer.flags) & INVALID).all(), layer
        with pytest.raises(CacheError, match="out-of-range index or num_new"):
            bad_layer.check()
    bad_count, _, _ = jax.jit(lambda c, n: c.update(k, v, 0, num_new=n))(cache, jnp.array([1, 3]))
    np.testing.assert_array_equal(bad_count.seq_lengths(0), [6, 3])
    with pytest.raises(CacheError, match="out-of-range index or num_new"):
        bad_count.check()


# ------------------------------------------------------------------- dtype and errors


def test_bf16_cache_stays_bf16_with_f32_states():
    cache = empty_static(dtype=jnp.bfloat16)
    k, v = states(2)
    with jax.numpy_dtype_promotion("standard"):
        cache, keys, values = cache.update(k, v, 0)
    assert cache.keys.dtype == keys.dtype == values.dtype == jnp.bfloat16


def test_x64_mode_keeps_int32_indices_and_bf16():
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp
        from jaxkv import StaticCache, DynamicCache
        c = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4, max_length=8,
                             dtype=jnp.bfloat16)
        k = jnp.ones((2, 1, 3, 4), jnp.float64)
        c, keys, _ = c.update(k, k, 1, num_new=jnp.array([3, 2]))
        c = jax.jit(lambda c: c.update(k, k, jnp.int64(1))[0])(c)
        c = c.crop(jnp.array([4, 3])).reorder_cache(jnp.array([1, 0]))
        assert c.keys.dtype == jnp.bfloat16 and keys.dtype == jnp.bfloat16, c.keys.dtype
        assert c.lengths.dtype == jnp.int32 and c.positions(2).dtype == jnp.int32
        assert c.seq_lengths(1).tolist() == [3, 4], c.lengths
        d, kk, _ = DynamicCache().update(k.astype(jnp.bfloat16), k, 0)
        d, kk, _ = d.update(k, k, 0)
        assert kk.dtype == jnp.bfloat16
        # Traced int64 indices, counts and layers are range-checked before narrowing to
        # int32 (2**32 + 1 would wrap to a valid 1): the row, count or layer is refused.
        wide = 2**32 + 1
        r = jax.jit(lambda c, i: c.reorder_cache(i))(c, jnp.array([wide, 0]))
        assert r.seq_lengths(1).tolist() == [0, 3] and (r.flags & 2).tolist() == [2, 0], r.lengths
        n = jax.jit(lambda c, n: c.update(k, k, 0, num_new=n)[0])(c, jnp.array([wide, 1]))
        assert n.seq_lengths(0).tolist() == [0, 1] and (n.flags & 2).tolist() == [2, 0], n.lengths
        w = jax.jit(lambda c, i: c.update(k, k, i)[0])(c, jnp.int64(wide))
        assert w.lengths.tolist() == c.lengths.tolist() and (w.flags & 2).tolist() == [2, 2]
        assert jax.jit(lambda c, i: c.seq_lengths(i))(c, jnp.int64(wide)).tolist() == [0, 0]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c, k, v: c.update(k[0], v[0], 0), ValueError, "rank 4"),
        (lambda c, k, v: c.update(k, v[..., :2], 0), ValueError, "same shape"),
        (lambda c, k, v: c.update(k[:1], v[:1], 0), ValueError, r"batch=1 but the cache holds batch=2"),
        (lambda c, k, v: c.update(k[:, :1], v[:, :1], 0), ValueError, "kv_heads=1"),
        (lambda c, k, v: c.update(k[..., :3], v[..., :3], 0), ValueError, "head_dim=3"),
        (lambda c, k, v: c.update(k, v, L), ValueError, "layer_idx 3 is out of range"),
        (lambda c, k, v: c.update(k, v, -1), ValueError, "layer_idx -1 is out of range"),
        (lambda c, k, v: c.update(k, v, "0"), TypeError, "layer_idx must be an int"),
        (lambda c, k, v: c.update(k.astype(jnp.int8), v, 0), TypeError, "floating dtype"),
        (lambda c, k, v: c.update(k, v.astype(jnp.complex64), 0), TypeError, "floating dtype"),
        (lambda c, k, v: c.update(k, v, 0, num_new=jnp.array([1, 5])), ValueError, r"num_new\[1\]=5 is outside \[0, 2\]"),
        (lambda c, k, v: c.update(k, v, 0, num_new=jnp.array([1, 1, 1])), TypeError, "num_new must be"),
        (lambda c, k, v: c.reorder_cache(jnp.array([0, 2])), ValueError, "row index 2"),
        (lambda c, k, v: c.reorder_cache(jnp.array([0])), ValueError, "one entry per row"),
        (lambda c, k, v: c.batch_select_indices(jnp.array([[0]])), ValueError, "1-D integer"),
        (lambda c, k, v: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c, k, v: c.batch_repeat_interleave(2**31), ValueError, r"repeats must be < 2\*\*31"),
        (lambda c, k, v: c.batch_repeat_interleave(jnp.ones(2, jnp.int32)), TypeError, "repeats must be a Python int"),
        (lambda c, k, v: c.crop(1.5), TypeError, "max_length must be an int"),
        (lambda c, k, v: c.crop(jnp.array([1, 2, 3])), ValueError, "needs 2 entries"),
        (lambda c, k, v: c.reset(jnp.array([1, 0])), TypeError, "rows must be a bool array"),
        (lambda c, k, v: c[L], ValueError, "out of range"),
        (lambda c, k, v: c.seq_lengths(7), ValueError, "out of range"),
        (lambda c, k, v: c.positions(-1), ValueError, r"num_tokens must be an int >= 0 .*got -1"),
        (lambda c, k, v: StaticCache.init(num_layers=0, batch_size=1, num_kv_heads=1, head_dim=1, max_length=1), ValueError, "num_layers must be an int >= 1"),
        (lambda c, k, v: StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=1, max_length=1, dtype=jnp.int32), TypeError, "dtype must be floating"),
        (lambda c, k, v: filled_static().to_legacy_cache(), ValueError, "different lengths per row"),
        # Wide concrete indices are range-checked in their own dtype (never wrapped to row 1).
        (lambda c, k, v: c.reorder_cache(np.array([2**32 + 1, 0])), ValueError, "row index 4294967297"),
        (lambda c, k, v: c.batch_select_indices(np.array([2**32], np.uint64)), ValueError, "row index 4294967296"),
        # put_rows from a cache of other sizes: refused, naming the axis (never broadcast in).
        (lambda c, k, v: c.put_rows(jnp.array([1]), empty_static(batch_size=1, num_kv_heads=1)), ValueError,
         r"ContiguousStorage.keys .*: heads 1 \(this cache 2\)\. Only the batch size may differ"),
        (lambda c, k, v: c.put_rows(jnp.array([1]), empty_static(batch_size=1, max_length=8)), ValueError,
         r"seq 8 \(this cache 16\)"),
        (lambda c, k, v: c.put_rows(jnp.array([1]), empty_static(batch_size=1, num_layers=1)), TypeError,
         r"StaticCache of 1 layers; this one: StaticCache of 3\)"),
        # only the dtype differs: named (it said "another kind or layer layout")
        (lambda c, k, v: c.put_rows(jnp.array([1]), empty_static(batch_size=1, dtype=jnp.bfloat16)), TypeError,
         r"put_rows: the other cache has another dtype: bfloat16; this one has float32"),
        (lambda c, k, v: StaticCache.from_dynamic(filled_dynamic(), max_length=3), ValueError,
         r"layer 0 holds 5 tokens, more than max_length=3; pass max_length >= 5"),
    ],
)
def test_static_bad_input(call, exc, match):
    cache = empty_static()
    k, v = states(2)
    with pytest.raises(exc, match=match):
        call(cache, k, v)


def test_traced_out_of_range_put_rows_drops_the_row_and_flags_every_row():
    big = filled_static()  # rows hold 5 and 3 tokens
    small = empty_static(batch_size=1).update(*states(2, batch=1), 0)[0]
    put = jax.jit(lambda c, r: c.put_rows(r, small))
    for row in (-1, B, 2**31 - 1):  # -1 must not wrap onto the last row
        out = put(big, jnp.array([row]))
        chex.assert_trees_all_equal(out.stores, big.stores)
        np.testing.assert_array_equal(out.lengths, big.lengths)
        assert ((np.asarray(out.flags) & INVALID) != 0).all(), row
        with pytest.raises(CacheError, match="out-of-range index"):
            out.check()
    good = put(big, jnp.array([1]))
    np.testing.assert_array_equal(good.lengths[:, 1], [2, 0, 0])
    np.testing.assert_array_equal(good.lengths[:, 0], [5, 5, 5])
    assert not np.asarray(good.flags).any()


def test_put_rows_mask_skips_unused_entries_without_flagging():
    """The unused entries of a fixed-size batch (a serving loop's padding) are skipped by the
    mask: whatever row they name, nothing is written, raised or flagged; the real entries
    are written as without a mask. An unmasked bad row still flags every row."""
    big = filled_static()  # rows hold 5 and 3 tokens
    small = empty_static(batch_size=2).update(*states(2, batch=2), 0)[0]
    want = big.put_rows(jnp.array([1, 0]), small).batch_select_indices(jnp.array([1]))
    put = jax.jit(lambda c, r, m: c.put_rows(r, small, mask=m))
    for call in (put, lambda c, r, m: c.put_rows(r, small, mask=m)):  # jit, then eager
        for padding in (B, -1, 2**31 - 1, 0):
            out = call(big, jnp.array([1, padding]), jnp.array([True, False]))
            assert not np.asarray(out.flags).any(), padding
            np.testing.assert_array_equal(out.lengths[:, 0], big.lengths[:, 0])  # row 0 untouched
            chex.assert_trees_all_equal(out.batch_select_indices(jnp.array([0])).stores,
                                        big.batch_select_indices(jnp.array([0])).stores)
            chex.assert_trees_all_equal(out.batch_select_indices(jnp.array([1])), want)
    out = put(big, jnp.array([B, 1]), jnp.array([True, True]))  # an unmasked bad row: as before
    assert ((np.asarray(out.flags) & INVALID) != 0).all()
    with pytest.raises(TypeError, match=r"mask must be a bool array of shape \[2\]"):
        big.put_rows(jnp.array([1, 0]), small, mask=jnp.array([1, 0]))
    with pytest.raises(ValueError, match="row index 2"):
        big.put_rows(jnp.array([1, B]), small, mask=jnp.array([True, True]))


def test_put_rows_with_a_row_named_twice_takes_its_first_entry():
    """Two entries onto one row: eagerly a ValueError; under jit the first entry, whole (keys,
    lengths and flags of one entry: a scatter of both lands either one, leaf by leaf, in an
    order the backend chooses)."""
    big = filled_static()
    small = empty_static(batch_size=2).update(*states(2, batch=2, seed=3), 0)[0]
    small = dataclasses.replace(small, flags=jnp.array([0, OVERFLOW], jnp.int32))
    with pytest.raises(ValueError, match=r"rows \[1\] appear more than once"):
        big.put_rows(jnp.array([1, 1]), small)
    got = jax.jit(lambda c, r: c.put_rows(r, small))(big, jnp.array([1, 1]))
    want = big.put_rows(jnp.array([1]), small.batch_select_indices(jnp.array([0])))
    chex.assert_trees_all_equal(got, want)


def test_shape_errors_are_raised_at_trace_time_under_jit():
    cache = empty_static()
    k, v = states(2)
    with pytest.raises(ValueError, match="head_dim=3"):
        jax.jit(lambda c, k, v: c.update(k, v, 0))(cache, k[..., :3], v[..., :3])


# ------------------------------------------------------------------------ conversions


def test_dynamic_prefill_then_static_decode_then_export():
    dyn = filled_dynamic()
    static = dyn.to_static(max_length=S)
    assert static.seq_lengths(1).tolist() == [5, 5] and static.dtype == jnp.float32
    k, v = states(1, seed=8)
    for layer in range(L):
        static, _, _ = static.update(k, v, layer)
        dyn, _, _ = dyn.update(k, v, layer)
    chex.assert_trees_all_equal(static.to_dynamic(), dyn)
    back = StaticCache.from_legacy_cache(dyn.to_legacy_cache(), max_length=8, dtype=jnp.bfloat16)
    assert back.dtype == jnp.bfloat16 and back.get_seq_length() == 6
    with pytest.raises(ValueError, match=r"holds 6 tokens, more than max_length=4; pass max_length >= 6"):
        dyn.to_static(max_length=4)


def test_scan_over_layers_decode_step_has_no_cache_sized_copy():
    """Trap: scanning a stacked cache must not copy the whole cache per layer or step."""
    layers, capacity = 4, 512
    cache = StaticCache.init(num_layers=layers, batch_size=1, num_kv_heads=H, head_dim=D, max_length=capacity)
    weights = jnp.ones((layers, D, D))

    def decode_step(cache, x):  # x: [1, D]
        def layer_fn(carry, w):
            x, cache, i = carry
            k = jnp.broadcast_to((x @ w)[:, None, None, :], (1, H, 1, D))
            cache, keys, values = cache.update(k, k, i)
            scores = jnp.einsum("bhd,bhsd->bhs", k[:, :, 0], keys)
            x = x + jnp.einsum("bhs,bhsd->bd", jax.nn.softmax(scores, axis=-1), values)
            return (x, cache, i + 1), None

        (x, cache, _), _ = jax.lax.scan(layer_fn, (x, cache, jnp.int32(0)), weights)
        return x, cache

    hlo = jax.jit(decode_step, donate_argnums=0).lower(cache, jnp.ones((1, D))).compile().as_text()
    buffer_shape = f"f32[{layers},1,{H},{capacity},{D}]"
    copies = [line for line in hlo.splitlines() if " copy(" in line and buffer_shape in line]
    assert not copies, copies


def test_a_cache_of_no_rows_has_length_zero():
    """batch_select_indices([]) gives a cache of no rows; its longest row is 0 (a max over
    nothing raised a NumPy reduction error)."""
    empty = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=4).batch_select_indices(
        jnp.zeros((0,), jnp.int32))
    assert empty.batch_size == 0 and empty.get_seq_length(0) == 0
    # An empty Python list is no rows too (NumPy made it float64, refused as "dtype float64").
    cache = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=4)
    assert cache.batch_select_indices([]).batch_size == 0
    with pytest.raises(ValueError, match=r"1-D integer array of batch rows, got shape \(1, 0\)"):
        cache.batch_select_indices([[]])
    # Its export and a seeded DynamicCache of no rows (an IndexError, "no layer is seeded yet";
    # review 77): empty layers of 0 rows.
    assert empty.to_dynamic().layers[0][0].shape == (0, 1, 0, 2)
    dynamic = DynamicCache.from_legacy_cache([(jnp.ones((2, 1, 3, 2)),) * 2]).batch_select_indices([])
    assert dynamic.positions(1).shape == (0, 1)


def test_mixed_dtype_dynamic_layers_round_trip_and_torch_bfloat16_is_named():
    """A DynamicCache layer of float32 keys and bfloat16 values (as transformers allows) was
    saved by flax's to_bytes and refused by from_bytes: restored now, dtypes kept. A torch
    bfloat16 tensor (NumPy cannot hold it) gets a message saying what to do, not torch's
    bare "unsupported ScalarType"."""
    from flax import serialization

    import jaxkv.nnx  # noqa: F401  (registers the kinds with flax)

    k = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 2, 4)
    mixed, _, _ = DynamicCache().update(k, k.astype(jnp.bfloat16), 0)
    back = serialization.from_bytes(DynamicCache(num_layers=1), serialization.to_bytes(mixed))
    chex.assert_trees_all_equal(back.layers, mixed.layers)
    assert [x.dtype for x in back.layers[0]] == [jnp.float32, jnp.bfloat16]
    torch = pytest.importorskip("torch")
    t = torch.ones((1, 1, 2, 4), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"key_states \(Tensor\) could not be read as an array.*tensor.float\(\)"):
        DynamicCache.from_legacy_cache([(t, t)])


def test_a_transformers_cache_converts_and_bad_dynamic_layers_are_named():
    """transformers 5 iterates (keys, values, sliding window) per layer: from_legacy_cache(
    hf_cache) said "got 3 items", and a forward pass's tensors (requires_grad) were torch's
    RuntimeError. A full layer converts (values exact), a sliding one is refused with why.
    DynamicCache(2) / DynamicCache(config) / a dict built a cache of nonsense layers (review 63)."""
    torch = pytest.importorskip("torch")
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    v = k * 2  # a non-leaf tensor that requires grad, as a forward pass returns
    cache = DynamicCache.from_legacy_cache([(k, v, None), (v, k, None)])
    np.testing.assert_array_equal(np.asarray(cache[1][0]), v.detach().numpy())
    assert cache.get_seq_length(0) == 3
    # A transformers 5 cache before its first forward: empty layers (review 67: JAX's
    # "None is not a valid value for jnp.array").
    empty = DynamicCache.from_legacy_cache([(None, None, None), (k, v, None)])
    assert empty.layers[0] is None and empty.get_seq_length(1) == 3
    with pytest.raises(ValueError, match=r"layer 1 is a sliding-window layer of a transformers cache"):
        DynamicCache.from_legacy_cache([(k, v, None), (k, v, torch.tensor(2))])
    for layers, match in [
        (2, r"pass DynamicCache\(num_layers=2\)"),
        (type("Config", (), {"num_hidden_layers": 2})(), r"got a Config; .*num_layers=config.num_hidden_layers"),
        ({"a": 1}, r"got a dict; build one with DynamicCache\(num_layers=n\)"),
        ([(k, v, k)], r"layer 0 must be None or a \(keys, values\) pair, got tuple of 3 items"),
    ]:
        with pytest.raises(TypeError, match=match):
            DynamicCache(layers)
    # JAX rebuilds the cache with other leaves through the same constructor.
    seeded = DynamicCache.from_legacy_cache([(np.ones((1, 1, 2, 4), np.float32),) * 2]).update(
        jnp.ones((1, 1, 1, 4)), jnp.ones((1, 1, 1, 4)), 0)[0]
    assert jax.jit(lambda c: c)(seeded).get_seq_length(0) == 3
    assert jax.tree.map(lambda x: 0, seeded).layers == ((0, 0),)


def test_the_dynamic_constructor_checks_layers_and_from_legacy_cache_refuses_whole_buffers():
    """DynamicCache(layers), transformers 5's form, checked the structure only: torch tensors
    stayed torch (update then failed in NumPy), a rank-3 layer read its head_dim as its length,
    keys of 3 tokens with values of 7 and layers of two batch sizes were taken. And
    from_legacy_cache(a jaxkv StaticCache) iterated its whole buffers: 3 tokens in 8 slots came
    back as 8 (review 78). JAX's rebuilds of the tree stay unchecked (any leaves)."""
    torch = pytest.importorskip("torch")
    k = torch.randn(1, 2, 3, 4)
    cache = DynamicCache([(k, 2 * k), None])
    assert isinstance(cache.layers[0][0], jax.Array)
    np.testing.assert_array_equal(np.asarray(cache.update(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)), 0)[1][:, :, :3]),
                                  k.numpy())
    ones = lambda *shape: jnp.ones(shape)
    for layers, exc, match in [
        ([(ones(1, 3, 5), ones(1, 3, 5))], ValueError, r"DynamicCache \(layer 0\): key_states must have rank 4"),
        ([(ones(1, 2, 3, 4), ones(1, 2, 7, 4))], ValueError, r"the same shape, got \(1, 2, 3, 4\) and \(1, 2, 7, 4\)"),
        ([(ones(2, 1, 3, 4),) * 2, (ones(5, 1, 3, 4),) * 2], ValueError, r"one batch size, got \[2, 5\]"),
        ([(jnp.ones((1, 1, 2, 4), jnp.int32),) * 2], TypeError, "which a key/value cache cannot store"),
    ]:
        with pytest.raises(exc, match=match):
            DynamicCache(layers)
    abstract = jax.ShapeDtypeStruct((1, 2, 3, 4), jnp.float32)
    assert DynamicCache([(abstract, abstract)]).get_seq_length(0) == 3  # a load_cache(like=) target
    # A JAX prefix tree is no layer to check (review 82: vmap axes were refused).
    seeded = DynamicCache([(ones(2, 1, 3, 4), ones(2, 1, 3, 4)), None])
    assert jax.vmap(lambda c: c.get_seq_length(0), in_axes=(DynamicCache([(0, 0), None]),))(seeded).shape == (2,)
    stacked = jax.vmap(lambda c: c)(jax.tree.map(lambda x: jnp.stack([x, x]), cache))  # rank-5 leaves, rebuilt
    assert stacked.layers[0][0].shape == (2, 1, 2, 3, 4)
    static = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=4, max_length=8)
    static = static.update(ones(1, 2, 3, 4), ones(1, 2, 3, 4), 0)[0]
    for convert in (lambda: DynamicCache.from_legacy_cache(static), lambda: StaticCache.from_legacy_cache(static, max_length=16)):
        with pytest.raises(TypeError, match=r"got a jaxkv StaticCache, whose layers are its whole buffers.*cache.to_dynamic\(\)"):
            convert()
    assert static.to_dynamic().get_seq_length(0) == 3


def test_the_hf_style_constructor_and_a_transformers_cache_say_how_to_build_a_jaxkv_cache():
    """StaticCache(num_layers=...) / StaticCache(config=..., max_cache_len=...) was the
    dataclass's bare "unexpected keyword argument"; a transformers cache passed to a model
    was refused as "got DynamicCache" next to a suggestion of DynamicCache() (review 63)."""
    from jaxkv.caches.container import check_cache

    for kwargs in (dict(num_layers=2, batch_size=1), dict(config=None, max_cache_len=8), {}):
        with pytest.raises(TypeError, match=r"^StaticCache\(\.\.\.\) is the constructor of the cache's fields .*"
                                            r"Build an empty cache with StaticCache.init\(\.\.\.\)"):
            StaticCache(**kwargs)
    cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4)
    assert jax.jit(lambda c: c)(cache).batch_size == 1  # JAX still rebuilds it through the constructor
    transformers = pytest.importorskip("transformers")
    with pytest.raises(TypeError, match=r"got transformers\.cache_utils\.DynamicCache; .*from_legacy_cache\(hf_cache\)"):
        check_cache(transformers.DynamicCache(), "Llama")


def test_repr_shows_sizes_and_fill_levels_not_buffers():
    """repr printed every buffer (7.5 KB of uint16 bit patterns for a 1024-slot bf16 cache)
    with the lengths buried in them (review 63). Under jit and for a stack of caches too."""
    cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=4, head_dim=64, max_length=1024, dtype=jnp.bfloat16)
    cache, _, _ = cache.update(jnp.ones((2, 4, 3, 64)), jnp.ones((2, 4, 3, 64)), 1, num_new=jnp.array([3, 1]))
    assert repr(cache) == ("StaticCache(num_layers=2, batch_size=2, num_kv_heads=4, head_dim=64, max_length=1024, "
                           "dtype=bfloat16, lengths=[[0, 0], [3, 1]], flags=[0, 0], stores=(ContiguousStorage))")
    seen = []
    jax.jit(lambda c: seen.append(repr(c)) or c)(cache)
    assert "lengths=<DynamicJaxprTracer int32[2, 2]>" in seen[0] and "max_length=1024" in seen[0]
    stack = jax.tree.map(lambda *x: jnp.stack(x), cache, cache)
    assert repr(stack).startswith("StaticCache(lengths=[[[0, 0], [3, 1]], [[0, 0], [3, 1]]], flags=[[0, 0], [0, 0]]")
    dynamic = DynamicCache(num_layers=2).update(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 3, 4), jnp.bfloat16), 0)[0]
    assert repr(dynamic) == "DynamicCache(layers=[(keys float32[1, 2, 3, 4], values bfloat16[1, 2, 3, 4]), None])"


def test_donating_a_cache_deletes_the_arrays_of_the_caches_sharing_them():
    """As the README says: crop moves no data, so the cropped cache shares the old one's
    arrays; donating it deletes them for both (an error, never stale data). A copy keeps
    the old cache readable."""
    cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4)
    cache, _, _ = cache.update(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2)), 0)
    step = jax.jit(lambda c: c.update(jnp.zeros((1, 1, 1, 2)), jnp.zeros((1, 1, 1, 2)), 0)[0], donate_argnums=0)
    kept = step(jax.tree.map(jnp.copy, cache.crop(-1)))
    np.testing.assert_array_equal(cache.keys[0, 0, 0, :2], 1.0)  # still readable
    assert kept.get_seq_length(0) == 2 and float(kept.keys[0, 0, 0, 1, 0]) == 0.0
    step(cache.crop(-1))
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        np.asarray(cache.keys)


def test_a_float64_cache_pickled_under_x64_is_refused_without_it():
    """Unpickled without x64, a float64 cache's buffers became float32 under a static dtype that
    still said float64: writes went on, attention failed with a message about 16-bit bits
    (review 77). It is an UnpicklingError naming jax_enable_x64; with x64 it loads whole."""
    import pickle

    with jax.enable_x64(True):
        cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4,
                                 dtype=jnp.float64)
        cache = cache.update(jnp.full((1, 1, 2, 2), 1 / 3, jnp.float64), jnp.ones((1, 1, 2, 2), jnp.float64), 0)[0]
        data = pickle.dumps(cache)
        back = pickle.loads(data)
        assert back.dtype == jnp.float64 and back.keys.dtype == jnp.float64
        assert float(back.keys[0, 0, 0, 1, 1]) == 1 / 3
    with pytest.raises(pickle.UnpicklingError, match=r"float64 arrays \(it was pickled with jax_enable_x64\)"):
        pickle.loads(data)

"""jaxkv.persist: whole caches and per-sequence prompt state, saved and loaded.

Caches are filled with random bits directly (no update programs to compile): a round trip
must give back every leaf bit for bit, whatever the values mean.
"""

import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxkv import (
    CrossAttentionCache,
    DynamicCache,
    EncoderDecoderCache,
    HybridCache,
    QuantizedCache,
    SlidingWindowCache,
    StaticCache,
)
from jaxkv.persist import (
    CacheFileError,
    PromptCacheStream,
    load_cache,
    load_sequence,
    model_fingerprint,
    save_cache,
    save_sequence,
)

SIZES = dict(batch_size=2, num_kv_heads=2, head_dim=8)


def randomized(cache, seed=0):
    """``cache`` with every leaf replaced by random bits of its dtype and shape."""
    rng = np.random.default_rng(seed)

    def fill(x):
        raw = rng.integers(0, 256, size=x.size * x.dtype.itemsize, dtype=np.uint8)
        if x.dtype == jnp.int32:  # lengths, positions: small non-negative values
            return jnp.asarray(rng.integers(0, 4, size=x.shape), jnp.int32)
        return jnp.asarray(raw.view(np.dtype(x.dtype)).reshape(x.shape))

    return jax.tree.map(fill, cache)


def with_rows(cache, lengths):
    """``cache`` whose row ``b`` holds ``lengths[b]`` tokens in every layer, no flags."""
    lengths = jnp.asarray(lengths, jnp.int32)
    return dataclasses.replace(
        cache, lengths=jnp.broadcast_to(lengths, cache.lengths.shape), flags=jnp.zeros_like(cache.flags)
    )


def make(kind, *, batch_size=2, max_length=16, dtype=jnp.float32):
    sizes = dict(SIZES, batch_size=batch_size)
    if kind == "static":
        return StaticCache.init(num_layers=2, max_length=max_length, dtype=dtype, **sizes)
    if kind == "sliding":
        return SlidingWindowCache.init(num_layers=2, window=4, extra_slots=2, dtype=dtype, **sizes)
    if kind == "quantized":
        return QuantizedCache.init(num_layers=2, max_length=max_length, bits=4, residual_length=2, dtype=dtype, **sizes)
    if kind == "hybrid":
        return HybridCache.init(
            layer_types=["sliding_attention", "full_attention", "full_attention"], max_length=max_length,
            window=4, extra_slots=2, dtype=dtype, **sizes,
        )
    if kind == "paged":
        from jaxkv.caches.paged import PagedCache

        return PagedCache.init(num_layers=2, max_length=max_length, page_size=4, dtype=dtype, **sizes)
    raise ValueError(kind)


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits(x), bits(y))


def bits(x):
    """The bytes of an array (random bits may hold NaNs, which never compare equal)."""
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def every_kind():
    cross = CrossAttentionCache.from_layers([(jnp.ones((2, 2, 3, 8)), jnp.ones((2, 2, 3, 8)))] * 2)
    dynamic = DynamicCache([(jnp.ones((1, 2, 5, 8), jnp.bfloat16), jnp.zeros((1, 2, 5, 8), jnp.bfloat16))] * 2)
    return {
        "static-bf16": make("static", dtype=jnp.bfloat16),
        "sliding": make("sliding"),
        "quantized-int4": make("quantized"),
        "hybrid": make("hybrid"),
        "paged": make("paged", dtype=jnp.bfloat16),
        "encdec": EncoderDecoderCache.create(make("static"), cross),
        "dynamic-bf16": dynamic,
    }


# --------------------------------------------------------------------------- whole caches


@pytest.mark.parametrize("kind", list(every_kind()))
def test_round_trip_every_kind_is_exact(kind, tmp_path):
    cache = randomized(every_kind()[kind], seed=len(kind))
    path = tmp_path / "cache.safetensors"
    save_cache(path, cache)
    assert_same(load_cache(path), cache)  # rebuilt from the file's own description
    assert_same(load_cache(path, like=cache), cache)


def test_like_mismatches_name_the_file_and_the_difference(tmp_path):
    path = tmp_path / "c.safetensors"
    save_cache(path, make("static"))
    with pytest.raises(CacheFileError, match=rf"{path}: the file holds a StaticCache, like= is a QuantizedCache"):
        load_cache(path, like=make("quantized"))
    with pytest.raises(CacheFileError, match=r"holds a float32 cache, like= is bfloat16"):
        load_cache(path, like=make("static", dtype=jnp.bfloat16))
    with pytest.raises(CacheFileError, match=r"keys is float32\[2, 2, 2, 16, 8\] in the file, like= has .*32, 8\]"):
        load_cache(path, like=make("static", max_length=32))
    hybrid = tmp_path / "h.safetensors"
    save_cache(hybrid, make("hybrid"))
    swapped = HybridCache.init(layer_types=["full_attention", "sliding_attention", "full_attention"],
                               max_length=16, window=4, extra_slots=2, **SIZES)
    with pytest.raises(CacheFileError, match=r"static metadata differ: the file has \(\(1, 0, 0\), None\)"):
        load_cache(hybrid, like=swapped)  # the same arrays, another layer layout


def test_damaged_files_are_clear_errors(tmp_path):
    path = tmp_path / "c.safetensors"
    save_cache(path, randomized(make("static")))
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheFileError, match=rf"{cut}: truncated or corrupt"):
        load_cache(cut)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # inside the last array's bytes
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CacheFileError, match=rf"{bad}: array .* fails its checksum"):
        load_cache(bad)
    # One bit of the JSON header (a ring's window, 4 -> 5): the header has its own checksum,
    # or the file would load as another cache.
    ring = tmp_path / "ring.safetensors"
    save_cache(ring, make("sliding"))
    data = bytearray(ring.read_bytes())
    size = struct.unpack("<Q", bytes(data[:8]))[0]
    header = json.loads(json.loads(bytes(data[8:8 + size]))["__metadata__"]["jaxkv"])
    window = make("sliding").stores[0].window
    at = data.index(b"RingStorage", 8, 8 + size)
    at = data.index(str(window).encode(), at)
    data[at] ^= 0x01
    ring.write_bytes(bytes(data))
    assert header["header_crc32"]
    with pytest.raises(CacheFileError, match=rf"{ring}: the file's header fails its checksum"):
        load_cache(ring)
    ring.unlink()
    plain = tmp_path / "plain.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(plain))
    with pytest.raises(CacheFileError, match="not a jaxkv file"):
        load_cache(plain)
    with pytest.raises(CacheFileError, match="no such file"):
        load_cache(tmp_path / "missing.safetensors")
    with pytest.raises(CacheFileError, match="does not exist"):
        save_cache(tmp_path / "no" / "dir.safetensors", make("static"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "c.safetensors", "cut.safetensors",
                                                         "plain.safetensors"]  # no temporary files left


# --------------------------------------------------------------------------- sequences


def seq_fields(store):
    return {f: axes for f, axes in type(store).LEAF_AXES.items()}


def assert_row_restored(src, src_row, out, out_row, n):
    """Row ``out_row`` of ``out`` holds what row ``src_row`` of ``src`` holds, first ``n`` slots."""
    np.testing.assert_array_equal(np.asarray(out.lengths)[:, out_row], np.asarray(src.lengths)[:, src_row])
    for a, b in zip(src.stores, out.stores):
        for field, axes in seq_fields(a).items():
            x, y = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
            x, y = np.take(x, src_row, axis=1), np.take(y, out_row, axis=1)
            if "seq" in axes:
                seq = axes.index("seq") - 1
                x, y = np.take(x, range(n), axis=seq), np.take(y, range(n), axis=seq)
            np.testing.assert_array_equal(bits(x), bits(y), err_msg=field)


@pytest.mark.parametrize("kind", ["static", "quantized", "hybrid", "sliding"])
def test_sequence_onto_larger_and_smaller_caches(kind, tmp_path):
    src = with_rows(randomized(make(kind), seed=3), [3, 6])
    if kind in ("hybrid", "sliding"):  # a ring that has seen 6 tokens holds all of them (6 slots)
        ring = next(i for i, s in enumerate(src.stores) if hasattr(s, "starts"))
        stores = list(src.stores)
        stores[ring] = dataclasses.replace(stores[ring], starts=jnp.zeros_like(stores[ring].starts))
        src = dataclasses.replace(src, stores=tuple(stores))
    path = tmp_path / "row.safetensors"
    ids = [11, 12, 13, 14, 15, 16]
    save_sequence(path, src, 1, model_fingerprint="m", token_ids=ids)
    for capacity, row in ((32, 2), (8, 0)):
        target = randomized(make(kind, batch_size=3, max_length=capacity), seed=4)
        out, k = load_sequence(path, target, row, model_fingerprint="m", token_ids=ids + [1, 2])
        assert k == 6
        assert_row_restored(src, 1, out, row, 6)
        others = [r for r in range(3) if r != row]
        np.testing.assert_array_equal(np.asarray(out.lengths)[:, others], np.asarray(target.lengths)[:, others])


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_rows_of_other_lengths_load_without_compiling_again(kind, tmp_path):
    """The saved row's own capacity and page count (its token count) were shapes of the
    jitted cut and put: each new saved length compiled them again (review 81)."""
    states = jnp.asarray(np.random.default_rng(3).standard_normal((2, SIZES["num_kv_heads"], 6, SIZES["head_dim"])),
                         jnp.float32)
    src = make(kind)
    for layer in range(2):
        src = src.update(states, -states, layer, num_new=np.array([3, 6]))[0]
    target = make(kind, batch_size=2, max_length=16)
    ids = [11, 12, 13, 14, 15, 16]
    for row, n in ((0, 3), (1, 6)):
        save_sequence(tmp_path / f"{n}.safetensors", src, row, model_fingerprint="m", token_ids=ids[:n])
    load_sequence(tmp_path / "3.safetensors", target, 0, model_fingerprint="m", token_ids=ids)  # compiles
    compiles = []

    def listen(event, _, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out, k = load_sequence(tmp_path / "6.safetensors", target, 0, model_fingerprint="m", token_ids=ids)
        jax.block_until_ready(out.lengths)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert k == 6 and compiles == [], compiles
    for layer in range(2):
        got, want = out.view(layer).dense(), src.view(layer).dense()
        np.testing.assert_array_equal(np.asarray(got.keys)[0, :, :6], np.asarray(want.keys)[1, :, :6])
        np.testing.assert_array_equal(np.asarray(got.values)[0, :, :6], np.asarray(want.values)[1, :, :6])


def test_sequence_prefix_rules(tmp_path):
    src = with_rows(randomized(make("static")), [6, 6])
    path = tmp_path / "row.safetensors"
    ids = [11, 12, 13, 14, 15, 16]
    save_sequence(path, src, 0, model_fingerprint="m", token_ids=np.asarray(ids))
    target = make("static", batch_size=1, max_length=16)

    def load(prompt, **kw):
        out, k = load_sequence(path, target, 0, model_fingerprint="m", token_ids=prompt, **kw)
        assert int(out.lengths[0, 0]) == k
        return k

    assert load(ids[:4]) == 4  # a longer stored sequence serves the prompt's 4 tokens
    assert load(ids + [7, 8, 9]) == 6  # a shorter one serves as a prefix
    assert load([11, 12, 13, 99, 15]) == 3  # diverging after 3 tokens: those 3
    assert load([99, 12]) == 0
    with pytest.raises(CacheFileError, match=r"token 3 differs \(the file has id 14, the prompt 99\)"):
        load([11, 12, 13, 99], strict=True)
    small = make("static", batch_size=1, max_length=4)
    out, k = load_sequence(path, small, 0, model_fingerprint="m", token_ids=ids)
    assert k == 4 and out.lengths.tolist() == [[4], [4]]  # capped at the capacity
    np.testing.assert_array_equal(bits(out.stores[0].keys[:, 0, :, :4]), bits(src.stores[0].keys[:, 0, :, :4]))


def test_ring_rollback_past_evicted_tokens_restores_nothing(tmp_path):
    ring = SlidingWindowCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, window=4)
    store = dataclasses.replace(ring.stores[0], starts=jnp.full((1, 1), 6, jnp.int32))  # holds positions 6..9
    full = dataclasses.replace(ring, stores=(store,), lengths=jnp.full((1, 1), 10, jnp.int32))
    path = tmp_path / "ring.safetensors"
    save_sequence(path, full, 0, model_fingerprint="m", token_ids=range(10))
    out, k = load_sequence(path, ring, 0, model_fingerprint="m", token_ids=range(9))  # rollback of 1: fine
    assert (k, int(out.lengths[0, 0])) == (9, 9)
    out, k = load_sequence(path, ring, 0, model_fingerprint="m", token_ids=range(5))  # needs evicted 2..4
    assert (k, int(out.lengths[0, 0])) == (0, 0)


def test_quantized_residual_restore_then_prefill_equals_a_fresh_prefill(tmp_path):
    """A quantized cache keeps exact copies of its last R tokens. Restoring k < n tokens for a
    shorter, diverging prompt and prefilling the rest gives the row a fresh prefill of the
    prompt gives: the file's exact copies are of its own last R tokens, so the restore stops
    at P - R and the prefill writes the last R exactly (before, k = 5 was restored and
    positions 2-3 were read from their int4 codes, off by up to 0.1)."""
    rng = np.random.default_rng(0)
    sizes = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=16, bits=4, residual_length=4)
    keys = jnp.asarray(rng.standard_normal((1, 1, 8, 8)), jnp.float32)
    saved, _, _ = QuantizedCache.init(**sizes).update(keys, -keys, 0)  # ids 0..7
    path = tmp_path / "q.safetensors"
    save_sequence(path, saved, 0, model_fingerprint="m", token_ids=range(8))
    prompt = [0, 1, 2, 3, 4, 99]  # P = 6, diverging at 5
    prompt_keys = keys[:, :, :6].at[:, :, 5].set(jnp.asarray(rng.standard_normal(8), jnp.float32))
    fresh, _, _ = QuantizedCache.init(**sizes).update(prompt_keys, -prompt_keys, 0)
    restored, k = load_sequence(path, QuantizedCache.init(**sizes), 0, model_fingerprint="m", token_ids=prompt)
    assert k == 6 - 4
    restored, _, _ = restored.update(prompt_keys[:, :, k:], -prompt_keys[:, :, k:], 0)
    want, got = fresh.view(0).dense(), restored.view(0).dense()  # dequantized, residual tokens in place
    np.testing.assert_array_equal(np.asarray(got.keys)[..., :6, :], np.asarray(want.keys)[..., :6, :])
    np.testing.assert_array_equal(np.asarray(got.values)[..., :6, :], np.asarray(want.values)[..., :6, :])
    np.testing.assert_array_equal(np.asarray(got.keys)[0, 0, 2:6], np.asarray(prompt_keys)[0, 0, 2:6])  # exact
    # A prompt at least as long as the file: every common token is taken, as for other kinds.
    assert load_sequence(path, QuantizedCache.init(**sizes), 0, model_fingerprint="m", token_ids=range(10))[1] == 8
    assert load_sequence(path, QuantizedCache.init(**sizes), 0, model_fingerprint="m",
                         token_ids=[0, 1, 2, 3, 4, 5, 6, 99])[1] == 7


def test_file_edges_token_ids_modes_directories_offload_and_dynamic_like(tmp_path):
    src = with_rows(randomized(make("static")), [2, 2])
    row = tmp_path / "row.safetensors"
    # Ids are stored as int32: one past it would wrap onto another token's state.
    for bad in ([2**32 + 7, 5], [2**31, 5], [-1, 5]):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*31\)"):
            save_sequence(row, src, 0, model_fingerprint="m", token_ids=bad)
    save_sequence(row, src, 0, model_fingerprint="m", token_ids=[7, 5])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*31\)"):
        load_sequence(row, make("static"), 0, model_fingerprint="m", token_ids=[2**32 + 7, 5, 1])
    # Files get the mode open() would give (mkstemp alone made them 0600 whatever the umask).
    old = os.umask(0o022)
    try:
        save_cache(tmp_path / "a.safetensors", src)
        save_sequence(row, src, 0, model_fingerprint="m", token_ids=[7, 5])
        os.umask(0o077)
        save_cache(tmp_path / "b.safetensors", src)
    finally:
        os.umask(old)
    modes = [os.stat(tmp_path / name).st_mode & 0o777 for name in ("a.safetensors", "row.safetensors", "b.safetensors")]
    assert modes == [0o644, 0o644, 0o600]
    (tmp_path / "adir").mkdir()
    with pytest.raises(CacheFileError, match=rf"{tmp_path / 'adir'}: is a directory"):
        save_cache(tmp_path / "adir", src)
    # An offloaded cache is never sharded: sharding= on its file is refused (it loaded the
    # buffers into device memory under a cache that still said offloaded, then failed later).
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jaxkv.offload import OffloadedCache

    offloaded = tmp_path / "off.safetensors"
    save_cache(offloaded, OffloadedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, max_length=4))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(CacheFileError, match="holds an offloaded cache"):
        load_cache(offloaded, sharding=NamedSharding(mesh, PartitionSpec("data", "model")))
    # like= a DynamicCache: its layers' length may differ from the file's, nothing else.
    dynamic = tmp_path / "dyn.safetensors"
    save_cache(dynamic, DynamicCache([(jnp.ones((1, 2, 3, 4)), jnp.ones((1, 2, 3, 4)))]))
    longer = load_cache(dynamic, like=DynamicCache([(jnp.ones((1, 2, 5, 4)), jnp.ones((1, 2, 5, 4)))]))
    assert longer.layers[0][0].shape == (1, 2, 3, 4)
    with pytest.raises(CacheFileError, match=r"is float32\[1, 2, 3, 4\] in the file, like= has float32\[4, 8, 3, 16\]"):
        load_cache(dynamic, like=DynamicCache([(jnp.ones((4, 8, 3, 16)), jnp.ones((4, 8, 3, 16)))]))


def test_paged_sequence_round_trip(tmp_path):
    """A paged row (its pages in a shared pool) restored into another row of a larger pool."""
    cache = randomized(make("paged", batch_size=2, max_length=16), seed=5)
    store = cache.stores[0]  # page_size 4: row 0 holds 2 tokens in page 3, row 1 six in pages 5, 1
    table = jnp.full(store.block_table.shape, -1, jnp.int32).at[0, 0].set(3).at[1, :2].set(jnp.array([5, 1]))
    refcount = jnp.zeros_like(store.refcount).at[jnp.array([1, 3, 5])].set(1)
    store = dataclasses.replace(store, block_table=table, refcount=refcount)
    cache = dataclasses.replace(with_rows(cache, [2, 6]), stores=(store,))
    path = tmp_path / "paged.safetensors"
    save_sequence(path, cache, 1, model_fingerprint="m", token_ids=range(6))
    # The file holds the row's own filled part: its 2 pages (not the pool of 8, which holds
    # row 0's tokens), and zeros in slots 6, 7 past its length (a fork's tokens could lie there).
    from safetensors.numpy import load_file

    saved = {name: a for name, a in load_file(path).items() if name.endswith((".keys", ".values"))}
    assert sorted(a.shape for a in saved.values()) == [(2, 2, 2, 4, 8)] * 2, {n: a.shape for n, a in saved.items()}
    filled = {}
    for field in ("keys", "values"):
        pool = np.asarray(getattr(store, field))
        filled[field] = np.concatenate([pool[:, 5], pool[:, 1, :, :2]], axis=2)  # [L, H, 6, D]: tokens 0..5
        (stored,) = [a for n, a in saved.items() if n.endswith("." + field)]
        np.testing.assert_array_equal(bits(np.concatenate([stored[:, 0], stored[:, 1, :, :2]], axis=2)),
                                      bits(filled[field]))
        assert not stored[:, 1, :, 2:].any()  # slots 6, 7
    target = make("paged", batch_size=3, max_length=16)
    out, k = load_sequence(path, target, 2, model_fingerprint="m", token_ids=range(8))
    assert k == 6 and out.lengths[:, 2].tolist() == [6, 6]
    new = out.stores[0]
    pages = np.asarray(new.block_table)[2, :2]
    assert (pages >= 0).all() and np.asarray(new.refcount)[pages].tolist() == [1, 1]
    for field in ("keys", "values"):
        got = np.asarray(getattr(new, field))[:, pages]  # [L, 2, H, 4, D]
        got = np.concatenate([got[:, 0], got[:, 1, :, :2]], axis=2)
        np.testing.assert_array_equal(bits(got), bits(filled[field]))
    # Into caches of other capacities (block tables of 8 and 2 pages per row): the row's pages
    # are the same; into 8 tokens (2 pages) the 6 fit; page size or heads of another value
    # are a CacheFileError naming the axis.
    for max_length in (32, 8):
        other, k = load_sequence(path, make("paged", batch_size=1, max_length=max_length), 0,
                                 model_fingerprint="m", token_ids=range(6))
        assert k == 6 and other.lengths[:, 0].tolist() == [6, 6]
        table = np.asarray(other.stores[0].block_table)[0]
        assert table.shape == (max_length // 4,) and (table[:2] >= 0).all() and (table[2:] == -1).all()
        for field in ("keys", "values"):
            got = np.asarray(getattr(other.stores[0], field))[:, table[:2]]
            got = np.concatenate([got[:, 0], got[:, 1, :, :2]], axis=2)
            np.testing.assert_array_equal(bits(got), bits(filled[field]))
    from jaxkv.caches.paged import PagedCache

    pages8 = PagedCache.init(num_layers=2, max_length=16, page_size=8, **dict(SIZES, batch_size=1))
    with pytest.raises(CacheFileError, match=r"stores\[0\]\.keys is .*: page differ"):
        load_sequence(path, pages8, 0, model_fingerprint="m", token_ids=range(6))


def test_paged_sequence_into_a_pool_without_room_is_an_error(tmp_path):
    """The restore runs jitted, where a pool without free pages drops the row and flags it;
    load_sequence used to return k = 8 for a row left empty. Now a ValueError, and the
    cache passed in is unchanged (and still usable)."""
    from jaxkv.caches.paged import PagedCache

    kw = dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4)
    src = PagedCache.init(batch_size=1, max_length=16, **kw)
    k = jnp.arange(32, dtype=jnp.float32).reshape(1, 1, 8, 4)
    src = src.update(k, k, 0)[0]  # 8 tokens: 2 pages
    path = tmp_path / "row.safetensors"
    save_sequence(path, src, 0, model_fingerprint="m", token_ids=range(8))
    full = jnp.ones((2, 1, 16, 4))
    target = PagedCache.init(batch_size=2, max_length=16, num_pages=5, **kw)
    target = target.update(full, full, 0, num_new=jnp.array([16, 0]))[0]  # 1 page left free
    with pytest.raises(ValueError, match="too few free pages for the 8 restored tokens of row 1 .free now: 1."):
        load_sequence(path, target, 1, model_fingerprint="m", token_ids=range(8))
    target.check()
    assert target.lengths[0].tolist() == [16, 0] and int(target.free_pages) == 1
    roomy = PagedCache.init(batch_size=2, max_length=16, num_pages=6, **kw).update(full, full, 0, num_new=jnp.array([16, 0]))[0]
    out, n = load_sequence(path, roomy, 1, model_fingerprint="m", token_ids=range(8))
    assert n == 8 and out.lengths[0].tolist() == [16, 8]
    out.check()


def test_sequence_errors(tmp_path):
    src = with_rows(randomized(make("static")), [6, 6])
    path = tmp_path / "row.safetensors"
    save_sequence(path, src, 0, model_fingerprint="model-a", token_ids=range(6))
    target = make("static")
    with pytest.raises(CacheFileError, match=rf"{path}: saved for another model"):
        load_sequence(path, target, 0, model_fingerprint="model-b", token_ids=range(6))
    with pytest.raises(CacheFileError, match=r"holds a float32 cache row, the cache is bfloat16"):
        load_sequence(path, make("static", dtype=jnp.bfloat16), 0, model_fingerprint="model-a", token_ids=range(6))
    with pytest.raises(CacheFileError, match=r"holds a StaticCache row, the cache is a QuantizedCache"):
        load_sequence(path, make("quantized"), 0, model_fingerprint="model-a", token_ids=range(6))
    other_heads = StaticCache.init(num_layers=2, batch_size=1, num_kv_heads=1, head_dim=8, max_length=16)
    with pytest.raises(CacheFileError, match=r"stores\[0\].keys is \[2, 1, 2, 6, 8\] in the file"):
        load_sequence(path, other_heads, 0, model_fingerprint="model-a", token_ids=range(6))
    with pytest.raises(CacheFileError, match="holds one sequence"):
        load_cache(path)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CacheFileError, match=rf"{cut}: truncated or corrupt"):
        load_sequence(cut, target, 0, model_fingerprint="model-a", token_ids=range(6))
    # A changed token id would restore token 5's keys and values as those of another token.
    data = bytearray(path.read_bytes())
    size = struct.unpack("<Q", bytes(data[:8]))[0]
    begin, end = json.loads(bytes(data[8:8 + size]))["__token_ids__"]["data_offsets"]
    ids = np.frombuffer(bytes(data[8 + size + begin:8 + size + end]), np.int32).copy()
    np.testing.assert_array_equal(ids, range(6))
    ids[5] = 99
    data[8 + size + begin:8 + size + end] = ids.tobytes()
    bad_ids = tmp_path / "ids.safetensors"
    bad_ids.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match=rf"{bad_ids}: array '__token_ids__' fails its checksum"):
        load_sequence(bad_ids, target, 0, model_fingerprint="model-a", token_ids=[0, 1, 2, 3, 4, 99])
    with pytest.raises(ValueError, match="token_ids has 5 ids, row 0 holds 6 tokens"):
        save_sequence(path, src, 0, model_fingerprint="m", token_ids=range(5))
    with pytest.raises(ValueError, match=r"holds \[6, 2\] tokens per layer"):
        save_sequence(path, dataclasses.replace(src, lengths=jnp.array([[6, 6], [2, 6]])), 0,
                      model_fingerprint="m", token_ids=range(6))
    with pytest.raises(ValueError, match="error flags 1 set"):
        save_sequence(path, dataclasses.replace(src, flags=jnp.array([1, 0])), 0, model_fingerprint="m",
                      token_ids=range(6))
    with pytest.raises(TypeError, match="needs a preallocated cache"):
        save_sequence(path, DynamicCache(), 0, model_fingerprint="m", token_ids=[])


def test_model_fingerprint_follows_config_and_weights():
    weights = {"w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.float32)}
    base = model_fingerprint(weights, config={"layers": 2})
    assert base == model_fingerprint({k: v.copy() for k, v in weights.items()}, config={"layers": 2})
    changed = dict(weights, w=weights["w"].copy())
    changed["w"][3] += 1e-6
    assert model_fingerprint(changed, config={"layers": 2}) != base
    assert model_fingerprint(weights, config={"layers": 3}) != base


# --------------------------------------------------------------------------- generation


def test_cli_prompt_cache_gives_the_same_text_as_a_fresh_prompt(tmp_path, capsys, monkeypatch):
    """Greedy, embedded model: fresh prefill (saves), restored, and a longer prompt that
    the saved one serves as a prefix, each against a run without the prompt cache."""
    from jaxkv.cli import main

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")  # in this process: leave JAX's settings alone

    path = tmp_path / "p.safetensors"

    def generate(prompt, *extra):
        assert main(["generate", prompt, "--max-new-tokens", "8", "--temperature", "0", *extra]) == 0
        captured = capsys.readouterr()
        return captured.out.rsplit("[jaxkv] prompt", 1)[0], captured.err

    def restored(err):  # "[jaxkv] prompt cache FILE: k of P prompt tokens restored"
        found = re.search(r": (\d+) of (\d+) prompt tokens restored", err)
        return int(found.group(1)), int(found.group(2))

    prompt, longer = "def add(a, b):", "def add(a, b):\n    return a"
    plain, _ = generate(prompt)
    text, err = generate(prompt, "--prompt-cache", str(path))
    assert text == plain and path.exists() and restored(err)[0] == 0
    text, err = generate(prompt, "--prompt-cache", str(path))
    k, n = restored(err)
    assert text == plain and k == n - 1  # all but the last token, fed again for its logits
    text, err = generate(longer, "--prompt-cache", str(path))
    assert text == generate(longer)[0] and restored(err)[0] == n  # the saved prompt as a prefix

    # stdout and stderr in the order they were written: the prompt cache's line first, then
    # the prompt and its continuation (it used to land after the prompt, mid-line).
    events = []

    class Recorder(io.StringIO):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def write(self, text):
            events.append((self.name, text))
            return len(text)

    monkeypatch.setattr(sys, "stdout", Recorder("out"))
    monkeypatch.setattr(sys, "stderr", Recorder("err"))
    assert main(["generate", prompt, "--max-new-tokens", "2", "--prompt-cache", str(path)]) == 0
    line = next(i for i, (name, text) in enumerate(events) if "prompt tokens restored" in text)
    assert events[line][0] == "err" and not any(name == "out" and text for name, text in events[:line])
    assert "".join(text for name, text in events if name == "out").startswith(prompt)
    monkeypatch.undo()
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")

    save_sequence(path, with_rows(make("static"), [2, 2]), 0, model_fingerprint="other", token_ids=[1, 2])
    assert main(["generate", prompt, "--prompt-cache", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxkv: error:") and "saved for another model" in err[0]
    assert captured.out == ""  # a refused file: no half-started output before the error


# --------------------------------------------------------------------------- sharded (8 devices)

SHARDED = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxkv import StaticCache
    from jaxkv.persist import CacheFileError, load_cache, save_cache

    devices = np.array(jax.devices())
    def layout(devs, shape):
        return NamedSharding(Mesh(devs.reshape(shape), ("data", "model")), P("data", "model"))
    def cache(sharding):
        return StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=4, head_dim=8, max_length=16,
                                dtype=jnp.bfloat16, sharding=sharding)
    on8 = cache(layout(devices, (2, 4)))
    leaves, treedef = jax.tree.flatten(on8)
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 2**15, x.shape).astype(x.dtype) for x in leaves]
    on8 = jax.tree.unflatten(treedef, [jax.device_put(v, x.sharding) for v, x in zip(values, leaves)])
    path = os.path.join(sys.argv[1], "ckpt")
    save_cache(path, on8, format="orbax")

    def check(restored, devices_used):
        for leaf, want in zip(jax.tree.leaves(restored), values):
            np.testing.assert_array_equal(np.asarray(leaf), want)
            assert len(leaf.sharding.device_set) == devices_used, leaf.sharding
    on4 = layout(devices[:4], (1, 4))
    restored = load_cache(path, sharding=on4)
    assert restored.sharding == on4 and restored.stores[0].keys.sharding.spec[:3] == (None, "data", "model")
    check(restored, 4)
    check(load_cache(path), 1)
    check(load_cache(path, like=cache(layout(devices[4:], (2, 2)))), 4)
    # like= an abstract cache (jax.eval_shape): its leaves carry no sharding in jax 0.10, the
    # cache's own layout places them (everything landed on one device; review 64)
    abstract = jax.eval_shape(lambda: cache(layout(devices[4:], (2, 2))))
    check(load_cache(path, like=abstract), 4)
    import shutil
    shutil.rmtree(os.path.join(path, "state"))
    try:
        load_cache(path)
    except CacheFileError as err:
        assert str(err).startswith(path) and "not a readable jaxkv Orbax checkpoint" in str(err), err
    else:
        raise AssertionError("a damaged checkpoint loaded")
    # A cache committed to another device than the default (not offloaded) loads onto a mesh;
    # it was refused as "an offloaded cache" (its leaves record their device).
    single = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=4, head_dim=8, max_length=16)
    for fmt in ("safetensors", "orbax"):
        other = os.path.join(sys.argv[1], "on-device-1-" + fmt)
        save_cache(other, jax.device_put(single, jax.devices()[1]), format=fmt)
        assert len(load_cache(other, sharding=on4).stores[0].keys.sharding.device_set) == 4
    # kv heads that do not split over the mesh: a message that names them (it was JAX's
    # IndivisibleError about an internal 5-D buffer)
    try:
        load_cache(other, sharding=layout(devices, (1, 8)))
    except ValueError as err:
        assert "num_kv_heads=4" in str(err) and "does not split over mesh axes" in str(err), err
    else:
        raise AssertionError("4 kv heads loaded over 8 devices")
    # ...and a sequence axis that does not split (it was JAX's IndivisibleError; review 64)
    try:
        load_cache(other, sharding=NamedSharding(Mesh(devices[:3], ("s",)), P(None, None, "s")))
    except ValueError as err:
        assert "the saved StaticCache: max_length (slots)=16 does not split over mesh axes ('s',)" in str(err), err
    else:
        raise AssertionError("16 slots loaded over 3 devices")
    print("OK")
    """
)


def test_orbax_checkpoint_checksums_and_an_empty_cache(tmp_path):
    """Orbax's files carry no checksum of their own: the header keeps one per array, so a
    flipped byte is a CacheFileError as in a safetensors file. A cache with no non-empty
    array (an empty DynamicCache) saves and loads too (Orbax refuses an empty item)."""
    pytest.importorskip("orbax.checkpoint")
    import glob

    cache = randomized(make("static", max_length=64))
    path = tmp_path / "ck"
    save_cache(path, cache, format="orbax")
    assert_same(load_cache(path), cache)
    data_file = max(glob.glob(str(path / "state" / "ocdbt.process_0" / "d" / "*")), key=os.path.getsize)
    data = bytearray(open(data_file, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(data_file, "wb").write(bytes(data))
    with pytest.raises(CacheFileError, match=rf"{path}: array .* fails its checksum"):
        load_cache(path)
    save_cache(tmp_path / "empty", DynamicCache(num_layers=2), format="orbax")
    back = load_cache(tmp_path / "empty")
    assert isinstance(back, DynamicCache) and len(back) == 2 and back.get_seq_length(1) == 0


def test_a_failed_save_keeps_the_old_file_or_checkpoint_and_its_mode(tmp_path, monkeypatch):
    """Orbax's force=True removed the old checkpoint before writing the new one, so a save
    that failed midway (the disk full) lost both; the safetensors file already survived. A
    re-saved file kept private (0600) became 0644. A path with '[' saved an Orbax checkpoint
    that never loaded; a file name of 250 bytes failed on the temporary name's length."""
    import errno

    ocp = pytest.importorskip("orbax.checkpoint")
    import safetensors.numpy

    old = randomized(make("static", max_length=8))
    new = randomized(make("static", max_length=8), seed=1)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    for fmt, path, owner, name in (("safetensors", tmp_path / "c.st", safetensors.numpy, "save_file"),
                                   ("orbax", tmp_path / "ck", ocp.CompositeCheckpointHandler, "save")):
        save_cache(path, old, format=fmt)
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, disk_full)
            with pytest.raises(OSError, match="No space left"):
                save_cache(path, new, format=fmt)
        assert_same(load_cache(path), old)
        assert sorted(os.listdir(tmp_path)) == sorted(["c.st"] + (["ck"] if fmt == "orbax" else []))
        save_cache(path, new, format=fmt)  # and a save that works replaces it
        assert_same(load_cache(path), new)

    os.chmod(tmp_path / "c.st", 0o600)
    save_cache(tmp_path / "c.st", old)
    assert os.stat(tmp_path / "c.st").st_mode & 0o777 == 0o600
    with pytest.raises(CacheFileError, match=r"run\[1\]: Orbax cannot save under a path holding"):
        save_cache(tmp_path / "run[1]", old, format="orbax")
    # through a link to a checkpoint: the checkpoint it names is replaced, the link stays
    os.symlink(tmp_path / "ck", tmp_path / "link")
    for cache in (old, new):
        save_cache(tmp_path / "link", cache, format="orbax")
        assert os.path.islink(tmp_path / "link")
        assert_same(load_cache(tmp_path / "ck"), cache)
    assert sorted(os.listdir(tmp_path)) == ["c.st", "ck", "link"]
    long_name = tmp_path / ("p" * 250)
    save_cache(long_name, old)
    assert_same(load_cache(long_name), old)


def test_like_and_sharding_together_are_refused(tmp_path):
    """sharding= next to like= was ignored silently (the result takes like='s shardings)."""
    cache = make("static", max_length=4)
    save_cache(tmp_path / "c", cache)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match="pass like= .* or sharding=, not both"):
        load_cache(tmp_path / "c", like=cache, sharding=device)


def test_leaves_that_are_not_numeric_arrays_are_named_errors(tmp_path):
    """A string leaf was KeyError: 12 from inside the writer; a typed PRNG key and a traced
    cache were JAX's errors without the leaf's name. Nothing is written for them."""
    cache = make("static", max_length=4)
    formats = ["safetensors"] + (["orbax"] if importlib.util.find_spec("orbax") else [])
    for fmt in formats:
        path = tmp_path / fmt
        with pytest.raises(TypeError, match=r"leaf \['note'\] is a str of dtype <U2; a cache file holds arrays"):
            save_cache(path, {"cache": cache, "note": "hi"}, format=fmt)
        with pytest.raises(TypeError, match=r"leaf \['key'\] is a typed PRNG key .*jax.random.key_data"):
            save_cache(path, {"cache": cache, "key": jax.random.key(0)}, format=fmt)
        assert not path.exists()
    with pytest.raises(TypeError, match=r"leaf .* is traced \(inside jit"):
        jax.jit(lambda c: save_cache(tmp_path / "t", c))(cache)
    # An abstract cache and a Python int JAX cannot hold were NumPy's and JAX's errors (review 67).
    with pytest.raises(TypeError, match=r"leaf .*keys is abstract \(jax.eval_shape\) and holds no values"):
        save_cache(tmp_path / "a", jax.eval_shape(lambda: cache))
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match=r"leaf \['seen'\] is the Python int 1099511627776, past the int32"):
            save_cache(tmp_path / "a", {"seen": 2**40})
    assert not (tmp_path / "a").exists()


def test_python_number_leaves_load_back_in_both_formats_and_with_like(tmp_path):
    """like= with a Python int leaf was AttributeError ('int' object has no attribute
    'dtype'); Orbax could not save one (review 62)."""
    tree = {"cache": make("static", max_length=4), "step": 3, "scale": 0.5}
    formats = ["safetensors"] + (["orbax"] if importlib.util.find_spec("orbax") else [])
    for fmt in formats:
        save_cache(tmp_path / fmt, tree, format=fmt)
        for back in (load_cache(tmp_path / fmt), load_cache(tmp_path / fmt, like=tree)):
            assert int(back["step"]) == 3 and float(back["scale"]) == 0.5, fmt
        with pytest.raises(CacheFileError, match=r"array .*step.* is int32\[\] in the file, like= has float32\[\]"):
            load_cache(tmp_path / fmt, like={**tree, "step": 3.0})


def test_64_bit_leaves_without_x64_load_only_when_nothing_is_lost(tmp_path):
    """A pytree with int64 / float64 NumPy leaves loaded without x64: the integers wrapped
    and the floats rounded to float32 silently (and Orbax called the good file corrupt).
    Values 32 bits hold (a step count saved from a Python int) still load, narrowed."""
    tree = {"cache": make("static", max_length=4), "seen": np.array([2**40 + 7], np.int64)}
    formats = ["safetensors"] + (["orbax"] if importlib.util.find_spec("orbax") else [])
    for fmt in formats:
        path = tmp_path / fmt
        save_cache(path, tree, format=fmt)
        with pytest.raises(CacheFileError, match=r"array .*seen.* is int64 in the file.*JAX holds 64-bit arrays "
                                                 r"only with jax_enable_x64 \(without it: int32"):
            load_cache(path)
        with jax.enable_x64(True):
            assert int(load_cache(path)["seen"][0]) == 2**40 + 7
    for value in (np.array([2**40 + 7], np.int64), np.array([0.1]), np.array([1e300])):
        save_cache(tmp_path / "one", {"x": value})
        with pytest.raises(CacheFileError, match="with values (int32|float32) cannot hold"):
            load_cache(tmp_path / "one")
    save_cache(tmp_path / "fits", {"step": 5, "scale": 0.5, "ids": np.arange(3), "nan": np.array([np.nan, 2.0])})
    back = load_cache(tmp_path / "fits")
    assert int(back["step"]) == 5 and float(back["scale"]) == 0.5 and back["ids"].tolist() == [0, 1, 2]
    assert np.isnan(back["nan"][0]) and back["ids"].dtype == jnp.int32
    # A float64 cache whose values fit float32 loaded as float32 buffers under a cache that
    # still said float64 (its static dtype; review 77): refused, whole with x64.
    with jax.enable_x64(True):
        wide = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4, dtype=jnp.float64)
        save_cache(tmp_path / "f64", wide.update(jnp.ones((1, 1, 2, 2)), jnp.ones((1, 1, 2, 2)), 0)[0])
        assert load_cache(tmp_path / "f64").keys.dtype == jnp.float64
        # inside another tree too (review 82: only the top level's dtype was read)
        save_cache(tmp_path / "nested", {"cache": wide})
    for name in ("f64", "nested"):
        with pytest.raises(CacheFileError, match=r"holds a cache of float64 \(its static dtype\), and JAX holds "
                                                 r"64-bit arrays only with jax_enable_x64"):
            load_cache(tmp_path / name)


def test_orbax_sharded_restore_onto_other_meshes(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    result = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_a_paged_cache_with_numpy_bits_saves_and_bad_bits_are_refused(tmp_path):
    """PagedCache(bits=np.int64(8)) worked but could not be saved ("cannot describe the static
    metadata np.int64(8)"): bits is stored as a Python int. 8.0 and True were accepted / are
    refused, as QuantizedCache refuses them."""
    from jaxkv import PagedCache

    cache = PagedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=16, bits=np.int64(8))
    assert type(cache.bits) is int
    save_cache(tmp_path / "p.safetensors", cache)
    assert load_cache(tmp_path / "p.safetensors").bits == 8
    for bad in (8.0, True, 3):
        with pytest.raises(ValueError, match="bits must be None"):
            PagedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=16, bits=bad)


def test_files_saved_before_the_dynamic_cache_registration_changed_load_with_like():
    """Files written at ad26b2b (before DynamicCache registered itself with its own flatten):
    the new flatten gave None as the node's data where register_dataclass gave (), and
    load_cache(like=) called those files a mismatch (review 82). Keys arange(24), values + 1."""
    data = Path(__file__).parent / "data"
    k = jnp.arange(24.0).reshape(1, 2, 3, 4)
    dynamic = load_cache(data / "dynamic_ad26b2b.jaxkv", like=DynamicCache([(k, k), None]))
    np.testing.assert_array_equal(np.asarray(dynamic.layers[0][1]), np.asarray(k + 1))
    assert dynamic.layers[1] is None
    like = EncoderDecoderCache.create(DynamicCache([(k, k)]), CrossAttentionCache.from_layers([(k, k)]))
    encdec = load_cache(data / "encdec_ad26b2b.jaxkv", like=like)
    np.testing.assert_array_equal(np.asarray(encdec.cross_attention.keys[0]), np.asarray(k))

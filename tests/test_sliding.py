"""SlidingWindowCache: ring contents against a NumPy model of the whole token history,
attention against full attention with a band mask (chunks around and past the window),
rollback and its limits, the ring's write path (no copies, long chunks), the error paths
and Mistral parity.

The protocol every kind shares (random op programs against the NumPy model with NaN/inf
in unused slots, eager == jit, vmap, scan over layers, donation, traced bad row indices,
the crop rule, pickling) is tested once per kind in test_conformance.py."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import INVALID, CacheError
from jaxkv.attention import attend
from jaxkv.caches import NO_POSITION, SlidingWindowCache

L, B, H, D = 2, 2, 2, 3


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def make(window=4, extra=0, batch=B, layers=L, dtype=jnp.float32):
    return SlidingWindowCache.init(
        num_layers=layers, batch_size=batch, num_kv_heads=H, head_dim=D, window=window,
        extra_slots=extra, dtype=dtype,
    )


def rand(rng, batch, t, heads=H):
    return rng.standard_normal((batch, heads, t, D)).astype(np.float32)


# ----------------------------------------------------------------------- NumPy model


class SlidingReference:
    """Every token a row has seen (``history``) and the first position a ring of
    ``capacity`` slots still holds: writing position p evicts p - capacity."""

    def __init__(self, layers: int, batch: int, window: int, capacity: int):
        self.window, self.capacity = window, capacity
        self.history = [[[] for _ in range(batch)] for _ in range(layers)]
        self.start = [[0] * batch for _ in range(layers)]

    @property
    def batch(self):
        return len(self.history[0])

    def length(self, layer, row):
        return len(self.history[layer][row])

    def update(self, layer, keys, values, num_new=None):
        for b in range(self.batch):
            n = keys.shape[2] if num_new is None else int(num_new[b])
            for t in range(n):
                self.history[layer][b].append((keys[b, :, t].copy(), values[b, :, t].copy()))
            self.start[layer][b] = max(self.start[layer][b], self.length(layer, b) - self.capacity)


@jax.jit
def _snapshot(cache):
    positions = jnp.stack([cache.kv_positions(layer) for layer in range(cache.num_layers)])
    return cache.lengths, positions, cache.keys, cache.values


def assert_matches(cache: SlidingWindowCache, ref: SlidingReference) -> None:
    """Each held position sits in slot p % C with its exact token; all other slots are empty."""
    lengths, positions, keys, values = (np.asarray(x) for x in _snapshot(cache))
    capacity = keys.shape[3]
    for layer in range(len(ref.history)):
        for b in range(ref.batch):
            n = ref.length(layer, b)
            assert lengths[layer, b] == n, (layer, b)
            expected = np.full(capacity, NO_POSITION)
            for p in range(ref.start[layer][b], n):
                expected[p % capacity] = p
                k, v = ref.history[layer][b][p]
                np.testing.assert_array_equal(keys[layer, b, :, p % capacity], k)
                np.testing.assert_array_equal(values[layer, b, :, p % capacity], v)
            np.testing.assert_array_equal(positions[layer, b], expected, err_msg=f"layer {layer} row {b}")


def attend_view(q, positions, view):
    # attend() itself broadcasts [S] against [B, 1] (rank promotion), so allow it here.
    with jax.numpy_rank_promotion("allow"):
        return attend(q, view.keys, view.values, q_positions=positions, kv_lengths=view.kv_lengths,
                      kv_positions=view.kv_positions, sliding_window=view.sliding_window)


def band_attention(q, keys, values, q_pos, window):
    """NumPy full attention with a band mask: q [Hq, D] at position q_pos over the whole
    history keys/values [H, n, D]; sees positions q_pos - window + 1 .. q_pos."""
    heads, n, _ = keys.shape
    groups = q.shape[0] // heads
    visible = np.array([q_pos - window < p <= q_pos for p in range(n)])
    out = np.zeros_like(q)
    for i in range(q.shape[0]):
        logits = keys[i // groups] @ q[i] / np.sqrt(q.shape[1])
        logits = np.where(visible, logits, -np.inf)
        w = np.exp(logits - logits.max())
        out[i] = (w / w.sum()) @ values[i // groups]
    return out


# ------------------------------------------------------------------- attention parity


@jax.jit
def _attention_step(cache, q, k, v, num_new):
    positions = cache.positions(q.shape[2])
    cache, view = cache.update_view(k, v, 0, num_new=num_new)
    return cache, attend_view(q, positions, view)


def _stream_attention(window, extra, total, chunk, *, lag=1, crop_back=0, seed=0):
    """Feeds `total` tokens in chunks of `chunk` (row 1 starts `lag` tokens behind, via
    num_new), optionally rolls back `crop_back` tokens once the window is full, and checks
    every real query against band attention over the row's whole history."""
    rng = np.random.default_rng(seed)
    cache = make(window, extra)
    hist_k = [np.zeros((H, 0, D), np.float32) for _ in range(B)]
    hist_v = [np.zeros((H, 0, D), np.float32) for _ in range(B)]
    fed, cropped = 0, crop_back == 0
    while fed < total:
        t = min(chunk, total - fed)
        num_new = np.array([t, max(t - lag, 0) if fed == 0 else t], np.int32)
        q = rng.standard_normal((B, 2 * H, t, D)).astype(np.float32)
        k, v = rand(rng, B, t), rand(rng, B, t)
        positions = cache.positions(t)
        cache, out = _attention_step(cache, q, k, v, num_new)
        out = np.asarray(out)
        for b in range(B):
            hist_k[b] = np.concatenate([hist_k[b], k[b, :, : num_new[b]]], axis=1)
            hist_v[b] = np.concatenate([hist_v[b], v[b, :, : num_new[b]]], axis=1)
            for i in range(num_new[b]):
                p = int(positions[b, i])
                expected = band_attention(q[b, :, i], hist_k[b][:, : p + 1], hist_v[b][:, : p + 1], p, window)
                np.testing.assert_allclose(out[b, :, i], expected, rtol=2e-5, atol=2e-5,
                                           err_msg=f"W={window} C={window + extra} n={total} T={chunk} row {b} pos {p}")
        fed += t
        if not cropped and fed >= window + extra:
            cache = cache.crop(-crop_back)
            for b in range(B):
                keep = max(hist_k[b].shape[1] - crop_back, 0)
                hist_k[b], hist_v[b] = hist_k[b][:, :keep], hist_v[b][:, :keep]
            cropped = True


@pytest.mark.parametrize("window, extra", [(3, 0), (4, 0), (4, 2)])
def test_attention_equals_band_attention_around_the_window_edge(window, extra):
    for total in range(window - 1, window + 4):
        for chunk in range(1, window + 1):
            _stream_attention(window, extra, total, chunk, seed=total * 10 + chunk)


def test_prefill_longer_than_the_ring_then_decode():
    _stream_attention(4, 1, 14, 11)  # T > C: only the last C tokens are stored
    _stream_attention(3, 0, 9, 9)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_attention_after_rollback_equals_band_attention(chunk):
    _stream_attention(4, 2, 13, chunk, crop_back=3, lag=0)  # extra=2 allows 3 tokens back


def test_nan_in_empty_or_padding_entries_contributes_nothing():
    k = jnp.ones((B, H, 2, D))
    cache, _, _ = make(3, 0).update(k, k, 0)
    empty = (cache.kv_positions(0) == NO_POSITION)[None, :, None, :, None]
    ring = dataclasses.replace(  # slots that hold no token: NaN
        cache.stores[0], keys=jnp.where(empty, jnp.nan, cache.keys), values=jnp.where(empty, jnp.nan, cache.values)
    )
    poisoned = dataclasses.replace(cache, stores=(ring,))
    for t in (1, 3):  # the ring after the write, and ring-before + chunk
        bad = jnp.full((B, H, t, D), jnp.nan).at[:, :, 0].set(2.0)  # padding tokens: NaN
        q = jnp.ones((B, 2 * H, t, D))
        _, out = _attention_step(poisoned, q, bad, bad, jnp.ones((B,), jnp.int32))
        # Nothing of the empty slots and padding reaches the real token's output: band attention
        # over the row's three real tokens (two ones, then 2.0) at position 2 (finiteness alone
        # passed with empty slots made visible; review 72).
        history = np.concatenate([np.ones((H, 2, D), np.float32), np.full((H, 1, D), 2.0, np.float32)], axis=1)
        want = band_attention(np.ones((2 * H, D), np.float32), history, history, 2, 3)
        for b in range(B):
            np.testing.assert_allclose(np.asarray(out[b, :, 0]), want, rtol=1e-6, err_msg=str(t))


# ------------------------------------------------------ the ring under jit and scan


def filled(seed=0):
    rng = np.random.default_rng(seed)
    cache = make(4, 1)
    for layer in range(L):
        cache, _, _ = cache.update(rand(rng, B, 7), rand(rng, B, 7), layer, num_new=jnp.array([7, 3]))
    return cache


K2 = rand(np.random.default_rng(3), B, 2)
K6 = rand(np.random.default_rng(4), B, 6)


def test_long_chunk_view_eager_equals_jit():
    # A chunk longer than C - W + 1 is read from the ring before the write plus the chunk;
    # the conformance programs only write short chunks.
    cache = filled()
    fn = lambda c: c.update_view(K6, K6 + 1, 0, num_new=jnp.array([6, 4]))  # noqa: E731
    chex.assert_trees_all_equal(fn(cache), jax.jit(fn)(cache))


def test_donated_ring_write_has_no_ring_sized_copy():
    # (Donation, aliasing and the compile count: test_conformance.py.) The ring's own
    # write path (a scatter at p % C and the starts) must not copy the ring either.
    def step(cache, k):
        for layer in range(L):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    hlo = jax.jit(step, donate_argnums=0).lower(make(16, 0), jnp.ones((B, H, 1, D))).compile().as_text()
    buffer_shape = f"f32[{L},{B},{H},16,{D}]"
    assert buffer_shape in hlo
    assert not [line for line in hlo.splitlines() if " copy(" in line and buffer_shape in line]


def test_scan_decode_wraps_around_and_matches_model():
    steps = 11
    rng = np.random.default_rng(5)
    ks = rand(rng, B, steps)

    def body(cache, k):  # k: [B, H, D]
        for layer in range(L):
            cache, _, _ = cache.update(k[:, :, None], k[:, :, None] * (layer + 1), layer)
        return cache, cache.kv_positions(0)

    cache, positions = jax.lax.scan(body, make(4, 1), jnp.moveaxis(jnp.asarray(ks), 2, 0))
    ref = SlidingReference(L, B, 4, 5)
    for layer in range(L):
        ref.update(layer, ks, ks * (layer + 1))
    assert_matches(cache, ref)
    np.testing.assert_array_equal(positions[-1, 0], [10, 6, 7, 8, 9])


def test_bf16_cache_stays_bf16():
    cache = make(dtype=jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        cache, keys, values = jax.jit(lambda c: c.update(K6, K6, 0))(cache)
    assert cache.dtype == keys.dtype == values.dtype == jnp.bfloat16


# ------------------------------------------------------------------- errors and flags


def test_traced_bad_inputs_set_invalid_flag():
    cache = filled()
    out = jax.jit(lambda c: c.crop(-3))(cache)  # row 0 holds 2..6 (C=5): needs 1..3
    np.testing.assert_array_equal(out.seq_lengths(0), [4, 0])
    assert int(out.flags[0]) & INVALID and int(out.flags[1]) == 0
    with pytest.raises(CacheError, match=r"rows \[0\] .*crop that needed evicted tokens"):
        out.check()
    assert out.reset().check() is not None
    # (A traced bad row index: test_conformance.py, every kind.)
    bad_layer, _, _ = jax.jit(lambda c, i: c.update(K2, K2, i))(cache, jnp.int32(L))
    chex.assert_trees_all_equal(bad_layer.keys, cache.keys)
    assert (np.asarray(bad_layer.flags) & INVALID).all()
    bad_count, _, _ = jax.jit(lambda c, n: c.update(K2, K2, 0, num_new=n))(cache, jnp.array([1, 3]))
    np.testing.assert_array_equal(bad_count.seq_lengths(0), [8, 3])
    assert int(bad_count.flags[1]) & INVALID


def test_crop_to_empty_needs_no_evicted_position():
    """Dropping every token of a row (crop(-length)) is always possible, evicted tokens
    or not: eagerly, and under jit without the INVALID flag; the row then takes new tokens
    as an empty one does."""
    cache = filled()  # row 0 holds positions 2..6 of 7 (positions 0..1 were evicted)
    for out in (cache.crop(jnp.array([-7, -1])), jax.jit(lambda c: c.crop(jnp.array([-7, -1])))(cache)):
        np.testing.assert_array_equal(out.seq_lengths(0), [0, 2])
        assert not np.asarray(out.flags).any()
        out, _, _ = out.update(K2, K2, 0)
        np.testing.assert_array_equal(out.kv_positions(0)[0], [0, 1] + [NO_POSITION] * 3)
    np.testing.assert_array_equal(cache.crop(-(2**40)).seq_lengths(1), [0, 0])


def test_a_window_of_one_rolls_back_any_amount():
    """With W = 1 the next query sees only itself: no cached position is needed, so every
    rollback is legal (it was a ValueError eagerly and INVALID under jit), and the next
    token's attention is over that token alone."""
    cache = SlidingWindowCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, window=1)
    k = jnp.arange(12, dtype=jnp.float32).reshape(1, 1, 6, 2)
    cache, _, _ = cache.update(k, k, 0)  # holds position 5 only
    eager = cache.crop(-2)
    np.testing.assert_array_equal(eager.seq_lengths(0), [4])
    assert not np.asarray(eager.flags).any()

    @jax.jit
    def crop_then_step(cache):
        out = cache.crop(-2)
        new = jnp.full((1, 1, 1, 2), 7.0)
        out, view = out.write(new, -new, 0)
        got = attend(jnp.ones((1, 1, 1, 2)), view.keys, view.values, q_positions=jnp.array([[4]]),
                     kv_positions=view.kv_positions, kv_lengths=view.kv_lengths, sliding_window=1)
        return out, got

    out, got = crop_then_step(cache)
    assert not np.asarray(out.flags).any()
    np.testing.assert_allclose(np.asarray(got)[0, 0, 0], [-7.0, -7.0])
    np.testing.assert_array_equal(out.kv_positions(0)[0], [4])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: c.update(K2[0], K2[0], 0), ValueError, "rank 4"),
        (lambda c: c.update(K2, K2[:, :, :1], 0), ValueError, "same shape"),
        (lambda c: c.update(K2[:1], K2[:1], 0), ValueError, "batch=1 but the cache holds batch=2"),
        (lambda c: c.update(K2, K2, L), ValueError, "layer_idx 2 is out of range"),
        (lambda c: c.update(K2, K2, "0"), TypeError, "layer_idx must be an int"),
        (lambda c: c.update(K2.astype(np.int32), K2, 0), TypeError, "floating dtype"),
        (lambda c: c.update(K2, K2, 0, num_new=jnp.array([3, 0])), ValueError, r"num_new\[0\]=3 is outside \[0, 2\]"),
        (lambda c: c.update(K2, K2, 0, num_new=jnp.array([1.0, 1.0])), TypeError, "num_new must be"),
        (lambda c: c.crop(-3), ValueError, r"layer 0, row 0 holds positions 2..6; rolling back to 4 tokens needs positions 1..3"),
        (lambda c: c.crop(1.5), TypeError, "max_length must be an int"),
        (lambda c: c.crop(jnp.array([1, 2, 3])), ValueError, "needs 2 entries"),
        (lambda c: c.reorder_cache(jnp.array([0, 2])), ValueError, "row index 2"),
        (lambda c: c.reorder_cache(jnp.array([0])), ValueError, "one entry per row"),
        (lambda c: c.batch_select_indices(jnp.array([[0]])), ValueError, "1-D integer"),
        (lambda c: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c: c.reset(jnp.array([1, 0])), TypeError, "rows must be a bool array"),
        (lambda c: c[L], ValueError, "out of range"),
        (lambda c: c.kv_positions(-1), ValueError, "out of range"),
        (lambda c: make(window=0), ValueError, "window must be an int >= 1"),
        (lambda c: make(extra=-1), ValueError, "extra_slots must be an int >= 0"),
        (lambda c: make(dtype=jnp.int8), TypeError, "dtype must be floating"),
        # a bf16 prefill put into f32 rows was cast silently (StaticCache refused it)
        (lambda c: c.put_rows(jnp.array([1]), make(4, 1, batch=1, dtype=jnp.bfloat16)), TypeError,
         r"put_rows: the other cache has another dtype: bfloat16; this one has float32 \(RingStorage.keys"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(filled())


def test_protocol_and_memory_is_o_window():
    cache = filled()
    assert len(cache) == L and len(list(cache)) == L and cache.get_max_length() is None
    assert cache.get_seq_length(0) == 7 and cache.capacity == 5 and cache.window == 4
    assert cache[0][0].shape == (B, H, 5, D)
    assert not np.asarray(cache.overflowed).any()
    long = cache
    for _ in range(3):
        long, _, _ = long.update(K6, K6, 0)
    assert long.get_seq_length(0) == 25 and long.keys.shape == cache.keys.shape
    assert jax.tree.structure(long) == jax.tree.structure(make(4, 1))


# ------------------------------------------------------------- model integration (HF)


def hf_tiny(family_cls, config_cls, directory, **config):
    """A tiny random transformers model saved to `directory`, norms moved off ones."""
    import torch
    import transformers

    cfg = getattr(transformers, config_cls)(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None, **config,
    )
    torch.manual_seed(0)
    model = getattr(transformers, family_cls)(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


def greedy(model, ids, cache, steps):
    """Greedy tokens [B, steps] through `cache`: prefill, then one jitted step per token."""
    from flax import nnx

    @nnx.jit
    def step(model, tokens, cache):
        logits, cache = model(tokens, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    # The model code is not written for this file's strict promotion settings.
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        token, cache = step(model, jnp.asarray(ids, jnp.int32), cache)
        out = [token]
        for _ in range(steps - 1):
            token, cache = step(model, token[:, None], cache)
            out.append(token)
    return np.stack([np.asarray(t) for t in out], axis=1), cache


def hf_greedy(model, ids, steps):
    import torch

    # One torch thread: a tiny model gains nothing from more, and OpenMP's spinning
    # barriers beside XLA's threads on a busy machine made generate 100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model.generate(torch.tensor(ids), max_new_tokens=steps, do_sample=False).numpy()[:, ids.shape[1]:]
    finally:
        torch.set_num_threads(threads)


def test_mistral_sliding_window_greedy_tokens_equal_transformers(tmp_path):
    pytest.importorskip("transformers")
    from jaxkv.models import from_pretrained

    hf = hf_tiny("MistralForCausalLM", "MistralConfig", tmp_path, num_hidden_layers=2, sliding_window=8)
    loaded = from_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))  # prompt longer than the window
    cache = SlidingWindowCache.init(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=16, window=8)
    got, cache = greedy(loaded.model, ids, cache, 64)
    np.testing.assert_array_equal(got, hf_greedy(hf, ids, 64))
    assert cache.keys.shape[3] == 8 and cache.get_seq_length() == 12 + 63  # O(window) memory

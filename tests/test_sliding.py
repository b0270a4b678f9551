"""SlidingWindowCache: ring contents against a NumPy model of the whole token history,
attention against full attention with a band mask, rollback, jit / vmap / scan / donation,
and every error path."""

from __future__ import annotations
import dataclasses

import copy

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import INVALID, CacheError
from jaxkv.attention import attend
from jaxkv.caches import NO_POSITION, SlidingWindowCache
from reference import crop_target

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

    def crop_error(self, max_length):
        """(layer, row) of the first rollback that needs an evicted token, else None."""
        m = np.broadcast_to(np.asarray(max_length), (self.batch,))
        for layer in range(len(self.history)):
            for b in range(self.batch):
                target = crop_target(m[b], self.length(layer, b))
                if target < self.length(layer, b) and self.start[layer][b] > max(0, target - self.window + 1):
                    return layer, b
        return None

    def crop(self, max_length):
        m = np.broadcast_to(np.asarray(max_length), (self.batch,))
        for layer in range(len(self.history)):
            for b in range(self.batch):
                del self.history[layer][b][crop_target(m[b], self.length(layer, b)):]
                self.start[layer][b] = min(self.start[layer][b], self.length(layer, b))

    def select(self, indices):
        self.history = [[copy.deepcopy(layer[i]) for i in indices] for layer in self.history]
        self.start = [[layer[i] for i in indices] for layer in self.start]

    def repeat(self, r):
        self.history = [[copy.deepcopy(row) for row in layer for _ in range(r)] for layer in self.history]
        self.start = [[s for s in layer for _ in range(r)] for layer in self.start]

    def reset(self, rows=None):
        for layer in range(len(self.history)):
            for b in range(self.batch):
                if rows is None or rows[b]:
                    self.history[layer][b] = []
                    self.start[layer][b] = 0


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
        assert np.isfinite(np.asarray(out[:, :, 0])).all(), t


# -------------------------------------------------------------------- property test

WINDOW, EXTRA, MAX_BATCH = 3, 2, 4
# Each new (batch, T) shape compiles; a few chunk sizes cover T = 1, T < C and T > C.
CHUNKS = (1, 2, 3, 7)


# The program runs jitted (eager == jit is its own test); only a crop the model says must
# fail runs eagerly, to check its ValueError.
_update = jax.jit(lambda cache, k, v, num_new, layer: cache.update(k, v, layer, num_new=num_new)[0])
_crop = jax.jit(lambda cache, m: cache.crop(m))
_reorder = jax.jit(lambda cache, idx: cache.reorder_cache(idx))
_select = jax.jit(lambda cache, idx: cache.batch_select_indices(idx))
_repeat = jax.jit(lambda cache, r: cache.batch_repeat_interleave(r), static_argnums=1)
_reset = jax.jit(lambda cache, rows: cache.reset(rows))


@st.composite
def programs(draw):
    batch = draw(st.integers(1, 2))
    ops, b = [], batch
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["update"] * 4 + ["crop", "crop", "reorder", "select", "repeat", "reset"]))
        if kind == "update":
            t = draw(st.sampled_from(CHUNKS))
            ragged = draw(st.booleans())
            num_new = draw(st.lists(st.integers(0, t), min_size=b, max_size=b)) if ragged else None
            op = ("update", draw(st.integers(0, L - 1)), t, num_new)
        elif kind == "crop":
            if draw(st.booleans()):
                op = ("crop", draw(st.lists(st.integers(-4, 12), min_size=b, max_size=b)))
            else:
                op = ("crop", draw(st.integers(-4, 12)))
        elif kind == "reorder":
            op = ("reorder", draw(st.permutations(range(b))))
        elif kind == "select":
            op = ("select", draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b)))
            b = len(op[1])
        elif kind == "repeat":
            op = ("repeat", draw(st.integers(1, max(1, MAX_BATCH // b))))
            b *= op[1]
        else:
            op = ("reset", draw(st.none() | st.lists(st.booleans(), min_size=b, max_size=b)))
        ops.append(op)
    return batch, ops, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_match_numpy_model(program):
    batch, ops, seed = program
    rng = np.random.default_rng(seed)
    cache = make(WINDOW, EXTRA, batch=batch)
    ref = SlidingReference(L, batch, WINDOW, WINDOW + EXTRA)
    for op in ops:
        if op[0] == "update":
            _, layer, t, num_new = op
            k, v = rand(rng, ref.batch, t), rand(rng, ref.batch, t)
            counts = jnp.full((ref.batch,), t, jnp.int32) if num_new is None else jnp.array(num_new, jnp.int32)
            cache = _update(cache, k, v, counts, jnp.int32(layer))
            ref.update(layer, k, v, num_new)
        elif op[0] == "crop":
            arg = op[1] if isinstance(op[1], int) else jnp.array(op[1], jnp.int32)
            bad = ref.crop_error(op[1])
            if bad is not None:
                with pytest.raises(ValueError, match=rf"layer {bad[0]}, row {bad[1]} holds positions .* evicted"):
                    cache.crop(arg)
                continue
            cache = _crop(cache, jnp.asarray(arg, jnp.int32))
            ref.crop(op[1])
        elif op[0] in ("reorder", "select"):
            cache = (_reorder if op[0] == "reorder" else _select)(cache, jnp.array(op[1], jnp.int32))
            ref.select(op[1])
        elif op[0] == "repeat":
            cache = _repeat(cache, op[1])
            ref.repeat(op[1])
        else:
            cache = _reset(cache, jnp.ones((ref.batch,), bool) if op[1] is None else jnp.array(op[1]))
            ref.reset(op[1])
        assert_matches(cache, ref)
    assert not np.asarray(cache.flags).any()


# ------------------------------------------------------------- jit, vmap, scan, donation


def filled(seed=0):
    rng = np.random.default_rng(seed)
    cache = make(4, 1)
    for layer in range(L):
        cache, _, _ = cache.update(rand(rng, B, 7), rand(rng, B, 7), layer, num_new=jnp.array([7, 3]))
    return cache


K2 = rand(np.random.default_rng(3), B, 2)
K6 = rand(np.random.default_rng(4), B, 6)


def _all_ops(cache):
    return dict(
        update=cache.update_view(K2, K2 + 1, 1, num_new=jnp.array([2, 1])),
        update_long=cache.update_view(K6, K6, 0),
        crop=cache.crop(-1),
        crop_rows=cache.crop(jnp.array([6, 2])),
        reorder=cache.reorder_cache(jnp.array([1, 0])),
        select=cache.batch_select_indices(jnp.array([1])),
        repeat=cache.batch_repeat_interleave(3),
        reset=cache.reset(),
        reset_rows=cache.reset(jnp.array([True, False])),
        positions=cache.positions(3, 1),
        kv_positions=cache.kv_positions(0),
        seq_lengths=cache.seq_lengths(1),
    )


def test_every_op_eager_equals_jit():
    cache = filled()
    chex.assert_trees_all_equal(_all_ops(cache), jax.jit(_all_ops)(cache))


def test_vmap_over_stacked_caches_equals_python_loop():
    caches = [filled(seed) for seed in range(3)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)

    def step(cache):
        cache, view = cache.update_view(K2, K2, 0, num_new=jnp.array([2, 1]))
        return cache.reorder_cache(jnp.array([1, 0])).crop(-1), view

    batched = jax.jit(jax.vmap(step))(stacked)
    for i, cache in enumerate(caches):
        chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], batched), jax.jit(step)(cache))


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


def test_scan_over_stacked_layers_equals_unrolled():
    def unrolled(cache):
        for layer in range(L):
            cache, _, _ = cache.update(K2 * layer, K2, layer)
        return cache

    def scanned(cache):
        def body(cache, layer):
            cache, _, _ = cache.update(K2 * layer.astype(jnp.float32), K2, layer)
            return cache, None

        return jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))[0]

    chex.assert_trees_all_equal(jax.jit(unrolled)(filled()), jax.jit(scanned)(filled()))


def test_donated_decode_step_writes_in_place_and_compiles_once():
    traces = []

    def step(cache, k):
        traces.append(1)
        for layer in range(L):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    jitted = jax.jit(step, donate_argnums=0)
    cache = make(16, 0)
    k = jnp.ones((B, H, 1, D))
    pointer = cache.keys.unsafe_buffer_pointer()
    for _ in range(40):
        old = cache
        cache = jitted(cache, k)
        assert old.keys.is_deleted()
    assert cache.keys.unsafe_buffer_pointer() == pointer
    assert len(traces) == 1
    np.testing.assert_array_equal(cache.seq_lengths(1), [40, 40])
    hlo = jitted.lower(cache, k).compile().as_text()
    buffer_shape = f"f32[{L},{B},{H},16,{D}]"
    assert not [line for line in hlo.splitlines() if " copy(" in line and buffer_shape in line]


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
    bad_row = jax.jit(lambda c, i: c.reorder_cache(i))(cache, jnp.array([0, 9]))
    assert int(bad_row.flags[1]) & INVALID and bad_row.seq_lengths(0).tolist() == [7, 0]
    bad_layer, _, _ = jax.jit(lambda c, i: c.update(K2, K2, i))(cache, jnp.int32(L))
    chex.assert_trees_all_equal(bad_layer.keys, cache.keys)
    assert (np.asarray(bad_layer.flags) & INVALID).all()
    bad_count, _, _ = jax.jit(lambda c, n: c.update(K2, K2, 0, num_new=n))(cache, jnp.array([1, 3]))
    np.testing.assert_array_equal(bad_count.seq_lengths(0), [8, 3])
    assert int(bad_count.flags[1]) & INVALID


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

    with torch.no_grad():
        return model.generate(torch.tensor(ids), max_new_tokens=steps, do_sample=False).numpy()[:, ids.shape[1]:]


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

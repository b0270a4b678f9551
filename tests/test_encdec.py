"""EncoderDecoderCache on a tiny encoder–decoder model: cached decoding (prefill, decode,
beam reorder, fan-out, rollback, per-row restart) gives the logits of a NumPy forward pass
over the whole sequence; cross attention under vmap; row ops on both parts; error paths.

The protocol every kind shares (random op programs against the NumPy model with NaN/inf
in unused slots, eager == jit, vmap, scan over layers, donation, traced bad row indices,
the crop rule, pickling) is tested once per kind in test_conformance.py (a static self
part)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheError, DynamicCache, StaticCache
from jaxkv.attention import attend
from jaxkv.caches import CrossAttentionCache, EncoderDecoderCache
from jaxkv.caches import LayerView

LAYERS, MODEL, HQ, HKV, HD, VOCAB, ENC, CAP = 2, 8, 4, 2, 4, 13, 6, 16


@pytest.fixture(autouse=True)
def strict_promotion():
    # attend() broadcasts [S] with [B, 1] internally, so rank promotion stays allowed here.
    with jax.numpy_dtype_promotion("strict"):
        yield


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)  # noqa: E731
    layer = lambda: dict(  # noqa: E731
        wq=w(MODEL, HQ * HD), wk=w(MODEL, HKV * HD), wv=w(MODEL, HKV * HD), wo=w(HQ * HD, MODEL),
        cq=w(MODEL, HQ * HD), ck=w(MODEL, HKV * HD), cv=w(MODEL, HKV * HD), co=w(HQ * HD, MODEL),
    )
    return dict(embed=w(VOCAB, MODEL) * 3, enc=w(MODEL, MODEL), layers=[layer() for _ in range(LAYERS)])


PARAMS = make_params()


def encode(src):  # [B, E, MODEL] -> [B, E, MODEL]
    return np.tanh(src @ PARAMS["enc"])


def heads(x, w, n):  # [B, T, MODEL] -> [B, n, T, HD]
    return (x @ w).reshape(x.shape[0], x.shape[1], n, HD).transpose(0, 2, 1, 3)


def embed(tokens, positions):
    freqs = np.arange(MODEL, dtype=np.float32) / MODEL + 0.1
    return PARAMS["embed"][tokens] + np.sin(np.asarray(positions, np.float32)[..., None] * freqs)


# ------------------------------------------------------------------ NumPy reference


def np_attention(q, k, v, visible):
    """q [Hq, T, D], k/v [H, S, D], visible [T, S] -> [Hq, T, D] (GQA)."""
    groups = q.shape[0] // k.shape[0]
    out = np.zeros_like(q)
    for i in range(q.shape[0]):
        logits = q[i] @ k[i // groups].T / np.sqrt(HD)
        logits = np.where(visible, logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out[i] = (p / p.sum(-1, keepdims=True)) @ v[i // groups]
    return out


def np_forward(src, src_len, tokens):
    """Logits [B, T, V] of the whole decoder sequence, no cache."""
    enc = encode(src)
    batch, t = tokens.shape
    x = embed(tokens, np.broadcast_to(np.arange(t), (batch, t)))
    causal = np.tril(np.ones((t, t), bool))
    for p in PARAMS["layers"]:
        q, k, v = heads(x, p["wq"], HQ), heads(x, p["wk"], HKV), heads(x, p["wv"], HKV)
        self_out = np.stack([np_attention(q[b], k[b], v[b], causal) for b in range(batch)])
        x = x + self_out.transpose(0, 2, 1, 3).reshape(batch, t, -1) @ p["wo"]
        cq, ck, cv = heads(x, p["cq"], HQ), heads(enc, p["ck"], HKV), heads(enc, p["cv"], HKV)
        cross = np.stack([
            np_attention(cq[b, :, :, :], ck[b, :, : src_len[b]], cv[b, :, : src_len[b]], np.ones((t, src_len[b]), bool))
            for b in range(batch)
        ])
        x = x + cross.transpose(0, 2, 1, 3).reshape(batch, t, -1) @ p["co"]
    return x @ PARAMS["embed"].T


# ------------------------------------------------------------------ cached decoder


def cross_layers(src):
    enc = encode(src)
    return [(heads(enc, p["ck"], HKV), heads(enc, p["cv"], HKV)) for p in PARAMS["layers"]]


def decode(cache, tokens):
    """One cached forward over new tokens [B, T]: (logits [B, T, V], cache)."""
    batch, t = tokens.shape
    positions = cache.positions(t)
    x = jnp.asarray(PARAMS["embed"])[tokens] + jnp.sin(
        positions.astype(jnp.float32)[..., None] * (jnp.arange(MODEL, dtype=jnp.float32) / MODEL + 0.1)
    )
    for layer, p in enumerate(PARAMS["layers"]):
        q, k, v = (heads(x, p[n], h) for n, h in (("wq", HQ), ("wk", HKV), ("wv", HKV)))
        cache, view = cache.update_view(k, v, layer)
        out = attend(q, view.keys, view.values, q_positions=positions, kv_lengths=view.kv_lengths,
                     kv_positions=view.kv_positions)
        x = x + out.transpose(0, 2, 1, 3).reshape(batch, t, -1) @ p["wo"]
        cross = cache.cross_view(layer)
        out = attend(heads(x, p["cq"], HQ), cross.keys, cross.values, q_positions=positions,
                     kv_lengths=cross.kv_lengths, kv_positions=cross.kv_positions)
        x = x + out.transpose(0, 2, 1, 3).reshape(batch, t, -1) @ p["co"]
    return x @ jnp.asarray(PARAMS["embed"]).T, cache


decode_jit = jax.jit(decode, donate_argnums=0)
decode_kept = jax.jit(decode)  # for caches used again after the step


def sources(batch=2, seed=1):
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((batch, ENC, MODEL)).astype(np.float32)
    src_len = np.array([ENC, 4, 2, 5][:batch])
    return src, src_len


def new_cache(src, src_len, self_attention=None):
    layers = cross_layers(src)
    for b, n in enumerate(src_len):  # encoder padding holds garbage: it must never be read
        for k, v in layers:
            k[b, :, n:], v[b, :, n:] = np.nan, np.nan
    if self_attention is None:
        self_attention = StaticCache.init(
            num_layers=LAYERS, batch_size=src.shape[0], num_kv_heads=HKV, head_dim=HD, max_length=CAP
        )
    return EncoderDecoderCache.create(self_attention, CrossAttentionCache.from_layers(layers, jnp.asarray(src_len)))


def run(cache, tokens, chunks, step=decode_jit):
    """Feeds tokens [B, N] in chunks; returns (logits [B, N, V], cache)."""
    outs, start = [], 0
    for c in chunks:
        logits, cache = step(cache, jnp.asarray(tokens[:, start : start + c]))
        outs.append(np.asarray(logits))
        start += c
    return np.concatenate(outs, axis=1), cache


TOKENS = np.random.default_rng(2).integers(0, VOCAB, (2, 9))


def test_prefill_and_decode_match_full_forward_despite_nan_padding():
    src, src_len = sources()
    # Its own jitted step over a new function: decode_jit is shared with the other tests of
    # this module, which (in whatever order the workers take them) compile it for their own
    # chunk sizes, and jax.jit(decode, donate_argnums=0) would share that same cache too (JAX
    # keys its compiled-program cache on the function and the jit arguments, not on the jit
    # object: CI counted 5 and 7 that way).
    def own_decode(cache, tokens):
        return decode(cache, tokens)

    step = jax.jit(own_decode, donate_argnums=0)
    logits, cache = run(new_cache(src, src_len), TOKENS, [3, 1, 1, 1, 2, 1], step=step)
    np.testing.assert_allclose(logits, np_forward(src, src_len, TOKENS), rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 9 and cache.encoder_lengths().tolist() == [6, 4]
    assert step._cache_size() == 3  # one compilation per chunk size (3, 1, 2): no retrace


def test_dynamic_self_attention_part():
    src, src_len = sources()
    logits, cache = run(new_cache(src, src_len, DynamicCache(num_layers=LAYERS)), TOKENS, [4, 1, 1], step=decode_kept)
    np.testing.assert_allclose(logits, np_forward(src, src_len, TOKENS[:, :6]), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="cannot reset single rows"):
        cache.reset(jnp.array([True, False]))
    with pytest.raises(ValueError, match="num_new needs per-row lengths"):
        cache.update(jnp.ones((2, HKV, 1, HD)), jnp.ones((2, HKV, 1, HD)), 0, num_new=jnp.array([1, 1]))


def test_beam_reorder_and_fan_out_move_both_parts():
    src, src_len = sources()
    _, cache = run(new_cache(src, src_len), TOKENS[:, :4], [4])
    swapped = cache.reorder_cache(jnp.array([1, 0]))
    logits, _ = run(swapped, TOKENS[::-1, 4:], [1, 1])
    expected = np_forward(src[::-1], src_len[::-1], np.concatenate([TOKENS[::-1, :4], TOKENS[::-1, 4:6]], 1))
    np.testing.assert_allclose(logits, expected[:, 4:], rtol=1e-5, atol=1e-5)
    # a beam step's index repeats rows (and [1, 0] is its own inverse: a gather/scatter mix-up
    # would pass it); both parts must follow
    both = np.array([1, 1])
    logits, _ = run(cache.reorder_cache(jnp.asarray(both)), TOKENS[both, 4:], [1, 1])
    expected = np_forward(src[both], src_len[both], np.concatenate([TOKENS[both, :4], TOKENS[both, 4:6]], 1))
    np.testing.assert_allclose(logits, expected[:, 4:], rtol=1e-5, atol=1e-5)
    fanned = cache.batch_repeat_interleave(2)  # rows a, a, b, b; each continues differently
    more = np.random.default_rng(3).integers(0, VOCAB, (4, 2))
    logits, _ = run(fanned, more, [2])
    rep = np.array([0, 0, 1, 1])
    expected = np_forward(src[rep], src_len[rep], np.concatenate([TOKENS[rep, :4], more], 1))
    np.testing.assert_allclose(logits, expected[:, 4:], rtol=1e-5, atol=1e-5)
    one = cache.batch_select_indices(jnp.array([1]))
    assert one.batch_size == 1 and one.encoder_lengths().tolist() == [4]


def test_crop_rolls_back_self_attention_only():
    src, src_len = sources()
    _, cache = run(new_cache(src, src_len), TOKENS[:, :6], [6])
    cropped = cache.crop(-2)
    assert cropped.cross_attention is cache.cross_attention
    assert cropped.get_seq_length() == 4
    other = (TOKENS[:, 4:7] + 1) % VOCAB
    logits, _ = run(cropped, other, [3])
    expected = np_forward(src, src_len, np.concatenate([TOKENS[:, :4], other], 1))
    np.testing.assert_allclose(logits, expected[:, 4:], rtol=1e-5, atol=1e-5)


def test_reset_row_and_new_source_restart_one_row():
    src, src_len = sources()
    _, cache = run(new_cache(src, src_len), TOKENS[:, :5], [5])
    new_src, new_len = sources(seed=7)
    restarted = cache.reset(jnp.array([False, True])).set_cross_attention(
        cross_layers(new_src), jnp.asarray(new_len), rows=jnp.array([False, True])
    )
    assert restarted.seq_lengths(0).tolist() == [5, 0]
    # Row 0 continues its sequence; row 1 starts a new one (ragged: num_new).
    logits, restarted = decode_kept(restarted, jnp.asarray(TOKENS[:, 5:6]))
    np.testing.assert_allclose(logits[0], np_forward(src[:1], src_len[:1], TOKENS[:1, :6])[0, 5:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        logits[1], np_forward(new_src[1:], new_len[1:], TOKENS[1:, 5:6])[0], rtol=1e-5, atol=1e-5
    )
    empty = cache.reset()
    assert empty.get_seq_length() == 0 and empty.encoder_lengths().tolist() == [0, 0]


def test_vmap_of_a_decode_step_with_cross_attention_equals_a_loop():
    # (Eager == jit and vmap of the row ops: test_conformance.py; its programs never read
    # the cross-attention part.)
    src, src_len = sources()
    _, cache = run(new_cache(src, src_len), TOKENS[:, :3], [3])
    caches = [cache, cache.reorder_cache(jnp.array([1, 0]))]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    token = jnp.asarray(TOKENS[:, 3:4])
    batched = jax.jit(jax.vmap(lambda c: decode(c, token)))(stacked)
    for i, c in enumerate(caches):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], batched), decode_kept(c, token), rtol=1e-6, atol=1e-6)


def test_traced_bad_row_flags_both_parts():
    src, src_len = sources()
    cache = new_cache(src, src_len)
    out = jax.jit(lambda c, i: c.reorder_cache(i))(cache, jnp.array([0, 5]))
    assert out.encoder_lengths().tolist() == [6, 0] and int(out.flags[1]) != 0
    with pytest.raises(CacheError, match=r"rows \[1\]"):
        out.check()
    # A traced out-of-range layer's cross view reads as empty, never as another layer (clamped).
    for bad in (LAYERS, -1):
        lengths = jax.jit(lambda c, i: c.cross_view(i).kv_lengths)(cache, jnp.int32(bad))
        assert lengths.tolist() == [0, 0], (bad, lengths)


def test_flax_restore_into_an_unseeded_dynamic_target():
    """DynamicCache(num_layers=L) is the natural target of a saved DynamicCache (alone or as
    the self part): its layers have no arrays yet, and the saved ones were dropped silently."""
    from flax import serialization

    import jaxkv.nnx  # noqa: F401  (registers the kinds with flax)

    k = jnp.arange(2 * HKV * 5 * HD, dtype=jnp.float32).reshape(2, HKV, 5, HD)
    saved = DynamicCache.from_legacy_cache([(k, k + 1)] * LAYERS)
    back = serialization.from_bytes(DynamicCache(num_layers=LAYERS), serialization.to_bytes(saved))
    chex.assert_trees_all_equal(back, saved)
    cross = CrossAttentionCache.from_layers(_pair())
    whole = EncoderDecoderCache.create(saved, cross)
    for target in (DynamicCache(num_layers=LAYERS), DynamicCache.from_legacy_cache([(k[:, :, :2], k[:, :, :2])] * LAYERS)):
        back = serialization.from_bytes(EncoderDecoderCache.create(target, cross), serialization.to_bytes(whole))
        assert back.get_seq_length() == 5
        chex.assert_trees_all_equal(back.self_attention, saved)
    with pytest.raises(ValueError, match="has arrays the target has no place for"):  # fewer layers than saved
        serialization.from_bytes(DynamicCache(num_layers=1), serialization.to_bytes(saved))


def test_the_transformers_constructor_form_is_refused_not_read_as_causal_attention():
    """EncoderDecoderCache(DynamicCache(...), DynamicCache(...)), transformers' way, was taken
    unchecked: the cross part was read as a self-attention layer, slot s at position s under a
    causal mask, so the first decoder token saw encoder token 0 only (review 78). A rebuilt
    tree (jit, tree.map with other leaves) keeps passing through the same constructor."""
    cross = DynamicCache.from_legacy_cache(_pair())
    with pytest.raises(TypeError, match=r"cross_attention must be a CrossAttentionCache, got a DynamicCache \(the "
                                        r"transformers form .*CrossAttentionCache.from_layers\(cross_cache"):
        EncoderDecoderCache(DynamicCache(num_layers=LAYERS), cross)
    src, src_len = sources()
    cache = new_cache(src, src_len)
    assert jax.jit(lambda c: c)(cache).cross_attention.keys.shape == cache.cross_attention.keys.shape
    assert jax.tree.map(lambda x: None, cache).cross_attention.keys is None
    # JAX prefix trees and is_leaf maps build the node with other leaves (review 82 found the
    # first check refusing them): vmap over the self part only, the cross part broadcast.
    axes = EncoderDecoderCache(0, None)
    lengths = jax.vmap(lambda c: c.self_attention.lengths.sum(), in_axes=(axes,))(
        EncoderDecoderCache(jax.tree.map(lambda x: jnp.stack([x, x]), cache.self_attention), cache.cross_attention))
    assert lengths.shape == (2,)
    parts = jax.tree.map(lambda part: type(part).__name__, cache, is_leaf=lambda x: x is not cache)
    assert parts.cross_attention == "CrossAttentionCache"


def _pair(batch=2, enc=ENC):
    k = jnp.ones((batch, HKV, enc, HD))
    return [(k, k)] * LAYERS


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: CrossAttentionCache.from_layers([]), ValueError, "at least one"),
        (lambda c: CrossAttentionCache.from_layers(_pair(), jnp.array([7, 1])), ValueError, r"lengths\[0\]=7 is outside \[0, 6\]"),
        (lambda c: CrossAttentionCache.from_layers(_pair(), jnp.array([1.0, 2.0])), TypeError, "lengths must be an int array"),
        # int64 lengths are checked in their own dtype: 2**32 + 2 is not 2.
        (lambda c: CrossAttentionCache.from_layers(_pair(), np.array([2**32 + 2, 1])), ValueError, r"lengths\[0\]=4294967298 is outside"),
        (lambda c: CrossAttentionCache.from_layers([_pair()[0], _pair(enc=3)[0]]), ValueError, "layer 1 has shape"),
        (lambda c: EncoderDecoderCache.create(c.self_attention, CrossAttentionCache.from_layers(_pair()[:1])), ValueError, "2 layers, the cross-attention cache 1"),
        (lambda c: EncoderDecoderCache.create(c.self_attention, CrossAttentionCache.from_layers(_pair(batch=3))), ValueError, "batch=2, the cross-attention cache batch=3"),
        (lambda c: EncoderDecoderCache.create(c.self_attention, _pair()), TypeError, "must be a CrossAttentionCache"),
        (lambda c: c.set_cross_attention(_pair(enc=3)), ValueError, "Build a new cache"),
        (lambda c: c.reorder_cache(jnp.array([0])), ValueError, "EncoderDecoderCache.reorder_cache: beam_idx"),
        (lambda c: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c: c.reset(jnp.array([0, 1])), TypeError, "rows must be a bool array"),
        (lambda c: c.cross_view(2), ValueError, "layer_idx 2 is out of range"),
        (lambda c: c[5], ValueError, "out of range"),
    ],
)
def test_bad_input(call, exc, match):
    src, src_len = sources()
    with pytest.raises(exc, match=match):
        call(new_cache(src, src_len))


def test_protocol():
    src, src_len = sources()
    cache = new_cache(src, src_len)
    assert len(cache) == LAYERS and cache.get_max_length() == CAP
    sk, sv, ck, cv = cache[1]
    assert sk.shape == (2, HKV, CAP, HD) and ck.shape == (2, HKV, ENC, HD)
    assert len(list(cache)) == LAYERS
    assert isinstance(cache.cross_view(0), LayerView)


def test_cross_views_zero_their_padding_and_an_integer_dtype_is_refused():
    """LayerView promises zeros where no token is: the cross view handed back NaN padding, so
    a user's masked softmax @ values gave NaN (from_layers now stores the padding as zero). from_layers(dtype=int32) truncated the states
    (0.7 -> 0) where every other kind refuses an integer dtype."""
    keys = jnp.full((1, 1, 4, 2), 0.7)
    values = jnp.ones((1, 1, 4, 2)).at[:, :, 2:].set(jnp.nan)
    cross = CrossAttentionCache.from_layers([(keys, values)], jnp.array([2]))
    view = cross.view(0)
    assert np.asarray(view.values)[0, 0, 2:].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    probs = jnp.where(jnp.arange(4) < 2, 0.5, 0.0)  # masked softmax of one query
    np.testing.assert_array_equal(np.asarray(probs @ view.values[0, 0]), [1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(view.values)[0, 0, :2], np.ones((2, 2)))
    with pytest.raises(TypeError, match="dtype must be floating"):
        CrossAttentionCache.from_layers([(keys, values)], dtype=jnp.int32)


def test_empty_entries_read_as_zero_after_reset_and_for_a_bad_traced_ring_layer():
    """LayerView promises zeros where no token is: a reset cross row kept the old encoder
    states (length 0), and a ring write with a traced layer outside [0, L) returned another
    layer's values with length 0 (review 59). Attention was right (lengths mask them); a
    user's own dense read was not."""
    import jax

    from jaxkv import SlidingWindowCache

    cross = CrossAttentionCache.from_layers([(jnp.ones((2, 1, 4, 2)), jnp.full((2, 1, 4, 2), 7.0))])
    cache = EncoderDecoderCache.create(
        StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=2, max_length=8), cross)
    view = cache.reset(jnp.asarray([True, False])).cross_view(0)
    assert view.kv_lengths.tolist() == [0, 4]
    np.testing.assert_array_equal(np.asarray(view.values[0]), 0)
    np.testing.assert_array_equal(np.asarray(view.values[1]), 7)
    np.testing.assert_array_equal(np.asarray(cache.reset().cross_view(0).keys), 0)
    reordered = jax.jit(lambda c, i: c.reorder_cache(i))(cache, jnp.asarray([1, 5]))  # 5: a bad traced row
    np.testing.assert_array_equal(np.asarray(reordered.cross_view(0).values[1]), 0)

    ring = SlidingWindowCache.init(num_layers=2, batch_size=1, num_kv_heads=1, head_dim=2, window=4)
    x = jnp.full((1, 1, 3, 2), 5.0)
    for layer in (0, 1):
        ring = ring.update(x, x, layer)[0]
    _, bad = jax.jit(lambda c, layer: c.update_view(x, x, layer))(ring, jnp.int32(2))
    assert bad.kv_lengths.tolist() == [0]
    np.testing.assert_array_equal(np.asarray(bad.keys), 0)
    np.testing.assert_array_equal(np.asarray(bad.values), 0)

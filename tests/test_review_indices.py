"""Review: indices, counts and sizes wider than int32 (or of the wrong kind) are refused or
flagged, never wrapped, truncated or clamped onto valid data (README "Overflow policy")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.caches import (
    INVALID,
    CrossAttentionCache,
    EncoderDecoderCache,
    HybridCache,
    QuantizedCache,
    SlidingWindowCache,
    StaticCache,
    dequantize,
    quantize,
)

_KW = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2)
_WIDE = np.int64(2**32 + 1)


def test_positions_refuses_num_tokens_past_int32():
    # int32 positions cannot hold 2**32 + 1 tokens; eval_shape: the old code built the
    # [B, 2**32 + 1] shape (and eagerly tried to allocate it) instead of refusing.
    cache = StaticCache.init(**_KW, max_length=4)
    for n in (_WIDE, 2**31):
        with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
            jax.eval_shape(lambda n=n: cache.positions(n))
    assert cache.positions(np.int64(2)).tolist() == [[0, 1]]


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: StaticCache.init(**_KW, max_length=_WIDE), "max_length"),
        (lambda: StaticCache.init(**_KW, max_length=2**31), "max_length"),
        (lambda: SlidingWindowCache.init(**_KW, window=_WIDE), "window"),
        (lambda: SlidingWindowCache.init(**_KW, window=2, extra_slots=np.int64(2**32)), "extra_slots"),
        (lambda: SlidingWindowCache.init(**_KW, window=2**31 - 1, extra_slots=1), "extra_slots"),
        (lambda: HybridCache.init(layer_types=["sliding_attention"], batch_size=1, num_kv_heads=1, head_dim=2,
                                  max_length=4, window=2, extra_slots=np.int64(2**32)), "extra_slots"),
        (lambda: QuantizedCache.init(**_KW, max_length=4, residual_length=np.int64(2**32)), "residual_length"),
    ],
)
def test_sizes_past_int32_refused(make, name):
    # Lengths, ring slots and positions are int32: a size past that range would wrap them.
    # eval_shape: the old code accepted these without allocating anything here.
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        jax.eval_shape(make)


def test_quantized_bits_must_be_an_int():
    for bits in (8.0, np.float32(4.0), True):
        with pytest.raises(ValueError, match="bits must be 8 or 4"):
            QuantizedCache.init(**_KW, max_length=4, bits=bits)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(jnp.ones((1, 2)), bits=8.0)
    q, s = quantize(jnp.ones((1, 2)), bits=4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        dequantize(q, s, bits=4.0)
    assert QuantizedCache.init(**_KW, max_length=4, bits=np.int64(4)).bits == 4


def test_cross_lengths_traced_out_of_range_flagged_not_clamped():
    # Under jit an out-of-range encoder length used to be clipped to [0, E] silently (the
    # row then attended its padding); it now empties the row and flags it INVALID.
    k = jnp.ones((3, 1, 2, 2))

    @jax.jit
    def build(lengths):
        return CrossAttentionCache.from_layers([(k, k)], lengths)

    cross = build(np.array([2**32 - 1, 1, 2], np.uint32))
    assert cross.lengths.tolist() == [0, 1, 2]
    assert cross.flags.tolist() == [INVALID, 0, 0]
    with jax.enable_x64(True):
        wide = build(np.array([2, -1, 2**32 + 1], np.int64))
    assert wide.lengths.tolist() == [2, 0, 0]
    assert wide.flags.tolist() == [0, INVALID, INVALID]

    # set_cross_attention(rows=...) keeps the new rows' flags (it used to zero them).
    cache = EncoderDecoderCache.create(StaticCache.init(num_layers=1, batch_size=3, num_kv_heads=1, head_dim=2,
                                                        max_length=4), CrossAttentionCache.from_layers([(k, k)]))
    cache = jax.jit(lambda c, n: c.set_cross_attention([(k, k)], n, rows=jnp.array([True, False, True])))(
        cache, np.array([2**32 - 1, 2**32 - 1, 1], np.uint32))
    assert cache.encoder_lengths().tolist() == [0, 2, 1]
    assert cache.flags.tolist() == [INVALID, 0, 0]
    with pytest.raises(Exception, match="out-of-range"):
        cache.check()


def test_narrow_integer_dtypes_are_range_tested_whole_under_jit():
    """JAX converts a Python bound to a narrow array's own dtype, wrapping it (uint8 < 256 is
    uint8 < 0): under jit, uint8 row indices on 256 rows emptied and flagged every row, int8
    counts of a 128-token chunk were refused, a uint8 encoder length of 200 of 256 was flagged,
    a paged row 5 of 256 taken as padding (its write lost, its page leaked), uint8 prompt
    lengths became NaN rows, and uint8 ids of a 256-token vocabulary embedded as NaN (review
    77). Each now equals the int32 call (eager calls were always right: NumPy checks them)."""
    from flax import nnx

    from jaxkv import PagedCache
    from jaxkv.generation import check_prompts
    from jaxkv.models import Llama, LlamaConfig

    rows = 256
    cache = StaticCache.init(num_layers=1, batch_size=rows, num_kv_heads=1, head_dim=1, max_length=2)
    keys = jnp.arange(rows, dtype=jnp.float32).reshape(rows, 1, 1, 1)
    cache = cache.update(keys, keys, 0)[0]
    back = jax.jit(lambda c, i: c.reorder_cache(i))(cache, jnp.arange(rows - 1, -1, -1).astype(jnp.uint8))
    assert back.keys[0, :, 0, 0, 0].tolist() == list(range(rows - 1, -1, -1)) and not back.flags.any()

    chunk = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=1, max_length=128)
    states = jnp.ones((2, 1, 128, 1))
    wrote = jax.jit(lambda c, n: c.update(states, states, 0, num_new=n)[0])(chunk, jnp.array([100, 5], jnp.int8))
    assert wrote.lengths[0].tolist() == [100, 5] and not wrote.flags.any()

    enc = jnp.ones((1, 1, 256, 1))
    cross = jax.jit(lambda n: CrossAttentionCache.from_layers([(enc, enc)], n))(jnp.array([200], jnp.uint8))
    assert cross.lengths.tolist() == [200] and not cross.flags.any()

    paged = PagedCache.init(num_layers=1, batch_size=rows, num_kv_heads=1, head_dim=1, max_length=4, page_size=2,
                            num_pages=8)
    paged = paged.update(jnp.ones((rows, 1, 3, 1)), jnp.ones((rows, 1, 3, 1)), 0,
                         num_new=np.where(np.arange(rows) == 5, 3, 0).astype(np.int32))[0]
    assert jax.jit(lambda c, r: c.take_rows(r))(paged, jnp.array([5, 7], jnp.uint8)).lengths[0].tolist() == [3, 0]

    ids = jnp.zeros((1, 256), jnp.int32)
    lengths = jax.jit(lambda n: check_prompts(ids, n, "test")[1])(jnp.array([200], jnp.uint8))
    assert lengths.tolist() == [200]

    # Token histories and the poisoning of a bad length (review 82): uint8 padding was counted
    # as id 0, an inactive row's token as id 0, and the poison id -1 of a uint8 prompt became
    # the valid id 255.
    from jaxkv.generation import poison_bad_lengths
    from jaxkv.sampling import TokenHistory, record_tokens, token_counts

    counts = jax.jit(lambda i: token_counts(i, jnp.array([1]), 256))(jnp.array([[5, 0]], jnp.uint8))
    assert int(counts[0, 5]) == 1 and int(counts[0, 0]) == 0
    history = TokenHistory(jnp.zeros((1, 256), bool), jnp.zeros((1, 256), jnp.int32))
    recorded = jax.jit(lambda t: record_tokens(history, t, jnp.array([False])))(jnp.array([7], jnp.uint8))
    assert not recorded.counts.any()
    poisoned, _ = jax.jit(poison_bad_lengths)(jnp.array([[3, 4]], jnp.uint8), jnp.array([0], jnp.uint8))
    assert int(poisoned[0, 0]) == -1

    model = Llama(LlamaConfig.tiny(vocab_size=256, num_layers=1), rngs=nnx.Rngs(0))
    tokens = np.array([[3, 200, 255]])
    forward = nnx.jit(lambda m, t: m(t, None)[0])
    narrow, wide = forward(model, jnp.asarray(tokens, jnp.uint8)), forward(model, jnp.asarray(tokens, jnp.int32))
    assert np.isfinite(np.asarray(narrow)).all()
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))

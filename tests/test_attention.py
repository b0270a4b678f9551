"""jaxkv.attention against an independent NumPy full-attention reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.attention import attend, attention_mask

# Jitted once per shape: far faster than eager op-by-op dispatch for many small cases.
jit_attend = jax.jit(attend, static_argnames=("sliding_window", "logit_softcap", "scale", "implementation"))


def reference_attention(q, k, v, q_pos, kv_len, *, window=None, softcap=None, kv_pos=None):
    """Loop-per-query float64 attention: slot s visible iff filled, not future, in window."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, num_q_heads, num_tokens, head_dim = q.shape
    num_kv_heads, num_slots = k.shape[1], k.shape[2]
    groups = num_q_heads // num_kv_heads
    if kv_pos is None:
        kv_pos = np.broadcast_to(np.arange(num_slots), (batch, num_slots))
    out = np.zeros_like(q)
    for b in range(batch):
        for hq in range(num_q_heads):
            h = hq // groups
            for t in range(num_tokens):
                p = q_pos[b, t]
                seen = [
                    s
                    for s in range(num_slots)
                    if s < kv_len[b] and kv_pos[b, s] <= p and (window is None or p - kv_pos[b, s] < window)
                ]
                if not seen:
                    continue
                logits = np.array([q[b, hq, t] @ k[b, h, s] for s in seen]) / np.sqrt(head_dim)
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, hq, t] = sum(wi * v[b, h, s] for wi, s in zip(w, seen))
    return out


def _random_case(seed, batch, num_q_heads, num_kv_heads, num_tokens, num_slots, head_dim):
    """Random q/k/v, per-row old lengths, and NaN in every slot past the new length."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, num_q_heads, num_tokens, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, num_kv_heads, num_slots, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, num_kv_heads, num_slots, head_dim)).astype(np.float32)
    old_len = rng.integers(0, num_slots - num_tokens + 1, size=batch)
    num_new = rng.integers(1, num_tokens + 1, size=batch)
    kv_len = (old_len + num_new).astype(np.int32)
    q_pos = (old_len[:, None] + np.arange(num_tokens)[None, :]).astype(np.int32)
    for b in range(batch):
        k[b, :, kv_len[b] :] = np.nan
        v[b, :, kv_len[b] :] = np.nan
    return q, k, v, q_pos, kv_len


@pytest.mark.parametrize("implementation", ["jaxkv", "jax"])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"]
)
@pytest.mark.parametrize("window", [None, 3])
def test_matches_reference_with_nan_in_unused_slots(implementation, num_q_heads, num_kv_heads, window):
    q, k, v, q_pos, kv_len = _random_case(0, 3, num_q_heads, num_kv_heads, 4, 11, 8)
    out = jit_attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
        q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len),
        sliding_window=window, implementation=implementation,
    )
    ref = reference_attention(q, k, v, q_pos, kv_len, window=window)
    # Padding queries (t >= num_new) still see filled slots, so every output is finite.
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3),
    num_tokens=st.integers(1, 4),
    extra_slots=st.integers(0, 6),
    window=st.one_of(st.none(), st.integers(1, 6)),
    softcap=st.one_of(st.none(), st.floats(0.5, 5.0)),
)
def test_property_random_shapes(seed, batch, kv_heads, groups, num_tokens, extra_slots, window, softcap):
    q, k, v, q_pos, kv_len = _random_case(seed, batch, kv_heads * groups, kv_heads, num_tokens, num_tokens + extra_slots, 4)
    out = jit_attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
        q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len),
        sliding_window=window, logit_softcap=softcap,
    )
    ref = reference_attention(q, k, v, q_pos, kv_len, window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_softcap_and_scale_under_jit():
    q, k, v, q_pos, kv_len = _random_case(1, 2, 4, 2, 3, 9, 8)
    q = q * 10  # large logits so the cap matters

    @jax.jit
    def f(q, k, v, q_pos, kv_len):
        return attend(q, k, v, q_positions=q_pos, kv_lengths=kv_len, logit_softcap=2.0)

    out = f(q, k, v, q_pos, kv_len)
    ref = reference_attention(q, k, v, q_pos, kv_len, softcap=2.0)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    uncapped = reference_attention(q, k, v, q_pos, kv_len)
    assert np.abs(uncapped - ref).max() > 1e-2


def test_sliding_window_edges():
    """At length == window the first token is still seen; one token later it is not."""
    num_slots, window = 6, 4
    mask = attention_mask(
        jnp.array([[3], [4]]), jnp.array([4, 5]), num_slots=num_slots, sliding_window=window
    )
    np.testing.assert_array_equal(
        np.asarray(mask[:, 0]),
        [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]],
    )
    # A multi-token chunk crossing the window edge: each query has its own window.
    mask = attention_mask(jnp.array([[2, 3, 4, 5]]), jnp.array([6]), num_slots=num_slots, sliding_window=3)
    np.testing.assert_array_equal(
        np.asarray(mask[0]),
        [[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]],
    )


def test_explicit_kv_positions_ring_layout():
    """Slots need not hold position == index (e.g. a ring buffer): positions decide."""
    q, k, v, _, _ = _random_case(2, 1, 2, 1, 1, 5, 4)
    k[...] = np.nan_to_num(k, nan=0.5)
    v[...] = np.nan_to_num(v, nan=0.5)
    kv_pos = np.array([[5, 6, 2, 3, 4]], np.int32)  # positions 2..6 written round a ring of 5
    q_pos = np.array([[6]], np.int32)
    kv_len = np.array([5], np.int32)
    out = attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
        kv_lengths=jnp.asarray(kv_len), kv_positions=jnp.asarray(kv_pos), sliding_window=3,
    )
    ref = reference_attention(q, k, v, q_pos, kv_len, kv_pos=kv_pos, window=3)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_query_that_sees_nothing_gives_zeros():
    q, k, v, _, _ = _random_case(3, 2, 2, 2, 1, 4, 4)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    k[0] = np.nan
    v[0] = np.nan
    out = attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
        q_positions=jnp.array([[0], [2]]), kv_lengths=jnp.array([0, 3]),
    )
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.isfinite(np.asarray(out)).all()


def test_bfloat16_inputs_keep_dtype_and_stay_close():
    q, k, v, q_pos, kv_len = _random_case(4, 2, 4, 2, 3, 8, 16)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    out = attend(*args, q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len))
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(*(np.asarray(a.astype(jnp.float32)) for a in args), q_pos, kv_len)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=3e-2)


@pytest.mark.parametrize("implementation", ["jaxkv", "jax"])
def test_a_16_bit_query_over_a_float32_cache_in_both_implementations(implementation):
    """implementation="jax" raised jax.nn.dot_product_attention's "query dtype should be
    float32" for a bf16 query over an f32 cache, where "jaxkv" attends (review 61)."""
    q, k, v, q_pos, kv_len = _random_case(4, 2, 4, 2, 3, 8, 16)
    q16 = jnp.asarray(q, jnp.bfloat16)
    out = attend(q16, jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len),
                 implementation=implementation)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(np.asarray(q16.astype(jnp.float32)), k, v, q_pos, kv_len)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=2e-2)


def test_vmap_over_batch_matches_batched():
    q, k, v, q_pos, kv_len = _random_case(5, 3, 4, 2, 2, 7, 8)
    batched = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len))

    def one(q, k, v, q_pos, kv_len):
        return attend(q[None], k[None], v[None], q_positions=q_pos[None], kv_lengths=kv_len[None])[0]

    mapped = jax.vmap(one)(q, k, v, q_pos, kv_len)
    chex.assert_trees_all_close(mapped, batched, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(queries=np.zeros((2, 4, 3))), "queries must have shape"),
        (dict(keys=np.zeros((2, 2, 8, 4))), "keys and values must have the same shape"),
        (dict(keys=np.zeros((2, 2, 8, 5)), values=np.zeros((2, 2, 8, 5))), "do not match keys"),
        (dict(keys=np.zeros((2, 3, 8, 8)), values=np.zeros((2, 3, 8, 8))), "multiple of kv heads"),
        (dict(q_positions=np.zeros((2, 2), np.int32)), "q_positions must have shape"),
        (dict(kv_lengths=np.zeros((3,), np.int32)), "kv_lengths must have shape"),
        (dict(kv_lengths=np.zeros((2,), np.float32)), "integer array"),
        (dict(sliding_window=0), "sliding_window must be a positive"),
        (dict(logit_softcap=-1.0), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        (dict(logit_softcap=float("inf")), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        (dict(logit_softcap=3e38), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        (dict(implementation="flash"), "implementation must be"),
        (dict(implementation="jax", logit_softcap=1.0), "cannot soft-cap"),
    ],
)
def test_bad_inputs_raise(change, match):
    kwargs = dict(
        queries=np.zeros((2, 4, 3, 8), np.float32),
        keys=np.zeros((2, 2, 8, 8), np.float32),
        values=np.zeros((2, 2, 8, 8), np.float32),
        q_positions=np.zeros((2, 3), np.int32),
        kv_lengths=np.zeros((2,), np.int32),
    )
    kwargs.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        attend(
            jnp.asarray(kwargs.pop("queries")), jnp.asarray(kwargs.pop("keys")), jnp.asarray(kwargs.pop("values")),
            q_positions=jnp.asarray(kwargs.pop("q_positions")), kv_lengths=jnp.asarray(kwargs.pop("kv_lengths")),
            **kwargs,
        )


def test_float_kv_positions_are_refused_in_both_forms():
    """[B, S] float positions were a TypeError, the [S] form was truncated (1.9 read as 1,
    review 55): both are refused now; integer positions of both forms agree."""
    q, k = jnp.ones((1, 1, 1, 8)), jnp.ones((1, 1, 4, 8))
    kw = dict(q_positions=jnp.asarray([[2]]), kv_lengths=jnp.asarray([4]))
    for positions in (jnp.asarray([0.0, 1.9, 2.5, 3.0]), jnp.asarray([[0.0, 1.9, 2.5, 3.0]])):
        with pytest.raises(TypeError):
            attend(q, k, k, kv_positions=positions, **kw)
    flat = attend(q, k, k, kv_positions=jnp.asarray([0, 1, 3, 2]), **kw)
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(attend(q, k, k, kv_positions=jnp.asarray([[0, 1, 3, 2]]), **kw)))


@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn])
def test_a_float8_cache_multiplies_probabilities_in_float32(dtype):
    """A float8 cache (any floating dtype= is taken) rounded the softmax probabilities to its
    own 2-3 mantissa bits before the product with the values: 0.03-0.18 off attention over the
    very values it stores (review 77). Blockwise (StaticCache) and dense (ring) paths, against
    the float64 reference over the float8-rounded keys and values."""
    from jaxkv import SlidingWindowCache, StaticCache
    from jaxkv.attention import cache_attention
    from reference import numpy_attention

    rng = np.random.default_rng(0)
    batch, heads, tokens, dim = 2, 1, 12, 8
    k, v = (rng.standard_normal((batch, heads, tokens, dim)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((batch, 2, tokens, dim)).astype(np.float32)
    stored = [np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)) for x in (k, v)]
    pos = np.broadcast_to(np.arange(tokens, dtype=np.int32), (batch, tokens))
    want = numpy_attention(q, *stored, pos, np.full(batch, tokens))
    for cache in (StaticCache.init(num_layers=1, batch_size=batch, num_kv_heads=heads, head_dim=dim, max_length=16,
                                   dtype=dtype),
                  SlidingWindowCache.init(num_layers=1, batch_size=batch, num_kv_heads=heads, head_dim=dim, window=16,
                                          dtype=dtype)):
        got, _ = cache_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache, 0, positions=jnp.asarray(pos))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=type(cache).__name__)


def test_no_new_tokens_without_a_cache_is_an_empty_output():
    """Zero queries over zero slots (KVAttention(x[B, 0, E], cache=None)) was NumPy's
    "zero-size array to reduction operation max" (review 80); every cache kind returns an
    empty output for the same call."""
    empty = jnp.zeros((2, 4, 0, 8))
    out = attend(empty, jnp.zeros((2, 2, 0, 8)), jnp.zeros((2, 2, 0, 8)), q_positions=jnp.zeros((2, 0), jnp.int32),
                 kv_lengths=jnp.zeros((2,), jnp.int32))
    assert out.shape == (2, 4, 0, 8)


def test_positions_and_lengths_as_python_lists_and_ints():
    """A list q_positions or list kv_lengths was an AttributeError ('list' object has no
    attribute 'shape'; review 84): read as arrays, the same output as arrays give."""
    from jaxkv.attention import blockwise_attend

    q, k, v, q_pos, kv_len = _random_case(4, 2, 4, 2, 3, 8, 16)
    want = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                  kv_lengths=jnp.asarray(kv_len))
    for fn in (attend, blockwise_attend):
        got = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=np.asarray(q_pos).tolist(),
                 kv_lengths=np.asarray(kv_len).tolist())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert attention_mask(np.asarray(q_pos).tolist(), np.asarray(kv_len).tolist(), num_slots=16).shape[0] == len(kv_len)

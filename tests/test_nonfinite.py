"""Non-finite keys and values: the native kernel, the blockwise XLA loop and the dense
``attend`` against one float64 NumPy reference of the contract (jaxkv.attention docstring).

Each batch row is one scenario: NaN, +inf or -inf in one element of a key or a value of
kv head 0, at a slot every query sees, one in the queries' future (a chunk of three
queries), one at a window's start (seen by the first query only), or an unfilled one. One
program per implementation and setting covers all of them; kv head 1 stays finite. The
same rows laid out in shuffled pages (pages no row holds full of inf) run the paged kernel
and the paged XLA loop.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import attend
from jaxkv.attention.blockwise import blockwise_attend, paged_blockwise_attend
from test_kernel import paged_view, to_pages

HAS_COMPILER = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
Q_HEADS, KV_HEADS, TOKENS, SLOTS, DIM = 4, 2, 3, 48, 16
WINDOW = 16


def reference(q, k, v, q_pos, kv_len, *, window=None, softcap=None):
    """The contract in float64: NaN rows where a visible slot has a non-finite raw logit or
    value element, else the softmax over the visible slots; zeros where none is visible."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_heads, tokens, dim = q.shape
    groups = q_heads // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)  # [B, Hq, S, D]
    slots = np.arange(k.shape[2])
    q_pos = np.asarray(q_pos)[:, :, None]
    visible = (slots < np.asarray(kv_len)[:, None, None]) & (slots <= q_pos)  # [B, T, S]
    if window is not None:
        visible &= q_pos - slots < window
    visible = visible[:, None]  # [B, 1, T, S]
    with np.errstate(invalid="ignore", over="ignore"):
        raw = np.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(dim)
    bad = ~np.isfinite(raw) | ~np.isfinite(v).all(-1)[:, :, None, :]  # [B, Hq, T, S]
    marked = (visible & bad).any(-1)  # [B, Hq, T]
    logits = np.where(np.isfinite(raw), raw, 0.0)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    weights = np.where(visible, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bhts,bhsd->bhtd", weights, np.where(np.isfinite(v), v, 0.0))
    return np.where(marked[..., None], np.nan, out)


def scenarios():
    """Inputs with one non-finite element per row; the last two rows: clean, and a row that
    sees nothing (length 0) with NaN in its unfilled slots."""
    rng = np.random.default_rng(0)
    cases = [(where, array, bad) for where in ("early", "window start", "recent", "future", "unfilled")
             for array in ("keys", "values") for bad in (np.nan, np.inf, -np.inf)]
    batch = len(cases) + 2
    q = rng.standard_normal((batch, Q_HEADS, TOKENS, DIM)).astype(np.float32)
    keys = rng.standard_normal((batch, KV_HEADS, SLOTS, DIM)).astype(np.float32)
    values = rng.standard_normal((batch, KV_HEADS, SLOTS, DIM)).astype(np.float32)
    kv_len = 36 + np.arange(batch) % 8  # ragged rows; slots 0-31 filled and seen by all (no window)
    kv_len[-1] = 0
    q_pos = kv_len[:, None] - TOKENS + np.arange(TOKENS)  # the chunk just written
    q_pos[-1] = np.arange(TOKENS)
    for row, (where, array, bad) in enumerate(cases):
        length, first_query = kv_len[row], q_pos[row, 0]
        slot = {"early": 2, "window start": first_query - WINDOW + 1, "recent": first_query - 1,
                "future": length - 1, "unfilled": length + 2}[where]
        (keys if array == "keys" else values)[row, 0, slot, 5] = bad
    keys[-1, :, :4], values[-1, :, 4:8] = np.nan, np.inf
    return q, keys, values, q_pos.astype(np.int32), kv_len.astype(np.int32)


def check(got, want):
    got = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


IMPLEMENTATIONS = {
    "kernel": lambda q, k, v, p, n, **kw: blockwise_attend(q, k, v, q_positions=p, kv_lengths=n, implementation="kernel", **kw),
    "xla": lambda q, k, v, p, n, **kw: blockwise_attend(q, k, v, q_positions=p, kv_lengths=n, implementation="xla",
                                                        block_size=8, **kw),
    "attend": lambda q, k, v, p, n, **kw: attend(q, k, v, q_positions=p, kv_lengths=n, **kw),
    "attend jax": lambda q, k, v, p, n, **kw: attend(q, k, v, q_positions=p, kv_lengths=n, implementation="jax", **kw),
}


@pytest.mark.parametrize("window, softcap", [(None, None), (WINDOW, None), (None, 30.0), (WINDOW, 5.0)])
def test_all_implementations_follow_the_contract(window, softcap):
    inputs = scenarios()
    want = reference(*inputs, window=window, softcap=softcap)
    # Every case marks some rows and leaves others finite: the comparison is not vacuous.
    assert np.isnan(want).any() and np.isfinite(want).any()
    assert not np.isnan(want[:, 2:]).any()  # kv head 1 (query heads 2, 3) never sees a bad slot
    assert (want[-1] == 0).all()
    for name, fn in IMPLEMENTATIONS.items():
        if (name == "kernel" and not HAS_COMPILER) or (name == "attend jax" and softcap is not None):
            continue
        got = jax.jit(lambda *a, fn=fn: fn(*a, sliding_window=window, logit_softcap=softcap))(*map(jnp.asarray, inputs))
        try:
            check(got, want)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_scenarios_cover_every_kind_of_slot():
    """The reference marks exactly the rows where a seen slot is bad (a check of the test)."""
    q, keys, values, q_pos, kv_len = scenarios()
    marked = np.isnan(reference(q, keys, values, q_pos, kv_len, window=WINDOW)[:, 0, :, 0])  # [B, T]
    expected = {"early": [False] * 3, "window start": [True, False, False], "recent": [True] * 3,
                "future": [False, False, True], "unfilled": [False] * 3}
    for kind, (where, seen) in enumerate(expected.items()):
        for row in range(6 * kind, 6 * kind + 6):  # keys, then values; NaN, inf, -inf each
            assert marked[row].tolist() == seen, (where, row)
    assert not marked[-2:].any()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the kernel")
@pytest.mark.parametrize("dim", [16, 8], ids=["vector path", "scalar path"])
def test_kernel_decode_step_split_into_pieces(dim):
    """One query per row (a decode step), rows long enough to be split into pieces merged at
    the end: a bad key in one piece of head 0, a bad value in another piece of head 1, NaN
    in the future and past the fill. Head dim 8 runs the kernel's scalar path."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 1, dim)).astype(np.float32)
    keys = rng.standard_normal((2, 2, 700, dim)).astype(np.float32)
    values = rng.standard_normal((2, 2, 700, dim)).astype(np.float32)
    kv_len, q_pos = np.array([650, 650], np.int32), np.array([[649], [639]], np.int32)
    keys[0, 0, 10, 3], values[0, 1, 500, 0], values[1, 1, 639, 2] = np.inf, np.nan, -np.inf
    keys[1, 0, 645], values[1, 0, 640, 1] = np.nan, np.inf  # filled, but in the query's future
    keys[:, :, 660:], values[:, :, 660:] = np.nan, np.nan
    want = reference(q, keys, values, q_pos, kv_len)
    assert np.isnan(want[..., 0, 0]).tolist() == [[True] * 4, [False, False, True, True]]
    check(IMPLEMENTATIONS["kernel"](*map(jnp.asarray, (q, keys, values, q_pos, kv_len))), want)


@pytest.mark.parametrize("window, softcap", [(None, None), (WINDOW, 5.0)])
def test_paged_kernel_and_loop_follow_the_contract(window, softcap):
    q, keys, values, q_pos, kv_len = scenarios()
    want = reference(q, keys, values, q_pos, kv_len, window=window, softcap=softcap)
    view = paged_view(*to_pages(keys, values, kv_len, 16, spare=2, fill=np.inf), kv_len, 0, jnp.float32)
    for implementation, block_size in (("kernel", None), ("xla", 8)):  # 8: blocks inside a page
        if implementation == "kernel" and not HAS_COMPILER:
            continue
        got = jax.jit(lambda q, p: paged_blockwise_attend(  # noqa: B023 - called at once
            q, view, q_positions=p, sliding_window=window, logit_softcap=softcap, implementation=implementation,
            block_size=block_size))(jnp.asarray(q), jnp.asarray(q_pos))
        try:
            check(got, want)
        except AssertionError as err:
            raise AssertionError(f"paged {implementation}: {err}") from None


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
def test_quantized_caches_keep_a_non_finite_token_non_finite(bad):
    """int8/int4 codes cannot hold inf or NaN: such a token used to be stored with a
    saturated scale, so inf became a finite value (and the token's other elements 0) and
    attention that saw it came out finite. Its scale is NaN now: as over a StaticCache, a
    query that sees the token gives NaN and one that does not is unaffected."""
    from jaxkv import PagedCache, QuantizedCache, StaticCache
    from jaxkv.attention import cache_attention

    rng = np.random.default_rng(0)
    keys = rng.normal(size=(1, 1, 3, 8)).astype(np.float32)
    values = rng.normal(size=(1, 1, 3, 8)).astype(np.float32)
    queries = jnp.asarray(rng.normal(size=(1, 2, 3, 8)), jnp.float32)
    size = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, max_length=8)
    kinds = {
        "static": StaticCache.init(**size),
        "int8": QuantizedCache.init(**size, bits=8, residual_length=0),
        "int4": QuantizedCache.init(**size, bits=4, residual_length=0),
        "paged int8": PagedCache.init(**size, page_size=4, bits=8),
    }
    for where in ("key", "value"):
        k, v = keys.copy(), values.copy()
        (k if where == "key" else v)[0, 0, 1, 3] = bad  # token 1: seen by queries 1 and 2, not 0
        outs = {}
        for name, cache in kinds.items():
            out, _ = cache_attention(queries, jnp.asarray(k), jnp.asarray(v), cache, 0, positions=cache.positions(3))
            outs[name] = np.asarray(out)
            assert np.isnan(outs[name][0, :, 1:]).all(), (name, where)  # queries that see token 1
            assert np.isfinite(outs[name][0, :, 0]).all(), (name, where)  # the one that does not
        # Query 0 sees token 0 only: its output is token 0's value as stored, within the codec's
        # bound max|v| / (2 qmax) (scales rounded up: 1 + 2**-7); 0.5 was 136x the int8 error (review 70).
        for name, qmax in (("int8", 127), ("int4", 7), ("paged int8", 127)):
            bound = np.abs(v[0, 0, 0]).max() / (2 * qmax) * (1 + 2**-7) + 1e-6
            np.testing.assert_allclose(outs[name][0, :, 0], outs["static"][0, :, 0], rtol=0, atol=bound, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_an_infinite_scale_stays_non_finite_in_16_bit_models(dtype):
    """Dequantizing to a 16-bit dtype clips products past its largest value (a rounded-up
    scale), and clipped an inf scale too: the XLA loop and dense reads gave finite rows
    where the kernels gave NaN (review 65). Only finite products are clipped now."""
    from jaxkv.attention.blockwise import quantized_blockwise_attend
    from jaxkv.caches.quantized import dequantize
    from jaxkv.caches.views import QuantizedView

    top = float(jnp.finfo(dtype).max)
    got = np.asarray(dequantize(jnp.array([[127, -127]], jnp.int8), jnp.array([jnp.inf]), dtype=dtype), np.float32)
    assert np.isinf(got).all() and (np.sign(got) == [[1, -1]]).all()
    saturated = dequantize(jnp.array([[127]], jnp.int8), jnp.array([top / 100]), dtype=dtype)
    assert float(saturated[0, 0]) == top  # a finite product past the dtype's range: clipped, as before
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(1, 100, (1, 1, 1, 16, 16)), jnp.int8)
    for which in ("key", "value"):
        scales = [np.full((1, 1, 1, 16), 0.01, np.float32) for _ in range(2)]
        scales[which == "value"][0, 0, 0, 2] = np.inf  # slot 2: seen by the query at position 3
        empty = jnp.zeros((1, 1, 0, 16), dtype)
        view = QuantizedView(codes, codes, *map(jnp.asarray, scales), empty, empty, jnp.zeros((1, 0), jnp.int32),
                             jnp.int32(0), jnp.array([4], jnp.int32), 8, dtype, jnp.float32)
        q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), dtype)
        out = quantized_blockwise_attend(q, view, q_positions=jnp.array([[3]], jnp.int32), implementation="xla")
        assert np.isnan(np.asarray(out, np.float32)).all(), which
        dense = view.dense()
        out = attend(q, dense.keys, dense.values, q_positions=jnp.array([[3]], jnp.int32), kv_lengths=dense.kv_lengths)
        assert np.isnan(np.asarray(out, np.float32)).all(), which

"""The native CPU decode-attention kernel (jaxkv._kernels) against a float64 NumPy reference.

Head dims with and without the vector path, query groups that do and do not fill its
groups of four, several tokens per row, windows, soft caps, bf16, fills large enough to be
split across threads and merged, and the program it makes (one custom call reading the
cache in place, no copies). The paged target reads the same from a page pool through a
block table (pages shuffled; NaN in unused slots, in pages no row holds and in other
layers). The fallback without a compiler runs in subprocesses.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import PagedCache, StaticCache, _kernels
from jaxkv.attention import cache_attention
from jaxkv.attention.blockwise import blockwise_attend, paged_blockwise_attend, quantized_blockwise_attend
from jaxkv.caches._bits import stored_dtype, to_bits
from jaxkv.caches.views import PagedView
from reference import make_inputs, numpy_attention

# Skipped only where there is no C++ compiler at all; with one, a failed build fails here.
pytestmark = pytest.mark.skipif(
    not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler to build the kernel"
)


def dense_reference(q, k, v, q_pos, kv_len, window=None, softcap=None):
    """Vectorised float64 attention over exactly the visible slots (checked against the
    per-query loop of `numpy_attention` below, then used where that loop is too slow)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, hq, tokens, dim = q.shape
    groups = hq // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    slots = np.arange(k.shape[2])
    filled = slots[None, :] < np.asarray(kv_len)[:, None]  # [B, S]
    visible = filled[:, None, :] & (slots[None, None, :] <= np.asarray(q_pos)[:, :, None])  # [B, T, S]
    if window is not None:
        visible &= np.asarray(q_pos)[:, :, None] - slots[None, None, :] < window
    visible = visible[:, None]  # [B, 1, T, S]
    logits = np.einsum("bhtd,bhsd->bhts", q, np.where(filled[:, None, :, None], k, 0.0)) / np.sqrt(dim)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    weights = np.where(visible, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    weights = weights / np.where(total > 0, total, 1.0)
    return np.einsum("bhts,bhsd->bhtd", weights, np.where(filled[:, None, :, None], v, 0.0))


def kernel(q, k, v, q_pos, kv_len, **kw):
    return blockwise_attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos, jnp.int32),
        kv_lengths=jnp.asarray(kv_len, jnp.int32), implementation="kernel", **kw,
    )


def last_positions(kv_len, tokens):
    return np.stack([np.maximum(n - tokens, 0) + np.arange(tokens) for n in kv_len])


def test_dense_reference_equals_the_loop_reference():
    kv_len = np.array([23, 0, 9])
    q, k, v = make_inputs(0, 3, 6, 2, 3, 30, 8, kv_len)
    q_pos = last_positions(kv_len, 3)
    for window, softcap in [(None, None), (5, 3.0)]:
        np.testing.assert_allclose(
            dense_reference(q, k, v, q_pos, kv_len, window, softcap), numpy_attention(q, k, v, q_pos, kv_len, window, softcap),
            rtol=1e-12, atol=1e-12,
        )


@pytest.mark.parametrize(
    "dim, groups, tokens, window, softcap",
    [
        (64, 4, 1, None, None),  # the vector path, one full group of four queries
        (16, 1, 1, None, None),  # one query: three empty lanes in the group
        (32, 2, 3, 7, None),  # six queries: a full group and a half one; window
        (128, 3, 2, None, 4.0),  # soft cap
        (64, 8, 16, 40, 5.0),  # the most tokens the kernel takes
        (256, 2, 1, None, None),  # Gemma's head dim
        (80, 1, 2, 9, None),  # a multiple of 16 that is not a power of two
        (24, 2, 2, None, None),  # a head dim off the vector path: the scalar loops
        (4, 5, 1, 3, None),
    ],
)
def test_kernel_matches_reference(dim, groups, tokens, window, softcap):
    kv_len = np.array([300, 37, 0, 1])
    q, k, v = make_inputs(dim + groups, 4, 2 * groups, 2, tokens, 300, dim, kv_len)
    q_pos = last_positions(kv_len, tokens)
    got = kernel(q, k, v, q_pos, kv_len, sliding_window=window, logit_softcap=softcap)
    want = dense_reference(q, k, v, q_pos, kv_len, window, softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[2]).any()  # an empty row sees nothing: zeros


def test_queries_past_the_fill_and_before_it():
    """Positions need not be the last ones: a query before the fill sees a prefix, one past
    it sees all of it (the kernel must not read beyond kv_lengths either way)."""
    kv_len = np.array([50, 50])
    q, k, v = make_inputs(1, 2, 4, 2, 3, 64, 16, kv_len)
    q_pos = np.array([[0, 20, 60], [49, 3, 100]])
    for window in (None, 10):
        got = kernel(q, k, v, q_pos, kv_len, sliding_window=window)
        np.testing.assert_allclose(np.asarray(got), dense_reference(q, k, v, q_pos, kv_len, window), rtol=2e-5, atol=2e-5)


def test_bf16_cache_and_queries():
    kv_len = np.array([200, 120])
    q, k, v = make_inputs(2, 2, 8, 2, 2, 256, 64, kv_len)
    q_pos = last_positions(kv_len, 2)
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    got = kernel(*as_bf16, q_pos, kv_len)
    assert got.dtype == jnp.bfloat16
    # Reference on the bf16-rounded inputs: what is left is the kernel's f32 arithmetic
    # and one rounding of the output to bf16 (relative 2^-8).
    rounded = [np.asarray(x, np.float32) for x in as_bf16]
    want = dense_reference(*rounded, q_pos, kv_len)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=2**-8)
    # f32 queries over a bf16 cache: f32 out.
    mixed = kernel(q, *as_bf16[1:], q_pos, kv_len)
    assert mixed.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(mixed), dense_reference(q, *rounded[1:], q_pos, kv_len), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [None, 3000])
def test_long_fills_split_across_threads_and_merged(window):
    """Fills large enough to be cut into pieces run on several threads; each piece has its
    own softmax state, merged at the end. Rows of different lengths get different pieces."""
    kv_len = np.array([20000, 9001, 513])
    q, k, v = make_inputs(3, 3, 8, 2, 2, 20000, 64, kv_len)
    q_pos = last_positions(kv_len, 2)
    got = kernel(q, k, v, q_pos, kv_len, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), dense_reference(q, k, v, q_pos, kv_len, window), rtol=2e-5, atol=2e-5)


def test_stacked_cache_layer_index_traced_and_checked():
    kv_len = np.array([40, 17])
    layers = [make_inputs(s, 2, 4, 2, 1, 48, 16, kv_len) for s in range(3)]
    q = jnp.asarray(layers[0][0])
    keys = jnp.stack([jnp.asarray(k) for _, k, _ in layers])
    values = jnp.stack([jnp.asarray(v) for _, _, v in layers])
    q_pos = last_positions(kv_len, 1)
    step = jax.jit(lambda q, k, v, i: blockwise_attend(
        q, k, v, layer_idx=i, q_positions=jnp.asarray(q_pos, jnp.int32), kv_lengths=jnp.asarray(kv_len, jnp.int32),
        implementation="kernel"))
    for layer in range(3):
        want = dense_reference(np.asarray(q), np.asarray(keys[layer]), np.asarray(values[layer]), q_pos, kv_len)
        np.testing.assert_allclose(np.asarray(step(q, keys, values, jnp.int32(layer))), want, rtol=2e-5, atol=2e-5)
    # A bad traced index is an error, never a read of another layer's (or no layer's) memory.
    with pytest.raises(Exception, match=r"layer index 3 is outside \[0, 3\)"):
        step(q, keys, values, jnp.int32(3)).block_until_ready()


def test_decode_step_program_reads_the_cache_in_place():
    """A jitted, donated decode step: one custom call, no conditional, no cache-sized copy."""
    cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=64, max_length=4096)
    kv = jnp.ones((2, 2, 1, 64))
    q = jnp.ones((2, 8, 1, 64))

    def step(cache, q, kv):
        positions = cache.seq_lengths(0)[:, None]
        for layer in range(2):
            out, cache = cache_attention(q, kv, kv, cache, layer, positions=positions)
            # As in a model, the next layer's inputs come from this layer's output: that
            # orders the next write after this read, so the write can happen in place.
            q = q + out
            kv = kv + out[:, :2]
        return q, cache

    hlo = jax.jit(step, donate_argnums=0).lower(cache, q, kv).compile().as_text()
    assert hlo.count('custom_call_target="jaxkv_decode_attention"') == 2, hlo
    assert "conditional" not in hlo
    buffer = "f32[2,2,2,4096,64]"
    assert not [line for line in hlo.splitlines() if " copy(" in line and buffer in line]


def test_unchained_layers_are_read_before_the_next_write():
    """A donated step whose layers do not depend on each other (layer 1's inputs are not
    layer 0's output) leaves XLA free to order layer 1's in-place write before layer 0's
    read; it then keeps that read valid by copying the buffers (slower, see the README),
    never by letting the read see layer 1's tokens: each layer attends over its own
    tokens exactly."""
    rng = np.random.default_rng(3)
    cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=16, max_length=64)
    old = [rng.standard_normal((2, 2, 5, 16)).astype(np.float32) for _ in range(2)]
    for layer in range(2):
        cache = cache.update(jnp.asarray(old[layer]), jnp.asarray(old[layer]), layer)[0]
    new = [rng.standard_normal((2, 2, 1, 16)).astype(np.float32) for _ in range(2)]
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)

    def step(cache, q, k0, k1):
        positions = cache.seq_lengths(0)[:, None]
        out0, cache = cache_attention(q, k0, k0, cache, 0, positions=positions)
        out1, cache = cache_attention(q, k1, k1, cache, 1, positions=positions)
        return out0, out1, cache

    out0, out1, cache = jax.jit(step, donate_argnums=0)(cache, jnp.asarray(q), *map(jnp.asarray, new))
    for layer, out in enumerate((out0, out1)):
        k = np.concatenate([old[layer], new[layer]], axis=2)
        want = numpy_attention(q, k, k, np.array([[5], [5]]), np.array([6, 6]))
        np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5, err_msg=f"layer {layer}")
    np.testing.assert_array_equal(cache.lengths, [[6, 6], [6, 6]])


def test_vmap_and_forward_derivative():
    kv_len = np.array([30, 11])
    q, k, v = make_inputs(4, 2, 4, 2, 1, 32, 16, kv_len)
    q_pos = last_positions(kv_len, 1)

    def run(impl, q, k, v):
        return blockwise_attend(q, k, v, q_positions=jnp.asarray(q_pos, jnp.int32),
                                kv_lengths=jnp.asarray(kv_len, jnp.int32), implementation=impl)

    # vmap over a leading axis of queries: each slice equals its own call.
    qs = jnp.stack([jnp.asarray(q), 2 * jnp.asarray(q)])
    batched = jax.vmap(lambda q: run("kernel", q, jnp.asarray(k), jnp.asarray(v)))(qs)
    for i in range(2):
        np.testing.assert_allclose(np.asarray(batched[i]), dense_reference(np.asarray(qs[i]), k, v, q_pos, kv_len),
                                   rtol=2e-5, atol=2e-5)
    # Forward-mode derivatives come from the XLA loop; finite differences check them.
    dq = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)
    primal, tangent = jax.jvp(lambda q: run("kernel", q, jnp.asarray(k), jnp.asarray(v)), (jnp.asarray(q),), (dq,))
    np.testing.assert_allclose(np.asarray(primal), dense_reference(q, k, v, q_pos, kv_len), rtol=2e-5, atol=2e-5)
    eps = 1e-4
    numeric = (dense_reference(q + eps * np.asarray(dq), k, v, q_pos, kv_len)
               - dense_reference(q - eps * np.asarray(dq), k, v, q_pos, kv_len)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), numeric, rtol=1e-3, atol=1e-3)


def test_what_the_kernel_does_not_take():
    q = jnp.zeros((1, 2, 17, 16))
    k = jnp.zeros((1, 1, 32, 16))
    kw = dict(q_positions=jnp.zeros((1, 17), jnp.int32), kv_lengths=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="17 queries, the kernel takes at most 16"):
        blockwise_attend(q, k, k, implementation="kernel", **kw)
    # "auto" sends a long chunk to the XLA loop instead.
    hlo = jax.jit(lambda q, k: blockwise_attend(q, k, k, **kw)).lower(q, k).as_text()
    assert "jaxkv_decode_attention" not in hlo
    with pytest.raises(ValueError, match="float16"):
        blockwise_attend(q[:, :, :1].astype(jnp.float16), k.astype(jnp.float16), k.astype(jnp.float16),
                         q_positions=kw["q_positions"][:, :1], kv_lengths=kw["kv_lengths"], implementation="kernel")


def to_pages(keys, values, kv_len, page_size, *, layers=1, layer=0, spare=3, seed=0, fill=np.nan):
    """Contiguous [B, H, S, D] keys/values laid out as a page pool [L, P, H, ps, D] and a
    block table [B, M]: each block holding a filled slot gets a page, in shuffled order;
    blocks past the fill get -1. ``spare`` pages no row holds, and the other layers, hold
    ``fill``; slots past the fill inside a held page keep what the inputs had there."""
    keys, values = np.asarray(keys), np.asarray(values)
    batch, heads, slots, dim = keys.shape
    blocks = -(-slots // page_size)
    held = np.arange(blocks)[None, :] * page_size < np.asarray(kv_len)[:, None]  # [B, M]
    num_pages = int(held.sum()) + spare
    table = np.full((batch, blocks), -1, np.int32)
    table[held] = np.random.default_rng(seed).permutation(num_pages)[: held.sum()]
    pools = []
    for x in (keys, values):
        x = np.pad(x, ((0, 0), (0, 0), (0, blocks * page_size - slots), (0, 0)), constant_values=fill)
        pages = x.reshape(batch, heads, blocks, page_size, dim).transpose(0, 2, 1, 3, 4)  # [B, M, H, ps, D]
        pool = np.full((layers, num_pages, heads, page_size, dim), fill, x.dtype)
        pool[layer, table[held]] = pages[held]
        pools.append(pool)
    return pools[0], pools[1], table


def paged_view(pool_keys, pool_values, table, kv_len, layer, dtype):
    """A PagedView of float pages, stored as PagedCache stores them (16-bit floats as bits)."""
    keys, values = (to_bits(jnp.asarray(x), dtype) for x in (pool_keys, pool_values))
    scales = jnp.zeros(keys.shape[:4][:-1] + (0,), stored_dtype(jnp.bfloat16))
    return PagedView(keys, values, scales, scales, jnp.asarray(table), layer, jnp.asarray(kv_len, jnp.int32), None,
                     jnp.dtype(dtype), jnp.dtype(jnp.bfloat16))


@pytest.mark.parametrize(
    "dim, groups, tokens, window, softcap, dtype",
    [
        (64, 4, 1, None, None, jnp.float32),  # a decode step, four query heads per kv head
        (128, 2, 4, 7, 4.0, jnp.float32),  # four queries, a window, a soft cap
        (24, 3, 4, None, None, jnp.float32),  # the scalar loops
        (64, 2, 4, 40, None, jnp.bfloat16),
        (32, 1, 1, None, 3.0, jnp.bfloat16),
    ],
)
def test_paged_kernel_matches_reference_and_the_xla_loop(dim, groups, tokens, window, softcap, dtype):
    """Row 0 is long enough to be split across threads; row 1 ends inside a page, row 2 is
    empty (no page at all), row 3 fills exactly one page. Layer 1 of 2 is read (traced)."""
    kv_len = np.array([2500, 37, 0, 16])
    q, k, v = make_inputs(dim + tokens, 4, 2 * groups, 2, tokens, 2512, dim, kv_len)
    q, k, v = (np.asarray(jnp.asarray(x, dtype)) for x in (q, k, v))  # inputs as the cache holds them
    q_pos = last_positions(kv_len, tokens)
    pool_keys, pool_values, table = to_pages(k, v, kv_len, 16, layers=2, layer=1)
    assert not np.isfinite(pool_keys[0]).any() and np.isnan(pool_keys[1]).any()  # the poison is there

    @jax.jit
    def run(q, pool_keys, pool_values, table, layer):
        view = paged_view(pool_keys, pool_values, table, kv_len, layer, dtype)
        return [paged_blockwise_attend(q, view, q_positions=jnp.asarray(q_pos, jnp.int32), sliding_window=window,
                                       logit_softcap=softcap, implementation=impl) for impl in ("kernel", "xla")]

    got, xla = run(jnp.asarray(q), pool_keys, pool_values, table, jnp.int32(1))
    assert got.dtype == dtype
    want = dense_reference(*(np.asarray(x, np.float64) for x in (q, k, v)), q_pos, kv_len, window, softcap)
    # bf16: one rounding of the output (relative 2^-8) on top of f32 arithmetic.
    tol = 2e-5 if dtype == jnp.float32 else 2**-8
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    # The XLA loop on the same view, against the reference itself: at bf16 it rounds the
    # softmax weights to bf16 before the value product (2**-7 relative, as in
    # tests/test_blockwise.py); checked against the kernel at 3e-2, a 2% bias passed (review 70).
    xla_tol = tol if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(xla, np.float64), want, rtol=xla_tol, atol=xla_tol)
    assert not np.asarray(got[2], np.float64).any()  # the empty row sees nothing: zeros


def test_an_int64_block_table_under_x64_reads_as_int32():
    """Under x64 a hand-built PagedView's block table may be int64; the kernel takes int32
    (its custom call failed: "expected S32 but got S64" while the XLA loop worked). It is
    cast, an id past int32's range reading as unmapped (-1), and both paths equal the
    reference."""
    kv_len = np.array([45, 20])
    q, k, v = make_inputs(5, 2, 4, 2, 1, 48, 16, kv_len)
    pool_k, pool_v, table = to_pages(k, v, kv_len, 16)
    q_pos = last_positions(kv_len, 1)
    want = dense_reference(q, k, v, q_pos, kv_len)
    with jax.enable_x64(True):
        view = paged_view(pool_k, pool_v, jnp.asarray(table, jnp.int64), kv_len, 0, jnp.float32)
        assert view.block_table.dtype == jnp.int64
        for implementation in ("kernel", "xla"):
            got = paged_blockwise_attend(jnp.asarray(q), view, q_positions=jnp.asarray(q_pos, jnp.int32),
                                         implementation=implementation)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    # narrow and unsigned tables too (the unmapped -1 entries wrap to 255 / 2**32 - 1 there): a
    # first version of the cast compared them with Python bounds that wrapped, mapping every id to -1
    base = paged_view(pool_k, pool_v, jnp.asarray(table), kv_len, 0, jnp.float32)
    for dtype in (jnp.int16, jnp.uint8, jnp.uint32):
        view = base._replace(block_table=jnp.asarray(table).astype(dtype))
        for implementation in ("kernel", "xla"):
            got = paged_blockwise_attend(jnp.asarray(q), view, q_positions=jnp.asarray(q_pos, jnp.int32),
                                         implementation=implementation)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5, err_msg=str(dtype))


def test_paged_decode_step_program_vmap_and_what_the_paged_kernel_does_not_take():
    """A jitted, donated decode step over a PagedCache: one paged custom call per layer, reading
    the pool in place; vmap over stacked queries equals one call per slice; int8 pages take
    the paged quantized target."""
    cache = PagedCache.init(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=64, max_length=4096, num_pages=300)
    kv = jnp.ones((2, 2, 1, 64))
    q = jnp.ones((2, 8, 1, 64))

    def step(cache, q, kv):
        positions = cache.seq_lengths(0)[:, None]
        for layer in range(2):
            out, cache = cache_attention(q, kv, kv, cache, layer, positions=positions)
            q = q + out
            kv = kv + out[:, :2]
        return q, cache

    hlo = jax.jit(step, donate_argnums=0).lower(cache, q, kv).compile().as_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="jaxkv_paged_decode_attention"' in line]
    # Each reads the whole pool where it lies (operands of the pool's shape), no gathered pages.
    assert len(calls) == 2 and all(line.count("f32[2,300,2,16,64]") == 2 for line in calls), calls
    # The page plan (O(pool) bookkeeping) and the copy-on-write are a loop of 0 or 1 trips that
    # carries the pool in place; no conditional returns the pool (a lax.cond over the pool
    # copies it into its branches), and nothing copies the pool.
    pool = "f32[2,300,2,16,64]"
    conditionals = [line for line in hlo.splitlines() if " conditional(" in line]
    assert not [line for line in conditionals if pool in line.split("conditional(")[0]], conditionals
    assert not [line for line in hlo.splitlines() if " copy(" in line and pool in line]

    kv_len = np.array([45, 20])
    qs, k, v = make_inputs(5, 2, 4, 2, 1, 48, 16, kv_len)
    qs = np.stack([qs, -2 * qs])
    view = paged_view(*to_pages(k, v, kv_len, 16), kv_len, 0, jnp.float32)
    q_pos = jnp.asarray(last_positions(kv_len, 1), jnp.int32)
    attend_ = lambda q: paged_blockwise_attend(q, view, q_positions=q_pos, implementation="kernel")  # noqa: E731
    batched = jax.jit(jax.vmap(attend_))(jnp.asarray(qs))
    for i in range(2):
        np.testing.assert_allclose(np.asarray(batched[i]), dense_reference(qs[i], k, v, q_pos, kv_len),
                                   rtol=2e-5, atol=2e-5)

    # int8 pages: the paged quantized target ("auto" too), equal to the XLA loop; pages with
    # float16 scales go to the XLA loop ("auto") or are refused ("kernel").
    int8 = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=16, max_length=64, bits=8)
    int8, _, _ = int8.update(jnp.asarray(k[:, :, :20]), jnp.asarray(v[:, :, :20]), 0)
    int8_view = int8.stores[0].view(0, int8.lengths[0])
    hlo = jax.jit(lambda q: paged_blockwise_attend(q, int8_view, q_positions=q_pos)).lower(jnp.asarray(qs[0])).as_text()
    assert "jaxkv_paged_quantized_decode_attention" in hlo
    got, want = (paged_blockwise_attend(jnp.asarray(qs[0]), int8_view, q_positions=q_pos, implementation=i)
                 for i in ("kernel", "xla"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    f16 = PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=16, max_length=64, bits=8,
                          scale_dtype=jnp.float16)
    f16_view = f16.stores[0].view(0, f16.lengths[0])
    with pytest.raises(ValueError, match="scales of dtype float16; the kernel reads float32 and bfloat16 scales"):
        paged_blockwise_attend(jnp.asarray(qs[0]), f16_view, q_positions=q_pos, implementation="kernel")
    hlo = jax.jit(lambda q: paged_blockwise_attend(q, f16_view, q_positions=q_pos)).lower(jnp.asarray(qs[0])).as_text()
    assert "decode_attention" not in hlo


def test_build_is_cached():
    first = _kernels.build()
    stamp = os.stat(first).st_mtime_ns
    assert _kernels.build() == first and os.stat(first).st_mtime_ns == stamp


FALLBACK = textwrap.dedent(
    """
    import warnings
    import jax.numpy as jnp, numpy as np
    from jaxkv import _kernels
    from jaxkv.attention.blockwise import blockwise_attend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = _kernels.available()
    print("available", ok, "warned", any("kernel is unavailable" in str(w.message) for w in caught))
    q = jnp.ones((1, 2, 1, 16)); k = jnp.arange(1 * 1 * 8 * 16, dtype=jnp.float32).reshape(1, 1, 8, 16) / 100
    kw = dict(q_positions=jnp.array([[4]], jnp.int32), kv_lengths=jnp.array([5], jnp.int32))
    out = blockwise_attend(q, k, k, **kw)
    print("auto", float(out.sum()))
    try:
        blockwise_attend(q, k, k, implementation="kernel", **kw)
    except ValueError as err:
        print("kernel refused:", "could not be built" in str(err))
    """
)


@pytest.mark.parametrize("env", [{"JAXKV_CPU_KERNEL": "0"}, {"CXX": "/bin/false"}], ids=["disabled", "no-compiler"])
def test_without_the_kernel_everything_falls_back_to_xla(env, tmp_path):
    full_env = {**os.environ, "JAXKV_KERNEL_CACHE": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=full_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"available False warned {env.get('CXX') is not None}"
    # The XLA loop's answer equals the reference.
    q = np.ones((1, 2, 1, 16))
    k = np.arange(8 * 16, dtype=np.float32).reshape(1, 1, 8, 16) / 100
    want = dense_reference(q, k, k, np.array([[4]]), np.array([5])).sum()
    assert abs(float(lines[1].split()[1]) - want) < 1e-3 * abs(want)
    assert lines[2] == "kernel refused: True"


# --- Quantized views (int8 / int4 codes with per-token scales), read by the quantized target ---


def quantized_inputs(seed, batch, heads, slots, dim, bits, kv_len, layers=2):
    """Random codes and positive scales for every layer ([L, B, H, S, D'] and [L, B, H, S]);
    scales past each row's fill (and of every other layer) are NaN: never to be read."""
    rng = np.random.default_rng(seed)
    if bits == 8:
        codes = [rng.integers(-127, 128, (layers, batch, heads, slots, dim), dtype=np.int8) for _ in range(2)]
    else:
        codes = [rng.integers(0, 256, (layers, batch, heads, slots, dim // 2), dtype=np.uint8) for _ in range(2)]
    scales = [rng.uniform(0.005, 0.03, (layers, batch, heads, slots)).astype(np.float32) for _ in range(2)]
    for s in scales:
        s[:-1] = np.nan  # the layer read is the last one
        for b, n in enumerate(kv_len):
            s[-1, b, :, n:] = np.nan
    return codes, scales


def numpy_dequantize(codes, scales, bits):
    """The storage format's definition, in NumPy: int8 codes times the token's scale; int4:
    each byte holds element 2i in its low nibble and 2i + 1 in its high one, two's complement."""
    codes = np.asarray(codes)
    if bits == 8:
        values = codes.astype(np.float64)
    else:
        b = codes.astype(np.int64)
        values = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],))
        values[..., 0::2] = ((b & 15) ^ 8) - 8
        values[..., 1::2] = ((b >> 4) ^ 8) - 8
    return values * np.asarray(scales, np.float64)[..., None]


def quantized_view(codes, scales, kv_len, bits, dtype, scale_dtype, layer):
    from jaxkv.caches.views import QuantizedView

    k_scales, v_scales = (to_bits(jnp.asarray(s, scale_dtype), scale_dtype) for s in scales)
    batch, heads, dim = codes[0].shape[1], codes[0].shape[2], codes[0].shape[4] * (8 // bits)
    residual = jnp.zeros((batch, heads, 0, dim), dtype)
    return QuantizedView(jnp.asarray(codes[0]), jnp.asarray(codes[1]), k_scales, v_scales, residual, residual,
                         jnp.zeros((batch, 0), jnp.int32), layer, jnp.asarray(kv_len, jnp.int32), bits,
                         jnp.dtype(dtype), jnp.dtype(scale_dtype))


def bf16_rounded(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)


@pytest.mark.parametrize(
    "bits, dim, groups, tokens, window, softcap, dtype, scale_dtype",
    [
        (8, 64, 4, 1, None, None, jnp.float32, jnp.float32),  # a decode step
        (4, 64, 4, 1, None, None, jnp.float32, jnp.bfloat16),  # int4, bf16 scales (the default)
        (8, 32, 2, 3, 7, 4.0, jnp.bfloat16, jnp.bfloat16),  # window, soft cap, a bf16 model
        (4, 128, 3, 4, None, 5.0, jnp.float32, jnp.float32),
        (8, 24, 2, 2, None, None, jnp.float32, jnp.float32),  # off the vector path: scalar loops
        (4, 24, 1, 2, 9, None, jnp.float32, jnp.bfloat16),
    ],
)
def test_quantized_kernel_matches_reference_and_the_xla_loop(bits, dim, groups, tokens, window, softcap, dtype,
                                                             scale_dtype):
    """Row 0 is long enough to be split across threads and merged; row 2 is empty. Layer 1
    of 2 is read, through a traced layer index."""
    kv_len = np.array([2500, 37, 0])
    codes, scales = quantized_inputs(dim + bits, 3, 2, 2560, dim, bits, kv_len)
    q = np.random.default_rng(dim).standard_normal((3, 2 * groups, tokens, dim)).astype(np.float32)
    q = bf16_rounded(q) if dtype == jnp.bfloat16 else q
    q_pos = last_positions(kv_len, tokens)
    view = quantized_view(codes, scales, kv_len, bits, dtype, scale_dtype, layer=1)
    read_scales = [bf16_rounded(s) if scale_dtype == jnp.bfloat16 else s for s in scales]
    k, v = (numpy_dequantize(c[1], s[1], bits) for c, s in zip(codes, read_scales))
    want = dense_reference(q, k, v, q_pos, kv_len, window, softcap)

    def run(implementation, layer):
        return quantized_blockwise_attend(
            jnp.asarray(q, dtype), view._replace(layer=layer), q_positions=jnp.asarray(q_pos, jnp.int32),
            sliding_window=window, logit_softcap=softcap, implementation=implementation,
        )

    got = jax.jit(run, static_argnums=0)("kernel", jnp.int32(1))
    hlo = jax.jit(run, static_argnums=0).lower("auto", jnp.int32(1)).as_text()
    assert "jaxkv_quantized_decode_attention" in hlo  # "auto" takes the kernel on CPU
    tol = 2e-5 if dtype == jnp.float32 else 2**-7  # bf16: one rounding of the output (and of each element, by XLA)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    assert not np.asarray(got[2], np.float32).any()  # an empty row sees nothing: zeros
    xla = run("xla", 1)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dim,groups,softcap", [(16, 1, None), (64, 2, 50.0)])
def test_a_non_finite_value_whose_weight_underflows_still_makes_the_row_nan(dim, groups, softcap):
    """Several queries per row with different visible ranges (a verify step): a visible slot
    whose score is far below the maximum has softmax weight exactly 0 in float32, and the
    vector path skipped slots of weight 0 as if unseen, so its NaN / inf value was dropped
    and the row came out finite. The contract (the XLA path, the scalar path, one query per
    row) makes the row NaN; a query that does not see the slot is unaffected."""
    q = np.zeros((1, groups, 3, dim), np.float32)
    q[..., 0] = 8.0 * np.sqrt(dim)  # logit = 8 x key[0]
    k = np.zeros((1, 1, 5, dim), np.float32)
    k[0, 0, 1, 0], k[0, 0, 2, 0] = -400.0, 400.0  # slot 1 scores 6400 below slot 2 (before the cap)
    v = np.random.default_rng(0).standard_normal((1, 1, 5, dim)).astype(np.float32)
    q_pos = [[0, 2, 3]]  # query 0 sees slot 0 only; queries 1 and 2 see slot 1
    for bad in (np.nan, np.inf):
        v[0, 0, 1, 3] = bad
        for implementation in ("kernel", "xla"):
            got = np.asarray(blockwise_attend(
                jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos, jnp.int32),
                kv_lengths=jnp.asarray([4], jnp.int32), implementation=implementation, logit_softcap=softcap))
            assert np.isnan(got[0, :, 1:]).all(), (implementation, bad)
            np.testing.assert_allclose(got[0, :, 0], np.broadcast_to(v[0, 0, 0], (groups, dim)), rtol=1e-6)


def test_quantized_kernel_non_finite_scales_of_visible_slots_make_the_row_nan():
    """The contract of jaxkv.attention: a non-finite key scale gives a visible slot a
    non-finite logit, a non-finite value scale a non-finite value: the row is NaN, in both
    implementations; the other rows, and a NaN scale no query sees, change nothing."""
    kv_len = np.array([40, 40, 40])
    codes, scales = quantized_inputs(5, 3, 1, 64, 32, 8, kv_len)
    scales[0][1, 0, 0, 3] = np.inf  # row 0: a key scale of a visible slot
    scales[1][1, 1, 0, 39] = np.nan  # row 1: a value scale of a visible slot
    q = np.random.default_rng(1).standard_normal((3, 2, 1, 32)).astype(np.float32)
    q_pos = last_positions(kv_len, 1)
    view = quantized_view(codes, scales, kv_len, 8, jnp.float32, jnp.float32, layer=1)
    clean = [s.copy() for s in scales]
    clean[0][1, 0, 0, 3], clean[1][1, 1, 0, 39] = 0.01, 0.01
    k, v = (numpy_dequantize(c[1], s[1], 8) for c, s in zip(codes, clean))
    want = dense_reference(q, k, v, q_pos, kv_len)
    for implementation in ("kernel", "xla"):
        got = np.asarray(quantized_blockwise_attend(jnp.asarray(q), view, q_positions=jnp.asarray(q_pos, jnp.int32),
                                                    implementation=implementation))
        assert np.isnan(got[:2]).all(), implementation
        np.testing.assert_allclose(got[2], want[2], rtol=2e-5, atol=2e-5)


def test_quantized_cache_attention_and_what_the_quantized_kernel_does_not_take():
    """Through the cache: a QuantizedCache, with or without a residual, reaches the kernel
    (vmap too); with float16 scales or float16 queries "auto" runs the XLA loop and
    "kernel" says why it cannot."""
    from jaxkv import QuantizedCache
    from jaxkv.attention import token_positions, update_and_attend

    rng = np.random.default_rng(3)
    k_new, v_new = (jnp.asarray(rng.standard_normal((2, 2, 5, 32)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 4, 5, 32)), jnp.float32)  # 4 query heads over 2 kv heads

    def step(q, k, v, cache):
        return update_and_attend(q, k, v, cache, 0, positions=token_positions(cache, q.shape[0], q.shape[2]))

    plain = QuantizedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=32, max_length=64, bits=4)
    with_residual = QuantizedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=32, max_length=64, bits=4,
                                        residual_length=8)
    one = (q[:, :, :1], k_new[:, :, :1], v_new[:, :, :1])
    assert "jaxkv_quantized_decode_attention" in jax.jit(step).lower(*one, plain).as_text()
    assert "jaxkv_quantized_decode_attention" in jax.jit(step).lower(*one, with_residual).as_text()
    # Five tokens in, then one query under vmap: the kernel's output equals the dense
    # reference over the cache's own dequantized layer (its dense view: the residual's exact
    # tokens patched over their codes).
    last = q[:, :, -1:] * 0.5
    for empty in (plain, with_residual):
        _, cache = step(q, k_new, v_new, empty)
        out = jax.vmap(lambda q: quantized_blockwise_attend(q, cache.view(0), q_positions=jnp.full((2, 1), 4, jnp.int32),
                                                            implementation="kernel"))(jnp.stack([last, 2 * last]))
        dense = cache.view(0).dense()
        for i, factor in enumerate((1, 2)):
            want = dense_reference(np.asarray(last) * factor, np.asarray(dense.keys), np.asarray(dense.values),
                                   np.full((2, 1), 4), [5, 5])
            np.testing.assert_allclose(np.asarray(out[i]), want, rtol=2e-5, atol=2e-5)

    kw = dict(q_positions=jnp.full((2, 1), 4, jnp.int32), implementation="kernel")
    f16_scales = QuantizedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=32, max_length=64, bits=8,
                                     scale_dtype=jnp.float16)
    with pytest.raises(ValueError, match="scales of dtype float16"):
        quantized_blockwise_attend(last, f16_scales.view(0), **kw)
    with pytest.raises(ValueError, match="float16"):
        quantized_blockwise_attend(last.astype(jnp.float16), plain.view(0), **kw)


@pytest.mark.parametrize(
    "bits, dim, groups, tokens, window, dtype, scale_dtype",
    [
        (8, 64, 4, 1, None, jnp.float32, jnp.bfloat16),
        (4, 32, 2, 4, 9, jnp.float32, jnp.float32),
        (4, 64, 2, 2, None, jnp.bfloat16, jnp.bfloat16),
        (8, 24, 3, 1, None, jnp.float32, jnp.float32),  # scalar loops
    ],
)
def test_paged_quantized_kernel_matches_reference(bits, dim, groups, tokens, window, dtype, scale_dtype):
    """int8/int4 pages in shuffled order: the codes and scales of the same token lie at the same
    (page, offset); row 0 spans many pages (split across threads), row 2 has none."""
    kv_len = np.array([1500, 37, 0])
    codes, scales = quantized_inputs(bits + dim, 3, 2, 1536, dim, bits, kv_len, layers=1)
    q = np.random.default_rng(dim + 1).standard_normal((3, 2 * groups, tokens, dim)).astype(np.float32)
    q = bf16_rounded(q) if dtype == jnp.bfloat16 else q
    q_pos = last_positions(kv_len, tokens)
    # Pools as to_pages lays them out (same seed, so the same block table for all four).
    k_pool, v_pool, table = to_pages(codes[0][0], codes[1][0], kv_len, 16, fill=0)
    ks_pool, vs_pool, table2 = to_pages(scales[0][0][..., None], scales[1][0][..., None], kv_len, 16)
    np.testing.assert_array_equal(table, table2)
    k_scales, v_scales = (to_bits(jnp.asarray(x[..., 0], scale_dtype), scale_dtype) for x in (ks_pool, vs_pool))
    view = PagedView(jnp.asarray(k_pool), jnp.asarray(v_pool), k_scales, v_scales, jnp.asarray(table), 0,
                     jnp.asarray(kv_len, jnp.int32), bits, jnp.dtype(dtype), jnp.dtype(scale_dtype))
    read_scales = [bf16_rounded(s) if scale_dtype == jnp.bfloat16 else s for s in scales]
    k, v = (numpy_dequantize(c[0], s[0], bits) for c, s in zip(codes, read_scales))
    want = dense_reference(q, k, v, q_pos, kv_len, window)
    got = paged_blockwise_attend(jnp.asarray(q, dtype), view, q_positions=jnp.asarray(q_pos, jnp.int32),
                                 sliding_window=window, implementation="kernel")
    tol = 2e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    assert not np.asarray(got[2], np.float32).any()


@pytest.mark.parametrize("bits, dim, dtype", [(8, 64, jnp.float32), (4, 32, jnp.bfloat16), (4, 24, jnp.float32)])
def test_quantized_kernel_reads_the_residual_tokens_instead_of_their_codes(bits, dim, dtype):
    """A residual slot holding position p (0 <= p < length) replaces slot p's codes: those
    slots' scales are NaN here, so reading them would poison the row. Slots whose position is
    -1 or past the length hold NaN tokens and are unused; positions need not be the last ones."""
    kv_len = np.array([700, 30, 0])
    codes, scales = quantized_inputs(bits * dim, 3, 2, 768, dim, bits, kv_len)
    rng = np.random.default_rng(dim)
    positions = np.array([[699, 698, 5, -1, 700, 350], [29, 0, 31, -1, -1, -1], [0, 1, -1, -1, -1, -1]], np.int32)
    exact = [rng.standard_normal((3, 2, 6, dim)).astype(np.float32) for _ in range(2)]
    exact = [bf16_rounded(x) if dtype == jnp.bfloat16 else x for x in exact]
    for b in range(3):
        for r, p in enumerate(positions[b]):
            if 0 <= p < kv_len[b]:
                for s in scales:
                    s[1, b, :, p] = np.nan  # the quantized copy: never read
            else:
                for x in exact:
                    x[b, :, r] = np.nan  # an unused residual slot
    q = rng.standard_normal((3, 4, 2, dim)).astype(np.float32)
    q = bf16_rounded(q) if dtype == jnp.bfloat16 else q
    q_pos = last_positions(kv_len, 2)
    view = quantized_view(codes, scales, kv_len, bits, dtype, jnp.float32, layer=1)._replace(
        residual_keys=jnp.asarray(exact[0], dtype), residual_values=jnp.asarray(exact[1], dtype),
        residual_positions=jnp.asarray(positions))
    k, v = (numpy_dequantize(c[1], sc[1], bits) for c, sc in zip(codes, scales))
    for b in range(3):
        for r, p in enumerate(positions[b]):
            if 0 <= p < kv_len[b]:
                k[b, :, p], v[b, :, p] = exact[0][b, :, r], exact[1][b, :, r]
    want = dense_reference(q, k, v, q_pos, kv_len)
    tol = 2e-5 if dtype == jnp.float32 else 2**-7
    for implementation in ("kernel", "xla"):
        got = quantized_blockwise_attend(jnp.asarray(q, dtype), view, q_positions=jnp.asarray(q_pos, jnp.int32),
                                         implementation=implementation)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol, err_msg=implementation)

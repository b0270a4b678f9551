"""Blockwise attention against a NumPy full-attention reference and against `attend`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.attention import attend
from jaxkv.attention.blockwise import blockwise_attend
from reference import make_inputs, numpy_attention

# float32 loop and kernel against the float64 reference: measured at most 1.25e-6 abs, 3.7e-7
# relative (outputs ~3); 2e-5 let a logit scale off by 2**-15 through (review 74).
F32_TOL = 5e-6


# Both implementations: the XLA loop (any platform) and, on CPU, the native kernel.
IMPLS = ["xla", "kernel"]


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    tokens=st.integers(1, 5),
    slots=st.integers(1, 40),
    block=st.sampled_from([1, 3, 8, 16, 64]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    softcap=st.one_of(st.none(), st.just(5.0)),
    data=st.data(),
)
def test_blockwise_matches_numpy_reference(impl, seed, batch, groups, tokens, slots, block, window, softcap, data):
    h, dim = 2, data.draw(st.sampled_from([4, 16]), label="dim")
    kv_len = np.array(data.draw(st.lists(st.integers(0, slots), min_size=batch, max_size=batch)))
    # Queries are the last `tokens` positions of each row (a chunk just written), or any
    # positions (e.g. past the fill) for a stress case.
    q_pos = np.stack([np.maximum(kv_len[b] - tokens, 0) + np.arange(tokens) for b in range(batch)])
    q, k, v = make_inputs(seed, batch, h * groups, h, tokens, slots, dim, kv_len)
    # Under jit: one program per example (eagerly the XLA loop dispatched ~30 small programs
    # per example, 21 s for the 15 examples; the eager path is covered by the tests below).
    fn = jax.jit(lambda q, k, v, q_pos, kv_len: blockwise_attend(
        q, k, v, q_positions=q_pos, kv_lengths=kv_len, sliding_window=window, logit_softcap=softcap,
        block_size=block, implementation=impl,
    ))
    got = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos, jnp.int32),
             jnp.asarray(kv_len, jnp.int32))
    want = numpy_attention(q, k, v, q_pos, kv_len, window, softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=F32_TOL, atol=F32_TOL)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    tokens=st.integers(17, 24),
    slots=st.integers(17, 80),
    block=st.sampled_from([8, 16, 64]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    data=st.data(),
)
def test_prefill_chunks_read_whole_blocks_and_match_numpy(seed, tokens, slots, block, window, data):
    # More than PARTIAL_BLOCK_MAX_QUERIES queries: the loop reads the last partial block
    # whole, as the last trip of the masked-block loop (the property test above covers the
    # decode-sized chunks, whose last block is read at one of four sizes).
    kv_len = np.array(data.draw(st.lists(st.integers(0, slots), min_size=2, max_size=2)))
    q_pos = np.stack([np.maximum(kv_len[b] - tokens, 0) + np.arange(tokens) for b in range(2)])
    q, k, v = make_inputs(seed, 2, 4, 2, tokens, slots, 8, kv_len)
    fn = jax.jit(lambda q, k, v, q_pos, kv_len: blockwise_attend(
        q, k, v, q_positions=q_pos, kv_lengths=kv_len, sliding_window=window, block_size=block,
        implementation="xla",
    ))
    got = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos, jnp.int32),
             jnp.asarray(kv_len, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, q_pos, kv_len, window), rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_equals_attend_under_jit_with_ragged_rows(impl):
    kv_len = np.array([700, 5, 0])
    q, k, v = make_inputs(1, 3, 4, 2, 1, 1024, 16, kv_len)
    q_pos = (np.maximum(kv_len - 1, 0))[:, None]
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    kw = dict(q_positions=jnp.asarray(q_pos, jnp.int32), kv_lengths=jnp.asarray(kv_len, jnp.int32))
    got = jax.jit(lambda q, k, v: blockwise_attend(q, k, v, block_size=128, implementation=impl, **kw))(*args)
    want = attend(*args, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[2]).any()  # a row with nothing to see gets zeros


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_reads_only_filled_blocks(impl):
    """inf in the blocks past every row's fill never reaches the result. (Masking alone
    would also keep it out: which blocks are read is checked by the next test.)"""
    kv_len = np.array([10, 20])
    q, k, v = make_inputs(2, 2, 2, 2, 1, 256, 8, kv_len, nan_fill=False)
    k[:, :, 32:] = np.inf  # past the second block of 16: never visited
    q_pos = (kv_len - 1)[:, None]
    got = blockwise_attend(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos, jnp.int32),
        kv_lengths=jnp.asarray(kv_len, jnp.int32), block_size=16, implementation=impl,
    )
    want = numpy_attention(q, k, v, q_pos, kv_len)
    np.testing.assert_allclose(np.asarray(got), want, rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize("window", [None, 20])
def test_the_loop_reads_only_blocks_that_hold_visible_slots(window):
    """The masked loop body zeroes what it must not see, so numbers alone cannot tell
    whether a block was read: a reader that records every (offset, size) it is asked for
    can. Slots past every row's fill, and with a window slots before every query's window,
    are never read, yet the result equals the NumPy reference."""
    from jaxkv.attention.blockwise import _blockwise_loop

    slots, block = 256, 16
    kv_len = np.array([150, 170])
    q, k, v = make_inputs(4, 2, 4, 2, 1, slots, 8, kv_len)
    q_pos = (kv_len - 1)[:, None]
    reads = []

    def read_block(offset, size):
        jax.debug.callback(lambda o: reads.append((int(o), size)), offset, ordered=True)
        return tuple(jax.lax.dynamic_slice_in_dim(jnp.asarray(x), offset, size, axis=2) for x in (k, v))

    def run(q):
        return _blockwise_loop(
            q, read_block, slots, 2, jnp.asarray(q_pos, jnp.int32),
            jnp.asarray(kv_len, jnp.int32), sliding_window=window, logit_softcap=None, scale=8**-0.5,
            block_size=block,
        )

    got = jax.jit(run)(jnp.asarray(q))
    jax.effects_barrier()
    want = numpy_attention(q, k, v, q_pos, kv_len, window=window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=F32_TOL, atol=F32_TOL)
    assert reads, "the reader was never called"
    first = 0 if window is None else int(kv_len.min()) - window  # the earliest visible slot
    for offset, size in reads:
        assert offset + size > first and offset < kv_len.max(), (offset, size, reads)
    # Each visible slot is read once: the reads cover [first block, last filled slot) exactly.
    covered = sorted(reads)
    assert covered[0][0] == first // block * block and covered[-1][0] + covered[-1][1] >= kv_len.max()
    assert all(a[0] + a[1] <= b[0] for a, b in zip(covered, covered[1:])), covered


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_bf16_inputs_keep_dtype(impl):
    kv_len = np.array([9])
    q, k, v = make_inputs(3, 1, 2, 1, 2, 16, 8, kv_len)
    q_pos = np.array([[7, 8]])
    got = blockwise_attend(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
        q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len), block_size=4, implementation=impl,
    )
    assert got.dtype == jnp.bfloat16
    # The reference over the bf16-rounded inputs: what is left is the loop's own rounding
    # (bf16 weights and output, 2**-7 relative); 3e-2 let a 2% bias through (review 70).
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v)]
    want = numpy_attention(*rounded, q_pos, kv_len)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(sliding_window=0), "sliding_window must be a positive int"),
        (dict(kv_lengths=jnp.zeros((3,), jnp.int32)), "kv_lengths"),
        (dict(implementation="pallas"), "implementation must be"),
        (dict(logit_softcap=0.0), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        (dict(logit_softcap=float("inf")), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        (dict(logit_softcap=3e38), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
        # 1e-46 is 0 in the kernels' float32 attribute, where 0 is "no cap": the kernel and the
        # Pallas path gave the uncapped result where dense and the XLA loop gave the capped one
        (dict(logit_softcap=1e-46), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
    ],
)
def test_blockwise_bad_input(kwargs, match):
    q = jnp.zeros((2, 2, 1, 4))
    k = jnp.zeros((2, 1, 8, 4))
    args = dict(q_positions=jnp.zeros((2, 1), jnp.int32), kv_lengths=jnp.zeros((2,), jnp.int32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        blockwise_attend(q, k, k, **args)


def test_every_loop_refuses_float_positions_and_3d_queries():
    """Float positions or lengths were truncated by the int32 cast on the XLA loop, the CPU
    kernel and Pallas (position 4.9 read as 4) while dense attention refused them; 3-D
    queries were Python's "not enough values to unpack" on the paged and quantized loops."""
    from jaxkv.attention import paged_blockwise_attend, pallas_attend_view, quantized_blockwise_attend
    from jaxkv.caches import PagedCache, QuantizedCache, StaticCache

    sizes = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=16, max_length=32)
    k = jnp.ones((1, 1, 3, 16))
    q, pos = jnp.ones((1, 2, 1, 16)), jnp.asarray([[2]], jnp.int32)
    with pytest.raises(TypeError, match="blockwise_attend: q_positions must be an integer array, got dtype float32"):
        blockwise_attend(q, k, k, q_positions=pos.astype(jnp.float32), kv_lengths=jnp.asarray([3]))
    with pytest.raises(TypeError, match="kv_lengths must be an integer array, got dtype float32"):
        blockwise_attend(q, k, k, q_positions=pos, kv_lengths=jnp.asarray([3.0]))
    for cache, loop in ((PagedCache.init(**sizes, page_size=16), paged_blockwise_attend),
                        (QuantizedCache.init(**sizes), quantized_blockwise_attend)):
        _, view = cache.write(k, k, 0)
        who = loop.__name__
        with pytest.raises(TypeError, match=f"{who}: q_positions must be an integer array"):
            loop(q, view, q_positions=jnp.asarray([[2.9]]))
        with pytest.raises(TypeError, match=f"{who}: lengths must be an integer array"):
            loop(q, view._replace(lengths=view.lengths.astype(jnp.float32)), q_positions=pos)
        with pytest.raises(ValueError, match=rf"{who}: expected queries \[B, Hq, T, D\], got shape \(1, 2, 16\)"):
            loop(q[:, :, 0], view, q_positions=pos)
    _, view = StaticCache.init(**sizes).write(k, k, 0)
    with pytest.raises(TypeError, match="pallas_attend_view: q_positions must be an integer array"):
        pallas_attend_view(q, view, q_positions=jnp.asarray([[2.9]]), interpret=True)


def test_blockwise_refuses_integer_buffers_without_kv_dtype():
    # uint16 bits of bf16 values read as integers would attend over the raw bit patterns.
    q, bits = jnp.zeros((2, 2, 1, 4)), jnp.zeros((2, 1, 8, 4), jnp.uint16)
    args = dict(q_positions=jnp.zeros((2, 1), jnp.int32), kv_lengths=jnp.ones((2,), jnp.int32))
    with pytest.raises(TypeError, match="uint16/uint16 are not a float cache; .* needs kv_dtype"):
        blockwise_attend(q, bits, bits, **args)
    out = blockwise_attend(q, bits, bits, kv_dtype=jnp.bfloat16, **args)  # the documented form
    assert out.shape == (2, 2, 1, 4) and np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_blockwise_reads_a_stacked_cache_by_layer_index(impl):
    kv_len = np.array([13, 6])
    stacked = [make_inputs(s, 2, 4, 2, 2, 32, 8, kv_len) for s in range(3)]
    q = jnp.asarray(stacked[0][0])
    keys = jnp.stack([jnp.asarray(k) for _, k, _ in stacked])  # [L, B, H, S, D]
    values = jnp.stack([jnp.asarray(v) for _, _, v in stacked])
    kw = dict(q_positions=jnp.asarray((kv_len - 2)[:, None] + np.arange(2), jnp.int32),
              kv_lengths=jnp.asarray(kv_len, jnp.int32), block_size=8, implementation=impl)
    for layer in range(3):
        want = numpy_attention(np.asarray(q), np.asarray(keys[layer]), np.asarray(values[layer]),
                               np.asarray(kw["q_positions"]), kv_len)
        got = jax.jit(lambda q, k, v, i: blockwise_attend(q, k, v, layer_idx=i, **kw))(q, keys, values, jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(got), want, rtol=F32_TOL, atol=F32_TOL)
    with pytest.raises(ValueError, match="stacked, with layer_idx"):
        blockwise_attend(q, keys[0], values[0], layer_idx=0, **kw)


def assert_xla_loop_matches_reference(q, k, v, q_pos, kv_len, window, block_size):
    got = jax.jit(lambda q, k, v: blockwise_attend(
        q, k, v, q_positions=jnp.asarray(q_pos, jnp.int32), kv_lengths=jnp.asarray(kv_len, jnp.int32),
        sliding_window=window, block_size=block_size, implementation="xla",
    ))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, q_pos, kv_len, window), rtol=F32_TOL, atol=F32_TOL)


@pytest.mark.parametrize(
    "kv_len, q_pos, window",
    [
        ([37, 37], [[36], [36]], None),  # 4 full blocks of 8 (unmasked body) + a partial one
        ([37, 19], [[36], [18]], None),  # ragged: the unmasked range ends at the short row
        ([37, 30], [[36], [29]], 12),  # window: blocks before every window and at its edge masked
        ([40, 40], [[32, 35, 39], [32, 35, 39]], 20),  # a 3-token chunk (causal edge inside a block)
        ([40, 33], [[37, 38, 39], [30, 31, 32]], None),
    ],
)
def test_unmasked_blocks_and_masked_edges_equal_reference(kv_len, q_pos, window):
    """XLA loop: blocks every query sees in full take the unmasked loop body; the rest are masked.
    NaN in unfilled slots proves the unmasked body never reads a slot it should not."""
    kv_len, q_pos = np.array(kv_len), np.array(q_pos)
    q, k, v = make_inputs(5, 2, 4, 2, q_pos.shape[1], 48, 8, kv_len)
    assert_xla_loop_matches_reference(q, k, v, q_pos, kv_len, window, block_size=8)


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("kv_len", [[129, 129], [150, 77], [192, 64], [200, 1], [65, 200]])
def test_quarter_block_tail_equals_reference(kv_len, window):
    """XLA loop, blocks of 64: the partial last block is read in quarter blocks of 16 (one decode step
    just past a block boundary reads 16 slots, not 64); every fill ends up in the result."""
    kv_len = np.array(kv_len)
    q_pos = (kv_len - 1)[:, None]
    q, k, v = make_inputs(6, 2, 4, 2, 1, 200, 8, kv_len)
    assert_xla_loop_matches_reference(q, k, v, q_pos, kv_len, window, block_size=64)


@pytest.mark.parametrize("kind", ["static", "quantized", "paged", "hybrid"])
def test_every_kind_reads_only_the_blocks_it_filled(kind, monkeypatch):
    """A decode step over a 4096-slot layer holding 150 / 170 tokens reads at most the first
    256 slots, whatever the layout: the dispatch reaches the data-bounded loop for every kind
    (a recording reader around the loop's block reads; the CPU kernel is turned off so that
    the XLA loop runs). The result equals the NumPy reference."""
    import jaxkv.attention.blockwise as bw
    from jaxkv import HybridCache, PagedCache, StaticCache
    from jaxkv.attention import attend_view
    from jaxkv.caches import QuantizedCache

    monkeypatch.setenv("JAXKV_CPU_KERNEL", "0")
    reads, loop = [], bw._blockwise_loop

    def recording_loop(queries, read_block, *args, **kwargs):
        def read(offset, size):
            jax.debug.callback(lambda o: reads.append((int(o), size)), offset, ordered=True)
            return read_block(offset, size)

        return loop(queries, read, *args, **kwargs)

    monkeypatch.setattr(bw, "_blockwise_loop", recording_loop)
    capacity, fill = 4096, np.array([150, 170])
    shape = dict(batch_size=2, num_kv_heads=2, head_dim=8, max_length=capacity)
    cache, layer = {
        "static": lambda: (StaticCache.init(num_layers=1, **shape), 0),
        "quantized": lambda: (QuantizedCache.init(num_layers=1, bits=8, residual_length=170, **shape), 0),
        "paged": lambda: (PagedCache.init(num_layers=1, page_size=16, **shape), 0),
        "hybrid": lambda: (HybridCache.init(layer_types=["sliding_attention", "full_attention"], window=8, **shape), 1),
    }[kind]()
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((2, 2, 170, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    cache, _, _ = cache.update(jnp.asarray(k), jnp.asarray(v), layer, num_new=jnp.asarray(fill, jnp.int32))

    def step(cache, q):
        return attend_view(q, cache.view(layer), q_positions=cache.seq_lengths(layer)[:, None] - 1)

    got = jax.jit(step)(cache, jnp.asarray(q))
    jax.effects_barrier()
    # The quantized residual holds all 170 tokens exactly, so every kind matches tightly.
    want = numpy_attention(q, k, v, (fill - 1)[:, None], fill)
    np.testing.assert_allclose(np.asarray(got), want, rtol=F32_TOL, atol=F32_TOL)
    assert reads, "the loop never read a block"
    assert max(offset + size for offset, size in reads) <= 256, reads


def _edge_case(seed=1):
    rng = np.random.default_rng(seed)
    batch, heads, groups, tokens, dim, slots, layers = 2, 1, 2, 2, 16, 40, 2
    q = rng.standard_normal((batch, heads * groups, tokens, dim)).astype(np.float32)
    k = rng.standard_normal((layers, batch, heads, slots, dim)).astype(np.float32)
    v = rng.standard_normal((layers, batch, heads, slots, dim)).astype(np.float32)
    kv_len, q_pos = np.array([33, 20]), np.array([[31, 32], [18, 19]], np.int32)
    return q, k, v, kv_len, q_pos


def test_gradient_is_finite_with_nan_in_unfilled_slots():
    """jax.grad through attention (dense, XLA loop, kernel: its derivative is the loop's)
    with NaN keys and inf values in every unfilled slot equals the gradient with zeros there
    and the float64 reference's finite difference. It was NaN everywhere: the unseen slots'
    zero cotangents met their NaN keys in the product's derivative."""
    q, k, v, kv_len, q_pos = _edge_case()
    dirty_k, dirty_v = k.copy(), v.copy()
    for b, n in enumerate(kv_len):
        dirty_k[:, b, :, n:], dirty_v[:, b, :, n:] = np.nan, np.inf
        k[:, b, :, n:], v[:, b, :, n:] = 0.0, 0.0
    dq = np.random.default_rng(2).standard_normal(q.shape)
    options = dict(q_positions=jnp.asarray(q_pos), kv_lengths=jnp.asarray(kv_len), sliding_window=9, logit_softcap=4.0)
    eps = 1e-4
    finite_difference = np.sum(
        numpy_attention(q + eps * dq, k[1], v[1], q_pos, kv_len, 9, 4.0)
        - numpy_attention(q - eps * dq, k[1], v[1], q_pos, kv_len, 9, 4.0)
    ) / (2 * eps)
    def losses(q, keys, values):  # one program: eagerly each gradient compiled op by op
        return (jnp.sum(attend(q, keys[1], values[1], **options)),
                *(jnp.sum(blockwise_attend(q, keys, values, layer_idx=1, implementation=name, **options))
                  for name in ("xla", "kernel")))

    grads = jax.jit(jax.jacrev(losses))
    dirty = grads(jnp.asarray(q), jnp.asarray(dirty_k), jnp.asarray(dirty_v))
    clean = grads(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for name, d, c in zip(("dense", "xla", "kernel"), dirty, clean):
        d = np.asarray(d)
        assert np.isfinite(d).all(), name
        np.testing.assert_allclose(d, np.asarray(c), rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.sum(d * dq), finite_difference, rtol=1e-3, err_msg=name)


def test_loop_edges_a_traced_scale_a_bad_layer_long_lengths_and_huge_positions():
    """The XLA loop on inputs only the direct API can give it (each was silently wrong or a
    bare tracer error; the kernel's answer, or a clear error, now on every path):
    a traced scale under jit falls back to the loop (auto), a Python layer index outside
    [0, L) is a ValueError (the loop clamped it onto layer L - 1), lengths past the capacity
    read as the capacity (a block was counted twice), and a query at position 2**31 - 1 sees
    the filled slots (the + 1 wrapped, so it saw nothing)."""
    q, k, v, kv_len, q_pos = _edge_case()
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))

    def run(implementation, q_pos=q_pos, kv_len=kv_len, scale=None, layer=1):
        return np.asarray(blockwise_attend(*args, layer_idx=layer, q_positions=jnp.asarray(q_pos),
                                           kv_lengths=jnp.asarray(kv_len), scale=scale, block_size=16,
                                           implementation=implementation))

    traced = jax.jit(lambda s: blockwise_attend(*args, layer_idx=1, q_positions=jnp.asarray(q_pos),
                                                kv_lengths=jnp.asarray(kv_len), scale=s))(jnp.float32(0.3))
    np.testing.assert_allclose(np.asarray(traced), run("xla", scale=0.3), rtol=1e-5, atol=1e-6)
    for layer in (2, -1):
        with pytest.raises(ValueError, match=rf"layer index {layer} is outside \[0, 2\)"):
            run("xla", layer=layer)
    full = np.array([40, 40])
    want = numpy_attention(q, k[1], v[1], q_pos, full)
    np.testing.assert_allclose(run("xla", kv_len=np.array([100, 60])), want, rtol=1e-5, atol=1e-6)
    late = np.full_like(q_pos, 2**31 - 1)
    np.testing.assert_allclose(run("xla", q_pos=late, kv_len=full), numpy_attention(q, k[1], v[1], np.full_like(q_pos, 39), full),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_very_negative_query_position_and_windows_past_int32(impl):
    """A padding row at position -2**31 beside a real one, with a window and blocks smaller
    than the buffer: min(q) - W + 1 wrapped past int32 and the loop skipped the real row's
    blocks (it read zeros); a window past int32's range raised OverflowError. Both now equal
    the float64 reference (the kernel's answer already did)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 2, 1, 16), (2, 1, 8, 16), (2, 1, 8, 16)))
    q_pos, kv_len = np.array([[-2**31], [5]]), np.array([0, 6])
    for window in (4, 9, 2**31 - 1, 2**31 + 5, 2**64 + 3):  # past int64: the kernel's attribute overflowed
        got = np.asarray(blockwise_attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                                          kv_lengths=jnp.asarray(kv_len), sliding_window=window, block_size=4,
                                          implementation=impl))
        want = numpy_attention(q, k, v, q_pos, kv_len, min(window, 2**40), None)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6, err_msg=f"window {window}")
        if impl == "xla":  # the dense path (rings, DynamicCache layers) raised OverflowError past int32
            dense = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), q_positions=jnp.asarray(q_pos),
                           kv_lengths=jnp.asarray(kv_len), sliding_window=window)
            np.testing.assert_allclose(np.asarray(dense)[1], want[1], rtol=1e-5, atol=1e-6, err_msg=f"dense {window}")


@pytest.mark.parametrize("impl", IMPLS)
def test_no_queries_give_an_empty_output(impl):
    """T = 0 (an empty chunk): the kernel returned the empty array, the XLA loop raised
    NumPy's "zero-size array to reduction operation max"; both return it now."""
    out = blockwise_attend(jnp.zeros((2, 4, 0, 16)), jnp.ones((2, 2, 8, 16)), jnp.ones((2, 2, 8, 16)),
                           q_positions=jnp.zeros((2, 0), jnp.int32), kv_lengths=jnp.array([3, 4]), implementation=impl)
    assert out.shape == (2, 4, 0, 16) and out.dtype == jnp.float32


@pytest.mark.parametrize("impl", IMPLS)
def test_a_logit_far_below_the_max_weighs_nothing(impl):
    """A slot 200 below the top logit has weight e^-200: nothing, even under a value near
    float32's max (the kernel floored every weight at e^-87, and 3e38 * e^-87 is 4.9)."""
    q = np.zeros((1, 1, 1, 16), np.float32)
    q[..., 0] = 1.0
    k = np.zeros((1, 1, 1, 2, 16), np.float32)
    k[..., 0, 0], k[..., 1, 0] = 400.0, -400.0  # logits +-100 at scale 1/4
    v = np.zeros((1, 1, 1, 2, 16), np.float32)
    v[..., 1, :] = 3e38
    out = blockwise_attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer_idx=0, q_positions=jnp.array([[1]]),
                           kv_lengths=jnp.array([2]), implementation=impl)
    np.testing.assert_array_equal(np.asarray(out), 0.0)

"""QuantizedCache: quantizer error bound (all-zero tokens, int4 packing), memory ratios,
dequantized contents against the NumPy model (exact tokens) within the derived bound,
residual exactness, overflow that drops without clamping codes or residual, and the error
paths.

The protocol every kind shares (random op programs against the NumPy model with NaN/inf
in unused slots, eager == jit, vmap, scan over layers, donation, the overflow policy,
traced bad row indices, the crop rule, pickling) is tested once per kind, int8 and int4,
in test_conformance.py."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import INVALID, OVERFLOW, CacheError, StaticCache
from jaxkv.caches import QuantizedCache, dequantize, quantize
from reference import ReferenceCache

L, B, H, D, S = 2, 2, 2, 4, 12
QMAX = {8: 127, 4: 7}


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def make(bits=8, residual=0, batch=B, max_length=S, dtype=jnp.float32, head_dim=D):
    return QuantizedCache.init(
        num_layers=L, batch_size=batch, num_kv_heads=H, head_dim=head_dim, max_length=max_length,
        bits=bits, residual_length=residual, dtype=dtype,
    )


def rand(rng, batch, t, scale=3.0):
    return (scale * rng.standard_normal((batch, H, t, D))).astype(np.float32)


def error_bound(x, bits):
    """Per-token bound on |x - dequantize(quantize(x))| for a bfloat16 scale rounded up:
    scale <= max|x| / qmax * (1 + 2**-7), error <= scale / 2; plus f32 rounding slack."""
    absmax = np.abs(x).max(axis=-1, keepdims=True)
    return absmax / (2 * QMAX[bits]) * (1 + 2.0**-7) + 1e-6 * np.abs(x) + 1e-30


# ------------------------------------------------------------------------ quantizer


@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_error_bound_zero_tokens_and_packing(bits):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 128)) * rng.lognormal(0, 3, (64, 1))).astype(np.float32)
    x[3] = 0.0  # an all-zero token
    x[5, 7] = -1e30  # extreme range stays finite
    q, scale = quantize(x, bits)
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.shape == (64, 128 if bits == 8 else 64) and scale.dtype == jnp.bfloat16
    deq = np.asarray(dequantize(q, scale, bits))
    assert np.isfinite(deq).all()
    assert (np.abs(deq - x) <= error_bound(x, bits)).all()
    np.testing.assert_array_equal(deq[3], 0.0)
    assert float(scale[3]) == 0.0
    # Integers in [-qmax, qmax] with max |x| = qmax get scale 1: the round trip is exact,
    # which pins the nibble order and sign extension of the int4 packing.
    ints = rng.integers(-QMAX[bits], QMAX[bits] + 1, (16, 8)).astype(np.float32)
    ints[:, 0] = QMAX[bits]
    q, scale = quantize(ints, bits)
    np.testing.assert_array_equal(dequantize(q, scale, bits), ints)
    if bits == 4:
        np.testing.assert_array_equal(np.asarray(q[:, 0]) & 0xF, QMAX[4])  # element 0: low nibble
    # float16 scales: a token past qmax * 65504 saturates at float16's largest scale (its
    # large elements clip there) instead of an inf scale that dequantizes to NaN.
    top = QMAX[bits] * 65504.0
    big = np.array([[1e7, -3.0, 1.0, 0.0], [100.0, 1.0, -2.0, 0.5]], np.float32)
    q, scale = quantize(big, bits, scale_dtype=jnp.float16)
    deq = np.asarray(dequantize(q, scale, bits))
    assert np.isfinite(deq).all() and float(scale[0]) == 65504.0
    np.testing.assert_allclose(deq[0, 0], top)
    assert (np.abs(deq[0, 1:] - big[0, 1:]) <= 65504.0 / 2).all()
    assert (np.abs(deq[1] - big[1]) <= error_bound(big[1:], bits)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_scales_of_tiny_tokens_stay_within_half_a_scale(bits):
    """Below float16's smallest normal a scale has few significant bits: rounded up it can
    be several times max|x| / qmax (the docstring's relative bound no longer holds, it says
    so), but every element stays within scale / 2 of its code and nothing clips."""
    x = np.random.default_rng(5).standard_normal((4, 16)) * np.array([1e-2, 1e-4, 1e-5, 1e-6])[:, None]
    codes, scales = quantize(jnp.asarray(x, jnp.float32), bits, scale_dtype=jnp.float16)
    deq = np.asarray(dequantize(codes, scales, bits, jnp.float32), np.float64)
    scale = np.asarray(scales, np.float64)
    qmax = 127 if bits == 8 else 7
    assert (scale >= np.abs(x).max(-1) / qmax).all()  # rounded up: nothing clips
    assert (np.abs(deq - x) <= scale[:, None] / 2 * (1 + 1e-6)).all()
    if bits == 8:  # the inflation the docstring quotes: max|x| = 1e-6, int8
        assert scale[-1] > 2 * np.abs(x[-1]).max() / qmax


def test_float16_token_at_the_dtype_max_reads_back_finite():
    """A scale is rounded up, so 127 * scale can pass float16's largest value: a stored
    65504 read back as inf, and the row's attention (every other value 0.5) came out NaN."""
    from jaxkv.attention import attend_view

    cache = QuantizedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=16, max_length=16, bits=8,
                                residual_length=0, dtype=jnp.float16)
    values = np.full((1, 1, 2, 16), 0.5, np.float32)
    values[0, 0, 0, 0] = 65504.0
    keys = jnp.zeros((1, 1, 2, 16), jnp.float16)
    cache, view = cache.write(keys, jnp.asarray(values, jnp.float16), 0)
    read = np.asarray(view.dense().values, np.float32)
    assert np.isfinite(read).all() and read[0, 0, 0, 0] == 65504.0
    out = np.asarray(attend_view(jnp.zeros((1, 1, 1, 16), jnp.float16), view, q_positions=jnp.array([[1]])), np.float32)
    # Equal keys: the mean of the two tokens. Each is within scale / 2 of its int8 code
    # (error_bound), so the mean is within the mean of the bounds, plus float16's rounding
    # of the output (spacing 32 near 32768: 16).
    want = values[0, 0].mean(axis=0)
    bound = error_bound(values[0, 0], 8).mean(axis=0) + np.spacing(np.float16(np.abs(want))).astype(np.float32) / 2
    assert np.isfinite(out).all()
    assert (np.abs(out[0, 0, 0] - want) <= bound).all(), (out[0, 0, 0], want, bound)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_memory_ratios_against_static_cache(head_dim, dtype):
    """Bytes of all leaves, realistic sizes (32 layers, 8 kv heads, 4096 tokens), no residual."""

    def nbytes(make_cache):
        shapes = jax.eval_shape(make_cache)
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    sizes = dict(num_layers=32, batch_size=1, num_kv_heads=8, head_dim=head_dim, max_length=4096)
    full = nbytes(lambda: StaticCache.init(**sizes, dtype=dtype))
    ratios = {bits: full / nbytes(lambda: QuantizedCache.init(**sizes, bits=bits, dtype=dtype)) for bits in (8, 4)}
    # Per token and head, keys and values: D elements of the dtype against D (int8) or D / 2
    # (int4) code bytes plus a bf16 scale each (the lengths and flags are negligible). The
    # float32 cases asserted the bf16 bounds, half their real ratios (review 74).
    size, d = jnp.dtype(dtype).itemsize, head_dim
    np.testing.assert_allclose([ratios[8], ratios[4]], [size * d / (d + 2), size * d / (d / 2 + 2)], rtol=1e-3)


# -------------------------------------------------------------------- NumPy model


class QuantizedReference(ReferenceCache):
    """Exact tokens plus, per layer and row, the first position the residual still holds
    exactly: a write ending at length n keeps positions >= n - R; a crop to m keeps < m."""

    def __init__(self, layers, batch, residual):
        super().__init__(layers, batch)
        self.residual = residual
        self.exact_from = [[0] * batch for _ in range(layers)]

    def update(self, layer, keys, values, num_new=None):
        super().update(layer, keys, values, num_new)
        for b in range(self.batch):
            self.exact_from[layer][b] = max(self.exact_from[layer][b], self.length(layer, b) - self.residual)

    def crop(self, max_length):
        super().crop(max_length)
        for layer, row in enumerate(self.exact_from):
            for b in range(self.batch):
                row[b] = min(row[b], self.length(layer, b))

    def select(self, indices):
        super().select(indices)
        self.exact_from = [[row[i] for i in indices] for row in self.exact_from]

    def repeat(self, r):
        super().repeat(r)
        self.exact_from = [[e for e in row for _ in range(r)] for row in self.exact_from]

    def reset(self, rows=None):
        for layer in range(len(self.rows)):
            for b in range(self.batch):
                if rows is None or rows[b]:
                    self.rows[layer][b] = []
                    self.exact_from[layer][b] = 0


@jax.jit
def _snapshot(cache):
    return cache.lengths, jnp.stack([jnp.stack(cache[layer]) for layer in range(cache.num_layers)])


def assert_matches(cache, ref):
    lengths, kv = (np.asarray(x) for x in _snapshot(cache))  # kv: [L, 2, B, H, S, D]
    for layer in range(len(ref.rows)):
        for b in range(ref.batch):
            n = ref.length(layer, b)
            assert lengths[layer, b] == n, (layer, b)
            for which, exact in enumerate(ref.layer_arrays(layer, b, H, D)):  # keys, values [H, n, D]
                got = kv[layer, which, b, :, :n]
                e = ref.exact_from[layer][b]
                np.testing.assert_array_equal(got[:, e:], exact[:, e:])
                assert (np.abs(got[:, :e] - exact[:, :e]) <= error_bound(exact[:, :e], cache.bits)).all()


_update = jax.jit(lambda cache, k, v, num_new, layer: cache.update(k, v, layer, num_new=num_new)[0])
_crop = jax.jit(lambda cache, m: cache.crop(m))
_select = jax.jit(lambda cache, idx: cache.batch_select_indices(idx))
_repeat = jax.jit(lambda cache, r: cache.batch_repeat_interleave(r), static_argnums=1)
_reset = jax.jit(lambda cache, rows: cache.reset(rows))
CHUNKS = (1, 5)  # each (batch, T, bits, R) compiles once: keep the shapes few


@st.composite
def programs(draw):
    batch = draw(st.integers(1, 2))
    ops, b = [], batch
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["update"] * 4 + ["crop", "select", "repeat", "reset"]))
        if kind == "update":
            t = draw(st.sampled_from(CHUNKS))
            op = ("update", draw(st.integers(0, L - 1)), t, draw(st.lists(st.integers(0, t), min_size=b, max_size=b)))
        elif kind == "crop":
            op = ("crop", draw(st.lists(st.integers(-4, S + 1), min_size=b, max_size=b)))
        elif kind == "select":
            op = ("select", draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b)))
            b = len(op[1])
        elif kind == "repeat":
            op = ("repeat", 2 if b == 1 else 1)
            b *= op[1]
        else:
            op = ("reset", draw(st.lists(st.booleans(), min_size=b, max_size=b)))
        ops.append(op)
    bits, residual = draw(st.sampled_from([(8, 0), (4, 3)]))
    return batch, bits, residual, ops, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_match_numpy_model_within_bound(program):
    """Scales move with the data: after any mix of ops every stored token dequantizes
    within the bound (exactly where the residual holds it)."""
    batch, bits, residual, ops, seed = program
    rng = np.random.default_rng(seed)
    cache, ref = make(bits, residual, batch=batch), QuantizedReference(L, batch, residual)
    for op in ops:
        if op[0] == "update":
            _, layer, t, num_new = op
            if any(ref.length(layer, i) + n > S for i, n in enumerate(num_new)):
                continue  # overflow has its own tests
            k, v = rand(rng, ref.batch, t), rand(rng, ref.batch, t, scale=0.01)
            cache = _update(cache, k, v, jnp.array(num_new, jnp.int32), jnp.int32(layer))
            ref.update(layer, k, v, num_new)
        elif op[0] == "crop":
            cache = _crop(cache, jnp.array(op[1], jnp.int32))
            ref.crop(op[1])
        elif op[0] == "select":
            cache = _select(cache, jnp.array(op[1], jnp.int32))
            ref.select(op[1])
        elif op[0] == "repeat":
            cache = _repeat(cache, op[1])
            ref.repeat(op[1])
        else:
            cache = _reset(cache, jnp.array(op[1]))
            ref.reset(op[1])
        assert_matches(cache, ref)
    assert not np.asarray(cache.flags).any()


# ------------------------------------------------------------------------- behaviour


def filled(bits=8, residual=2, seed=0):
    rng = np.random.default_rng(seed)
    cache = make(bits, residual)
    for layer in range(L):
        cache, _, _ = cache.update(rand(rng, B, 5), rand(rng, B, 5), layer, num_new=jnp.array([5, 3]))
    return cache


K2 = rand(np.random.default_rng(3), B, 2)


def test_update_returns_dequantized_layer_with_exact_residual():
    rng = np.random.default_rng(1)
    k, v = rand(rng, B, 5), rand(rng, B, 5)
    k[0, :, 1] = 0.0  # an all-zero token: zeros, no NaN
    cache, keys, values = jax.jit(lambda c: c.update(k, v, 0, num_new=jnp.array([5, 3])))(make(4, residual=2))
    assert keys.shape == (B, H, S, D) and keys.dtype == jnp.float32
    np.testing.assert_array_equal(keys[0, :, 3:5], k[0, :, 3:5])  # last 2: exact
    np.testing.assert_array_equal(values[1, :, 1:3], v[1, :, 1:3])
    np.testing.assert_array_equal(keys[0, :, 1], 0.0)
    assert (np.abs(np.asarray(keys[0, :, :3]) - k[0, :, :3]) <= error_bound(k[0, :, :3], 4)).all()
    assert np.isfinite(np.asarray(keys)).all()
    chex.assert_trees_all_equal(cache[0], (keys, values))


def test_bf16_model_dtype_stays_bf16():
    cache = make(8, residual=2, dtype=jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        cache, keys, values = jax.jit(lambda c: c.update(K2, K2, 0))(cache)
    assert keys.dtype == values.dtype == cache.residual_keys.dtype == jnp.bfloat16
    assert cache.keys.dtype == jnp.int8 and cache.key_scales.dtype == jnp.bfloat16


# --------------------------------------------------------------- overflow and errors


def test_eager_overflow_raises_and_jit_overflow_drops_and_flags():
    cache = make(8, residual=2, max_length=4)
    k = jnp.full((B, H, 3, D), 127.0)  # scale 1: quantization is exact
    cache, _, _ = cache.update(k, k, 0, num_new=jnp.array([1, 3]))
    with pytest.raises(ValueError, match=r"layer 0, row 1: it holds 3 tokens and 2 new would make 5 > max_length=4"):
        cache.update(k[:, :, :2], k[:, :, :2], 0)
    k2 = jnp.full((B, H, 2, D), 254.0)
    out, keys, _ = jax.jit(lambda c: c.update(k2, k2, 0))(cache)
    np.testing.assert_array_equal(out.seq_lengths(0), [3, 4])
    assert int(out.flags[1]) & OVERFLOW and int(out.flags[0]) == 0
    np.testing.assert_array_equal(keys[1, :, 3], 254.0)  # the one free slot took the first token
    np.testing.assert_array_equal(keys[1, :, :3], 127.0)  # nothing clamped onto slot 3 or before
    with pytest.raises(CacheError, match=r"rows \[1\] overflowed max_length=4"):
        out.check()
    assert out.reset().check() is not None


def test_traced_bad_layer_writes_nothing_and_flags():
    # (A traced bad row index: test_conformance.py, every kind.)
    cache = filled()
    bad_layer, _, _ = jax.jit(lambda c, i: c.update(K2, K2, i))(cache, jnp.int32(L))
    chex.assert_trees_all_equal(bad_layer.keys, cache.keys)
    assert (np.asarray(bad_layer.flags) & INVALID).all()
    with pytest.raises(CacheError, match="out-of-range index or num_new"):
        bad_layer.check()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: c.update(K2[0], K2[0], 0), ValueError, "rank 4"),
        (lambda c: c.update(K2[..., :2], K2[..., :2], 0), ValueError, "head_dim=2"),
        (lambda c: c.update(K2, K2, L), ValueError, "layer_idx 2 is out of range"),
        (lambda c: c.update(K2.astype(np.int32), K2, 0), TypeError, "floating dtype"),
        (lambda c: c.update(K2, K2, 0, num_new=jnp.array([3, 0])), ValueError, r"num_new\[0\]=3 is outside"),
        (lambda c: c.crop(1.5), TypeError, "max_length must be an int"),
        (lambda c: c.reorder_cache(jnp.array([0])), ValueError, "one entry per row"),
        (lambda c: c.batch_select_indices(jnp.array([2])), ValueError, "row index 2"),
        (lambda c: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c: c.reset(jnp.array([1, 0])), TypeError, "rows must be a bool array"),
        (lambda c: c[L], ValueError, "out of range"),
        (lambda c: make(bits=2), ValueError, "bits must be 8 or 4"),
        (lambda c: make(bits=4, head_dim=3), ValueError, "head_dim must be even"),
        (lambda c: make(residual=-1), ValueError, "residual_length must be an int >= 0"),
        (lambda c: make(dtype=jnp.int8), TypeError, "dtype must be floating"),
        (lambda c: quantize(np.ones((2, 3)), 4), ValueError, "head_dim must be even"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(filled())


def test_protocol():
    cache = filled()
    assert len(cache) == L and len(list(cache)) == L and cache.get_max_length() == S
    assert cache.get_seq_length(0) == 5 and cache.residual_length == 2 and cache.head_dim == D
    assert jax.tree.structure(cache) == jax.tree.structure(make(8, 2))


@pytest.mark.parametrize("kind", ["quantized", "paged"])
@pytest.mark.parametrize("bits", [8, 4])
def test_all_zero_tokens_attend_exactly(kind, bits):
    """All-zero tokens (a scale of 0) through write and attention, not only the quantizer: a
    row of nothing but zero tokens attends to exactly 0, and zero tokens among others are
    read as zeros, never NaN. The other tokens are multiples of 1/4 with one component at
    +-qmax / 4, so their codes are exact and the float64 reference (causal attention over the
    tokens as given) holds to float32 rounding."""
    from jaxkv import PagedCache
    from jaxkv.attention import cache_attention

    qmax, t, hq, d = QMAX[bits], 5, 4, 8
    rng = np.random.default_rng(bits)

    def tokens():
        x = rng.integers(-qmax, qmax + 1, size=(B, H, t, d)).astype(np.float32)
        x[..., 0] = qmax * rng.choice([-1.0, 1.0], size=(B, H, t))
        x[0] = 0.0  # row 0: zero tokens only
        x[1, :, 2] = 0.0  # row 1: one zero token among others
        return x / 4

    keys, values = tokens(), tokens()
    queries = rng.standard_normal((B, hq, t, d)).astype(np.float32)
    if kind == "quantized":
        cache = make(bits=bits, head_dim=d)
    else:
        cache = PagedCache.init(num_layers=L, batch_size=B, num_kv_heads=H, head_dim=d, max_length=S,
                                page_size=4, bits=bits)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    out, cache = jax.jit(lambda c, q, k, v: cache_attention(q, k, v, c, 1, positions=positions))(
        cache, jnp.asarray(queries), jnp.asarray(keys), jnp.asarray(values))
    out = np.asarray(out)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0], 0.0)
    want = np.zeros(out.shape)
    for b in range(B):
        for h in range(hq):
            k, v = keys[b, h // (hq // H)].astype(np.float64), values[b, h // (hq // H)].astype(np.float64)
            for i in range(t):
                logits = k[: i + 1] @ queries[b, h, i].astype(np.float64) / np.sqrt(d)
                w = np.exp(logits - logits.max())
                want[b, h, i] = (w / w.sum()) @ v[: i + 1]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)  # exact codes: float32 rounding (measured 3.4e-6 relative)


def test_dequantize_refuses_codes_of_the_other_width():
    """quantize(x, 4) read back without bits=4 gave [..., D/2] values ~65 off, int8 codes read
    with bits=4 [..., 2D], silently (review 84)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    q4, s4 = quantize(x, bits=4)
    q8, s8 = quantize(x, bits=8)
    with pytest.raises(ValueError, match=r"bits=8 reads int8 codes \(quantize's\), got uint8; .*bits=4"):
        dequantize(q4, s4)
    with pytest.raises(ValueError, match=r"bits=4 reads uint8 codes \(quantize's\), got int8"):
        dequantize(q8, s8, bits=4)
    with pytest.raises(ValueError, match=r"scale must have shape \[3\]"):
        dequantize(q8, s8[:2])
    assert dequantize(q4, s4, bits=4).shape == x.shape

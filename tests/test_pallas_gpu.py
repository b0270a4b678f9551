"""The Pallas split-K decode kernels (jaxkv.attention.pallas_gpu) against a float64 NumPy
reference of the attention contract.

On CPU the kernels run in Pallas interpret mode; where the default backend is a GPU
(``JAX_PLATFORMS=cuda``) the same tests run the Triton kernels. Interpret mode compiles
slowly, so each static configuration (dtype, G, T, bits) is one shape used by several
tests: windows, soft caps, layers, split counts of the same shape and the non-finite
scenarios reuse one compiled program (window and soft cap are runtime operands).
"""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.attention import attend_view, pallas_attend_view
from jaxkv.attention import pallas_gpu
from jaxkv.caches.quantized import QuantizedCache
from jaxkv.caches.views import ContiguousView, LayerView, PagedView, QuantizedView
from reference import numpy_attention

INTERPRET = jax.default_backend() != "gpu"
LAYERS, HEADS, SLOTS, DIM = 3, 2, 64, 32
# Rows: full, ragged, empty, one token, and queries well before the fill (a prefix is seen).
LENGTHS = np.array([SLOTS, 37, 0, 1, SLOTS])
SETTINGS = [(2, None, None), (0, 7, None), (1, None, 4.0), (2, 20, 2.5)]  # (layer, window, soft cap)


def contract_reference(q, k, v, q_pos, kv_len, window=None, softcap=None):
    """float64: softmax over the visible slots; NaN rows where a visible slot has a
    non-finite raw logit or value element; zeros where nothing is visible. k, v [B, H, S, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    slots = np.arange(k.shape[2])
    pos = np.asarray(q_pos)[:, None, :, None]  # [B, 1, T, 1]
    visible = (slots < np.asarray(kv_len)[:, None, None, None]) & (slots <= pos)
    if window is not None:
        visible &= pos - slots < window
    with np.errstate(invalid="ignore", over="ignore"):
        raw = np.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(q.shape[-1])
    bad = ~np.isfinite(raw) | ~np.isfinite(v).all(-1)[:, :, None, :]
    marked = (visible & bad).any(-1)
    logits = np.where(np.isfinite(raw), raw, 0.0)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    weights = np.where(visible, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bhts,bhsd->bhtd", weights, np.where(np.isfinite(v), v, 0.0))
    return np.where(marked[..., None], np.nan, out)


def query_positions(tokens):
    last = [np.maximum(n - tokens, 0) + np.arange(tokens) for n in LENGTHS]
    last[-1] = 10 + np.arange(tokens)  # before the fill: sees slots 0..10+t only
    return np.stack(last).astype(np.int32)


def bf16_bits(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_round(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def contiguous_case(dtype, groups, tokens, seed=0):
    """Stacked [L, B, H, S, D] buffers (as stored) with NaN in every unfilled slot."""
    rng = np.random.default_rng(seed)
    batch = len(LENGTHS)
    q = rng.standard_normal((batch, HEADS * groups, tokens, DIM)).astype(np.float32)
    k = rng.standard_normal((LAYERS, batch, HEADS, SLOTS, DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, batch, HEADS, SLOTS, DIM)).astype(np.float32) + 3.0
    for b, n in enumerate(LENGTHS):
        k[:, b, :, n:] = np.nan
        v[:, b, :, n:] = np.nan
    if dtype == jnp.bfloat16:  # the reference sees what the cache holds
        q, k, v = (bf16_round(x).astype(np.float32) for x in (q, k, v))
    return q, k, v, query_positions(tokens)


def contiguous_view(k, v, layer, dtype):
    stored = (bf16_bits(k), bf16_bits(v)) if dtype == jnp.bfloat16 else (k, v)
    return ContiguousView(jnp.asarray(stored[0]), jnp.asarray(stored[1]), jnp.int32(layer),
                          jnp.asarray(LENGTHS, jnp.int32), dtype)


def run(q, view, q_pos, dtype=jnp.float32, **kw):
    return pallas_attend_view(jnp.asarray(q, dtype), view, q_positions=jnp.asarray(q_pos), interpret=INTERPRET, **kw)


def test_contract_reference_equals_the_loop_reference():
    q, k, v, q_pos = contiguous_case(jnp.float32, 2, 3)
    for window, softcap in [(None, None), (5, 3.0)]:
        np.testing.assert_allclose(contract_reference(q, k[0], v[0], q_pos, LENGTHS, window, softcap),
                                   numpy_attention(q, k[0], v[0], q_pos, LENGTHS, window, softcap), rtol=1e-12, atol=1e-12)


# bf16: the output is rounded to bf16 and the softmax weights enter the value product as
# bf16 (as in every jaxkv path): 2^-8 relative.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2**-8}


# Each configuration is one compiled program (interpret mode compiles slowly); G = 1 and f32
# with several queries are covered by the quantized and paged tests below.
@pytest.mark.parametrize("dtype, groups, tokens", [(jnp.float32, 4, 1), (jnp.bfloat16, 4, 4)])
def test_contiguous_matches_reference(dtype, groups, tokens):
    """Ragged rows (full, partial, empty, one token, queries before the fill), windows, soft
    caps, every layer of the stacked buffer; 4 blocks in 3 splits (the last one empty)."""
    q, k, v, q_pos = contiguous_case(dtype, groups, tokens)
    for layer, window, softcap in SETTINGS:
        view = contiguous_view(k, v, layer, dtype)
        want = contract_reference(q, k[layer], v[layer], q_pos, LENGTHS, window, softcap)
        got = run(q, view, q_pos, dtype, sliding_window=window, logit_softcap=softcap, num_splits=3, block_k=16)
        assert got.dtype == dtype and got.shape == q.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        assert not np.asarray(got[2]).any()  # the empty row sees nothing: zeros


POISONS = [np.nan, np.inf, -np.inf]


def test_contiguous_nonfinite_contract():
    """One non-finite element per row per call, in a key or a value: in a visible slot
    (that query's row is NaN), in a slot only some queries see (the window's start, the
    future of the earlier queries), or in an unfilled one (no effect on anything); bf16."""
    q, k, v, q_pos = contiguous_case(jnp.bfloat16, 4, 4)
    window = 20
    places = {  # row -> slot
        "visible": lambda b: LENGTHS[b] - 1,
        "future of earlier queries": lambda b: q_pos[b, -1],
        "window start": lambda b: q_pos[b, 0] - window + 1,
        "unfilled": lambda b: LENGTHS[b] + 1,
    }
    for poison_index, (place, slot_of) in enumerate(places.items()):
        for array in ("keys", "values"):
            poisoned_k, poisoned_v = k.copy(), v.copy()
            target = poisoned_k if array == "keys" else poisoned_v
            for b in range(len(LENGTHS)):
                slot = int(slot_of(b))
                if 0 <= slot < SLOTS:
                    target[1, b, 0, slot, b % DIM] = POISONS[(b + poison_index) % 3]
            want = contract_reference(q, poisoned_k[1], poisoned_v[1], q_pos, LENGTHS, window)
            got = np.asarray(run(q, contiguous_view(poisoned_k, poisoned_v, 1, jnp.bfloat16), q_pos, jnp.bfloat16,
                                 sliding_window=window, num_splits=3, block_k=16), np.float32)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{place}, {array}")
            np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8, err_msg=f"{place}, {array}")
            if place == "visible":  # the last query of rows 0, 1, 3 sees the last slot (kv head 0's 4 heads)
                assert np.isnan(got[[0, 1, 3], :4, -1]).all() and not np.isnan(got[:, 4:]).any()


def test_full_blocks_keep_the_contract_and_equal_the_masked_kernel():
    """Blocks every query of a row sees run unmasked (``full_blocks``, the default): there a
    non-finite key or value (NaN, +inf, -inf) reaches the row's output through the products
    (a -inf logit is made NaN first, and before the soft cap, which would bound it), not
    through marks. Poisons at random slots every query sees, and in unseen ones, for float32
    and bf16, several queries, windows and soft caps: the float64 reference, and the same
    output as every block masked (``full_blocks=False``)."""
    rng = np.random.default_rng(21)
    q, k, v, q_pos = contiguous_case(jnp.float32, 2, 3, seed=4)
    for trial in range(6):
        dtype = (jnp.float32, jnp.bfloat16)[trial % 2]
        window, softcap = [(None, None), (40, None), (None, 3.0)][trial % 3]
        pk, pv = k.copy(), v.copy()
        for b, n in enumerate(LENGTHS):
            seen_by_all = int(q_pos[b].min()) + 1 if window is None else 0  # [0, min position]: no window cut
            if seen_by_all >= 16 and trial % 4 != 3:
                slot = int(rng.integers(0, seen_by_all - 15))  # inside a whole block of 16 every query sees
                target = pk if rng.random() < 0.5 else pv
                target[1, b, int(rng.integers(HEADS)), slot, int(rng.integers(DIM))] = POISONS[(trial + b) % 3]
        if dtype == jnp.bfloat16:
            pk, pv = (np.where(np.isfinite(x), bf16_round(x), x).astype(np.float32) for x in (pk, pv))
        want = contract_reference(q if dtype == jnp.float32 else bf16_round(q), pk[1], pv[1], q_pos, LENGTHS,
                                  window, softcap)
        view = contiguous_view(pk, pv, 1, dtype)
        outs = [np.asarray(run(q, view, q_pos, dtype, sliding_window=window, logit_softcap=softcap, block_k=16,
                               num_splits=2, full_blocks=full), np.float32) for full in (True, False)]
        tol = 2e-5 if dtype == jnp.float32 else 2**-7
        for full, got in zip((True, False), outs):
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"trial {trial} full={full}")
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"trial {trial} full={full}")
        assert np.isnan(want).any() or trial % 4 == 3 or window is not None


def test_full_blocks_of_a_quantized_view_without_residual():
    """The same for int8 codes without a residual (a non-finite key or value scale inside a
    block every query sees): full_blocks on and off agree, NaN in the poisoned rows only.
    (Paged views take the same path: test_paged_matches_reference, NaN past each length.)"""
    case = quantized_case(8, jnp.float32, 2, 2)
    case["residual"] = case["residual"][:, :, :, :0]
    case["positions"] = case["positions"][:, :0]
    view = quantized_view(case, 1)
    scales_k, scales_v = np.array(view.key_scales), np.array(view.value_scales)
    scales_k[1, 0, 0, 5] = bf16_bits(np.float32(np.inf))
    scales_v[1, 4, 1, 3] = bf16_bits(np.float32(np.nan))
    poisoned = view._replace(key_scales=jnp.asarray(scales_k), value_scales=jnp.asarray(scales_v))
    q, q_pos = jnp.asarray(case["q"]), jnp.asarray(case["q_pos"])
    for v in (view, poisoned):
        on, off = (np.asarray(pallas_attend_view(q, v, q_positions=q_pos, interpret=INTERPRET, block_k=16,
                                                 full_blocks=full)) for full in (True, False))
        np.testing.assert_array_equal(np.isnan(on), np.isnan(off))
        np.testing.assert_allclose(on, off, rtol=2e-5, atol=2e-5)
    assert np.isnan(on[0]).any() and np.isnan(on[4]).any() and not np.isnan(on[1]).any()


# ---------------------------------------------------------------- quantized views

RESIDUAL = 8


def quantized_case(bits, dtype, groups, tokens, seed=1):
    """Random codes and bf16 scales (NaN scales in unfilled slots), a residual of R exact
    tokens per row, and the [L, B, H, S, D] keys/values the view stands for (float64)."""
    rng = np.random.default_rng(seed)
    batch = len(LENGTHS)
    qmax = 127 if bits == 8 else 7
    codes = rng.integers(-qmax, qmax + 1, size=(2, LAYERS, batch, HEADS, SLOTS, DIM))
    scales = bf16_round(rng.uniform(0.005, 0.05, size=(2, LAYERS, batch, HEADS, SLOTS)))
    for b, n in enumerate(LENGTHS):
        scales[:, :, b, :, n:] = np.nan
    if bits == 8:
        stored = codes.astype(np.int8)
    else:  # element 2i in the low nibble, 2i + 1 in the high one
        nibbles = codes & 0xF
        stored = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    # Residual rows: the last R positions in ring order; scattered positions (one unused,
    # past the length); none (empty row); one token; positions holding the window's edge.
    positions = np.full((batch, RESIDUAL), -1, np.int32)
    positions[0] = np.roll(np.arange(SLOTS - RESIDUAL, SLOTS), 3)
    positions[1] = [3, 36, 20, 40, -1, 12, 35, 7]  # 40 >= length 37: unused
    positions[3] = [-1, 0, -1, -1, -1, -1, -1, -1]
    positions[4] = [9, 10, 11, 12, 13, 50, 60, 2]
    residual = rng.standard_normal((2, batch, HEADS, RESIDUAL, DIM)).astype(np.float32)
    if dtype == jnp.bfloat16:
        residual = bf16_round(residual).astype(np.float32)
    residual[1] += 3.0
    for b in range(batch):  # unused residual slots may hold anything
        unused = (positions[b] < 0) | (positions[b] >= LENGTHS[b])
        residual[:, b, :, unused] = np.nan
    q = rng.standard_normal((batch, HEADS * groups, tokens, DIM)).astype(np.float32)
    if dtype == jnp.bfloat16:
        q = bf16_round(q).astype(np.float32)
    return dict(q=q, stored=stored, codes=codes, scales=scales, positions=positions, residual=residual,
                q_pos=query_positions(tokens), bits=bits, dtype=dtype)


def quantized_view(case, layer):
    dtype = case["dtype"]
    scale_bits = bf16_bits(case["scales"])
    residual = jnp.asarray(case["residual"], dtype)
    return QuantizedView(
        jnp.asarray(case["stored"][0]), jnp.asarray(case["stored"][1]), jnp.asarray(scale_bits[0]),
        jnp.asarray(scale_bits[1]), residual[0], residual[1], jnp.asarray(case["positions"]), jnp.int32(layer),
        jnp.asarray(LENGTHS, jnp.int32), case["bits"], dtype, jnp.bfloat16,
    )


def quantized_reference(case, layer, window=None, softcap=None):
    """Attention over the layer dequantized (held in the model dtype), with the used
    residual slots' exact tokens in place."""
    with np.errstate(invalid="ignore"):
        dense = case["codes"][:, layer] * case["scales"][:, layer, ..., None]
    dense = bf16_round(dense) if case["dtype"] == jnp.bfloat16 else dense.astype(np.float32).astype(np.float64)
    k, v = dense
    for b, row in enumerate(case["positions"]):
        for r, p in enumerate(row):
            if 0 <= p < LENGTHS[b]:
                k[b, :, p], v[b, :, p] = case["residual"][0, b, :, r], case["residual"][1, b, :, r]
    return contract_reference(case["q"], k, v, case["q_pos"], LENGTHS, window, softcap)


QUANTIZED = [(8, jnp.float32, 4, 1), (4, jnp.bfloat16, 1, 4)]


@pytest.mark.parametrize("bits, dtype, groups, tokens", QUANTIZED)
def test_quantized_with_residual_matches_reference(bits, dtype, groups, tokens):
    case = quantized_case(bits, dtype, groups, tokens)
    for layer, window, softcap in SETTINGS:
        got = run(case["q"], quantized_view(case, layer), case["q_pos"], dtype, sliding_window=window,
                  logit_softcap=softcap, num_splits=3, block_k=16)
        assert got.dtype == dtype
        want = quantized_reference(case, layer, window, softcap)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_quantized_nonfinite_contract():
    """A NaN/inf scale or residual token in a slot the queries see makes their rows NaN; in
    unfilled slots and unused residual slots (NaN throughout the case) nothing changes."""
    case = quantized_case(*QUANTIZED[0])
    layer = 2
    for name in ("key scale", "value scale", "residual key", "residual value"):
        poisoned = {**case, "scales": case["scales"].copy(), "residual": case["residual"].copy()}
        if name.endswith("scale"):
            which = 0 if name.startswith("key") else 1
            poisoned["scales"][which, layer, 1, 0, 5] = np.inf  # row 1, slot 5: seen, not in the residual
        else:
            which = 0 if name.endswith("key") else 1
            poisoned["residual"][which, 0, 1, 2] = np.nan  # row 0, kv head 1, a used slot
        got = np.asarray(run(case["q"], quantized_view(poisoned, layer), case["q_pos"], num_splits=3, block_k=16))
        want = quantized_reference(poisoned, layer)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        assert np.isnan(got).any(), name
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


def test_forward_derivative_comes_from_the_xla_loop():
    q, k, v, q_pos = contiguous_case(jnp.float32, 4, 1)
    view = contiguous_view(k, v, 2, jnp.float32)
    dq = np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
    options = pallas_gpu._INTERPRET_COMPILER_OPTIONS if INTERPRET else None
    primal, tangent = jax.jit(lambda q, dq: jax.jvp(lambda q: run(q, view, q_pos, num_splits=3, block_k=16), (q,), (dq,)),
                              compiler_options=options)(jnp.asarray(q), jnp.asarray(dq))
    np.testing.assert_allclose(np.asarray(primal), contract_reference(q, k[2], v[2], q_pos, LENGTHS), rtol=2e-5,
                               atol=2e-5)
    eps = 1e-4
    numeric = (contract_reference(q + eps * dq, k[2], v[2], q_pos, LENGTHS)
               - contract_reference(q - eps * dq, k[2], v[2], q_pos, LENGTHS)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), numeric, rtol=1e-3, atol=1e-3)


def test_vmap_over_caches_equals_each_alone():
    """jax.vmap over independent caches (a leading axis on every array of the view, the
    layer index too): the Pallas call's own batching (the sharding wrapper has none), equal
    to each cache attended alone."""
    cases = [contiguous_case(jnp.float32, 2, 2, seed=seed) for seed in (0, 1)]
    q, k, v = (np.stack([case[i] for case in cases]) for i in range(3))
    q_pos, layers = cases[0][3], np.array([2, 0], np.int32)

    def one(q, k, v, layer):
        view = ContiguousView(k, v, layer, jnp.asarray(LENGTHS, jnp.int32), jnp.float32)
        return pallas_attend_view(q, view, q_positions=jnp.asarray(q_pos), interpret=INTERPRET, sliding_window=20,
                                  num_splits=2, block_k=16)

    options = pallas_gpu._INTERPRET_COMPILER_OPTIONS if INTERPRET else None
    got = jax.jit(jax.vmap(one), compiler_options=options)(*(jnp.asarray(x) for x in (q, k, v, layers)))
    for i, layer in enumerate(layers):
        want = contract_reference(q[i], k[i][layer], v[i][layer], q_pos, LENGTHS, 20)
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=2e-5, atol=2e-5)


@contextlib.contextmanager
def _triton_ir():
    """The Triton IR (text) of each Pallas kernel lowered inside the block, in order."""
    from jax._src.pallas.triton import lowering as triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", spy)
        yield modules


def _abstract_gpu():
    """Off a GPU, jax >= 0.11 lowers a Triton kernel only for a named abstract GPU (it reads the
    compute capability from the device kind), and an abstract mesh cannot lower the kernels'
    custom_partitioning wrapper: there the test is skipped (the GPU run lowers them for real).
    Older jax lowered for a generic GPU, as CI's does."""
    if jax.default_backend() != "gpu" and tuple(jax.__version_info__[:2]) >= (0, 11):
        pytest.skip("jax >= 0.11 lowers Triton kernels only with a GPU present")
    return contextlib.nullcontext()

@pytest.mark.parametrize("kind", ["bf16", "int4", "paged int8", "f32 tf32x3"])
def test_kernels_lower_through_triton(kind):
    """Off a GPU, the Triton lowering still runs (exported for CUDA): every value in the
    kernel is a tile Triton takes (power-of-two shapes, supported ops). PTX compilation and
    the numbers need a device (benchmarks/bench_device.py)."""
    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    batch, heads, slots, dim = 2, 2, 256, 64
    q, pos, lengths, layer = sds((batch, 4 * heads, 2, dim), jnp.bfloat16), sds((batch, 2), jnp.int32), sds(
        (batch,), jnp.int32), sds((), jnp.int32)
    if kind == "bf16":
        buffers = [sds((2, batch, heads, slots, dim), jnp.uint16)] * 2

        def attend(q, pos, k, v, lengths, layer):
            return pallas_attend_view(q, ContiguousView(k, v, layer, lengths, jnp.bfloat16), q_positions=pos,
                                      sliding_window=100, logit_softcap=30.0)
    elif kind == "f32 tf32x3":  # float32 products as TF32 x 3 (not in interpret mode: XLA:CPU has no TF32)
        q = sds(q.shape, jnp.float32)
        buffers = [sds((2, batch, heads, slots, dim), jnp.float32)] * 2

        def attend(q, pos, k, v, lengths, layer):
            return pallas_attend_view(q, ContiguousView(k, v, layer, lengths, jnp.float32), q_positions=pos,
                                      f32_precision="tf32x3")
    elif kind == "paged int8":
        buffers = ([sds((2, 9, heads, 16, dim), jnp.int8)] * 2 + [sds((2, 9, heads, 16), jnp.uint16)] * 2
                   + [sds((batch, slots // 16), jnp.int32)])

        def attend(q, pos, *arrays):
            *arrays, lengths, layer = arrays
            view = PagedView(*arrays, layer, lengths, 8, jnp.bfloat16, jnp.bfloat16)
            return pallas_attend_view(q, view, q_positions=pos, sliding_window=64)
    else:
        buffers = ([sds((2, batch, heads, slots, dim // 2), jnp.uint8)] * 2 + [sds((2, batch, heads, slots), jnp.uint16)]
                   * 2 + [sds((batch, heads, 8, dim), jnp.bfloat16)] * 2 + [sds((batch, 8), jnp.int32)])

        def attend(q, pos, *arrays):
            *arrays, lengths, layer = arrays
            view = QuantizedView(*arrays, layer, lengths, 4, jnp.bfloat16, jnp.bfloat16)
            return pallas_attend_view(q, view, q_positions=pos)

    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with _abstract_gpu(), _triton_ir() as modules:
        exported = jax.export.export(jax.jit(attend), platforms=["cuda"], disabled_checks=[triton])(
            q, pos, *buffers, lengths, layer)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
    (module,) = modules
    # the block loops' products take the requested precision (the marks' 0/1 product is bf16)
    assert ("inputPrecision = tf32x3" in module) == (kind == "f32 tf32x3")
    assert ("tt.extern_elementwise" in module and "tanh" in module) == (kind == "bf16")  # soft cap: tanh only then


# ---------------------------------------------------------------- paged views

PAGE = 16


def test_paged_matches_reference():
    """Rows read through shuffled block tables from one pool (unused pages and slots NaN),
    ragged lengths, windows, soft caps, both layers; one page per block."""
    rng = np.random.default_rng(4)
    batch, pages_per_row = len(LENGTHS), SLOTS // PAGE
    num_pages = batch * pages_per_row + 2
    pool = rng.standard_normal((2, LAYERS, num_pages, HEADS, PAGE, DIM)).astype(np.float32)
    pool[1] += 3.0
    order = rng.permutation(num_pages)
    table = np.full((batch, pages_per_row), -1, np.int32)
    dense = np.full((2, LAYERS, batch, HEADS, SLOTS, DIM), np.nan, np.float32)
    for b, n in enumerate(LENGTHS):
        used = -(-n // PAGE)
        table[b, :used] = order[b * pages_per_row:b * pages_per_row + used]
        for i, page in enumerate(table[b, :used]):
            dense[:, :, b, :, i * PAGE:(i + 1) * PAGE] = pool[:, :, page]
        dense[:, :, b, :, n:] = np.nan
        for i, page in enumerate(table[b, :used]):  # what a slot past the length holds: anything
            pool[:, :, page, :, max(n - i * PAGE, 0):] = np.nan
    pool[:, :, order[-2:]] = np.nan  # pages no row uses
    q = rng.standard_normal((batch, 2 * HEADS, 2, DIM)).astype(np.float32)
    q_pos = query_positions(2)
    empty = jnp.zeros((LAYERS, num_pages, HEADS, 0))
    for layer, window, softcap in SETTINGS:
        view = PagedView(jnp.asarray(pool[0]), jnp.asarray(pool[1]), empty, empty, jnp.asarray(table),
                         jnp.int32(layer), jnp.asarray(LENGTHS, jnp.int32), None, jnp.float32, jnp.float32)
        got = run(q, view, q_pos, sliding_window=window, logit_softcap=softcap, num_splits=3)
        want = contract_reference(q, dense[0, layer], dense[1, layer], q_pos, LENGTHS, window, softcap)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_page_id_past_the_pool_reads_the_last_page_as_the_other_paths_do():
    """A block table entry past the pool (only a hand-built view holds one) is clamped into it
    by the XLA loop's gather and the CPU kernel; the Pallas kernel clamps it the same way
    rather than read outside the pool. (Interpret mode clamps its reads by itself: this test
    tells the paths apart only when it runs on a GPU.)"""
    from jaxkv.attention.blockwise import paged_blockwise_attend

    rng = np.random.default_rng(6)
    pool = jnp.asarray(rng.standard_normal((2, LAYERS, 5, HEADS, PAGE, DIM)), jnp.float32)
    table = jnp.asarray([[3, 9], [0, 4]], jnp.int32)  # 9: past the 5 pages
    lengths = jnp.asarray([2 * PAGE, PAGE + 3], jnp.int32)
    empty = jnp.zeros((LAYERS, 5, HEADS, 0))
    view = PagedView(pool[0], pool[1], empty, empty, table, jnp.int32(1), lengths, None, jnp.float32, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 2 * HEADS, 1, DIM)), jnp.float32)
    q_pos = jnp.asarray([[2 * PAGE - 1], [PAGE + 2]], jnp.int32)
    want = paged_blockwise_attend(q, view, q_positions=q_pos, implementation="xla")
    clamped = view._replace(block_table=jnp.minimum(table, 4))
    np.testing.assert_allclose(np.asarray(want), np.asarray(
        paged_blockwise_attend(q, clamped, q_positions=q_pos, implementation="xla")), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(run(q, view, q_pos)), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_capacity_that_is_not_a_multiple_of_the_block():
    """generate's capacity is prompt + new tokens, any number: the last block is read from
    the buffer's last BK slots and the slots it shares with the block before are counted
    once. Capacity 57 in blocks of 16 (the last read from slot 41; rows of length 57, 45, 48,
    41, 0 and a query before the fill), float32 and int8 with a residual covering slots of
    the overlap; NaN in every unfilled slot."""
    slots, lengths = 57, np.array([57, 45, 48, 41, 0, 57])
    rng = np.random.default_rng(7)
    batch = len(lengths)
    q = rng.standard_normal((batch, 2 * HEADS, 1, DIM)).astype(np.float32)
    q_pos = np.maximum(lengths - 1, 0)[:, None].astype(np.int32)
    q_pos[-1] = 44  # before the fill: sees slots 0..44, the overlap's first ones among them
    k, v = rng.standard_normal((2, 1, batch, HEADS, slots, DIM)).astype(np.float32)
    v += 3.0
    for b, n in enumerate(lengths):
        k[:, b, :, n:] = v[:, b, :, n:] = np.nan
    view = ContiguousView(jnp.asarray(k), jnp.asarray(v), jnp.int32(0), jnp.asarray(lengths, jnp.int32), jnp.float32)
    for window, softcap in [(None, None), (9, 3.0)]:
        want = contract_reference(q, k[0], v[0], q_pos, lengths, window, softcap)
        for block_k in (16, None):  # None: the default, the largest power of two <= min(64, 57)
            got = run(q, view, q_pos, sliding_window=window, logit_softcap=softcap, num_splits=2, block_k=block_k)
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=f"{window} {block_k}")
    with pytest.raises(ValueError, match="at most the capacity 57, got 64"):
        run(q, view, q_pos, block_k=64)

    codes = rng.integers(-127, 128, size=(2, 1, batch, HEADS, slots, DIM))
    scales = bf16_round(rng.uniform(0.005, 0.05, size=(2, 1, batch, HEADS, slots)))
    dense = codes * scales[..., None]
    for b, n in enumerate(lengths):
        scales[:, :, b, :, n:] = np.nan
        dense[:, :, b, :, n:] = np.nan
    positions = np.full((batch, 4), -1, np.int32)
    positions[0] = [42, 47, 56, 3]  # in the overlap (41..47), past it, the last slot, the first block
    positions[1] = [44, 41, -1, 30]
    residual = rng.standard_normal((2, batch, HEADS, 4, DIM)).astype(np.float32)
    for b in range(batch):
        for r, p in enumerate(positions[b]):
            if 0 <= p < lengths[b]:
                dense[:, 0, b, :, p] = residual[:, b, :, r]
    quantized = QuantizedView(
        jnp.asarray(codes[0].astype(np.int8)), jnp.asarray(codes[1].astype(np.int8)),
        jnp.asarray(bf16_bits(scales[0])), jnp.asarray(bf16_bits(scales[1])), jnp.asarray(residual[0]),
        jnp.asarray(residual[1]), jnp.asarray(positions), jnp.int32(0), jnp.asarray(lengths, jnp.int32), 8,
        jnp.float32, jnp.bfloat16)
    want = contract_reference(q, dense[0, 0], dense[1, 0], q_pos, lengths)
    got = run(q, quantized, q_pos, num_splits=2, block_k=16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_a_very_negative_query_position_with_a_large_window():
    """A row's first visible slot is ``min(q_positions) - W + 1``: with a padding query at a
    negative position and a window near 2**31 that wrapped past -2**31 to a large start,
    and the row's real query saw nothing (zeros). Positions and windows at the int32 edges
    against the float64 reference."""
    rng = np.random.default_rng(11)
    slots, lengths = 32, np.array([32, 20])
    k, v = rng.standard_normal((2, 1, 2, 1, slots, 16)).astype(np.float32)
    q = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    view = ContiguousView(jnp.asarray(k), jnp.asarray(v), jnp.int32(0), jnp.asarray(lengths, jnp.int32), jnp.float32)
    for q_pos, window in [([[-3, 20], [-1, 19]], 2**31 - 1), ([[-2**31, 20], [-2**31, 5]], 8),
                          ([[0, 31], [2**31 - 1, 7]], 2**31 - 1), ([[-3, 20], [-1, 19]], 2**31 + 5),
                          # wider than int32: a query at 2**31 - 1 still sees slot 0 (review 55)
                          ([[2**31 - 1, 20], [2**31 - 1, 7]], 2**31)]:
        q_pos = np.array(q_pos, np.int32)
        want = contract_reference(q, k[0], v[0], q_pos, lengths, window)
        got = run(q, view, q_pos, sliding_window=window, num_splits=2, block_k=16)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=f"{q_pos.tolist()} {window}")


# ---------------------------------------------------------------- dispatch and limits


def test_forced_dispatch_takes_the_kernel_with_a_traced_layer(monkeypatch):
    """JAXKV_PALLAS_GPU=1: attend_view's program holds the kernel (traced with the layer
    index an argument); =0 and LayerViews keep the other paths. (Its numbers through
    attend_view under jit: test_a_quantized_cache_after_crop_and_ragged_writes.)"""
    q, k, v, q_pos = contiguous_case(jnp.float32, 4, 1)

    def step(q, k, v, layer):
        view = ContiguousView(k, v, layer, jnp.asarray(LENGTHS, jnp.int32), jnp.float32)
        return attend_view(q, view, q_positions=jnp.asarray(q_pos), sliding_window=7)

    def program(*args):  # the mode is read when tracing: a fresh function is traced anew
        return str(jax.make_jaxpr(lambda *a: step(*a))(*args))

    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(0))
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    assert "pallas_call" in program(*args)
    dense = LayerView(jnp.asarray(k[0]), jnp.asarray(v[0]), None, jnp.asarray(LENGTHS, jnp.int32), None)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda q: attend_view(q, dense, q_positions=jnp.asarray(q_pos)))(
        args[0]))
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "0")
    assert "pallas_call" not in program(*args)
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "auto")
    assert ("pallas_call" in program(*args)) == (jax.default_backend() == "gpu")
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="JAXKV_PALLAS_GPU must be one of 'auto', '1', '0'"):
        program(*args)


def test_a_quantized_cache_after_crop_and_ragged_writes(monkeypatch):
    """The view a real QuantizedCache hands over (int4, residual ring after a crop and
    ragged writes, a layer index traced under jit) gives, through attend_view, the
    attention over what it stands for."""
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    rng = np.random.default_rng(3)
    prefill, steps = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                      for shape in ((2, HEADS, 20, DIM), (1, 2, HEADS, 2, DIM)))
    q = jnp.asarray(rng.standard_normal((2, 2 * HEADS, 2, DIM)), jnp.float32)

    def scenario(prefill, steps, q, layer):  # one program: eager cache ops would compile one each
        cache = QuantizedCache.init(num_layers=2, batch_size=2, num_kv_heads=HEADS, head_dim=DIM, max_length=SLOTS,
                                    bits=4, residual_length=4)
        cache, _ = cache.write(prefill, prefill + 1.0, layer, num_new=jnp.array([20, 13]))
        cache = cache.crop(jnp.array([17, 13]))
        for keys in steps:
            positions = cache.positions(2, layer, batch_size=2)
            cache, view = cache.write(keys, 0.5 * keys, layer, num_new=jnp.array([2, 1]))
        assert isinstance(view, QuantizedView)
        dense = view.dense()  # dequantized, residual tokens in place
        out = attend_view(q, view, q_positions=positions, sliding_window=9)
        return out, dense.keys, dense.values, positions, view.lengths

    options = pallas_gpu._INTERPRET_COMPILER_OPTIONS if INTERPRET else None
    traced = jax.jit(scenario, compiler_options=options).trace(prefill, steps, q, jnp.int32(1))
    assert "pallas_call" in str(traced.jaxpr)
    got, keys, values, positions, lengths = traced.lower().compile()(prefill, steps, q, jnp.int32(1))
    want = contract_reference(q, keys, values, positions, lengths, 9)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_what_the_kernels_do_not_take():
    def view(slots=SLOTS, dim=DIM):
        buffer = jnp.zeros((1, 1, 1, slots, dim))
        return ContiguousView(buffer, buffer, 0, jnp.zeros((1,), jnp.int32), jnp.float32)

    def call(q, v, **kw):
        return pallas_attend_view(q, v, q_positions=jnp.zeros(q.shape[::2][:2], jnp.int32), interpret=True, **kw)

    q = jnp.zeros((1, 2, 1, DIM))
    for bad_q, bad_view, message in [
        (jnp.zeros((1, 2, 17, DIM)), view(), "17 queries per row; the kernels take at most 16"),
        (jnp.zeros((1, 2, 1, 24)), view(dim=24), "head_dim 24"),
        (q, view(slots=12), "capacity 12; the kernels take at least 16 slots"),
        (q.astype(jnp.int32), view(), "the kernels take float32, bfloat16, float16"),
        (q, LayerView(jnp.zeros((1, 1, 8, DIM)), jnp.zeros((1, 1, 8, DIM)), None, jnp.zeros((1,), jnp.int32), 4),
         "LayerView is attended densely"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(bad_q, bad_view)
        assert not pallas_gpu.use_pallas(bad_q, bad_view)
    for kw, message in [(dict(num_splits=5, block_k=16), r"num_splits must be an int in \[1, 4\]"),
                        (dict(f32_precision="tf32"), "f32_precision must be 'highest' or 'tf32x3'"),
                        (dict(block_k=8), "block_k must be a power of two >= 16"),
                        (dict(sliding_window=0), "sliding_window must be a positive int"),
                        (dict(logit_softcap=-1.0), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
                        (dict(logit_softcap=float("inf")), r"logit_softcap must be in \[1e-30, 1e\+30\]"),
                        (dict(logit_softcap=3e38), r"logit_softcap must be in \[1e-30, 1e\+30\]")]:
        with pytest.raises(ValueError, match=message):
            call(q, view(), **kw)


def test_one_byte_buffers_of_2_to_4_gib_go_to_the_xla_loop(monkeypatch):
    """Pallas' Triton lowering gives an operand of at most 4 GiB 32-bit element offsets: int8
    codes (int4 pairs) of 2-4 GiB would be read from wrong addresses past element 2**31 - 1,
    so such a view is not the kernels' (the dispatch falls back, the direct call names why);
    at 2 GiB and above 4 GiB, and for 16-bit buffers of any size, the kernels take it.
    Abstract arrays: nothing is allocated."""
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    sds = jax.ShapeDtypeStruct
    batch, heads, dim = 2, 8, 128

    def quantized(layers, slots, bits=8):
        codes = sds((layers, batch, heads, slots, dim if bits == 8 else dim // 2), jnp.int8 if bits == 8 else jnp.uint8)
        scales = sds((layers, batch, heads, slots), jnp.uint16)
        residual = sds((batch, heads, 8, dim), jnp.bfloat16)
        return QuantizedView(codes, codes, scales, scales, residual, residual, sds((batch, 8), jnp.int32),
                             sds((), jnp.int32), sds((batch,), jnp.int32), bits, jnp.bfloat16, jnp.bfloat16)

    q = sds((batch, 4 * heads, 1, dim), jnp.bfloat16)
    slots = 2**31 // (32 * batch * heads * dim)  # 32 layers of it: exactly 2**31 int8 elements
    for layers, bits, taken in [(32, 8, True), (33, 8, False), (48, 8, False), (64, 8, False), (65, 8, True),
                                (66, 4, False), (130, 4, True)]:
        view = quantized(layers, slots, bits)
        why = pallas_gpu.unsupported_reason(q, view)
        assert (why is None) == taken, (layers, bits, why)
        assert pallas_gpu.use_pallas(q, view) == taken
        if not taken:
            assert why.startswith("keys ") and "32-bit offsets" in why and "XLA loop" in why
    # 16-bit floats are stored as uint16: 2**31 elements are exactly 4 GiB, never in the range
    big = sds((64, batch, heads, slots, dim), jnp.uint16)
    view = ContiguousView(big, big, sds((), jnp.int32), sds((batch,), jnp.int32), jnp.bfloat16)
    assert pallas_gpu.unsupported_reason(q, view) is None
    with pytest.raises(ValueError, match="32-bit offsets"):
        pallas_attend_view(q, quantized(40, slots), q_positions=sds((batch, 1), jnp.int32))


def test_a_vmapped_batch_of_one_byte_codes_in_the_wrapping_range_goes_to_the_xla_loop(monkeypatch):
    """The kernels' own vmap rule lowers the batched operand: two caches of 1.5 GiB of int8
    codes are one 3 GiB operand to Triton, 32-bit offsets that wrap (review 58); the batch
    takes the XLA loop then. (A device's shard of a larger sharded cache is checked the same
    way where the partitioned call is lowered.) Two of 0.5 GiB keep the kernels. Abstract
    arrays: nothing is allocated."""
    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    sds = jax.ShapeDtypeStruct

    def program(slots):  # one cache: 8 layers x 8 kv heads x slots x 128 int8 codes
        def one(q, codes, scales, lengths, pos):
            empty = jnp.zeros((1, 8, 0, 128), jnp.bfloat16)
            view = QuantizedView(codes, codes, scales, scales, empty, empty, jnp.zeros((1, 0), jnp.int32),
                                 jnp.int32(0), lengths, 8, jnp.bfloat16, jnp.bfloat16)
            return pallas_attend_view(q, view, q_positions=pos, interpret=INTERPRET)

        return str(jax.make_jaxpr(jax.vmap(one))(
            sds((2, 1, 32, 1, 128), jnp.bfloat16), sds((2, 8, 1, 8, slots, 128), jnp.int8),
            sds((2, 8, 1, 8, slots), jnp.uint16), sds((2, 1), jnp.int32), sds((2, 1, 1), jnp.int32)))

    assert "pallas_call" in program(2**16)  # 0.5 GiB each, 1 GiB batched
    assert "pallas_call" not in program(3 * 2**16)  # 1.5 GiB each, one 3 GiB operand


def test_the_triton_lowering_gives_operands_of_at_most_4_gib_32_bit_offsets():
    """The rule ``pallas_gpu._offsets_wrap`` assumes, read off the Triton IR Pallas lowers: a
    kernel loading 128 int8 elements at a traced offset of an operand of 2**31, 2**31 + 2**20,
    2**32 and 2**32 + 128 bytes. If jax widens its offsets, this fails: relax the check."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kernel(at_ref, x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(at_ref[0], 128)].astype(jnp.int32)  # an int32 output: only x is int8

    def load(at, x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.int32),
                              in_specs=[pl.no_block_spec, pl.no_block_spec],
                              compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(at, x)

    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    widths = {}
    with _abstract_gpu():
        for size in (2**31, 2**31 + 2**20, 2**32, 2**32 + 128):
            with _triton_ir() as modules:
                jax.export.export(jax.jit(load), platforms=["cuda"], disabled_checks=[triton])(
                    jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((size,), jnp.int8))
            (module,) = modules
            loads = [line for line in module.splitlines() if "tt.addptr" in line and "ptr<i8>" in line]
            assert loads, module
            widths[size] = {"i64" if "xi64>" in line.rsplit(",", 1)[1] else "i32" for line in loads}
    assert widths == {2**31: {"i32"}, 2**31 + 2**20: {"i32"}, 2**32: {"i32"}, 2**32 + 128: {"i64"}}, widths
    view = jax.ShapeDtypeStruct
    assert [pallas_gpu._offsets_wrap(view((n,), jnp.int8)) is not None for n in widths] == [False, True, True, False]


def test_a_traced_layer_outside_the_stack_is_nan_never_another_layer():
    """The direct attention functions with a layer index traced under jit and outside [0, L):
    the XLA loop's slice clamped it onto a real layer (layer L - 1's attention came out, or
    layer 0's for -1) and the Pallas kernels would read outside the buffers on a GPU; now the
    output is NaN on both (the CPU kernel raises at run time, as before). Inside the range the
    traced index gives the concrete one's answer. Views of real caches, each layer different."""
    from jaxkv.attention.blockwise import blockwise_attend, paged_blockwise_attend, quantized_blockwise_attend
    from jaxkv.caches import PagedCache, StaticCache

    rng = np.random.default_rng(5)
    sizes = dict(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=16, max_length=32)
    q = jnp.asarray(rng.standard_normal((2, 2, 1, 16)), jnp.float32)
    q_pos = jnp.asarray([[4], [2]], jnp.int32)
    xla = {
        "static": lambda v: blockwise_attend(q, v.keys, v.values, layer_idx=v.layer, q_positions=q_pos,
                                             kv_lengths=v.lengths, implementation="xla", kv_dtype=v.dtype),
        "paged": lambda v: paged_blockwise_attend(q, v, q_positions=q_pos, implementation="xla"),
        "quantized": lambda v: quantized_blockwise_attend(q, v, q_positions=q_pos, implementation="xla"),
    }
    for name, cache in {"static": StaticCache.init(**sizes), "paged": PagedCache.init(**sizes, page_size=16),
                        "quantized": QuantizedCache.init(**sizes, residual_length=2)}.items():
        for layer in range(2):
            k = jnp.asarray(rng.standard_normal((2, 1, 5, 16)), jnp.float32)
            cache, view = cache.write(k, k * 2 + layer, layer, num_new=jnp.asarray([5, 3], jnp.int32))
        paths = {"xla": xla[name]}
        if name == "static":  # the kernels share the layer guard (pallas_attend_view's): one kind is enough
            paths["pallas"] = lambda v: pallas_attend_view(q, v, q_positions=q_pos, interpret=INTERPRET)
        for path, attend in paths.items():
            traced = jax.jit(lambda i: attend(view._replace(layer=i)))
            np.testing.assert_allclose(np.asarray(traced(jnp.int32(1))), np.asarray(attend(view._replace(layer=1))),
                                       rtol=1e-6, atol=1e-6, err_msg=f"{name} {path}")
            for bad in (2, -1):
                assert np.isnan(np.asarray(traced(jnp.int32(bad)))).all(), (name, path, bad)


def test_float16_quantized_values_keep_their_digits_at_small_magnitudes():
    """int8 codes of a float16 model: each weight times its value scale was rounded to float16
    before the product, and with small values (scale ~1e-6) that fell below float16's normal
    range: error 5e-3 of the values at magnitude 1e-4, 2e-2 at 3e-5 (review 55). The scales
    are now divided by the block's largest first: the error stays at float16's rounding."""
    batch, dim, n = 4, 16, 250
    for magnitude in (1.0, 1e-4, 3e-5):
        rng = np.random.default_rng(0)
        k = jnp.asarray(rng.standard_normal((batch, 1, n, dim)) * 2, jnp.float16)
        v = jnp.asarray(rng.standard_normal((batch, 1, n, dim)) * magnitude, jnp.float16)
        q = jnp.asarray(rng.standard_normal((batch, 1, 1, dim)), jnp.float32)
        cache = QuantizedCache.init(num_layers=1, batch_size=batch, num_kv_heads=1, head_dim=dim, max_length=256,
                                    bits=8, dtype=jnp.float16)
        _, view = cache.write(k, v, 0)
        dense = view.dense()
        keys, values = (np.asarray(x[:, 0, :n], np.float64) for x in (dense.keys, dense.values))
        logits = np.einsum("bsd,bd->bs", keys, np.asarray(q[:, 0, 0], np.float64)) / np.sqrt(dim)
        weights = np.exp(logits - logits.max(1, keepdims=True))
        want = np.einsum("bs,bsd->bd", weights / weights.sum(1, keepdims=True), values)
        got = np.asarray(pallas_attend_view(q, view, q_positions=jnp.full((batch, 1), n - 1, jnp.int32),
                                            interpret=INTERPRET), np.float64)[:, 0, 0]
        assert np.abs(got - want).max() / np.abs(values).max() < 3e-4, magnitude


def test_review_58_an_unseen_scale_a_numpy_dtype_field_and_an_int64_layer(monkeypatch):
    """(1) float16 int8 codes: the block's largest value scale, which the others are divided
    by, was taken over unseen slots too: a large scale past the length moved the output by
    0.18 of 0.37; now the output does not move. (2) A hand-built view whose dtype field is
    np.float32 (a type, whose .shape is a descriptor) crashed the 2-4 GiB check. (3) A traced
    int64 layer of 2**32 + 1 was cast to int32 (1) before the range check: layer 1 came out."""
    rng = np.random.default_rng(0)
    slots, dim, n = 32, 16, 20
    codes = rng.integers(-127, 128, size=(2, 1, 1, 1, slots, dim)).astype(np.int8)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float16)
    empty = jnp.zeros((1, 1, 0, dim), jnp.float16)

    def attend(unseen_scale):
        scales = np.full((1, 1, 1, slots), 0.01, np.float32)
        scales[..., 25] = unseen_scale  # slot 25 >= length 20
        view = QuantizedView(jnp.asarray(codes[0]), jnp.asarray(codes[1]), jnp.full((1, 1, 1, slots), 0.01, jnp.float32),
                             jnp.asarray(scales), empty, empty, jnp.zeros((1, 0), jnp.int32), jnp.int32(0),
                             jnp.asarray([n]), 8, jnp.float16, jnp.float32)
        return np.asarray(pallas_attend_view(q, view, q_positions=jnp.asarray([[n - 1]]), interpret=INTERPRET,
                                             block_k=16), np.float64)

    base = attend(0.01)
    for scale in (1e4, 1e8):
        np.testing.assert_array_equal(attend(scale), base)

    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    k = jnp.asarray(rng.standard_normal((2, 1, 1, 16, 16)), jnp.float32)
    view = ContiguousView(k, k, 0, jnp.asarray([4]), np.float32)
    assert pallas_gpu.unsupported_reason(jnp.ones((1, 1, 1, 16)), view) is None
    attend_view(jnp.ones((1, 1, 1, 16)), view, q_positions=jnp.asarray([[3]]))

    from jaxkv.attention.blockwise import blockwise_attend

    with jax.enable_x64(True):
        f = jax.jit(lambda layer: blockwise_attend(k[0, :, :, :1], k, k, layer_idx=layer, q_positions=jnp.asarray([[5]]),
                                                   kv_lengths=jnp.asarray([6]), implementation="xla"))
        assert np.isnan(np.asarray(f(jnp.int64(2**32 + 1)))).all()
        assert not np.isnan(np.asarray(f(jnp.int64(1)))).any()


def test_empty_batches_and_queries_and_bad_view_lengths(monkeypatch):
    """No rows or no queries: the kernels divided by zero while tracing (the other paths return
    the empty result); now the dispatch falls back. A hand-built view whose lengths are not
    [B]: the XLA loop broadcast a [1] to every row (row 1 read slots it never filled), the
    kernels failed with messages naming none of this; now a ValueError naming the shape
    (review 55)."""
    from jaxkv.attention.blockwise import paged_blockwise_attend, quantized_blockwise_attend
    from jaxkv.caches import PagedCache

    monkeypatch.setenv(pallas_gpu.ENV_VAR, "1")
    buffer = jnp.zeros((1, 2, 1, 32, 16))
    view = ContiguousView(buffer, buffer, 0, jnp.asarray([3, 5], jnp.int32), jnp.float32)
    out = attend_view(jnp.zeros((2, 2, 0, 16)), view, q_positions=jnp.zeros((2, 0), jnp.int32))
    assert out.shape == (2, 2, 0, 16)
    empty = ContiguousView(buffer[:, :0], buffer[:, :0], 0, jnp.zeros((0,), jnp.int32), jnp.float32)
    assert attend_view(jnp.zeros((0, 2, 1, 16)), empty, q_positions=jnp.zeros((0, 1), jnp.int32)).shape == (0, 2, 1, 16)
    assert "no rows or no queries" in pallas_gpu.unsupported_reason(jnp.zeros((2, 2, 0, 16)), view)

    k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 8, 16)), jnp.float32)
    sizes = dict(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=16, max_length=32)
    q, pos = jnp.ones((2, 1, 1, 16)), jnp.asarray([[7], [7]], jnp.int32)
    for cache, attend in ((PagedCache.init(**sizes), paged_blockwise_attend),
                          (QuantizedCache.init(**sizes), quantized_blockwise_attend)):
        _, good = cache.write(k, k, 0, num_new=jnp.asarray([8, 3], jnp.int32))
        bad = good._replace(lengths=jnp.asarray([8], jnp.int32))
        for call in (lambda v: attend(q, v, q_positions=pos, implementation="xla"),
                     lambda v: pallas_attend_view(q, v, q_positions=pos, interpret=INTERPRET)):
            call(good)
            with pytest.raises(ValueError, match=r"the view's lengths must have shape \[2\]"):
                call(bad)


def test_kernels_run_under_x64():
    """Under jax_enable_x64 a Python int constant is int64 and a float float64: the kernels'
    block arithmetic (lax.div of int32 by int64) and the residual check's cond (int64 against
    int32) failed with a TypeError on every call; now each view equals the float64 reference."""
    from jaxkv.caches import PagedCache, StaticCache

    rng = np.random.default_rng(3)
    sizes = dict(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=16, max_length=32)
    made = {"static": StaticCache.init(**sizes), "paged": PagedCache.init(**sizes, page_size=16),
            "quantized": QuantizedCache.init(**sizes, residual_length=2)}
    with jax.enable_x64(True):
        for name, cache in made.items():
            k = jnp.asarray(rng.standard_normal((2, 1, 5, 16)), jnp.float32)
            cache, view = cache.write(k, k + 1, 0, num_new=jnp.asarray([5, 3], jnp.int32))
            q = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
            q_pos = np.asarray([[4], [2]], np.int32)
            dense = view.dense()
            want = contract_reference(q, np.asarray(dense.keys, np.float64), np.asarray(dense.values, np.float64),
                                      q_pos, np.asarray([5, 3]))
            got = pallas_attend_view(jnp.asarray(q), view, q_positions=jnp.asarray(q_pos), interpret=INTERPRET)
            assert got.dtype == jnp.float32, name
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=name)

"""HybridCache: layer kinds from HF configs (checked against transformers' own config
classes), per-layer dispatch against the NumPy models of both kinds, attention through
update_and_attend, full layers overflowing while sliding ones go on, a decode loop under
scan (the layer index must be static), x64, the error paths and Qwen parity.

The protocol every kind shares (random op programs against the NumPy model with NaN/inf
in unused slots, eager == jit, vmap, donation, traced bad row indices, the crop rule,
pickling) is tested once per kind in test_conformance.py."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import OVERFLOW, CacheError, DynamicCache, StaticCache
from jaxkv.attention import update_and_attend
from jaxkv.caches import FULL, SLIDING, HybridCache
from jaxkv.models.layer_types import layer_types_from_config
from jaxkv.caches import QuantizedCache
from jaxkv.caches import NO_POSITION, SlidingWindowCache
from test_sliding import band_attention, greedy, hf_greedy, hf_tiny

TYPES = (SLIDING, FULL, SLIDING, FULL)
B, H, D, S, W, EXTRA = 2, 2, 3, 12, 3, 1


@pytest.fixture(autouse=True)
def strict_promotion():
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


def make(batch=B, types=TYPES, dtype=jnp.float32):
    return HybridCache.init(
        layer_types=types, batch_size=batch, num_kv_heads=H, head_dim=D, max_length=S, window=W,
        extra_slots=EXTRA, dtype=dtype,
    )


def rand(rng, batch, t, heads=H):
    return rng.standard_normal((batch, heads, t, D)).astype(np.float32)


# ------------------------------------------------------------------------ HF configs


def test_layer_types_match_transformers_configs():
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    small = dict(num_hidden_layers=5, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    cases = [
        Qwen2Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=2),
        Qwen3Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=3),
        Qwen2Config(**small, use_sliding_window=False, sliding_window=8, max_window_layers=2),
        Qwen3Config(**small, layer_types=[FULL, SLIDING] * 2 + [FULL], use_sliding_window=True, sliding_window=4),
        MistralConfig(**small, sliding_window=8),
        MistralConfig(**small, sliding_window=None),
    ]
    for config in cases:
        types, window = layer_types_from_config(config)
        expected = getattr(config, "layer_types", None) or (
            [SLIDING if config.sliding_window else FULL] * 5  # Mistral: one window for every layer
        )
        assert list(types) == list(expected), config
        assert window == (config.sliding_window if SLIDING in types else None)
    assert layer_types_from_config(cases[0])[0] == (FULL, FULL, SLIDING, SLIDING, SLIDING)
    # A raw config.json dict (no post-processing): Qwen switches the window off by flag.
    raw = dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=False, sliding_window=4096, max_window_layers=1)
    assert layer_types_from_config(raw) == ((FULL,) * 3, None)
    raw["use_sliding_window"] = True
    assert layer_types_from_config(raw) == ((FULL, SLIDING, SLIDING), 4096)
    assert layer_types_from_config(dict(model_type="llama", num_hidden_layers=2)) == ((FULL, FULL), None)


def test_from_config_shapes_each_kind():
    config = dict(
        model_type="qwen3", num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1,
    )
    cache = HybridCache.from_config(config, batch_size=3, max_length=40, extra_slots=2, dtype=jnp.bfloat16)
    assert cache.layer_types == (FULL, SLIDING, SLIDING, SLIDING)
    assert cache.full.keys.shape == (1, 3, 2, 40, 16) and cache.sliding.keys.shape == (3, 3, 2, 8, 16)
    assert cache.window == 6 and cache.full.dtype == jnp.bfloat16 and cache.get_max_length() == 40
    del config["head_dim"]  # Qwen3Config's default, as the model reads it (this test said 32 // 4 before review 59)
    assert HybridCache.from_config(config, batch_size=1, max_length=8).full.head_dim == 128
    config["model_type"] = "qwen2"  # no head_dim of its own: hidden_size // num_attention_heads
    assert HybridCache.from_config(config, batch_size=1, max_length=8).full.head_dim == 32 // 4


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(model_type="gemma2", num_hidden_layers=2, sliding_window=4), "Pass layer_types"),
        (dict(num_hidden_layers=2, layer_types=[FULL]), "expected one per layer"),
        (dict(num_hidden_layers=2, layer_types=[FULL, "linear_attention"]), "linear_attention"),
        (dict(num_hidden_layers=2, layer_types=[FULL, SLIDING]), "sliding window is None"),
        (dict(model_type="mistral"), "num_hidden_layers must be an int"),
    ],
)
def test_bad_configs(config, match):
    with pytest.raises(ValueError, match=match):
        layer_types_from_config(config)


# --------------------------------------------------------- layers mapped to storages


def test_crop_and_row_ops_map_each_layer_to_its_storage():
    """Two layers of each kind: the ring storage holds layers 0 and 2, the contiguous one
    layers 1 and 3. (Random op programs on a hybrid cache: test_conformance.py, with one
    layer of each kind.)"""
    rng = np.random.default_rng(2)
    cache = make()
    for layer, n in enumerate((2, 5, 5, 4)):
        cache, _, _ = cache.update(rand(rng, B, 5), rand(rng, B, 5), layer, num_new=jnp.array([n, n - 1]))
    # Only layer 2 (the second ring layer, C = 4) has evicted what crop(-3) needs.
    with pytest.raises(ValueError, match=r"layer 2, row 0 holds positions 1\.\.4; rolling back to 2 tokens"):
        cache.crop(-3)
    out = cache.crop(-1)  # each layer loses one token of its own length
    assert [out.seq_lengths(i).tolist() for i in range(4)] == [[1, 0], [4, 3], [4, 3], [3, 2]]
    no = NO_POSITION
    np.testing.assert_array_equal(out.kv_positions(0), [[0, no, no, no], [no] * 4])
    np.testing.assert_array_equal(out.kv_positions(2), [[no, 1, 2, 3], [0, 1, 2, no]])
    np.testing.assert_array_equal(out.kv_positions(3)[:, :4], [[0, 1, 2, no], [0, 1, no, no]])
    rep = out.batch_repeat_interleave(2).batch_select_indices(jnp.array([3, 0]))
    assert [rep.seq_lengths(i).tolist() for i in range(4)] == [[0, 1], [3, 4], [3, 4], [2, 3]]
    np.testing.assert_array_equal(rep.kv_positions(2), out.kv_positions(2)[::-1])
    np.testing.assert_array_equal(rep[2][0], out[2][0][::-1])


# ------------------------------------------------------------------------ attention


def test_update_and_attend_equals_numpy_attention_per_layer_kind():
    """A 4-layer pass per chunk: sliding layers see a band, full layers all earlier tokens."""
    rng = np.random.default_rng(0)
    cache = make()
    history = {(layer, b): [np.zeros((H, 0, D), np.float32)] * 2 for layer in range(len(TYPES)) for b in range(B)}

    @jax.jit
    def forward(cache, q, k, v):  # one pass over every layer, as a model does
        positions = cache.positions(q.shape[3])
        outs = []
        for layer, kind in enumerate(TYPES):
            out, cache = update_and_attend(q[layer], k[layer], v[layer], cache, layer, positions=positions,
                                           sliding_window=W if kind == SLIDING else None)
            outs.append(out)
        return jnp.stack(outs), cache

    for t in (5, 1, 3, 1, 2):
        positions = np.asarray(cache.positions(t))
        q = rng.standard_normal((len(TYPES), B, 2 * H, t, D)).astype(np.float32)
        k = rng.standard_normal((len(TYPES), B, H, t, D)).astype(np.float32)
        v = rng.standard_normal((len(TYPES), B, H, t, D)).astype(np.float32)
        with jax.numpy_rank_promotion("allow"):  # attend() broadcasts [S] with [B, 1]
            out, cache = forward(cache, q, k, v)
        for (layer, kind), b in itertools.product(enumerate(TYPES), range(B)):  # every row: its own data
            hk, hv = history[layer, b]
            hk = np.concatenate([hk, k[layer, b]], axis=1)
            hv = np.concatenate([hv, v[layer, b]], axis=1)
            history[layer, b] = [hk, hv]
            window = W if kind == SLIDING else 10**6
            for i in range(t):
                p = int(positions[b, i])
                expected = band_attention(q[layer, b, :, i], hk[:, : p + 1], hv[:, : p + 1], p, window)
                np.testing.assert_allclose(np.asarray(out[layer, b, :, i]), expected, rtol=2e-5, atol=2e-5)
    assert cache.sliding.capacity == W + EXTRA and cache.get_seq_length(1) == 12


def test_update_and_attend_accepts_every_cache_kind():
    rng = np.random.default_rng(1)
    q, k, v = rand(rng, B, 3, heads=2 * H), rand(rng, B, 3), rand(rng, B, 3)
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (B, 3))
    sizes = dict(batch_size=B, num_kv_heads=H, head_dim=D)
    run = jax.jit(
        lambda cache, layer, window=None: update_and_attend(q, k, v, cache, layer, positions=positions,
                                                            sliding_window=window),
        static_argnums=(1, 2),
    )
    with jax.numpy_rank_promotion("allow"):
        reference, _ = run(None, 0)
        for cache in (
            StaticCache.init(num_layers=1, max_length=4, **sizes),
            DynamicCache(num_layers=1),
            SlidingWindowCache.init(num_layers=1, window=4, **sizes),
            QuantizedCache.init(num_layers=1, max_length=4, residual_length=3, **sizes),
            make(),
        ):
            out, new = run(cache, 1 if isinstance(cache, HybridCache) else 0)
            np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5, err_msg=type(cache).__name__)
            assert type(new) is type(cache)
        with pytest.raises(ValueError, match="has window 3 but the model asks for sliding_window=8"):
            run(make(), 0, 8)


# ---------------------------------------------------------------- jit, vmap, donation


def filled(seed=0):
    rng = np.random.default_rng(seed)
    cache = make()
    for layer in range(len(TYPES)):
        cache, _, _ = cache.update(rand(rng, B, 5), rand(rng, B, 5), layer, num_new=jnp.array([5, 3]))
    return cache


K2 = rand(np.random.default_rng(3), B, 2)


def test_full_layers_overflow_while_sliding_layers_go_on():
    # (Donation of both parts, the compile count: test_conformance.py.)
    def step(cache, k):
        for layer in range(len(TYPES)):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    jitted = jax.jit(step)
    cache, k = make(), jnp.ones((B, H, 1, D))
    for _ in range(S):
        cache = jitted(cache, k)
    assert not np.asarray(cache.flags).any()
    out = jitted(cache, k)  # the full layers are at capacity: dropped and flagged, sliding goes on
    assert (np.asarray(out.flags) & OVERFLOW).all() and out.get_seq_length(0) == S + 1
    assert out.get_seq_length(1) == S
    with pytest.raises(CacheError, match=r"overflowed max_length=12"):
        out.check()


def test_scan_decode_loop_equals_step_loop():
    ks = jnp.asarray(rand(np.random.default_rng(4), B, 7))

    def step(cache, k):  # k: [B, H, D]
        for layer in range(len(TYPES)):
            cache, _, _ = cache.update(k[:, :, None], k[:, :, None] * (layer + 1), layer)
        return cache, cache.kv_positions(0)

    scanned, positions = jax.jit(lambda c: jax.lax.scan(step, c, jnp.moveaxis(ks, 2, 0)))(make())
    looped, jitted = make(), jax.jit(step)
    for t in range(7):
        looped, last = jitted(looped, ks[:, :, t])
    chex.assert_trees_all_equal(scanned, looped)
    np.testing.assert_array_equal(positions[-1], last)


@pytest.mark.slow
def test_x64_mode_keeps_int32_indices_and_storage_dtypes():
    """Under jax_enable_x64 (a subprocess): storage dtypes and int32 indices stay as they are, and
    attention over static, paged and quantized caches with int64 positions equals NumPy, and
    generate gives the uncached forward's greedy tokens (it raised on a dynamic_slice of mixed
    int32/int64 indices before)."""
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp
        from jaxkv.caches import HybridCache
        from jaxkv.caches import QuantizedCache
        k = jnp.ones((2, 1, 5, 4), jnp.float64)
        h = HybridCache.init(layer_types=["sliding_attention", "full_attention"], batch_size=2, num_kv_heads=1,
                             head_dim=4, max_length=8, window=3, dtype=jnp.bfloat16)
        h, view = h.update_view(k, k, 0, num_new=jnp.array([5, 2]))
        h = jax.jit(lambda c: c.update(k, k, 1)[0])(h).crop(jnp.array([9, 2])).reorder_cache(jnp.array([1, 0]))
        assert view.keys.dtype == jnp.bfloat16 and view.kv_positions.dtype == jnp.int32
        s = h.sliding
        assert s.keys.dtype == jnp.bfloat16 and s.lengths.dtype == s.starts.dtype == jnp.int32
        assert h.kv_positions(0).dtype == jnp.int32 and h.positions(2).dtype == jnp.int32
        assert h.seq_lengths(0).tolist() == [2, 5] and h.seq_lengths(1).tolist() == [2, 5], h
        q = QuantizedCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_length=8, bits=4,
                                residual_length=2, dtype=jnp.bfloat16)
        q, keys, _ = jax.jit(lambda c: c.update(k, k, jnp.int64(0), num_new=jnp.array([5, 2])))(q)
        assert keys.dtype == jnp.bfloat16 and q.keys.dtype == jnp.uint8
        assert q.lengths.dtype == q.residual_positions.dtype == jnp.int32
        # Attention over every layout with int64 positions (x64 makes jnp.arange int64):
        # float32 out, equal to a float64 NumPy reference, for a 5-token chunk and a decode step.
        import numpy as np
        from jaxkv import PagedCache, StaticCache
        from jaxkv.attention import cache_attention
        rng = np.random.default_rng(0)
        kk, vv = (rng.standard_normal((2, 2, 6, 8)).astype(np.float32) for _ in range(2))
        qq = rng.standard_normal((2, 4, 6, 8)).astype(np.float32)
        def reference(t):
            out = np.zeros((2, 4, t, 8))
            for b in range(2):
                for h in range(4):
                    k, v = kk[b, h // 2, :t].astype(np.float64), vv[b, h // 2, :t].astype(np.float64)
                    for i in range(t):
                        w = np.exp(k[: i + 1] @ qq[b, h, i] / np.sqrt(8))
                        out[b, h, i] = (w / w.sum()) @ v[: i + 1]
            return out
        step = jax.jit(lambda c, q, k, v, p: cache_attention(q, k, v, c, 0, positions=p))
        for cache in (StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=8, max_length=8),
                      PagedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=8, max_length=8, page_size=4),
                      QuantizedCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=8, max_length=8, bits=8,
                                          residual_length=8)):
            pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
            assert pos.dtype == jnp.int64
            out, cache = step(cache, qq[:, :, :5], kk[:, :, :5], vv[:, :, :5], pos)
            last, cache = step(cache, qq[:, :, 5:], kk[:, :, 5:], vv[:, :, 5:], cache.positions(1))
            assert out.dtype == last.dtype == jnp.float32, (type(cache).__name__, out.dtype, last.dtype)
            got = np.concatenate([np.asarray(out), np.asarray(last)], axis=2)
            np.testing.assert_allclose(got, reference(6), rtol=1e-5, atol=1e-5, err_msg=type(cache).__name__)
            assert cache.seq_lengths(0).dtype == jnp.int32 and cache.seq_lengths(0).tolist() == [6, 6]
        # A model under x64 (int64 token ids): generate's greedy tokens are the uncached forward's.
        from flax import nnx
        import jaxkv
        from jaxkv.models.llama import Llama, LlamaConfig
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=4)
        model = Llama(config, rngs=nnx.Rngs(0))
        ids = jnp.asarray([[3, 5, 7, 9], [1, 2, 3, 4]])
        assert ids.dtype == jnp.int64
        tokens = jaxkv.generate(model, ids, 3).tokens
        # One uncached forward over prompt + generated tokens (full attention): each greedy
        # token is the argmax after the tokens before it.
        logits = jax.jit(lambda seq: model(seq)[0])(jnp.concatenate([ids, tokens.astype(ids.dtype)], axis=1))
        np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(logits[:, 3:6]), -1))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


# ---------------------------------------------------------------------------- errors


def test_numpy_int_extra_slots_and_crop_to_empty():
    cache = HybridCache.init(layer_types=[SLIDING, FULL], batch_size=1, num_kv_heads=1, head_dim=2, max_length=8,
                             window=2, extra_slots=np.int64(1))
    assert cache.stores[cache.groups[0]].num_slots == 3
    full = filled()  # the ring layers have evicted positions: emptying a row needs none of them
    out = full.crop(jnp.array([-(2**20)] * B))
    np.testing.assert_array_equal(out.lengths, np.zeros_like(full.lengths))
    assert not np.asarray(out.flags).any()


def test_kv_positions_of_both_kinds():
    cache = filled()
    np.testing.assert_array_equal(cache.kv_positions(0)[0], [4, 1, 2, 3])  # ring of 4, 5 seen
    full = np.asarray(cache.kv_positions(1))
    np.testing.assert_array_equal(full[1, :4], [0, 1, 2, NO_POSITION])
    assert cache[0][0].shape == (B, H, W + EXTRA, D) and cache[1][0].shape == (B, H, S, D)
    assert len(cache) == 4 and len(list(cache)) == 4


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: jax.jit(lambda c, i: c.update(K2, K2, i))(c, jnp.int32(0)), TypeError, "must be a Python int"),
        (lambda c: c.update(K2, K2, 4), ValueError, "layer_idx 4 is out of range"),
        (lambda c: c.update(K2[:, :1], K2[:, :1], 1), ValueError, "kv_heads=1"),
        (lambda c: c.crop(-3), ValueError, "evicted"),
        (lambda c: c.reorder_cache(jnp.array([0])), ValueError, "HybridCache.reorder_cache: beam_idx"),
        (lambda c: c.batch_select_indices(jnp.array([3])), ValueError, "HybridCache.batch_select_indices: row index 3"),
        (lambda c: c.batch_repeat_interleave(0), ValueError, "repeats must be >= 1"),
        (lambda c: c.reset(jnp.array([1, 0])), TypeError, "HybridCache.reset: rows must be a bool array"),
        (lambda c: make(types=()), ValueError, "layer_types is empty"),
        (lambda c: make(types=(FULL, "chunked_attention")), ValueError, "chunked_attention"),
        (lambda c: HybridCache.init(layer_types=[SLIDING], batch_size=1, num_kv_heads=1, head_dim=1, max_length=4),
         ValueError, "window must be given"),
        (lambda c: HybridCache.init(layer_types=[SLIDING], batch_size=1, num_kv_heads=1, head_dim=1, max_length=4,
                                    window=2, extra_slots=True), ValueError, "extra_slots must be an int >= 0, got True"),
        (lambda c: c.crop(-5).put_rows(jnp.array([0]), make(batch=1, types=(FULL, SLIDING, FULL, SLIDING))),
         TypeError, "another kind or layer layout"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call(filled())


def test_all_full_or_all_sliding():
    full = make(types=(FULL, FULL))
    assert full.sliding is None and full.window is None and full.get_max_length() == S
    sliding = make(types=(SLIDING,))
    assert sliding.full is None and sliding.get_max_length() is None
    sliding, _, _ = sliding.update(K2, K2, 0)
    assert sliding.reorder_cache(jnp.array([1, 0])).get_seq_length() == 2


# ------------------------------------------------------------- model integration (HF)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_qwen_hybrid_greedy_tokens_equal_transformers(family, tmp_path):
    """Layer 0 full, layers 1-2 sliding (window 6): 48 greedy tokens as transformers."""
    pytest.importorskip("transformers")
    from jaxkv.models import from_pretrained

    hf = hf_tiny(f"{family}ForCausalLM", f"{family}Config", tmp_path, num_hidden_layers=3, use_sliding_window=True,
                 sliding_window=6, max_window_layers=1)
    loaded = from_pretrained(tmp_path)
    cache = HybridCache.from_config(hf.config, batch_size=2, max_length=10 + 48)
    assert cache.layer_types == (FULL, SLIDING, SLIDING) and cache.window == 6
    ids = np.random.default_rng(1).integers(0, 128, (2, 10))
    got, cache = greedy(loaded.model, ids, cache, 48)
    np.testing.assert_array_equal(got, hf_greedy(hf, ids, 48))
    assert cache.get_seq_length(0) == cache.get_seq_length(2) == 10 + 47


def test_from_config_takes_the_models_defaults_for_left_out_keys():
    """A config.json without head_dim (Qwen3: 128 in transformers) or num_key_value_heads
    (Mistral: 8) gave HybridCache.from_config 64 and 16, a cache the model refused, while
    LlamaConfig.from_hf took transformers' class defaults (review 59)."""
    transformers = pytest.importorskip("transformers")
    from jaxkv import HybridCache
    from jaxkv.models import LlamaConfig

    qwen3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, hidden_size=512, intermediate_size=64, vocab_size=100,
                 use_sliding_window=True, sliding_window=16, max_window_layers=1)
    mistral = dict(architectures=["MistralForCausalLM"], model_type="mistral", num_hidden_layers=2,
                   num_attention_heads=16, hidden_size=512, intermediate_size=64, vocab_size=100, sliding_window=16)
    for cfg, cls in ((qwen3, transformers.Qwen3Config), (mistral, transformers.MistralConfig)):
        hf = cls(**cfg)
        cache = HybridCache.from_config(cfg, batch_size=1, max_length=32)
        model = LlamaConfig.from_hf(cfg)
        assert (cache.num_kv_heads, cache.head_dim) == (model.num_kv_heads, model.head_dim) == (
            hf.num_key_value_heads, hf.head_dim)

"""The NNX/linen integration and the Llama-family model over jaxkv caches (no HF needed)."""

import copy
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import DynamicCache, StaticCache
from jaxkv.generation import _generate, decode_step, generate, prefill
from jaxkv.models import Llama, LlamaConfig
from jaxkv.models.llama import rope_frequencies
from jaxkv.nnx import KVAttention, token_positions

TOL = dict(rtol=2e-5, atol=2e-5)


def make_model(seed=0, **overrides):
    """A tiny random model with norms moved off their all-ones init."""
    model = Llama(LlamaConfig.tiny(**overrides), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "weight" in path or "bias" in path:  # RMSNorm weights and biases
            var.set_value(var.get_value() + jnp.asarray(0.3 * rng.normal(size=var.get_value().shape), jnp.float32))
    return model


@partial(nnx.jit, donate_argnames="cache")
def forward(model, tokens, cache, num_new=None):
    return model(tokens, cache, num_new)


@nnx.jit
def full_forward(model, tokens):
    return model(tokens, None)[0]


VARIANTS = {
    "llama": {},
    "qwen3_window": dict(qk_norm=True, qkv_bias=True, out_bias=True, sliding_window=4, sliding_layers=(True, False)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_cached_chunks_equal_full_forward(variant, chunk):
    """Prefill in chunks of `chunk` tokens, then decode: every step's logits == uncached."""
    model = make_model(**VARIANTS[variant])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, size=(2, 11)), jnp.int32)
    full = full_forward(model, tokens)
    cache = model.init_cache(batch_size=2, max_length=16)
    start = 0
    prompt_len = 8
    while start < tokens.shape[1]:
        size = chunk if start < prompt_len else 1
        logits, cache = forward(model, tokens[:, start : start + size], cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, start : start + size]), **TOL)
        start += size
    np.testing.assert_array_equal(np.asarray(cache.seq_lengths(1)), [11, 11])


def test_ragged_chunks_equal_each_row_alone():
    """Rows of different lengths fed in chunks with per-row num_new == each row run alone."""
    model = make_model(seed=2)
    lengths = [9, 4, 1]
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 128, size=n) for n in lengths]
    padded = np.full((3, 9), 127)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = row
    cache = model.init_cache(batch_size=3, max_length=12)
    got = [[] for _ in rows]
    for start in range(0, 9, 3):
        num_new = np.clip(np.array(lengths) - start, 0, 3)
        logits, cache = forward(model, jnp.asarray(padded[:, start : start + 3]), cache, jnp.asarray(num_new, jnp.int32))
        for b in range(3):
            got[b].append(np.asarray(logits[b, : num_new[b]]))
    np.testing.assert_array_equal(np.asarray(cache.seq_lengths(0)), lengths)
    for b, row in enumerate(rows):
        alone = full_forward(model, jnp.asarray(row[None], jnp.int32))[0]
        np.testing.assert_allclose(np.concatenate(got[b]), np.asarray(alone), **TOL)


def _fill_unused_with_nan(cache: StaticCache) -> StaticCache:
    slots = jnp.arange(cache.max_length)
    unused = slots[None, None, None, :, None] >= cache.lengths[:, :, None, None, None]  # [L, B, 1, S, 1]
    storage = dataclasses.replace(
        cache.stores[0], keys=jnp.where(unused, jnp.nan, cache.keys), values=jnp.where(unused, jnp.nan, cache.values)
    )
    nan_cache = dataclasses.replace(cache, stores=(storage,))
    # Own copies of every leaf: donating one cache must not delete the other's lengths.
    return jax.tree.map(jnp.copy, nan_cache)


def test_nan_in_every_unused_slot_changes_nothing():
    model = make_model(seed=4, sliding_window=3, sliding_layers=(True, True))
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, 128, size=(3, 6)), jnp.int32)
    num_new = jnp.array([6, 2, 4], jnp.int32)
    cache = model.init_cache(batch_size=3, max_length=10)
    _, cache = forward(model, prompt, cache, num_new)
    nan_cache = _fill_unused_with_nan(cache)
    assert np.isnan(np.asarray(nan_cache.keys)).any()
    step = jnp.array([[7], [8], [9]], jnp.int32)
    for _ in range(3):
        clean, cache = forward(model, step, cache)
        dirty, nan_cache = forward(model, step, nan_cache)
        np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
        step = jnp.argmax(clean[:, -1:], axis=-1).astype(jnp.int32)


def test_dynamic_cache_equals_full_forward():
    model = make_model(seed=6)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 128, size=(2, 6)), jnp.int32)
    full = full_forward(model, tokens)
    step = nnx.jit(lambda model, tokens, cache: model(tokens, cache))
    first, cache = step(model, tokens[:, :4], DynamicCache())
    second, cache = step(model, tokens[:, 4:], cache)
    np.testing.assert_allclose(np.asarray(jnp.concatenate([first, second], axis=1)), np.asarray(full), **TOL)
    assert cache.get_seq_length(1) == 6
    with pytest.raises(ValueError, match="DynamicCache does not track"):
        model(tokens[:, :1], DynamicCache(), jnp.array([1, 1]))


def test_jitted_step_donates_the_cache():
    model = make_model()
    cache = model.init_cache(batch_size=1, max_length=4)
    old_keys = cache.keys
    _, new_cache = forward(model, jnp.array([[1, 2]], jnp.int32), cache)
    assert old_keys.is_deleted()
    assert int(new_cache.seq_lengths(0)[0]) == 2


def test_jax_jit_prefill_and_donated_decode_step_compile_once():
    """The building blocks of generate under plain jax.jit: model as split (graphdef, state)."""
    model = make_model(seed=13)
    graphdef, state = nnx.split(model)
    jit_prefill = jax.jit(prefill, static_argnames="graphdef", donate_argnames="cache")
    jit_step = jax.jit(decode_step, static_argnames="graphdef", donate_argnames="cache")
    prompt = jnp.asarray(np.random.default_rng(14).integers(0, 128, size=(2, 4)), jnp.int32)
    cache = model.init_cache(batch_size=2, max_length=8)
    tokens, cache = jit_prefill(graphdef, state, prompt, jnp.array([4, 2], jnp.int32), cache)
    tokens, cache = jit_step(graphdef, state, tokens, cache)
    compiled = jit_step._cache_size()
    for _ in range(2):
        old = cache
        tokens, cache = jit_step(graphdef, state, tokens, cache)
        assert old.keys.is_deleted()
    # Fill levels are data, not part of the compiled shape: later steps reuse the program.
    assert jit_step._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(cache.seq_lengths(1)), [7, 5])


def test_generate_greedy_ragged_equals_alone_and_compiles_once():
    model = make_model(seed=8)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 128, size=n) for n in (5, 2)]
    padded = np.zeros((2, 5), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    together = generate(model, padded, 6, prompt_lengths=np.array([5, 2])).tokens
    assert together.shape == (2, 6) and together.dtype == jnp.int32
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(np.asarray(generate(model, p[None], 6).tokens)[0], np.asarray(together[b]))
    # Greedy reference: extend the sequence and rerun the full uncached forward each step.
    seq = prompts[0][None]
    for _ in range(6):
        seq = np.concatenate([seq, np.argmax(full_forward(model, jnp.asarray(seq, jnp.int32))[:, -1:], -1)], axis=1)
    np.testing.assert_array_equal(seq[0, 5:], np.asarray(together[0]))

    compiled = _generate._cache_size()
    again = generate(model, padded[::-1].copy(), 6, prompt_lengths=np.array([2, 5])).tokens
    assert _generate._cache_size() == compiled, "a second call with the same shapes recompiled"
    np.testing.assert_array_equal(np.asarray(again[::-1]), np.asarray(together))


def test_bfloat16_model_and_cache_stay_bfloat16():
    model = make_model(seed=10)
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 128, size=(2, 5)), jnp.int32)
    ref = np.asarray(full_forward(model, tokens))
    bf16 = Llama(model.config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    cache = bf16.init_cache(batch_size=2, max_length=8)
    assert cache.keys.dtype == jnp.bfloat16
    logits, cache = forward(bf16, tokens, cache)
    assert logits.dtype == jnp.bfloat16 and cache.keys.dtype == jnp.bfloat16
    err = np.abs(np.asarray(logits, np.float32) - ref).max() / np.abs(ref).max()
    assert err < 5e-2, err


def test_linen_module_shares_the_cache_contract():
    from jaxkv.linen import KVSelfAttention

    nnx_attn = KVAttention(16, 4, 2, 8, layer_idx=0, rngs=nnx.Rngs(0))
    linen_attn = KVSelfAttention(num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=0)
    x = jnp.asarray(np.random.default_rng(12).normal(size=(2, 5, 16)), jnp.float32)
    cache = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=8, max_length=8)
    positions = token_positions(cache, 2, 3)
    params = linen_attn.init(jax.random.key(0), x[:, :3], cache, positions=positions)
    # Same weights in both: linen's DenseGeneral kernels are the nnx kernels reshaped.
    p = params["params"]
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(nnx_attn, name).kernel.set_value(p[name]["kernel"].reshape(16, -1))
    nnx_attn.o_proj.kernel.set_value(p["o_proj"]["kernel"].reshape(-1, 16))

    linen_cache, nnx_cache = cache, cache
    for start, size in ((0, 3), (3, 1), (4, 1)):
        positions = token_positions(linen_cache, 2, size)
        chunk = x[:, start : start + size]
        y_linen, linen_cache = linen_attn.apply(params, chunk, linen_cache, positions=positions)
        y_nnx, nnx_cache = nnx_attn(chunk, nnx_cache, positions=positions)
        np.testing.assert_allclose(np.asarray(y_linen), np.asarray(y_nnx), **TOL)
    full, _ = linen_attn.apply(params, x, None, positions=token_positions(None, 2, 5))
    np.testing.assert_allclose(np.asarray(y_linen), np.asarray(full[:, 4:5]), **TOL)
    np.testing.assert_array_equal(np.asarray(linen_cache.seq_lengths(0)), [5, 5])


def test_llama3_rope_scaling_bands():
    """High frequencies untouched, low ones divided by factor, medium ones in between."""
    base = rope_frequencies(64, 500000.0, None)
    scaled = rope_frequencies(
        64, 500000.0,
        (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
         ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
    )
    wavelen = 2 * np.pi / base
    high, low = wavelen < 8192 / 4, wavelen > 8192
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-6)
    medium = ~high & ~low
    assert medium.any()
    assert ((scaled[medium] < base[medium]) & (scaled[medium] > base[medium] / 8)).all()


HF_LLAMA = dict(
    architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
)


def test_config_from_hf_layouts():
    v4 = LlamaConfig.from_hf(
        HF_LLAMA | dict(rope_theta=5e5, rope_scaling=dict(type="linear", factor=2.0), tie_word_embeddings=True)
    )
    assert v4.rope_theta == 5e5 and dict(v4.rope_scaling) == dict(factor=2.0, rope_type="linear")
    assert v4.head_dim == 4 and v4.tie_word_embeddings and v4.sliding_window is None
    v5 = LlamaConfig.from_hf(HF_LLAMA | dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)))
    assert v5.rope_scaling is None and v5.rope_theta == 1e4
    qwen2 = LlamaConfig.from_hf(
        HF_LLAMA | dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16, max_window_layers=1)
    )
    assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.sliding_layers == (False, True)
    mistral = LlamaConfig.from_hf(HF_LLAMA | dict(architectures=["MistralForCausalLM"], sliding_window=8))
    assert mistral.sliding_layers == (True, True) and mistral.sliding_window == 8
    qwen3 = LlamaConfig.from_hf(HF_LLAMA | dict(architectures=["Qwen3ForCausalLM"], head_dim=12))
    assert qwen3.qk_norm and qwen3.head_dim == 12


_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_DROP = object()  # a key the config.json leaves out


@pytest.mark.parametrize(
    "change",
    [
        # llama3 without original_max_position_embeddings: transformers takes max_position_embeddings
        dict(max_position_embeddings=64, rope_parameters=dict(_LLAMA3, rope_theta=1e4)),
        # a legacy rope_scaling beside rope_parameters replaces it whole (its theta too)
        dict(max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=5e5),
             rope_scaling=dict(_LLAMA3, original_max_position_embeddings=32)),
        # rope_theta missing from the dict comes from the top level
        dict(max_position_embeddings=64, rope_theta=300.0, rope_scaling=dict(type="linear", factor=2.0)),
        # no context anywhere: transformers' class default (LlamaConfig: 2048); jaxkv refused it
        dict(max_position_embeddings=_DROP, rope_parameters=dict(_LLAMA3, rope_theta=1e4)),
        # the default RoPE ignores a partial_rotary_factor in the dict as at the top level (a
        # re-saved config moves it there), and a null top-level theta defers to the dict's
        # (both refused until review 75)
        dict(rope_parameters=dict(rope_type="default", rope_theta=2e4, partial_rotary_factor=0.5)),
        dict(rope_theta=None, rope_parameters=dict(rope_type="default", rope_theta=3e4)),
    ],
    ids=["llama3-no-original", "scaling-replaces-parameters", "top-level-theta", "llama3-no-context",
         "default-partial-in-dict", "null-top-level-theta"],
)
def test_config_rope_resolves_as_transformers(change):
    """The RoPE parameters jaxkv reads from a config.json are those transformers' own config
    resolves from the same dict (the frequencies they give: ``test_llama3_rope_scaling_bands``,
    and a llama3-scaled model against transformers in ``test_hf_parity``)."""
    import warnings

    transformers = pytest.importorskip("transformers")
    hf = {k: v for k, v in (HF_LLAMA | change).items() if v is not _DROP}
    cfg = LlamaConfig.from_hf(copy.deepcopy(hf))  # transformers fills the rope dicts in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = dict(transformers.LlamaConfig(**copy.deepcopy(hf)).rope_parameters)
    assert cfg.rope_theta == ref.pop("rope_theta")
    ref.pop("type", None)
    if ref["rope_type"] == "default":
        assert cfg.rope_scaling is None
    else:
        assert dict(cfg.rope_scaling) == ref


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "rope_type 'yarn' is not supported"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=4.0)), "needs rope parameter"),
        (dict(vocab_size=None), "missing required key 'vocab_size'"),
        (dict(num_key_value_heads=3), "must be a multiple"),
    ],
)
def test_config_from_hf_errors(change, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(HF_LLAMA | change, source="dir/config.json")


def test_bad_model_inputs_raise():
    model = make_model()
    with pytest.raises(ValueError, match="tokens must have shape"):
        model(jnp.array([1, 2, 3]), None)
    # float or bool ids: a TypeError that names the argument (it was Flax's "Input type
    # must be an integer or unsigned integer" from inside nnx.Embed)
    for ids in (jnp.array([[0.0, 3.0]]), jnp.array([[True, False]])):
        with pytest.raises(TypeError, match="tokens must hold integer token ids"):
            model(ids, None)
    # a nested list is taken, as generate takes one (it was "'list' object has no attribute 'ndim'")
    np.testing.assert_array_equal(model([[1, 2]], None)[0], model(jnp.array([[1, 2]]), None)[0])
    wrong = StaticCache.init(num_layers=3, batch_size=1, num_kv_heads=2, head_dim=16, max_length=4)
    with pytest.raises(ValueError, match="model.init_cache"):
        model(jnp.array([[1]]), wrong)
    with pytest.raises(TypeError, match="cache must be a jaxkv"):
        model(jnp.array([[1]]), {"keys": 0})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        KVAttention(16, 3, 2, 8, layer_idx=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((np.array([1, 2]), 4), {}, ValueError, "input_ids must have shape"),
        ((np.array([[1.0, 2.0]]), 4), {}, TypeError, "integer token ids"),
        ((np.array([[1, 2]]), 0), {}, ValueError, "max_new_tokens must be"),
        ((np.array([[1, 2]]), 2), dict(prompt_lengths=np.array([1, 2])), ValueError, r"shape \[batch\]"),
        ((np.array([[1, 2]]), 2), dict(prompt_lengths=np.array([3])), ValueError, r"outside \[1, 2\]"),
        ((np.array([[1, 2]]), 2), dict(prompt_lengths=np.array([0])), ValueError, r"prompt_lengths\[0\] = 0"),
    ],
)
def test_generate_bad_inputs_raise(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        generate(make_model(), *args, **kwargs)


def test_logits_at_returns_the_chosen_token_per_row():
    model = make_model(seed=21)
    tokens = jnp.asarray(np.random.default_rng(22).integers(0, 128, size=(3, 6)), jnp.int32)
    full, _ = model(tokens, model.init_cache(batch_size=3, max_length=8), jnp.array([6, 2, 4]))
    picked, cache = model(tokens, model.init_cache(batch_size=3, max_length=8), jnp.array([6, 2, 4]),
                          logits_at=jnp.array([5, 1, 3]))
    assert picked.shape == (3, 1, full.shape[-1])
    np.testing.assert_allclose(np.asarray(picked[:, 0]), np.asarray(full[jnp.arange(3), jnp.array([5, 1, 3])]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.seq_lengths(0), [6, 2, 4])


def test_a_ring_cache_under_a_full_attention_layer_is_an_error():
    """A SlidingWindowCache keeps only its window; a full-attention layer reading it would
    attend to the window alone and drift from the model once a row outgrows it, unflagged.
    It used to run (max logit error 2.7 against the uncached forward at 10 tokens, window 4);
    now the model refuses any ring that is not its layer's window, eagerly and under jit,
    and still runs (and matches the full forward) on the ring its config asks for."""
    from jaxkv import HybridCache, SlidingWindowCache
    from jaxkv.caches import FULL, SLIDING

    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 128, size=(1, 8)), jnp.int32)
    full_model = make_model(seed=12)
    cfg = full_model.config
    sizes = dict(batch_size=1, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    ring = SlidingWindowCache.init(num_layers=cfg.num_layers, window=4, **sizes)
    with pytest.raises(ValueError, match="layer 0 of this model attends to every token.*keeps only the last 4"):
        full_model(tokens, ring)
    with pytest.raises(ValueError, match="attends to every token"):
        forward(full_model, tokens, ring)
    from jaxkv import EncoderDecoderCache
    from jaxkv.caches.encdec import CrossAttentionCache

    cross = CrossAttentionCache.from_layers([(jnp.zeros((1, cfg.num_kv_heads, 3, cfg.head_dim)),) * 2] * cfg.num_layers)
    with pytest.raises(ValueError, match="attends to every token"):  # the ring as a self-attention part
        full_model(tokens, EncoderDecoderCache.create(ring, cross))

    mixed = make_model(seed=12, sliding_window=4, sliding_layers=(True, False))
    swapped = HybridCache.init(layer_types=[FULL, SLIDING], max_length=8, window=4, **sizes)
    with pytest.raises(ValueError, match="layer 1 of this model attends to every token.*HybridCache"):
        mixed(tokens, swapped)
    other_window = SlidingWindowCache.init(num_layers=cfg.num_layers, window=5, **sizes)
    sliding = make_model(seed=12, sliding_window=4, sliding_layers=(True, True))
    with pytest.raises(ValueError, match="layer 0 of this model has sliding_window=4.*ring of window 5"):
        sliding(tokens, other_window)

    # The ring the config asks for: cached (a prompt of 5, then 3 steps past the window)
    # equals the uncached forward, which masks the window itself.
    want = full_forward(sliding, tokens)
    ring = SlidingWindowCache.init(num_layers=cfg.num_layers, window=4, **sizes)
    got, ring = forward(sliding, tokens[:, :5], ring)
    outs = [got]
    for t in range(5, 8):
        got, ring = forward(sliding, tokens[:, t : t + 1], ring)
        outs.append(got)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, axis=1)), np.asarray(want), **TOL)


def test_a_scalar_num_new_is_every_rows_count():
    """Llama.__call__ took num_new only as [B] (a scalar was an IndexError, review 57) where
    the caches, cache_attention and KVAttention take a scalar too."""
    from flax import nnx

    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 100, (2, 3)), jnp.int32)
    scalar, _ = model(ids, model.init_cache(2, 8), 2)
    rows, _ = model(ids, model.init_cache(2, 8), jnp.asarray([2, 2]))
    np.testing.assert_array_equal(np.asarray(scalar), np.asarray(rows))


def test_linen_attention_under_nn_scan_writes_each_layer():
    """KVSelfAttention's layer was a fixed attribute: under nn.scan over layers the one
    instance wrote every layer into the same cache layer (later layers attended to earlier
    layers' keys, silently; review 57). A layer_idx call argument (traced: the scan's step)
    overrides it: two scanned layers equal two unrolled modules with fixed layers, output
    and cache."""
    import flax.linen as nn

    from jaxkv.linen import KVSelfAttention

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x, cache, positions):
            for i in range(2):
                y, cache = KVSelfAttention(4, 2, 8, layer_idx=i, name=f"layer_{i}")(x, cache, positions=positions)
                x = x + y
            return x, cache

    class Step(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            x, cache, positions, i = carry
            y, cache = KVSelfAttention(4, 2, 8)(x, cache, positions=positions, layer_idx=i)
            return (x + y, cache, positions, i + 1), None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x, cache, positions):
            scan = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
            (x, cache, _, _), _ = scan()((x, cache, positions, jnp.int32(0)), None)
            return x, cache

    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=8, max_length=8)
    scanned = Scanned()
    params = scanned.init(jax.random.key(1), x, cache, positions)
    stacked = params["params"]["ScanStep_0"]["KVSelfAttention_0"]  # leaves [2, ...]
    unrolled = {"params": {f"layer_{i}": jax.tree.map(lambda w: w[i], stacked) for i in range(2)}}
    want_y, want_cache = Unrolled().apply(unrolled, x, cache, positions)
    got_y, got_cache = jax.jit(scanned.apply)(params, x, cache, positions)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no cache layer"):
        KVSelfAttention(4, 2, 8).init(jax.random.key(0), x, cache, positions=positions)
    KVSelfAttention(4, 2, 8).init(jax.random.key(0), x, None, positions=positions)  # no cache: no layer needed


def test_a_layer_view_returned_from_jit_goes_to_attend_as_is():
    """A ring's LayerView carried its window as a pytree leaf: returned from jit it was an
    array, and attend refused it ("sliding_window must be a positive Python int", review 59)."""
    from jaxkv import SlidingWindowCache
    from jaxkv.attention import attend

    cache = SlidingWindowCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4, window=4)
    k = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 2, 4)), jnp.float32)
    _, eager = cache.update_view(k, k, 0)
    _, jitted = jax.jit(lambda c: c.update_view(k, k, 0))(cache)
    assert jitted.sliding_window == 4 and isinstance(jitted.sliding_window, int)
    outs = [attend(k, v.keys, v.values, q_positions=cache.positions(2), kv_lengths=v.kv_lengths,
                   kv_positions=v.kv_positions, sliding_window=v.sliding_window) for v in (eager, jitted)]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=1e-6)


def test_logits_at_outside_the_tokens():
    """logits_at = T read NaN (take_along_axis's fill), -1 wrapped to the last token (padding in a
    ragged row: num_new - 1 of a row with none), silently (review 57). Concrete: a ValueError;
    traced: NaN for both."""
    from flax import nnx

    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    ids = jnp.ones((2, 3), jnp.int32)
    for bad in ([0, 3], [-1, 1]):
        with pytest.raises(ValueError, match=r"logits_at must index the 3 tokens"):
            model(ids, None, logits_at=jnp.asarray(bad))
    graphdef, state = nnx.split(model)
    traced = jax.jit(lambda s, at: nnx.merge(graphdef, s)(ids, None, logits_at=at)[0])
    out = np.asarray(traced(state, jnp.asarray([-1, 1])))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    full = np.asarray(model(ids, None)[0])
    np.testing.assert_allclose(out[1, 0], full[1, 1], rtol=1e-5, atol=1e-6)


def test_init_cache_refuses_options_of_another_kind():
    """kind="static", bits=4 built a float cache; residual_length with paged, extra_slots with
    quantized: ignored, silently (review 59). Each option belongs to its kinds."""
    from flax import nnx

    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    for kind, options in [("static", dict(bits=4)), ("paged", dict(residual_length=32)),
                          ("quantized", dict(extra_slots=3)), ("static", dict(page_size=8, num_pages=4))]:
        with pytest.raises(ValueError, match=f"do\\(es\\) not apply to kind='{kind}'"):
            model.init_cache(2, 16, kind=kind, **options)
    assert model.init_cache(2, 16, kind="quantized", bits=4).bits == 4
    assert model.init_cache(2, 16, kind="paged-quantized", bits=4, page_size=8).page_size == 8

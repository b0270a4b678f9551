"""jaxkv.generate / jaxkv.stream: sampling, EOS, bucketing and compile counts."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.generation import _generate, bucket_length, generate, stream
from jaxkv.models import Llama, LlamaConfig
from jaxkv.sampling import SamplingConfig

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "weight" in path:  # move norms off their all-ones init so a wrong norm shows
            var.set_value(var.get_value() + jnp.asarray(0.3 * rng.normal(size=var.get_value().shape), jnp.float32))
    return model


def ragged(rng, lengths):
    prompts = [rng.integers(1, VOCAB, size=n) for n in lengths]
    padded = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    return prompts, padded


SAMPLED = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)


def test_greedy_ragged_batch_equals_rows_alone(model):
    """(Greedy tokens against the uncached forward: tests/test_models.py.)"""
    prompts, padded = ragged(np.random.default_rng(0), [6, 3])
    out = generate(model, padded, 8, prompt_lengths=np.array([6, 3]))
    assert out.tokens.shape == (2, 8) and out.tokens.dtype == jnp.int32
    np.testing.assert_array_equal(out.lengths, [8, 8])
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(generate(model, p[None], 8).tokens[0], out.tokens[b])


def test_same_key_same_tokens_and_rows_independent_of_batch(model):
    prompts, padded = ragged(np.random.default_rng(1), [5, 4, 2])
    keys = jax.random.split(jax.random.key(7), 3)
    a = generate(model, padded, 10, prompt_lengths=np.array([5, 4, 2]), sampling=SAMPLED, key=keys)
    b = generate(model, padded, 10, prompt_lengths=np.array([5, 4, 2]), sampling=SAMPLED, key=keys)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    other = generate(model, padded, 10, prompt_lengths=np.array([5, 4, 2]), sampling=SAMPLED, key=jax.random.split(jax.random.key(8), 3))
    assert (np.asarray(other.tokens) != np.asarray(a.tokens)).any()
    for row, p in enumerate(prompts):  # a row's samples depend on its key only
        alone = generate(model, p[None], 10, sampling=SAMPLED, key=keys[row : row + 1])
        np.testing.assert_array_equal(alone.tokens[0], a.tokens[row])


def test_top_k_one_and_tiny_temperature_equal_greedy(model):
    _, padded = ragged(np.random.default_rng(2), [4, 4])
    want = generate(model, padded, 8).tokens
    key = jax.random.key(0)
    np.testing.assert_array_equal(generate(model, padded, 8, sampling=SamplingConfig(temperature=1.0, top_k=1), key=key).tokens, want)
    np.testing.assert_array_equal(generate(model, padded, 8, sampling=SamplingConfig(temperature=1e-6), key=key).tokens, want)


def test_eos_freezes_a_row_and_equals_running_rows_alone(model):
    prompts, padded = ragged(np.random.default_rng(4), [5, 3])
    free = np.asarray(generate(model, padded, 12, prompt_lengths=np.array([5, 3])).tokens)
    eos = int(free[0, 3])  # row 0 emits it at step 3 (maybe earlier too)
    stop_at = int(np.argmax(free[0] == eos))
    out = generate(model, padded, 12, prompt_lengths=np.array([5, 3]), eos_token_id=eos, pad_token_id=VOCAB - 1)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert lengths[0] == stop_at + 1
    np.testing.assert_array_equal(tokens[0, : stop_at + 1], free[0, : stop_at + 1])
    assert (tokens[0, stop_at + 1 :] == VOCAB - 1).all()  # frozen: padding after the stop token
    for row, p in enumerate(prompts):
        # 0-d integer arrays are token ids too (jnp.int32 used to fail with a TypeError).
        alone = generate(model, p[None], 12, eos_token_id=jnp.int32(eos), pad_token_id=np.int64(VOCAB - 1))
        np.testing.assert_array_equal(alone.tokens[0], tokens[row])
        assert int(alone.lengths[0]) == lengths[row]
    # The other row went on decoding past row 0's stop.
    assert lengths[1] > lengths[0] or eos in free[1, : lengths[0]]


def test_new_prompt_length_in_same_bucket_compiles_nothing(model):
    assert bucket_length(5) == bucket_length(9) == 16 and bucket_length(17) == 32
    rng = np.random.default_rng(5)
    generate(model, rng.integers(1, VOCAB, size=(2, 5)), 6)
    compiled = _generate._cache_size()
    out = generate(model, rng.integers(1, VOCAB, size=(2, 9)), 6)  # new length, same bucket
    assert _generate._cache_size() == compiled
    generate(model, rng.integers(1, VOCAB, size=(2, 7)), 6, prompt_lengths=np.array([7, 1]))
    assert _generate._cache_size() == compiled
    assert out.tokens.shape == (2, 6)


@pytest.mark.parametrize("tokens_per_call", [1, 4])
def test_stream_equals_generate_and_donates(model, tokens_per_call):
    """One prefill call, then decode calls of up to tokens_per_call steps; the rows stop on
    their EOS at different steps and the last call ends early: the tokens are generate's,
    and each call donated the cache it got."""
    prompts, padded = ragged(np.random.default_rng(6), [4, 2])
    key, lengths = jax.random.key(11), np.array([4, 2])
    run = partial(generate, model, padded, 9, prompt_lengths=lengths, sampling=SAMPLED, key=key)
    unused = [VOCAB - 2, VOCAB - 1]  # ids no row emits (checked): the same program as two real stops
    free = np.asarray(run(eos_token_id=unused).tokens)
    assert not np.isin(free, unused).any(), f"pick other unused stop ids than {unused}: {free.tolist()}"
    eos = [int(free[0, 5]), int(free[1, 6])]  # row 0 stops by step 5, row 1 by step 6
    want = run(eos_token_id=eos)
    s = stream(model, padded, 9, prompt_lengths=lengths, sampling=SAMPLED, key=key, eos_token_id=eos,
               tokens_per_call=tokens_per_call)
    it = iter(s)
    steps, caches = [next(it)], [s.cache]
    for tokens in it:
        if s.cache is not caches[-1]:
            assert caches[-1].keys.is_deleted()  # the decode call donated the cache
            caches.append(s.cache)
        steps.append(tokens)
    got = np.stack(steps, axis=1)
    n = got.shape[1]
    np.testing.assert_array_equal(got, np.asarray(want.tokens)[:, :n])
    assert n == int(np.max(want.lengths)) > 1 and n < 9
    assert len(caches) == 1 + -(-(n - 1) // tokens_per_call)
    # Each row stored its prompt and every fed-back token up to its stop.
    np.testing.assert_array_equal(s.cache.seq_lengths(0), lengths + np.asarray(want.lengths) - 1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sampling=SAMPLED), ValueError, "sampling needs a PRNG key"),
        (dict(sampling=SAMPLED, key=jax.random.split(jax.random.key(0), 3)), ValueError, "one key or 2 keys"),
        (dict(sampling=SAMPLED, key=np.array([0, 1], np.uint32)), TypeError, "typed PRNG key"),
        (dict(sampling="greedy"), TypeError, "SamplingConfig"),
    ],
)
def test_generate_bad_sampling_inputs(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        generate(model, np.ones((2, 3), np.int32), 4, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((4,), dict(eos_token_id=VOCAB), r"generate: eos_token_id must be None or a token id in \[0, 128\), got 128"),
        ((4,), dict(eos_token_id=[7, 10**6]), r"generate: eos_token_id\[1\] must be a token id in \[0, 128\), got 1000000"),
        ((4,), dict(eos_token_id=True), "eos_token_id must be None or a token id"),
        ((4,), dict(eos_token_id=7.0), "eos_token_id must be None or a token id"),
        ((4,), dict(pad_token_id=-1), r"generate: pad_token_id must be a token id in \[0, 128\), got -1"),  # NAN_TOKEN
        ((4,), dict(pad_token_id=VOCAB), "pad_token_id must be a token id"),
        ((4,), dict(pad_token_id=None), "pad_token_id must be a token id"),
        ((True,), {}, "generate: max_new_tokens must be a Python int >= 1, got True"),
    ],
)
def test_generate_and_stream_refuse_bad_stop_pad_and_lengths(model, args, kwargs, match):
    # The checks (and messages) of beam_search / sample_n / ServingLoop; nothing compiles.
    with pytest.raises(ValueError, match=match):
        generate(model, np.ones((1, 3), np.int32), *args, **kwargs)
    with pytest.raises(ValueError, match=match.replace("generate", "stream")):
        stream(model, np.ones((1, 3), np.int32), *args, **kwargs)


@pytest.mark.slow
def test_generate_through_other_cache_kinds():
    """A sliding-window model: the ring-buffer (hybrid) cache gives the static cache's
    tokens exactly. The int8 cache runs through the same loop (its accuracy is measured in
    tests/test_quantized.py and benchmarks/bench_cache_kinds.py)."""
    windowed = Llama(LlamaConfig.tiny(sliding_window=4, sliding_layers=(True, False)), rngs=nnx.Rngs(5))
    _, padded = ragged(np.random.default_rng(7), [9, 6])
    lengths = np.array([9, 6])
    want = generate(windowed, padded, 10, prompt_lengths=lengths)
    hybrid = generate(windowed, padded, 10, prompt_lengths=lengths, cache_kind="hybrid")
    np.testing.assert_array_equal(hybrid.tokens, want.tokens)
    quantized = generate(windowed, padded, 10, prompt_lengths=lengths, cache_kind="quantized")
    assert quantized.tokens.shape == (2, 10) and np.asarray(quantized.lengths).tolist() == [10, 10]
    with pytest.raises(ValueError, match="kind must be"):
        generate(windowed, padded, 4, prompt_lengths=lengths, cache_kind="no-such-kind")


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", ["static", "hybrid"])
def test_chunked_prefill_equals_one_shot(cache_kind):
    """Prompts longer than prefill_chunk_size enter the cache chunk by chunk inside the
    program; rows whose prompts end in different chunks (or in the first) give the tokens
    of one-shot prefill, on the contiguous and the ring (hybrid) storage. What does not
    depend on the storage runs on the static cache only: a chunk size that pads the prompt,
    sampling, and stream agreeing with generate."""
    windowed = Llama(LlamaConfig.tiny(sliding_window=6, sliding_layers=(True, False)), rngs=nnx.Rngs(9))
    _, padded = ragged(np.random.default_rng(12), [40, 23, 9])
    lengths = np.array([40, 23, 9])
    kw = dict(prompt_lengths=lengths, cache_kind=cache_kind)
    one_shot = generate(windowed, padded, 12, prefill_chunk_size=None, **kw)
    # 64-token bucket: 4 chunks of 16, each longer than the window of 6.
    np.testing.assert_array_equal(generate(windowed, padded, 12, prefill_chunk_size=16, **kw).tokens, one_shot.tokens)
    if cache_kind != "static":
        return
    chunked = generate(windowed, padded, 12, prefill_chunk_size=24, **kw)  # pads the prompt to 72
    np.testing.assert_array_equal(chunked.tokens, one_shot.tokens)
    key = jax.random.key(3)
    sampled = dict(sampling=SAMPLED, key=key, **kw)
    np.testing.assert_array_equal(
        generate(windowed, padded, 12, prefill_chunk_size=16, **sampled).tokens,
        generate(windowed, padded, 12, prefill_chunk_size=None, **sampled).tokens,
    )
    streamed = np.stack(list(stream(windowed, padded, 12, prompt_lengths=lengths, prefill_chunk_size=16)), axis=1)
    np.testing.assert_array_equal(streamed, one_shot.tokens)


@pytest.mark.slow
def test_chunked_prefill_bounds_the_programs_temporaries(model):
    """XLA's own memory plan: a 512-token prefill in 64-token chunks needs a fraction of
    the temporary buffers of the one-shot prefill (activations scale with the chunk)."""
    ids = jnp.ones((2, 512), jnp.int32)
    graphdef, state = nnx.split(model)

    def temp_bytes(chunk):
        lowered = _generate.lower(
            graphdef, state, ids, jnp.full((2,), 512, jnp.int32), None, jnp.array([-1], jnp.int32), jnp.int32(0),
            max_new_tokens=4, capacity=516, sampling=SamplingConfig(), cache_dtype=None, chunk_size=chunk,
        )
        return lowered.compile().memory_analysis().temp_size_in_bytes

    one_shot, chunked = temp_bytes(None), temp_bytes(64)
    assert chunked * 3 < one_shot, (chunked, one_shot)


@pytest.mark.parametrize("bad", [0, -4, 2.5, "64"])
def test_bad_prefill_chunk_size(model, bad):
    with pytest.raises(ValueError, match="prefill_chunk_size must be None or a Python int >= 1"):
        generate(model, np.ones((1, 40), np.int32), 2, prefill_chunk_size=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_tokens_per_call(model, bad):
    with pytest.raises(ValueError, match="tokens_per_call must be a Python int >= 1"):
        stream(model, np.ones((1, 4), np.int32), 2, tokens_per_call=bad)

"""Repetition, presence and frequency penalties, and min-p: against NumPy, HF's logits
processors and an uncached decode loop; through generate, stream, PromptCacheStream and
sample_n; and the errors where a penalty cannot be honoured."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.decoding import sample_n
from jaxkv.generation import NAN_TOKEN, _generate, generate, select_token, stream
from jaxkv.models import Llama, LlamaConfig
from jaxkv.sampling import SamplingConfig, apply_penalties, init_history, min_p_filter, record_tokens

VOCAB = 128
PENALISED = SamplingConfig(repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3)  # greedy


def numpy_penalised(logits, prompt, generated, config):
    """The penalties from their definitions, one row at a time, in float64."""
    x = np.asarray(logits, np.float64).copy()
    for t in set(prompt) | set(generated):  # HF / CTRL: every token seen, prompt included
        x[t] = x[t] / config.repetition_penalty if x[t] > 0 else x[t] * config.repetition_penalty
    for t, n in Counter(generated).items():  # OpenAI / vLLM: generated tokens only
        x[t] -= config.frequency_penalty * n + config.presence_penalty
    return x


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    rep=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    pres=st.sampled_from([0.0, 0.5, -0.25]),
    freq=st.sampled_from([0.0, 0.2]),
)
def test_penalties_equal_numpy(seed, rep, pres, freq):
    rng = np.random.default_rng(seed)
    batch, vocab, width = 3, 11, 6
    config = SamplingConfig(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    ids = rng.integers(0, vocab, size=(batch, width))
    lengths = rng.integers(1, width + 1, size=batch)
    steps = rng.integers(0, vocab, size=(4, batch))
    active = rng.random((4, batch)) < 0.75
    logits = rng.standard_normal((batch, vocab)) * 3
    logits[0, 0] = 0.0  # the sign rule's boundary
    history = init_history(config, jnp.asarray(ids), jnp.asarray(lengths), vocab)
    for tokens, on in zip(steps, active):
        history = record_tokens(history, jnp.asarray(tokens, jnp.int32), jnp.asarray(on))
    got = apply_penalties(jnp.asarray(logits, jnp.float32), history, config)
    if not config.needs_history:
        assert history is None
        np.testing.assert_array_equal(np.asarray(got), logits.astype(np.float32))
        return
    for b in range(batch):
        generated = [int(t) for t, on in zip(steps[:, b], active[:, b]) if on]
        want = numpy_penalised(logits[b], ids[b, : lengths[b]].tolist(), generated, config)
        np.testing.assert_allclose(np.asarray(got[b]), want, rtol=1e-6, atol=1e-5)


def test_history_ignores_padding_nan_tokens_and_inactive_rows():
    config = SamplingConfig(repetition_penalty=2.0)
    ids = jnp.asarray([[5, 6, 9, 9], [7, 9, 9, 9]])  # 9: padding past each row's length
    history = init_history(config, ids, jnp.asarray([2, 1]), 10)
    assert np.flatnonzero(np.asarray(history.in_prompt[0])).tolist() == [5, 6]
    assert np.flatnonzero(np.asarray(history.in_prompt[1])).tolist() == [7]
    # NAN_TOKEN (-1) must not wrap to the last id; an inactive row records nothing.
    history = record_tokens(history, jnp.asarray([NAN_TOKEN, 3]), jnp.asarray([True, False]))
    history = record_tokens(history, jnp.asarray([4, NAN_TOKEN]))
    assert np.asarray(history.counts).tolist() == [[0] * 4 + [1] + [0] * 5, [0] * 10]


def test_repetition_penalty_equals_transformers_processor():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(4, 9))
    logits = (rng.standard_normal((4, 50)) * 4).astype(np.float32)
    config = SamplingConfig(repetition_penalty=1.7)
    # HF counts every id in input_ids: prompt 5 tokens + 4 generated, all "seen" alike.
    history = init_history(config, jnp.asarray(ids[:, :5]), jnp.asarray([5] * 4), 50)
    for t in range(5, 9):
        history = record_tokens(history, jnp.asarray(ids[:, t], jnp.int32))
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(ids), torch.tensor(logits)).numpy()
    np.testing.assert_allclose(np.asarray(apply_penalties(jnp.asarray(logits), history, config)), want, rtol=1e-6)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_equals_transformers_warper(min_p):
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = (np.random.default_rng(1).standard_normal((5, 40)) * 3).astype(np.float32)
    want = MinPLogitsWarper(min_p)(None, torch.tensor(logits)).numpy()
    got = np.asarray(min_p_filter(jnp.asarray(logits), min_p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])


@pytest.fixture(scope="module")
def model():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(5))
    rng = np.random.default_rng(5)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "weight" in path:
            var.set_value(var.get_value() + jnp.asarray(0.3 * rng.normal(size=var.get_value().shape), jnp.float32))
    return model


LENGTHS = (7, 3, 5)
NEW = 12


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    ids = np.full((len(LENGTHS), max(LENGTHS)), 4, np.int32)  # padding id 4: it must not count as seen
    for b, n in enumerate(LENGTHS):
        ids[b, :n] = rng.integers(5, VOCAB, size=n)
    ids[1, 1] = ids[1, 0]  # a repeat inside a prompt
    return ids


def test_greedy_generate_with_penalties_equals_uncached_numpy_loop(model):
    ids = _prompts()
    got = np.asarray(generate(model, ids, NEW, prompt_lengths=np.asarray(LENGTHS), sampling=PENALISED).tokens)
    plain = np.asarray(generate(model, ids, NEW, prompt_lengths=np.asarray(LENGTHS)).tokens)
    assert (got != plain).any(), "the penalties changed nothing: the test would not see them"

    # Reference: the whole sequence through the uncached forward (one [B, P + N] buffer, causal,
    # so position t sees only tokens <= t), the penalties in NumPy, argmax.
    width = max(LENGTHS) + NEW
    full = jax.jit(lambda tokens: model(tokens, None)[0])
    seqs = np.zeros((len(LENGTHS), width), np.int32)
    for b, n in enumerate(LENGTHS):
        seqs[b, :n] = ids[b, :n]
    out = [[] for _ in LENGTHS]
    for _ in range(NEW):
        logits = np.asarray(full(jnp.asarray(seqs)), np.float64)
        for b, n in enumerate(LENGTHS):
            row = numpy_penalised(logits[b, n + len(out[b]) - 1], ids[b, :n].tolist(), out[b], PENALISED)
            seqs[b, n + len(out[b])] = token = int(np.argmax(row))
            out[b].append(token)
    np.testing.assert_array_equal(got, np.asarray(out))
    # Other prompts of the same shape: no new program (the penalty strengths are static, the history is data).
    compiled = _generate._cache_size()
    again = generate(model, ids[::-1].copy(), NEW, prompt_lengths=np.asarray(LENGTHS[::-1]), sampling=PENALISED)
    assert _generate._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(again.tokens)[::-1], got)


def test_sampled_penalties_stream_equals_generate_and_prompt_cache(model, tmp_path):
    from jaxkv.persist import PromptCacheStream

    config = SamplingConfig(temperature=0.9, top_k=20, min_p=0.05, repetition_penalty=1.4, frequency_penalty=0.2)
    ids = _prompts(1)[:1, : LENGTHS[0]]
    key = jax.random.key(3)
    want = np.asarray(generate(model, ids, NEW, sampling=config, key=key).tokens)[0]
    streamed = np.concatenate(list(stream(model, ids, NEW, sampling=config, key=key, tokens_per_call=4)))
    np.testing.assert_array_equal(streamed, want)
    # A prompt cache restores the prompt's first tokens from a file and prefills only the rest;
    # the penalties must still count the restored tokens.
    path = tmp_path / "prompt.jaxkv"
    first = np.concatenate(list(PromptCacheStream(path, model, ids, NEW, sampling=config, key=key)))
    again = PromptCacheStream(path, model, ids, NEW, sampling=config, key=key)
    assert again.restored == LENGTHS[0] - 1
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(np.concatenate(list(again)), want)


def test_sample_n_greedy_with_penalties_equals_generate(model):
    ids = _prompts(3)
    config = SamplingConfig(temperature=1.0, top_k=1, repetition_penalty=1.6, presence_penalty=0.4,
                            frequency_penalty=0.3)
    got = np.asarray(sample_n(model, ids, NEW, num_return_sequences=2, key=jax.random.key(0), config=config,
                              prompt_lengths=np.asarray(LENGTHS)))
    want = np.asarray(generate(model, ids, NEW, prompt_lengths=np.asarray(LENGTHS), sampling=PENALISED).tokens)
    np.testing.assert_array_equal(got[:, 0], want)
    np.testing.assert_array_equal(got[:, 1], want)


def test_a_penalty_is_never_skipped_silently(model):
    logits = jnp.zeros((2, VOCAB))
    with pytest.raises(ValueError, match="needs each row's TokenHistory"):
        select_token(logits, None, 0, PENALISED)
    # (Every decoding algorithm that samples carries the history: speculative decoding's
    # penalties are checked in test_decoding_speculative.py.)

"""Parallel sampling: one prefill per prompt, samples equal to independent runs."""

import jax
import numpy as np
import pytest

from jaxkv.decoding import sample_keys, sample_n
from jaxkv.models import Llama
from jaxkv.sampling import SamplingConfig
from test_decoding_reference import make_model, sample_reference

CONFIG = SamplingConfig(temperature=0.9, top_k=20)
PROMPTS = [[7, 3, 9, 1, 4], [2, 8]]
IDS = np.array([[7, 3, 9, 1, 4], [2, 8, 0, 0, 0]])
LENGTHS = np.array([5, 2])
N, NUM = 6, 3


@pytest.fixture(scope="module")
def model():
    return make_model(seed=4, num_layers=1, scale=0.5)


def test_prompt_is_processed_once_then_fanned_out(model, monkeypatch):
    calls = []
    original = Llama.__call__

    def spy(self, tokens, cache=None, num_new=None):
        calls.append(tuple(tokens.shape))
        return original(self, tokens, cache, num_new)

    monkeypatch.setattr(Llama, "__call__", spy)
    # max_new_tokens=5 is used by no other test here: this call traces afresh.
    out = sample_n(model, IDS, 5, num_return_sequences=NUM, key=jax.random.key(0), config=CONFIG,
                   prompt_lengths=LENGTHS)
    assert out.shape == (2, NUM, 5)
    # One forward over the [B, P] prompts (P = 5 padded to its bucket, 16), then single-token
    # steps over B * n rows.
    assert calls == [(2, 16), (2 * NUM, 1)]


def test_samples_equal_independent_cache_free_runs(model):
    keys = sample_keys(jax.random.key(1), 2, NUM)
    out = np.asarray(sample_n(model, IDS, N, num_return_sequences=NUM, keys=keys, config=CONFIG,
                              prompt_lengths=LENGTHS))
    for b, prompt in enumerate(PROMPTS):
        for j in range(NUM):
            assert out[b, j].tolist() == sample_reference(model, prompt, N, keys[b, j], CONFIG)
    # Different keys, different samples: the fan-out did not copy one sample n times.
    assert len({tuple(out[b, j]) for b in range(2) for j in range(NUM)}) == 2 * NUM


def test_batched_equals_one_sample_per_call(model):
    keys = sample_keys(jax.random.key(2), 2, NUM)
    together = np.asarray(sample_n(model, IDS, N, num_return_sequences=NUM, keys=keys, config=CONFIG,
                                   prompt_lengths=LENGTHS))
    for j in range(NUM):
        alone = sample_n(model, IDS, N, num_return_sequences=1, keys=keys[:, j : j + 1], config=CONFIG,
                         prompt_lengths=LENGTHS)
        np.testing.assert_array_equal(np.asarray(alone)[:, 0], together[:, j])


def test_eos_stops_a_sample_and_pads_after_it(model):
    keys = sample_keys(jax.random.key(3), 2, NUM)
    plain = np.asarray(sample_n(model, IDS, N, num_return_sequences=NUM, keys=keys, config=CONFIG,
                                prompt_lengths=LENGTHS))
    eos = int(plain[0, 0, 1])  # met at step 1 by at least one sample
    out = np.asarray(sample_n(model, IDS, N, num_return_sequences=NUM, keys=keys, config=CONFIG,
                              prompt_lengths=LENGTHS, eos_token_id=eos, pad_token_id=127))
    for b in range(2):
        for j in range(NUM):
            row, ref = out[b, j].tolist(), plain[b, j].tolist()
            stop = ref.index(eos) + 1 if eos in ref else N
            assert row[:stop] == ref[:stop] and all(t == 127 for t in row[stop:])


def test_second_call_compiles_nothing(model):
    from jaxkv.decoding.parallel import _sample_n

    sample_n(model, IDS, N, num_return_sequences=NUM, key=jax.random.key(5), config=CONFIG, prompt_lengths=LENGTHS)
    before = _sample_n._cache_size()
    sample_n(model, IDS[::-1], N, num_return_sequences=NUM, key=jax.random.key(6), config=CONFIG,
             prompt_lengths=LENGTHS[::-1])
    # Another prompt width in the same bucket, another stop and pad id: each compiled a search
    # of its own (review 81).
    sample_n(model, IDS[:, :-1], N, num_return_sequences=NUM, key=jax.random.key(6), config=CONFIG,
             prompt_lengths=np.minimum(LENGTHS, IDS.shape[1] - 1), eos_token_id=3, pad_token_id=4)
    assert _sample_n._cache_size() == before


def test_errors(model):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="exactly one of key"):
        sample_n(model, IDS, N, num_return_sequences=2)
    with pytest.raises(ValueError, match=r"keys must have shape \[batch, num_return_sequences\] = \[2, 2\]"):
        sample_n(model, IDS, N, num_return_sequences=2, keys=sample_keys(key, 2, 3))
    with pytest.raises(ValueError, match="num_return_sequences must be a Python int >= 1"):
        sample_n(model, IDS, N, num_return_sequences=0, key=key)
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\] = 0 is outside"):
        sample_n(model, IDS, N, num_return_sequences=2, key=key, prompt_lengths=np.array([5, 0]))
    # B keys given as key= (generate takes them so): JAX's "split accepts a single key" before
    with pytest.raises(ValueError, match=r"key must be one PRNG key .* got a batch of shape \[2\]; .*keys=\[batch"):
        sample_n(model, IDS, N, num_return_sequences=2, key=jax.random.split(key, 2))
    # one raw key of another PRNG implementation ([4] uint32 for rbg) is one key
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        raw = jax.random.PRNGKey(0)
        assert raw.shape == (4,)
        assert sample_n(model, IDS, N, num_return_sequences=2, key=raw).shape == (2, 2, N)
    finally:
        jax.config.update("jax_default_prng_impl", previous)

"""Chunked prefill == one-shot prefill (logits and cache), one program per chunk size,
activation memory bounded by the chunk."""

import numpy as np
import pytest
from flax import nnx

from jaxkv.decoding import chunked_prefill
from jaxkv.decoding._common import forward
from test_decoding_reference import make_model

TOL = dict(rtol=1e-5, atol=1e-5)
CAPACITY = 40


@nnx.jit
def one_shot(model, tokens, cache, num_new):
    return model(tokens, cache, num_new)


@pytest.fixture(scope="module", params=["full", "sliding"])
def model(request):
    if request.param == "sliding":  # window shorter than a chunk: chunks cross the window edge
        return make_model(seed=6, sliding_window=5, sliding_layers=(True, False))
    return make_model(seed=6)


def _prompts(lengths, width, seed=0):
    ids = np.random.default_rng(seed).integers(0, 128, size=(len(lengths), width)).astype(np.int32)
    for b, n in enumerate(lengths):
        ids[b, n:] = 127  # padding: must be neither stored nor attended to
    return ids


def _assert_same_cache(got, want, lengths):
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for b, n in enumerate(lengths):
        for buf in ("keys", "values"):
            np.testing.assert_allclose(
                np.asarray(getattr(got, buf)[:, b, :, :n]), np.asarray(getattr(want, buf)[:, b, :, :n]), **TOL
            )


@pytest.mark.parametrize("chunk", [3, 64])
def test_equals_one_shot_prefill(model, chunk):
    lengths = np.array([29, 11, 1])
    ids = _prompts(lengths, 29)
    want_logits, want_cache = one_shot(model, ids, model.init_cache(3, CAPACITY), lengths)
    logits, cache = chunked_prefill(
        model, ids, model.init_cache(3, CAPACITY), chunk_size=chunk, prompt_lengths=lengths, return_logits=True
    )
    assert logits.shape == want_logits.shape
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(logits[b, :n]), np.asarray(want_logits[b, :n]), **TOL)
    _assert_same_cache(cache, want_cache, lengths)


def test_continues_a_cache_that_already_holds_a_prefix(model):
    lengths = np.array([7, 4])
    head, tail = _prompts([6, 3], 6, seed=1), _prompts(lengths, 7, seed=2)
    cache = model.init_cache(2, CAPACITY)
    _, cache = one_shot(model, head, cache, np.array([6, 3]))
    _, want_cache = one_shot(model, head, model.init_cache(2, CAPACITY), np.array([6, 3]))
    want_logits, want_cache = one_shot(model, tail, want_cache, lengths)
    # Default output: each row's logits at its last prompt token (row 1 ends a chunk early).
    last, cache = chunked_prefill(model, tail, cache, chunk_size=3, prompt_lengths=lengths)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want_logits)[np.arange(2), lengths - 1], **TOL)
    _assert_same_cache(cache, want_cache, [13, 7])


def test_one_program_per_chunk_size_whatever_the_prompt_length(model):
    from jaxkv.decoding.chunked import _chunk_step

    chunked_prefill(model, _prompts([5], 5), model.init_cache(1, CAPACITY), chunk_size=4)
    before = _chunk_step._cache_size()
    for length in (1, 9, 17, 36):
        chunked_prefill(model, _prompts([length], length), model.init_cache(1, CAPACITY), chunk_size=4)
    assert _chunk_step._cache_size() == before


def test_activation_memory_is_bounded_by_the_chunk():
    import jax

    model = make_model(seed=6)
    graphdef, state = nnx.split(model)
    capacity = 512

    def temp_bytes(num_tokens):
        fn = jax.jit(lambda s, c, t, n: forward(graphdef, s, t, c, n))
        cache = model.init_cache(1, capacity)
        tokens = np.zeros((1, num_tokens), np.int32)
        compiled = fn.lower(state, cache, tokens, np.array([num_tokens], np.int32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunk, whole = temp_bytes(16), temp_bytes(512)
    # Blockwise scores are [B, Hq, block, T]: block 512 for a 16-token chunk, 128 for 512
    # tokens (blockwise_attend's default), so the chunk holds 1/8 of the scores and 1/32 of
    # the per-token activations; fixed temporaries (masks, statistics) shrink the ratio a
    # little (6.2x measured). The property: temporaries follow the chunk, not the prompt.
    assert chunk * 4 < whole, (chunk, whole)


def test_errors(model):
    ids = _prompts([6], 6)
    with pytest.raises(ValueError, match="chunk_size must be a Python int >= 1"):
        chunked_prefill(model, ids, model.init_cache(1, CAPACITY), chunk_size=0)
    with pytest.raises(ValueError, match="does not fit: the cache has 4 free slots"):
        chunked_prefill(model, ids, model.init_cache(1, 4), chunk_size=2)
    with pytest.raises(TypeError, match="cache must be a jaxkv cache"):
        chunked_prefill(model, ids, None, chunk_size=2)


def test_a_pool_that_runs_out_and_a_cache_of_another_batch_are_errors():
    """A page pool too small for the prompt: chunked_prefill returned logits of a truncated
    prompt (the flag set, no error; free_slots counts slots, not pages). A cache of 3 rows
    for 2 prompts: NumPy's broadcast error."""
    from jaxkv.caches import CacheError

    model = make_model(seed=6)
    ids = _prompts([7], 7)
    cache = model.init_cache(1, 32, kind="paged", page_size=4, num_pages=1)
    with pytest.raises(CacheError, match="found no free page"):
        chunked_prefill(model, ids, cache, chunk_size=3)
    roomy = model.init_cache(1, 32, kind="paged", page_size=4, num_pages=2)
    last, roomy = chunked_prefill(model, ids, roomy, chunk_size=3)
    assert int(roomy.seq_lengths(0)[0]) == 7 and not np.asarray(roomy.flags).any()
    with pytest.raises(ValueError, match="input_ids has 2 rows but the cache has 3; build the cache with batch_size=2"):
        chunked_prefill(model, _prompts([3, 2], 3), model.init_cache(3, CAPACITY), chunk_size=2)
    from jaxkv import DynamicCache

    with pytest.raises(TypeError, match="a DynamicCache cannot take chunks"):  # named up front since review 59
        chunked_prefill(model, _prompts([3], 3), DynamicCache(), chunk_size=2)


def test_a_dynamic_cache_is_refused_by_name():
    """chunked_prefill documented 'a jaxkv cache of any kind' and a DynamicCache failed with the
    cache's own 'num_new ... for ragged batches' message, even for one full-length prompt
    (review 59): now a TypeError naming why and the way out."""
    from flax import nnx

    from jaxkv import DynamicCache
    from jaxkv.decoding import chunked_prefill
    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="a DynamicCache cannot take chunks.*init_cache"):
        chunked_prefill(model, np.asarray([[1, 2, 3, 4, 5]], np.int32), DynamicCache(num_layers=2), chunk_size=2)

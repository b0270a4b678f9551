"""Every generation entry and decoding algorithm takes every cache kind (``cache_kind``).

The reference is independent of any cache: greedy continuation computed with full
(uncached) attention over the whole sequence (``greedy_reference``). The model has a
sliding layer and a full one, so ``"hybrid"`` runs a ring and a contiguous storage side by
side (and speculative decoding rolls both back); ``"quantized"`` reads int8 keys/values
block by block; ``"paged"`` keeps them in pages of a shared pool (the serving loop puts
prefilled rows into it page by page, speculative rollback returns pages). The model (seed, ``scale``) is picked so that every greedy choice along the
reference wins by a logit margin of at least 1 (the ``reference`` fixture asserts it): int8
keys/values move these logits by far less, so the quantized runs must match exactly too.
"""

import numpy as np
import pytest

import jaxkv
from jaxkv.decoding import ServingLoop, beam_search, speculative_generate
from jaxkv.decoding.serving import Request
from test_decoding_reference import clear_greedy_reference, make_model

V, N = 64, 8
PROMPTS = [[5, 9, 2, 7, 1, 3], [8, 4, 6]]
IDS = np.array([p + [0] * (6 - len(p)) for p in PROMPTS], np.int32)
LENGTHS = np.array([len(p) for p in PROMPTS], np.int32)
KINDS = ["hybrid", "quantized", "paged"]


@pytest.fixture(scope="module")
def model():
    # Stacked layers (the scan): the seed's greedy margins hold for this layout's weights.
    return make_model(
        seed=29, scale=10.0, scan_layers=True, vocab_size=V, num_layers=2, sliding_window=3,
        sliding_layers=(True, False),
    )


@pytest.fixture(scope="module")
def reference(model):
    return np.array(clear_greedy_reference(model, PROMPTS, N, margin=1.0))  # see the module doc


@pytest.mark.parametrize("kind", KINDS)
def test_generate_and_stream(model, reference, kind):
    out = jaxkv.generate(model, IDS, N, prompt_lengths=LENGTHS, cache_kind=kind)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)
    streamed = np.stack([np.asarray(t) for t in jaxkv.stream(model, IDS, N, prompt_lengths=LENGTHS, cache_kind=kind)], 1)
    np.testing.assert_array_equal(streamed, reference)


@pytest.mark.parametrize("kind", KINDS)
def test_speculative(model, reference, kind):
    out = speculative_generate(model, model, IDS, N, num_draft_tokens=3, prompt_lengths=LENGTHS, cache_kind=kind)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)


# Paged: the three-beam search below (forks, reorders, copy-on-write) covers it.
@pytest.mark.parametrize("kind", ["hybrid", "quantized"])
def test_beam_search_of_one_beam_is_greedy(model, reference, kind):
    out = beam_search(model, IDS, N, num_beams=1, prompt_lengths=LENGTHS, cache_kind=kind)
    np.testing.assert_array_equal(np.asarray(out.sequences)[:, 0, : N], reference)


@pytest.mark.parametrize("kind", KINDS)
def test_serving_loop(model, reference, kind):
    # 3 slots, 2 prefill rows: the second chunk of the first prompt is prefilled alone, next
    # to an unused entry, which must leave every row unflagged (run() raises on a flag).
    loop = ServingLoop(model, num_slots=3, max_length=16, chunk_size=4, prefill_rows=2, cache_kind=kind)
    done = loop.run([Request(prompt=tuple(p), max_new_tokens=N) for p in PROMPTS])
    for row, completion in enumerate(done):  # completions come back in request order
        np.testing.assert_array_equal(completion.tokens, reference[row])


# The serving loop above prefills every kind in chunks of 4 (prefill_chunk); here the
# public chunked_prefill on the kind where chunks meet a ring's window edge.
@pytest.mark.parametrize("kind", ["hybrid"])
def test_chunked_prefill_then_decode(model, reference, kind):
    import jax.numpy as jnp

    from jaxkv.decoding import chunked_prefill

    cache = model.init_cache(2, 16, kind=kind)
    last, cache = chunked_prefill(model, IDS, cache, chunk_size=4, prompt_lengths=LENGTHS)
    tokens = [np.asarray(last.argmax(-1))]
    for _ in range(N - 1):  # greedy decode on the prefilled cache, one token per row
        logits, cache = model(jnp.asarray(tokens[-1])[:, None], cache)
        tokens.append(np.asarray(logits[:, 0].argmax(-1)))
    np.testing.assert_array_equal(np.stack(tokens, 1), reference)


def test_beam_search_on_pages_equals_the_static_cache(model):
    """Beams fork and reorder every step: on pages they share their prefix pages and copy
    only a page they write into while shared; the search must not notice."""
    static = beam_search(model, IDS, N, num_beams=3, prompt_lengths=LENGTHS)
    paged = beam_search(model, IDS, N, num_beams=3, prompt_lengths=LENGTHS, cache_kind="paged")
    np.testing.assert_array_equal(np.asarray(paged.sequences), np.asarray(static.sequences))
    np.testing.assert_allclose(np.asarray(paged.scores), np.asarray(static.scores), rtol=1e-5, atol=1e-5)


def test_every_algorithm_takes_a_model_without_a_config():
    """The generation protocol is init_cache + __call__: chunked_prefill, sample_n,
    beam_search and speculative_generate read model.config.vocab_size (AttributeError)."""
    import jax
    from flax import nnx

    import jaxkv
    from jaxkv.decoding import beam_search, chunked_prefill, sample_n, speculative_generate
    from jaxkv.sampling import SamplingConfig
    from test_decoding_reference import make_model

    class Bare(nnx.Module):
        def __init__(self, inner):
            self.inner = inner

        def init_cache(self, batch_size, max_length, **kw):
            return self.inner.init_cache(batch_size, max_length, **kw)

        def __call__(self, tokens, cache=None, num_new=None, **kw):
            return self.inner(tokens, cache, num_new, **kw)

    inner = make_model(seed=29, scale=10.0)
    bare = Bare(inner)
    ids = np.array([[5, 9, 2, 7]])
    want = np.asarray(jaxkv.generate(inner, ids, 3).tokens)
    last, _ = chunked_prefill(bare, ids, bare.init_cache(1, 8), chunk_size=3)
    assert int(np.argmax(last[0])) == want[0, 0]
    greedy = SamplingConfig()
    np.testing.assert_array_equal(np.asarray(sample_n(bare, ids, 3, num_return_sequences=1, key=jax.random.key(0),
                                                      config=greedy))[:, 0], want)
    np.testing.assert_array_equal(np.asarray(beam_search(bare, ids, 3, num_beams=1).sequences)[:, 0], want)
    np.testing.assert_array_equal(np.asarray(speculative_generate(bare, bare, ids, 3).tokens), want)


def test_an_unknown_cache_kind_names_init_cache_and_cache_kind():
    """It said only "kind must be 'static', ... got 'ring'" from inside the traced program."""
    import jax

    from jaxkv.decoding import sample_n
    from jaxkv.sampling import SamplingConfig
    from test_decoding_reference import make_model

    with pytest.raises(ValueError, match=r"Llama.init_cache: kind must be .* got 'ring' \(the cache_kind= of"):
        sample_n(make_model(seed=1), np.array([[1, 2]]), 2, num_return_sequences=1, key=jax.random.key(0),
                 config=SamplingConfig(), cache_kind="ring")
    # stream() raises when called, as generate does (its cache is allocated later, when first needed)
    import jaxkv

    with pytest.raises(ValueError, match="kind must be"):
        jaxkv.stream(make_model(seed=1), np.array([[1, 2]]), 2, cache_kind="ring")

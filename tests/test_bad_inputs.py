"""Bad inputs at every public entry point that takes token ids (issue 13 items 2, 5, 8).

* out-of-range token ids (== V, >> V, beyond int32, negative) raise a ValueError naming
  the id, its position and V; under jit they give NaN logits for their row, and
  ``generate`` emits -1 there;
* a ``from_pretrained`` bundle passed where the model goes raises "pass loaded.model";
* iterating a TokenStream again starts over from the prompt.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.cli import embedded_model_path
from jaxkv.decoding import Request, ServingLoop, beam_search, chunked_prefill, prefill_chunk, sample_n
from jaxkv.decoding import speculative_generate
from jaxkv.generation import NAN_TOKEN, decode_step, generate, prefill, select_token, stream
from jaxkv.models import Llama, LlamaConfig, from_pretrained
from jaxkv.sampling import SamplingConfig

V = 128
ROW, COL = 1, 2  # where the bad id sits in the [2, 4] prompts
CLEAN = np.array([[3, 4, 5, 6], [7, 8, 9, 10]], np.int64)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(vocab_size=V), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def loaded():
    return from_pretrained(embedded_model_path())


# name -> (call(model_or_bundle, ids [2, 4] int64, tiny_model), where the bad id is reported,
#          whether the entry takes a model at all).
ENTRIES = {
    "generate": (lambda m, ids, tiny: generate(m, ids, 3), "input_ids[1, 2]", True),
    "stream": (lambda m, ids, tiny: stream(m, ids, 3), "input_ids[1, 2]", True),
    "Llama.__call__": (lambda m, ids, tiny: m(ids, m.init_cache(2, 8)), "tokens[1, 2]", False),
    "prefill": (
        lambda m, ids, tiny: prefill(*nnx.split(m), ids, jnp.full((2,), 4), m.init_cache(2, 8)),
        "tokens[1, 2]",
        False,
    ),
    "decode_step": (
        lambda m, ids, tiny: decode_step(*nnx.split(m), ids[:, COL], m.init_cache(2, 8)),
        "tokens[1, 0]",
        False,
    ),
    "chunked_prefill": (
        lambda m, ids, tiny: chunked_prefill(m, ids, tiny.init_cache(2, 8), chunk_size=2),
        "input_ids[1, 2]",
        True,
    ),
    "prefill_chunk": (
        lambda m, ids, tiny: prefill_chunk(*nnx.split(m), m.init_cache(2, 8), ids, jnp.full((2,), 4)),
        "tokens[1, 2]",
        False,
    ),
    "sample_n": (
        lambda m, ids, tiny: sample_n(m, ids, 3, num_return_sequences=2, key=jax.random.key(0)),
        "input_ids[1, 2]",
        True,
    ),
    "beam_search": (lambda m, ids, tiny: beam_search(m, ids, 3, num_beams=2), "input_ids[1, 2]", True),
    "speculative_generate(target)": (
        lambda m, ids, tiny: speculative_generate(m, tiny, ids, 3),
        "input_ids[1, 2]",
        True,
    ),
    "speculative_generate(draft)": (
        lambda m, ids, tiny: speculative_generate(tiny, m, ids, 3),
        "input_ids[1, 2]",
        True,
    ),
    "ServingLoop.run": (
        lambda m, ids, tiny: ServingLoop(m, num_slots=2, max_length=8, chunk_size=2).run(
            [Request(list(row), 2) for row in ids]
        ),
        "requests[1].prompt[2]",
        True,
    ),
}

BAD_IDS = {"id == vocab": V, "id >> vocab": 10**6, "id beyond int32": 2**40, "id -1": -1}


@pytest.mark.parametrize("bad", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("entry", ENTRIES)
def test_out_of_range_id_is_rejected_with_id_position_and_vocab(model, entry, bad):
    call, location, _ = ENTRIES[entry]
    ids = CLEAN.copy()
    ids[ROW, COL] = bad
    expected = re.escape(f"token id {bad} at {location} is outside the vocabulary [0, {V}) (vocab_size={V}")
    with pytest.raises(ValueError, match=expected):
        call(model, ids, model)


@pytest.mark.parametrize("entry", [name for name, (_, _, takes_model) in ENTRIES.items() if takes_model])
def test_pretrained_bundle_instead_of_model_is_rejected(model, loaded, entry):
    call, _, _ = ENTRIES[entry]
    with pytest.raises(TypeError, match=r"Pretrained bundle .*from_pretrained.*; pass loaded\.model"):
        call(loaded, CLEAN, model)


def test_any_other_object_instead_of_model_is_rejected(model):
    with pytest.raises(TypeError, match="generate: model must be an nnx.Module .* got dict"):
        generate({"model": 1}, CLEAN, 3)


def test_boundary_ids_are_accepted(model):
    ids = np.array([[0, V - 1]])
    logits, _ = model(ids, model.init_cache(1, 4))
    assert np.isfinite(np.asarray(logits)).all()


def test_traced_bad_ids_give_nan_logits_for_their_row_only(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, num_new):
        return nnx.merge(graphdef, state)(tokens, model.init_cache(4, 8), num_new)[0]

    clean = np.arange(3, 19, dtype=np.int32).reshape(4, 4)
    num_new = np.array([4, 4, 4, 2], np.int32)
    bad = clean.copy()
    bad[1, 1] = -1  # would wrap to V - 1 without the guard
    bad[2, 3] = V  # would read past the table
    bad[3, 2:] = [-1, V]  # padding (past num_new): never stored, so allowed
    want, got = np.asarray(forward(state, clean, num_new)), np.asarray(forward(state, bad, num_new))
    assert np.isfinite(want).all()
    assert np.isnan(got[1:3]).all()  # every position of a row with a bad real token
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[3, :2], want[3, :2])


def test_traced_bad_ids_in_generate_emit_nan_token(model):
    ids = CLEAN.astype(np.int32)
    bad = ids.copy()
    bad[ROW, COL] = -1
    out = jax.jit(lambda ids: generate(model, ids, 3).tokens)(bad)
    np.testing.assert_array_equal(out[ROW], [NAN_TOKEN] * 3)
    np.testing.assert_array_equal(out[0], generate(model, ids, 3).tokens[0])


def test_traced_bad_prompt_lengths_emit_nan_token(model):
    """Under an outer jit the lengths cannot raise. A length of 0 (or -2) used to give the
    row a "first token" read from padding, and one past the width passed in (5 of 4, within
    the bucket of 8) took a pad token as prompt: valid-looking ids either way. Such a row
    now emits NAN_TOKEN; the other row equals its eager run. Eagerly, prefill itself
    refuses such a length too (it did not check it)."""
    ids = CLEAN.astype(np.int32)
    run = jax.jit(lambda lengths: generate(model, ids, 3, prompt_lengths=lengths).tokens)
    want = generate(model, ids, 3, prompt_lengths=np.array([4, 3])).tokens
    for bad in (0, -2, 5, 40):
        out = run(jnp.array([bad, 3]))
        np.testing.assert_array_equal(out[0], [NAN_TOKEN] * 3, err_msg=str(bad))
        np.testing.assert_array_equal(out[1], want[1])
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"prefill: prompt_lengths\[0\] = 0 is outside \[1, 4\]"):
        prefill(graphdef, state, jnp.asarray(ids), jnp.array([0, 3]), cache)


@pytest.mark.parametrize("algorithm", ["sample_n", "speculative", "beam"])
def test_every_decoding_loop_turns_traced_bad_rows_into_nan_token(model, algorithm):
    """generate's rule, in sample_n, speculative_generate and beam_search: under an outer jit
    a row holding an id >= V, or a length outside [1, P], emits NAN_TOKEN (beam: NaN score),
    never ids picked from NaN logits or read from padding (they gave 0s or tokens of the
    padding position, unmarked); the good row equals its eager run."""
    ids = np.array([[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]], np.int32)
    bad_ids = ids.copy()
    bad_ids[0, 1] = V
    calls = {
        "sample_n": lambda ids, lengths: sample_n(model, ids, 3, num_return_sequences=1, key=jax.random.key(0),
                                                  prompt_lengths=lengths)[:, 0],
        "speculative": lambda ids, lengths: speculative_generate(model, model, ids, 3, num_draft_tokens=2,
                                                                 prompt_lengths=lengths).tokens,
        "beam": lambda ids, lengths: beam_search(model, ids, 3, num_beams=2, prompt_lengths=lengths),
    }
    call = calls[algorithm]
    got = jax.jit(call)(bad_ids, jnp.array([4, 0, 3]))
    want = call(ids, np.array([4, 4, 3]))
    if algorithm == "beam":
        assert np.isnan(np.asarray(got.scores[:2])).all() and np.isfinite(np.asarray(got.scores[2])).all()
        np.testing.assert_array_equal(got.sequences[2], want.sequences[2])
        got = got.sequences[:, 0]
    else:
        np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[:2], [[NAN_TOKEN] * 3] * 2)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "sampled"])
def test_select_token_never_turns_nan_logits_into_a_valid_id(sampling):
    logits = jnp.zeros((2, V)).at[0].set(jnp.nan).at[1, 5].set(10.0)
    keys = jax.random.split(jax.random.key(0), 2)
    np.testing.assert_array_equal(select_token(logits, keys, 0, sampling), [NAN_TOKEN, 5])


@pytest.mark.parametrize(
    "row_keys, error, match",
    [
        (None, ValueError, "a sampling config needs row_keys, one PRNG key per row"),
        (jax.random.key(0), ValueError, r"row_keys must hold 2 keys .* got shape \[\]"),
        (jax.random.split(jax.random.key(0), 3), ValueError, r"must hold 2 keys .* got shape \[3\]"),
        (jax.random.split(jax.random.PRNGKey(0), 2), TypeError, "row_keys must be typed PRNG keys"),
    ],
    ids=["none", "one-key", "three-keys", "raw-uint32"],
)
def test_select_token_names_missing_or_misshaped_row_keys(row_keys, error, match):
    """It was JAX's "unexpected PRNG key type" or a vmap axis error from inside the sampler."""
    with pytest.raises(error, match=match):
        select_token(jnp.zeros((2, V)), row_keys, 0, SamplingConfig(temperature=0.8))


def test_stream_iterated_again_starts_over_from_the_prompt(model):
    prompt_lengths = np.array([4, 2])
    first = np.stack(list(stream(model, CLEAN, 6, prompt_lengths=prompt_lengths)), axis=1)
    eos = int(first[0, 2])  # row 0 stops at its third token, so `done` matters
    s = stream(model, CLEAN, 6, prompt_lengths=prompt_lengths, eos_token_id=eos)
    once = np.stack(list(s), axis=1)
    cache_lengths, done = np.asarray(s.cache.seq_lengths(0)), s.done.copy()
    twice = np.stack(list(s), axis=1)
    np.testing.assert_array_equal(twice, once)
    np.testing.assert_array_equal(once, generate(model, CLEAN, 6, prompt_lengths=prompt_lengths, eos_token_id=eos).tokens)
    assert once[0, 2] == eos and (once[0, 3:] == 0).all()
    np.testing.assert_array_equal(s.cache.seq_lengths(0), cache_lengths)  # not appended to the old cache
    np.testing.assert_array_equal(s.done, done)
    # Two live iterations do not share a cache either.
    a, b = iter(s), iter(s)
    np.testing.assert_array_equal(np.stack([next(a), next(a), next(b), next(b)]), np.stack([once[:, 0], once[:, 1]] * 2))
    # The stream keeps the weights it was built with (documented): a later change to the
    # model is not seen by a new iteration.
    clone = nnx.clone(model)
    kept = stream(clone, CLEAN, 6, prompt_lengths=prompt_lengths)
    nnx.update(clone, jax.tree.map(jnp.zeros_like, nnx.state(clone, nnx.Param)))
    np.testing.assert_array_equal(np.stack(list(kept), axis=1), first)
    assert (np.stack(list(stream(clone, CLEAN, 6, prompt_lengths=prompt_lengths)), axis=1) == 0).all()  # zero weights: token 0


def test_check_inside_jit_and_to_dynamic_of_ragged_rows_say_what_to_do():
    from jaxkv import StaticCache

    cache = StaticCache.init(num_layers=1, batch_size=2, num_kv_heads=1, head_dim=4, max_length=4)
    with pytest.raises(TypeError, match=r"StaticCache.check\(\) reads the flags on the host.*call check\(\) on the result"):
        jax.jit(lambda c: c.check())(cache)
    cache, _, _ = cache.update(jnp.ones((2, 1, 3, 4)), jnp.ones((2, 1, 3, 4)), 0, num_new=jnp.array([3, 1]))
    with pytest.raises(ValueError, match=r"^StaticCache.to_dynamic: layer 0 holds different lengths per row \[3, 1\]"):
        cache.to_dynamic()
    with pytest.raises(ValueError, match=r"^StaticCache.to_legacy_cache: layer 0"):
        cache.to_legacy_cache()


def test_plausible_wrong_arguments_are_named_errors():
    """Review 84: each was a raw error naming nothing (JAX's "None is not a valid value",
    AttributeError, dataclasses.replace's TypeError), a dtype error for an empty page list,
    or a string's characters reported as layer types."""
    import jax.numpy as jnp

    from jaxkv import DynamicCache, HybridCache, PagedCache, StaticCache
    from jaxkv.models import LlamaConfig

    cache = StaticCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4)
    k = jnp.ones((1, 1, 1, 2))
    for call, exc, match in [
        (lambda: cache.update(k, None, 0), TypeError, "StaticCache.update: value_states is None"),
        (lambda: DynamicCache.from_legacy_cache(((None, k),)), TypeError, r"\(layer 0\): key_states is None"),
        (lambda: StaticCache.from_dynamic(((k, k),), max_length=8), TypeError, r"use StaticCache.from_legacy_cache"),
        (lambda: cache.put_rows(jnp.array([0]), None), TypeError, "other must be a jaxkv cache of the same kind"),
        (lambda: HybridCache.init(layer_types="full_attention", batch_size=1, num_kv_heads=1, head_dim=2, max_length=4),
         ValueError, r"got the string 'full_attention'"),
        (lambda: HybridCache.from_config(LlamaConfig.tiny(), batch_size=1, max_length=4), TypeError,
         r"got LlamaConfig; for a jaxkv model use model.init_cache"),
        (lambda: HybridCache.from_config({"num_hidden_layers": 2, "hidden_size": 8}, batch_size=1, max_length=4),
         ValueError, "the config has no num_attention_heads"),
        (lambda: LlamaConfig.from_hf("config.json"), TypeError, r"got str; for a checkpoint directory use"),
    ]:
        with pytest.raises(exc, match=match):
            call()
    paged = PagedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4, page_size=2)
    assert paged.retain([]).free_pages == paged.release([]).free_pages == paged.free_pages

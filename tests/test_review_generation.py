"""Review of jaxkv.generate / stream / sampling: inputs that gave a silently wrong result.

* top-p with ``p`` equal to the mass of the top tokens kept one token too many (the mass
  before a token was ``cumsum - probs``, which rounds below ``p``); checked against HF's
  ``TopPLogitsWarper`` and exact fractions.
* ``prompt_lengths`` given as int64 / uint64 (or a Python list) were converted to int32
  before the range check, so 2**32 + 3 wrapped to 3 and was accepted.
* ``prefill_chunk_size=True`` was accepted as a chunk size of 1.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.generation import check_prompts, generate, stream
from jaxkv.models import Llama, LlamaConfig
from jaxkv.sampling import SamplingConfig, sample, top_p_filter

# Probabilities (exact percentages, most likely first) whose first token's mass is exactly
# TOP_P: the smallest set reaching it is that token alone.
BOUNDARY_ROWS = [(40, 25, 15, 10, 10), (40, 35, 15, 5, 5), (40, 25, 20, 10, 5)]
TOP_P = Fraction(2, 5)


def exact_top_p_kept(probs, p):
    """The smallest prefix of the (descending) probabilities whose mass reaches p, in exact arithmetic."""
    mass = Fraction(0)
    for i, q in enumerate(probs):
        mass += q
        if mass >= p:
            return i + 1
    return len(probs)


def test_top_p_equal_to_a_cumulative_mass_keeps_the_smallest_set():
    rows = [[Fraction(q, 100) for q in row] for row in BOUNDARY_ROWS]
    expected = np.zeros((len(rows), 5), bool)
    for r, row in enumerate(rows):
        expected[r, : exact_top_p_kept(row, TOP_P)] = True
    logits = np.log(np.array([[float(q) for q in row] for row in rows])).astype(np.float32)
    p = float(TOP_P)
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopPLogitsWarper

    hf_kept = np.isfinite(TopPLogitsWarper(p)(None, torch.tensor(logits)).numpy())
    np.testing.assert_array_equal(hf_kept, expected)  # the two references agree
    np.testing.assert_array_equal(np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits), p))), expected)
    # sample's top-k path runs the same rule over the k survivors: it must never draw outside the set.
    config = SamplingConfig(temperature=1.0, top_k=4, top_p=p)
    keys = jax.random.split(jax.random.key(0), 64)
    drawn = np.asarray(jax.jit(jax.vmap(lambda k: sample(jnp.asarray(logits), k, config)))(keys))  # [64, R]
    np.testing.assert_array_equal(drawn, 0)


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "lengths",
    [np.array([2**32 + 3], np.int64), np.array([2**32 + 3], np.uint64), [2**32 + 3], np.array([2**31], np.int64)],
    ids=["int64", "uint64", "list", "int64-2**31"],
)
@pytest.mark.parametrize("entry", [generate, stream])
def test_prompt_lengths_beyond_int32_are_refused_not_wrapped(model, entry, lengths):
    """2**32 + 3 used to become 3 (a valid length: the prompt silently cut to 3 tokens)."""
    ids = np.array([[1, 2, 3, 4, 5]], np.int32)
    with pytest.raises(ValueError, match=rf"prompt_lengths\[0\] = {int(np.asarray(lengths)[0])} is outside \[1, 5\]"):
        entry(model, ids, 2, prompt_lengths=lengths)


def test_prompt_lengths_int64_in_range_still_accepted():
    ids, lengths = check_prompts(np.array([[1, 2, 3, 4, 5]]), np.array([3, 5], np.uint64)[:1], "t", vocab_size=8)
    assert lengths.dtype == jnp.int32 and isinstance(lengths, jax.Array)
    np.testing.assert_array_equal(lengths, [3])


@pytest.mark.parametrize("entry", [generate, stream])
def test_bool_prefill_chunk_size_refused(model, entry):
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        entry(model, np.array([[1, 2, 3]], np.int32), 2, prefill_chunk_size=True)


def test_engine_top_p_at_a_cumulative_mass_keeps_the_smallest_set():
    # PagedEngine samples per row with its own top-p: the same boundary, the same exact set.
    from jaxkv.decoding.engine import _per_row_top_p

    rows = [[Fraction(q, 100) for q in row] for row in BOUNDARY_ROWS]
    expected = np.zeros((len(rows), 5), bool)
    for r, row in enumerate(rows):
        expected[r, : exact_top_p_kept(row, TOP_P)] = True
    logits = np.log(np.array([[float(q) for q in row] for row in rows])).astype(np.float32)
    kept = _per_row_top_p(jnp.asarray(logits), jnp.full((len(rows),), float(TOP_P), jnp.float32))
    np.testing.assert_array_equal(np.isfinite(np.asarray(kept)), expected)


def test_penalties_take_numpy_reals_like_temperature():
    # np.float32 penalties were refused while temperature and top_p accepted them; bools and
    # non-finite values stay refused.
    config = SamplingConfig(temperature=np.float32(0.7), presence_penalty=np.float32(0.5),
                            frequency_penalty=np.float64(0.25))
    assert config.presence_penalty == 0.5 and config.frequency_penalty == 0.25
    for bad in (True, np.bool_(True), float("nan"), np.float32("inf"), "0.5"):
        with pytest.raises(ValueError, match="presence_penalty must be a finite number"):
            SamplingConfig(presence_penalty=bad)


def test_a_top_p_below_the_smallest_normal_float_keeps_the_most_likely_token(model):
    """top_p is any value in (0, 1], but one below float32's smallest normal is flushed to 0
    on XLA:CPU and 'mass before < p' was then false for every token: no token kept, and the
    draw from all -inf logits was token 0 (generate, the engine; review 56). The most likely
    token is kept whatever p is, as the docstring promises."""
    from jaxkv.decoding.engine import EngineRequest, PagedEngine, _per_row_top_p

    logits = jnp.asarray([[0.0, 5.0, 1.0, 2.0], [3.0, -1.0, 0.5, 2.9]], jnp.float32)
    for p in (1e-45, np.finfo(np.float32).tiny / 2, 1e-40):
        for kept in (top_p_filter(logits, p), _per_row_top_p(logits, jnp.full((2,), p, jnp.float32))):
            np.testing.assert_array_equal(np.isfinite(np.asarray(kept)), [[False, True, False, False],
                                                                           [True, False, False, False]])
        config = SamplingConfig(temperature=1.0, top_p=p)
        for seed in range(3):
            assert np.asarray(sample(logits, jax.random.key(seed), config)).tolist() == [1, 0]
    ids = np.array([[5, 6, 7, 8]], np.int32)
    greedy = np.asarray(generate(model, ids, 4).tokens)
    sampled = np.asarray(generate(model, ids, 4, sampling=config, key=jax.random.key(0)).tokens)
    np.testing.assert_array_equal(sampled, greedy)
    engine = PagedEngine(model, max_rows=1, max_length=32, num_pages=8, page_size=16, chunk_size=16)
    (result,) = engine.run([EngineRequest([5, 6, 7, 8], 4, temperature=1.0, top_p=p)])
    assert list(result.tokens) == greedy[0].tolist()

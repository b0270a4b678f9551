"""Review of the decoding entry points' argument checks (see the review report).

The serving loop took float / bool prompt ids (numpy truncated 2.9 to 2 when copying the
prompt into its int32 chunk, so another prompt was served silently) and looped forever on
a NaN or infinite ``arrival`` (never ``<= step``); a far arrival spun one empty loop step
at a time. ``sample_n`` took ``pad_token_id=None`` and failed inside ``jnp.where``.
"""

import contextlib
import signal

import jax
import numpy as np
import pytest

from jaxkv.decoding import ServingLoop, sample_n
from jaxkv.decoding.serving import Request
from test_decoding_reference import greedy_reference, make_model

V = 64


@contextlib.contextmanager
def deadline(seconds, message):
    """Raises TimeoutError(message) in the block after ``seconds``: a loop that never ends
    (the bug these tests pin) fails the test instead of hanging the suite."""

    def expired(*_):
        raise TimeoutError(message)

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=0, vocab_size=V, num_layers=1)


@pytest.mark.parametrize("prompt", [(1.7, 2.9), (2.0, 3.0), (True, False), np.array([1.0, 2.0]), "ab", [[1, 2]]])
def test_serving_loop_refuses_non_integer_prompt_ids(model, prompt):
    loop = ServingLoop(model, num_slots=1, max_length=8, chunk_size=2)
    with pytest.raises(TypeError, match="integer token ids"):
        loop.run([Request(prompt, 2)])


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), 2.5, True, -1])
def test_serving_loop_refuses_bad_arrival(model, arrival):
    loop = ServingLoop(model, num_slots=1, max_length=8, chunk_size=2)
    with deadline(5, "ServingLoop.run did not return"):
        with pytest.raises(ValueError, match="arrival"):
            loop.run([Request((1, 2), 2, arrival=arrival)])


def test_serving_loop_far_arrival_is_served_at_its_step(model):
    """Idle steps before an arrival are skipped, not spun: same tokens and steps, at once."""
    prompts = [[5, 9, 2], [8, 4]]
    far = 10**9
    loop = ServingLoop(model, num_slots=1, max_length=8, chunk_size=2)
    with deadline(5, "ServingLoop.run spun through idle steps"):
        done = loop.run([Request(tuple(prompts[0]), 3), Request(tuple(prompts[1]), 3, arrival=far)])
    reference = greedy_reference(model, prompts, 3)
    assert [list(c.tokens) for c in done] == reference
    assert done[1].admitted_step == far and done[0].admitted_step == 0


def test_sample_n_refuses_pad_none(model):
    with pytest.raises(ValueError, match="pad_token_id"):
        sample_n(model, np.array([[5, 9, 2]]), 2, num_return_sequences=2, key=jax.random.key(0), pad_token_id=None)


# ---- PagedEngine: the same request checks (the serving loop's prompt and arrival checks
# are shared through decoding._common), and its own seed and stop ids.


def _engine(model):
    from jaxkv.decoding.engine import PagedEngine

    return PagedEngine(model, max_rows=1, max_length=8, num_pages=4, page_size=4, chunk_size=2)


@pytest.mark.parametrize(
    "field, bad, error, match",
    [
        ("prompt", (1.7, 2.9), TypeError, "integer token ids"),
        ("prompt", np.array([1.0, 2.0]), TypeError, "integer token ids"),
        ("arrival", float("nan"), ValueError, "arrival"),
        ("arrival", -1, ValueError, "arrival"),
        ("seed", 2**32 + 5, ValueError, r"seed must be in \[0, 2\*\*32\)"),  # wrapped onto seed 5
        ("seed", -1, ValueError, r"seed must be in \[0, 2\*\*32\)"),
        ("stop_token_ids", (3.0,), TypeError, "integer token ids"),  # a float never equals a token
    ],
)
def test_engine_refuses_bad_request_fields(model, field, bad, error, match):
    from jaxkv.decoding.engine import EngineRequest

    request = EngineRequest(**{"prompt": (1, 2), "max_new_tokens": 2, field: bad})
    with deadline(60, "PagedEngine.run did not return"):  # a NaN arrival is never reached
        with pytest.raises(error, match=match):
            _engine(model).run([request])


def test_engine_far_arrival_is_served_at_once_with_the_same_tokens(model):
    """Idle steps before a far arrival are skipped (10**9 of them spun before), and the
    request's tokens are those of the same request arriving at step 0."""
    from jaxkv.decoding.engine import EngineRequest

    with deadline(60, "PagedEngine.run spun through idle steps"):
        far = _engine(model).run([EngineRequest((5, 9, 2), 3, arrival=10**9)])
    assert [list(r.tokens) for r in far] == greedy_reference(model, [[5, 9, 2]], 3)


def test_beam_early_stopping_takes_bools_and_never_only(model):
    from jaxkv.decoding import beam_search

    for bad in (1, 0, 1.0, "True"):  # 1 == True, so `in (True, False, "never")` let it pass
        with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
            beam_search(model, np.array([[1, 2]]), max_new_tokens=2, num_beams=2, early_stopping=bad)


def test_chunked_prefill_return_logits_is_a_bool(model):
    from jaxkv.decoding import chunked_prefill

    cache = model.init_cache(batch_size=1, max_length=8)
    with pytest.raises(TypeError, match="return_logits must be True or False"):
        chunked_prefill(model, np.array([[1, 2, 3]]), cache, chunk_size=2, return_logits="no")


@pytest.mark.parametrize("key", [0, [0, 1]])
def test_sample_n_refuses_a_key_that_is_not_a_jax_key(model, key):
    with pytest.raises(TypeError, match="must be a JAX PRNG key"):
        sample_n(model, np.array([[1, 2]]), max_new_tokens=2, num_return_sequences=2, key=key, pad_token_id=0)

"""Serving loop: any arrival order gives each request its tokens alone; nothing recompiles."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.decoding import Request, ServingLoop
from test_decoding_reference import greedy_reference, make_model

SLOTS, CAPACITY, CHUNK = 3, 32, 4


def _requests(seed=0, count=7):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt = rng.integers(1, 128, size=int(rng.integers(1, 11))).tolist()
        out.append(Request(prompt, int(rng.integers(1, 13)), id=f"r{i}"))
    return out


REQUESTS = _requests()


@pytest.fixture(scope="module")
def model():
    return make_model(seed=8, num_layers=1)


@pytest.fixture(scope="module")
def eos(model):
    # A token the requests actually produce, so some stop early at their EOS.
    plain = greedy_reference(model, [r.prompt for r in REQUESTS], 12)
    values, counts = np.unique([t for out in plain for t in out[1:4]], return_counts=True)
    return int(values[np.argmax(counts)])


@pytest.fixture(scope="module")
def alone(model, eos):
    """Each request's tokens when it runs by itself (cache-free reference)."""
    outs = greedy_reference(model, [r.prompt for r in REQUESTS], 12, eos_token_id=eos)
    return {r.id: out[: r.max_new_tokens] for r, out in zip(REQUESTS, outs)}


@pytest.fixture(scope="module")
def loop(model, eos):
    return ServingLoop(model, num_slots=SLOTS, max_length=CAPACITY, chunk_size=CHUNK, eos_token_id=eos)


def _check(done, requests, alone, eos):
    for request, completion in zip(requests, done):
        assert completion.id == request.id
        assert list(completion.tokens) == alone[request.id], request.id
        assert completion.finish_reason == ("eos" if completion.tokens[-1] == eos else "length")


@pytest.mark.parametrize("prefill_rows", [1, 2, SLOTS])
def test_every_request_gets_its_tokens_alone(model, alone, eos, prefill_rows):
    loop = ServingLoop(model, num_slots=SLOTS, max_length=CAPACITY, chunk_size=CHUNK, eos_token_id=eos,
                       prefill_rows=prefill_rows)
    done = loop.run(REQUESTS)
    _check(done, REQUESTS, alone, eos)
    assert {c.finish_reason for c in done} == {"eos", "length"}
    # More requests than slots: slots were reused.
    assert len({c.slot for c in done}) == SLOTS and loop.stats["generated_tokens"] == sum(len(a) for a in alone.values())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    order=st.permutations(range(len(REQUESTS))),
    arrivals=st.lists(st.integers(0, 25), min_size=len(REQUESTS), max_size=len(REQUESTS)),
)
def test_any_arrival_order_gives_the_same_tokens_without_recompiling(loop, alone, eos, order, arrivals):
    loop.run(REQUESTS[:2])  # warm: both programs compiled
    compiled = dict(loop.compile_counts)
    requests = [
        Request(REQUESTS[i].prompt, REQUESTS[i].max_new_tokens, arrival=a, id=REQUESTS[i].id)
        for i, a in zip(order, arrivals)
    ]
    done = loop.run(requests)
    _check(done, requests, alone, eos)
    assert loop.compile_counts == compiled and max(compiled.values()) <= 1  # 0: an earlier loop compiled them


def test_a_second_loop_over_the_same_model_and_sizes_compiles_nothing(model, loop, eos):
    """Each loop jitted its own partial of the programs: a second loop compiled both again
    (review 81). The programs are shared: the second loop's counts are zeros, its tokens the same."""
    first = loop.run(REQUESTS[:2])
    again = ServingLoop(model, num_slots=SLOTS, max_length=CAPACITY, chunk_size=CHUNK, eos_token_id=eos)
    assert [c.tokens for c in again.run(REQUESTS[:2])] == [c.tokens for c in first]
    assert again.compile_counts == {"prefill": 0, "decode": 0}


def test_static_batches_give_the_same_tokens_in_more_steps(model, alone, eos, loop):
    static = ServingLoop(model, num_slots=SLOTS, max_length=CAPACITY, chunk_size=CHUNK, eos_token_id=eos,
                         policy="static")
    done = static.run(REQUESTS)
    _check(done, REQUESTS, alone, eos)
    loop.run(REQUESTS)
    assert static.stats["steps"] > loop.stats["steps"]
    # A static batch admits only into an empty batch.
    admitted = sorted({c.admitted_step for c in done})
    for step in admitted[1:]:
        assert all(c.finished_step < step for c in done if c.admitted_step < step)


def test_rejects_requests_that_do_not_fit(loop, model):
    with pytest.raises(ValueError, match="needs 33 cache slots .* but max_length is 32"):
        loop.run([Request([1] * 30, 4)])
    # A request without an id is named by its index (it was "request None" for all of them).
    with pytest.raises(ValueError, match=r"ServingLoop.run: request 1 needs 33 cache slots"):
        loop.run([Request([1], 4), Request([1] * 30, 4)])
    with pytest.raises(ValueError, match=r"request 'b' needs 33 cache slots"):
        loop.run([Request([1], 4), Request([1] * 30, 4, id="b")])
    with pytest.raises(ValueError, match="empty prompt"):
        loop.run([Request([], 4)])
    # which request: it said only "max_new_tokens must be a Python int >= 1, got 0"
    with pytest.raises(ValueError, match=r"ServingLoop.run: request 'c' max_new_tokens must be a Python int >= 1, got 0"):
        loop.run([Request([1], 4), Request([1], 0, id="c")])
    # one Request, a (prompt, n) tuple: "not iterable", "no attribute 'prompt'" (review 84)
    with pytest.raises(TypeError, match="takes a list of Requests, got one Request"):
        loop.run(Request([1], 4))
    with pytest.raises(TypeError, match=r"request 0 must be a Request\(prompt, max_new_tokens, ...\), got tuple"):
        loop.run([([1], 4)])
    with pytest.raises(ValueError, match="policy must be"):
        ServingLoop(model, num_slots=2, max_length=8, policy="fifo")
    with pytest.raises(ValueError, match=r"prefill_rows \(3\) must be <= num_slots \(2\)"):
        ServingLoop(model, num_slots=2, max_length=8, prefill_rows=3)


def test_nan_logits_give_the_nan_token_as_every_other_loop(model):
    """A NaN in the weights (an overflow, a corrupt checkpoint): generate and the engine emit
    NAN_TOKEN (-1); the serving loop emitted token 0 (argmax of NaN), a real id, and with
    eos_token_id=0 ended the request as 'eos' after one token (review 76)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.generation import NAN_TOKEN

    broken = nnx.clone(model)
    broken.norm.weight.set_value(broken.norm.weight.get_value().at[0].set(jnp.nan))
    done = ServingLoop(broken, num_slots=2, max_length=16, chunk_size=4, eos_token_id=0).run(
        [Request([5, 7, 9], 3), Request([3, 4], 2)])
    assert [list(d.tokens) for d in done] == [[NAN_TOKEN] * 3, [NAN_TOKEN] * 2]
    assert [d.finish_reason for d in done] == ["length", "length"]

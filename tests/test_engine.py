"""PagedEngine: continuous batching on a paged cache, prefix caching, preemption.

References: greedy continuation with full (uncached) attention (``greedy_reference``), and
each request served alone (sampling keys depend on the request, not on the batch). The
model has a sliding layer and a full one, with clear greedy margins (the fixture checks
them), so chunked, batched, prefix-hit and preempted runs must agree token for token.
"""

import numpy as np
import pytest

from jaxkv.decoding.engine import EngineRequest, PagedEngine, _step_program
from test_decoding_reference import clear_greedy_reference, make_model

V, N, PS = 64, 6, 4
SHARED = [37, 57, 41, 37, 31, 3, 8, 45, 41, 36]  # 10 tokens: two full pages of 4, then 2
PROMPTS = [SHARED + [8, 53], SHARED + [51], [18, 23, 51], SHARED + [8, 53, 11, 21, 25]]


@pytest.fixture(scope="module")
def model():
    # Stacked layers (the scan): the prompts' greedy margins hold for this layout's weights.
    return make_model(
        seed=7, scale=10.0, scan_layers=True, vocab_size=V, num_layers=2, sliding_window=3,
        sliding_layers=(True, False),
    )


@pytest.fixture(scope="module")
def reference(model):
    # Float32 pages in other chunkings and batches move the logits by ~1e-5: far below 0.5.
    return clear_greedy_reference(model, PROMPTS, N, margin=0.5)


def engine(model, **kw):
    # 3 rows of up to 6 pages each from a pool of 8: the pool, not the rows, is the limit.
    kw = {"max_rows": 3, "max_length": 24, "num_pages": 8, "page_size": PS, "chunk_size": 4, **kw}
    return PagedEngine(model, **kw)


def test_greedy_matches_the_uncached_reference_with_prefix_hits_and_preemption(model, reference):
    # Compile counts below are this run's own: programs an earlier test of this worker
    # compiled for the same model and sizes would be reused (and counted 0; order-dependent).
    _step_program.clear_cache()
    eng = engine(model, num_pages=7)
    # Request 3 arrives late: the shared pages are indexed by then.
    reqs = [EngineRequest(p, N, arrival=(6 if i == 3 else 0)) for i, p in enumerate(PROMPTS)]
    out = eng.run(reqs)
    assert [list(r.tokens) for r in out] == reference
    # Request 3 extends request 0's 12-token prompt: all three of its full pages are reused
    # (the last one too, though request 0 ends on it: review 59).
    assert out[3].cached_tokens == 12 and out[2].cached_tokens == 0
    assert eng.stats["preemptions"] > 0 and sum(r.preemptions for r in out) == eng.stats["preemptions"]
    assert all(r.finish_reason == "length" for r in out)
    compiled = eng.compile_counts
    # Busy-row buckets 1 and 3 (R), decode (1 token) and mixed (C = 4): at most 4 programs.
    assert set(compiled) <= {"step1x1", "step1x4", "step3x1", "step3x4"} and max(compiled.values()) == 1
    cold = engine(model, num_pages=7, prefix_cache=False)
    assert [list(r.tokens) for r in cold.run(reqs)] == reference
    assert eng.stats["prefill_tokens"] < cold.stats["prefill_tokens"]
    # Same model and sizes: programs are shared (the cold run compiles only shapes the
    # first run did not need).
    assert not set(cold.compile_counts) & set(compiled)
    # The same 12-token prompt again: its last page is indexed but recomputed (the last
    # token's logits start generation), the two before it are reused.
    again = eng.run([EngineRequest(PROMPTS[0], N)])[0]
    assert list(again.tokens) == reference[0] and again.cached_tokens == 8


def test_sampled_tokens_do_not_depend_on_the_batch_or_the_prefix_cache(model):
    reqs = [EngineRequest(p, N, temperature=0.8, top_p=0.9, seed=10 + i) for i, p in enumerate(PROMPTS)]
    together = [r.tokens for r in engine(model).run(reqs)]
    cold = engine(model, prefix_cache=False)
    assert together == [r.tokens for r in cold.run(reqs)]
    alone = [cold.run([r])[0].tokens for r in reqs[:2]]  # the other rows empty
    assert together[:2] == alone
    # NumPy scalars are numbers too (they used to be refused as "must be a finite number").
    import numpy as np

    numpy_scalars = EngineRequest(PROMPTS[0], N, temperature=np.float32(0.8), top_p=np.float32(0.9), seed=np.int64(10))
    assert cold.run([numpy_scalars])[0].tokens == alone[0]
    assert len({t for toks in together for t in toks}) > N  # it did sample (not one greedy path)


PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3)


def test_penalties_equal_generate_through_prefix_hits_and_preemption(model):
    """Greedy with penalties: each request equals jaxkv.generate with the same penalties
    alone; a preempted request resumes with its own history, a plain request sharing the
    step is untouched. Sampled with penalties and min-p: a request's tokens alone equal
    its tokens in the batch (same engine sizes: the programs are shared)."""
    import numpy as np

    from jaxkv.generation import generate
    from jaxkv.sampling import SamplingConfig

    penalised = SamplingConfig(**PENALTIES)
    want = [np.asarray(generate(model, np.asarray([p]), N, sampling=penalised).tokens)[0].tolist()
            if i != 2 else None for i, p in enumerate(PROMPTS)]
    plain = [np.asarray(generate(model, np.asarray([p]), N).tokens)[0].tolist() for p in PROMPTS]
    want[2] = plain[2]
    assert any(w != q for w, q in zip(want, plain)), "the penalties changed nothing: the test would not see them"
    reqs = [EngineRequest(p, N, arrival=(6 if i == 3 else 0), **({} if i == 2 else PENALTIES))
            for i, p in enumerate(PROMPTS)]
    eng = engine(model, num_pages=7)  # request 1 is preempted after 2 tokens: it must resume with their counts
    out = eng.run(reqs)
    assert out[1].preemptions == 1 and out[3].cached_tokens > 0
    assert [list(r.tokens) for r in out] == want
    assert {"step3x1+history", "step3x4+history"} & set(eng.compile_counts)

    sampled = [EngineRequest(p, N, temperature=0.9, min_p=0.05, seed=20 + i, **PENALTIES) for i, p in enumerate(PROMPTS)]
    together = [r.tokens for r in engine(model, num_pages=7).run(sampled)]
    assert together[1] == engine(model, num_pages=7, prefix_cache=False).run([sampled[1]])[0].tokens  # alone
    assert len({t for toks in together for t in toks}) > N  # it did sample


def test_per_row_min_p_and_penalties_follow_their_definitions():
    """Each row's own min-p and penalties (the engine's per-row vectors), against NumPy."""
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.decoding.engine import _sample_rows
    from jaxkv.sampling import TokenHistory, penalise

    rows, vocab = 2000, 6
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = jnp.asarray(np.tile(np.log(probs), (rows, 1)), jnp.float32)
    min_p = np.where(np.arange(rows) % 2 == 0, 0.3, 0.0).astype(np.float32)  # even rows: keep p >= 0.12
    picked = np.asarray(_sample_rows(logits, jnp.ones(rows), jnp.ones(rows), jnp.asarray(min_p),
                                     jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32)))
    assert set(picked[0::2]) == {0, 1, 2} and set(picked[1::2]) == set(range(vocab))
    in_prompt = np.zeros((2, vocab), bool)
    in_prompt[0, [1, 4]] = True
    counts = np.zeros((2, vocab), np.int32)
    counts[0, 2], counts[1, 3] = 2, 1
    x = np.array([[1.0, 2.0, -1.0, 0.5, -2.0, 3.0], [1.0, 2.0, -1.0, 0.5, -2.0, 3.0]], np.float32)
    got = np.asarray(penalise(jnp.asarray(x), TokenHistory(jnp.asarray(in_prompt), jnp.asarray(counts)),
                                        jnp.asarray([2.0, 1.0]), jnp.asarray([0.5, 0.0]), jnp.asarray([0.25, 0.0])))
    want = x.copy()
    want[0, 1], want[0, 4] = 2.0 / 2, -2.0 * 2  # in the prompt: repetition only
    want[0, 2] = -1.0 * 2 - 0.25 * 2 - 0.5  # generated twice: all three
    np.testing.assert_allclose(got, want)  # row 1 (1.0 / 0.0 / 0.0) unchanged despite its history


def test_per_row_top_p_and_the_key_rule_follow_their_definitions():
    """Each row's top-p keeps the smallest most-likely set reaching p, and the draw is
    ``categorical(fold_in(PRNGKey(seed), index))`` (README: a request's tokens depend on itself
    only). The engine tests compare runs with each other; a _sample_rows that ignored top_p
    or drew every token with index 0 passed them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.decoding.engine import _sample_rows

    rows = 4000
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = jnp.asarray(np.tile(np.log(probs), (rows, 1)), jnp.float32)
    top_p = np.where(np.arange(rows) % 2 == 0, 0.5, 1.0).astype(np.float32)  # even rows: 0.4 + 0.25 reach 0.5
    seeds, index = np.arange(rows, dtype=np.uint32) % 97, np.arange(rows, dtype=np.int32) // 97
    picked = np.asarray(_sample_rows(logits, jnp.ones(rows), jnp.asarray(top_p), jnp.zeros(rows), jnp.asarray(seeds),
                                     jnp.asarray(index)))
    assert set(picked[0::2]) == {0, 1} and set(picked[1::2]) == set(range(6))
    share = np.mean(picked[0::2] == 0)  # 0.4 / 0.65 of the kept mass; 2000 draws: sd 0.011
    assert abs(share - 0.4 / 0.65) < 0.05, share
    # rows without a filter: exactly the draw of the documented key from the row's distribution
    want = [int(jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(int(seeds[r])), int(index[r])),
                                       jnp.log(jnp.asarray(probs, jnp.float32)))) for r in range(1, 400, 2)]
    np.testing.assert_array_equal(picked[1:400:2], want)


def test_rows_without_top_p_keep_every_token():
    """A request without top_p (p = 1 in its row) samples from every token, as generate's
    filter-free path does: the float32 running sum of many probabilities rounds up to 1 before
    the tail, and the filter at p = 1 dropped tens to hundreds of tail tokens (the draw then
    could never be one of them)."""
    import jax.numpy as jnp

    from jaxkv.decoding.engine import _per_row_top_p

    rng = np.random.default_rng(0)
    for vocab in (1000, 4096, 32000):
        logits = jnp.asarray(rng.normal(size=(8, vocab)) * 2.0, jnp.float32)
        got = np.asarray(_per_row_top_p(logits, jnp.ones(8, jnp.float32)))
        np.testing.assert_array_equal(got, np.asarray(logits), err_msg=f"vocab {vocab}: p = 1 dropped tokens")


def test_a_request_top_p_reaches_its_row(model, reference):
    """A top-p that keeps only the most likely token makes a hot sampler greedy: the
    request's top_p reaches the row's filter (at temperature 5 alone the draws wander)."""
    hot = [EngineRequest(p, N, temperature=5.0, top_p=1e-6, seed=i) for i, p in enumerate(PROMPTS)]
    assert [list(r.tokens) for r in engine(model).run(hot)] == reference
    unfiltered = [EngineRequest(p, N, temperature=5.0, seed=i) for i, p in enumerate(PROMPTS)]
    assert [list(r.tokens) for r in engine(model).run(unfiltered)] != reference


def test_tiny_temperature_gives_the_argmax():
    # logits / 1e-37 overflowed to +-inf: the draw was the lowest overflowed id, not the argmax.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.decoding.engine import _sample_rows

    rows = 8
    logits = (jax.random.normal(jax.random.key(0), (rows, 50)) * 100).at[:, 3].set(-jnp.inf)
    temperature = jnp.asarray([1e-37, 1e-40] * (rows // 2), jnp.float32)
    top_p = jnp.asarray([1.0, 1.0, 0.9, 0.9] * (rows // 4), jnp.float32)
    min_p = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1], jnp.float32)
    got = _sample_rows(logits, temperature, top_p, min_p, jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.argmax(np.asarray(logits), axis=-1),
                                  err_msg="a tiny temperature must give each row's argmax")


def test_stop_tokens_and_streaming(model, reference):
    stop = reference[0][2]
    reqs = [EngineRequest(PROMPTS[0], N, stop_token_ids=[stop], id="a"), EngineRequest(PROMPTS[2], N, id="b")]
    eng = engine(model)
    streamed = {"a": [], "b": []}
    for rid, token in eng.stream(reqs):
        streamed[rid].append(token)
    out = eng.run(reqs)
    first_stop = reference[0].index(stop)
    assert list(out[0].tokens) == reference[0][: first_stop + 1] and out[0].finish_reason == "stop"
    assert streamed == {"a": list(out[0].tokens), "b": list(out[1].tokens)}
    # Stop ids as a one-shot iterator: the check used to consume it, so it never matched
    # (the request ran to max_new_tokens, finish_reason "length").
    once = eng.run([EngineRequest(PROMPTS[0], N, stop_token_ids=iter([stop]), id="a")])
    assert once[0].tokens == out[0].tokens and once[0].finish_reason == "stop"
    # A stream abandoned after its first token (a client gone) frees its rows' pages: the
    # pool then holds only the prefix index's pins, and a later run is served in full
    # (it used to wait forever for pages no row would free).
    pool = eng._cache.num_pages
    for _ in eng.stream([EngineRequest(PROMPTS[3], N)]):
        break
    assert eng._cache.free_pages == pool - len(eng.prefix)
    # Its figures are its own (they were the previous run's, 3 tokens; review 60).
    assert eng.stats["generated_tokens"] == 1 and len(once[0].tokens) != 1
    assert not (np.asarray(eng._cache.block_table) >= 0).any() and not np.asarray(eng._cache.lengths).any()
    assert [list(r.tokens) for r in eng.run([EngineRequest(p, N) for p in PROMPTS])] == reference
    # One run or stream at a time: a second one while a stream is open used to empty the
    # open stream's rows (or have its rows emptied when that stream closed), and both went
    # on decoding from emptied rows: wrong tokens, no error.
    first = eng.stream([EngineRequest(p, N) for p in PROMPTS])
    tokens = {i: [] for i in range(len(PROMPTS))}
    rid, token = next(first)
    tokens[rid].append(token)
    with pytest.raises(RuntimeError, match="another run or stream of this engine is still open"):
        eng.run([EngineRequest(PROMPTS[0], N)])
    second = eng.stream([EngineRequest(PROMPTS[0], N)])
    with pytest.raises(RuntimeError, match="still open"):
        next(second)
    for rid, token in first:  # the open stream is untouched by the refused calls
        tokens[rid].append(token)
    assert [tokens[i] for i in range(len(PROMPTS))] == reference
    # A generator of requests is served (run() took len() of it after serving, and failed).
    assert [list(r.tokens) for r in eng.run(EngineRequest(p, N) for p in PROMPTS)] == reference
    # Pages pinned outside the engine's index can starve a request with no row running: an
    # error, not a loop that never ends.
    starved = engine(model, prefix_cache=False)
    starved._cache = starved._cache.retain(list(range(pool - 1)))
    with pytest.raises(RuntimeError, match=r"request 0 cannot be admitted although no row is running: only 1 of 8"):
        starved.run([EngineRequest(PROMPTS[0], N)])


def _tight_engine(model, free_left):
    """An engine whose index holds SHARED's two full pages (the first two of PROMPTS[0], 1
    and 3) and whose other pages are all pinned from outside but ``free_left``."""
    eng = engine(model)
    eng.run([EngineRequest(SHARED, 1)])
    refcount = np.asarray(eng._cache.refcount)
    free = [p for p in range(eng._cache.num_pages) if refcount[p] == 0]
    eng._cache = eng._cache.retain(free[: len(free) - free_left])
    return eng


def test_admission_keeps_the_prefix_pages_it_matched(model, reference):
    # Request 0 matches the two indexed pages (no row holds them yet); request 1, admitted in
    # the same round, needs a page more than is free. Evicting request 0's matched page for it
    # used to count that page as free although request 0 takes it over: request 1 was admitted,
    # preempted at once, and the index lost the page.
    eng = _tight_engine(model, free_left=1)
    out = eng.run([EngineRequest(PROMPTS[1], 1), EngineRequest(PROMPTS[2], 2)])
    assert [list(r.tokens) for r in out] == [reference[1][:1], reference[2][:2]]
    assert out[0].cached_tokens == 8
    assert (eng.stats["preemptions"], eng.stats["evicted_pages"], len(eng.prefix)) == (0, 0, 2)
    # The same pool cannot finish a 6-token request: a lone row without a page used to write
    # nowhere and sample garbage (15, 6, 6, 6, 6, 6 against the reference's 15, 6, 45, ...).
    with pytest.raises(RuntimeError, match=r"request 0 needs 1 more page\(s\) to go on with no other row"):
        eng.run([EngineRequest(PROMPTS[1], N)])  # the same pins, the same free page


def test_evicting_a_prefix_page_drops_the_pages_after_it(model, reference):
    """A lookup walks a chain from its first page: evicting page 0 of SHARED's indexed
    chain made page 1 unreachable, yet it stayed pinned (pool space no request could use)
    until LRU reached it too. Now the pages after an evicted one go with it."""
    eng = _tight_engine(model, free_left=0)  # index: SHARED's pages 0 -> 1; nothing else free
    out = eng.run([EngineRequest(PROMPTS[2], 2)])  # 3 + 2 tokens: 1 page, taken from the index
    assert [list(r.tokens) for r in out] == [reference[2][:2]]
    assert (eng.stats["evicted_pages"], len(eng.prefix)) == (2, 0)
    refcount = np.asarray(eng._cache.refcount)
    assert eng._cache.free_pages == int((refcount == 0).sum()) == 2  # both of the chain's pages are free

    from jaxkv.decoding.engine import PrefixIndex

    index = PrefixIndex(2)
    a, b = index.keys_of([1, 2, 3, 4, 5, 6]), index.keys_of([1, 2, 9, 9])
    for j, key in enumerate(a):
        assert index.insert(key, 10 + j, a[j - 1] if j else None)
    assert not index.insert(b[0], 99, None) and index.insert(b[1], 20, b[0])  # b shares a's first page
    assert sorted(index.remove(a[1])) == [11, 12]  # a's pages 1, 2; b's branch stays
    assert index.lookup(a) == [10] and index.lookup(b) == [10, 20]
    assert sorted(index.remove(a[0])) == [10, 20]
    assert len(index) == 0
    assert not index.insert(a[1], 11, a[0])  # its parent is gone: no lookup could reach it


def test_a_flagged_write_is_an_error_and_the_next_run_is_clean(model, reference):
    # Whatever drops a write (an accounting bug the page checks above miss), the engine
    # raises instead of sampling from it, and its rows are emptied for the next run.
    import dataclasses

    from jaxkv.caches import CacheError
    from jaxkv.caches._checks import OUT_OF_PAGES

    eng = engine(model)
    step = eng._step  # (state, cache, ...): the cache comes in with row 1 flagged
    eng._step = lambda state, cache, *a: step(
        state, dataclasses.replace(cache, flags=cache.flags.at[1].set(OUT_OF_PAGES)), *a)
    with pytest.raises(CacheError, match=r"rows \[1\] found no free page for a write"):
        eng.run([EngineRequest(p, N) for p in PROMPTS[:2]])
    eng._step = step
    assert [list(r.tokens) for r in eng.run([EngineRequest(PROMPTS[2], N)])] == [reference[2]]


def test_bad_requests_are_refused(model):
    eng = engine(model)
    for bad, match in [
        (EngineRequest([], 2), "empty prompt"),
        (EngineRequest([1] * 20, 10), "needs 29 cache slots"),
        (EngineRequest([1], 2, temperature=float("nan")), "temperature"),
        (EngineRequest([1], 2, top_p=0.0), "top_p"),
        (EngineRequest([1], 2, min_p=1.5), "request 0 min_p must be in"),
        (EngineRequest([1], 2, repetition_penalty=0.0), "request 0 repetition_penalty must be finite and > 0"),
        (EngineRequest([1], 2, presence_penalty=float("nan")), "presence_penalty must be a finite number"),
        (EngineRequest([1], 2, frequency_penalty=float("inf")), "frequency_penalty must be a finite number"),
        (EngineRequest([V], 2), r"\[0, 64\)"),
        (EngineRequest([1], 2, temperature=True), "request 0 temperature must be a finite number"),
        (EngineRequest([1], 2, top_p=True), "request 0 top_p must be a number in"),
        # inf in the float32 sampler: every scaled logit 0, so top-p kept the lowest ids (review 76)
        (EngineRequest([1], 2, temperature=1e39, top_p=0.5), r"request 0 temperature=1e\+39 overflows float32"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.run([bad])
    with pytest.raises(TypeError, match=r"request 0 stop_token_ids must be a sequence of token ids .* got 44"):
        eng.run([EngineRequest([1], 2, stop_token_ids=44)])  # was a bare "'int' object is not iterable"
    for seed in (2.7, 2.0, True, "2"):  # 2.7 used to be truncated to 2 silently
        with pytest.raises(TypeError, match="request 0 seed must be an int"):
            eng.run([EngineRequest([1], 2, temperature=1.0, seed=seed)])
    with pytest.raises(ValueError, match="cannot hold one request"):
        engine(model, num_pages=3)
    for bad in (([1], 2), {"prompt": [1], "max_new_tokens": 2}):  # AttributeError: no attribute 'prompt'
        with pytest.raises(TypeError, match="request 0 must be an EngineRequest"):
            eng.run([bad])
    # stream() tags tokens by id: two requests of one id were accepted, their tokens inseparable
    with pytest.raises(ValueError, match="requests 0 and 2 have the same id 'a'"):
        eng.run([EngineRequest([1], 2, id="a"), EngineRequest([1], 2, id="b"), EngineRequest([2], 2, id="a")])
    with pytest.raises(ValueError, match=r"requests 0 and 1 have the same id 0 \(request 0 has no id"):
        list(eng.stream([EngineRequest([1], 2), EngineRequest([1], 2, id=0)]))
    with pytest.raises(TypeError, match="request 0 id must be hashable"):
        eng.run([EngineRequest([1], 2, id=["a"])])


def test_nan_logits_give_the_nan_token_as_generate_does(model):
    """A NaN in the weights (an overflow, a corrupt checkpoint): generate emits NAN_TOKEN (-1);
    the engine emitted token 0 (argmax of NaN), a real id, which even ended a request whose
    stop ids held 0."""
    import jax.numpy as jnp
    from flax import nnx

    broken = nnx.clone(model)
    broken.norm.weight.set_value(broken.norm.weight.get_value().at[0].set(jnp.nan))
    out = engine(broken).run([EngineRequest([37, 57, 41], 3), EngineRequest([37, 57, 41], 3, temperature=0.8, seed=3),
                              EngineRequest([37, 57, 41], 3, stop_token_ids=[0])])
    for completion in out:
        assert list(completion.tokens) == [-1, -1, -1] and completion.finish_reason == "length"


def test_a_page_two_rows_write_stays_in_flight_until_both_are_done():
    """Two rows of one prompt that ends on a page boundary both write its last page (neither
    may reuse it: its last token's logits start generation). One of them preempted or done
    must leave the page in flight for the other, so that a request extending the prompt
    waits for it instead of computing it again (a set dropped the key; review 60)."""
    import collections

    from jaxkv.decoding.engine import _done_writing

    in_flight = collections.Counter()
    in_flight[b"last page"] += 1  # row A
    in_flight[b"last page"] += 1  # row B, the same prompt
    _done_writing(in_flight, b"last page")  # B preempted
    assert b"last page" in in_flight
    _done_writing(in_flight, b"last page")  # A indexed it
    assert b"last page" not in in_flight and not in_flight

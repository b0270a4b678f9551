"""PagedEngine: continuous batching on a paged cache, prefix caching, preemption.

References: greedy continuation with full (uncached) attention (``greedy_reference``), and
each request served alone (sampling keys depend on the request, not on the batch). The
model has a sliding layer and a full one, with clear greedy margins (the fixture checks
them), so chunked, batched, prefix-hit and preempted runs must agree token for token.
"""

import pytest

from jaxkv.decoding.engine import EngineRequest, PagedEngine
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
    eng = engine(model)
    # Request 3 arrives late: the shared pages are indexed by then.
    reqs = [EngineRequest(p, N, arrival=(6 if i == 3 else 0)) for i, p in enumerate(PROMPTS)]
    out = eng.run(reqs)
    assert [list(r.tokens) for r in out] == reference
    assert out[3].cached_tokens == 8 and out[2].cached_tokens == 0
    assert eng.stats["preemptions"] > 0 and sum(r.preemptions for r in out) == eng.stats["preemptions"]
    assert all(r.finish_reason == "length" for r in out)
    compiled = eng.compile_counts
    # Busy-row buckets 1 and 3 (R), decode (1 token) and mixed (C = 4): at most 4 programs.
    assert set(compiled) <= {"step1x1", "step1x4", "step3x1", "step3x4"} and max(compiled.values()) == 1
    cold = engine(model, prefix_cache=False)
    assert [list(r.tokens) for r in cold.run(reqs)] == reference
    assert eng.stats["prefill_tokens"] < cold.stats["prefill_tokens"]
    # Same model and sizes: programs are shared (the cold run compiles only shapes the
    # first run did not need).
    assert not set(cold.compile_counts) & set(compiled)


def test_sampled_tokens_do_not_depend_on_the_batch_or_the_prefix_cache(model):
    reqs = [EngineRequest(p, N, temperature=0.8, top_p=0.9, seed=10 + i) for i, p in enumerate(PROMPTS)]
    together = [r.tokens for r in engine(model).run(reqs)]
    cold = engine(model, prefix_cache=False)
    assert together == [r.tokens for r in cold.run(reqs)]
    alone = [cold.run([r])[0].tokens for r in reqs[:2]]  # the other rows empty
    assert together[:2] == alone
    assert len({t for toks in together for t in toks}) > N  # it did sample (not one greedy path)


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


def test_bad_requests_are_refused(model):
    eng = engine(model)
    for bad, match in [
        (EngineRequest([], 2), "empty prompt"),
        (EngineRequest([1] * 20, 10), "needs 29 cache slots"),
        (EngineRequest([1], 2, temperature=float("nan")), "temperature"),
        (EngineRequest([1], 2, top_p=0.0), "top_p"),
        (EngineRequest([V], 2), r"\[0, 64\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.run([bad])
    with pytest.raises(ValueError, match="cannot hold one request"):
        engine(model, num_pages=3)

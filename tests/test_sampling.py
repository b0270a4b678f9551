"""Sampling filters on hand-made distributions, and sampling statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.sampling import SamplingConfig, apply_temperature, greedy, sample, top_k_filter, top_p_filter

PROBS = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


@pytest.mark.parametrize(
    "p, kept",
    [(0.3, {1}), (0.5, {1}), (0.51, {1, 3}), (0.79, {1, 3}), (0.85, {1, 3, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_p(p, kept):
    out = np.asarray(top_p_filter(LOGITS, p))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == kept
    np.testing.assert_array_equal(out[list(kept)], np.asarray(LOGITS)[0, list(kept)])


@pytest.mark.parametrize("k, kept", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3})])
def test_top_k_keeps_k_largest(k, kept):
    out = np.asarray(top_k_filter(LOGITS, k))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == kept


def test_top_k_one_and_tiny_temperature_equal_greedy():
    logits = jax.random.normal(jax.random.key(0), (16, 50))
    want = greedy(logits)
    keys = jax.random.split(jax.random.key(1), 5)
    for key in keys:
        np.testing.assert_array_equal(sample(logits, key, SamplingConfig(temperature=1.0, top_k=1)), want)
        np.testing.assert_array_equal(sample(logits, key, SamplingConfig(temperature=1e-6)), want)
        np.testing.assert_array_equal(sample(logits, key, SamplingConfig(temperature=0.0)), want)


@pytest.mark.parametrize("temperature, scale", [(1e-37, 100.0), (1e-38, 3.0), (1e-40, 3.0)])
def test_tiny_temperature_gives_the_argmax(temperature, scale):
    # logits / temperature used to overflow to +-inf (or divide by a flushed 0): the draw
    # was then the lowest id of the overflowed tokens, not the argmax of the T -> 0 limit.
    from jaxkv.decoding._common import filtered_logits

    logits = jax.random.normal(jax.random.key(0), (8, 50)) * scale
    logits = logits.at[:, 3].set(-jnp.inf)  # a masked token stays masked
    want = np.asarray(greedy(logits))
    for kwargs in (dict(), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        config = SamplingConfig(temperature=temperature, **kwargs)
        got = np.asarray(sample(logits, jax.random.key(1), config))
        np.testing.assert_array_equal(got, want, err_msg=f"sample with {kwargs} is not the argmax at T={temperature}")
        probs = np.asarray(jax.nn.softmax(filtered_logits(logits, config), axis=-1))
        np.testing.assert_array_equal(probs, np.eye(50)[want], err_msg=f"filtered_logits with {kwargs} is not one-hot")
    # NaN rows stay NaN (select_token turns them into NAN_TOKEN); -inf stays -inf.
    scaled = np.asarray(jax.jit(apply_temperature)(logits.at[0, 7].set(jnp.nan), temperature))
    assert np.isnan(scaled[0, 7]) and np.isneginf(scaled[:, 3]).all() and (scaled[np.arange(1, 8), want[1:]] == 0).all()


def test_same_key_same_tokens_different_key_differs():
    logits = jnp.zeros((64, 100))
    config = SamplingConfig(temperature=1.0, top_p=0.9)
    a = sample(logits, jax.random.key(3), config)
    np.testing.assert_array_equal(a, sample(logits, jax.random.key(3), config))
    assert (a != sample(logits, jax.random.key(4), config)).any()


def test_sampling_frequencies_follow_filtered_distribution():
    n = 20000
    logits = jnp.broadcast_to(LOGITS, (n, 4))
    tokens = np.asarray(jax.jit(lambda l, k: sample(l, k, SamplingConfig(temperature=1.0, top_p=0.85)))(logits, jax.random.key(0)))
    counts = np.bincount(tokens, minlength=4) / n
    want = np.array([0.0, 0.5, 0.15, 0.3]) / 0.95
    # 5 standard errors of a binomial proportion at n=20000: about 0.018 at p=0.5.
    assert np.all(np.abs(counts - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), counts


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(temperature=-1.0), "temperature must be finite and >= 0"), (dict(temperature=float("inf")), "finite"), (dict(temperature=float("nan")), "finite"), (dict(top_k=-2), "top_k must be"), (dict(top_k=True), "top_k must be a non-negative int or None, got True"), (dict(temperature=True), "temperature must be a real number, got True of type bool"), (dict(top_p="0.9"), "top_p must be a real number or None, got '0.9'"), (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
     (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"), (dict(min_p=float("nan")), "min_p"),
     (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
     (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(repetition_penalty=float("nan")), "repetition_penalty"),
     (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
     (dict(frequency_penalty=float("-inf")), "frequency_penalty must be a finite number"),
     (dict(frequency_penalty="0.5"), "frequency_penalty"),
     # finite in float64, inf in the sampler's float32: every logit 0, or NaN (silently)
     (dict(temperature=1e39), "temperature=1e\\+39 overflows float32"),
     (dict(presence_penalty=1e39), "presence_penalty=1e\\+39 overflows float32"),
     (dict(frequency_penalty=-1e39), "frequency_penalty=-1e\\+39 overflows float32")],
)
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_numpy_ints_are_a_top_k_like_any_other_int():
    """NumPy ints are accepted as NumPy floats are for the other settings (top_k=np.int64(5)
    was refused with "must be a non-negative int"), and kept as a Python int: the same
    static config, so the same compiled program."""
    config = SamplingConfig(top_k=np.int64(5))
    assert type(config.top_k) is int and config == SamplingConfig(top_k=5)
    assert hash(config) == hash(SamplingConfig(top_k=5))


def test_greedy_equals_numpy_argmax_with_ties_infinities_and_nan():
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal(37),
        np.array([1.0, 3.0, 3.0, -2.0, 3.0]),  # ties: the lowest id
        np.array([-np.inf, -np.inf, -np.inf]),  # all -inf: id 0, as argmax
        np.array([0.5, np.inf, 2.0, np.inf]),
        np.array([0.5, np.nan, 9.0, np.nan]),  # a NaN wins, the first one (as jnp/np.argmax)
        np.round(rng.standard_normal(37), 1),  # many ties
    ]
    for row in rows:
        logits = jnp.asarray(np.tile(row, (3, 1)), jnp.float32)
        want = np.argmax(np.asarray(logits), axis=-1)
        np.testing.assert_array_equal(np.asarray(greedy(logits)), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(greedy)(logits)), want)


def _numpy_sampling_distribution(logits, temperature, top_k, top_p, min_p=None):
    """The distribution ``sample`` draws from, written from the definitions in NumPy
    (min-p: HF's rule, a probability below min_p times the largest one is dropped)."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")  # most likely first, lower ids first on ties
    kept = order[:top_k] if top_k else order
    probs = np.exp(x[kept] - x[kept].max())
    probs /= probs.sum()
    if top_p is not None:
        kept = kept[np.cumsum(probs) - probs < top_p]
    if min_p:
        probs = np.exp(x[kept] - x[kept].max())
        probs /= probs.sum()
        kept = kept[probs >= min_p * probs.max()]
    out = np.zeros_like(x)
    out[kept] = np.exp(x[kept] - x[kept].max())
    return out / out.sum()


def test_top_k_keeps_exactly_k_lower_ids_first_on_ties():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]])
    out = np.asarray(top_k_filter(logits, 2))[0]
    assert set(np.flatnonzero(np.isfinite(out))) == {1, 2}
    # sample draws from that same set (never id 3 or 5, tied at the k-th value)
    tokens = sample(jnp.broadcast_to(logits, (4000, 6)), jax.random.key(0), SamplingConfig(temperature=1.0, top_k=2))
    assert set(np.unique(np.asarray(tokens))) == {1, 2}


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(12, 0.7, None), (12, None, None), (5, 0.999, None), (None, 0.6, None), (12, 0.9, 0.3), (None, None, 0.05)],
)
def test_sampling_frequencies_equal_numpy_reference(top_k, top_p, min_p):
    # sample() draws over the top-k survivors only (no sort over V); its frequencies must be
    # those of the filtered full-vocabulary distribution, computed here independently.
    n, vocab, temperature = 20000, 64, 0.9
    row = np.asarray(jax.random.normal(jax.random.key(7), (vocab,)) * 2.0)
    want = _numpy_sampling_distribution(row, temperature, top_k, top_p, min_p)
    if min_p:  # the case must remove tokens that top-k / top-p alone keep
        assert (want > 0).sum() < (_numpy_sampling_distribution(row, temperature, top_k, top_p) > 0).sum()
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = jnp.broadcast_to(jnp.asarray(row, jnp.float32), (n, vocab))
    tokens = np.asarray(jax.jit(lambda l, k: sample(l, k, config))(logits, jax.random.key(1)))
    counts = np.bincount(tokens, minlength=vocab) / n
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(want)), "drew a token the filters remove"
    assert np.all(np.abs(counts - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9), (counts, want)
    # and the filters alone give the same distribution (speculative decoding's acceptance test uses them)
    from jaxkv.decoding._common import filtered_logits

    filtered = np.asarray(jax.nn.softmax(filtered_logits(jnp.asarray(row[None], jnp.float32), config), axis=-1))[0]
    np.testing.assert_allclose(filtered, want, atol=1e-6)

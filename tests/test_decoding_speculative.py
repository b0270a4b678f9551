"""Speculative decoding: greedy output == the target's greedy output; sampling preserves
the target's distribution (chi-square test on a tiny vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxkv.decoding import speculative_generate
from jaxkv.decoding._common import filtered_logits
from jaxkv.sampling import SamplingConfig
from test_decoding_reference import full_logits, greedy_reference, make_model, perturbed

V = 64
PROMPTS = [[5, 9, 2, 7, 1, 3], [8, 4, 6], [10, 11, 12, 13, 14]]
IDS = np.array([p + [0] * (6 - len(p)) for p in PROMPTS])
LENGTHS = np.array([len(p) for p in PROMPTS])
N = 20


@pytest.fixture(scope="module")
def target():
    return make_model(seed=0, vocab_size=V, num_layers=1)


@pytest.fixture(scope="module")
def reference(target):
    return np.array(greedy_reference(target, PROMPTS, N))


@pytest.mark.parametrize("draft_kind, k", [("close", 3), ("close", 1), ("unrelated", 3), ("same", 3)])
def test_greedy_equals_target_greedy(target, reference, draft_kind, k):
    draft = {
        "close": lambda: perturbed(target, seed=1, noise=0.1),
        "unrelated": lambda: make_model(seed=5, vocab_size=V, num_layers=1),
        "same": lambda: target,
    }[draft_kind]()
    out = speculative_generate(target, draft, IDS, N, num_draft_tokens=k, prompt_lengths=LENGTHS)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)
    accepted, rounds = np.asarray(out.accepted), np.asarray(out.rounds)
    # Every round emits accepted + 1 tokens; the first token comes from the prefill.
    assert (rounds + accepted >= N - 1).all() and (rounds + accepted <= N - 1 + k).all()
    if draft_kind == "same":
        assert (accepted >= (N - 1) // (k + 1) * k).all() and out.acceptance_rate > 0.9
    if draft_kind == "close" and k == 3:
        # Rows accepted different counts, so per-row crop left them at different lengths.
        assert len(set(accepted.tolist())) > 1 and 0 < out.acceptance_rate < 1


def test_prompts_of_another_width_in_the_bucket_reuse_the_program(target, reference):
    """Each prompt width compiled a search of its own (review 81); widths 6 and 7 share the
    bucket of 16, and the tokens are those of the unpadded call."""
    from jaxkv.decoding.speculative import _speculative

    out = speculative_generate(target, target, IDS, N, num_draft_tokens=3, prompt_lengths=LENGTHS)
    before = _speculative._cache_size()
    wider = np.pad(IDS, ((0, 0), (0, 1)), constant_values=3)
    again = speculative_generate(target, target, wider, N, num_draft_tokens=3, prompt_lengths=LENGTHS)
    assert _speculative._cache_size() == before
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
    np.testing.assert_array_equal(np.asarray(out.tokens), reference)


def test_hybrid_target_with_a_draft_without_sliding_layers():
    """cache_kind="hybrid" is the target's; a draft with no sliding layer takes the static
    kind (a hybrid cache of it was refused). Greedy tokens equal the uncached reference."""
    sliding = make_model(seed=2, vocab_size=V, num_layers=2, sliding_window=3, sliding_layers=(True, False))
    draft = make_model(seed=5, vocab_size=V, num_layers=1)
    out = speculative_generate(sliding, draft, IDS, 8, num_draft_tokens=3, prompt_lengths=LENGTHS, cache_kind="hybrid")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.array(greedy_reference(sliding, PROMPTS, 8)))
    # The other way round the target cannot take the kind: the error says it is the target
    # (it read as if the sliding draft lacked sliding layers; review 71).
    with pytest.raises(ValueError, match=r"^speculative_generate: the target model: kind='hybrid' needs a config"):
        speculative_generate(draft, sliding, IDS, 8, num_draft_tokens=3, prompt_lengths=LENGTHS, cache_kind="hybrid")


def test_greedy_with_penalties_equals_penalised_generate(target, reference):
    """Every draft token and every verified position is penalised with its own prefix's history."""
    from jaxkv.generation import generate

    config = SamplingConfig(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    want = np.asarray(generate(target, IDS, N, prompt_lengths=LENGTHS, sampling=config).tokens)
    assert (want != reference).any(), "the penalties changed nothing: the test would not see them"
    out = speculative_generate(target, perturbed(target, seed=1, noise=0.1), IDS, N, num_draft_tokens=3,
                               prompt_lengths=LENGTHS, config=config)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert 0 < out.acceptance_rate < 1


def test_errors(target):
    other = make_model(vocab_size=32, num_layers=1)
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_generate(target, other, IDS, 4)
    with pytest.raises(ValueError, match="needs a key"):
        speculative_generate(target, target, IDS, 4, config=SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="num_draft_tokens must be a Python int >= 1"):
        speculative_generate(target, target, IDS, 4, num_draft_tokens=0)
    sampled = SamplingConfig(temperature=1.0)
    for bad in (0, np.array([0, 1], np.int32)):  # key=0 used to fail with AttributeError
        with pytest.raises(TypeError, match="speculative_generate: key must be a typed PRNG key from jax.random.key"):
            speculative_generate(target, target, IDS, 4, config=sampled, key=bad)
    with pytest.raises(ValueError, match=r"key must be one PRNG key \(shape \(\)\), got shape \[2\]"):
        speculative_generate(target, target, IDS, 4, config=sampled, key=jax.random.split(jax.random.key(0)))


# ------------------------------------------------------------------ sampling statistics

SMALL_V = 4
SAMPLES = 24_000
PROMPT = [1, 2, 3]


def _penalised(logits, seqs, config):
    """SamplingConfig's penalties in NumPy: at position t, the history is the prompt and the
    generated tokens up to t (HF's repetition rule over both, presence / frequency over the
    generated ones)."""
    x = np.array(logits, np.float64)
    p = len(PROMPT)
    for s, seq in enumerate(seqs):
        for t in range(p - 1, len(seq)):
            generated = list(seq[p : t + 1])
            for v in set(PROMPT) | set(generated):
                r = config.repetition_penalty
                x[s, t, v] = x[s, t, v] / r if x[s, t, v] > 0 else x[s, t, v] * r
            for v in set(generated):
                x[s, t, v] -= config.frequency_penalty * generated.count(v) + config.presence_penalty
    return jnp.asarray(x, jnp.float32)


def _exact_joint(model, config, length):
    """Exact probability of every continuation of PROMPT of ``length`` tokens: [V] * length."""
    seqs = np.array([PROMPT + list(s) for s in np.ndindex(*(SMALL_V,) * length)], np.int32)
    logits = full_logits(model, jnp.asarray(seqs))
    if config.needs_history:
        logits = _penalised(logits, seqs, config)
    probs = np.asarray(jax.nn.softmax(filtered_logits(logits, config), -1), np.float64)
    p = len(PROMPT)
    joint = np.ones(len(seqs))
    for i in range(length):
        joint *= probs[np.arange(len(seqs)), p - 1 + i, seqs[:, p + i]]
    return joint.reshape((SMALL_V,) * length)


@pytest.mark.slow
@pytest.mark.parametrize("penalties", [{}, dict(repetition_penalty=1.8, presence_penalty=0.4, frequency_penalty=0.3)],
                         ids=["plain", "penalised"])
def test_sampling_preserves_the_target_distribution(penalties):
    """Tokens 2..4 of many independent rows vs the target's exact distribution.

    Token 1 comes from the target's prefill; with k = 2 the first verification round gives
    tokens 2 and 3 (accepted drafts or a residual resample at either position) and, when
    both drafts are accepted, token 4 as the bonus; otherwise token 4 comes from a second
    round. Top-k = 3 of V = 4 makes both models' filtered supports differ.

    The statistic sums over all outcomes of (token 2, 3, 4); under the target distribution
    it is chi-square with (outcomes - 1) degrees of freedom (every expected count is well
    above 5 at this sample size), and the test fails only beyond its 1 - 1e-6 quantile.
    The draft's own distribution sits orders of magnitude above that bound, so a rule that
    simply kept the drafts would be caught. With penalties, the target distribution is the
    penalised one (NumPy, ``_penalised``), and the unpenalised one is also far outside the
    bound, so a history that reached neither the drafts nor the verified positions would
    be caught too.
    """
    config, k, n = SamplingConfig(temperature=1.0, top_k=3, **penalties), 2, 4
    target = make_model(seed=0, vocab_size=SMALL_V, num_layers=1, scale=0.5)
    draft = make_model(seed=3, vocab_size=SMALL_V, num_layers=1, scale=0.5)
    ids = np.tile(np.array(PROMPT, np.int32), (SAMPLES, 1))
    out = speculative_generate(target, draft, ids, n, num_draft_tokens=k, config=config, key=jax.random.key(7))
    tokens = np.asarray(out.tokens)[:, 1:]
    counts = np.zeros((SMALL_V,) * 3)
    np.add.at(counts, tuple(tokens.T), 1)

    expected = _exact_joint(target, config, n).sum(axis=0) * SAMPLES
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the filtered support"
    assert expected[support].min() > 5
    dof = support.sum() - 1
    bound = stats.chi2.ppf(1 - 1e-6, dof)
    chi2 = (((counts - expected) ** 2)[support] / expected[support]).sum()
    assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f} with {dof} dof"

    draft_expected = _exact_joint(draft, config, n).sum(axis=0) * SAMPLES
    both = support & (draft_expected > 0)
    draft_chi2 = (((draft_expected - expected) ** 2)[both] / expected[both]).sum()
    assert draft_chi2 > 10 * bound
    assert 0.1 < out.acceptance_rate < 0.95
    if penalties:
        plain = _exact_joint(target, SamplingConfig(temperature=1.0, top_k=3), n).sum(axis=0) * SAMPLES
        both = support & (plain > 0)
        assert (((plain - expected) ** 2)[both] / expected[both]).sum() > 10 * bound
    print(f"chi2 {chi2:.1f} (bound {bound:.1f}, {dof} dof); draft's distribution would give {draft_chi2:.0f}")

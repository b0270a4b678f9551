"""Beam search: brute-force enumeration on a tiny vocabulary, and transformers parity."""

import itertools
import tempfile

import numpy as np
import pytest

from jaxkv.caches import StaticCache
from jaxkv.decoding import beam_search
from test_decoding_reference import make_model, next_token_log_probs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv.models import from_pretrained  # noqa: E402

# --------------------------------------------------------------------------- brute force

V, N, EOS = 4, 3, 0
# With EOS = one of V tokens, step t < N - 1 has (V - 1)^t unfinished prefixes, each with V
# continuations. K = (V - 1)^(N - 2) * V beams hold every one of them, so nothing is pruned
# before the last step and beam search must return the true top-K of all hypotheses.
K = (V - 1) ** (N - 2) * V


def all_hypotheses():
    """Every sequence beam search may finish: ends at its first EOS, or has length N."""
    out = []
    for length in range(1, N + 1):
        for seq in itertools.product(range(V), repeat=length):
            if EOS in seq[:-1]:
                continue
            if length < N and seq[-1] != EOS:
                continue
            out.append(seq)
    return out


@pytest.fixture(scope="module")
def tiny_vocab_model():
    return make_model(seed=2, vocab_size=V, num_layers=1, scale=0.5)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.5])
def test_equals_brute_force_enumeration(tiny_vocab_model, length_penalty):
    prompt = [1, 3, 2, 2]
    hyps = all_hypotheses()
    # Sum of log-probs of each hypothesis, from cache-free forwards of the padded sequences.
    padded = [h + (1,) * (N - len(h)) for h in hyps]
    log_probs = next_token_log_probs(tiny_vocab_model, prompt, padded)
    sums = np.array([log_probs[m, : len(h)].sum() for m, h in enumerate(hyps)])
    lengths = np.array([len(h) for h in hyps])
    scores = sums / lengths.astype(np.float64) ** length_penalty
    order = np.argsort(-scores, kind="stable")[:K]
    if length_penalty <= 1.0:
        assert len(set(lengths[order])) > 1, "the test needs EOS-ended and full-length hypotheses in the top K"

    out = beam_search(
        tiny_vocab_model, np.array([prompt]), N, num_beams=K, num_return_sequences=K,
        length_penalty=length_penalty, early_stopping="never", eos_token_id=EOS, pad_token_id=V - 1,
    )
    got_lengths = np.asarray(out.lengths[0])
    got = [tuple(int(x) for x in np.asarray(out.sequences[0, r, : got_lengths[r]])) for r in range(K)]
    assert got == [hyps[i] for i in order]
    np.testing.assert_array_equal(got_lengths, lengths[order])
    np.testing.assert_allclose(np.asarray(out.scores[0]), scores[order], rtol=1e-5, atol=1e-5)
    # Padding after each hypothesis.
    seqs = np.asarray(out.sequences[0])
    for r in range(K):
        assert (seqs[r, got_lengths[r] :] == V - 1).all()


def test_errors():
    model = make_model(num_layers=1)
    ids = np.array([[1, 2]])
    with pytest.raises(ValueError, match="num_return_sequences"):
        beam_search(model, ids, 4, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(model, ids, 4, num_beams=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="eos_token_id"):
        beam_search(model, ids, 4, num_beams=2, eos_token_id=10_000)
    with pytest.raises(ValueError, match="num_beams"):
        beam_search(model, ids, 4, num_beams=0)
    for bad in (float("nan"), float("inf"), -float("inf"), True, "1.0"):
        with pytest.raises(ValueError, match="length_penalty must be a finite real number"):
            beam_search(model, ids, 4, num_beams=2, length_penalty=bad)


# ------------------------------------------------------------------ transformers parity

HF_VOCAB, HF_N, HF_BEAMS = 32, 10, 3
HF_COMMON = dict(
    vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1,
    # Wide init: peaked logits, so score ties (where torch/XLA top-k may order differently) do not occur.
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
HF_FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(HF_FAMILIES))
def hf_pair(request):
    model_cls, config_cls, extra = HF_FAMILIES[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**HF_COMMON, **extra)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        loaded = from_pretrained(directory)
    ids = np.random.default_rng(0).integers(1, HF_VOCAB, size=(2, 5))
    # An EOS that beam search actually meets: the most common early token of a run without one.
    with torch.no_grad():
        plain = hf.generate(torch.tensor(ids), max_new_tokens=HF_N, do_sample=False, num_beams=HF_BEAMS,
                            num_return_sequences=HF_BEAMS).numpy()[:, 5:]
    values, counts = np.unique(plain[:, 1:6], return_counts=True)
    eos = int(values[np.argmax(counts)])
    return hf, loaded.model, ids, eos


def _hf_beams(hf, ids, eos, **kw):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), max_new_tokens=HF_N,
            do_sample=False, num_beams=HF_BEAMS, num_return_sequences=HF_BEAMS, eos_token_id=eos, pad_token_id=eos, **kw,
        )
    return out.numpy()[:, ids.shape[1] :]


@pytest.mark.parametrize(
    "early_stopping, length_penalty",
    # "never" with a positive penalty: the bound on unfinished beams uses the longest possible length
    [(False, 1.0), (True, 2.0), ("never", -0.5), (False, -0.5), ("never", 1.0), ("never", 2.0)],
)
def test_matches_transformers_generate(hf_pair, early_stopping, length_penalty):
    hf, model, ids, eos = hf_pair
    want = _hf_beams(hf, ids, eos, early_stopping=early_stopping, length_penalty=length_penalty)
    out = beam_search(
        model, ids, HF_N, num_beams=HF_BEAMS, num_return_sequences=HF_BEAMS, eos_token_id=eos,
        early_stopping=early_stopping, length_penalty=length_penalty,
    )
    got = np.asarray(out.sequences).reshape(2 * HF_BEAMS, HF_N)
    lengths = np.asarray(out.lengths).reshape(-1)
    # transformers trims its output to the longest returned hypothesis and pads with EOS.
    assert lengths.max() == want.shape[1]
    np.testing.assert_array_equal(got[:, : want.shape[1]], want)
    for r, n in enumerate(lengths):
        assert (want[r, n:] == eos).all() and (n == HF_N or want[r, n - 1] == eos)


def test_repetition_penalty_matches_transformers_generate(hf_pair):
    hf, model, ids, eos = hf_pair
    want = _hf_beams(hf, ids, eos, repetition_penalty=1.3)
    assert want.shape != _hf_beams(hf, ids, eos).shape or (want != _hf_beams(hf, ids, eos)).any(), (
        "the penalty changed nothing in transformers: the test would not see it")
    out = beam_search(model, ids, HF_N, num_beams=HF_BEAMS, num_return_sequences=HF_BEAMS, eos_token_id=eos,
                      repetition_penalty=1.3)
    got = np.asarray(out.sequences).reshape(2 * HF_BEAMS, HF_N)
    np.testing.assert_array_equal(got[:, : want.shape[1]], want)
    assert np.asarray(out.lengths).max() == want.shape[1]


def test_chosen_eos_ends_hypotheses_early(hf_pair):
    """Guards the parity test: with this EOS, some hypotheses are shorter than N."""
    _, model, ids, eos = hf_pair
    out = beam_search(model, ids, HF_N, num_beams=HF_BEAMS, num_return_sequences=HF_BEAMS, eos_token_id=eos,
                      length_penalty=-0.5)
    assert (np.asarray(out.lengths) < HF_N).any()


def test_ragged_batch_matches_each_prompt_alone_in_transformers(hf_pair, monkeypatch):
    hf, model, _, eos = hf_pair
    seen = []
    original = StaticCache.reorder_cache

    def spy(self, beam_idx):
        seen.append((type(beam_idx).__name__, tuple(beam_idx.shape)))
        return original(self, beam_idx)

    monkeypatch.setattr(StaticCache, "reorder_cache", spy)
    rng = np.random.default_rng(3)
    lengths = np.array([6, 2, 4])
    ids = rng.integers(1, HF_VOCAB, size=(3, 6))
    out = beam_search(
        model, ids, HF_N, num_beams=HF_BEAMS, num_return_sequences=HF_BEAMS, eos_token_id=eos, prompt_lengths=lengths,
    )
    # This shape is new, so the search was traced: reorder_cache ran once, in the
    # while_loop body, on a traced [B * K] row index.
    assert seen == [("DynamicJaxprTracer", (3 * HF_BEAMS,))]
    for b, n in enumerate(lengths):
        want = _hf_beams(hf, ids[b : b + 1, :n], eos)
        np.testing.assert_array_equal(np.asarray(out.sequences[b])[:, : want.shape[1]], want)


def test_compiles_once_for_new_prompts_penalties_and_stopping_modes(hf_pair):
    _, model, ids, eos = hf_pair
    from jaxkv.decoding.beam import _beam_search

    kw = dict(num_beams=HF_BEAMS, eos_token_id=eos)
    beam_search(model, ids, HF_N, length_penalty=1.0, **kw)
    before = _beam_search._cache_size()
    beam_search(model, ids[::-1], HF_N, length_penalty=0.3, early_stopping="never", **kw)
    beam_search(model, ids, HF_N, length_penalty=-2.0, early_stopping=True, **kw)
    # Another prompt width in the same bucket, another stop and pad id: each compiled a search
    # of its own (review 81).
    beam_search(model, ids[:, :-1], HF_N, num_beams=HF_BEAMS, eos_token_id=(eos + 1) % 7, pad_token_id=2)
    assert _beam_search._cache_size() == before


@pytest.mark.parametrize("early_stopping", ["never", False])
def test_one_beam_is_transformers_greedy_whatever_early_stopping_says(hf_pair, early_stopping):
    """transformers runs greedy search for num_beams=1 (early_stopping ignored): the first EOS
    ends the sequence. A one-beam search with "never" and a positive length penalty went on
    past that EOS with its second-best token."""
    hf, model, ids, _ = hf_pair
    with torch.no_grad():
        plain = hf.generate(torch.tensor(ids), max_new_tokens=HF_N, do_sample=False).numpy()[:, ids.shape[1]:]
    checked = 0
    for row in range(len(ids)):
        for pos in (1, 2, 3):
            eos = int(plain[row, pos])
            if eos in plain[row, :pos]:
                continue
            with torch.no_grad():
                want = hf.generate(torch.tensor(ids[row:row + 1]), max_new_tokens=HF_N, do_sample=False, num_beams=1,
                                   eos_token_id=eos, pad_token_id=eos, early_stopping=early_stopping,
                                   length_penalty=1.0).numpy()[0, ids.shape[1]:]
            out = beam_search(model, ids[row:row + 1], HF_N, num_beams=1, eos_token_id=eos,
                              early_stopping=early_stopping, length_penalty=1.0)
            assert int(out.lengths[0, 0]) == len(want) == pos + 1
            np.testing.assert_array_equal(np.asarray(out.sequences)[0, 0, : len(want)], want)
            checked += 1
    assert checked >= 2


def test_a_one_token_vocabulary_is_a_named_error():
    """Each step keeps 2 * num_beams candidates of num_beams * V: with V = 1 that was lax.top_k's
    "k argument to top_k must be no larger than size along axis" (review 56)."""
    from flax import nnx

    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab_size=1), rngs=nnx.Rngs(0))
    for beams in (1, 2):
        with pytest.raises(ValueError, match=r"keeps 2 \* num_beams = .* vocabulary of 1 token"):
            beam_search(model, np.zeros((2, 3), np.int32), 3, num_beams=beams)


def test_a_beam_whose_logits_turn_nan_mid_sequence_holds_the_nan_token():
    """A generated token whose embedding is NaN (corrupt weights): generate emits NAN_TOKEN
    from there on; beam search kept argmax-of-NaN ids (0s) in such a hypothesis, marked only
    by its NaN score (review 76). Every NaN-scored hypothesis now holds -1 from the step its
    logits turned NaN, and no finite-scored one holds -1."""
    import jax.numpy as jnp

    from jaxkv.generation import NAN_TOKEN, generate

    model = make_model(seed=4, num_layers=1)
    ids = np.array([[5, 6, 7, 8, 9]], np.int32)
    poisoned = int(np.asarray(generate(model, ids, 2).tokens)[0, 1])  # the second greedy token
    emb = model.embed_tokens.embedding
    emb.set_value(emb.get_value().at[poisoned].set(jnp.nan))
    assert list(np.asarray(generate(model, ids, 4).tokens)[0, 2:]) == [NAN_TOKEN] * 2
    out = beam_search(model, ids, 5, num_beams=2)
    scores, lengths = np.asarray(out.scores)[0], np.asarray(out.lengths)[0]
    assert np.isnan(scores).any()
    for seq, score, length in zip(np.asarray(out.sequences)[0], scores, lengths):
        held = list(seq[:length])
        if np.isnan(score):
            first = held.index(NAN_TOKEN)  # a ValueError if the hypothesis holds no -1
            assert held[first - 1] == poisoned and held[first:] == [NAN_TOKEN] * (length - first)
        else:
            assert NAN_TOKEN not in held and poisoned not in held[:-1]  # a last token's logits go unused

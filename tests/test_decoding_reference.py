"""Cache-free references for the decoding tests, and the tiny models they run on.

Every reference here runs the model *without* a cache: a full causal forward over a
fixed-width token buffer, reading the logits at each row's last real position. Tokens past
that position cannot influence it (causal attention), so one compiled program of width
``WIDTH`` serves every prompt and step. The algorithms under test use the cache and its
operations; these references use neither.
"""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models import Llama, LlamaConfig
from jaxkv.sampling import sample

WIDTH = 48


def make_model(seed=0, scale=1.0, scan_layers=None, **overrides):
    """A tiny random Llama with norms moved off their all-ones init.

    ``scale`` multiplies the final norm weight: > 1 gives peakier next-token
    distributions (clear greedy margins), < 1 flatter ones (interesting sampling).
    ``scan_layers`` picks the layer layout (None: the backend's default); the perturbation
    below draws per parameter leaf, so each layout gives its own weights from one seed:
    fixtures that rely on a seed's greedy margins pin it.
    """
    model = Llama(LlamaConfig.tiny(**overrides), rngs=nnx.Rngs(seed), scan_layers=scan_layers)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "weight" in path or "bias" in path:
            value = var.get_value()
            var.set_value(value + jnp.asarray(0.3 * rng.normal(size=value.shape), value.dtype))
    model.norm.weight.set_value(model.norm.weight.get_value() * scale)
    return model


def perturbed(model, seed, noise):
    """A copy of ``model`` with every parameter moved by ``noise`` times its own spread."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(state)
    leaves = [
        x + jnp.asarray(noise * (float(jnp.std(x)) or 1.0) * rng.normal(size=x.shape), x.dtype) for x in leaves
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@nnx.jit
def full_logits(model, tokens):  # [R, W] -> [R, W, V], no cache
    return model(tokens, None)[0].astype(jnp.float32)


def _buffer(prompts, width):
    buf = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        buf[r, : len(p)] = p
    return buf


def greedy_reference(model, prompts, max_new_tokens, eos_token_id=None, width=WIDTH):
    """Greedy continuation of each prompt (a list of id lists), stopping after its EOS."""
    buf = _buffer(prompts, width)
    lengths = np.array([len(p) for p in prompts])
    outs = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        logits = np.asarray(full_logits(model, jnp.asarray(buf)))
        for r, out in enumerate(outs):
            if len(out) == max_new_tokens or (out and out[-1] == eos_token_id):
                continue
            token = int(np.argmax(logits[r, lengths[r] - 1]))
            out.append(token)
            buf[r, lengths[r]] = token
            lengths[r] += 1
    return outs


def sample_reference(model, prompt, max_new_tokens, key, config, width=WIDTH):
    """One sample: token ``t`` drawn with ``fold_in(key, t)`` from the cache-free logits."""
    buf = _buffer([prompt], width)
    n = len(prompt)
    out = []
    for t in range(max_new_tokens):
        logits = full_logits(model, jnp.asarray(buf))[:, n - 1]
        token = int(sample(logits, jax.random.fold_in(key, t), config)[0])
        out.append(token)
        buf[0, n] = token
        n += 1
    return out


def next_token_log_probs(model, prompt, continuations, width=WIDTH):
    """``log p(c[i] | prompt + c[:i])`` for each continuation: float64 [M, len(c)]."""
    seqs = [list(prompt) + list(c) for c in continuations]
    logits = np.asarray(full_logits(model, jnp.asarray(_buffer(seqs, width))), np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    p = len(prompt)
    return np.array([[log_probs[m, p - 1 + i, tok] for i, tok in enumerate(c)] for m, c in enumerate(continuations)])


def test_reference_logits_do_not_depend_on_buffer_width_or_padding():
    model = make_model(num_layers=1)
    prompt = [3, 1, 4, 1, 5, 9]
    wide = np.asarray(full_logits(model, jnp.asarray(_buffer([prompt], WIDTH))))[0, : len(prompt)]
    junk = _buffer([prompt], WIDTH)
    junk[0, len(prompt) :] = 77
    padded = np.asarray(full_logits(model, jnp.asarray(junk)))[0, : len(prompt)]
    exact = np.asarray(full_logits(model, jnp.asarray([prompt], jnp.int32)))[0]
    np.testing.assert_allclose(wide, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(wide, padded)


def clear_greedy_reference(model, prompts, max_new_tokens, margin):
    """``greedy_reference``, asserting every greedy choice wins by at least ``margin`` in
    the logits, so a cached run whose logits differ slightly (int8 codes, other chunkings)
    must still pick the same tokens."""
    tokens = greedy_reference(model, prompts, max_new_tokens)
    for prompt, row in zip(prompts, tokens):
        logits = np.asarray(full_logits(model, np.array([prompt + row], np.int32)))[0, len(prompt) - 1 : -1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() >= margin
    return tokens

"""Parallel sampling: ``num_return_sequences`` samples per prompt from one prefill.

The prompts are run through the model once (``[B, P]`` tokens); the prefilled cache is then
fanned out with ``batch_repeat_interleave(n)`` so sample ``j`` of prompt ``b`` lives in row
``b * n + j``, and a ``lax.scan`` of sampling steps decodes all ``B * n`` rows together.
Compared with running the ``n`` samples as separate prompts, the prompt's forward pass
(usually the expensive part for long prompts) is paid once instead of ``n`` times.

Randomness is per row: sample ``(b, j)`` draws its ``t``-th token with
``jax.random.fold_in(keys[b, j], t)``, so it does not depend on the batch it runs in:
``num_return_sequences=n`` with ``keys`` gives exactly the samples of ``n`` separate calls
with ``num_return_sequences=1`` and ``keys[:, j:j+1]``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv._checks import check_model, model_vocab_size
from jaxkv.decoding._common import check_positive_int, check_token_id, forward, logits_at
from jaxkv.generation import NO_STOP, check_prompts, init_model_cache, pad_to_bucket, poison_bad_lengths, select_token
from jaxkv.sampling import SamplingConfig, init_history, record_tokens

__all__ = ["sample_keys", "sample_n"]


def sample_keys(key: jax.Array, batch_size: int, num_return_sequences: int) -> jax.Array:
    """The per-sample keys ``sample_n`` derives from one key: ``[B, n]`` typed keys."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return jax.random.split(key, batch_size * num_return_sequences).reshape(batch_size, num_return_sequences)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "config", "cache_dtype", "cache_kind"))
def _sample_n(graphdef, state, input_ids, prompt_lengths, keys, eos_token_id, pad_token_id, *, max_new_tokens, config,
              cache_dtype, cache_kind):
    model = nnx.merge(graphdef, state)
    batch, prompt_len = input_ids.shape
    n = keys.shape[1]
    input_ids, prompt_lengths = poison_bad_lengths(input_ids, prompt_lengths)  # traced bad lengths: NAN_TOKEN rows
    # The last sampled token is never fed back, so it needs no slot.
    cache = init_model_cache(model, batch, prompt_len + max_new_tokens - 1, cache_dtype, cache_kind, fanout=n)
    logits, cache = forward(graphdef, state, input_ids, cache, prompt_lengths)
    logits = jnp.repeat(logits_at(logits, prompt_lengths - 1), n, axis=0)  # [B*n, V]
    cache = cache.batch_repeat_interleave(n)
    keys = keys.reshape(-1)
    history = init_history(config, jnp.repeat(input_ids, n, axis=0), jnp.repeat(prompt_lengths, n), logits.shape[-1])
    first = select_token(logits, keys, 0, config, history)
    history = record_tokens(history, first)
    done = first == eos_token_id  # a traced id (NO_STOP: none), as the pad: any value reuses the program

    def step(carry, t):
        tokens, done, cache, history = carry
        logits, cache = forward(graphdef, state, tokens[:, None], cache)
        nxt = select_token(logits[:, 0], keys, t, config, history)
        nxt = jnp.where(done, pad_token_id, nxt)
        history = record_tokens(history, nxt, ~done)
        done = done | (nxt == eos_token_id)
        return (nxt, done, cache, history), nxt

    steps = jnp.arange(1, max_new_tokens, dtype=jnp.int32)
    _, rest = jax.lax.scan(step, (first, done, cache, history), steps)  # [N-1, B*n]
    tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
    return tokens.reshape(batch, n, max_new_tokens)


def sample_n(
    model: nnx.Module,
    input_ids: Any,  # [B, P] int
    max_new_tokens: int,
    *,
    num_return_sequences: int,
    key: jax.Array | None = None,
    keys: jax.Array | None = None,  # [B, n] typed keys
    config: SamplingConfig = SamplingConfig(temperature=1.0),
    prompt_lengths: Any = None,  # [B] int
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    cache_dtype: Any = None,
    cache_kind: str = "static",
    bucket: bool = True,
) -> jax.Array:  # [B, n, N] int32
    """Draws ``num_return_sequences`` samples per prompt, prefilling each prompt once.

    Args:
        model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
        input_ids: [B, P] prompts, right-padded when ragged.
        max_new_tokens: N >= 1 tokens per sample.
        num_return_sequences: n >= 1 samples per prompt.
        key: one PRNG key; the per-sample keys are ``sample_keys(key, B, n)``.
        keys: or the per-sample keys themselves, [B, n] (exactly one of key/keys).
        config: temperature / top-k / top-p / min-p and the penalties
            (:class:`jaxkv.sampling.SamplingConfig`); each sample's penalties count its
            prompt and its own tokens.
        prompt_lengths: [B] real prompt lengths, in ``[1, P]``; default P.
        eos_token_id: if set, a sample stops at its EOS (kept) and is padded after it.
        pad_token_id: the padding token after an EOS.
        cache_dtype: key/value storage dtype; default the model's parameter dtype.
        cache_kind: ``"static"`` (default), or another kind the model's ``init_cache`` offers
            (``Llama``: ``"hybrid"``, ``"quantized"``); every algorithm takes every kind.
        bucket: pad the prompt axis to the next power of two (>= 16), as ``generate`` does,
            so that prompts of nearby lengths share one compiled program (the EOS and pad
            ids are traced: any value shares it too).

    Returns:
        int32 [B, n, N]: ``out[b, j]`` is sample ``j`` of prompt ``b``.

    Raises:
        ValueError: bad sizes, keys, token ids (in the prompts: outside ``[0, V)``) or prompts.
        TypeError: ``model`` not an ``nnx.Module`` (a ``from_pretrained`` bundle: pass
            ``loaded.model``).

    Example:
        >>> out = sample_n(model, jnp.array([[5, 6, 7]]), 32, num_return_sequences=8,  # doctest: +SKIP
        ...                key=jax.random.key(0), config=SamplingConfig(temperature=0.8, top_p=0.95))
        >>> out.shape                                                                   # doctest: +SKIP
        (1, 8, 32)
    """
    who = "sample_n"
    check_model(model, who)
    input_ids, prompt_lengths = check_prompts(input_ids, prompt_lengths, who, vocab_size=model_vocab_size(model))
    n_tokens = check_positive_int(max_new_tokens, "max_new_tokens", who)
    n = check_positive_int(num_return_sequences, "num_return_sequences", who)
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"{who}: config must be a jaxkv.sampling.SamplingConfig, got {type(config).__name__}")
    batch = input_ids.shape[0]
    if (key is None) == (keys is None):
        raise ValueError(f"{who}: pass exactly one of key (one PRNG key) or keys ([batch, n] keys)")
    for name, k in (("key", key), ("keys", keys)):
        if k is not None and not hasattr(k, "dtype"):  # 0 or a list: not a key (raw uint32 key data is fine)
            raise TypeError(f"{who}: {name} must be a JAX PRNG key (jax.random.key(seed) or a split of one), got "
                            f"{type(k).__name__} {k!r}")
    if keys is None:
        typed = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
        if typed.shape != ():
            raise ValueError(
                f"{who}: key must be one PRNG key (jax.random.key(seed), or one raw key), got a batch of shape "
                f"{list(typed.shape)}; "
                f"for one key per sample pass keys=[batch, num_return_sequences] (e.g. sample_keys(key, {batch}, {n}))"
            )
        keys = sample_keys(key, batch, n)
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{who}: keys must be typed PRNG keys (jax.random.key / split), got dtype {keys.dtype}")
    if keys.shape != (batch, n):
        raise ValueError(f"{who}: keys must have shape [batch, num_return_sequences] = [{batch}, {n}], got {list(keys.shape)}")
    vocab = model_vocab_size(model)  # None: the ids go unchecked
    eos = check_token_id(eos_token_id, "eos_token_id", vocab, who)
    pad = check_token_id(pad_token_id, "pad_token_id", vocab, who, allow_none=False)  # None broke jnp.where
    graphdef, state = nnx.split(model)
    return _sample_n(
        graphdef,
        state,
        pad_to_bucket(input_ids, pad, bucket),
        prompt_lengths,
        keys,
        jnp.int32(NO_STOP if eos is None else eos),
        jnp.int32(pad),
        max_new_tokens=n_tokens,
        config=config,
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
        cache_kind=cache_kind,
    )

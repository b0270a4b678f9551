"""Chunked prefill: a long prompt enters the cache in fixed-size chunks.

One-shot prefill of a P-token prompt compiles one program per prompt length and holds
activations for all P tokens at once (the attention scores alone are ``[B, Hq, P, S]``).
Here the prompt is cut into chunks of C tokens and each chunk is one call of the same
jitted step, ``[B, C]`` tokens in, cache donated: the step compiles once per
``(B, C, capacity)`` whatever the prompt length, and its activations are bounded by the
chunk (``[B, Hq, C, S]`` scores), not by the prompt.

Ragged prompts need no padding tricks: each chunk passes ``num_new[b]`` = the number of row
``b``'s prompt tokens inside the chunk (0 once its prompt is done), so a row's last chunk
stores only its real tokens, and its last-token logits are picked from the chunk that holds
its last prompt token. Each chunk appends at every row's current length, so the cache
may already hold a prefix (multi-turn continuation).

The result equals one-shot prefill: the same cache contents and the same logits, up to
float rounding of different matmul shapes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_model, model_vocab_size
from jaxkv.caches import DynamicCache, KVCache, check_cache
from jaxkv.decoding._common import check_positive_int, forward, free_slots, logits_at, logits_width
from jaxkv.generation import check_prompts

__all__ = ["chunked_prefill", "prefill_chunk"]


def prefill_chunk(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: KVCache,
    tokens: jax.Array,  # [B, C] int32
    num_new: jax.Array,  # [B] int32, in [0, C]
) -> tuple[jax.Array, jax.Array, KVCache]:  # (last [B, V], logits [B, C, V], cache)
    """One chunk: row ``b`` stores its first ``num_new[b]`` tokens; the others are padding.

    Returns each row's logits at its last stored token of this chunk (meaningless where
    ``num_new[b] == 0``), the logits of every chunk token, and the new cache. Unjitted;
    :func:`chunked_prefill` and the serving loop jit it.
    """
    logits, cache = forward(graphdef, state, tokens, cache, num_new)
    return logits_at(logits, num_new - 1), logits, cache


@partial(jax.jit, static_argnames=("graphdef", "return_logits"), donate_argnames=("cache",))
def _chunk_step(graphdef, state, cache, tokens, num_new, last, *, return_logits):
    chunk_last, logits, cache = prefill_chunk(graphdef, state, cache, tokens, num_new)
    # A row keeps the logits of the last chunk that still held prompt tokens.
    last = jnp.where((num_new > 0)[:, None], chunk_last, last)
    return last, (logits if return_logits else None), cache


def chunked_prefill(
    model: nnx.Module,
    input_ids: Any,  # [B, P] int
    cache: KVCache,
    *,
    chunk_size: int,
    prompt_lengths: Any = None,  # [B] int
    return_logits: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Prefills prompts chunk by chunk; the cache is donated (do not reuse the one passed).

    Args:
        model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
        input_ids: [B, P] prompts, right-padded when ragged.
        cache: a preallocated jaxkv cache of any kind (not a DynamicCache, whose rows share
            one length: a TypeError) for the model with room for the prompts; each row's
            prompt is appended at its current length.
        chunk_size: C, tokens per chunk (one compiled program per C).
        prompt_lengths: [B] real prompt length per row, in ``[1, P]``; default P.
        return_logits: also return the logits of every prompt token.

    Returns:
        ``(logits, cache)``: logits are ``[B, V]`` at each row's last prompt token, or with
        ``return_logits`` ``[B, P, V]`` at every prompt position (meaningless past a row's
        length); float32.

    Raises:
        ValueError: bad prompts (a token id outside ``[0, V)`` included) or chunk size, a
            cache of another batch size; eagerly, a prompt that overflows the cache.
        CacheError (a ValueError): a page pool that ran out of pages during the prefill (the
            cache passed in was donated: build a larger ``num_pages``).
        TypeError: ``model`` not an ``nnx.Module`` (a ``from_pretrained`` bundle: pass
            ``loaded.model``), or ``cache`` not a jaxkv cache.

    Example:
        >>> cache = model.init_cache(batch_size=1, max_length=4096)           # doctest: +SKIP
        >>> last, cache = chunked_prefill(model, ids, cache, chunk_size=256)  # doctest: +SKIP
        >>> first_token = last.argmax(-1)                                     # doctest: +SKIP
    """
    who = "chunked_prefill"
    check_model(model, who)
    input_ids, prompt_lengths = check_prompts(input_ids, prompt_lengths, who, vocab_size=model_vocab_size(model))
    chunk = check_positive_int(chunk_size, "chunk_size", who)
    if not isinstance(return_logits, (bool, np.bool_)):  # a static argument: "no" would mean True
        raise TypeError(f"{who}: return_logits must be True or False, got {return_logits!r}")
    return_logits = bool(return_logits)
    check_cache(cache, who)
    if isinstance(cache, DynamicCache):  # its rows share one length: no per-row counts, no padded last chunk
        raise TypeError(
            f"{who}: a DynamicCache cannot take chunks: each chunk is written with per-row token counts (the last "
            "one padded), and a DynamicCache's rows share one length. Use a preallocated cache "
            "(model.init_cache(batch_size, max_length)), or call the model on the whole prompt."
        )
    batch, prompt_len = input_ids.shape
    rows = getattr(cache, "batch_size", None)  # None: a DynamicCache, whose rows come with its first write
    if rows is not None and rows != batch:
        raise ValueError(f"{who}: input_ids has {batch} rows but the cache has {rows}; "
                         f"build the cache with batch_size={batch}")
    free = free_slots(cache)
    if free is not None and (np.asarray(prompt_lengths) > free).any():
        row = int(np.argmax(np.asarray(prompt_lengths) > free))
        raise ValueError(
            f"{who}: row {row}'s prompt of {int(prompt_lengths[row])} tokens does not fit: the cache has "
            f"{int(free[row])} free slots (max_length={cache.get_max_length()}); allocate a larger cache"
        )
    num_chunks = -(-prompt_len // chunk)
    padded = jnp.pad(input_ids, ((0, 0), (0, num_chunks * chunk - prompt_len)))
    graphdef, state = nnx.split(model)
    # [B, V] float32, whatever the model's V (a model without a config included)
    last = jnp.zeros((batch, logits_width(model)), jnp.float32)
    flags = getattr(cache, "flags", None)  # (a DynamicCache has none: its write below refuses num_new)
    flags_before = None if flags is None else np.asarray(flags)
    all_logits = []
    for i in range(num_chunks):
        start = i * chunk
        num_new = jnp.clip(prompt_lengths - start, 0, chunk).astype(jnp.int32)
        last, logits, cache = _chunk_step(
            graphdef, state, cache, padded[:, start : start + chunk], num_new, last, return_logits=return_logits
        )
        all_logits.append(logits)
    if flags_before is not None and (np.asarray(cache.flags) & ~flags_before).any():
        # a page pool that ran out (free_slots counts slots, not pages): the dropped tokens
        # would make every later logit wrong, so the new flag is an error here, as in the
        # serving loops
        cache.check()
    if return_logits:
        return jnp.concatenate(all_logits, axis=1)[:, :prompt_len], cache
    return last, cache

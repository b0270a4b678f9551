"""Greedy generation through a StaticCache, compiled as one program.

The loop is split into the pieces a sampler needs, so that sampling, stop tokens or a
``while_loop`` can replace one piece without touching the others:

* :func:`prefill` runs the (ragged) prompts through the model in one forward pass and
  picks each row's first new token from the logits at its last real prompt token;
* :func:`decode_step` feeds one token per row and picks the next;
* :func:`select_token` turns logits into tokens (greedy here);
* :func:`generate` allocates the cache and runs prefill plus a ``lax.scan`` of decode
  steps under one ``jax.jit``.

The model is any ``nnx.Module`` with ``init_cache(batch_size, max_length)`` and
``__call__(tokens [B, T], cache, num_new) -> (logits [B, T, V], cache)``, such as
:class:`jaxkv.models.Llama`. Inside jit it travels as ``nnx.split`` halves: the graph
definition (static, hashable) and the parameter state (a pytree).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.cache import StaticCache

__all__ = ["decode_step", "generate", "prefill", "select_token"]


def select_token(logits: jax.Array) -> jax.Array:  # [B, V] -> [B] int32
    """Greedy choice: the highest logit (the lowest id on exact ties, as ``torch.argmax``)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def prefill(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    input_ids: jax.Array,  # [B, P] int
    prompt_lengths: jax.Array,  # [B] int
    cache: StaticCache,
) -> tuple[jax.Array, StaticCache]:  # ([B] int32, cache)
    """Writes the prompts into ``cache`` and returns each row's first generated token.

    Row ``b``'s prompt is ``input_ids[b, :prompt_lengths[b]]``; the rest is padding that is
    neither stored nor attended to.
    """
    model = nnx.merge(graphdef, state)
    logits, cache = model(input_ids, cache, prompt_lengths)  # [B, P, V]
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    return select_token(last), cache


def decode_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,  # [B] int
    cache: StaticCache,
) -> tuple[jax.Array, StaticCache]:  # ([B] int32, cache)
    """Feeds one token per row and returns the next token of each row and the new cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens[:, None], cache)  # [B, 1, V]
    return select_token(logits[:, 0]), cache


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_dtype"))
def _generate(graphdef, state, input_ids, prompt_lengths, *, max_new_tokens, cache_dtype):
    model = nnx.merge(graphdef, state)
    # The last generated token is returned but never fed back, so it needs no slot.
    capacity = input_ids.shape[1] + max_new_tokens - 1
    cache = model.init_cache(input_ids.shape[0], capacity, dtype=cache_dtype)
    first, cache = prefill(graphdef, state, input_ids, prompt_lengths, cache)

    def step(carry, _):
        tokens, cache = carry
        tokens, cache = decode_step(graphdef, state, tokens, cache)
        return (tokens, cache), tokens

    _, rest = jax.lax.scan(step, (first, cache), length=max_new_tokens - 1)  # [N-1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(
    model: nnx.Module,
    input_ids: Any,  # [B, P] int
    max_new_tokens: int,
    *,
    prompt_lengths: Any = None,  # [B] int
    cache_dtype: Any = None,
) -> jax.Array:  # [B, max_new_tokens] int32
    """Greedy decoding of a batch of (possibly ragged) prompts.

    Prefill and every decode step run through a :class:`jaxkv.StaticCache` of capacity
    ``P + max_new_tokens - 1`` inside one compiled program; a second call with the same
    shapes compiles nothing.

    Args:
        model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
        input_ids: [B, P] prompt token ids. Ragged prompts are right-padded (no left padding):
            row ``b`` holds its prompt in ``input_ids[b, :prompt_lengths[b]]``.
        max_new_tokens: N >= 1, tokens to generate per row.
        prompt_lengths: [B] real prompt length of each row, in ``[1, P]``; default P for all.
        cache_dtype: key/value storage dtype; default the model's parameter dtype.

    Returns:
        int32 [B, N] generated tokens (the prompts are not included).

    Raises:
        ValueError: ``input_ids`` not 2-D or empty, ``max_new_tokens < 1``, or
            ``prompt_lengths`` of the wrong shape or outside ``[1, P]``.
        TypeError: non-integer ids or lengths.

    Example:
        >>> tokens = jaxkv.generate(model, jnp.array([[1, 2, 3], [4, 5, 0]]), 8,  # doctest: +SKIP
        ...                         prompt_lengths=jnp.array([3, 2]))
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must have shape [batch, prompt_len] with prompt_len >= 1, got {list(input_ids.shape)}; "
            "add a batch axis with input_ids[None]"
        )
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a Python int >= 1, got {max_new_tokens!r}")
    batch, prompt_len = input_ids.shape
    if prompt_lengths is None:
        prompt_lengths = jnp.full((batch,), prompt_len, jnp.int32)
    prompt_lengths = jnp.asarray(prompt_lengths)
    if prompt_lengths.shape != (batch,):
        raise ValueError(f"prompt_lengths must have shape [batch] = [{batch}], got {list(prompt_lengths.shape)}")
    if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
        raise TypeError(f"prompt_lengths must be integers, got dtype {prompt_lengths.dtype}")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        host = np.asarray(prompt_lengths)
        if ((host < 1) | (host > prompt_len)).any():
            row = int(np.argmax((host < 1) | (host > prompt_len)))
            raise ValueError(
                f"prompt_lengths[{row}] = {int(host[row])} is outside [1, {prompt_len}]: every row needs at least "
                "one prompt token and at most input_ids.shape[1]"
            )
    graphdef, state = nnx.split(model)
    dtype = None if cache_dtype is None else jnp.dtype(cache_dtype)
    return _generate(
        graphdef,
        state,
        input_ids.astype(jnp.int32),
        prompt_lengths.astype(jnp.int32),
        max_new_tokens=int(max_new_tokens),
        cache_dtype=dtype,
    )

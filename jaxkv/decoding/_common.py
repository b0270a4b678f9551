"""Pieces the decoding algorithms share: model forward inside jit, prompt checks, sampling.

Shape letters: B batch, T new tokens, P prompt length, V vocabulary, N new tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import model_vocab_size
from jaxkv.caches import KVCache
from jaxkv.caches._checks import _static_int
from jaxkv.sampling import SamplingConfig, apply_temperature, min_p_filter, top_k_filter, top_p_filter


def forward(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,  # [B, T] int32
    cache: KVCache,
    num_new: jax.Array | None = None,  # [B] int32
) -> tuple[jax.Array, KVCache]:  # (logits [B, T, V] float32, cache)
    """Runs the model (given as ``nnx.split`` halves) over ``tokens``; logits in float32."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache, num_new)
    return logits.astype(jnp.float32), cache


def logits_at(logits: jax.Array, index: jax.Array) -> jax.Array:  # [B, T, V], [B] -> [B, V]
    """Row ``b``'s logits at token ``index[b]`` (clipped into ``[0, T)``)."""
    index = jnp.clip(index, 0, logits.shape[1] - 1)
    return jnp.take_along_axis(logits, index[:, None, None], axis=1)[:, 0]


def filtered_logits(logits: jax.Array, config: SamplingConfig) -> jax.Array:  # [..., V] -> [..., V]
    """Temperature, then top-k, top-p, min-p: the distribution ``sampling.sample`` draws from.

    Excluded tokens get ``-inf``; ``softmax`` of the result is the sampling distribution.
    Greedy configs are not a distribution; callers handle them separately. Penalties come
    first, with the rows' history (:func:`jaxkv.sampling.apply_penalties`).
    """
    shape = logits.shape
    flat = apply_temperature(logits.reshape(-1, shape[-1]), config.temperature)
    if config.top_k:
        flat = top_k_filter(flat, config.top_k)
    if config.top_p is not None:
        flat = top_p_filter(flat, config.top_p)
    return min_p_filter(flat, config.min_p).reshape(shape)


def free_slots(cache: Any) -> np.ndarray | None:
    """int[B] tokens each row can still take, or None for a cache that never fills (rings)."""
    capacity = cache.get_max_length()
    if capacity is None:
        return None
    return capacity - np.asarray(cache.seq_lengths(0))


def logits_width(model: Any) -> int:
    """V, the width of ``model``'s logits: ``model.config.vocab_size``, or for a model that
    declares none, the shape of a one-token call traced on abstract inputs (nothing runs)."""
    size = model_vocab_size(model)
    if size is not None:
        return size
    return int(nnx.eval_shape(lambda m: m(jnp.zeros((1, 1), jnp.int32), m.init_cache(1, 1))[0], model).shape[-1])


def check_positive_int(value: Any, name: str, who: str) -> int:
    """``value`` as a Python int >= 1, else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{who}: {name} must be a Python int >= 1, got {value!r}")
    return int(value)


def check_token_id(
    value: Any, name: str, vocab_size: int | None, who: str, *, allow_none: bool = True
) -> int | None:
    """``None`` (when ``allow_none``) or a token id in ``[0, vocab_size)`` as a Python int.

    Integers of any kind count (Python, NumPy, concrete 0-d integer arrays), bools do not.
    ``vocab_size`` None (a model without ``config.vocab_size``) checks ``>= 0`` only.
    """
    if value is None and allow_none:
        return None
    token = _static_int(value)  # Python, NumPy or concrete 0-d integers; not bools
    if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
        wanted = "a token id >= 0" if vocab_size is None else f"a token id in [0, {vocab_size})"
        raise ValueError(f"{who}: {name} must be {'None or ' if allow_none else ''}{wanted}, got {value!r}")
    return token


def check_integer_ids(ids: Any, who: str, name: str) -> None:
    """``ids`` is a 1-D sequence of integer token ids (empty allowed), else ``TypeError``.

    NumPy would truncate 2.9 to 2 (and take True as 1) when ids are copied into an int32
    buffer, silently serving other tokens; strings would be split into characters.
    """
    from jaxkv._checks import integral_ids

    arr = None if isinstance(ids, (str, bytes)) else np.asarray(ids)
    if arr is None or arr.ndim != 1 or not (arr.size == 0 or integral_ids(arr)):
        raise TypeError(f"{who}: {name} must be a 1-D sequence of integer token ids, got {ids!r}")


def check_arrival(arrival: Any, who: str, label: str) -> int:
    """A request's arrival step: an int >= 0 (a NaN or inf arrival is never reached: the
    serving loop would wait for it forever)."""
    if isinstance(arrival, bool) or not isinstance(arrival, (int, np.integer)) or arrival < 0:
        raise ValueError(f"{who}: {label} arrival must be an int >= 0 (a loop step), got {arrival!r}")
    return int(arrival)


def check_request(
    prompt: Any, max_new_tokens: Any, arrival: Any, max_length: int, vocab_size: int, who: str, index: int, label: str
) -> None:
    """A serving request's prompt (non-empty, integer ids in the vocabulary) and
    ``max_new_tokens`` (>= 1) fit a row of ``max_length`` tokens (the last generated token is
    never stored), and its ``arrival`` is a loop step. ``label`` names the request in
    messages; token ids are named ``requests[index].prompt``."""
    from jaxkv._checks import check_token_ids

    name = label
    check_arrival(arrival, who, label)
    check_integer_ids(prompt, who, f"{label} prompt")
    if len(prompt) < 1:
        raise ValueError(f"{who}: {name} has an empty prompt; it needs at least one token")
    check_token_ids(prompt, vocab_size, who, name=f"requests[{index}].prompt")
    check_positive_int(max_new_tokens, f"{label} max_new_tokens", who)
    need = len(prompt) + max_new_tokens - 1
    if need > max_length:
        raise ValueError(
            f"{who}: {name} needs {need} cache slots (prompt {len(prompt)} + max_new_tokens {max_new_tokens} - 1) "
            f"but max_length is {max_length}; use a larger max_length or shorten the request"
        )

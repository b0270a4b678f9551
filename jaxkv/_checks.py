"""Argument checks shared by the model call, generation and the decoding algorithms.

Token ids are checked eagerly, on the host, whenever they are concrete arrays. Under
``jax.jit`` they are tracers and nothing can raise: :class:`jaxkv.models.Llama` then turns
the embedding of an out-of-range id into NaN (see its ``__call__``), so such a row shows
NaN logits instead of silently reading another token's embedding, and
:func:`jaxkv.generation.select_token` turns NaN logits into token -1.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

__all__ = ["check_model", "check_token_ids", "model_vocab_size"]


def check_model(model: Any, who: str, *, name: str = "model") -> Any:
    """Returns ``model`` if it is an ``nnx.Module``.

    Raises:
        TypeError: a :class:`jaxkv.models.Pretrained` bundle (what ``from_pretrained``
            returns: the module is its ``.model``), or anything else that is not an
            ``nnx.Module``.
    """
    if isinstance(model, nnx.Module):
        return model
    if isinstance(getattr(model, "model", None), nnx.Module):
        raise TypeError(
            f"{who}: {name} is a {type(model).__name__} bundle (what jaxkv.models.from_pretrained returns), "
            "not a model; pass loaded.model"
        )
    raise TypeError(f"{who}: {name} must be an nnx.Module such as jaxkv.models.Llama, got {type(model).__name__}")


def model_vocab_size(model: Any) -> int | None:
    """``model.config.vocab_size``, or None for a model that does not declare one."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return None if size is None else int(size)


def integral_ids(ids: np.ndarray) -> bool:
    """Whether a NumPy array of token ids holds integers: an integer dtype, or Python / NumPy
    ints in an object array (ints beyond int64); bools and floats are not ids."""
    return np.issubdtype(ids.dtype, np.integer) or (
        ids.dtype == object and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in ids.flat)
    )


def check_token_ids(token_ids: Any, vocab_size: int | None, who: str, *, name: str = "input_ids") -> None:
    """Raises if a concrete token id lies outside ``[0, vocab_size)``; tracers pass unchecked.

    Every position is checked, padding included: padding is embedded too, so it must be a
    real id (0, say) even though it is never stored or attended to.

    Args:
        token_ids: an integer array (any shape) or nested sequence of ids.
        vocab_size: V; None skips the check (a model without ``config.vocab_size``).
        who: the public entry point, named first in the message.
        name: how the message names ``token_ids``.

    Raises:
        ValueError: naming the first bad id (in row-major order), its position and V.
    """
    if vocab_size is None or isinstance(token_ids, jax.core.Tracer):
        return
    if isinstance(token_ids, jax.Array) and not token_ids.is_fully_addressable:
        # a global array over several processes: each checks the shards it holds
        for shard in token_ids.addressable_shards:
            check_token_ids(np.asarray(shard.data), vocab_size, who, name=f"{name} (a shard at {shard.index})")
        return
    ids = np.asarray(token_ids)
    if ids.size == 0 or not integral_ids(ids):
        return  # shape and dtype problems are reported by the callers' own checks
    bad = (ids < 0) | (ids >= vocab_size)
    if not bad.any():
        return
    where = np.unravel_index(int(np.argmax(bad)), ids.shape)
    position = "[" + ", ".join(str(int(i)) for i in where) + "]"
    value = int(ids[where])
    hint = "negative ids do not wrap around" if value < 0 else "the id is too large for this model"
    raise ValueError(
        f"{who}: token id {value} at {name}{position} is outside the vocabulary [0, {vocab_size}) "
        f"(vocab_size={vocab_size}; {hint}); padding must be a valid id too, e.g. 0"
    )

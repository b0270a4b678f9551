"""Saving and restoring caches: pickle, and ``flax.serialization`` (``to_bytes`` / ``from_bytes``).

* ``pickle``: every kind pickles as is (``KVCache.__reduce__``): host copies of the arrays,
  and a sharded cache's mesh by axis names, shape and device ids; it is rebuilt on load,
  so the cache comes back onto the same devices with the same layout (or the load raises,
  naming the missing devices).
* ``flax.serialization``: :func:`register_flax_serialization` teaches flax every cache
  kind. It runs when a flax integration module is imported (``jaxkv.nnx``, ``jaxkv.linen``,
  ``jaxkv.models``) or when ``jaxkv`` is imported after flax; the core never imports flax
  itself. A state dict holds the arrays by their pytree path; ``from_bytes(target, data)``
  restores them into ``target``'s structure and onto ``target``'s shardings (build the
  target with the same ``sharding=`` to restore onto the same mesh), checking every shape
  and dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["from_state_dict", "register_flax_serialization", "to_state_dict"]

_registered = False


def to_state_dict(cache: Any) -> dict[str, np.ndarray]:
    """``{pytree path: host array}`` of every array leaf of ``cache``."""
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    """``target`` with its arrays replaced by ``state``'s, on ``target``'s shardings.

    Raises:
      ValueError: a path missing from ``state``, or an array whose shape or dtype differs
        from ``target``'s (a ``DynamicCache``'s sequence axis, its length, may differ).
    """
    who = f"restoring a {type(target).__name__}"
    grows = getattr(target, "SHAPES_GROW", False)  # a DynamicCache's arrays grow with its length
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    out = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        if key not in state:
            raise ValueError(f"{who}: the saved state has no array {key!r} (saved keys: {sorted(state)[:8]}...).")
        value = np.asarray(state[key])
        # A DynamicCache's layers are [B, H, S, D] and only S (axis 2) follows the length.
        free = (2,) if grows else ()
        same_sizes = value.ndim == leaf.ndim and all(
            a == b for i, (a, b) in enumerate(zip(value.shape, leaf.shape)) if i not in free
        )
        if not same_sizes or value.dtype != leaf.dtype:
            allowed = " (only the sequence axis may differ)" if grows else ""
            raise ValueError(
                f"{who}: {key} was saved as {value.dtype}{list(value.shape)}, the target holds "
                f"{leaf.dtype}{list(leaf.shape)}{allowed}; build the target with the same sizes and dtype."
            )
        sharding = getattr(leaf, "sharding", None)
        out.append(jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value))
    return jax.tree_util.tree_unflatten(treedef, out)


def register_flax_serialization() -> None:
    """Registers every cache kind with ``flax.serialization`` (idempotent; imports flax)."""
    global _registered
    if _registered:
        return
    from flax import serialization

    from jaxkv.caches import CrossAttentionCache, DynamicCache, EncoderDecoderCache, KVCache

    def kinds(cls):  # flax looks classes up by exact type: every kind, present and future
        return [cls] + [k for sub in cls.__subclasses__() for k in kinds(sub)]

    for cls in kinds(KVCache) + [DynamicCache, EncoderDecoderCache, CrossAttentionCache]:
        serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)
    _registered = True

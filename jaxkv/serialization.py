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
* The arrays do not say everything: a bf16 and an f16 buffer are both stored as uint16 bits,
  and a ring's window or a hybrid cache's layer-to-storage map are static fields. So the
  state dict also holds those static facts (``"<path>.dtype"`` and the like, each as the
  UTF-8 bytes of its text in a uint8 array), and a restore into a target that differs in any
  of them raises instead of reinterpreting the bits (an f16 cache read back as bf16) or
  moving layers into the wrong storage. Placement (``sharding``, an offloaded cache's
  ``offloaded``) is the target's choice and is not compared. A state saved without them
  (before they were written) is restored as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["from_state_dict", "register_flax_serialization", "to_state_dict"]

_registered = False


# Static fields that say where the arrays live, not what they mean: the target decides.
_PLACEMENT_FIELDS = frozenset({"sharding", "offloaded"})


def _static_text(value: Any) -> str | None:
    """The text a static field is saved as, or None for what is not compared."""
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, tuple) and all(isinstance(v, (bool, int)) for v in value):
        return repr(tuple(int(v) for v in value))
    return None


def _static_fields(node: Any, prefix: str = "") -> dict[str, str]:
    """``{path: text}`` of the static (non-array) fields of every dataclass in ``node``
    that change what the arrays mean: dtypes (16-bit floats are stored as their bits),
    a ring's window, quantization bits, a hybrid cache's layer groups, and the length of
    every tuple of them (layers, storages)."""
    out: dict[str, str] = {}
    if isinstance(node, (tuple, list)):
        for i, item in enumerate(node):
            out.update(_static_fields(item, f"{prefix}[{i}]"))
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            if field.name in _PLACEMENT_FIELDS:
                continue
            value = getattr(node, field.name)
            if value is None or isinstance(value, (jax.Array, np.ndarray)):
                continue
            text = _static_text(value)
            if text is not None:
                out[f"{prefix}.{field.name}"] = text
                continue
            if isinstance(value, (tuple, list)):
                # How many: a DynamicCache's unseeded layers have no arrays, so a saved cache of
                # 2 layers would otherwise fill a target of 3 and leave the third empty.
                out[f"{prefix}.{field.name}#len"] = repr(len(value))
            out.update(_static_fields(value, f"{prefix}.{field.name}"))
    return out


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).copy()


def _decode(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    return np.asarray(value).astype(np.uint8).tobytes().decode("utf-8")


def to_state_dict(cache: Any) -> dict[str, np.ndarray]:
    """``{pytree path: host array}`` of every array leaf of ``cache``, plus its static facts
    (``"<path>.dtype"`` and the like: UTF-8 text as uint8 arrays; see the module docstring)."""
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    state = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}
    for key, text in _static_fields(cache).items():
        state[key] = _encode(text)
    return state


def _check_static_fields(want: dict[str, str], state: dict[str, Any], who: str) -> None:
    """Refuses a target whose static facts ``want`` (:func:`_static_fields`: dtypes, window,
    bits, layer groups, layer count) differ from the saved ones."""
    saved_any = any(key in state for key in want)
    for key, text in want.items():
        if key not in state:
            if saved_any:  # a state written with static facts, but not this one: another structure
                raise ValueError(f"{who}: the saved state has no {key!r}; build the target with the same kind.")
            continue  # a state saved before static facts were written: nothing to compare
        try:
            saved = _decode(state[key])
        except (UnicodeDecodeError, ValueError, TypeError):
            raise ValueError(f"{who}: the saved {key!r} is not readable; the state is damaged.") from None
        if saved != text:
            raise ValueError(
                f"{who}: {key} was saved as {saved}, the target has {text}; build the target with the same "
                "init arguments as the saved cache (a 16-bit float buffer is stored as its bits, so restoring "
                "one dtype into another would reinterpret them)."
            )


def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    """``target`` with its arrays replaced by ``state``'s, on ``target``'s shardings.

    A ``DynamicCache`` anywhere in ``target`` (alone, or the self part of an
    ``EncoderDecoderCache``) takes the saved layers whatever their length, seeded in the
    target or not (``DynamicCache(num_layers=L)`` is a target for any saved one of L layers).

    Raises:
      ValueError: a path missing from ``state``, an array whose shape or dtype differs from
        ``target``'s (a ``DynamicCache`` layer's sequence axis, its length, may differ), or
        saved arrays the target has no place for (another layer count or structure), or
        static facts that differ (another dtype, window, bits, layer order or layer count;
        see the module docstring).
    """
    from jaxkv.caches.dynamic import DynamicCache

    who = f"restoring a {type(target).__name__}"
    used: set[str] = set()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: isinstance(x, DynamicCache))
    out = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        if isinstance(leaf, DynamicCache):
            out.append(_restore_dynamic(leaf, state, key, who, used))
            continue
        out.append(_restore_array(leaf, state, key, who, free=()))
        used.add(key)
    statics = _static_fields(target)
    unused = sorted(set(state) - used - set(statics))
    if unused:
        raise ValueError(
            f"{who}: the saved state has arrays the target has no place for: {unused[:8]}; build the target "
            "with the same kind and layer count as the saved cache."
        )
    _check_static_fields(statics, state, who)
    return jax.tree_util.tree_unflatten(treedef, out)


def _restore_array(leaf: Any, state: dict[str, Any], key: str, who: str, *, free: tuple[int, ...]) -> Any:
    if key not in state:
        raise ValueError(f"{who}: the saved state has no array {key!r} (saved keys: {sorted(state)[:8]}...).")
    value = np.asarray(state[key])
    same_sizes = value.ndim == leaf.ndim and all(
        a == b for i, (a, b) in enumerate(zip(value.shape, leaf.shape)) if i not in free
    )
    if not same_sizes or value.dtype != leaf.dtype:
        allowed = " (only the sequence axis may differ)" if free else ""
        raise ValueError(
            f"{who}: {key} was saved as {value.dtype}{list(value.shape)}, the target holds "
            f"{leaf.dtype}{list(leaf.shape)}{allowed}; build the target with the same sizes and dtype."
        )
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


def _restore_dynamic(target: Any, state: dict[str, Any], prefix: str, who: str, used: set[str]) -> Any:
    """A DynamicCache's layers [B, H, S, D] from ``state``: any length S; a layer the target
    has seeded must agree in dtypes, B, H and D; an unseeded one takes the saved arrays."""
    from jaxkv.caches.dynamic import DynamicCache

    layers = []
    for i, mine in enumerate(target.layers):
        keys = [f"{prefix}.layers[{i}][{j}]" for j in (0, 1)]
        present = [k in state for k in keys]
        if not any(present):  # unseeded when saved
            layers.append(None)
            continue
        if not all(present):
            raise ValueError(f"{who}: the saved state has only one of {keys}; it is damaged.")
        used.update(keys)
        if mine is not None:
            layers.append(tuple(_restore_array(x, state, k, who, free=(2,)) for x, k in zip(mine, keys)))
            continue
        pair = [np.asarray(state[k]) for k in keys]
        # Keys and values may differ in float dtype, as DynamicCache.update takes them (and
        # transformers' DynamicCache); shapes must agree.
        floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in pair)  # bfloat16 included
        if pair[0].ndim != 4 or pair[0].shape != pair[1].shape or not floating:
            raise ValueError(
                f"{who}: {keys[0]} / {keys[1]} were saved as {pair[0].dtype}{list(pair[0].shape)} / "
                f"{pair[1].dtype}{list(pair[1].shape)}; a DynamicCache layer is a pair of float [B, H, S, D] of one "
                "shape."
            )
        layers.append(tuple(jnp.asarray(x) for x in pair))
    return DynamicCache(tuple(layers))


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
        register_kind(cls)
    _registered = True


def register_kind(cls: type) -> None:
    """Registers one cache class with ``flax.serialization`` (a kind defined after
    :func:`register_flax_serialization` ran is registered by ``KVCache`` itself)."""
    from flax import serialization

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)

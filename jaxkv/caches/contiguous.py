"""Contiguous storage and ``StaticCache``: preallocated ``[L, B, H, S, D]`` buffers.

Slot ``s`` of a row holds the token at absolute position ``s``; a row of length ``n``
uses slots ``0 .. n-1``. Slots at or past the length may hold anything (stale tokens after
``crop``/``reset``): attention masks them by the lengths. All layers are stacked in one
buffer, so a ``lax.scan`` over layers can carry the whole cache and update layer ``i`` in
place with a traced ``layer_idx``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.caches._bits import stored_dtype, to_bits
from jaxkv.caches._checks import CacheError, _check_sizes, _floating_dtype, _is_traced
from jaxkv.caches.container import KVCache, storage_field
from jaxkv.caches.dynamic import DynamicCache
from jaxkv.caches.views import ContiguousView

Array = jax.Array

__all__ = ["ContiguousStorage", "StaticCache"]


def token_slots(old: Array, count: Array, new_tokens: int, capacity: int) -> Array:
    """int32[B, T]: slot ``old[b] + t`` of each new token, or ``capacity`` (out of bounds,
    so dropped) for padding (``t >= count[b]``) and for positions past capacity."""
    t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
    pos = old[:, None] + t
    return jnp.where((t < count[:, None]) & (pos < capacity), pos, capacity)


def scatter_slots(buffer: Array, write_layer: Any, states: Array, slot: Array) -> Array:
    """Writes ``states`` [B, H, T, ...] into ``buffer`` [L, B, H, S, ...] at ``slot``
    int32[B, T]; out-of-range slots are dropped (``mode="drop"``), never clamped."""
    rows = jnp.arange(states.shape[0], dtype=jnp.int32)[:, None]
    moved = jnp.moveaxis(states.astype(buffer.dtype), 2, 1)  # [B, T, H, ...]; bits: already converted
    return buffer.at[write_layer, rows, :, slot].set(moved, mode="drop")


@dataclasses.dataclass(frozen=True)
class ContiguousStorage:
    """Keys and values of every layer in two ``[L, B, H, S, D]`` buffers (slot = position).

    Attributes:
      keys: [L, B, H, S, D] key buffer, as stored: a 16-bit float dtype as its uint16
        bits (:mod:`jaxkv.caches._bits`: XLA:CPU updates those in place, not bf16).
      values: [L, B, H, S, D] value buffer, stored the same way.
      dtype: static, the float dtype the buffers hold.
    """

    keys: Array
    values: Array
    dtype: Any  # static

    LEAF_AXES: ClassVar[dict] = {
        "keys": ("layer", "batch", "heads", "seq", "dim"),
        "values": ("layer", "batch", "heads", "seq", "dim"),
    }

    @classmethod
    def zeros(cls, num_layers, batch_size, num_kv_heads, head_dim, max_length, dtype) -> ContiguousStorage:
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        return cls(jnp.zeros(shape, stored_dtype(dtype)), jnp.zeros(shape, stored_dtype(dtype)), jnp.dtype(dtype))

    num_layers = property(lambda self: self.keys.shape[0])
    num_kv_heads = property(lambda self: self.keys.shape[2])
    capacity = property(lambda self: self.keys.shape[3])
    head_dim = property(lambda self: self.keys.shape[4])

    def write(self, read_layer, write_layer, layer_ok, keys, values, old, count):
        del read_layer, layer_ok  # a bad layer writes at `write_layer` == L: dropped
        slot = token_slots(old, count, keys.shape[2], self.capacity)
        return dataclasses.replace(
            self,
            keys=scatter_slots(self.keys, write_layer, to_bits(keys, self.dtype), slot),
            values=scatter_slots(self.values, write_layer, to_bits(values, self.dtype), slot),
        ), None

    def view(self, layer: Any, lengths: Array) -> ContiguousView:
        return ContiguousView(self.keys, self.values, layer, lengths, self.dtype)

    def crop(self, old: Array, new: Array, **_: Any):
        return self, jnp.zeros(new.shape, bool)

    def reset_rows(self, rows: Array) -> ContiguousStorage:
        return self


register_dataclass(ContiguousStorage, data_fields=["keys", "values"], meta_fields=["dtype"])


class StaticCache(KVCache):
    """Preallocated cache with per-row fill levels, for jitted decode loops.

    One :class:`ContiguousStorage`: row ``b`` of layer ``l`` holds ``lengths[l, b]``
    tokens in slots ``0 .. lengths-1`` of ``keys``/``values`` [L, B, H, S, D]. The policy
    (overflow, bad indices, flags) and every op are those of
    :class:`jaxkv.caches.container.KVCache`.

    Example:
      >>> cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4,
      ...                          max_length=16)
      >>> k = jnp.ones((2, 1, 3, 4))
      >>> cache, keys, values = cache.update(k, k, 0, num_new=jnp.array([3, 1]))
      >>> cache.seq_lengths(0).tolist(), keys.shape
      ([3, 1], (2, 1, 16, 4))
    """

    @classmethod
    def init(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: Any = jnp.float32,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> StaticCache:
        """Allocates an empty cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim, max_length: sizes (ints >= 1).
          dtype: a floating storage dtype.
          sharding: optional ``NamedSharding`` whose spec describes one layer's
            ``[B, H, S, D]`` buffer, e.g. ``NamedSharding(mesh, P("data", "model"))`` puts
            rows on the data axis and kv heads on the model axis. The layer axis is never
            sharded; ``lengths``/``flags`` follow the batch axis. Buffers are created
            directly in their shards.

        Raises:
          ValueError: a size < 1 or a sharding spec longer than 4.
          TypeError: a non-floating dtype or a sharding of another type.
        """
        _check_sizes(
            "StaticCache.init", num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_length=max_length,
        )
        dtype = _floating_dtype(dtype, "StaticCache.init")
        return cls._allocate(
            lambda: [ContiguousStorage.zeros(num_layers, batch_size, num_kv_heads, head_dim, max_length, dtype)],
            num_layers=num_layers, batch_size=batch_size, groups=(0,) * num_layers, sharding=sharding,
        )

    @classmethod
    def from_dynamic(
        cls, cache: DynamicCache, *, max_length: int, dtype: Any = None, sharding: Any = None
    ) -> StaticCache:
        """Copies a (fully seeded) ``DynamicCache`` into a new static cache.

        Typical use: prefill with a dynamic cache, then decode in a static one.
        """
        if not hasattr(cache, "to_legacy_cache"):  # a tuple of pairs: AttributeError before (review 84)
            raise TypeError(f"StaticCache.from_dynamic takes a DynamicCache, got {type(cache).__name__}; for "
                            "((k0, v0), ...) pairs use StaticCache.from_legacy_cache(pairs, max_length=...).")
        if len(cache) == 0:
            raise ValueError("StaticCache.from_dynamic: the dynamic cache has no layers.")
        layers = cache.to_legacy_cache()
        k0 = layers[0][0]
        for i, (k, _) in enumerate(layers):
            if (k.shape[0], k.shape[1], k.shape[3]) != (k0.shape[0], k0.shape[1], k0.shape[3]):
                raise ValueError(
                    "StaticCache.from_dynamic: every layer must share [batch, kv_heads, head_dim]; "
                    f"layer 0 has {k0.shape}, layer {i} has {k.shape}."
                )
        longest = max(k.shape[2] for k, _ in layers)
        if isinstance(max_length, int) and not isinstance(max_length, bool) and longest > max_length:
            i = next(i for i, (k, _) in enumerate(layers) if k.shape[2] == longest)
            raise ValueError(
                f"StaticCache.from_dynamic: layer {i} holds {longest} tokens, more than max_length="
                f"{max_length}; pass max_length >= {longest} (plus the tokens you will decode)."
            )
        static = cls.init(
            num_layers=len(layers), batch_size=k0.shape[0], num_kv_heads=k0.shape[1], head_dim=k0.shape[3],
            max_length=max_length, dtype=k0.dtype if dtype is None else dtype, sharding=sharding,
        )
        for i, (k, v) in enumerate(layers):
            if k.shape[2]:
                static, _, _ = static.update(k, v, i)
        return static

    @classmethod
    def from_legacy_cache(
        cls, past_key_values: Sequence[tuple[Any, Any]], *, max_length: int, **kwargs: Any
    ) -> StaticCache:
        """Builds a static cache of capacity ``max_length`` from ``((k0, v0), ...)``."""
        return cls.from_dynamic(DynamicCache.from_legacy_cache(past_key_values), max_length=max_length, **kwargs)

    def to_dynamic(self) -> DynamicCache:
        """Exports the valid part as a ``DynamicCache``.

        Raises:
          ValueError: rows of one layer hold different lengths (a dynamic cache has one
            length per layer); select rows with ``batch_select_indices`` first.
          CacheError: a row is flagged (an overflow or a bad index dropped data): the
            export has no flags to carry that, so it would pass for a whole cache.
        """
        return DynamicCache(self._legacy("StaticCache.to_dynamic"))

    def to_legacy_cache(self) -> tuple[tuple[Array, Array], ...]:
        """The valid part ``((k0, v0), ...)``, each ``[B, H, n_l, D]``; rows must agree.
        A flagged row is a ``CacheError``, as in :meth:`to_dynamic`."""
        return self._legacy("StaticCache.to_legacy_cache")

    def _legacy(self, who: str) -> tuple[tuple[Array, Array], ...]:
        if _is_traced(self.lengths):
            raise TypeError(
                f"{who} needs concrete lengths (its output shapes depend "
                "on them); call it outside jax.jit."
            )
        if np.asarray(self.flags).any():  # sticky flags have nowhere to go in the export
            try:
                self.check()
            except CacheError as err:
                raise CacheError(
                    f"{who}: {err} The export has no flags, so it would pass for a whole cache; reset or "
                    "drop the flagged rows first."
                ) from None
        lengths = np.asarray(self.lengths)
        out = []
        for i in range(self.num_layers):
            row_lengths = lengths[i]
            if row_lengths.size and (row_lengths != row_lengths[0]).any():
                raise ValueError(
                    f"{who}: layer {i} holds different lengths per row "
                    f"{row_lengths.tolist()}; a dynamic cache needs one length per layer. Export "
                    "rows separately with batch_select_indices([row])."
                )
            n = int(row_lengths[0]) if row_lengths.size else 0  # no rows (batch_select_indices([])): empty
            out.append((self.keys[i, :, :, :n], self.values[i, :, :, :n]))
        return tuple(out)

    # ---- the storage's buffers, by their familiar names

    keys = storage_field("keys", "[L, B, H, S, D] key buffer (16-bit dtypes: from the stored bits).", dtype_of="dtype")
    values = storage_field("values", "[L, B, H, S, D] value buffer.", dtype_of="dtype")

    max_length = storage_field("capacity", "The capacity S.")

    def get_max_length(self) -> int:
        return self.max_length

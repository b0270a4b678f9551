"""Ring storage and ``SlidingWindowCache``: ``window`` (+ ``extra_slots``) slots per layer.

Shapes use the package alphabet (L layers, B rows, H kv heads, T new tokens, D head dim)
plus W for the attention window and C = W + extra_slots for the ring's slots.

Memory is O(C) whatever the sequence length. Each row keeps its own absolute length (the
container's ``lengths``: the position of its next token); the token at absolute position
``p`` lives in slot ``p % C``. A query at position ``p`` sees positions ``p - W + 1 .. p``
(itself and the ``W - 1`` before it, as HF transformers and
:func:`jaxkv.attention.attend` define the window).

Positions are the source of truth: :func:`slot_positions` gives the absolute
position held by every slot; a slot that holds no token (never written, evicted, cropped
or reset) reports ``NO_POSITION`` (``2**31 - 1``), a position in the future of every
query, so attention masks it without a separate mask.

Multi-token chunks. Writing a chunk of ``T`` tokens overwrites the slots of positions
``p - C`` for every new ``p``; with ``T > C - W + 1`` some of those are still needed by the
chunk's own earlier queries. The view for attention is then the ring as it was *before*
the write followed by the chunk itself (``[B, H, C + T, D]``), while the stored ring keeps
the last ``C`` tokens. For short chunks (``T <= C - W + 1``, which includes every decode
step) nothing needed is overwritten and the view is the ring after the write.

Policy: that of :class:`jaxkv.caches.container.KVCache`. A ring never runs out of room,
so ``OVERFLOW`` is never set. A ``crop`` that would need evicted tokens raises eagerly and
sets ``INVALID`` under jit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.caches._checks import _check_extra, _check_sizes, _floating_dtype, _is_traced
from jaxkv.caches.container import KVCache, storage_field
from jaxkv.caches.contiguous import scatter_slots
from jaxkv.caches.views import NO_POSITION, LayerView

Array = jax.Array

__all__ = ["RingStorage", "SlidingWindowCache"]


def slot_positions(lengths: Array, starts: Array, num_slots: int) -> Array:
    """int32[B, C]: the position held by each ring slot, ``NO_POSITION`` where none."""
    slots = jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    # The one position in [lengths - C, lengths) that maps to the slot; jnp.mod is >= 0.
    pos = last - jnp.mod(last - slots, num_slots)
    held = (pos >= starts[:, None]) & (pos >= 0)
    return jnp.where(held, pos, jnp.int32(NO_POSITION))


def _zero_empty(values: Array, positions: Array) -> Array:
    """Zeros the entries that hold no token (``0 * NaN`` would leak through attention; keys
    too, for a user's own masking of a dense read)."""
    return jnp.where((positions != NO_POSITION)[:, None, :, None], values, jnp.zeros((), values.dtype))


@dataclasses.dataclass(frozen=True)
class RingStorage:
    """Rings of ``C`` slots per layer and row; position ``p`` in slot ``p % C``.

    Attributes:
      keys: [L, B, H, C, D] ring of keys.
      values: [L, B, H, C, D] ring of values.
      starts: int32[L, B] first position still held per layer and row (``max(0, length - C)``
        unless a crop rolled the row back).
      window: static attention window W.
    """

    keys: Array
    values: Array
    starts: Array
    window: int  # static

    LEAF_AXES: ClassVar[dict] = {
        "keys": ("layer", "batch", "heads", "slots", "dim"),
        "values": ("layer", "batch", "heads", "slots", "dim"),
        "starts": ("layer", "batch"),
    }
    capacity: ClassVar[None] = None  # a ring never overflows

    @classmethod
    def zeros(cls, num_layers, batch_size, num_kv_heads, head_dim, window, extra_slots, dtype) -> RingStorage:
        shape = (num_layers, batch_size, num_kv_heads, window + extra_slots, head_dim)
        return cls(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_layers, batch_size), jnp.int32), window
        )

    num_layers = property(lambda self: self.keys.shape[0])
    num_kv_heads = property(lambda self: self.keys.shape[2])
    num_slots = property(lambda self: self.keys.shape[3])
    head_dim = property(lambda self: self.keys.shape[4])
    dtype = property(lambda self: self.keys.dtype)

    def write(self, read_layer, write_layer, layer_ok, keys, values, old, count):
        del layer_ok  # count is 0 for a bad layer, and write_layer is out of bounds
        num_slots, new_tokens = self.num_slots, keys.shape[2]
        start = self.starts[read_layer]
        t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
        pos = old[:, None] + t  # [B, T]
        # Only the last C real tokens of a row reach the ring: the slots stay distinct
        # (a scatter with duplicate indices has no defined winner).
        stored = (t < count[:, None]) & (t >= count[:, None] - num_slots)
        slot = jnp.where(stored, jnp.mod(pos, num_slots), num_slots)  # `num_slots`: dropped
        new_len = old + count
        new = dataclasses.replace(
            self,
            keys=scatter_slots(self.keys, write_layer, keys, slot),
            values=scatter_slots(self.values, write_layer, values, slot),
            starts=self.starts.at[write_layer].set(jnp.maximum(start, new_len - num_slots), mode="drop"),
        )
        if new_tokens <= num_slots - self.window + 1:
            return new, None  # nothing a query of this chunk needs was overwritten
        chunk_pos = jnp.where(t < count[:, None], pos, jnp.int32(NO_POSITION))
        view_pos = jnp.concatenate([slot_positions(old, start, num_slots), chunk_pos], axis=1)
        view_k = jnp.concatenate([self.keys[read_layer], keys.astype(self.dtype)], axis=2)
        view_v = jnp.concatenate([self.values[read_layer], values.astype(self.dtype)], axis=2)
        full = jnp.full((keys.shape[0],), view_pos.shape[1], jnp.int32)
        return new, LayerView(_zero_empty(view_k, view_pos), _zero_empty(view_v, view_pos), view_pos, full, self.window)

    def view(self, layer: Any, lengths: Array) -> LayerView:
        pos = slot_positions(lengths, self.starts[layer], self.num_slots)
        full = jnp.full((lengths.shape[0],), self.num_slots, jnp.int32)
        return LayerView(_zero_empty(self.keys[layer], pos), _zero_empty(self.values[layer], pos), pos, full, self.window)

    def crop(self, old: Array, new: Array, *, who: str, layers: Any) -> tuple[RingStorage, Array]:
        needed_from = jnp.maximum(new - self.window + 1, 0)
        # Emptying a row (new == 0) needs no position back, whatever was evicted; nor does a
        # window of 1 (the next query sees only itself: positions needed_from..new-1 is empty).
        lost = (new < old) & (new > 0) & (needed_from < new) & (self.starts > needed_from)  # [L_g, B]
        if not _is_traced(lost) and np.asarray(lost).any():
            local, row = (int(i) for i in np.argwhere(np.asarray(lost))[0])
            layer = int(layers[local]) if isinstance(layers, np.ndarray) else local
            start, length = int(self.starts[local, row]), int(new[local, row])
            raise ValueError(
                f"{who}: layer {layer}, row {row} holds positions {start}..{int(old[local, row]) - 1}; "
                f"rolling back to {length} tokens needs positions {int(needed_from[local, row])}.."
                f"{length - 1} for the window of {self.window}, but those before {start} were evicted. "
                f"This cache (extra_slots={self.num_slots - self.window}) can roll a full window back by at "
                f"most {self.num_slots - self.window + 1} token(s); allocate more extra_slots."
            )
        return dataclasses.replace(self, starts=jnp.minimum(self.starts, new)), lost

    def reset_rows(self, rows: Array) -> RingStorage:
        return dataclasses.replace(self, starts=jnp.where(rows[None, :], 0, self.starts))


register_dataclass(RingStorage, data_fields=["keys", "values", "starts"], meta_fields=["window"])


class SlidingWindowCache(KVCache):
    """Ring-buffer cache of ``C = window + extra_slots`` slots per layer and row.

    One :class:`RingStorage`. Row ``b`` of layer ``l`` has seen ``lengths[l, b]`` tokens
    and still holds positions ``starts[l, b] .. lengths[l, b] - 1`` (at most ``C``).

    Rollback: ``crop`` back to length ``m`` is possible while the positions the next query
    needs (``m - W + 1 .. m - 1``) are still held: up to ``extra_slots + 1`` tokens behind
    a row that has seen at least ``C`` tokens, any amount before that. Allocate
    ``extra_slots`` for the deepest rollback you need (e.g. speculative decoding's draft
    length).

    Example:
      >>> cache = SlidingWindowCache.init(num_layers=1, batch_size=1, num_kv_heads=1,
      ...                                 head_dim=2, window=4)
      >>> k = jnp.ones((1, 1, 6, 2))
      >>> positions = cache.positions(6)                     # [[0 .. 5]]
      >>> cache, view = cache.update_view(k, k, 0)
      >>> cache.kv_positions(0).tolist()
      [[4, 5, 2, 3]]
    """

    @classmethod
    def init(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        extra_slots: int = 0,
        dtype: Any = jnp.float32,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> SlidingWindowCache:
        """Allocates an empty ring cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim: sizes (ints >= 1).
          window: attention window W (int >= 1).
          extra_slots: slots beyond the window (int >= 0); each one allows rolling back one
            more token (``crop``) once the window is full.
          dtype: a floating storage dtype.
          sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]`` (rows and kv
            heads are sharded; the ring's slots stay whole), as for ``StaticCache.init``.

        Raises:
          ValueError: a size < 1 or negative ``extra_slots``.
          TypeError: a non-floating dtype.
        """
        who = "SlidingWindowCache.init"
        _check_sizes(
            who, num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, window=window,
        )
        extra_slots = _check_extra(extra_slots, "extra_slots", who, base=int(window))
        dtype = _floating_dtype(dtype, who)
        return cls._allocate(
            lambda: [RingStorage.zeros(num_layers, batch_size, num_kv_heads, head_dim, int(window), extra_slots, dtype)],
            num_layers=num_layers, batch_size=batch_size, groups=(0,) * num_layers, sharding=sharding,
        )

    keys = storage_field("keys", "[L, B, H, C, D] ring of keys (slot order; see ``kv_positions``).")
    values = storage_field("values", "[L, B, H, C, D] ring of values.")
    starts = storage_field("starts", "int32[L, B] first position still held per layer and row.")
    window = storage_field("window", "The attention window W.")
    capacity = storage_field("num_slots", "Ring slots C = window + extra_slots.")

    @property
    def extra_slots(self) -> int:
        return self.capacity - self.window

"""What a storage hands to attention for one layer: a view that says its layout.

Attention dispatches on the type of the view, never on the cache class
(:func:`jaxkv.attention.attend_view`):

* :class:`ContiguousView`: slot ``s`` holds position ``s``; the stacked buffers are
  passed whole with the layer index, so the blockwise loop / CPU kernel reads only the
  filled blocks in place (cost O(tokens stored), not O(capacity)).
* :class:`QuantizedView`: the same layout in int8 / int4 with per-token scales, read and
  dequantized block by block, plus an exact full-precision residual of recent tokens.
* :class:`PagedView`: pages of a shared pool named by per-row block tables (slot ``s`` of
  a row is position ``s``, found in page ``block_table[b, s // ps]``); read block by
  block through the table, dequantizing int8/int4 pages in the loop.
* :class:`LayerView`: dense arrays with a position per slot (a ring buffer, a dynamic
  cache's grown arrays, encoder states). Attention reads every slot; a storage returns
  this only when its slot count is already small (a ring is O(window)) or unbounded by
  design (a dynamic cache).

Every view can be materialised with ``.dense()`` into a :class:`LayerView` (the HF-style
``update`` return value); attention never does that for the first two.

Shapes: L layers, B rows, H kv heads, S slots, D head dim, D' stored last axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.caches._bits import from_bits

Array = jax.Array

__all__ = ["NO_POSITION", "ContiguousView", "LayerView", "PagedView", "QuantizedView"]

#: Position reported by a slot that holds no token: later than any query, so masked.
NO_POSITION = 2**31 - 1


class LayerView(NamedTuple):
    """Dense arrays of one layer after an update, each slot with its position.

    ``attend(q, view.keys, view.values, q_positions=positions,
    kv_lengths=view.kv_lengths, kv_positions=view.kv_positions,
    sliding_window=view.sliding_window)`` is the attention of the new tokens.
    """

    keys: Array  # [B, H, S', D]
    values: Array  # [B, H, S', D]; entries that hold no token are zero
    kv_positions: Array | None  # int32[B, S'] (NO_POSITION: empty); None: slot s holds position s
    kv_lengths: Array  # int32[B]: slots at or past it are unused
    sliding_window: int | None  # the window of this layer, None for full attention

    def dense(self) -> LayerView:
        return self

    def slot_positions(self) -> Array:
        """int32[B, S']: the position each slot holds, ``NO_POSITION`` where none."""
        if self.kv_positions is None:
            return _filled_positions(self.kv_lengths, self.keys.shape[2])
        slots = jnp.arange(self.keys.shape[2], dtype=jnp.int32)[None, :]
        return jnp.where(slots < self.kv_lengths[:, None], self.kv_positions, jnp.int32(NO_POSITION))


def _zero_unfilled(keys: Array, values: Array, lengths: Array) -> tuple[Array, Array]:
    """``[B, H, S, D]`` keys and values with zeros in the slots at or past each row's length,
    as :class:`LayerView` promises: a user's own masked ``softmax @ values`` over a dense read
    met stale NaN of a rolled-back token, or (pages) another row's page read for a block the
    row has no page for. Only dense reads pay for it; attention reads the views in place."""
    filled = (jnp.arange(keys.shape[2], dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :, None]
    return jnp.where(filled, keys, 0), jnp.where(filled, values, 0)


def _filled_positions(lengths: Array, num_slots: int) -> Array:
    slots = jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    return jnp.where(slots < lengths[:, None], slots, jnp.int32(NO_POSITION))


class ContiguousView(NamedTuple):
    """One layer of stacked ``[L, B, H, S, D]`` buffers where slot ``s`` holds position ``s``.

    ``keys``/``values`` are the buffers as stored: a 16-bit float as its uint16 bits
    (:mod:`jaxkv.caches._bits`); ``dtype`` says what they hold.
    """

    keys: Array  # [L, B, H, S, D], the whole stacked buffer
    values: Array  # [L, B, H, S, D]
    layer: Any  # int or traced int32: the layer to read
    lengths: Array  # int32[B]: filled slots per row
    dtype: Any  # the float dtype the buffers hold

    def dense(self) -> LayerView:
        keys, values = (from_bits(x[self.layer], self.dtype) for x in (self.keys, self.values))
        return LayerView(*_zero_unfilled(keys, values, self.lengths), None, self.lengths, None)

    def slot_positions(self) -> Array:
        """int32[B, S]: the position each slot holds, ``NO_POSITION`` where none."""
        return _filled_positions(self.lengths, self.keys.shape[3])


class QuantizedView(NamedTuple):
    """One layer of a quantized storage: ``[L, B, H, S, D']`` codes with per-token scales
    (slot ``s`` holds position ``s``) and a ring of the last R tokens in full precision.

    A residual slot ``r`` holds position ``residual_positions[b, r]`` exactly; it is used
    iff ``0 <= position < lengths[b]``, and the quantized slot of that position must then be
    ignored (the residual wins).
    """

    keys: Array  # [L, B, H, S, D'] int8 (or uint8: two int4 per byte)
    values: Array  # [L, B, H, S, D']
    key_scales: Array  # [L, B, H, S], as stored (16-bit floats as uint16 bits)
    value_scales: Array  # [L, B, H, S]
    residual_keys: Array  # [B, H, R, D] in the model dtype
    residual_values: Array  # [B, H, R, D]
    residual_positions: Array  # int32[B, R]
    layer: Any  # int or traced int32
    lengths: Array  # int32[B]
    bits: int  # 8 or 4
    dtype: Any  # the model dtype
    scale_dtype: Any  # the scales' dtype

    def residual_used(self) -> Array:
        """bool[B, R]: residual slots holding a stored token."""
        rp = self.residual_positions
        return (rp >= 0) & (rp < self.lengths[:, None])

    def dense(self) -> LayerView:
        from jaxkv.caches.quantized import dequantize  # the codec lives with its storage

        key_scales = from_bits(self.key_scales[self.layer], self.scale_dtype)
        value_scales = from_bits(self.value_scales[self.layer], self.scale_dtype)
        keys = dequantize(self.keys[self.layer], key_scales, self.bits, self.dtype)
        values = dequantize(self.values[self.layer], value_scales, self.bits, self.dtype)
        if self.residual_keys.shape[2]:
            slot = jnp.where(self.residual_used(), self.residual_positions, keys.shape[2])
            rows = jnp.arange(keys.shape[0], dtype=jnp.int32)[:, None]
            keys = keys.at[rows, :, slot].set(self.residual_keys.transpose(0, 2, 1, 3), mode="drop")
            values = values.at[rows, :, slot].set(self.residual_values.transpose(0, 2, 1, 3), mode="drop")
        return LayerView(*_zero_unfilled(keys, values, self.lengths), None, self.lengths, None)

    def slot_positions(self) -> Array:
        """int32[B, S]: the position each slot holds, ``NO_POSITION`` where none."""
        return _filled_positions(self.lengths, self.keys.shape[3])


class PagedView(NamedTuple):
    """One layer of a paged pool: row ``b``'s position ``p`` is in page
    ``block_table[b, p // ps]`` at offset ``p % ps`` of ``keys[layer]``.

    Float pages are stored as for :class:`ContiguousView` (16-bit as bits); with ``bits``
    8 or 4 they are codes with per-token scales, as for :class:`QuantizedView` (no
    residual).
    """

    keys: Array  # [L, P, H, ps, D'] the whole pool
    values: Array  # [L, P, H, ps, D']
    key_scales: Array  # [L, P, H, ps] (quantized) or [L, P, H, 0]
    value_scales: Array
    block_table: Array  # int32[B, M], -1: no page
    layer: Any  # int or traced int32
    lengths: Array  # int32[B]
    bits: int | None  # None: float pages
    dtype: Any  # the float dtype attention reads
    scale_dtype: Any

    @property
    def page_size(self) -> int:
        return self.keys.shape[3]

    @property
    def num_slots(self) -> int:
        return self.block_table.shape[1] * self.keys.shape[3]

    def gather(self, pages: Array) -> tuple[Array, Array]:
        """Keys and values of ``pages`` (int32[B, n], -1 allowed: page 0 is read, to be
        masked) as ``[B, H, n * ps, D]`` in ``dtype``."""
        ids = jnp.maximum(pages, 0)
        out = []
        for codes, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)):
            block = codes[self.layer, ids]  # [B, n, H, ps, D']
            if self.bits is None:
                block = from_bits(block, self.dtype)
            else:
                from jaxkv.caches.quantized import dequantize  # the codec lives with its storage

                block = dequantize(block, from_bits(scales[self.layer, ids], self.scale_dtype), self.bits, self.dtype)
            b, n, h, ps, d = block.shape
            out.append(block.transpose(0, 2, 1, 3, 4).reshape(b, h, n * ps, d))
        return out[0], out[1]

    def dense(self) -> LayerView:
        keys, values = self.gather(self.block_table)
        return LayerView(*_zero_unfilled(keys, values, self.lengths), None, self.lengths, None)

    def slot_positions(self) -> Array:
        """int32[B, M * ps]: the position each slot holds, ``NO_POSITION`` where none."""
        return _filled_positions(self.lengths, self.num_slots)


def _register_view(cls: type, static: tuple[str, ...]) -> None:
    """Registers a view as a pytree whose ``static`` fields (dtypes, bit widths) are tree
    metadata, not leaves: so a view can be a ``jit`` output, a ``lax.cond`` branch result or
    a scan carry (as a NamedTuple every field was a leaf, and a dtype is not a JAX type)."""
    data = tuple(name for name in cls._fields if name not in static)

    def flatten(view):
        return [getattr(view, name) for name in data], tuple(getattr(view, name) for name in static)

    def unflatten(aux, children):
        return cls(**dict(zip(data, children)), **dict(zip(static, aux)))

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)


_register_view(ContiguousView, ("dtype",))
_register_view(QuantizedView, ("bits", "dtype", "scale_dtype"))
_register_view(PagedView, ("bits", "dtype", "scale_dtype"))
# The window is a Python int attend() takes as such: as a leaf, a view returned from jit
# carried it as an array, which attend refused (review 59).
_register_view(LayerView, ("sliding_window",))


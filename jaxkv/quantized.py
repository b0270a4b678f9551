"""Quantized cache: int8 or int4 keys/values with per-token, per-head scales.

Shapes use the package alphabet (L layers, B rows, H kv heads, S capacity, T new tokens,
D head dim) plus R for the full-precision residual and D' for the stored last axis
(``D`` for int8, ``D / 2`` for int4: two 4-bit values per byte).

Quantization is symmetric absmax per token and head: ``scale = max|x| / qmax`` over the
head dim (``qmax`` = 127 for int8, 7 for int4), ``q = round(x / scale)``, ``x ~ q * scale``.
Scales are stored in ``scale_dtype`` (bfloat16 by default, 2 bytes per token and head)
rounded *up*, so ``|x / scale| <= qmax`` never clips and the error of every element is at
most ``scale / 2 <= max|x| / (2 qmax) * (1 + 2**-7)`` (bfloat16 spacing is ``2**-7``
relative). An all-zero token gets scale 0 and dequantizes to exact zeros.

Each token is quantized once, when written; per-token scales do not depend on other
tokens, so quantizing later (as HF's quantized cache does for tokens leaving its residual)
would give the same bytes. The residual is therefore a ring of the ``R`` most recently
written tokens kept in the model dtype beside their quantized copies: attention reads
those positions exactly. ``residual_length=0`` disables it.

Layout and policy are those of :class:`jaxkv.StaticCache`: slot ``s`` holds position
``s``; per-row ``lengths``; a write past ``max_length`` raises ``ValueError`` eagerly and
is dropped and flagged ``OVERFLOW`` under jit; bad traced indices flag ``INVALID``.
``update`` returns the layer *dequantized* in the model dtype, ready for attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.cache import (
    _RowCache,
    INVALID,
    OVERFLOW,
    _check_beam_idx,
    _check_layout,
    _check_repeats,
    _check_reset_rows,
    _check_row_indices,
    _check_sizes,
    _check_states,
    _crop_targets,
    _flag,
    _floating_dtype,
    _is_traced,
    _layer_index,
    _new_counts,
    _raise_on_flags,
    _static_int,
    _write_target,
)
from jaxkv.sliding import LayerView

Array = jax.Array

__all__ = ["QuantizedCache", "dequantize", "quantize"]

_QMAX = {8: 127, 4: 7}


def _check_bits(bits: Any, who: str) -> int:
    if bits not in _QMAX or isinstance(bits, bool):
        raise ValueError(f"{who}: bits must be 8 or 4, got {bits!r}.")
    return int(bits)


def quantize(x: Any, bits: int = 8, *, scale_dtype: Any = jnp.bfloat16) -> tuple[Array, Array]:
    """Symmetric absmax quantization over the last axis.

    Args:
      x: [..., D] finite floating values.
      bits: 8 (int8 storage) or 4 (two values per uint8 byte; D must be even).
      scale_dtype: floating dtype of the scales; each is rounded up to it.

    Returns:
      ``(q, scale)``: ``q`` int8 [..., D] or uint8 [..., D / 2] (element ``2i`` in the low
      nibble, ``2i + 1`` in the high one, each a 4-bit two's complement value), and
      ``scale`` [...] in ``scale_dtype``. ``dequantize(q, scale, bits)`` is within
      ``scale / 2`` of ``x``, elementwise.

    Raises:
      ValueError: bits not 8/4, or an odd D with bits=4.
    """
    bits = _check_bits(bits, "quantize")
    x = jnp.asarray(x)
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"quantize: int4 packs two values per byte, so head_dim must be even, got {x.shape[-1]}.")
    qmax = _QMAX[bits]
    x32 = x.astype(jnp.float32)
    wanted = jnp.max(jnp.abs(x32), axis=-1) / jnp.float32(qmax)
    scale = wanted.astype(scale_dtype)
    # Round the stored scale up so that |x / scale| <= qmax: no clipping error.
    scale = jnp.where(
        scale.astype(jnp.float32) < wanted, jnp.nextafter(scale, jnp.asarray(jnp.inf, scale_dtype)), scale
    )
    s32 = scale.astype(jnp.float32)[..., None]
    q = jnp.round(x32 / jnp.where(s32 > 0, s32, jnp.float32(1.0)))  # an all-zero token: 0 / 1
    q = jnp.clip(q, -qmax, qmax).astype(jnp.int32)
    if bits == 8:
        return q.astype(jnp.int8), scale
    packed = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    return packed.astype(jnp.uint8), scale


def dequantize(q: Array, scale: Array, bits: int = 8, dtype: Any = jnp.float32) -> Array:
    """Inverse of :func:`quantize`: ``[..., D]`` in ``dtype``."""
    bits = _check_bits(bits, "dequantize")
    if bits == 8:
        values = q.astype(jnp.float32)
    else:
        b = q.astype(jnp.int32)
        lo = ((b & 0xF) ^ 8) - 8  # sign-extend a 4-bit two's complement nibble
        hi = ((b >> 4) ^ 8) - 8
        values = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1]).astype(jnp.float32)
    return (values * scale.astype(jnp.float32)[..., None]).astype(dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedCache(_RowCache):
    """Preallocated int8/int4 cache with per-token, per-head scales and an optional
    full-precision residual of the most recent tokens.

    Attributes:
      keys: [L, B, H, S, D'] quantized keys (int8, or uint8 holding two int4 values).
      values: [L, B, H, S, D'] quantized values.
      key_scales: [L, B, H, S] per-token, per-head key scales (``scale_dtype``).
      value_scales: [L, B, H, S] value scales.
      residual_keys: [L, B, H, R, D] the last R written keys in the model dtype; the token
        at position ``p`` is in slot ``p % R``.
      residual_values: [L, B, H, R, D] the same for values.
      residual_positions: int32[L, B, R] position held by each residual slot (-1: none);
        a slot is used iff ``0 <= position < lengths``.
      lengths: int32[L, B] tokens stored per layer and row.
      flags: int32[B] sticky error bits (``OVERFLOW``, ``INVALID``).
      bits: static, 8 or 4.
      dtype: static model dtype: what ``update`` returns and the residual stores.

    Example:
      >>> cache = QuantizedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4,
      ...                             max_length=8, bits=4, residual_length=2)
      >>> k = jnp.arange(12.0).reshape(1, 1, 3, 4)
      >>> cache, keys, values = cache.update(k, k, 0)   # keys: [1, 1, 8, 4] float32
      >>> bool((keys[0, 0, 1:3] == k[0, 0, 1:3]).all())  # the last 2 are exact
      True
    """

    keys: Array
    values: Array
    key_scales: Array
    value_scales: Array
    residual_keys: Array
    residual_values: Array
    residual_positions: Array
    lengths: Array
    flags: Array
    bits: int  # static
    dtype: Any  # static

    # ---- construction

    @classmethod
    def init(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        bits: int = 8,
        residual_length: int = 0,
        dtype: Any = jnp.float32,
        scale_dtype: Any = jnp.bfloat16,
    ) -> QuantizedCache:
        """Allocates an empty quantized cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim, max_length: sizes (ints >= 1).
          bits: 8 or 4. With 4, head_dim must be even.
          residual_length: R >= 0 most recent tokens also kept in ``dtype``.
          dtype: the model dtype (floating): what attention reads.
          scale_dtype: floating dtype of the scales (bfloat16: 2 bytes per token and head).

        Raises:
          ValueError: a size < 1, bits not 8/4, odd head_dim with int4, negative R.
          TypeError: a non-floating dtype or scale_dtype.
        """
        who = "QuantizedCache.init"
        _check_sizes(
            who, num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_length=max_length,
        )
        bits = _check_bits(bits, who)
        if bits == 4 and head_dim % 2:
            raise ValueError(f"{who}: int4 packs two values per byte, so head_dim must be even, got {head_dim}.")
        if _static_int(residual_length) is None or residual_length < 0:
            raise ValueError(f"{who}: residual_length must be an int >= 0, got {residual_length!r}.")
        dtype = _floating_dtype(dtype, who)
        scale_dtype = _floating_dtype(scale_dtype, who)
        lead = (num_layers, batch_size, num_kv_heads)
        stored = (*lead, max_length, head_dim if bits == 8 else head_dim // 2)
        qdtype = jnp.int8 if bits == 8 else jnp.uint8
        residual = (*lead, residual_length, head_dim)
        return cls(
            keys=jnp.zeros(stored, qdtype),
            values=jnp.zeros(stored, qdtype),
            key_scales=jnp.zeros((*lead, max_length), scale_dtype),
            value_scales=jnp.zeros((*lead, max_length), scale_dtype),
            residual_keys=jnp.zeros(residual, dtype),
            residual_values=jnp.zeros(residual, dtype),
            residual_positions=jnp.full((num_layers, batch_size, residual_length), -1, jnp.int32),
            lengths=jnp.zeros((num_layers, batch_size), jnp.int32),
            flags=jnp.zeros((batch_size,), jnp.int32),
            bits=bits,
            dtype=dtype,
        )

    # ---- shape facts (static)

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    @property
    def head_dim(self) -> int:
        return self.residual_keys.shape[4]

    @property
    def residual_length(self) -> int:
        return self.residual_keys.shape[3]

    # ---- sequence protocol

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        """The layer dequantized: ``(keys, values)`` [B, H, S, D] in the model dtype."""
        i = _layer_index(layer_idx, self.num_layers, "QuantizedCache.__getitem__", allow_traced=False)
        return self._dequantized(i)

    # ---- queries

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: tokens stored per row in ``layer_idx``."""
        return self.lengths[_layer_index(layer_idx, self.num_layers, "QuantizedCache.seq_lengths")]

    def get_max_length(self) -> int:
        """The capacity ``S``."""
        return self.max_length

    def positions(self, num_tokens: int, layer_idx: Any = 0) -> Array:
        """int32[B, T]: the absolute positions the next ``num_tokens`` tokens will take."""
        return self.seq_lengths(layer_idx)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def check(self) -> QuantizedCache:
        """Raises ``CacheError`` on the host if any flag is set; returns ``self`` otherwise."""
        _raise_on_flags(
            self.flags,
            "QuantizedCache",
            f"overflowed max_length={self.max_length} (tokens past capacity were dropped)",
            "got an out-of-range index or num_new",
        )
        return self

    # ---- ops

    def update(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[QuantizedCache, Array, Array]:
        """Quantizes and writes new tokens of one layer, each row at its own offset.

        Args:
          key_states: [B, H, T, D] new keys.
          value_states: [B, H, T, D] new values.
          layer_idx: int in ``[0, L)``, or a traced int32 scalar (``lax.scan`` over layers).
          num_new: optional int32[B]: how many of the T tokens are real per row.

        Returns:
          ``(new_cache, keys [B, H, S, D], values [B, H, S, D])``: the layer dequantized in
          the model dtype (residual positions exact); row ``b`` is valid in slots
          ``< new_cache.seq_lengths(layer_idx)[b]``.

        Raises:
          ValueError: wrong shapes, an out-of-range static layer, a concrete ``num_new``
            outside ``[0, T]``, or (eagerly) a write past ``max_length``.
          TypeError: non-floating states or a non-integer ``num_new``.
        """
        cache, view = self.update_view(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.keys, view.values

    def update_view(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[QuantizedCache, LayerView]:
        """:meth:`update`, returning a :class:`~jaxkv.sliding.LayerView` for attention."""
        who = "QuantizedCache.update"
        key_states, value_states = _check_states(key_states, value_states, who)
        _check_layout(key_states, (self.batch_size, self.num_kv_heads, self.head_dim), who)
        layer = _layer_index(layer_idx, self.num_layers, who)
        batch, capacity, new_tokens = self.batch_size, self.max_length, key_states.shape[2]
        count, invalid_row = _new_counts(num_new, batch, new_tokens, who)
        layer_ok, read_layer, write_layer = _write_target(layer, self.num_layers)
        old = self.lengths[read_layer]
        if not _is_traced(old, count, layer):
            total = np.asarray(old) + np.asarray(count)
            over = total > capacity
            if over.any():
                row = int(np.argmax(over))
                raise ValueError(
                    f"{who}: overflow in layer {int(layer)}, row {row}: it holds "
                    f"{int(np.asarray(old)[row])} tokens and {int(np.asarray(count)[row])} new "
                    f"would make {int(total[row])} > max_length={capacity}. Allocate a larger "
                    "max_length, or crop the row first."
                )

        t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
        pos = old[:, None] + t  # [B, T]
        write = (t < count[:, None]) & (pos < capacity) & layer_ok
        slot = jnp.where(write, pos, capacity)  # `capacity` is out of bounds: dropped, never clamped
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        scale_dtype = self.key_scales.dtype
        kq, ks = quantize(key_states, self.bits, scale_dtype=scale_dtype)  # [B, H, T, D'], [B, H, T]
        vq, vs = quantize(value_states, self.bits, scale_dtype=scale_dtype)
        at = (write_layer, rows, slice(None), slot)
        keys = self.keys.at[at].set(kq.transpose(0, 2, 1, 3), mode="drop")
        values = self.values.at[at].set(vq.transpose(0, 2, 1, 3), mode="drop")
        key_scales = self.key_scales.at[at].set(ks.transpose(0, 2, 1), mode="drop")
        value_scales = self.value_scales.at[at].set(vs.transpose(0, 2, 1), mode="drop")

        residual_keys, residual_values = self.residual_keys, self.residual_values
        residual_positions = self.residual_positions
        r = self.residual_length
        if r:
            # The last R stored tokens of each row; distinct slots, so no scatter collisions.
            keep = write & (t >= jnp.minimum(count, capacity - old)[:, None] - r)
            rslot = jnp.where(keep, jnp.mod(pos, r), r)
            rat = (write_layer, rows, slice(None), rslot)
            residual_keys = residual_keys.at[rat].set(key_states.astype(self.dtype).transpose(0, 2, 1, 3), mode="drop")
            residual_values = residual_values.at[rat].set(
                value_states.astype(self.dtype).transpose(0, 2, 1, 3), mode="drop"
            )
            residual_positions = residual_positions.at[write_layer, rows, rslot].set(pos, mode="drop")

        new_len = jnp.minimum(old + count, capacity)
        flags = self.flags | _flag(old + count > capacity, OVERFLOW)
        flags = flags | _flag(invalid_row | jnp.logical_not(layer_ok), INVALID)
        new = dataclasses.replace(
            self,
            keys=keys,
            values=values,
            key_scales=key_scales,
            value_scales=value_scales,
            residual_keys=residual_keys,
            residual_values=residual_values,
            residual_positions=residual_positions,
            lengths=self.lengths.at[write_layer].set(new_len, mode="drop"),
            flags=flags,
        )
        keys_out, values_out = new._dequantized(read_layer)
        return new, LayerView(keys_out, values_out, None, new.lengths[read_layer], None)

    def _dequantized(self, layer: Any) -> tuple[Array, Array]:
        keys = dequantize(self.keys[layer], self.key_scales[layer], self.bits, self.dtype)
        values = dequantize(self.values[layer], self.value_scales[layer], self.bits, self.dtype)
        if self.residual_length:
            rp = self.residual_positions[layer]  # [B, R]
            used = (rp >= 0) & (rp < self.lengths[layer][:, None])
            slot = jnp.where(used, rp, self.max_length)
            rows = jnp.arange(self.batch_size, dtype=jnp.int32)[:, None]
            keys = keys.at[rows, :, slot].set(self.residual_keys[layer].transpose(0, 2, 1, 3), mode="drop")
            values = values.at[rows, :, slot].set(self.residual_values[layer].transpose(0, 2, 1, 3), mode="drop")
        return keys, values

    def crop(self, max_length: Any) -> QuantizedCache:
        """Keeps at most ``max_length`` tokens per row (int or int32[B]; negative drops
        that many off the end), in every layer; moves no data. See ``StaticCache.crop``."""
        target = _crop_targets(max_length, self.lengths[0], self.batch_size, "QuantizedCache.crop")
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, target[None, :]))

    def _map_rows(self, fn) -> QuantizedCache:
        """Applies ``fn(x, axis)`` to every leaf along its batch axis."""
        return dataclasses.replace(
            self,
            keys=fn(self.keys, 1),
            values=fn(self.values, 1),
            key_scales=fn(self.key_scales, 1),
            value_scales=fn(self.value_scales, 1),
            residual_keys=fn(self.residual_keys, 1),
            residual_values=fn(self.residual_values, 1),
            residual_positions=fn(self.residual_positions, 1),
            lengths=fn(self.lengths, 1),
            flags=fn(self.flags, 0),
        )

    def _gather_rows(self, idx: Array) -> QuantizedCache:
        ok = (idx >= 0) & (idx < self.batch_size)
        safe = jnp.where(ok, idx, 0)
        out = self._map_rows(lambda x, axis: jnp.take(x, safe, axis=axis))
        return dataclasses.replace(
            out,
            lengths=jnp.where(ok[None, :], out.lengths, 0),
            flags=jnp.where(ok, out.flags, jnp.int32(INVALID)),
        )

    def reorder_cache(self, beam_idx: Any) -> QuantizedCache:
        """Gathers rows (data, scales and residual) by ``beam_idx`` (int[B])."""
        return self._gather_rows(_check_beam_idx(beam_idx, self.batch_size, "QuantizedCache.reorder_cache"))

    def batch_select_indices(self, indices: Any) -> QuantizedCache:
        """Keeps only the rows in ``indices`` (int[N]), in that order."""
        return self._gather_rows(_check_row_indices(indices, self.batch_size, "QuantizedCache.batch_select_indices"))

    def batch_repeat_interleave(self, repeats: int) -> QuantizedCache:
        """Repeats every row ``repeats`` times, interleaved: rows a, b -> a, a, b, b."""
        r = _check_repeats(repeats, "QuantizedCache.batch_repeat_interleave")
        n = self.batch_size * r
        return self._map_rows(lambda x, axis: jnp.repeat(x, r, axis=axis, total_repeat_length=n))

    def reset(self, rows: Any = None) -> QuantizedCache:
        """Empties the cache (or the rows where ``rows`` (bool[B]) is true)."""
        if rows is None:
            rows = jnp.ones((self.batch_size,), bool)
        rows = _check_reset_rows(rows, self.batch_size, "QuantizedCache.reset")
        return dataclasses.replace(
            self,
            lengths=jnp.where(rows[None, :], 0, self.lengths),
            residual_positions=jnp.where(rows[None, :, None], -1, self.residual_positions),
            flags=jnp.where(rows, 0, self.flags),
        )


register_dataclass(
    QuantizedCache,
    data_fields=[
        "keys",
        "values",
        "key_scales",
        "value_scales",
        "residual_keys",
        "residual_values",
        "residual_positions",
        "lengths",
        "flags",
    ],
    meta_fields=["bits", "dtype"],
)

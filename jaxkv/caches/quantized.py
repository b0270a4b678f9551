"""Quantized cache: int8 or int4 keys/values with per-token, per-head scales.

Shapes use the package alphabet (L layers, B rows, H kv heads, S capacity, T new tokens,
D head dim) plus R for the full-precision residual and D' for the stored last axis
(``D`` for int8, ``D / 2`` for int4: two 4-bit values per byte).

Quantization is symmetric absmax per token and head: ``scale = max|x| / qmax`` over the
head dim (``qmax`` = 127 for int8, 7 for int4), ``q = round(x / scale)``, ``x ~ q * scale``.
Scales are stored in ``scale_dtype`` (bfloat16 by default, 2 bytes per token and head)
rounded *up*, so ``|x / scale| <= qmax`` never clips and the error of every element is at
most ``scale / 2 <= max|x| / (2 qmax) * (1 + 2**-7)`` (bfloat16 spacing is ``2**-7``
relative). An all-zero token gets scale 0 and dequantizes to exact zeros. With
``scale_dtype=float16`` a token with ``max|x| > qmax * 65504`` saturates (its scale is
float16's largest; its elements are clipped to ``+-qmax * 65504``) rather than turning into
NaN; bfloat16 scales have float32's range. At the other end, a float16 scale below float16's
smallest normal (``max|x| < qmax * 2**-14``, about 7.8e-3 for int8) has fewer significant
bits: the error stays at most ``scale / 2`` and nothing clips, but rounding the scale up
can make it several times ``max|x| / qmax`` (3.3x the bound above at ``max|x|`` = 1e-6);
bfloat16 scales keep their 8 bits down to 1e-38.

Each token is quantized once, when written; per-token scales do not depend on other
tokens, so quantizing later (as HF's quantized cache does for tokens leaving its residual)
would give the same bytes. The residual is therefore a ring of the ``R`` most recently
written tokens kept in the model dtype beside their quantized copies: attention reads
those positions exactly. ``residual_length=0`` disables it.

Layout and policy are those of :class:`jaxkv.StaticCache` (the container
:class:`jaxkv.caches.container.KVCache`): slot ``s`` holds position ``s``; per-row
``lengths``; a write past ``max_length`` raises ``ValueError`` eagerly and is dropped and
flagged ``OVERFLOW`` under jit; bad traced indices flag ``INVALID``. ``update`` returns
the layer *dequantized* in the model dtype (the HF vocabulary); attention never does
that: it reads a :class:`~jaxkv.caches.views.QuantizedView` and dequantizes block by
block inside its loop (:mod:`jaxkv.attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.tree_util import register_dataclass

from jaxkv.caches._bits import not_differentiable, stored_dtype, to_bits
from jaxkv.caches._checks import _check_extra, _check_sizes, _floating_dtype, _static_int
from jaxkv.caches.container import KVCache, storage_field
from jaxkv.caches.contiguous import scatter_slots, token_slots
from jaxkv.caches.views import QuantizedView

Array = jax.Array

__all__ = ["QuantizedCache", "QuantizedStorage", "dequantize", "quantize"]

_QMAX = {8: 127, 4: 7}


def _check_bits(bits: Any, who: str) -> int:
    b = _static_int(bits)  # an int or NumPy int: not a bool, not a float (8.0), not an array
    if b not in _QMAX:
        raise ValueError(f"{who}: bits must be 8 or 4, got {bits!r}.")
    return b


def quantize(x: Any, bits: int = 8, *, scale_dtype: Any = jnp.bfloat16) -> tuple[Array, Array]:
    """Symmetric absmax quantization over the last axis.

    Args:
      x: [..., D] floating values. A token (a row over D) with a NaN or inf element gets a
        NaN scale and zero codes: it dequantizes to NaN (never to a finite stand-in).
      bits: 8 (int8 storage) or 4 (two values per uint8 byte; D must be even).
      scale_dtype: floating dtype of the scales; each is rounded up to it. A scale beyond
        the dtype's range saturates at its largest finite value (float16: tokens with
        ``max|x| > qmax * 65504`` are clipped there instead of turning into NaN; bfloat16
        and float32 have float32's range).

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
    # integer codes carry no gradient (JAX's own rule failed on 'nextafter'): a clear error instead
    x32 = not_differentiable(x.astype(jnp.float32), "quantization (a quantized cache's integer codes)")
    wanted = jnp.max(jnp.abs(x32), axis=-1) / jnp.float32(qmax)
    # A scale past the dtype's range (float16: |x| > qmax * 65504) would round to inf and
    # dequantize to NaN: it saturates at the largest finite scale instead (such a token is
    # clipped to +-qmax * that scale, which is documented in the cache's docstring).
    top = jnp.float32(jnp.finfo(scale_dtype).max)
    scale = jnp.minimum(wanted, top).astype(scale_dtype)
    # Round the stored scale up so that |x / scale| <= qmax: no clipping error.
    scale = jnp.where(
        (scale.astype(jnp.float32) < wanted) & (scale.astype(jnp.float32) < top),
        jnp.nextafter(scale, jnp.asarray(jnp.inf, scale_dtype)),
        scale,
    )
    # A token holding NaN or inf gets a NaN scale (codes 0): it reads back as NaN, so attention
    # that sees it gives NaN as over a float cache (the non-finite contract of
    # jaxkv.attention.dense), where the saturation above would have stored it as a finite token.
    finite = jnp.isfinite(wanted)
    scale = jnp.where(finite, scale, jnp.asarray(jnp.nan, scale_dtype))
    s32 = scale.astype(jnp.float32)[..., None]
    q = jnp.round(x32 / jnp.where(s32 > 0, s32, jnp.float32(1.0)))  # an all-zero token: 0 / 1
    q = jnp.where(finite[..., None], jnp.clip(q, -qmax, qmax), 0.0).astype(jnp.int32)
    if bits == 8:
        return q.astype(jnp.int8), scale
    packed = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    return packed.astype(jnp.uint8), scale


def dequantize(q: Array, scale: Array, bits: int = 8, dtype: Any = jnp.float32) -> Array:
    """Inverse of :func:`quantize`: ``[..., D]`` in ``dtype``.

    Raises:
      ValueError: codes of the other width (``quantize``'s int8 read with ``bits=4``, its
        packed uint8 with ``bits=8``: [..., 2D] or [..., D/2] values, silently, before;
        review 84) or a scale not of shape ``q.shape[:-1]``.
    """
    bits = _check_bits(bits, "dequantize")
    want = jnp.int8 if bits == 8 else jnp.uint8
    if jnp.dtype(q.dtype) != want:
        raise ValueError(
            f"dequantize: bits={bits} reads {jnp.dtype(want).name} codes (quantize's), got {jnp.dtype(q.dtype).name}; "
            f"pass the bits the codes were made with (bits={4 if bits == 8 else 8}?)."
        )
    if tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"dequantize: scale must have shape {list(q.shape[:-1])} (one per code row), got "
                         f"{list(scale.shape)}.")
    if bits == 8:
        values = q.astype(jnp.float32)
    else:
        b = q.astype(jnp.int32)
        lo = ((b & 0xF) ^ 8) - 8  # sign-extend a 4-bit two's complement nibble
        hi = ((b >> 4) ^ 8) - 8
        values = jnp.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1]).astype(jnp.float32)
    out = values * scale.astype(jnp.float32)[..., None]
    # A scale is rounded up, so qmax * scale may pass a narrow dtype's largest value (float16:
    # 127 * 516 = 65532 for a stored 65504): clip, or a finite token would read back as inf.
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        # Only where the scale is finite: a non-finite scale stays non-finite (clipped, an
        # inf scale read as the dtype's largest value, a finite number, on the XLA and
        # dense paths where the kernels made the row NaN; review 65). A finite scale whose
        # product passes even float32's range (bfloat16 near its largest value) is clipped.
        top = jnp.float32(jnp.finfo(dtype).max)
        out = jnp.where(jnp.isfinite(scale)[..., None], jnp.clip(out, -top, top), out)
    return out.astype(dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedStorage:
    """int8/int4 codes with per-token, per-head scales, and a full-precision residual ring.

    Attributes:
      keys: [L, B, H, S, D'] quantized keys (int8, or uint8 holding two int4 values).
      values: [L, B, H, S, D'] quantized values.
      key_scales: [L, B, H, S] per-token, per-head key scales (``scale_dtype``; a 16-bit
        float is stored as its uint16 bits, see :mod:`jaxkv.caches._bits`).
      value_scales: [L, B, H, S] value scales, stored the same way.
      residual_keys: [L, B, H, R, D] the last R written keys in the model dtype; the token
        at position ``p`` is in slot ``p % R``.
      residual_values: [L, B, H, R, D] the same for values.
      residual_positions: int32[L, B, R] position held by each residual slot (-1: none);
        a slot is used iff ``0 <= position < length``.
      bits: static, 8 or 4.
      dtype: static model dtype: what attention reads and the residual stores.
      scale_dtype: static dtype of the scales.
    """

    keys: Array
    values: Array
    key_scales: Array
    value_scales: Array
    residual_keys: Array
    residual_values: Array
    residual_positions: Array
    bits: int  # static
    dtype: Any  # static
    scale_dtype: Any  # static

    LEAF_AXES: ClassVar[dict] = {
        "keys": ("layer", "batch", "heads", "seq", "packed"),
        "values": ("layer", "batch", "heads", "seq", "packed"),
        "key_scales": ("layer", "batch", "heads", "seq"),
        "value_scales": ("layer", "batch", "heads", "seq"),
        "residual_keys": ("layer", "batch", "heads", "slots", "dim"),
        "residual_values": ("layer", "batch", "heads", "slots", "dim"),
        "residual_positions": ("layer", "batch", "slots"),
    }

    @classmethod
    def zeros(cls, num_layers, batch_size, num_kv_heads, head_dim, max_length, bits, residual_length, dtype,
              scale_dtype) -> QuantizedStorage:
        lead = (num_layers, batch_size, num_kv_heads)
        stored = (*lead, max_length, head_dim if bits == 8 else head_dim // 2)
        qdtype = jnp.int8 if bits == 8 else jnp.uint8
        residual = (*lead, residual_length, head_dim)
        return cls(
            keys=jnp.zeros(stored, qdtype),
            values=jnp.zeros(stored, qdtype),
            key_scales=jnp.zeros((*lead, max_length), stored_dtype(scale_dtype)),
            value_scales=jnp.zeros((*lead, max_length), stored_dtype(scale_dtype)),
            residual_keys=jnp.zeros(residual, dtype),
            residual_values=jnp.zeros(residual, dtype),
            residual_positions=jnp.full((num_layers, batch_size, residual_length), -1, jnp.int32),
            bits=bits,
            dtype=dtype,
            scale_dtype=jnp.dtype(scale_dtype),
        )

    num_layers = property(lambda self: self.keys.shape[0])
    num_kv_heads = property(lambda self: self.keys.shape[2])
    capacity = property(lambda self: self.keys.shape[3])
    head_dim = property(lambda self: self.residual_keys.shape[4])
    residual_length = property(lambda self: self.residual_keys.shape[3])

    def write(self, read_layer, write_layer, layer_ok, keys, values, old, count):
        del read_layer, layer_ok  # a bad layer writes at `write_layer` == L: dropped
        capacity, new_tokens, r = self.capacity, keys.shape[2], self.residual_length
        slot = token_slots(old, count, new_tokens, capacity)
        kq, ks = quantize(keys, self.bits, scale_dtype=self.scale_dtype)  # [B, H, T, D'], [B, H, T]
        vq, vs = quantize(values, self.bits, scale_dtype=self.scale_dtype)
        new = dataclasses.replace(
            self,
            keys=scatter_slots(self.keys, write_layer, kq, slot),
            values=scatter_slots(self.values, write_layer, vq, slot),
            key_scales=scatter_slots(self.key_scales, write_layer, to_bits(ks, self.scale_dtype), slot),
            value_scales=scatter_slots(self.value_scales, write_layer, to_bits(vs, self.scale_dtype), slot),
        )
        if r:
            # The last R stored tokens of each row; distinct slots, so no scatter collisions.
            t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
            pos = old[:, None] + t
            keep = (slot < capacity) & (t >= jnp.minimum(count, capacity - old)[:, None] - r)
            rslot = jnp.where(keep, jnp.mod(pos, r), r)
            rows = jnp.arange(keys.shape[0], dtype=jnp.int32)[:, None]
            new = dataclasses.replace(
                new,
                residual_keys=scatter_slots(self.residual_keys, write_layer, keys, rslot),
                residual_values=scatter_slots(self.residual_values, write_layer, values, rslot),
                residual_positions=self.residual_positions.at[write_layer, rows, rslot].set(pos, mode="drop"),
            )
        return new, None

    def view(self, layer: Any, lengths: Array) -> QuantizedView:
        return QuantizedView(
            self.keys, self.values, self.key_scales, self.value_scales, self.residual_keys[layer],
            self.residual_values[layer], self.residual_positions[layer], layer, lengths, self.bits, self.dtype,
            self.scale_dtype,
        )

    def crop(self, old: Array, new: Array, **_: Any):
        # Residual slots at or past the new length stop counting as used by themselves. The
        # exact copies those cropped tokens overwrote are gone: the positions they held are
        # read from their codes until written again (README, crop).
        return self, jnp.zeros(new.shape, bool)

    def reset_rows(self, rows: Array) -> QuantizedStorage:
        return dataclasses.replace(
            self, residual_positions=jnp.where(rows[None, :, None], -1, self.residual_positions)
        )


register_dataclass(
    QuantizedStorage,
    data_fields=[
        "keys", "values", "key_scales", "value_scales", "residual_keys", "residual_values", "residual_positions",
    ],
    meta_fields=["bits", "dtype", "scale_dtype"],
)


class QuantizedCache(KVCache):
    """Preallocated int8/int4 cache with per-token, per-head scales and an optional
    full-precision residual of the most recent tokens (one :class:`QuantizedStorage`).

    Example:
      >>> cache = QuantizedCache.init(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4,
      ...                             max_length=8, bits=4, residual_length=2)
      >>> k = jnp.arange(12.0).reshape(1, 1, 3, 4)
      >>> cache, keys, values = cache.update(k, k, 0)   # keys: [1, 1, 8, 4] float32
      >>> bool((keys[0, 0, 1:3] == k[0, 0, 1:3]).all())  # the last 2 are exact
      True
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
        bits: int = 8,
        residual_length: int = 0,
        dtype: Any = jnp.float32,
        scale_dtype: Any = jnp.bfloat16,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> QuantizedCache:
        """Allocates an empty quantized cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim, max_length: sizes (ints >= 1).
          bits: 8 or 4. With 4, head_dim must be even.
          residual_length: R >= 0 most recent tokens also kept in ``dtype``.
          dtype: the model dtype (floating): what attention reads.
          scale_dtype: floating dtype of the scales (bfloat16: 2 bytes per token and head).
          sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]``, as for
            ``StaticCache.init`` (the packed last axis of int4 codes is not sharded).

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
        residual_length = _check_extra(residual_length, "residual_length", who)
        dtype = _floating_dtype(dtype, who)
        scale_dtype = _floating_dtype(scale_dtype, who)
        return cls._allocate(
            lambda: [QuantizedStorage.zeros(num_layers, batch_size, num_kv_heads, head_dim, max_length, bits,
                                            residual_length, dtype, scale_dtype)],
            num_layers=num_layers, batch_size=batch_size, groups=(0,) * num_layers, sharding=sharding,
        )

    keys = storage_field("keys", "[L, B, H, S, D'] quantized keys.")
    values = storage_field("values", "[L, B, H, S, D'] quantized values.")
    key_scales = storage_field("key_scales", "[L, B, H, S] key scales in scale_dtype.", dtype_of="scale_dtype")
    value_scales = storage_field("value_scales", "[L, B, H, S] value scales.", dtype_of="scale_dtype")

    residual_keys = storage_field("residual_keys", "[L, B, H, R, D] exact recent keys.")
    residual_values = storage_field("residual_values", "[L, B, H, R, D].")
    residual_positions = storage_field("residual_positions", "int32[L, B, R].")
    bits = storage_field("bits", "8 or 4.")
    max_length = storage_field("capacity", "The capacity S.")
    residual_length = storage_field("residual_length", "R.")

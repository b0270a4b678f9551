"""Encoder–decoder cache: a decoder self-attention cache plus a cross-attention cache.

Shapes: L decoder layers, B rows, H kv heads, E encoder tokens (capacity), T new decoder
tokens, D head dim.

The cross-attention keys/values depend only on the encoder output, so they are computed
once, after the encoder runs, for every layer (:meth:`CrossAttentionCache.from_layers`),
and only read while decoding (:meth:`EncoderDecoderCache.cross_view`). That replaces HF's
per-layer ``is_updated`` switch, which would be a data-dependent branch under ``jax.jit``.

Row operations (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``,
``reset``) apply to both parts; ``crop`` (decoder rollback) only to the self-attention part.
``reset`` empties both (a row that starts over gets a new source sequence); write the new
encoder states with :meth:`EncoderDecoderCache.set_cross_attention`.

Policy: the self-attention part keeps its own (``StaticCache`` etc.). Cross-attention has
no writes during decoding; a traced out-of-range row index empties the row and sets
``INVALID``, as everywhere in jaxkv.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.caches._checks import (
    INVALID,
    OVERFLOW,
    _check_beam_idx,
    _check_repeats,
    _check_reset_rows,
    _check_row_indices,
    _check_states,
    _flag,
    _floating_dtype,
    _is_traced,
    _layer_index,
    _raise_on_flags,
    _widen,
    _write_target,
)
from jaxkv.caches.container import KVCache
from jaxkv.caches.views import LayerView

Array = jax.Array

__all__ = ["CrossAttentionCache", "EncoderDecoderCache"]


@dataclasses.dataclass(frozen=True)
class CrossAttentionCache:
    """Per-layer keys/values of the encoder output, written once, read by every step.

    Attributes:
      keys: [L, B, H, E, D] cross-attention keys.
      values: [L, B, H, E, D] cross-attention values.
      lengths: int32[B] real encoder tokens per row (the rest is padding, never attended).
      flags: int32[B] sticky ``INVALID`` bits (a traced bad row index).
    """

    keys: Array
    values: Array
    lengths: Array
    flags: Array

    @classmethod
    def from_layers(
        cls, layers: Sequence[tuple[Any, Any]], lengths: Any = None, *, dtype: Any = None
    ) -> CrossAttentionCache:
        """Stacks ``[(k0, v0), (k1, v1), ...]``, each ``[B, H, E, D]``, into a cache.

        Args:
          layers: one (keys, values) pair per decoder layer, all of one shape.
          lengths: optional int[B] real encoder tokens per row (default E for all).
          dtype: storage dtype (default: that of the first keys).

        Raises:
          ValueError: no layers, mismatched shapes, or lengths outside ``[0, E]``.
          TypeError: non-floating states or non-integer lengths.
        """
        who = "CrossAttentionCache.from_layers"
        if not layers:
            raise ValueError(f"{who}: needs at least one (keys, values) layer.")
        pairs = [_check_states(k, v, f"{who} (layer {i})") for i, (k, v) in enumerate(layers)]
        shape = pairs[0][0].shape
        for i, (k, _) in enumerate(pairs):
            if k.shape != shape:
                raise ValueError(f"{who}: layer {i} has shape {k.shape}, layer 0 has {shape}; all must match.")
        # an integer dtype truncated the states (0.7 -> 0): refused as every kind refuses it
        dtype = pairs[0][0].dtype if dtype is None else _floating_dtype(dtype, who)
        keys = jnp.stack([k.astype(dtype) for k, _ in pairs])
        values = jnp.stack([v.astype(dtype) for _, v in pairs])
        batch, enc = shape[0], shape[2]
        lengths, bad = _check_lengths(lengths, batch, enc, who)
        # padding is stored as zero, as LayerView promises of every view (NaN padding leaked
        # into a user's masked softmax @ values); written once here, not on every read
        held = jnp.arange(enc)[None, :] < lengths[:, None]  # [B, E]
        values = jnp.where(held[None, :, None, :, None], values, jnp.zeros((), values.dtype))
        return cls(keys, values, lengths, _flag(bad, INVALID))

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def encoder_length(self) -> int:
        return self.keys.shape[3]

    def __len__(self) -> int:
        return self.num_layers

    def view(self, layer_idx: Any) -> LayerView:
        """What attention reads for ``layer_idx``: every real encoder token is visible to
        every query (positions 0, no causal order), padding is not."""
        i = _layer_index(layer_idx, self.num_layers, "CrossAttentionCache.view")
        positions = jnp.zeros((self.batch_size, self.encoder_length), jnp.int32)
        ok, read, _ = _write_target(i, self.num_layers)  # a bad traced layer reads as empty, not another
        return LayerView(self.keys[read], self.values[read], positions, jnp.where(ok, self.lengths, 0), None)

    def _gather_rows(self, idx: Array) -> CrossAttentionCache:
        ok = (idx >= 0) & (idx < self.batch_size)
        safe = jnp.where(ok, idx, 0)
        gone = ~ok[None, :, None, None, None]  # a bad traced index: an empty row, zeros as every empty entry
        return CrossAttentionCache(
            keys=jnp.where(gone, 0, jnp.take(self.keys, safe, axis=1)).astype(self.keys.dtype),
            values=jnp.where(gone, 0, jnp.take(self.values, safe, axis=1)).astype(self.values.dtype),
            lengths=jnp.where(ok, jnp.take(self.lengths, safe), 0),
            flags=jnp.where(ok, jnp.take(self.flags, safe), jnp.int32(INVALID)),
        )

    def _repeat(self, r: int) -> CrossAttentionCache:
        n = self.batch_size * r
        return CrossAttentionCache(
            keys=jnp.repeat(self.keys, r, axis=1, total_repeat_length=n),
            values=jnp.repeat(self.values, r, axis=1, total_repeat_length=n),
            lengths=jnp.repeat(self.lengths, r, total_repeat_length=n),
            flags=jnp.repeat(self.flags, r, total_repeat_length=n),
        )

    def _reset(self, rows: Array) -> CrossAttentionCache:
        # The states too: a view's entries past its length read as zero (LayerView's promise;
        # the old encoder states stayed there, review 59). Only a reset pays for it.
        gone = rows[None, :, None, None, None]
        return dataclasses.replace(
            self, keys=jnp.where(gone, 0, self.keys).astype(self.keys.dtype),
            values=jnp.where(gone, 0, self.values).astype(self.values.dtype),
            lengths=jnp.where(rows, 0, self.lengths), flags=jnp.where(rows, 0, self.flags)
        )


def _check_lengths(lengths: Any, batch: int, enc: int, who: str) -> tuple[Array, Array]:
    """``(int32[B] lengths, bool[B] bad)``: a traced length outside ``[0, E]`` (tested in its
    own dtype) empties the row and is reported as bad (flagged ``INVALID``), never clamped."""
    if lengths is None:
        return jnp.full((batch,), enc, jnp.int32), jnp.zeros((batch,), bool)
    traced = _is_traced(lengths)
    lengths = lengths if traced else np.asarray(lengths)  # concrete: checked in its own dtype, never wrapped
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(
            f"{who}: lengths must be an int array of shape [{batch}], got shape {lengths.shape} "
            f"and dtype {lengths.dtype}."
        )
    if not traced:
        bad = (lengths < 0) | (lengths > enc)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"{who}: lengths[{row}]={int(lengths[row])} is outside [0, {enc}] (encoder tokens).")
        return jnp.asarray(lengths.astype(np.int32)), jnp.zeros((batch,), bool)
    lengths = _widen(lengths)
    bad = (lengths < 0) | (lengths > enc)  # in its own dtype, before narrowing
    return jnp.where(bad, 0, lengths).astype(jnp.int32), bad


@dataclasses.dataclass(frozen=True)
class EncoderDecoderCache:
    """A decoder's self-attention cache and its cross-attention cache, as one pytree.

    Attributes:
      self_attention: any jaxkv cache (``StaticCache``, ``DynamicCache``,
        ``SlidingWindowCache``, ``QuantizedCache``, ``HybridCache``).
      cross_attention: the :class:`CrossAttentionCache` of the encoder output.

    Example:
      >>> enc = EncoderDecoderCache.create(
      ...     StaticCache.init(num_layers=2, batch_size=1, num_kv_heads=1, head_dim=4, max_length=16),
      ...     CrossAttentionCache.from_layers([(ck, cv), (ck, cv)]))          # doctest: +SKIP
      >>> enc, k_all, v_all = enc.update(k, v, 0)                           # doctest: +SKIP
      >>> view = enc.cross_view(0)   # attend(q, view.keys, ...)             # doctest: +SKIP
    """

    self_attention: Any
    cross_attention: CrossAttentionCache

    def __post_init__(self) -> None:
        # transformers builds EncoderDecoderCache(DynamicCache(), DynamicCache()): taken as it
        # was, its cross part was read as a causal self-attention layer (slot s at position s),
        # a silently wrong cross-attention (review 78). JAX rebuilds the tree through here with
        # the same node types, so a type check holds for every leaf it brings.
        # Only a cache in the cross part is refused: JAX prefix trees (vmap axes, shardings) and
        # tree maps with is_leaf build this node with other leaves (review 82).
        who = "EncoderDecoderCache"
        cross = self.cross_attention
        if not isinstance(cross, CrossAttentionCache) and (
            hasattr(cross, "write") or (hasattr(cross, "update") and hasattr(cross, "get_seq_length"))
        ):
            raise TypeError(
                f"{who}: cross_attention must be a CrossAttentionCache, got a {type(cross).__name__} (the transformers "
                "form EncoderDecoderCache(self_cache, cross_cache)): pass the encoder's states as "
                f"CrossAttentionCache.from_layers(cross_cache.to_legacy_cache()), and pair the two with "
                f"{who}.create(self_cache, cross_cache)."
            )

    @classmethod
    def create(cls, self_attention: Any, cross_attention: CrossAttentionCache) -> EncoderDecoderCache:
        """Pairs the two caches after checking that they agree on layers and rows.

        Raises:
          ValueError: different numbers of layers or batch sizes.
          TypeError: ``cross_attention`` is not a ``CrossAttentionCache``.
        """
        who = "EncoderDecoderCache.create"
        if not isinstance(cross_attention, CrossAttentionCache):
            raise TypeError(
                f"{who}: cross_attention must be a CrossAttentionCache (build it with "
                f"CrossAttentionCache.from_layers), got {type(cross_attention).__name__}."
            )
        if len(self_attention) and len(self_attention) != len(cross_attention):
            raise ValueError(
                f"{who}: the self-attention cache has {len(self_attention)} layers, the cross-attention "
                f"cache {len(cross_attention)}; a decoder layer needs one of each."
            )
        batch = self_attention.batch_size
        if batch is not None and batch != cross_attention.batch_size:
            raise ValueError(
                f"{who}: the self-attention cache has batch={batch}, the cross-attention cache "
                f"batch={cross_attention.batch_size}."
            )
        return cls(self_attention, cross_attention)

    # ---- protocol

    def __len__(self) -> int:
        return len(self.cross_attention)

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array, Array, Array]:
        """``(self_keys, self_values, cross_keys, cross_values)`` of a layer (HF's legacy
        encoder–decoder tuple)."""
        i = _layer_index(layer_idx, len(self), "EncoderDecoderCache.__getitem__", allow_traced=False)
        k, v = self.self_attention[i]
        return k, v, self.cross_attention.keys[i], self.cross_attention.values[i]

    def __iter__(self) -> Iterator[tuple[Array, Array, Array, Array]]:
        for i in range(len(self)):
            yield self[i]

    @property
    def batch_size(self) -> int:
        return self.cross_attention.batch_size

    @property
    def flags(self) -> Array:
        """int32[B]: the flags of both parts, OR-ed (a DynamicCache has none)."""
        own = getattr(self.self_attention, "flags", None)
        return self.cross_attention.flags if own is None else own | self.cross_attention.flags

    @property
    def overflowed(self) -> Array:
        """bool[B]: rows whose self-attention part lost a token to overflow."""
        return (self.flags & OVERFLOW) != 0

    def check(self) -> EncoderDecoderCache:
        """Raises ``CacheError`` if either part has a flag set."""
        self.self_attention.check()
        _raise_on_flags(self.cross_attention.flags, "EncoderDecoderCache (cross-attention)", "", "got an out-of-range index")
        return self

    # ---- queries (self-attention)

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: decoder tokens cached per row in ``layer_idx``."""
        return self.positions(1, layer_idx)[:, 0]

    def get_seq_length(self, layer_idx: Any = 0) -> int | Array:
        return self.self_attention.get_seq_length(layer_idx)

    def get_max_length(self) -> int | None:
        return self.self_attention.get_max_length()

    def encoder_lengths(self) -> Array:
        """int32[B]: real encoder tokens per row."""
        return self.cross_attention.lengths

    def positions(self, num_tokens: int, layer_idx: Any = 0, *, batch_size: int | None = None) -> Array:
        """int32[B, T]: the decoder positions of the next ``num_tokens`` tokens."""
        return self.self_attention.positions(num_tokens, layer_idx, batch_size=self.batch_size)

    # ---- ops

    def update(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[EncoderDecoderCache, Array, Array]:
        """Writes decoder self-attention states; see the self-attention cache's ``update``."""
        if isinstance(self.self_attention, KVCache):  # its update (one program, eagerly)
            own, keys, values = self.self_attention.update(key_states, value_states, layer_idx, num_new=num_new)
            return dataclasses.replace(self, self_attention=own), keys, values
        cache, view = self.update_view(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.keys, view.values

    def update_view(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[EncoderDecoderCache, LayerView]:
        """Writes decoder self-attention states; returns the cache and the dense
        self-attention :class:`~jaxkv.caches.views.LayerView` (:meth:`cross_view` for
        cross-attention)."""
        cache, view = self.write(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.dense()

    def write(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[EncoderDecoderCache, Any]:
        """Writes decoder self-attention states; returns the cache and the self part's view
        (what attention reads; a StaticCache self part is read blockwise).

        Raises:
          ValueError: ``num_new`` with a DynamicCache self part, or any error of its write.
        """
        own, view = self.self_attention.write(key_states, value_states, layer_idx, num_new=num_new)
        return dataclasses.replace(self, self_attention=own), view

    def view(self, layer_idx: Any) -> Any:
        """The self-attention layer as it is now, as attention reads it (no write)."""
        return self.self_attention.view(layer_idx)

    def cross_view(self, layer_idx: Any) -> LayerView:
        """The cross-attention :class:`~jaxkv.caches.LayerView` of ``layer_idx``:
        ``attend(q, v.keys, v.values, q_positions=positions, kv_lengths=v.kv_lengths,
        kv_positions=v.kv_positions)`` lets every query see every real encoder token."""
        return self.cross_attention.view(layer_idx)

    def set_cross_attention(
        self, layers: Sequence[tuple[Any, Any]], lengths: Any = None, *, rows: Any = None
    ) -> EncoderDecoderCache:
        """Replaces the cross-attention states (all rows, or the rows where ``rows``
        (bool[B]) is true, e.g. after ``reset(rows)`` for a new request).

        Raises:
          ValueError / TypeError: as :meth:`CrossAttentionCache.from_layers`; a shape other
            than the current ``[B, H, E, D]`` per layer.
        """
        cross = self.cross_attention
        new = CrossAttentionCache.from_layers(layers, lengths, dtype=cross.keys.dtype)
        if new.keys.shape != cross.keys.shape:
            raise ValueError(
                f"EncoderDecoderCache.set_cross_attention: new states have shape {new.keys.shape[1:]} per "
                f"layer ({new.num_layers} layers), the cache holds {cross.keys.shape[1:]} "
                f"({cross.num_layers} layers). Build a new cache for another encoder length."
            )
        if rows is None:
            return dataclasses.replace(self, cross_attention=new)
        rows = _check_reset_rows(rows, self.batch_size, "EncoderDecoderCache.set_cross_attention")
        pick = rows[None, :, None, None, None]
        merged = CrossAttentionCache(
            keys=jnp.where(pick, new.keys, cross.keys),
            values=jnp.where(pick, new.values, cross.values),
            lengths=jnp.where(rows, new.lengths, cross.lengths),
            flags=jnp.where(rows, new.flags, cross.flags),
        )
        return dataclasses.replace(self, cross_attention=merged)

    def crop(self, max_length: Any) -> EncoderDecoderCache:
        """Rolls back the decoder self-attention only; the encoder states stay."""
        return dataclasses.replace(self, self_attention=self.self_attention.crop(max_length))

    def reorder_cache(self, beam_idx: Any) -> EncoderDecoderCache:
        """Gathers the rows of both parts by ``beam_idx`` (int[B])."""
        idx = _check_beam_idx(beam_idx, self.batch_size, "EncoderDecoderCache.reorder_cache")
        return EncoderDecoderCache(self.self_attention.reorder_cache(idx), self.cross_attention._gather_rows(idx))

    def batch_select_indices(self, indices: Any) -> EncoderDecoderCache:
        """Keeps only the rows in ``indices`` (int[N]) in both parts."""
        idx = _check_row_indices(indices, self.batch_size, "EncoderDecoderCache.batch_select_indices")
        return EncoderDecoderCache(
            self.self_attention.batch_select_indices(idx), self.cross_attention._gather_rows(idx)
        )

    def batch_repeat_interleave(self, repeats: int) -> EncoderDecoderCache:
        """Repeats every row of both parts ``repeats`` times, interleaved."""
        r = _check_repeats(repeats, "EncoderDecoderCache.batch_repeat_interleave")
        return EncoderDecoderCache(self.self_attention.batch_repeat_interleave(r), self.cross_attention._repeat(r))

    def reset(self, rows: Any = None) -> EncoderDecoderCache:
        """Empties both parts (or the rows where ``rows`` (bool[B]) is true).

        Raises:
          TypeError: per-row reset of a ``DynamicCache`` self-attention part.
        """
        if rows is None:
            return EncoderDecoderCache(
                self.self_attention.reset(), self.cross_attention._reset(jnp.ones((self.batch_size,), bool))
            )
        rows = _check_reset_rows(rows, self.batch_size, "EncoderDecoderCache.reset")
        return EncoderDecoderCache(self.self_attention.reset(rows), self.cross_attention._reset(rows))


register_dataclass(CrossAttentionCache, data_fields=["keys", "values", "lengths", "flags"], meta_fields=[])
register_dataclass(EncoderDecoderCache, data_fields=["self_attention", "cross_attention"], meta_fields=[])

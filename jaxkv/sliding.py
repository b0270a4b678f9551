"""Sliding-window cache: a ring buffer of ``window`` (+ ``extra_slots``) slots per layer.

Shapes use the package alphabet (L layers, B rows, H kv heads, T new tokens, D head dim)
plus W for the attention window and C = W + extra_slots for the ring's slots.

Memory is O(C) whatever the sequence length. Each row keeps its own absolute length (the
number of tokens it has seen, which is also the position of its next token); the token at
absolute position ``p`` lives in slot ``p % C``. A query at position ``p`` sees positions
``p - W + 1 .. p`` (itself and the ``W - 1`` before it, as HF transformers and
:func:`jaxkv.attention.attend` define the window).

Positions are the source of truth. :meth:`SlidingWindowCache.kv_positions` gives the
absolute position held by every slot; a slot that holds no token (never written, evicted,
cropped or reset) reports ``NO_POSITION`` (``2**31 - 1``), a position in the future of
every query, so ``attend`` masks it without a separate mask.

Multi-token chunks. Writing a chunk of ``T`` tokens overwrites the slots of positions
``p - C`` for every new ``p``; with ``T > C - W + 1`` some of those are still needed by the
chunk's own earlier queries. :meth:`SlidingWindowCache.update` therefore returns, for
attention, the ring as it was *before* the write followed by the chunk itself
(``[B, H, C + T, D]``), while the stored ring keeps the last ``C`` tokens. For short
chunks (``T <= C - W + 1``, which includes every decode step) nothing needed is
overwritten and the ring after the write (``[B, H, C, D]``) is returned. Use
:meth:`SlidingWindowCache.update_view` to get the matching positions.

Overflow and bad-index policy (that of :class:`jaxkv.StaticCache`): a ring never runs out
of room, so ``OVERFLOW`` is never set. Eagerly, an out-of-range layer/row index, a bad
``num_new`` or a ``crop`` that would need evicted tokens raises ``ValueError``; under
``jax.jit`` / ``vmap`` / ``scan`` these set the sticky ``INVALID`` flag of the row
instead (a traced bad layer writes nothing; a traced bad row index empties the row; a
crop past the evicted tokens still crops, leaving the row with fewer tokens than its
window needs). ``check()`` turns flags into a ``CacheError`` on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import register_dataclass

from jaxkv.cache import (
    _RowCache,
    INVALID,
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

Array = jax.Array

__all__ = ["NO_POSITION", "LayerView", "SlidingWindowCache"]

#: Position reported by a slot that holds no token: later than any query, so masked.
NO_POSITION = 2**31 - 1


class LayerView(NamedTuple):
    """What attention needs to read one layer after an update.

    ``attend(q, view.keys, view.values, q_positions=positions,
    kv_lengths=view.kv_lengths, kv_positions=view.kv_positions,
    sliding_window=view.sliding_window)`` is the attention of the new tokens.
    """

    keys: Array  # [B, H, S', D]
    values: Array  # [B, H, S', D]; entries that hold no token are zero
    kv_positions: Array | None  # int32[B, S'] (NO_POSITION: empty); None: slot s holds position s
    kv_lengths: Array  # int32[B]: slots at or past it are unused
    sliding_window: int | None  # the window of this layer, None for full attention


# ------------------------------------------------------ helpers shared by the cache kinds


def _slot_positions(lengths: Array, starts: Array, capacity: int) -> Array:
    """int32[B, C]: the position held by each ring slot, ``NO_POSITION`` where none."""
    slots = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    # The one position in [lengths - C, lengths) that maps to the slot; jnp.mod is >= 0.
    pos = last - jnp.mod(last - slots, capacity)
    held = (pos >= starts[:, None]) & (pos >= 0)
    return jnp.where(held, pos, jnp.int32(NO_POSITION))


def _zero_empty(values: Array, positions: Array) -> Array:
    """Zeros the value entries that hold no token (``0 * NaN`` would leak through attention)."""
    return jnp.where((positions != NO_POSITION)[:, None, :, None], values, jnp.zeros((), values.dtype))


# ------------------------------------------------------------------- SlidingWindowCache


@dataclasses.dataclass(frozen=True)
class SlidingWindowCache(_RowCache):
    """Ring-buffer cache of ``C = window + extra_slots`` slots per layer and row.

    Row ``b`` of layer ``l`` has seen ``lengths[l, b]`` tokens and still holds positions
    ``starts[l, b] .. lengths[l, b] - 1`` (at most ``C`` of them), position ``p`` in slot
    ``p % C``. ``starts`` is ``max(0, lengths - C)`` unless a crop rolled the row back.

    Rollback: ``crop`` back to length ``m`` is possible while the positions the next query
    needs (``m - W + 1 .. m - 1``) are still held: up to ``extra_slots + 1`` tokens behind
    a row that has seen at least ``C`` tokens, any amount before that. Allocate
    ``extra_slots`` for the deepest rollback you need (e.g. speculative decoding's draft
    length).

    All layers are stacked in one buffer, so a ``lax.scan`` over layers can carry the cache
    and update layer ``i`` with a traced ``layer_idx``.

    Attributes:
      keys: [L, B, H, C, D] ring of keys.
      values: [L, B, H, C, D] ring of values.
      lengths: int32[L, B] tokens seen per layer and row (the next token's position).
      starts: int32[L, B] first position still held per layer and row.
      flags: int32[B] sticky error bits (``INVALID``); see the module doc.
      window: static attention window W (a query sees itself and the W - 1 before it).

    Example:
      >>> cache = SlidingWindowCache.init(num_layers=1, batch_size=1, num_kv_heads=1,
      ...                                 head_dim=2, window=4)
      >>> k = jnp.ones((1, 1, 6, 2))
      >>> positions = cache.positions(6)                     # [[0 .. 5]]
      >>> cache, view = cache.update_view(k, k, 0)
      >>> out = attend(q, view.keys, view.values, q_positions=positions,   # doctest: +SKIP
      ...              kv_lengths=view.kv_lengths, kv_positions=view.kv_positions,
      ...              sliding_window=view.sliding_window)
      >>> cache.kv_positions(0).tolist()
      [[4, 5, 2, 3]]
    """

    keys: Array
    values: Array
    lengths: Array
    starts: Array
    flags: Array
    window: int  # static

    # ---- construction

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
    ) -> SlidingWindowCache:
        """Allocates an empty ring cache.

        Args:
          num_layers, batch_size, num_kv_heads, head_dim: sizes (ints >= 1).
          window: attention window W (int >= 1).
          extra_slots: slots beyond the window (int >= 0); each one allows rolling back one
            more token (``crop``) once the window is full.
          dtype: a floating storage dtype.

        Raises:
          ValueError: a size < 1 or negative ``extra_slots``.
          TypeError: a non-floating dtype.
        """
        who = "SlidingWindowCache.init"
        _check_sizes(
            who, num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, window=window,
        )
        if _static_int(extra_slots) is None or extra_slots < 0:
            raise ValueError(f"{who}: extra_slots must be an int >= 0, got {extra_slots!r}.")
        dtype = _floating_dtype(dtype, who)
        shape = (num_layers, batch_size, num_kv_heads, window + extra_slots, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((num_layers, batch_size), jnp.int32),
            starts=jnp.zeros((num_layers, batch_size), jnp.int32),
            flags=jnp.zeros((batch_size,), jnp.int32),
            window=int(window),
        )

    # ---- shape facts (static)

    @property
    def capacity(self) -> int:
        """Ring slots C = window + extra_slots."""
        return self.keys.shape[3]

    @property
    def extra_slots(self) -> int:
        return self.capacity - self.window

    @property
    def head_dim(self) -> int:
        return self.keys.shape[4]

    @property
    def dtype(self) -> jnp.dtype:
        return self.keys.dtype

    # ---- sequence protocol

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        """The ring buffers ``(keys, values)`` [B, H, C, D] of a layer, in slot order."""
        i = _layer_index(layer_idx, self.num_layers, "SlidingWindowCache.__getitem__", allow_traced=False)
        return self.keys[i], self.values[i]

    # ---- queries

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: tokens seen per row in ``layer_idx`` (not only those still held)."""
        return self.lengths[_layer_index(layer_idx, self.num_layers, "SlidingWindowCache.seq_lengths")]

    def get_max_length(self) -> None:
        """None: a ring has no limit on sequence length (``capacity`` is its slot count)."""
        return None

    def positions(self, num_tokens: int, layer_idx: Any = 0) -> Array:
        """int32[B, T]: the absolute positions the next ``num_tokens`` tokens will take."""
        return self.seq_lengths(layer_idx)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def kv_positions(self, layer_idx: Any = 0) -> Array:
        """int32[B, C]: the absolute position held by each slot of ``layer_idx``.

        A slot that holds no token reports ``NO_POSITION`` (``2**31 - 1``).
        """
        i = _layer_index(layer_idx, self.num_layers, "SlidingWindowCache.kv_positions")
        return _slot_positions(self.lengths[i], self.starts[i], self.capacity)

    def check(self) -> SlidingWindowCache:
        """Raises ``CacheError`` on the host if any flag is set; returns ``self`` otherwise."""
        _raise_on_flags(
            self.flags,
            "SlidingWindowCache",
            "overflowed",
            "got an out-of-range index or num_new, or a crop that needed evicted tokens",
        )
        return self

    # ---- ops

    def update(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[SlidingWindowCache, Array, Array]:
        """Writes new tokens of one layer; returns ``(cache, keys, values)`` for attention.

        Same as :meth:`update_view`, without the positions; see there.
        """
        cache, view = self.update_view(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.keys, view.values

    def update_view(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[SlidingWindowCache, LayerView]:
        """Writes new tokens of one layer, each row at its own position.

        Args:
          key_states: [B, H, T, D] new keys (cast to the cache dtype). T may exceed the
            window (a prefill): only the last C tokens of each row are stored.
          value_states: [B, H, T, D] new values.
          layer_idx: int in ``[0, L)``, or a traced int32 scalar (``lax.scan`` over layers).
          num_new: optional int32[B]: how many of the T tokens are real in each row (the
            first ``num_new[b]``). Defaults to T.

        Returns:
          ``(new_cache, view)``. ``view.keys``/``view.values`` are ``[B, H, C, D]`` (the
          ring after the write) when ``T <= C - W + 1``, else ``[B, H, C + T, D]`` (the
          ring before the write, then the chunk); ``view.kv_positions`` gives each entry's
          position (``NO_POSITION`` where empty; those value entries are zero), and
          ``view.kv_lengths`` is the full entry count (positions do all the masking).

        Raises:
          ValueError: wrong rank/shape, an out-of-range static layer index, a concrete
            ``num_new`` outside ``[0, T]``.
          TypeError: non-floating states or a non-integer ``num_new``.
        """
        who = "SlidingWindowCache.update"
        key_states, value_states = _check_states(key_states, value_states, who)
        _check_layout(key_states, (self.batch_size, self.num_kv_heads, self.head_dim), who)
        layer = _layer_index(layer_idx, self.num_layers, who)
        batch, capacity, new_tokens = self.batch_size, self.capacity, key_states.shape[2]
        count, invalid_row = _new_counts(num_new, batch, new_tokens, who)
        layer_ok, read_layer, write_layer = _write_target(layer, self.num_layers)

        old, start = self.lengths[read_layer], self.starts[read_layer]  # [B]
        t = jnp.arange(new_tokens, dtype=jnp.int32)[None, :]
        pos = old[:, None] + t  # [B, T]
        # Only the last C real tokens of a row reach the ring: the slots stay distinct
        # (a scatter with duplicate indices has no defined winner).
        write = (t < count[:, None]) & (t >= count[:, None] - capacity) & layer_ok
        slot = jnp.where(write, jnp.mod(pos, capacity), capacity)  # `capacity`: dropped
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        k_new = key_states.astype(self.dtype)
        v_new = value_states.astype(self.dtype)
        keys = self.keys.at[write_layer, rows, :, slot].set(k_new.transpose(0, 2, 1, 3), mode="drop")
        values = self.values.at[write_layer, rows, :, slot].set(v_new.transpose(0, 2, 1, 3), mode="drop")
        new_len = old + jnp.where(layer_ok, count, 0)
        new_start = jnp.maximum(start, new_len - capacity)
        new = SlidingWindowCache(
            keys=keys,
            values=values,
            lengths=self.lengths.at[write_layer].set(new_len, mode="drop"),
            starts=self.starts.at[write_layer].set(new_start, mode="drop"),
            flags=self.flags | _flag(invalid_row | jnp.logical_not(layer_ok), INVALID),
            window=self.window,
        )

        if new_tokens <= capacity - self.window + 1:
            # No position that a query of this chunk needs was overwritten.
            view_pos = _slot_positions(new_len, new_start, capacity)
            view_k, view_v = keys[read_layer], values[read_layer]
        else:
            chunk_pos = jnp.where(t < count[:, None], pos, jnp.int32(NO_POSITION))
            view_pos = jnp.concatenate([_slot_positions(old, start, capacity), chunk_pos], axis=1)
            view_k = jnp.concatenate([self.keys[read_layer], k_new], axis=2)
            view_v = jnp.concatenate([self.values[read_layer], v_new], axis=2)
        view = LayerView(
            keys=view_k,
            values=_zero_empty(view_v, view_pos),
            kv_positions=view_pos,
            kv_lengths=jnp.full((batch,), view_pos.shape[1], jnp.int32),
            sliding_window=self.window,
        )
        return new, view

    def crop(self, max_length: Any) -> SlidingWindowCache:
        """Rolls rows back to at most ``max_length`` tokens, in every layer; moves no data.

        Args:
          max_length: an int, or int32[B] per row. A negative entry drops that many tokens
            off the end of its row (target ``seq_lengths(0)[b] - |m|``, floored at 0). At or
            above a row's length: unchanged.

        Raises:
          ValueError: (eagerly) the rollback needs a position that was already evicted —
            the message names the layer, row and positions. Under jit the row is cropped
            anyway and flagged ``INVALID``.
          TypeError: a non-integer ``max_length``.
        """
        who = "SlidingWindowCache.crop"
        target = _crop_targets(max_length, self.lengths[0], self.batch_size, who)
        new_len = jnp.minimum(self.lengths, target[None, :])  # [L, B]
        needed_from = jnp.maximum(new_len - self.window + 1, 0)
        lost = (new_len < self.lengths) & (self.starts > needed_from)
        if not _is_traced(lost):
            host = np.asarray(lost)
            if host.any():
                layer, row = (int(i) for i in np.argwhere(host)[0])
                start = int(self.starts[layer, row])
                length = int(new_len[layer, row])
                raise ValueError(
                    f"{who}: layer {layer}, row {row} holds positions {start}.."
                    f"{int(self.lengths[layer, row]) - 1}; rolling back to {length} tokens needs "
                    f"positions {int(needed_from[layer, row])}..{length - 1} for the window of "
                    f"{self.window}, but those before {start} were evicted. This cache "
                    f"(extra_slots={self.extra_slots}) can roll a full window back by at most "
                    f"{self.extra_slots + 1} token(s); allocate more extra_slots."
                )
        return dataclasses.replace(
            self,
            lengths=new_len,
            starts=jnp.minimum(self.starts, new_len),
            flags=self.flags | _flag(jnp.any(lost, axis=0), INVALID),
        )

    def _gather_rows(self, idx: Array) -> SlidingWindowCache:
        ok = (idx >= 0) & (idx < self.batch_size)
        safe = jnp.where(ok, idx, 0)
        return SlidingWindowCache(
            keys=jnp.take(self.keys, safe, axis=1),
            values=jnp.take(self.values, safe, axis=1),
            lengths=jnp.where(ok[None, :], jnp.take(self.lengths, safe, axis=1), 0),
            starts=jnp.where(ok[None, :], jnp.take(self.starts, safe, axis=1), 0),
            flags=jnp.where(ok, jnp.take(self.flags, safe, axis=0), jnp.int32(INVALID)),
            window=self.window,
        )

    def reorder_cache(self, beam_idx: Any) -> SlidingWindowCache:
        """Gathers rows by ``beam_idx`` (int[B]) for beam search; same batch size."""
        return self._gather_rows(_check_beam_idx(beam_idx, self.batch_size, "SlidingWindowCache.reorder_cache"))

    def batch_select_indices(self, indices: Any) -> SlidingWindowCache:
        """Keeps only the rows in ``indices`` (int[N]), in that order."""
        return self._gather_rows(
            _check_row_indices(indices, self.batch_size, "SlidingWindowCache.batch_select_indices")
        )

    def batch_repeat_interleave(self, repeats: int) -> SlidingWindowCache:
        """Repeats every row ``repeats`` times, interleaved: rows a, b -> a, a, b, b."""
        r = _check_repeats(repeats, "SlidingWindowCache.batch_repeat_interleave")
        n = self.batch_size * r
        return SlidingWindowCache(
            keys=jnp.repeat(self.keys, r, axis=1, total_repeat_length=n),
            values=jnp.repeat(self.values, r, axis=1, total_repeat_length=n),
            lengths=jnp.repeat(self.lengths, r, axis=1, total_repeat_length=n),
            starts=jnp.repeat(self.starts, r, axis=1, total_repeat_length=n),
            flags=jnp.repeat(self.flags, r, axis=0, total_repeat_length=n),
            window=self.window,
        )

    def reset(self, rows: Any = None) -> SlidingWindowCache:
        """Empties the cache (or the rows where ``rows`` (bool[B]) is true); moves no data."""
        if rows is None:
            zeros = jnp.zeros_like(self.lengths)
            return dataclasses.replace(self, lengths=zeros, starts=zeros, flags=jnp.zeros_like(self.flags))
        rows = _check_reset_rows(rows, self.batch_size, "SlidingWindowCache.reset")
        return dataclasses.replace(
            self,
            lengths=jnp.where(rows[None, :], 0, self.lengths),
            starts=jnp.where(rows[None, :], 0, self.starts),
            flags=jnp.where(rows, 0, self.flags),
        )


register_dataclass(
    SlidingWindowCache,
    data_fields=["keys", "values", "lengths", "starts", "flags"],
    meta_fields=["window"],
)

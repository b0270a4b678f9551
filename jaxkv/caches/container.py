"""The one cache container: lengths, flags, policy and row operations, written once.

A :class:`KVCache` holds one or more *storages* (one per memory layout: contiguous,
ring, quantized; see ``jaxkv/caches/*.py``) and everything that does not depend on the
layout:

* ``lengths: int32[L, B]``: tokens each layer of each row has seen; the next token's
  position. Positions are the source of truth; masks derive from them.
* ``flags: int32[B]``: sticky error bits (``OVERFLOW``, ``INVALID``), cleared by ``reset``.
* the overflow policy, input validation, ``crop``, the row operations (``reorder_cache``,
  ``batch_select_indices``, ``batch_repeat_interleave``, ``reset(rows)``, ``put_rows``),
  ``check``, ``positions`` and the sharding constraint.

Layer ``i`` lives in storage ``groups[i]`` as that storage's layer number (count of earlier
layers of the same storage). With one storage the layer index may be traced (a
``lax.scan`` over layers); with several (``HybridCache``) it must be a Python int.

A storage is a frozen, registered dataclass whose array leaves all have the layer axis
first and the batch axis second (``[L_g, B, ...]``); that is what lets every row op here
be one ``tree_map``. It implements:

* ``capacity``: slots per row, or None when it never runs out (a ring);
* ``write(read_layer, write_layer, layer_ok, keys, values, old, count)`` ->
  ``(storage, view or None)`` or ``(storage, view or None, stored int32[B])``: store
  ``count[b]`` of the T new tokens of row ``b`` at positions ``old[b] + t``, dropping
  (never clamping) anything at or past ``capacity``; ``write_layer`` is out of bounds
  when ``layer_ok`` is false (the write is dropped). It returns a view when attention
  must see something other than the storage after the write (a ring overwritten by a
  long chunk), else None; and ``stored`` when some rows stored fewer tokens than asked
  for another reason than capacity (a paged pool out of pages: those rows get
  ``OUT_OF_PAGES``). A storage with ``WANTS_ALL_LENGTHS = True`` also gets
  ``all_lengths=`` (the lengths ``[L, B]`` of every layer before the write);
* ``view(layer, lengths)`` -> a view of :mod:`jaxkv.caches.views`;
* ``crop(old, new)`` -> ``(storage, lost bool[L_g, B])`` and ``reset_rows(rows)`` for
  layout state beyond the lengths (a ring's first held position, a residual's positions);
* ``LEAF_AXES``: per field, the logical axes of its leaf, for sharding.

A storage whose leaves are not all ``[L_g, B, ...]`` (a paged pool shared by the rows)
also implements ``map_rows(fn)`` (a row gather or repeat: ``fn(leaf, batch_axis)``) and
``put_rows(idx, other) -> (storage, stored bool[N])``.

Overflow and bad-index policy (never silent):

* Eagerly (concrete inputs), a write past capacity, an out-of-range row or layer index or
  an invalid ``num_new`` raises ``ValueError`` naming the layer, row and lengths.
* Under ``jax.jit`` / ``vmap`` / ``scan`` nothing can raise. Writes past capacity are
  dropped (a scatter with ``mode="drop"``; never ``dynamic_update_slice``, which clamps the
  start index and would overwrite the last valid slot), the length stops at capacity, and
  the row gets ``OVERFLOW``. A traced row index out of range empties that row and sets
  ``INVALID``; a traced layer index out of range writes nothing and sets ``INVALID`` on
  every row. Read them with ``cache.overflowed`` / ``cache.flags``, or ``cache.check()``.

Eagerly, ``update``, ``crop``, ``reset``, ``reorder_cache``, ``batch_select_indices`` and
``batch_repeat_interleave`` check their arguments on the host (the errors above), then run
as one jitted program rather than op by op (a first eager update of a new shape compiled
some 40 small programs, 150 on a page pool). The program hands back the buffers an op
leaves alone as they were (``_EagerProgram``): a crop, a reset or a fork of a page pool
still moves no data. Errors only a run can find (a pool out of pages, a ring cropped past
what it evicted) send the op down the op-by-op path, which raises them.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import register_dataclass

from jaxkv.caches._bits import from_bits, stored_dtype
from jaxkv.caches.views import LayerView
from jaxkv.caches._checks import (
    INVALID,
    OUT_OF_PAGES,
    OVERFLOW,
    _check_beam_idx,
    _check_layout,
    _distinct_entries,
    _check_repeats,
    _check_reset_rows,
    _check_row_indices,
    _check_states,
    _check_num_tokens,
    _crop_amounts,
    _flag,
    _host_counts,
    _is_traced,
    _layer_index,
    _new_counts,
    _raise_on_flags,
    _static_int,
    _write_target,
    crop_lengths,
)

Array = jax.Array

__all__ = ["KVCache", "check_cache", "storage_field"]

# Logical axes of a storage leaf; "batch", "heads", "seq" and "dim" take the mesh axes of
# the user's one-layer [B, H, S, D] sharding spec, anything else is replicated.
_SPEC_AXES = ("batch", "heads", "seq", "dim")


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys/values in one or more storages, with per-row lengths and flags.

    Build one through a kind's constructor (``StaticCache.init``,
    ``SlidingWindowCache.init``, ``QuantizedCache.init``, ``HybridCache.init``); they all
    share this class's methods, the HF-style vocabulary with every op returning a new cache.

    Attributes:
      stores: the storages, one per layout (see the module docstring).
      lengths: int32[L, B] tokens seen per layer and row.
      flags: int32[B] sticky error bits (``OVERFLOW``, ``INVALID``).
      groups: static, the storage of each layer.
      sharding: static ``NamedSharding`` of one layer's ``[B, H, S, D]`` buffer given at
        ``init`` (or None). Every op constrains its outputs to it, so the layout survives
        gathers and repeats, eagerly and under jit. A row op whose new batch size the data
        axis does not divide falls back to replicating rows.
    """

    stores: tuple[Any, ...]
    lengths: Array
    flags: Array
    groups: tuple[int, ...]  # static
    sharding: NamedSharding | None = None  # static

    #: Eager ops run as one jitted program each (after their host-side checks), not op by
    #: op. A kind whose storages live outside device memory turns this off.
    EAGER_PROGRAMS: ClassVar[bool] = True

    _data_fields: ClassVar[tuple[str, ...]] = ("stores", "lengths", "flags")
    _meta_fields: ClassVar[tuple[str, ...]] = ("groups", "sharding")

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        # A kind is this container under its own name: register it as the same pytree.
        register_dataclass(cls, data_fields=list(cls._data_fields), meta_fields=list(cls._meta_fields))
        # A kind defined after flax.serialization learnt the others (jaxkv.serialization is
        # loaded only where flax is): the same state dict, or to_bytes could not save it.
        serialization = sys.modules.get("jaxkv.serialization")
        if serialization is not None and serialization._registered:
            serialization.register_kind(cls)

    # ---- construction (for the kinds' constructors)

    @classmethod
    def _allocate(cls, make_stores, *, num_layers: int, batch_size: int, groups: tuple[int, ...], sharding: Any):
        """Builds an empty cache; with a sharding, creates every buffer in its shards."""

        def make():
            return cls(
                stores=tuple(make_stores()),
                lengths=jnp.zeros((num_layers, batch_size), jnp.int32),
                flags=jnp.zeros((batch_size,), jnp.int32),
                groups=tuple(groups),
            )

        if sharding is None:
            return make()
        spec = _one_layer_spec(sharding, f"{cls.__name__}.init")
        shape = jax.eval_shape(make)
        check_divisible(shape, spec, sharding, f"{cls.__name__}.init")
        out = jax.jit(make, out_shardings=_tree_shardings(shape, sharding.mesh, spec))()
        return dataclasses.replace(out, sharding=sharding)

    # ---- shape facts (static)

    @property
    def num_layers(self) -> int:
        return self._unstacked_lengths().shape[0]

    @property
    def batch_size(self) -> int:
        return self._unstacked_lengths().shape[1]

    def _unstacked_lengths(self) -> Array:
        """``lengths`` [L, B]; a stack of caches (``jax.tree.map(jnp.stack, ...)``: [N.., L, B])
        is refused here, so that no row or layer op reads its stack axis as layers or rows."""
        if self.lengths.ndim != 2:
            raise ValueError(
                f"{self._name}: this is a stack of caches (lengths {list(self.lengths.shape)}, not [layers, "
                "batch]); its row, layer and write ops work on one cache: run them under jax.vmap (or "
                "lax.scan / lax.map over the stack), or take one cache out with jax.tree.map(lambda x: x[i], "
                "stack). (check() takes the stack as it is.)"
            )
        return self.lengths

    @property
    def num_kv_heads(self) -> int:
        return self.stores[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.stores[0].head_dim

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype attention reads (a quantized storage's model dtype)."""
        return self.stores[0].dtype

    @property
    def overflowed(self) -> Array:
        """bool[B]: rows that lost a token to a write past capacity (sticky until reset)."""
        return (self.flags & OVERFLOW) != 0

    def get_max_length(self) -> int | None:
        """The capacity of the bounded layers (None when every layer is a ring)."""
        caps = [s.capacity for s in self.stores if s.capacity is not None]
        return min(caps) if caps else None

    # ---- sequence protocol

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        """The layer as the HF vocabulary reads it: ``(keys, values)`` [B, H, S, D]
        (a ring in slot order; a quantized layer dequantized)."""
        store, local, layer = self._locate(layer_idx, f"{self._name}.__getitem__", allow_traced=False)
        view = self.stores[store].view(local, self.lengths[layer]).dense()
        return view.keys, view.values

    def __iter__(self) -> Iterator[tuple[Array, Array]]:
        for i in range(self.num_layers):
            yield self[i]

    # ---- queries

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: tokens seen per row by ``layer_idx``.

        A traced ``layer_idx`` out of range reads as an empty layer (zeros), never as another
        layer (jnp indexing would clamp or wrap it); eagerly it raises ValueError."""
        return self._layer_lengths(_layer_index(layer_idx, self.num_layers, f"{self._name}.seq_lengths"))

    def _layer_lengths(self, layer: Any) -> Array:
        if isinstance(layer, int):
            return self.lengths[layer]
        ok, read, _ = _write_target(layer, self.num_layers)
        return jnp.where(ok, self.lengths[read], 0)

    def get_seq_length(self, layer_idx: Any = 0) -> int | Array:
        """The longest row of ``layer_idx``: a Python int eagerly, an int32 scalar under jit."""
        longest = jnp.max(self.seq_lengths(layer_idx), initial=0)  # 0 for a cache of no rows
        return longest if _is_traced(longest) else int(longest)

    def positions(self, num_tokens: int, layer_idx: Any = 0, *, batch_size: int | None = None) -> Array:
        """int32[B, T]: the absolute positions the next ``num_tokens`` tokens will take.

        Call it before the forward pass (it reads the current lengths); RoPE and causal
        masks take their positions from here. (``batch_size`` is for caches that may have
        no rows yet, a ``DynamicCache``; here the rows are known.)
        """
        del batch_size
        n = _check_num_tokens(num_tokens, f"{self._name}.positions")
        return self.seq_lengths(layer_idx)[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]

    def view(self, layer_idx: Any) -> Any:
        """The layer as it is now, as attention reads it (no write): a view of
        :mod:`jaxkv.caches.views`; pass it to :func:`jaxkv.attention.attend_view`."""
        store, local, layer = self._locate(layer_idx, f"{self._name}.view")
        if not isinstance(layer, int):  # traced: an out-of-range layer is viewed empty
            _, local, _ = _write_target(local, self.stores[store].num_layers)
        return self.stores[store].view(local, self._layer_lengths(layer))

    def kv_positions(self, layer_idx: Any = 0) -> Array:
        """int32[B, S]: the absolute position held by each slot of the layer
        (``NO_POSITION`` where none)."""
        return self.view(layer_idx).slot_positions()

    def check(self) -> KVCache:
        """Raises ``CacheError`` on the host if any flag is set; returns ``self`` otherwise.

        Raises:
          CacheError: a flag is set.
          TypeError: called inside ``jax.jit`` (or another trace), where the flags are not
            known yet: return ``cache.flags`` (or ``cache.overflowed``) and check after.
        """
        if _is_traced(self.flags):
            raise TypeError(
                f"{self._name}.check() reads the flags on the host, but it was called inside jax.jit (or "
                "another trace), where they are not known yet. Return the cache (or cache.flags / "
                "cache.overflowed) from the jitted function and call check() on the result."
            )
        cap = self.get_max_length()
        _raise_on_flags(
            self.flags,
            self._name,
            f"overflowed max_length={cap} (tokens past capacity were dropped; allocate a larger "
            "max_length or crop before writing)",
            "got an out-of-range index or num_new, or a crop that needed evicted tokens",
            "found no free page for a write (it was dropped; free rows, crop, release pins or "
            "allocate a larger num_pages)",
        )
        return self

    # ---- writes

    def write(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[KVCache, Any]:
        """Writes new tokens of one layer; returns ``(new_cache, view)`` for attention.

        The view says the layer's layout (:mod:`jaxkv.caches.views`);
        :func:`jaxkv.attention.attend_view` reads it without materialising the layer.
        Arguments and errors are those of :meth:`update`.
        """
        new, view, _ = self._write(key_states, value_states, layer_idx, num_new)
        return new, view

    def _write(self, key_states, value_states, layer_idx, num_new):
        """:meth:`write`, also returning bool[B]: rows the storage could not take (a paged
        pool out of pages; they are flagged)."""
        who = f"{self._name}.update"
        key_states, value_states = _check_states(key_states, value_states, who)
        _check_layout(key_states, (self.batch_size, self.num_kv_heads, self.head_dim), who)
        store_i, local, layer = self._locate(layer_idx, who)
        store = self.stores[store_i]
        batch, new_tokens = self.batch_size, key_states.shape[2]
        count, invalid_row = _new_counts(num_new, batch, new_tokens, who)
        layer_ok, read_layer, write_layer = _write_target(layer, self.num_layers)
        _, read_local, write_local = _write_target(local, store.num_layers)
        old = self.lengths[read_layer]  # [B]
        capacity = store.capacity
        if capacity is not None and not _is_traced(old, count, layer):
            _check_no_overflow(np.asarray(old), np.asarray(count), capacity, int(layer), who)
        requested = count = jnp.where(layer_ok, count, 0)
        extra = {"all_lengths": self.lengths} if getattr(store, "WANTS_ALL_LENGTHS", False) else {}
        written = store.write(read_local, write_local, layer_ok, key_states, value_states, old, count, **extra)
        new_store, view = written[:2]
        flags = self.flags | _flag(invalid_row | jnp.logical_not(layer_ok), INVALID)
        if len(written) > 2:  # rows the storage could not take (a paged pool out of pages)
            flags = flags | _flag(written[2] < count, OUT_OF_PAGES)
            count = written[2]
        new_len = old + count
        if capacity is not None:
            flags = flags | _flag(new_len > capacity, OVERFLOW)
            new_len = jnp.minimum(new_len, capacity)
        stores = self.stores[:store_i] + (new_store,) + self.stores[store_i + 1:]
        new = dataclasses.replace(
            self, stores=stores, lengths=self.lengths.at[write_layer].set(new_len, mode="drop"), flags=flags
        )._constrained()
        if view is None:
            view = new.stores[store_i].view(read_local, new_len)
        if layer_ok is not True:  # a traced layer: a bad one read layer 0's buffers; it reads as empty
            view = _emptied_unless(view, layer_ok)
        return new, view, count < requested

    def update(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[KVCache, Array, Array]:
        """Writes new tokens of one layer, each row at its own position.

        Args:
          key_states: [B, H, T, D] new keys (any floating dtype; cast to the cache dtype).
          value_states: [B, H, T, D] new values.
          layer_idx: int in ``[0, L)``, or a traced int32 scalar (``lax.scan`` over layers)
            when the cache has one storage.
          num_new: optional int32[B]: how many of the T tokens are valid in each row (the
            first ``num_new[b]``); the rest are not stored. Defaults to T for every row.

        Returns:
          ``(new_cache, keys [B, H, S, D], values [B, H, S, D])``: the layer after the write
          as the kind lays it out (see :meth:`update_view` for positions). For a contiguous
          layer, row ``b`` is valid in slots ``< new_cache.seq_lengths(layer_idx)[b]``.

        Raises:
          ValueError: wrong rank/shape, an out-of-range static layer index, a concrete
            ``num_new`` outside ``[0, T]``, or (eagerly) a write past capacity — the
            message names the layer, row and lengths. Under jit see the module policy.
          TypeError: non-floating states, a non-integer ``num_new`` or one of another shape than
            ``[B]`` (or a scalar), a traced layer index with several storages.
        """
        if type(self).write is KVCache.write and self._eager(key_states, value_states, layer_idx, num_new):
            done = self._eager_update(key_states, value_states, layer_idx, num_new)
            if done is not None:
                return done
        cache, view = self.update_view(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.keys, view.values

    def _eager_update(self, key_states, value_states, layer_idx, num_new):
        """An eager ``update`` as one compiled program (op by op, a first update of a new
        shape compiled some 40 small programs), after the checks that need values, done
        on the host first. None: take the op-by-op path (it raises what this cannot)."""
        who = f"{self._name}.update"
        key_states, value_states = _check_states(key_states, value_states, who)
        _check_layout(key_states, (self.batch_size, self.num_kv_heads, self.head_dim), who)
        store_i, _, layer = self._locate(layer_idx, who)
        if not isinstance(layer, int):
            return None
        count = _host_counts(num_new, self.batch_size, key_states.shape[2], who)
        capacity = self.stores[store_i].capacity
        if capacity is not None:
            _check_no_overflow(np.asarray(self.lengths)[layer], count, capacity, layer, who)
        if len(self.stores) == 1:  # one program for every layer: the index is an operand
            new, keys, values, short = _update_program(self, key_states, value_states, np.int32(layer), count)
        else:  # storages of different shapes: the layer picks one at trace time
            new, keys, values, short = _update_program_static_layer(self, key_states, value_states, layer, count)
        if np.asarray(short).any():  # out of pages: the op-by-op path raises the storage's error
            return None
        return new, keys, values

    def update_view(
        self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None
    ) -> tuple[KVCache, Any]:
        """:meth:`update`, returning a dense :class:`~jaxkv.caches.views.LayerView`
        (keys, values, each slot's position, lengths, the layer's window)."""
        cache, view = self.write(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.dense()

    # ---- length ops

    def crop(self, max_length: Any) -> KVCache:
        """Rolls rows back, in every layer; moves no data.

        Args:
          max_length: an int, or int[B] per row (speculative rollback). A positive entry
            keeps at most that many tokens; a negative one drops that many off the end of
            each layer's own length (floored at 0); 0 drops nothing (``crop(-n)`` with
            ``n == 0`` is a no-op, as in transformers 5, which refuses positive values;
            transformers 4 kept at most a positive value, as here, but its ``crop(0)``
            emptied the cache: use ``reset``). At or above a row's length: no-op.
            Values beyond the int32 range are clamped, never wrapped. Empty rows with
            ``reset``.

        The cropped slots stay in the buffer past the length, so a later update
        overwrites them: crop then update equals never having stored the cropped tokens.

        Raises:
          ValueError: (eagerly) a ring layer would need positions it already evicted; under
            jit the row is cropped anyway and flagged ``INVALID``.
          TypeError: a non-integer ``max_length``.
        """
        amounts = _crop_amounts(max_length, self.batch_size, f"{self._name}.crop")
        if self._eager(amounts):
            new, lost = _crop_program(self, amounts)
            if not np.asarray(lost).any():
                return new
            # A ring lost positions it still needs: the op-by-op path raises the storage's error.
        return self._crop(amounts)[0]

    def _crop(self, amounts: Array) -> tuple[KVCache, Array]:
        """:meth:`crop` by int32[B] amounts; also returns bool[B], the rows flagged ``INVALID``."""
        who = f"{self._name}.crop"
        new_lengths = crop_lengths(self.lengths, amounts)
        stores, lost_any = [], jnp.zeros((self.batch_size,), bool)
        for i, store in enumerate(self.stores):
            layers = self._layers_of(i)
            store, lost = store.crop(self.lengths[layers], new_lengths[layers], who=who, layers=layers)
            stores.append(store)
            lost_any = lost_any | jnp.any(lost, axis=0)
        return dataclasses.replace(
            self, stores=tuple(stores), lengths=new_lengths, flags=self.flags | _flag(lost_any, INVALID)
        )._constrained(), lost_any

    def reset(self, rows: Any = None) -> KVCache:
        """Empties the cache (or only the rows where ``rows`` (bool[B]) is true).

        Lengths and flags go to zero; the buffers are not touched (no data moves): their
        stale contents sit past the length, where attention masks them.
        """
        if rows is None:
            rows = jnp.ones((self.batch_size,), bool)
        rows = _check_reset_rows(rows, self.batch_size, f"{self._name}.reset")
        return _reset_program(self, rows) if self._eager(rows) else self._reset(rows)

    def _reset(self, rows: Array) -> KVCache:
        return self._emptied(rows, jnp.int32(0))._constrained()

    # ---- row ops

    def reorder_cache(self, beam_idx: Any) -> KVCache:
        """Gathers rows by ``beam_idx`` (int[B]) for beam search; same batch size."""
        return self._gather_rows(_check_beam_idx(beam_idx, self.batch_size, f"{self._name}.reorder_cache"))

    def batch_select_indices(self, indices: Any) -> KVCache:
        """Keeps only the rows in ``indices`` (int[N]), in that order."""
        return self._gather_rows(_check_row_indices(indices, self.batch_size, f"{self._name}.batch_select_indices"))

    def batch_repeat_interleave(self, repeats: int) -> KVCache:
        """Repeats every row ``repeats`` times, interleaved: rows a, b -> a, a, b, b."""
        r = _check_repeats(repeats, f"{self._name}.batch_repeat_interleave")
        return _repeat_program(self, r) if self._eager() else self._repeat(r)

    def _repeat(self, r: int) -> KVCache:
        n = self.batch_size * r
        return self._map_rows(lambda x, axis: jnp.repeat(x, r, axis=axis, total_repeat_length=n))._constrained()

    def put_rows(self, rows: Any, other: KVCache, *, mask: Any = None) -> KVCache:
        """Writes the rows of ``other`` (batch N) into rows ``rows`` (int[N]) of this cache.

        The serving loop's admission: prefill new requests in a small cache, then place
        them. ``other`` must be the same kind with the same layer layout and sizes.

        Args:
          rows: int[N], the row of this cache each row of ``other`` goes to.
          other: the rows to write.
          mask: optional bool[N]: entries where it is False are skipped, neither written nor
            checked nor flagged (the unused entries of a fixed-size batch under jit, whose
            ``rows`` may hold anything).

        Raises:
          ValueError / TypeError: another structure, sizes or dtype (only the batch may differ),
            a mask not bool[N], an out-of-range row or a row named twice (eagerly). Under
            jit an out-of-range row that is not masked is dropped and every row of the
            result is flagged ``INVALID`` (``check()`` raises); a row named twice takes its
            first entry (the later ones are skipped), on every backend.
        """
        who = f"{self._name}.put_rows"
        if not isinstance(other, KVCache):  # dataclasses.replace's error named nothing (review 84)
            raise TypeError(f"{who}: other must be a jaxkv cache of the same kind (its rows to put), got "
                            f"{type(other).__name__}.")
        if jax.tree.structure(self) != jax.tree.structure(dataclasses.replace(other, sharding=self.sharding)):
            raise TypeError(
                f"{who}: the other cache has another {_static_difference(self, other)}. Prefill the rows in "
                "a cache made with the same init arguments except batch_size."
            )
        keep = None
        if mask is not None:
            keep = mask if _is_traced(mask) else np.asarray(mask)
            if keep.shape != (other.batch_size,) or keep.dtype != np.bool_:
                raise TypeError(
                    f"{who}: mask must be a bool array of shape [{other.batch_size}] (one entry per row of the "
                    f"other cache), got shape {tuple(keep.shape)} and dtype {keep.dtype}."
                )
            if not _is_traced(rows) and not _is_traced(keep):
                rows = np.where(keep, np.asarray(rows), 0)  # a skipped entry's row is never read
            else:
                rows = jnp.where(keep, rows, 0)
        idx = _check_row_indices(rows, self.batch_size, who)
        if idx.shape[0] != other.batch_size:
            raise ValueError(f"{who}: {idx.shape[0]} rows given for a cache of {other.batch_size} rows.")
        _check_same_row_layout(self.stores, other.stores, who)
        # A traced out-of-range row (negative included) is dropped, never wrapped onto
        # another row; the request it carried is lost, so every row is flagged INVALID.
        bad_row = jnp.zeros((), bool)
        if _is_traced(idx):
            bad = (idx < 0) | (idx >= self.batch_size)
            idx, bad_row = jnp.where(bad, self.batch_size, idx), jnp.any(bad)
        if keep is not None:  # skipped entries: dropped like an out-of-range row, unflagged
            idx = jnp.where(keep, idx, self.batch_size)
        idx = _distinct_entries(idx, self.batch_size, who, "mask= skips an entry")

        def put(x, part, axis):
            return x.at[(slice(None),) * axis + (idx,)].set(part.astype(x.dtype), mode="drop")

        stores, stored = [], jnp.ones(idx.shape, bool)
        for mine, theirs in zip(self.stores, other.stores):
            if hasattr(mine, "put_rows"):  # a pool shared by the rows: pages are copied in
                mine, ok = mine.put_rows(idx, theirs)
                stored = stored & ok
            else:
                mine = jax.tree.map(lambda x, y: put(x, y, 1), mine, theirs)
            stores.append(mine)
        lengths = jnp.where(stored[None, :], other.lengths, 0)
        flags = jnp.where(stored, other.flags, other.flags | jnp.int32(OUT_OF_PAGES))
        flags = put(self.flags, flags, 0) | _flag(bad_row, INVALID)
        return dataclasses.replace(
            self, stores=tuple(stores), lengths=put(self.lengths, lengths, 1), flags=flags
        )._constrained()

    # ---- serialisation

    def __copy__(self):
        # A new container over the same (immutable) arrays: no host round trip, and it works
        # on traced and abstract caches (copy.copy went through __reduce__ below).
        return jax.tree.map(lambda x: x, self)

    def __deepcopy__(self, memo):
        return jax.tree.map(lambda x: copy.deepcopy(x, memo), self)

    def __reduce__(self):
        # A sharded cache's static NamedSharding holds a Mesh of live devices, which cannot
        # be pickled: store host arrays and the mesh by axis names, shape and device ids,
        # and rebuild it (same devices) on load.
        # Leaves in another memory than the device's (an offloaded cache's pinned_host
        # buffers) are put back there, or a "larger than device memory" cache would come
        # back in device memory while its static fields still say offloaded.
        leaves, treedef = jax.tree.flatten(dataclasses.replace(self, sharding=None))
        if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for x in leaves):
            raise TypeError(f"cannot pickle a {self._name} whose arrays are traced (inside jit, vmap, scan) or abstract "
                            "(jax.eval_shape): pickle a concrete cache, outside the transformation")
        mesh = None
        if self.sharding is not None:
            m = self.sharding.mesh
            mesh = (tuple(m.axis_names), np.vectorize(lambda d: d.id)(m.devices), tuple(self.sharding.spec))
        places = [memory_place(x) for x in leaves]
        args = (treedef, [np.asarray(x) for x in leaves], mesh)
        return _restore, args + ((places,) if any(places) else ())

    def __repr__(self) -> str:
        # The sizes and fill levels, not the buffers (a 1024-slot bf16 cache printed 7.5 KB
        # of uint16 bit patterns with its lengths buried in them).
        def show(x: Any) -> str:
            if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
                return f"<{type(x).__name__} {jnp.dtype(x.dtype).name}{list(x.shape)}>"
            if not isinstance(x, (np.ndarray, jax.Array)):  # a placeholder leaf (in_axes, tree_map)
                return repr(x)
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # other processes hold parts of it
                return f"<{jnp.dtype(x.dtype).name}{list(x.shape)} across processes>"
            return " ".join(np.array2string(np.asarray(x), separator=", ", threshold=64).split())

        try:
            sizes = (f"num_layers={self.num_layers}, batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                     f"head_dim={self.head_dim}, max_length={self.get_max_length()}, "
                     f"dtype={jnp.dtype(self.dtype).name}, ")
        except Exception:  # a stack of caches (vmap) or leaves of another kind (in_axes specs): no sizes
            sizes = ""
        stores = ", ".join(type(s).__name__ for s in self.stores)
        sharded = "" if self.sharding is None else f", sharding={self.sharding.spec}"
        return f"{self._name}({sizes}lengths={show(self.lengths)}, flags={show(self.flags)}, stores=({stores}){sharded})"

    # ---- internals

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _locate(self, layer_idx: Any, who: str, *, allow_traced: bool = True) -> tuple[int, Any, Any]:
        """``(storage, layer within it, layer)`` for a layer index."""
        single = len(self.stores) == 1
        if allow_traced and not single and _static_int(layer_idx) is None:
            raise TypeError(
                f"{who}: layer_idx must be a Python int (this cache's layers live in storages of "
                f"different shapes, so the layer is chosen at trace time), got {layer_idx!r}."
            )
        layer = _layer_index(layer_idx, self.num_layers, who, allow_traced=allow_traced and single)
        if isinstance(layer, int):
            store = self.groups[layer]
            return store, self.groups[:layer].count(store), layer
        return 0, layer, layer

    def _layers_of(self, store: int) -> Any:
        if len(self.stores) == 1:
            return slice(None)
        return np.array([i for i, g in enumerate(self.groups) if g == store])

    def _map_rows(self, fn) -> KVCache:
        """``fn(leaf, batch_axis)`` over every leaf: storages and lengths are [L, B, ...]
        (a storage with its own ``map_rows`` moves its rows itself)."""
        stores = tuple(
            s.map_rows(fn) if hasattr(s, "map_rows") else jax.tree.map(lambda x: fn(x, 1), s) for s in self.stores
        )
        return dataclasses.replace(self, stores=stores, lengths=fn(self.lengths, 1), flags=fn(self.flags, 0))

    def _emptied(self, rows: Array, flag_value: Array) -> KVCache:
        return dataclasses.replace(
            self,
            stores=tuple(s.reset_rows(rows) for s in self.stores),
            lengths=jnp.where(rows[None, :], 0, self.lengths),
            flags=jnp.where(rows, flag_value, self.flags),
        )

    def _eager(self, *args: Any) -> bool:
        """Whether an op on these arguments runs eagerly as one jitted program
        (:class:`_EagerProgram`)."""
        return self.EAGER_PROGRAMS and not _is_traced(*args, *jax.tree.leaves(self))

    def _gather_rows(self, idx: Array) -> KVCache:
        return _gather_program(self, idx) if self._eager(idx) else self._gathered(idx)

    def _gathered(self, idx: Array) -> KVCache:
        ok = (idx >= 0) & (idx < self.batch_size)
        safe = jnp.where(ok, idx, 0)
        out = self._map_rows(lambda x, axis: jnp.take(x, safe, axis=axis))
        # A traced bad index (eager ones were refused) empties the row and flags it.
        return out._emptied(jnp.logical_not(ok), jnp.int32(INVALID))._constrained()

    def _constrained(self) -> KVCache:
        if self.sharding is None:
            return self
        spec = _fitted_spec(self.sharding, self._name, self.batch_size)
        targets = _tree_shardings(dataclasses.replace(self, sharding=None), self.sharding.mesh, spec)
        out = jax.tree.map(_constrain, dataclasses.replace(self, sharding=None), targets)
        return dataclasses.replace(out, sharding=self.sharding)


register_dataclass(KVCache, data_fields=list(KVCache._data_fields), meta_fields=list(KVCache._meta_fields))


def _constrain(x: Any, target: NamedSharding) -> Any:
    """``x`` laid out as ``target``: a constraint inside a trace; a concrete array is placed
    there (the same array when it already is). An eager with_sharding_constraint of a
    zero-size leaf (a float page pool's scales, a quantized cache without residual) made an
    array whose shards did not match its layout: it could not be read, pickled or saved."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, target)
    return jax.device_put(x, target)


_fields_init = KVCache.__init__


def _kvcache_init(self, *args: Any, **kwargs: Any) -> None:
    # The dataclass constructor takes the cache's fields (JAX rebuilds caches through it); an
    # HF-style StaticCache(config=..., max_cache_len=...) or StaticCache(num_layers=...) only
    # named a keyword it did not expect.
    try:
        _fields_init(self, *args, **kwargs)
    except TypeError as err:
        kind = type(self).__name__
        raise TypeError(
            f"{kind}(...) is the constructor of the cache's fields (stores, lengths, flags, groups), and {err}. "
            f"Build an empty cache with {kind}.init(...) (e.g. StaticCache.init(num_layers=..., batch_size=..., "
            "num_kv_heads=..., head_dim=..., max_length=...)) or model.init_cache(batch_size, max_length, kind=...)."
        ) from None


KVCache.__init__ = _kvcache_init


def _check_no_overflow(old: np.ndarray, count: np.ndarray, capacity: int, layer: int, who: str) -> None:
    total = old + count
    over = total > capacity
    if over.any():
        row = int(np.argmax(over))
        raise ValueError(
            f"{who}: overflow in layer {layer}, row {row}: it holds {int(old[row])} tokens and "
            f"{int(count[row])} new would make {int(total[row])} > max_length={capacity}. Allocate a "
            "larger max_length, or crop the row first."
        )


def _update_arrays(cache, key_states, value_states, layer, count):
    new, view, short = cache._write(key_states, value_states, layer, count)
    dense = view.dense()
    return new, dense.keys, dense.values, short


try:  # jax >= 0.5: the public names
    from jax import typeof as _typeof
    from jax.extend.core import jaxpr_as_fun as _jaxpr_as_fun
except ImportError:  # older jax (pyproject allows 0.4.35)
    from jax.core import get_aval as _typeof
    from jax.core import jaxpr_as_fun as _jaxpr_as_fun


class _EagerProgram:
    """``fn(*args)`` run eagerly as one jitted program that returns only the leaves it
    computes: an output leaf that is an input leaf passed through (a buffer the op leaves
    alone: a crop's keys, a page pool under a row op) is handed back as that input, never
    copied, as a plain jitted call would (it returns fresh buffers for every output).

    Which outputs are passed through is read from the traced program once per argument
    structure and types (``jax.make_jaxpr``); that program, jitted, returns the others.
    """

    def __init__(self, fn, static_argnums: tuple[int, ...] = ()):
        self._fn, self._static = fn, frozenset(static_argnums)
        self._plans: dict = {}

    def __call__(self, *args):
        statics = tuple((i, args[i]) for i in sorted(self._static))
        leaves, treedef = jax.tree.flatten([a for i, a in enumerate(args) if i not in self._static])
        key = (treedef, statics, tuple(_typeof(x) for x in leaves), tuple(_placement(x) for x in leaves))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(treedef, statics, leaves)
        out_tree, passed, program = plan
        computed = iter(program(*leaves))
        return jax.tree.unflatten(out_tree, [next(computed) if i is None else leaves[i] for i in passed])

    def _plan(self, treedef, statics, leaves):
        given = dict(statics)

        def flat(*xs):
            dynamic = jax.tree.unflatten(treedef, list(xs))  # the non-static arguments, in order
            rest = iter(dynamic)
            return self._fn(*[given[i] if i in given else next(rest) for i in range(len(dynamic) + len(given))])

        closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
        inputs = {id(v): i for i, v in enumerate(closed.jaxpr.invars)}
        # A constraint to the layout an input already has passes it through as well: every
        # op of a sharded cache ends in one (the whole cache was copied by its crop, reset
        # or fork; review 64).
        for eqn in closed.jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint" and id(eqn.invars[0]) in inputs:
                i = inputs[id(eqn.invars[0])]
                have = _placement(leaves[i])
                if have is not None and have.is_equivalent_to(eqn.params["sharding"], leaves[i].ndim):
                    inputs[id(eqn.outvars[0])] = i
        passed = [inputs.get(id(v)) for v in closed.jaxpr.outvars]
        keep = [i for i, p in enumerate(passed) if p is None]
        traced = _jaxpr_as_fun(closed)  # the program as traced once: no second trace of fn
        program = jax.jit(lambda *xs: [out for i, out in enumerate(traced(*xs)) if i in keep])
        return jax.tree.structure(out_shape), passed, program


def _placement(x: Any) -> Any:
    """A concrete array's sharding (part of an eager program's plan), else None."""
    return x.sharding if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None


_update_program = _EagerProgram(_update_arrays)
_update_program_static_layer = _EagerProgram(_update_arrays, static_argnums=(3,))
_crop_program = _EagerProgram(lambda cache, amounts: cache._crop(amounts))
_reset_program = _EagerProgram(lambda cache, rows: cache._reset(rows))
_gather_program = _EagerProgram(lambda cache, idx: cache._gathered(idx))
_repeat_program = _EagerProgram(lambda cache, r: cache._repeat(r), static_argnums=(1,))


def storage_field(name: str, doc: str, *, dtype_of: str | None = None) -> property:
    """A kind's read-only attribute that is a field of its (single) storage, e.g.
    ``StaticCache.keys`` is ``cache.stores[0].keys``. With ``dtype_of``, the field is a
    buffer that may be stored as bits (:mod:`jaxkv.caches._bits`) and the attribute returns
    it as the dtype named by that storage field. A buffer of another kind (the int8 / uint8
    codes of quantized pages) is returned as stored: bitcasting codes to floats made numbers
    of nothing (four int8 codes read as one float32)."""
    if dtype_of is None:
        return property(lambda self: getattr(self.stores[0], name), doc=doc)

    def read(self):
        stored, dtype = getattr(self.stores[0], name), getattr(self.stores[0], dtype_of)
        return from_bits(stored, dtype) if stored.dtype == stored_dtype(dtype) else stored

    return property(read, doc=doc)


def check_cache(cache: Any, who: str) -> Any:
    """``cache`` if it speaks the cache protocol (every jaxkv kind does), else ``TypeError``."""
    if not callable(getattr(cache, "write", None)) or not callable(getattr(cache, "positions", None)):
        kind = type(cache)
        hint = ""
        if kind.__module__.split(".")[0] == "transformers":
            hint = ("; a transformers cache holds torch tensors: convert a full-attention one with "
                    "jaxkv.DynamicCache.from_legacy_cache(hf_cache)")
        raise TypeError(
            f"{who}: cache must be a jaxkv cache (model.init_cache(batch_size, max_length, kind=...), "
            f"jaxkv.StaticCache.init(...), jaxkv.DynamicCache(), ...) or None, got {kind.__module__}.{kind.__qualname__}"
            + hint
        )
    return cache


def _one_layer_spec(sharding: Any, who: str) -> tuple:
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"{who}: sharding must be a jax.sharding.NamedSharding over one layer's "
            f"[B, H, S, D] buffer, got {type(sharding).__name__}."
        )
    spec = tuple(sharding.spec)
    if len(spec) > 4:
        raise ValueError(
            f"{who}: the sharding spec describes one layer [B, H, S, D] and may have "
            f"at most 4 entries, got {sharding.spec}."
        )
    check_auto_axes(sharding.mesh, who)
    if sharding.memory_kind not in (None, "device"):
        # (the buffers were made in device memory while the sharding said otherwise)
        raise ValueError(
            f"{who}: the sharding asks for memory kind {sharding.memory_kind!r}; a cache's sharding places it "
            "in device memory. For a cache in host memory use jaxkv.OffloadedCache."
        )
    return spec + (None,) * (4 - len(spec))


def check_divisible(cache: KVCache, spec: tuple, sharding: NamedSharding, who: str) -> None:
    """A ValueError naming the size unless every sharded axis of every buffer of ``cache``
    (concrete or abstract) splits evenly over its mesh axes under the one-layer ``spec``:
    XLA's own error names the internal buffer (a sequence axis of 37 slots over 4 devices
    was an IndivisibleError about [L, B, H, S, D])."""
    named = dict(zip(_SPEC_AXES, spec))
    checks = [("batch_size", cache.lengths.shape[-1], spec[0]), ("num_kv_heads", cache.stores[0].keys.shape[2], spec[1])]
    labels = {"seq": "max_length (slots)", "dim": "head_dim"}
    for store in cache.stores:
        for field, axes in type(store).LEAF_AXES.items():
            for axis, n in zip(axes, getattr(store, field).shape):
                if axis in labels and named.get(axis) is not None:
                    checks.append((labels[axis], n, named[axis]))
    for name, n, axes in checks:
        names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        devices = spec_axis_devices(sharding.mesh, axes)
        if n % devices:
            raise ValueError(
                f"{who}: {name}={n} does not split over mesh axes {names} ({devices} devices) "
                f"of sharding spec {tuple(sharding.spec)}; use a multiple of {devices}, or shard that axis "
                "over fewer devices (None: replicated)."
            )


def check_auto_axes(mesh: Any, who: str) -> None:
    """A ValueError unless every axis of ``mesh`` is ``AxisType.Auto``: the cache ops' gathers,
    scatters and sharding constraints are written for Auto axes (``jax.make_mesh`` makes
    Explicit ones by default in jax >= 0.7: every op then failed after the init took them)."""
    types = getattr(mesh, "axis_types", None)
    auto = getattr(getattr(jax.sharding, "AxisType", None), "Auto", None)
    if types is None or auto is None or all(t == auto for t in types):
        return
    kinds = ", ".join(f"{name}: {getattr(t, 'name', t)}" for name, t in zip(mesh.axis_names, types))
    raise ValueError(
        f"{who}: the mesh's axes must be Auto, got ({kinds}); build it with jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * len(names)) or jax.sharding.Mesh(devices, names)."
    )


def spec_axis_devices(mesh: Any, axes: Any) -> int:
    """Devices along one PartitionSpec entry: None (1), a mesh axis name, or a tuple of them."""
    names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in names]))


def _fitted_spec(sharding: Any, who: str, batch_size: int) -> tuple:
    """The one-layer spec of ``sharding`` for a cache of ``batch_size`` rows: rows replicated
    when they do not divide the axes that split them (a row op such as
    ``batch_select_indices`` can leave such a count; every op, pickling and loading lay the
    cache out this way)."""
    spec = _one_layer_spec(sharding, who)
    batch_axis = spec[0]
    if batch_axis is not None and batch_size % spec_axis_devices(sharding.mesh, batch_axis):
        spec = (None,) + spec[1:]
    return spec


def _tree_shardings(cache: KVCache, mesh: Any, spec: tuple) -> KVCache:
    """A cache-shaped tree of ``NamedSharding``: each leaf by its storage's logical axes."""
    named = dict(zip(_SPEC_AXES, spec))

    def sharding(axes):
        return NamedSharding(mesh, P(*(named.get(a) for a in axes)))

    stores = tuple(
        dataclasses.replace(s, **{f: sharding(axes) for f, axes in type(s).LEAF_AXES.items()}) for s in cache.stores
    )
    return dataclasses.replace(
        cache, stores=stores, lengths=sharding(("layer", "batch")), flags=sharding(("batch",))
    )


def _emptied_unless(view: Any, ok: Array) -> Any:
    """``view`` with every row's length 0 where ``ok`` (a traced bool) is False: a bad traced
    layer index writes nothing, and the view a write returns (layer 0's buffers, read in its
    place) must then read as an empty layer, not as layer 0's tokens."""
    field = "kv_lengths" if hasattr(view, "kv_lengths") else "lengths"
    view = view._replace(**{field: jnp.where(ok, getattr(view, field), 0)})
    if isinstance(view, LayerView):  # dense arrays (a ring's): their empty entries read as zero too
        view = view._replace(keys=jnp.where(ok, view.keys, jnp.zeros((), view.keys.dtype)),
                             values=jnp.where(ok, view.values, jnp.zeros((), view.values.dtype)))
    return view


def memory_place(x: Any) -> tuple[int, str] | None:
    """``(device id, memory kind)`` of a single-device array outside device memory (an
    offloaded cache's ``pinned_host`` buffers) or committed to a device other than the
    default one (an offloaded cache made with ``device=d`` keeps its lengths, flags and
    staged layer in ``d``'s memory, next to its host buffers: restored on the default
    device they would mix two devices in one op), else None."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return None
    kind = sharding.memory_kind
    (device,) = sharding.device_set
    if kind not in (None, "device"):
        return device.id, kind
    if getattr(x, "committed", False) and device != jax.local_devices()[0]:
        return device.id, kind or "device"
    return None


def place_sharding(place: tuple[int, str] | None, who: str) -> Any:
    """The ``SingleDeviceSharding`` of a recorded :func:`memory_place` (None: default)."""
    if place is None:
        return None
    by_id = {d.id: d for d in jax.devices()}
    device_id, kind = place
    if kind == "device" and (device_id not in by_id or by_id[device_id].process_index != jax.process_index()):
        return None  # a device buffer on a device this process lacks: the default device, as unrecorded
    if device_id not in by_id or kind not in {m.kind for m in by_id[device_id].addressable_memories()}:
        raise ValueError(
            f"{who}: an array was saved in the {kind!r} memory of device {device_id}, which this process "
            "lacks; load it where that memory exists, or save a copy that is not offloaded."
        )
    return jax.sharding.SingleDeviceSharding(by_id[device_id], memory_kind=kind)


def _restore(treedef, leaves, mesh, places=None):
    try:
        targets = [place_sharding(p, "unpickling a cache") for p in places or [None] * len(leaves)]
    except ValueError as err:
        raise pickle.UnpicklingError(str(err)) from None
    wide = sorted({str(np.dtype(x.dtype)) for x in leaves
                   if hasattr(x, "dtype") and jax.dtypes.canonicalize_dtype(x.dtype) != np.dtype(x.dtype)})
    if wide:
        # Loaded as they are, float64 buffers become float32 while the cache's static dtype still
        # says float64: writes and reads then disagree (review 77). Say so instead.
        raise pickle.UnpicklingError(
            f"the cache holds {', '.join(wide)} arrays (it was pickled with jax_enable_x64), which this process "
            "would load as 32-bit ones under a cache that still says 64-bit. Enable x64 before loading "
            "(jax.config.update('jax_enable_x64', True)), or pickle a cache of float32 or a 16-bit dtype."
        )
    cache = jax.tree.unflatten(
        treedef, [jnp.asarray(x) if t is None else jax.device_put(x, t) for x, t in zip(leaves, targets)]
    )
    if mesh is None:
        return cache
    names, ids, spec = mesh
    by_id = {d.id: d for d in jax.devices()}
    missing = sorted(set(ids.ravel().tolist()) - set(by_id))
    if missing:
        raise pickle.UnpicklingError(
            f"{type(cache).__name__}: the cache was sharded over devices {sorted(ids.ravel().tolist())}; this "
            f"process lacks {missing}. Load it where those devices exist, or pickle an unsharded copy."
        )
    devices = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
    sharding = NamedSharding(jax.sharding.Mesh(devices, names), P(*spec))
    spec = _fitted_spec(sharding, type(cache).__name__, cache.batch_size)
    targets = _tree_shardings(cache, sharding.mesh, spec)
    return dataclasses.replace(jax.device_put(cache, targets), sharding=sharding)


# Axes a row copy may differ in: the batch (rows given vs rows held) and a paged pool's size.
_ROW_COPY_FREE_AXES = ("batch", "pages")


def _check_same_row_layout(mine: tuple, theirs: tuple, who: str) -> None:
    """Refuses ``put_rows`` from a cache of other sizes (heads, head_dim, capacity, slots,
    layers): a scatter would broadcast or fail far from the cause, never say which size."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        for field, axes in type(a).LEAF_AXES.items():
            x, y = getattr(a, field), getattr(b, field)
            if x is None or y is None:
                continue
            want = {n: d for n, d in zip(axes, x.shape) if n not in _ROW_COPY_FREE_AXES}
            got = {n: d for n, d in zip(axes, y.shape) if n not in _ROW_COPY_FREE_AXES}
            if want != got or x.ndim != y.ndim:
                diff = ", ".join(f"{n} {got.get(n)} (this cache {want.get(n)})" for n in want if want[n] != got.get(n))
                raise ValueError(
                    f"{who}: the other cache's {type(b).__name__}.{field} (storage {i}) has shape {y.shape}, "
                    f"this cache's {x.shape}: {diff or 'another rank'}. Only the batch size may differ: "
                    "build the cache you prefill with the same init arguments except batch_size."
                )
            if x.dtype != y.dtype:  # the scatter would cast it silently (a bf16 prefill into f32 rows)
                raise TypeError(
                    f"{who}: the other cache has another dtype: {y.dtype}; this one has {x.dtype} "
                    f"({type(b).__name__}.{field}, storage {i}). Prefill the rows in a cache made with the same "
                    "init arguments except batch_size."
                )


def _static_difference(this: Any, other: Any) -> str:
    """What makes two caches' tree structures differ, in words (for put_rows' error)."""
    if (type(this) is not type(other) or this.num_layers != other.num_layers or len(this.stores) != len(other.stores)
            or this.groups != other.groups):
        return (f"kind or layer layout ({type(other).__name__} of {other.num_layers} layers; this one: "
                f"{type(this).__name__} of {this.num_layers})")
    for i, (a, b) in enumerate(zip(this.stores, other.stores)):
        if type(a) is not type(b):
            return f"storage type in its storage {i} ({type(b).__name__}; this one: {type(a).__name__})"
        for field in dataclasses.fields(a):
            va, vb = getattr(a, field.name), getattr(b, field.name)
            if not isinstance(va, (jax.Array, np.ndarray)) and va != vb:
                where = f" (storage {i})" if len(this.stores) > 1 else ""
                return f"{field.name}{where}: {vb!s}; this one has {va!s}"
    return "structure (the same kind and static settings, but other array shapes)"


"""Immutable key/value caches: ``DynamicCache`` and ``StaticCache``.

Shapes use the package alphabet: L layers, B batch rows, H kv heads, T new tokens,
S cached tokens (or capacity), D head dim.

Both caches are frozen dataclasses registered as pytrees. Every method returns a new
cache; the receiver is never modified, so an old cache stays valid after an update.

``DynamicCache`` is the reference semantics (the HF-style vocabulary): layers grow by
concatenation, all rows share one length. Its shapes change with every update, so under
``jax.jit`` it compiles once per new length, as any growing array does.

``StaticCache`` preallocates ``[L, B, H, S, D]`` buffers and keeps a fill level per layer
and per row as array leaves (``lengths: int32[L, B]``), so caches with different fill
levels share one treedef and one compiled program.

Overflow and bad-index policy of ``StaticCache`` (never silent):

* Eagerly (concrete inputs), a write past ``max_length``, an out-of-range row index or an
  invalid ``num_new`` raises ``ValueError`` naming the layer, row and lengths.
* Under ``jax.jit`` / ``vmap`` / ``scan`` (traced inputs) nothing can raise. Writes past
  capacity are *dropped* (a scatter with ``mode="drop"``; never ``dynamic_update_slice``,
  which clamps the start index and would overwrite the last valid slot), the row's length
  stops at ``max_length``, and the row's ``flags`` gets ``OVERFLOW``. A traced row index
  out of range empties that row and sets ``INVALID``; a traced layer index out of range
  writes nothing and sets ``INVALID`` on every row. Flags are sticky until ``reset``.
  Read them with ``cache.overflowed`` / ``cache.flags``, or call ``cache.check()`` on the
  host to turn them into a ``CacheError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.tree_util import register_dataclass

Array = jax.Array

#: Flag bit: a write fell past ``max_length`` and was dropped.
OVERFLOW = 1
#: Flag bit: a traced row/layer index or ``num_new`` was out of range.
INVALID = 2


class CacheError(ValueError):
    """Raised on the host by ``StaticCache.check`` when a traced operation set a flag."""


# --------------------------------------------------------------------------- helpers


def _is_traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _static_int(x: Any) -> int | None:
    """Returns ``x`` as a Python int when it is a concrete integer scalar, else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (np.ndarray, jax.Array)) and not _is_traced(x):
        if x.ndim == 0 and jnp.issubdtype(x.dtype, jnp.integer):
            return int(x)
    return None


def _flag(condition: Array, bit: int) -> Array:
    # Explicit int32 operands: a weak-typed int64 under jax_enable_x64 OR-ed into an int32
    # array crashes jaxlib 0.10.2 on CPU (segfault), and flags must stay int32 anyway.
    return jnp.where(condition, jnp.int32(bit), jnp.int32(0))


def _check_states(key_states: Any, value_states: Any, who: str) -> tuple[Array, Array]:
    key_states = jnp.asarray(key_states)
    value_states = jnp.asarray(value_states)
    for name, x in (("key_states", key_states), ("value_states", value_states)):
        if x.ndim != 4:
            raise ValueError(
                f"{who}: {name} must have rank 4 [batch, kv_heads, new_tokens, head_dim], "
                f"got shape {x.shape}. Transpose or reshape your states to that layout."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{who}: {name} has dtype {x.dtype}, which a key/value cache cannot store; "
                "expected a floating dtype (float32, bfloat16, float16). Cast the states "
                "with .astype(...) first."
            )
    if key_states.shape != value_states.shape:
        raise ValueError(
            f"{who}: key_states and value_states must have the same shape, got "
            f"{key_states.shape} and {value_states.shape}."
        )
    return key_states, value_states


def _check_layout(states: Array, expected: tuple[int, int, int], who: str) -> None:
    batch, heads, head_dim = expected
    got = (states.shape[0], states.shape[1], states.shape[3])
    for name, e, g in zip(("batch", "kv_heads", "head_dim"), expected, got):
        if e != g:
            raise ValueError(
                f"{who}: states have {name}={g} but the cache holds {name}={e} "
                f"(states shape {states.shape}, expected [{batch}, {heads}, T, {head_dim}])."
            )


def _check_row_indices(indices: Any, batch: int, who: str) -> Array:
    indices = jnp.asarray(indices)
    if indices.ndim != 1 or not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(
            f"{who}: indices must be a 1-D integer array of batch rows, got shape "
            f"{indices.shape} and dtype {indices.dtype}."
        )
    if not _is_traced(indices):
        host = np.asarray(indices)
        bad = (host < 0) | (host >= batch)
        if bad.any():
            raise ValueError(
                f"{who}: row index {int(host[bad][0])} (position {int(np.argmax(bad))}) is out "
                f"of range for a cache with batch size {batch}; valid rows are 0..{batch - 1}."
            )
    return indices.astype(jnp.int32)


def _check_repeats(repeats: Any, who: str) -> int:
    r = _static_int(repeats)
    if r is None:
        raise TypeError(
            f"{who}: repeats must be a Python int (it sets the new batch size, which is a "
            f"static shape), got {type(repeats).__name__}."
        )
    if r < 1:
        raise ValueError(f"{who}: repeats must be >= 1, got {r}.")
    return r


# Shared by every per-row cache kind (StaticCache here; the ring, quantized and hybrid
# caches import them): one implementation of each check and rule.


def _layer_index(layer_idx: Any, num_layers: int, who: str, *, allow_traced: bool = True) -> Any:
    """A static int in range, or (``allow_traced``) a traced int32 scalar."""
    i = _static_int(layer_idx)
    if i is not None:
        if not 0 <= i < num_layers:
            raise ValueError(
                f"{who}: layer_idx {i} is out of range for a cache with {num_layers} layers; "
                f"valid indices are 0..{num_layers - 1}."
            )
        return i
    if (
        allow_traced
        and isinstance(layer_idx, jax.Array)
        and layer_idx.ndim == 0
        and jnp.issubdtype(layer_idx.dtype, jnp.integer)
    ):
        return layer_idx.astype(jnp.int32)
    raise TypeError(
        f"{who}: layer_idx must be an int{' or a traced int32 scalar' if allow_traced else ''}, "
        f"got {layer_idx!r}."
    )


def _write_target(layer: Any, num_layers: int) -> tuple[Any, Any, Any]:
    """``(layer_ok, read_layer, write_layer)``; a bad traced layer writes out of bounds."""
    if isinstance(layer, int):
        return True, layer, layer
    ok = (layer >= 0) & (layer < num_layers)
    return ok, jnp.where(ok, layer, 0), jnp.where(ok, layer, num_layers)


def _new_counts(num_new: Any, batch: int, new_tokens: int, who: str) -> tuple[Array, Array]:
    """``(count int32[B], invalid bool[B])`` for ``num_new`` (default: all T tokens)."""
    if num_new is None:
        return jnp.full((batch,), new_tokens, jnp.int32), jnp.zeros((batch,), bool)
    count = jnp.asarray(num_new)
    if count.ndim == 0:
        count = jnp.broadcast_to(count, (batch,))
    if count.shape != (batch,) or not jnp.issubdtype(count.dtype, jnp.integer):
        raise TypeError(
            f"{who}: num_new must be an integer array of shape [{batch}] (or a scalar), "
            f"got shape {count.shape} and dtype {count.dtype}."
        )
    count = count.astype(jnp.int32)
    if not _is_traced(count):
        host = np.asarray(count)
        bad = (host < 0) | (host > new_tokens)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(
                f"{who}: num_new[{row}]={int(host[row])} is outside [0, {new_tokens}] "
                f"(the states carry {new_tokens} new tokens)."
            )
    invalid = (count < 0) | (count > new_tokens)
    return jnp.where(invalid, 0, count), invalid


def _crop_targets(max_length: Any, lengths0: Array, batch: int, who: str) -> Array:
    """int32[B] absolute target length per row, as ``StaticCache.crop`` defines it."""
    m = jnp.asarray(max_length)
    if not jnp.issubdtype(m.dtype, jnp.integer) or m.ndim not in (0, 1):
        raise TypeError(
            f"{who}: max_length must be an int or an int array [{batch}], "
            f"got shape {m.shape} and dtype {m.dtype}."
        )
    if m.ndim == 1 and m.shape[0] != batch:
        raise ValueError(f"{who}: per-row max_length needs {batch} entries, got {m.shape[0]}.")
    m = jnp.broadcast_to(m.astype(jnp.int32), (batch,))
    return jnp.where(m < 0, jnp.maximum(lengths0 + m, 0), m)


def _check_reset_rows(rows: Any, batch: int, who: str) -> Array:
    rows = jnp.asarray(rows)
    if rows.shape != (batch,) or rows.dtype != jnp.bool_:
        raise TypeError(
            f"{who}: rows must be a bool array of shape [{batch}], got shape {rows.shape} "
            f"and dtype {rows.dtype}."
        )
    return rows


def _check_beam_idx(beam_idx: Any, batch: int, who: str) -> Array:
    idx = _check_row_indices(beam_idx, batch, who)
    if idx.shape[0] != batch:
        raise ValueError(
            f"{who}: beam_idx must have one entry per row ({batch}), got {idx.shape[0]}. "
            "To change the batch size use batch_select_indices."
        )
    return idx


def _raise_on_flags(flags: Array, who: str, overflow: str, invalid: str) -> None:
    """Turns set flag bits into a ``CacheError`` naming the rows."""
    flags = np.asarray(flags)
    if not flags.any():
        return
    rows = np.flatnonzero(flags)
    what = []
    over = rows[(flags[rows] & OVERFLOW) != 0]
    bad = rows[(flags[rows] & INVALID) != 0]
    if over.size:
        what.append(f"rows {over.tolist()} {overflow}")
    if bad.size:
        what.append(f"rows {bad.tolist()} {invalid}")
    raise CacheError(f"{who}: " + "; ".join(what) + ". reset() clears the flags.")


def _check_sizes(who: str, **sizes: Any) -> None:
    for name, value in sizes.items():
        if _static_int(value) is None or value < 1:
            raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r}.")


def _floating_dtype(dtype: Any, who: str) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{who}: dtype must be floating (float32, bfloat16, float16), got {dtype}.")
    return dtype


class _RowCache:
    """Shape facts and the sequence protocol of the per-row cache kinds.

    For frozen dataclasses whose ``keys`` leaf is ``[L, B, H, ...]`` and which carry
    ``flags: int32[B]`` and a ``seq_lengths(layer_idx)`` method (StaticCache, the sliding
    ring and the quantized cache).
    """

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[2]

    @property
    def overflowed(self) -> Array:
        """bool[B]: rows that lost a token to a write past capacity (sticky until reset)."""
        return (self.flags & OVERFLOW) != 0

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self) -> Iterator[tuple[Array, Array]]:
        for i in range(self.num_layers):
            yield self[i]

    def get_seq_length(self, layer_idx: Any = 0) -> int | Array:
        """The longest row of ``layer_idx``: a Python int eagerly, an int32 scalar under jit."""
        longest = jnp.max(self.seq_lengths(layer_idx))
        return longest if _is_traced(longest) else int(longest)


# ---------------------------------------------------------------------- DynamicCache


@dataclasses.dataclass(frozen=True, init=False)
class DynamicCache:
    """Unbounded cache that grows by concatenation; the HF ``DynamicCache`` vocabulary.

    Attributes:
      layers: one entry per layer, ``None`` until the layer is seeded, then
        ``(keys [B, H, S, D], values [B, H, S, D])``.

    Example:
      >>> cache = DynamicCache(num_layers=2)
      >>> k = jnp.ones((1, 2, 3, 4))
      >>> cache, keys, values = cache.update(k, k, 0)
      >>> cache.get_seq_length(0), cache.get_seq_length(1)
      (3, 0)
    """

    layers: tuple[tuple[Array, Array] | None, ...]

    def __init__(
        self,
        layers: Sequence[tuple[Array, Array] | None] = (),
        *,
        num_layers: int | None = None,
    ):
        if num_layers is not None:
            if layers:
                raise ValueError("DynamicCache: pass either layers or num_layers, not both.")
            if _static_int(num_layers) is None or num_layers < 0:
                raise ValueError(f"DynamicCache: num_layers must be an int >= 0, got {num_layers!r}.")
            layers = (None,) * int(num_layers)
        object.__setattr__(self, "layers", tuple(layers))

    # ---- construction / conversion

    @classmethod
    def from_legacy_cache(cls, past_key_values: Sequence[tuple[Any, Any]] | None) -> DynamicCache:
        """Builds a cache from ``((k0, v0), (k1, v1), ...)``, each ``[B, H, S, D]``."""
        if past_key_values is None:
            return cls()
        layers = []
        for i, entry in enumerate(past_key_values):
            if len(entry) != 2:
                raise ValueError(
                    f"DynamicCache.from_legacy_cache: layer {i} must be a (keys, values) pair, "
                    f"got {len(entry)} items."
                )
            k, v = _check_states(entry[0], entry[1], f"DynamicCache.from_legacy_cache (layer {i})")
            layers.append((k, v))
        _check_same_batch(layers, "DynamicCache.from_legacy_cache")
        return cls(layers)

    def to_legacy_cache(self) -> tuple[tuple[Array, Array], ...]:
        """Returns ``((k0, v0), ...)``; every layer must be seeded."""
        return tuple(self[i] for i in range(len(self)))

    def to_static(self, max_length: int, **init_kwargs: Any) -> StaticCache:
        """Copies this cache into a ``StaticCache`` of capacity ``max_length``."""
        return StaticCache.from_dynamic(self, max_length=max_length, **init_kwargs)

    # ---- sequence protocol

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        i = _static_int(layer_idx)
        if i is None or not 0 <= i < len(self.layers):
            raise IndexError(
                f"DynamicCache: layer index {layer_idx!r} out of range for a cache with "
                f"{len(self.layers)} layers."
            )
        layer = self.layers[i]
        if layer is None:
            raise ValueError(
                f"DynamicCache: layer {i} has not been seeded yet; call update(..., layer_idx={i}) first."
            )
        return layer

    def __iter__(self) -> Iterator[tuple[Array, Array]]:
        for i in range(len(self)):
            yield self[i]

    # ---- queries

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in ``layer_idx`` (0 if the layer is absent or not seeded)."""
        if layer_idx >= len(self.layers) or self.layers[layer_idx] is None:
            return 0
        return int(self.layers[layer_idx][0].shape[2])

    def get_max_length(self) -> None:
        """A dynamic cache has no capacity."""
        return None

    def _batch_size(self) -> int | None:
        for layer in self.layers:
            if layer is not None:
                return int(layer[0].shape[0])
        return None

    # ---- ops

    def update(
        self, key_states: Any, value_states: Any, layer_idx: int
    ) -> tuple[DynamicCache, Array, Array]:
        """Appends new states to a layer.

        Args:
          key_states: [B, H, T, D] new keys.
          value_states: [B, H, T, D] new values.
          layer_idx: Python int >= 0. The first update seeds the layer; an index past the
            current number of layers grows the layer list with unseeded layers.

        Returns:
          ``(new_cache, keys [B, H, S+T, D], values [B, H, S+T, D])``. A seeded layer keeps
          its dtype: states are cast to it (a bf16 cache stays bf16).

        Raises:
          ValueError: wrong rank, keys/values shapes differ, or batch/heads/head_dim do not
            match the seeded layer; negative layer index.
          TypeError: non-integer or traced layer index, non-floating states.
        """
        who = "DynamicCache.update"
        i = _static_int(layer_idx)
        if i is None:
            raise TypeError(
                f"{who}: layer_idx must be a Python int (a dynamic cache's layers are separate "
                f"arrays), got {type(layer_idx).__name__}. For a traced layer index use StaticCache."
            )
        if i < 0:
            raise ValueError(f"{who}: layer_idx must be >= 0, got {i}.")
        key_states, value_states = _check_states(key_states, value_states, who)
        layers = list(self.layers) + [None] * max(0, i + 1 - len(self.layers))
        old = layers[i]
        if old is None:
            batch = self._batch_size()
            if batch is not None and key_states.shape[0] != batch:
                raise ValueError(
                    f"{who}: states have batch={key_states.shape[0]} but the cache's other "
                    f"layers hold batch={batch}."
                )
            new = (key_states, value_states)
        else:
            k_old, v_old = old
            _check_layout(key_states, (k_old.shape[0], k_old.shape[1], k_old.shape[3]), who)
            new = (
                jnp.concatenate([k_old, key_states.astype(k_old.dtype)], axis=2),
                jnp.concatenate([v_old, value_states.astype(v_old.dtype)], axis=2),
            )
        layers[i] = new
        return DynamicCache(layers), new[0], new[1]

    def crop(self, max_length: int) -> DynamicCache:
        """Keeps at most ``max_length`` tokens in every layer.

        A negative ``max_length`` drops that many tokens off the end (the target is
        ``get_seq_length(0) - |max_length|``, floored at 0). At or above the current
        length this is a no-op; 0 empties every layer (seeded layers stay seeded, length 0).
        """
        m = _static_int(max_length)
        if m is None:
            raise TypeError(
                "DynamicCache.crop: max_length must be a Python int (it sets array shapes), "
                f"got {type(max_length).__name__}. For per-row rollback use StaticCache.crop."
            )
        if m < 0:
            m = max(self.get_seq_length(0) + m, 0)
        layers = tuple(
            None if layer is None else (layer[0][:, :, :m], layer[1][:, :, :m])
            for layer in self.layers
        )
        return DynamicCache(layers)

    def _map_rows(self, fn) -> DynamicCache:
        return DynamicCache(
            tuple(None if layer is None else (fn(layer[0]), fn(layer[1])) for layer in self.layers)
        )

    def reorder_cache(self, beam_idx: Any) -> DynamicCache:
        """Gathers batch rows by ``beam_idx`` (int[B]); under jit an out-of-range index
        yields a NaN-filled row (visible in any output that reads it)."""
        batch = self._batch_size()
        if batch is None:
            return self
        idx = _check_row_indices(beam_idx, batch, "DynamicCache.reorder_cache")
        if idx.shape[0] != batch:
            raise ValueError(
                f"DynamicCache.reorder_cache: beam_idx must have one entry per row ({batch}), "
                f"got {idx.shape[0]}. To change the batch size use batch_select_indices."
            )
        return self._map_rows(lambda x: _gather_rows_nan(x, idx))

    def batch_select_indices(self, indices: Any) -> DynamicCache:
        """Keeps only the batch rows in ``indices`` (int[N]), in that order."""
        batch = self._batch_size()
        if batch is None:
            return self
        idx = _check_row_indices(indices, batch, "DynamicCache.batch_select_indices")
        return self._map_rows(lambda x: _gather_rows_nan(x, idx))

    def batch_repeat_interleave(self, repeats: int) -> DynamicCache:
        """Repeats every row ``repeats`` times, interleaved: rows a, b -> a, a, b, b."""
        r = _check_repeats(repeats, "DynamicCache.batch_repeat_interleave")
        return self._map_rows(lambda x: jnp.repeat(x, r, axis=0, total_repeat_length=x.shape[0] * r))

    def reset(self) -> DynamicCache:
        """An empty cache with the same number of layers."""
        return DynamicCache(num_layers=len(self))


def _check_same_batch(layers: Sequence[tuple[Array, Array]], who: str) -> None:
    batches = {int(k.shape[0]) for k, _ in layers}
    if len(batches) > 1:
        raise ValueError(f"{who}: all layers must share one batch size, got {sorted(batches)}.")


def _gather_rows_nan(x: Array, idx: Array) -> Array:
    # Out-of-range rows only reach here under jit (eager calls were range-checked):
    # fill them with NaN so the error shows in every output that reads them.
    return jnp.take(x, idx, axis=0, mode="fill", fill_value=jnp.nan)


# ----------------------------------------------------------------------- StaticCache


@dataclasses.dataclass(frozen=True)
class StaticCache(_RowCache):
    """Preallocated cache with per-row fill levels, for jitted decode loops.

    Row ``b`` of layer ``l`` holds ``lengths[l, b]`` tokens in slots ``0 .. lengths-1``;
    slot ``s`` holds absolute position ``s``. Slots at or past the length may hold anything
    (stale tokens after ``crop``/``reset``): attention must mask them by ``lengths``.

    All layers are stacked in one buffer, so a ``lax.scan`` over layers can carry the whole
    cache and update layer ``i`` in place with a traced ``layer_idx`` (see README).

    Attributes:
      keys: [L, B, H, S, D] key buffer.
      values: [L, B, H, S, D] value buffer.
      lengths: int32[L, B] tokens stored per layer and row.
      flags: int32[B] sticky error bits per row (``OVERFLOW``, ``INVALID``); see module doc.
      sharding: static ``NamedSharding`` of one layer given to ``init`` (or None). Every op
        constrains its outputs to it, so the layout survives gathers and repeats, eagerly
        and under jit. A row op whose new batch size the data axis does not divide falls
        back to replicating rows (other axes keep their sharding).

    Example:
      >>> cache = StaticCache.init(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=4,
      ...                          max_length=16)
      >>> k = jnp.ones((2, 1, 3, 4))
      >>> cache, keys, values = cache.update(k, k, 0, num_new=jnp.array([3, 1]))
      >>> cache.seq_lengths(0).tolist(), keys.shape
      ([3, 1], (2, 1, 16, 4))
    """

    keys: Array
    values: Array
    lengths: Array
    flags: Array
    sharding: jax.sharding.NamedSharding | None = None  # static: one layer's [B, H, S, D] layout

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
          TypeError: a non-floating dtype.
        """
        sizes = dict(
            num_layers=num_layers,
            batch_size=batch_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_length=max_length,
        )
        _check_sizes("StaticCache.init", **sizes)
        dtype = _floating_dtype(dtype, "StaticCache.init")
        buf_shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        shardings = _cache_shardings(sharding)

        def make():
            zeros = jnp.zeros(buf_shape, dtype)
            return cls(
                keys=zeros,
                values=jnp.zeros(buf_shape, dtype),
                lengths=jnp.zeros((num_layers, batch_size), jnp.int32),
                flags=jnp.zeros((batch_size,), jnp.int32),
            )

        if shardings is None:
            return make()
        return dataclasses.replace(jax.jit(make, out_shardings=shardings)(), sharding=sharding)

    @classmethod
    def from_dynamic(
        cls,
        cache: DynamicCache,
        *,
        max_length: int,
        dtype: Any = None,
        sharding: jax.sharding.NamedSharding | None = None,
    ) -> StaticCache:
        """Copies a (fully seeded) ``DynamicCache`` into a new static cache.

        Typical use: prefill with a dynamic cache, then decode in a static one.
        """
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
        static = cls.init(
            num_layers=len(layers),
            batch_size=k0.shape[0],
            num_kv_heads=k0.shape[1],
            head_dim=k0.shape[3],
            max_length=max_length,
            dtype=k0.dtype if dtype is None else dtype,
            sharding=sharding,
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
        return cls.from_dynamic(
            DynamicCache.from_legacy_cache(past_key_values), max_length=max_length, **kwargs
        )

    def to_dynamic(self) -> DynamicCache:
        """Exports the valid part as a ``DynamicCache``.

        Raises:
          ValueError: rows of one layer hold different lengths (a dynamic cache has one
            length per layer); select rows with ``batch_select_indices`` first.
        """
        return DynamicCache(self.to_legacy_cache())

    def to_legacy_cache(self) -> tuple[tuple[Array, Array], ...]:
        """The valid part ``((k0, v0), ...)``, each ``[B, H, n_l, D]``; rows must agree."""
        if _is_traced(self.lengths):
            raise TypeError(
                "StaticCache.to_legacy_cache needs concrete lengths (its output shapes depend "
                "on them); call it outside jax.jit."
            )
        lengths = np.asarray(self.lengths)
        out = []
        for i in range(self.num_layers):
            row_lengths = lengths[i]
            if (row_lengths != row_lengths[0]).any():
                raise ValueError(
                    f"StaticCache.to_legacy_cache: layer {i} holds different lengths per row "
                    f"{row_lengths.tolist()}; a dynamic cache needs one length per layer. Export "
                    "rows separately with batch_select_indices([row])."
                )
            n = int(row_lengths[0])
            out.append((self.keys[i, :, :, :n], self.values[i, :, :, :n]))
        return tuple(out)

    # ---- shape facts (static)

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[4]

    @property
    def dtype(self) -> jnp.dtype:
        return self.keys.dtype

    # ---- sequence protocol

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        i = self._layer(layer_idx, "StaticCache.__getitem__", allow_traced=False)
        return self.keys[i], self.values[i]

    # ---- queries

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: tokens stored per row in ``layer_idx``."""
        i = self._layer(layer_idx, "StaticCache.seq_lengths")
        return self.lengths[i]

    def get_max_length(self) -> int:
        """The capacity ``S``."""
        return self.max_length

    def positions(self, num_tokens: int, layer_idx: Any = 0) -> Array:
        """int32[B, T]: the absolute positions the next ``num_tokens`` tokens will take.

        Call it before the forward pass (it reads the current lengths); RoPE and causal
        masks take their positions from here.
        """
        return self.seq_lengths(layer_idx)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def check(self) -> StaticCache:
        """Raises ``CacheError`` on the host if any flag is set; returns ``self`` otherwise."""
        _raise_on_flags(
            self.flags,
            "StaticCache",
            overflow=f"overflowed max_length={self.max_length} (tokens past capacity were dropped; allocate "
            "a larger max_length or crop before writing)",
            invalid="got an out-of-range index or num_new",
        )
        return self

    # ---- ops

    def update(
        self,
        key_states: Any,
        value_states: Any,
        layer_idx: Any,
        *,
        num_new: Any = None,
    ) -> tuple[StaticCache, Array, Array]:
        """Writes new tokens of one layer, each row at its own offset.

        Args:
          key_states: [B, H, T, D] new keys (any floating dtype; cast to the cache dtype).
          value_states: [B, H, T, D] new values.
          layer_idx: int in ``[0, L)``, or a traced int32 scalar (``lax.scan`` over layers).
          num_new: optional int32[B]: how many of the T tokens are valid in each row (the
            first ``num_new[b]``); the rest are not stored. Defaults to T for every row.

        Returns:
          ``(new_cache, keys [B, H, S, D], values [B, H, S, D])``: the layer's full buffers
          after the write. Row ``b`` is valid in slots ``< new_cache.seq_lengths(layer_idx)[b]``;
          the new tokens sit at ``self.positions(T, layer_idx)``.

        Raises:
          ValueError: wrong rank/shape, an out-of-range static layer index, a concrete
            ``num_new`` outside ``[0, T]``, or (eagerly) a write past ``max_length`` — the
            message names the layer, row and lengths. Under jit see the module policy.
          TypeError: non-floating states or a non-integer ``num_new``.
        """
        who = "StaticCache.update"
        key_states, value_states = _check_states(key_states, value_states, who)
        _check_layout(key_states, (self.batch_size, self.num_kv_heads, self.head_dim), who)
        layer = self._layer(layer_idx, who)
        num_layers, batch, capacity = self.num_layers, self.batch_size, self.max_length
        new_tokens = key_states.shape[2]

        count, invalid_row = _new_counts(num_new, batch, new_tokens, who)

        # A bad traced layer index writes out of bounds (dropped) and reads layer 0.
        layer_ok, safe_layer, write_layer = _write_target(layer, num_layers)
        old = self.lengths[safe_layer]  # [B]
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

        t = jnp.arange(new_tokens, dtype=jnp.int32)
        pos = old[:, None] + t[None, :]  # [B, T]
        write = (t[None, :] < count[:, None]) & (pos < capacity) & layer_ok
        # Slot index `capacity` is out of bounds: mode="drop" discards it. Never clamp.
        slot = jnp.where(write, pos, capacity)
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        keys = self.keys.at[write_layer, rows, :, slot].set(
            key_states.astype(self.dtype).transpose(0, 2, 1, 3), mode="drop"
        )
        values = self.values.at[write_layer, rows, :, slot].set(
            value_states.astype(self.dtype).transpose(0, 2, 1, 3), mode="drop"
        )
        new_len = jnp.minimum(old + count, capacity)
        lengths = self.lengths.at[write_layer].set(new_len, mode="drop")
        flags = self.flags | _flag(old + count > capacity, OVERFLOW)
        flags = flags | _flag(invalid_row | jnp.logical_not(layer_ok), INVALID)
        new = StaticCache(keys, values, lengths, flags, self.sharding)._constrained()
        return new, new.keys[safe_layer], new.values[safe_layer]

    def crop(self, max_length: Any) -> StaticCache:
        """Keeps at most ``max_length`` tokens per row, in every layer; moves no data.

        Args:
          max_length: an int, or int32[B] for per-row rollback (speculative decoding).
            Entries >= 0 keep at most that many tokens; a negative entry drops that many off
            the end of its row (target ``seq_lengths(0)[b] - |m|``, floored at 0, applied to
            every layer). Values at or above a row's length leave it unchanged.

        The cropped slots stay in the buffer but are past the length, so a later update
        overwrites them: crop then update equals never having stored the cropped tokens.
        """
        target = _crop_targets(max_length, self.lengths[0], self.batch_size, "StaticCache.crop")  # [B]
        return dataclasses.replace(
            self, lengths=jnp.minimum(self.lengths, target[None, :])
        )._constrained()

    def _gather_rows(self, idx: Array) -> StaticCache:
        batch = self.batch_size
        ok = (idx >= 0) & (idx < batch)
        safe = jnp.where(ok, idx, 0)
        return StaticCache(
            keys=jnp.take(self.keys, safe, axis=1),
            values=jnp.take(self.values, safe, axis=1),
            lengths=jnp.where(ok[None, :], jnp.take(self.lengths, safe, axis=1), 0),
            flags=jnp.where(ok, jnp.take(self.flags, safe, axis=0), jnp.int32(INVALID)),
            sharding=self.sharding,
        )._constrained()

    def reorder_cache(self, beam_idx: Any) -> StaticCache:
        """Gathers rows by ``beam_idx`` (int[B]) for beam search; same batch size."""
        return self._gather_rows(_check_beam_idx(beam_idx, self.batch_size, "StaticCache.reorder_cache"))

    def batch_select_indices(self, indices: Any) -> StaticCache:
        """Keeps only the rows in ``indices`` (int[N]), in that order."""
        idx = _check_row_indices(indices, self.batch_size, "StaticCache.batch_select_indices")
        return self._gather_rows(idx)

    def batch_repeat_interleave(self, repeats: int) -> StaticCache:
        """Repeats every row ``repeats`` times, interleaved: rows a, b -> a, a, b, b."""
        r = _check_repeats(repeats, "StaticCache.batch_repeat_interleave")
        n = self.batch_size * r
        return StaticCache(
            keys=jnp.repeat(self.keys, r, axis=1, total_repeat_length=n),
            values=jnp.repeat(self.values, r, axis=1, total_repeat_length=n),
            lengths=jnp.repeat(self.lengths, r, axis=1, total_repeat_length=n),
            flags=jnp.repeat(self.flags, r, axis=0, total_repeat_length=n),
            sharding=self.sharding,
        )._constrained()

    def reset(self, rows: Any = None) -> StaticCache:
        """Empties the cache (or only the rows where ``rows`` (bool[B]) is true).

        Lengths and flags go to zero; the buffers are not touched (no data moves), their
        stale contents sit past the length where attention masks them.
        """
        if rows is None:
            return dataclasses.replace(
                self, lengths=jnp.zeros_like(self.lengths), flags=jnp.zeros_like(self.flags)
            )._constrained()
        rows = _check_reset_rows(rows, self.batch_size, "StaticCache.reset")
        return dataclasses.replace(
            self,
            lengths=jnp.where(rows[None, :], 0, self.lengths),
            flags=jnp.where(rows, 0, self.flags),
        )._constrained()

    # ---- internals

    def _constrained(self) -> StaticCache:
        if self.sharding is None:
            return self
        spec = tuple(self.sharding.spec) + (None,) * (4 - len(self.sharding.spec))
        batch_axis = spec[0]
        if batch_axis is not None:
            axes = batch_axis if isinstance(batch_axis, tuple) else (batch_axis,)
            if self.batch_size % int(np.prod([self.sharding.mesh.shape[a] for a in axes])):
                spec = (None,) + spec[1:]
        targets = _cache_shardings(jax.sharding.NamedSharding(self.sharding.mesh, P(*spec)))
        wsc = jax.lax.with_sharding_constraint
        return StaticCache(
            wsc(self.keys, targets.keys),
            wsc(self.values, targets.values),
            wsc(self.lengths, targets.lengths),
            wsc(self.flags, targets.flags),
            self.sharding,
        )

    def _layer(self, layer_idx: Any, who: str, *, allow_traced: bool = True) -> Any:
        return _layer_index(layer_idx, self.num_layers, who, allow_traced=allow_traced)


def _cache_shardings(sharding: Any) -> StaticCache | None:
    if sharding is None:
        return None
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(
            "StaticCache.init: sharding must be a jax.sharding.NamedSharding over one layer's "
            f"[B, H, S, D] buffer, got {type(sharding).__name__}."
        )
    spec = tuple(sharding.spec)
    if len(spec) > 4:
        raise ValueError(
            f"StaticCache.init: the sharding spec describes one layer [B, H, S, D] and may have "
            f"at most 4 entries, got {sharding.spec}."
        )
    spec = spec + (None,) * (4 - len(spec))
    mesh = sharding.mesh
    buf = jax.sharding.NamedSharding(mesh, P(None, *spec))
    return StaticCache(
        keys=buf,
        values=buf,
        lengths=jax.sharding.NamedSharding(mesh, P(None, spec[0])),
        flags=jax.sharding.NamedSharding(mesh, P(spec[0])),
    )


register_dataclass(
    DynamicCache, data_fields=["layers"], meta_fields=[]
)
register_dataclass(
    StaticCache, data_fields=["keys", "values", "lengths", "flags"], meta_fields=["sharding"]
)

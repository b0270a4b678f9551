"""``DynamicCache``: the reference semantics, the HF vocabulary on growing arrays.

Layers grow by concatenation and all rows share one length per layer. Its shapes change
with every update, so under ``jax.jit`` it compiles once per new length, as any growing
array does; use it as the reference and for short eager experiments, and a preallocated
kind (``StaticCache`` ...) for jitted decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.caches._checks import (
    _check_num_tokens,
    _check_layout,
    _check_repeats,
    _check_row_indices,
    _check_states,
    _INT32_MAX,
    _static_int,
)
from jaxkv.caches.views import LayerView

Array = jax.Array

__all__ = ["DynamicCache"]


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

    #: Its arrays' shapes follow its length (a restore may bring other shapes).
    SHAPES_GROW: ClassVar[bool] = True

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
        # Checked as from_legacy_cache checks them (review 78: torch tensors, a rank-3 layer,
        # keys of 3 tokens with values of 7 or layers of two batch sizes were taken and failed
        # later, or read a wrong length). JAX rebuilds the tree through ``_of``, unchecked.
        layers = _checked_layers(_layer_entries(layers), "DynamicCache")
        object.__setattr__(self, "layers", layers)

    @classmethod
    def _of(cls, layers: Sequence[tuple[Array, Array] | None]) -> DynamicCache:
        """A cache of ``layers`` as they are: the ops' results (their inputs were checked)
        and JAX's rebuilds of the tree (any leaves: tracers, placeholders, stacked arrays)."""
        cache = object.__new__(cls)
        object.__setattr__(cache, "layers", tuple(layers))
        return cache

    # ---- construction / conversion

    @classmethod
    def from_legacy_cache(cls, past_key_values: Sequence[tuple[Any, Any]] | None) -> DynamicCache:
        """Builds a cache from ``((k0, v0), (k1, v1), ...)``, each ``[B, H, S, D]``.

        A transformers cache object works too (``from_legacy_cache(hf_cache)``): transformers 5
        iterates ``(keys, values, sliding_window)`` per layer, taken for full-attention layers
        (window ``None``); a sliding-window layer is a ValueError (it holds only its last tokens).
        """
        if past_key_values is None:
            return cls()
        _refuse_cache_object(past_key_values, "DynamicCache.from_legacy_cache")
        layers = []
        for i, entry in enumerate(past_key_values):
            if len(entry) == 3 and entry[2] is None:
                # A transformers >= 5 cache iterates (keys, values, sliding window): None is a full layer.
                entry = entry[:2]
            if len(entry) in (2, 3) and entry[0] is None and entry[1] is None:
                layers.append(None)  # a layer not written yet (transformers 5 before its first forward)
                continue
            elif len(entry) == 3:
                raise ValueError(
                    f"DynamicCache.from_legacy_cache: layer {i} is a sliding-window layer of a transformers "
                    "cache (its third item is the window): it holds only the last tokens, while a DynamicCache "
                    "layer holds the whole context from position 0. Convert only full-attention caches, or "
                    "prefill a jaxkv HybridCache / SlidingWindowCache from the prompt instead."
                )
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

    def to_static(self, max_length: int, **init_kwargs: Any) -> Any:
        """Copies this cache into a ``StaticCache`` of capacity ``max_length``."""
        from jaxkv.caches.contiguous import StaticCache  # it imports this module

        return StaticCache.from_dynamic(self, max_length=max_length, **init_kwargs)

    # ---- sequence protocol

    def __repr__(self) -> str:
        # Shapes, not the arrays' contents (review 63).
        def show(x: Any) -> str:
            return f"{jnp.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "shape") and hasattr(x, "dtype") else repr(x)

        layers = ", ".join("None" if e is None else f"(keys {show(e[0])}, values {show(e[1])})" for e in self.layers)
        return f"DynamicCache(layers=[{layers}])"

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
        """Tokens cached in ``layer_idx`` (0 if the layer is absent or not seeded).

        Raises:
          ValueError: a negative or non-integer ``layer_idx`` (as every jaxkv cache does;
            a Python list would read -1 as the last layer).
        """
        i = _static_int(layer_idx)
        if i is None or i < 0:
            raise ValueError(
                f"DynamicCache.get_seq_length: layer_idx must be an int >= 0, got {layer_idx!r}."
            )
        layer_idx = i
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
        return DynamicCache._of(layers), new[0], new[1]

    def crop(self, max_length: int) -> DynamicCache:
        """Rolls every layer back (the rule of every jaxkv kind and of transformers).

        A positive ``max_length`` keeps at most that many tokens; a negative one drops that
        many off the end of each layer's own length (floored at 0; an unseeded layer stays
        unseeded); 0 drops nothing. At or above a layer's length: no-op. Values beyond the
        int32 range are clamped, never wrapped. Empty the cache with ``reset``.
        """
        m = _static_int(max_length)
        if m is None:
            raise TypeError(
                "DynamicCache.crop: max_length must be a Python int (it sets array shapes), "
                f"got {type(max_length).__name__}. For per-row rollback use StaticCache.crop."
            )
        m = max(-_INT32_MAX, min(_INT32_MAX, m))  # clamp, never wrap

        def cropped(layer):
            n = layer[0].shape[2]
            keep = min(n, m) if m > 0 else max(n + m, 0)
            return layer[0][:, :, :keep], layer[1][:, :, :keep]

        return DynamicCache._of(tuple(None if layer is None else cropped(layer) for layer in self.layers))

    # ---- the cache protocol (what attention and the models call)

    def positions(self, num_tokens: int, layer_idx: int = 0, *, batch_size: int | None = None) -> Array:
        """int32[B, T]: the positions of the next ``num_tokens`` tokens (all rows alike).

        ``batch_size`` is needed only while no layer is seeded (the cache has no rows yet).
        """
        batch = self._batch_size()
        if batch is None:  # (a seeded cache of 0 rows has batch 0, not none)
            batch = batch_size
        if batch is None:
            raise ValueError("DynamicCache.positions: no layer is seeded yet; pass batch_size.")
        n = _check_num_tokens(num_tokens, "DynamicCache.positions")
        start = self.get_seq_length(layer_idx)
        return jnp.broadcast_to(start + jnp.arange(n, dtype=jnp.int32), (batch, n))

    def write(
        self, key_states: Any, value_states: Any, layer_idx: int, *, num_new: Any = None
    ) -> tuple[DynamicCache, LayerView]:
        """:meth:`update`, returning a :class:`~jaxkv.caches.views.LayerView` for attention.

        Raises:
          ValueError: ``num_new`` given (a dynamic cache's rows share one length; ragged
            batches need a preallocated kind), or any error of :meth:`update`.
        """
        if num_new is not None:
            raise ValueError(
                "num_new needs per-row lengths, which DynamicCache does not track (all its rows share "
                "one length); use StaticCache (or another preallocated kind) for ragged batches"
            )
        cache, keys, values = self.update(key_states, value_states, layer_idx)
        return cache, LayerView(keys, values, None, jnp.full((keys.shape[0],), keys.shape[2], jnp.int32), None)

    update_view = write

    def view(self, layer_idx: int) -> LayerView:
        """The layer as it is now, as attention reads it (no write)."""
        keys, values = self[layer_idx]
        return LayerView(keys, values, None, jnp.full((keys.shape[0],), keys.shape[2], jnp.int32), None)

    def _map_rows(self, fn) -> DynamicCache:
        return DynamicCache._of(
            tuple(None if layer is None else (fn(layer[0]), fn(layer[1])) for layer in self.layers)
        )

    def reorder_cache(self, beam_idx: Any) -> DynamicCache:
        """Gathers batch rows by ``beam_idx`` (int[B]); under jit an out-of-range index
        (negative included) yields a NaN-filled row (visible in any output that reads it)."""
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

    def reset(self, rows: Any = None) -> DynamicCache:
        """An empty cache with the same number of layers.

        Raises:
          TypeError: ``rows`` given: a dynamic cache's rows share one length, so single
            rows cannot start over; use a preallocated kind (``StaticCache``).
        """
        if rows is not None:
            raise TypeError(
                "DynamicCache.reset: a DynamicCache cannot reset single rows (its rows share one "
                "length); use StaticCache or another preallocated kind."
            )
        return DynamicCache(num_layers=len(self))

    @property
    def batch_size(self) -> int | None:
        """Rows of the seeded layers (None while no layer is seeded)."""
        return self._batch_size()

    def seq_lengths(self, layer_idx: int = 0, *, batch_size: int | None = None) -> Array:
        """int32[B]: tokens cached per row in ``layer_idx`` (all rows alike)."""
        return self.positions(1, layer_idx, batch_size=batch_size)[:, 0]

    def check(self) -> DynamicCache:
        """A dynamic cache has no flags (its ops raise instead): returns ``self``."""
        return self


def _check_same_batch(layers: Sequence[tuple[Array, Array]], who: str) -> None:
    batches = {int(layer[0].shape[0]) for layer in layers if layer is not None}
    if len(batches) > 1:
        raise ValueError(f"{who}: all layers must share one batch size, got {sorted(batches)}.")


def _gather_rows_nan(x: Array, idx: Array) -> Array:
    # Out-of-range rows only reach here under jit (eager calls were range-checked): fill
    # them with NaN so the error shows in every output that reads them. A DynamicCache has
    # no flags; the preallocated kinds empty such a row and flag it INVALID instead. Every
    # bad index, negative ones included, is moved past the end first: `take` would wrap -1
    # to the last row before filling.
    bad = (idx < 0) | (idx >= x.shape[0])
    return jnp.take(x, jnp.where(bad, x.shape[0], idx), axis=0, mode="fill", fill_value=jnp.nan)




def _layer_entries(layers: Any) -> tuple:
    """``layers`` as a tuple of ``None`` / ``(keys, values)`` entries, or a TypeError that says
    what to pass. Only the structure is checked: JAX rebuilds the cache through here with
    any leaves (tracers, placeholders); :meth:`DynamicCache.from_legacy_cache` checks arrays."""
    who = "DynamicCache"
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        raise TypeError(f"{who}(layers) takes a sequence of (keys, values) pairs; for {layers} empty layers "
                        f"pass DynamicCache(num_layers={int(layers)}).")
    if hasattr(layers, "num_hidden_layers"):  # an HF config
        raise TypeError(f"{who}(layers) takes a sequence of (keys, values) pairs, got a {type(layers).__name__}; "
                        "for a model config pass DynamicCache(num_layers=config.num_hidden_layers).")
    if isinstance(layers, (str, bytes, dict)) or not isinstance(layers, Iterable):
        raise TypeError(f"{who}(layers) takes a sequence of (keys, values) pairs (None for an empty layer), got a "
                        f"{type(layers).__name__}; build one with DynamicCache(num_layers=n) or "
                        "DynamicCache.from_legacy_cache(((k0, v0), (k1, v1), ...)).")
    layers = tuple(layers)
    for i, entry in enumerate(layers):
        if entry is not None and not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise TypeError(f"{who}(layers): layer {i} must be None or a (keys, values) pair, got "
                            f"{type(entry).__name__}{f' of {len(entry)} items' if isinstance(entry, (tuple, list)) else ''}.")
    return tuple(None if entry is None else tuple(entry) for entry in layers)


def _checked_layers(layers: tuple, who: str) -> tuple:
    """Each seeded layer as ``from_legacy_cache`` takes it (rank-4 float keys and values of
    one shape, torch and NumPy arrays read as JAX arrays), one batch size for all; abstract
    leaves (``jax.ShapeDtypeStruct``) are checked by shape and dtype."""
    out = []
    for i, entry in enumerate(layers):
        if entry is None or not all(_array_like(x) for x in entry):
            # None, or a JAX prefix tree's leaves (vmap axes, shardings, PartitionSpecs): as they are
            out.append(entry)
            continue
        out.append(_check_states(entry[0], entry[1], f"{who} (layer {i})", abstract=True))
    _check_same_batch([e for e in out if e is not None and all(_array_like(x) for x in e)], who)
    return tuple(out)


def _array_like(x: Any) -> bool:
    """An array (JAX, NumPy, torch) or an abstract one: what a layer's keys and values are, not
    a leaf of a prefix tree (an int axis, None, a sharding; review 82)."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, jax.sharding.Sharding)


def _refuse_cache_object(x: Any, who: str) -> None:
    """A jaxkv cache iterates whole buffers (a StaticCache its capacity, a ring its slots in
    storage order), and a transformers StaticCache cannot be iterated: neither is a list of
    (keys, values) pairs of the tokens seen (review 78: a static cache of 3 tokens in 8 slots
    came back as 8 tokens)."""
    from jaxkv.caches.container import KVCache  # it imports this module

    if isinstance(x, DynamicCache):
        return
    if isinstance(x, KVCache):
        raise TypeError(
            f"{who} takes ((k0, v0), (k1, v1), ...), got a jaxkv {type(x).__name__}, whose layers are its "
            "whole buffers (capacity slots, a ring's in storage order), not the tokens it holds. Convert it "
            "with cache.to_dynamic() (or cache.to_legacy_cache() for the pairs)."
        )
    if not isinstance(x, Iterable) and hasattr(x, "layers") and hasattr(x, "get_seq_length"):
        raise TypeError(
            f"{who}: a {type(x).__module__}.{type(x).__name__} cannot be iterated (a transformers StaticCache "
            "holds max_cache_len slots per layer). Pass the tokens it holds: "
            "n = cache.get_seq_length(); [(l.keys[:, :, :n], l.values[:, :, :n]) for l in cache.layers]."
        )


# The node's aux data is (), as register_dataclass gave it: saved files describe the tree with
# it, and load_cache(like=) compares the descriptions (None there refused older files; review 82).
def _flatten_with_keys(cache: DynamicCache):
    return ((jax.tree_util.GetAttrKey("layers"), cache.layers),), ()


def _flatten(cache: DynamicCache):
    return (cache.layers,), ()


def _unflatten(_: tuple, children: Sequence[Any]) -> DynamicCache:
    return DynamicCache._of(children[0])


jax.tree_util.register_pytree_with_keys(DynamicCache, _flatten_with_keys, _unflatten, _flatten)

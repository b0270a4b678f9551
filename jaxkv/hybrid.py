"""Hybrid cache: a per-layer choice of full or sliding-window attention in one cache.

Models such as Qwen2/Qwen3 (``use_sliding_window`` + ``max_window_layers``), Gemma 2/3 and
other alternating local/global decoders mark each layer ``"full_attention"`` or
``"sliding_attention"`` (HF ``config.layer_types``). A :class:`HybridCache` keeps the full
layers in one :class:`jaxkv.StaticCache` (capacity ``max_length``) and the sliding layers
in one :class:`jaxkv.sliding.SlidingWindowCache` (``window`` slots), so a sliding layer
costs O(window) memory instead of O(max_length).

``update(k, v, layer_idx)`` dispatches on the *static* layer index; the layer's kind is
part of the treedef, so a traced index (``lax.scan`` over layers) is refused: the layers
do not share one shape. :func:`update_and_attend` writes one layer of any jaxkv cache and
attends over it with the right positions and window.

Shape letters: L layers, B rows, H kv heads, S capacity, W window, T new tokens, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.attention import cache_attention
from jaxkv.cache import (
    OVERFLOW,
    StaticCache,
    _check_beam_idx,
    _check_repeats,
    _check_reset_rows,
    _check_row_indices,
    _crop_targets,
    _is_traced,
    _raise_on_flags,
    _static_int,
)
from jaxkv.sliding import NO_POSITION, LayerView, SlidingWindowCache

Array = jax.Array

__all__ = ["FULL", "SLIDING", "HybridCache", "layer_types_from_config", "update_and_attend"]

FULL = "full_attention"
SLIDING = "sliding_attention"

# Model types whose configs say which layers slide with use_sliding_window/max_window_layers.
_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Model types whose sliding_window, when set, applies to every layer.
_ALL_SLIDING_TYPES = ("mistral", "mixtral")


def layer_types_from_config(config: Any) -> tuple[tuple[str, ...], int | None]:
    """Which layers slide, and the window, from an HF config (dict or ``PretrainedConfig``).

    Rules, in order (those of transformers' Qwen2/Qwen3/Mistral configs):

    * ``layer_types`` given: used as is (each ``"full_attention"`` or
      ``"sliding_attention"``). The window is ``sliding_window``, except that Qwen configs
      switch it off unless ``use_sliding_window``.
    * Qwen2/Qwen3 (``model_type`` qwen2, qwen3 or their MoE variants): with
      ``use_sliding_window`` and a ``sliding_window``, layer ``i`` slides iff
      ``i >= max_window_layers``; otherwise no layer slides.
    * Mistral/Mixtral: every layer slides when ``sliding_window`` is set.
    * Any other config without ``sliding_window`` (Llama, ...): every layer is full.

    Returns:
      ``(layer_types, sliding_window)``; ``sliding_window`` is None when no layer slides.

    Raises:
      ValueError: ``layer_types`` of the wrong length or with another kind of layer
        (e.g. linear attention); layers marked sliding without a window; a config of
        another model type that sets ``sliding_window`` without ``layer_types`` (its
        pattern is not known here: pass ``layer_types``).
    """
    cfg = config if isinstance(config, Mapping) else config.to_dict()
    num_layers = cfg.get("num_hidden_layers")
    if _static_int(num_layers) is None or num_layers < 1:
        raise ValueError(f"layer_types_from_config: num_hidden_layers must be an int >= 1, got {num_layers!r}.")
    model_type = str(cfg.get("model_type", "")).lower()
    window = cfg.get("sliding_window")
    if model_type in _QWEN_TYPES and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is not None:
        types = tuple(types)
        if len(types) != num_layers:
            raise ValueError(
                f"layer_types_from_config: layer_types has {len(types)} entries, expected one per layer "
                f"({num_layers})."
            )
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise ValueError(
                f"layer_types_from_config: only {FULL!r} and {SLIDING!r} layers have a jaxkv cache, got {other}."
            )
    elif model_type in _QWEN_TYPES:
        first = cfg.get("max_window_layers", num_layers)
        types = tuple(SLIDING if window is not None and i >= first else FULL for i in range(num_layers))
    elif model_type in _ALL_SLIDING_TYPES or window is None:
        types = ((SLIDING if window is not None else FULL),) * num_layers
    else:
        raise ValueError(
            f"layer_types_from_config: a {model_type or 'config'} with sliding_window={window} but no "
            "layer_types; which layers slide is not known for this model type. Pass layer_types."
        )
    if SLIDING not in types:
        return types, None
    if _static_int(window) is None or window < 1:
        raise ValueError(
            f"layer_types_from_config: layers are marked sliding but the sliding window is {window!r}."
        )
    return types, int(window)


@dataclasses.dataclass(frozen=True)
class HybridCache:
    """Full-attention layers in a ``StaticCache``, sliding layers in a ``SlidingWindowCache``.

    Layer ``i`` of kind ``layer_types[i]`` is layer number (count of earlier layers of the
    same kind) of its part. Both parts share the batch rows; every row op applies to both.

    Attributes:
      full: the full layers' ``StaticCache`` (None if there are none).
      sliding: the sliding layers' ``SlidingWindowCache`` (None if there are none).
      layer_types: static, one ``"full_attention"``/``"sliding_attention"`` per layer.

    Example:
      >>> cache = HybridCache.init(layer_types=["sliding_attention", "full_attention"],
      ...                          batch_size=1, num_kv_heads=1, head_dim=4,
      ...                          max_length=64, window=8)
      >>> k = jnp.ones((1, 1, 3, 4))
      >>> cache, view = cache.update_view(k, k, 0)   # view.sliding_window == 8
      >>> cache.get_max_length(), cache.sliding.capacity
      (64, 8)
    """

    full: StaticCache | None
    sliding: SlidingWindowCache | None
    layer_types: tuple[str, ...]  # static

    # ---- construction

    @classmethod
    def init(
        cls,
        *,
        layer_types: Sequence[str],
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        window: int | None = None,
        extra_slots: int = 0,
        dtype: Any = jnp.float32,
    ) -> HybridCache:
        """Allocates an empty hybrid cache.

        Args:
          layer_types: one ``"full_attention"`` or ``"sliding_attention"`` per layer.
          batch_size, num_kv_heads, head_dim: sizes shared by all layers.
          max_length: capacity of the full layers.
          window: the sliding layers' window (required if any layer slides).
          extra_slots: sliding ring slots beyond the window (rollback depth, see
            ``SlidingWindowCache``).
          dtype: floating storage dtype.

        Raises:
          ValueError: an unknown layer type, no layers, or sliding layers without a window.
        """
        types = tuple(layer_types)
        if not types:
            raise ValueError("HybridCache.init: layer_types is empty; a cache needs at least one layer.")
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"HybridCache.init: layer types must be {FULL!r} or {SLIDING!r}, got {unknown}.")
        num_full, num_sliding = types.count(FULL), types.count(SLIDING)
        if num_sliding and window is None:
            raise ValueError("HybridCache.init: layers are marked sliding, so window must be given.")
        shared = dict(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        full = StaticCache.init(num_layers=num_full, max_length=max_length, **shared) if num_full else None
        sliding = (
            SlidingWindowCache.init(num_layers=num_sliding, window=window, extra_slots=extra_slots, **shared)
            if num_sliding
            else None
        )
        return cls(full=full, sliding=sliding, layer_types=types)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        batch_size: int,
        max_length: int,
        extra_slots: int = 0,
        dtype: Any = jnp.float32,
    ) -> HybridCache:
        """A cache shaped for an HF decoder config (dict or ``PretrainedConfig``); the layer
        kinds come from :func:`layer_types_from_config`, head_dim from ``head_dim`` or
        ``hidden_size // num_attention_heads``."""
        cfg = config if isinstance(config, Mapping) else config.to_dict()
        types, window = layer_types_from_config(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls.init(
            layer_types=types,
            batch_size=batch_size,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_length=max_length,
            window=window,
            extra_slots=extra_slots,
            dtype=dtype,
        )

    # ---- layout

    def _part(self, layer_idx: Any, who: str) -> tuple[str, int]:
        """``(kind, index within its part)`` of a static layer index."""
        i = _static_int(layer_idx)
        if i is None:
            raise TypeError(
                f"{who}: layer_idx must be a Python int (full and sliding layers have different "
                f"shapes, so the layer is chosen at trace time), got {layer_idx!r}."
            )
        if not 0 <= i < len(self.layer_types):
            raise ValueError(
                f"{who}: layer_idx {i} is out of range for a cache with {len(self.layer_types)} layers; "
                f"valid indices are 0..{len(self.layer_types) - 1}."
            )
        kind = self.layer_types[i]
        return kind, self.layer_types[:i].count(kind)

    def _parts(self) -> tuple[Any, ...]:
        return tuple(p for p in (self.full, self.sliding) if p is not None)

    def _with(self, fn) -> HybridCache:
        return dataclasses.replace(
            self,
            full=None if self.full is None else fn(self.full),
            sliding=None if self.sliding is None else fn(self.sliding),
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def batch_size(self) -> int:
        return self._parts()[0].batch_size

    @property
    def window(self) -> int | None:
        return None if self.sliding is None else self.sliding.window

    @property
    def flags(self) -> Array:
        """int32[B]: the flags of both parts, OR-ed."""
        parts = self._parts()
        return parts[0].flags if len(parts) == 1 else parts[0].flags | parts[1].flags

    @property
    def overflowed(self) -> Array:
        return (self.flags & OVERFLOW) != 0

    # ---- sequence protocol

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer_idx: int) -> tuple[Array, Array]:
        """The layer's buffers: ``[B, H, S, D]`` for a full layer, the ring ``[B, H, C, D]``
        (slot order, see ``kv_positions``) for a sliding one."""
        kind, j = self._part(layer_idx, "HybridCache.__getitem__")
        return (self.full if kind == FULL else self.sliding)[j]

    def __iter__(self) -> Iterator[tuple[Array, Array]]:
        for i in range(self.num_layers):
            yield self[i]

    # ---- queries

    def seq_lengths(self, layer_idx: Any = 0) -> Array:
        """int32[B]: tokens seen per row by ``layer_idx``."""
        kind, j = self._part(layer_idx, "HybridCache.seq_lengths")
        return (self.full if kind == FULL else self.sliding).seq_lengths(j)

    def get_seq_length(self, layer_idx: Any = 0) -> int | Array:
        longest = jnp.max(self.seq_lengths(layer_idx))
        return longest if _is_traced(longest) else int(longest)

    def get_max_length(self) -> int | None:
        """The full layers' capacity; None if every layer slides (no length limit)."""
        return None if self.full is None else self.full.max_length

    def positions(self, num_tokens: int, layer_idx: Any = 0) -> Array:
        """int32[B, T]: the absolute positions the next ``num_tokens`` tokens will take."""
        return self.seq_lengths(layer_idx)[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]

    def kv_positions(self, layer_idx: Any = 0) -> Array:
        """int32[B, S or C]: the position held by each slot of the layer (``NO_POSITION``
        where none); for a full layer slot ``s`` holds ``s`` while ``s < length``."""
        kind, j = self._part(layer_idx, "HybridCache.kv_positions")
        if kind == SLIDING:
            return self.sliding.kv_positions(j)
        slots = jnp.arange(self.full.max_length, dtype=jnp.int32)[None, :]
        return jnp.where(slots < self.full.seq_lengths(j)[:, None], slots, jnp.int32(NO_POSITION))

    def check(self) -> HybridCache:
        """Raises ``CacheError`` on the host if any flag of either part is set."""
        _raise_on_flags(
            self.flags,
            "HybridCache",
            f"overflowed max_length={self.get_max_length()} (tokens past capacity were dropped)",
            "got an out-of-range index or num_new, or a crop that needed evicted tokens",
        )
        return self

    # ---- ops

    def update(
        self, key_states: Any, value_states: Any, layer_idx: int, *, num_new: Any = None
    ) -> tuple[HybridCache, Array, Array]:
        """Writes one layer; returns ``(cache, keys, values)`` as that layer's kind does.

        See :meth:`update_view` for the positions that go with the keys.
        """
        cache, view = self.update_view(key_states, value_states, layer_idx, num_new=num_new)
        return cache, view.keys, view.values

    def update_view(
        self, key_states: Any, value_states: Any, layer_idx: int, *, num_new: Any = None
    ) -> tuple[HybridCache, LayerView]:
        """Writes new tokens of one layer (static index); returns the cache and a
        :class:`~jaxkv.sliding.LayerView` for attention (its ``sliding_window`` is the
        window for a sliding layer, None for a full one).

        Raises:
          TypeError: a traced or non-int ``layer_idx``; any error of the layer's cache.
          ValueError: an out-of-range layer; any error of the layer's cache.
        """
        kind, j = self._part(layer_idx, "HybridCache.update")
        if kind == SLIDING:
            sliding, view = self.sliding.update_view(key_states, value_states, j, num_new=num_new)
            return dataclasses.replace(self, sliding=sliding), view
        full, keys, values = self.full.update(key_states, value_states, j, num_new=num_new)
        return dataclasses.replace(self, full=full), LayerView(keys, values, None, full.seq_lengths(j), None)

    def crop(self, max_length: Any) -> HybridCache:
        """Rolls every layer back to at most ``max_length`` tokens per row (int or
        int32[B]; negative: that many off the end of layer 0's length).

        Raises:
          ValueError: (eagerly) a sliding layer would need evicted tokens; see
            ``SlidingWindowCache.crop`` (under jit: the ``INVALID`` flag).
        """
        target = _crop_targets(max_length, self.seq_lengths(0), self.batch_size, "HybridCache.crop")
        return self._with(lambda part: part.crop(target))

    def reorder_cache(self, beam_idx: Any) -> HybridCache:
        """Gathers the rows of both parts by ``beam_idx`` (int[B])."""
        idx = _check_beam_idx(beam_idx, self.batch_size, "HybridCache.reorder_cache")
        return self._with(lambda part: part.reorder_cache(idx))

    def batch_select_indices(self, indices: Any) -> HybridCache:
        """Keeps only the rows in ``indices`` (int[N]) in both parts."""
        idx = _check_row_indices(indices, self.batch_size, "HybridCache.batch_select_indices")
        return self._with(lambda part: part.batch_select_indices(idx))

    def batch_repeat_interleave(self, repeats: int) -> HybridCache:
        """Repeats every row ``repeats`` times in both parts, interleaved."""
        r = _check_repeats(repeats, "HybridCache.batch_repeat_interleave")
        return self._with(lambda part: part.batch_repeat_interleave(r))

    def reset(self, rows: Any = None) -> HybridCache:
        """Empties both parts (or the rows where ``rows`` (bool[B]) is true)."""
        if rows is not None:
            rows = _check_reset_rows(rows, self.batch_size, "HybridCache.reset")
        return self._with(lambda part: part.reset(rows))


jax.tree_util.register_dataclass(HybridCache, data_fields=["full", "sliding"], meta_fields=["layer_types"])


def update_and_attend(
    queries: Array,  # [B, Hq, T, D]
    key_states: Array,  # [B, H, T, D]
    value_states: Array,  # [B, H, T, D]
    cache: Any,
    layer_idx: Any,
    *,
    positions: Array,  # [B, T] int
    num_new: Array | None = None,  # [B] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> tuple[Array, Any]:
    """Writes one layer's new keys/values into any jaxkv cache, then attends over it.

    Works with ``StaticCache``, ``DynamicCache``, ``None`` (delegated to
    :func:`jaxkv.attention.cache_attention`) and every cache with ``update_view``
    (``SlidingWindowCache``, ``QuantizedCache``, ``HybridCache``, the self-attention of an
    ``EncoderDecoderCache``). The cache's own window wins for its sliding layers.

    Args:
      queries: [B, Hq, T, D] position-encoded queries.
      key_states, value_states: [B, H, T, D] the new tokens' keys and values.
      cache: the cache, or None.
      layer_idx: the layer to write and read.
      positions: [B, T] absolute positions of the new tokens (``cache.positions(T)`` taken
        before the first layer writes).
      num_new: optional [B] real tokens per row.
      sliding_window: the model's window for this layer (None: full attention). A
        cache whose layer has a window must agree with it.
      logit_softcap, scale: as in :func:`jaxkv.attention.attend`.

    Returns:
      ``(out [B, Hq, T, D], new_cache)``.

    Raises:
      ValueError: the cache's window for this layer differs from ``sliding_window``.
    """
    return cache_attention(
        queries, key_states, value_states, cache, layer_idx, positions=positions, num_new=num_new,
        sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
    )

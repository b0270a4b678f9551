"""``HybridCache``: a per-layer choice of full or sliding-window attention in one cache.

Models such as Qwen2/Qwen3 (``use_sliding_window`` + ``max_window_layers``), Gemma 2/3 and
other alternating local/global decoders mark each layer ``"full_attention"`` or
``"sliding_attention"`` (HF ``config.layer_types``). A :class:`HybridCache` is the one
container with two storages: the full layers in a :class:`ContiguousStorage` (capacity
``max_length``, read blockwise by attention) and the sliding layers in a
:class:`RingStorage` (``window`` slots), so a sliding layer costs O(window) memory.

The layer's kind is part of the treedef, so the layer index must be a Python int (a
``lax.scan`` over layers needs one layout: use a single-kind cache there).

Shape letters: L layers, B rows, H kv heads, S capacity, W window, T new tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.caches._checks import _check_extra, _check_sizes, _floating_dtype
from jaxkv.caches.container import KVCache
from jaxkv.caches.contiguous import ContiguousStorage, StaticCache
from jaxkv.caches.ring import RingStorage, SlidingWindowCache

Array = jax.Array

__all__ = ["FULL", "SLIDING", "HybridCache"]

FULL = "full_attention"
SLIDING = "sliding_attention"


class HybridCache(KVCache):
    """Full-attention layers in contiguous storage, sliding layers in rings; one container.

    Layer ``i`` of kind ``layer_types[i]`` is layer number (count of earlier layers of the
    same kind) of its storage. Both storages share the rows, lengths and flags; every op
    is the container's.

    Example:
      >>> cache = HybridCache.init(layer_types=["sliding_attention", "full_attention"],
      ...                          batch_size=1, num_kv_heads=1, head_dim=4,
      ...                          max_length=64, window=8)
      >>> k = jnp.ones((1, 1, 3, 4))
      >>> cache, view = cache.update_view(k, k, 0)   # view.sliding_window == 8
      >>> cache.get_max_length(), cache.sliding.capacity
      (64, 8)
    """

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
        sharding: jax.sharding.NamedSharding | None = None,
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
          sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]``, as for
            ``StaticCache.init``.

        Raises:
          ValueError: an unknown layer type, no layers, or sliding layers without a window.
        """
        who = "HybridCache.init"
        if isinstance(layer_types, str):  # its characters were reported as layer types (review 84)
            raise ValueError(f"{who}: layer_types is a sequence of one type per layer, got the string "
                             f"{layer_types!r}; e.g. [{layer_types!r}] * num_layers.")
        types = tuple(layer_types)
        if not types:
            raise ValueError(f"{who}: layer_types is empty; a cache needs at least one layer.")
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"{who}: layer types must be {FULL!r} or {SLIDING!r}, got {unknown}.")
        num_full, num_sliding = types.count(FULL), types.count(SLIDING)
        if num_sliding and window is None:
            raise ValueError(f"{who}: layers are marked sliding, so window must be given.")
        _check_sizes(who, batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim, max_length=max_length)
        if num_sliding:
            _check_sizes(who, window=window)
            extra_slots = _check_extra(extra_slots, "extra_slots", who, base=int(window))  # not a bool
        dtype = _floating_dtype(dtype, who)
        shared = (batch_size, num_kv_heads, head_dim)
        kinds = [k for k in (FULL, SLIDING) if k in types]

        def make_stores():
            out = []
            if num_full:
                out.append(ContiguousStorage.zeros(num_full, *shared, max_length, dtype))
            if num_sliding:
                out.append(RingStorage.zeros(num_sliding, *shared, int(window), extra_slots, dtype))
            return out

        return cls._allocate(
            make_stores, num_layers=len(types), batch_size=batch_size,
            groups=tuple(kinds.index(t) for t in types), sharding=sharding,
        )

    @classmethod
    def from_config(
        cls, config: Any, *, batch_size: int, max_length: int, extra_slots: int = 0, dtype: Any = jnp.float32
    ) -> HybridCache:
        """A cache shaped for an HF decoder config (dict or ``PretrainedConfig``).

        The layer kinds come from :func:`jaxkv.models.layer_types_from_config`, the rule the
        models use too; kv heads and head_dim by :func:`jaxkv.models.layer_types.attention_geometry`,
        the models' rule too (a key the file leaves out is transformers' class default).
        """
        # The rule is pure Python (no flax): the one place that reads HF layer kinds.
        from jaxkv.models.layer_types import attention_geometry, layer_types_from_config

        if not isinstance(config, Mapping) and not hasattr(config, "to_dict"):  # AttributeError before (review 84)
            raise TypeError(
                f"HybridCache.from_config takes an HF config (a config.json dict or a transformers PretrainedConfig), "
                f"got {type(config).__name__}; for a jaxkv model use model.init_cache(batch_size, max_length, "
                "kind='hybrid')."
            )
        missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers")
                   if (config.get(k) if isinstance(config, Mapping) else getattr(config, k, None)) is None]
        if missing:  # a bare KeyError before
            raise ValueError(f"HybridCache.from_config: the config has no {', '.join(missing)}.")

        cfg = config if isinstance(config, Mapping) else config.to_dict()
        types, window = layer_types_from_config(config)  # (a config object: its class's rule, not config.json's)
        heads = cfg["num_attention_heads"]
        kv_heads, head_dim = attention_geometry(config)  # the models' rule: a left-out key is the class default
        return cls.init(
            layer_types=types,
            batch_size=batch_size,
            num_kv_heads=kv_heads or heads,
            head_dim=head_dim or cfg["hidden_size"] // heads,
            max_length=max_length,
            window=window,
            extra_slots=extra_slots,
            dtype=dtype,
        )

    # ---- layout

    @property
    def layer_types(self) -> tuple[str, ...]:
        """One ``"full_attention"``/``"sliding_attention"`` per layer."""
        return tuple(SLIDING if isinstance(self.stores[g], RingStorage) else FULL for g in self.groups)

    @property
    def window(self) -> int | None:
        """The sliding layers' window (None if no layer slides)."""
        ring = self._store(SLIDING)
        return None if ring is None else ring.window

    @property
    def full(self) -> StaticCache | None:
        """The full layers as a ``StaticCache`` (same buffers; None if there are none)."""
        return self._part(FULL, StaticCache)

    @property
    def sliding(self) -> SlidingWindowCache | None:
        """The sliding layers as a ``SlidingWindowCache`` (same buffers; None if none)."""
        return self._part(SLIDING, SlidingWindowCache)

    def _store(self, kind: str) -> Any:
        for store in self.stores:
            if isinstance(store, RingStorage) == (kind == SLIDING):
                return store
        return None

    def _part(self, kind: str, cls: type) -> Any:
        store = self._store(kind)
        if store is None:
            return None
        layers = [i for i, t in enumerate(self.layer_types) if t == kind]
        return cls(
            stores=(store,), lengths=self.lengths[jnp.asarray(layers)], flags=self.flags,
            groups=(0,) * len(layers), sharding=self.sharding,
        )

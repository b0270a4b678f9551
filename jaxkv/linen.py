"""Flax linen integration: the same explicit-cache pattern as :mod:`jaxkv.nnx`.

A linen module's ``apply`` is already a pure function, so a jaxkv cache fits it as an
ordinary argument and return value; no ``"cache"`` collection or ``mutable=`` is needed::

    attn = KVSelfAttention(num_heads=4, num_kv_heads=2, head_dim=8, layer_idx=0)
    params = attn.init(rng, x, cache, positions=positions)
    y, cache = attn.apply(params, x, cache, positions=positions)

Shape letters: B batch, T new tokens, E embedding width, Hq query heads, H kv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.attention import cache_attention
from jaxkv.caches import DynamicCache, StaticCache
from jaxkv.caches._checks import _check_sizes
from jaxkv.caches.container import check_cache
from jaxkv.nnx import _check_positions
from jaxkv.serialization import register_flax_serialization

__all__ = ["KVSelfAttention"]


class KVSelfAttention(nn.Module):
    """Grouped-query self-attention over one layer of a jaxkv cache (linen).

    Attributes:
        num_heads: Hq.
        num_kv_heads: H.
        head_dim: D.
        layer_idx: the cache layer this module writes and reads; None: given per call
            (``layer_idx=`` of ``__call__``, which wins over this field: under ``nn.scan``
            over layers the one module instance must write a different layer each step).
        use_bias: bias on the q/k/v projections.
        sliding_window: optional attention window (see :func:`jaxkv.attention.attend`).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_idx: int | None = None
    use_bias: bool = False
    sliding_window: int | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,  # [B, T, E]
        cache: StaticCache | DynamicCache | None,
        *,
        positions: jax.Array,  # [B, T] int
        num_new: jax.Array | None = None,  # [B] int
        rope: Callable[[jax.Array], jax.Array] | None = None,
        layer_idx: int | jax.Array | None = None,
    ) -> tuple[jax.Array, StaticCache | DynamicCache | None]:
        """Same contract as :meth:`jaxkv.nnx.KVAttention.__call__`: ``(y [B, T, E], new_cache)``.
        ``layer_idx`` (an int or a traced int, e.g. an ``nn.scan`` step's layer) overrides
        the attribute; one of the two is required."""
        layer = self.layer_idx if layer_idx is None else layer_idx
        if layer is None and cache is not None:  # without a cache there is no layer to name, as in KVAttention
            raise ValueError("KVSelfAttention: no cache layer: set the layer_idx attribute or pass layer_idx= "
                             "to the call (under nn.scan over layers: the scanned layer index)")
        if cache is not None:
            check_cache(cache, "KVSelfAttention")
        _check_positions(positions, "KVSelfAttention")
        _check_sizes("KVSelfAttention", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim)
        if jnp.ndim(x) != 3:
            raise ValueError(f"KVSelfAttention: x must be [batch, tokens, embed_dim], got shape {list(jnp.shape(x))}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"KVSelfAttention: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        embed_dim = x.shape[-1]

        def heads(name, n):  # [B, T, E] -> [B, n, T, D]
            y = nn.DenseGeneral((n, self.head_dim), use_bias=self.use_bias, name=name)(x)
            return y.transpose(0, 2, 1, 3)

        q = heads("q_proj", self.num_heads)
        k = heads("k_proj", self.num_kv_heads)
        v = heads("v_proj", self.num_kv_heads)
        if rope is not None:
            q, k = rope(q), rope(k)
        out, cache = cache_attention(
            q, k, v, cache, 0 if layer is None else layer, positions=positions, num_new=num_new, sliding_window=self.sliding_window
        )  # [B, Hq, T, D]
        y = nn.DenseGeneral(embed_dim, axis=(-2, -1), use_bias=False, name="o_proj")(out.transpose(0, 2, 1, 3))
        return y, cache


# Flax is here anyway: teach flax.serialization every cache kind.
register_flax_serialization()

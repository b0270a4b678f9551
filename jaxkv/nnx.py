"""Flax NNX integration: attention whose cache is an explicit argument and return value.

Modules here hold only parameters; the cache never lives in module state. A forward pass
reads the positions of its new tokens from the cache, writes every layer at those
positions and returns the new cache::

    logits, cache = model(tokens, cache)             # prefill: tokens [B, T]
    logits, cache = model(next_token[:, None], cache)  # decode: the same code, T = 1

Because the cache is an ordinary pytree argument, the step can be jitted with the cache
donated (``nnx.jit(step, donate_argnames="cache")``), so XLA updates it in place.

Shape letters: B batch, T new tokens, E embedding width, Hq query heads, H kv heads,
D head dim, S cache slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.attention import cache_attention, token_positions
from jaxkv.caches import DynamicCache, StaticCache
from jaxkv.caches._checks import _check_sizes
from jaxkv.caches.container import check_cache
from jaxkv.serialization import register_flax_serialization

__all__ = ["CacheSpec", "KVAttention", "init_cache", "token_positions"]

Cache = StaticCache | DynamicCache


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The cache geometry a decoder needs: enough to allocate a :class:`StaticCache`.

    Attributes:
        num_layers: L, decoder layers that each write one cache layer.
        num_kv_heads: H.
        head_dim: D.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int


def init_cache(
    spec: CacheSpec, batch_size: int, max_length: int, *, dtype: Any = jnp.float32, sharding: Any = None
) -> StaticCache:
    """An empty :class:`StaticCache` shaped for a decoder.

    Args:
        spec: the decoder's :class:`CacheSpec` (e.g. ``model.cache_spec``).
        batch_size: B.
        max_length: S, capacity in tokens (prompt plus everything generated).
        dtype: storage dtype of keys and values.
        sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]``.

    Returns:
        A StaticCache with buffers [L, B, H, S, D] and all lengths 0.
    """
    return StaticCache.init(
        num_layers=spec.num_layers,
        batch_size=batch_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_length=max_length,
        dtype=dtype,
        sharding=sharding,
    )


def _check_positions(positions: Any, who: str) -> None:
    """Positions are integer token indices: a float array would be truncated where masks
    compare it and used as is by RoPE, silently disagreeing with itself."""
    dtype = getattr(positions, "dtype", None)
    if dtype is None and positions is not None:
        try:
            dtype = np.asarray(positions).dtype
        except (TypeError, ValueError):
            dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{who}: positions must be an integer [B, T] array (token_positions(cache, B, T)), got "
            f"{type(positions).__name__} of dtype {dtype}"
        )


class KVAttention(nnx.Module):
    """Grouped-query self-attention over one layer of a jaxkv cache.

    Projects ``x`` to queries, keys and values, optionally normalises queries and keys per
    head (Qwen3), applies a position encoding, writes the new keys/values into the cache
    layer ``layer_idx`` and attends over everything that layer holds.

    Args:
        embed_dim: E.
        num_heads: Hq.
        num_kv_heads: H (Hq must be a multiple).
        head_dim: D.
        layer_idx: which cache layer this module reads and writes; None when every
            call says it (a model scanning one module over stacked layer weights).
        qkv_bias: bias on the q/k/v projections (Qwen2).
        out_bias: bias on the output projection.
        q_norm, k_norm: optional modules applied to [..., D] per head before the
            position encoding.
        sliding_window: if set, a query sees only the last ``sliding_window`` positions
            (itself included). A call may set it instead (per layer of a stacked model).
            When neither sets one, a ring cache layer (``SlidingWindowCache``) applies
            its own window: it holds no older token. A model that knows which of its
            layers are full should refuse a ring there (``Llama`` does).
        logit_softcap: optional soft-capping of attention logits.
        param_dtype: dtype of the projection weights.
        rngs: initialisation randomness.

    Example:
        >>> attn = KVAttention(32, 4, 2, 8, layer_idx=0, rngs=nnx.Rngs(0))  # doctest: +SKIP
        >>> positions = token_positions(cache, 2, 5)                          # doctest: +SKIP
        >>> y, cache = attn(x, cache, positions=positions)                    # doctest: +SKIP
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        layer_idx: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        q_norm: nnx.Module | None = None,
        k_norm: nnx.Module | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        _check_sizes("KVAttention", embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )

        def linear(n_in, n_out, bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(embed_dim, num_heads * head_dim, qkv_bias)
        self.k_proj = linear(embed_dim, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = linear(embed_dim, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = linear(num_heads * head_dim, embed_dim, out_bias)
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def __call__(
        self,
        x: jax.Array,  # [B, T, E]
        cache: Cache | None,
        *,
        positions: jax.Array,  # [B, T] int
        num_new: jax.Array | None = None,  # [B] int
        rope: Callable[[jax.Array], jax.Array] | None = None,
        layer_idx: int | jax.Array | None = None,
        sliding_window: int | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Attends the new tokens over the cache and returns the output and the new cache.

        Args:
            x: [B, T, E] hidden states of the new tokens.
            cache: StaticCache, DynamicCache, or None for a plain full forward (the T
                tokens attend causally among themselves only).
            positions: [B, T] absolute positions of the new tokens
                (:func:`token_positions`, taken before any layer writes).
            num_new: [B] how many of the T tokens are real per row (the rest is padding:
                not stored, never attended to). Default: all T. Not for DynamicCache,
                whose rows share one length.
            rope: position encoding applied to [B, heads, T, D] queries and keys (already
                bound to ``positions``), or None.
            layer_idx: the cache layer for this call, overriding the module's: a Python
                int, or a traced int32 scalar inside a ``lax.scan`` over layers (caches
                with one storage; see :class:`jaxkv.caches.KVCache`).
            sliding_window: this call's window, for a module built without one.

        Returns:
            ``(y [B, T, E], new_cache)``; ``new_cache`` is None when ``cache`` is None.
            Outputs at padding tokens are finite but meaningless.

        Raises:
            ValueError: ``num_new`` with a DynamicCache, shapes that do not match, no
                layer index (neither the module's nor the call's), or a call window that
                differs from the module's.
            TypeError: a cache that is not a jaxkv cache, or positions that are not integers.
        """
        if cache is not None:
            check_cache(cache, "KVAttention")
        _check_positions(positions, "KVAttention")
        positions = jnp.asarray(positions)  # a nested list is fine (it failed on .shape further in)
        if jnp.ndim(x) != 3:
            raise ValueError(f"KVAttention: x must be [batch, tokens, embed_dim], got shape {list(jnp.shape(x))}")
        if jnp.shape(x)[-1] != self.q_proj.in_features:
            raise ValueError(
                f"KVAttention: x must be [batch, tokens, embed_dim] with the module's embed_dim "
                f"{self.q_proj.in_features}, got shape {list(jnp.shape(x))}"
            )
        if layer_idx is None:
            layer_idx = self.layer_idx
        if layer_idx is None and cache is not None:
            raise ValueError("KVAttention: no cache layer: build it with layer_idx=, or pass layer_idx= to the call")
        if sliding_window is None:
            sliding_window = self.sliding_window
        elif self.sliding_window is not None and sliding_window != self.sliding_window:
            raise ValueError(
                f"KVAttention: the call asks for sliding_window={sliding_window} but the module was built "
                f"with {self.sliding_window}; build it without a window to set one per call"
            )
        batch, num_tokens, _ = x.shape

        def heads(proj, n):  # [B, T, E] -> [B, T, n, D]
            return proj(x).reshape(batch, num_tokens, n, self.head_dim)

        q = heads(self.q_proj, self.num_heads)
        k = heads(self.k_proj, self.num_kv_heads)
        v = heads(self.v_proj, self.num_kv_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # -> [B, heads, T, D]
        if rope is not None:
            q, k = rope(q), rope(k)

        out, cache = cache_attention(
            q,
            k,
            v,
            cache,
            layer_idx,
            positions=positions,
            num_new=num_new,
            sliding_window=sliding_window,
            logit_softcap=self.logit_softcap,
        )  # [B, Hq, T, D]
        out = out.transpose(0, 2, 1, 3).reshape(batch, num_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out), cache


# Flax is here anyway: teach flax.serialization every cache kind.
register_flax_serialization()

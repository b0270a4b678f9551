"""From a cache to attention: write one layer, then read it the way its view is laid out.

:func:`cache_attention` is what models and framework modules call for every layer; it
asks the cache to ``write`` (every kind returns a view of :mod:`jaxkv.caches.views`) and
:func:`attend_view` dispatches on the view's type, never on the cache class.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.attention import pallas_gpu
from jaxkv.attention.blockwise import blockwise_attend, paged_blockwise_attend, quantized_blockwise_attend
from jaxkv.attention.dense import attend
from jaxkv.caches._checks import _is_traced, _new_counts
from jaxkv.caches.views import ContiguousView, LayerView, PagedView, QuantizedView

__all__ = ["attend_view", "cache_attention", "token_positions", "update_and_attend"]


def token_positions(cache: Any, batch_size: int, num_tokens: int) -> jax.Array:  # [B, T] int32
    """Absolute positions of the next ``num_tokens`` tokens of every row.

    Read them once, before the first layer writes: every layer of one forward pass writes
    at the same positions.

    Args:
        cache: any jaxkv cache (it knows its rows' lengths), or None (positions start at 0).
        batch_size: B.
        num_tokens: T.

    Returns:
        int32 [B, T] positions.
    """
    if cache is None:
        return jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32), (batch_size, num_tokens))
    rows = getattr(cache, "batch_size", None)
    if isinstance(rows, int) and rows != batch_size:  # [rows, T] came back for [B, T] (review 84)
        raise ValueError(f"token_positions: batch_size={batch_size}, but the cache holds {rows} rows.")
    return cache.positions(num_tokens, 0, batch_size=batch_size)


def attend_view(
    queries: jax.Array,  # [B, Hq, T, D]
    view: Any,
    *,
    q_positions: jax.Array,  # [B, T] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> jax.Array:  # [B, Hq, T, D]
    """Attention of new queries over one layer, read the way its view says it is laid out.

    The one dispatch point, on the view's type (never on the cache class):

    * :class:`~jaxkv.caches.ContiguousView` (StaticCache, a HybridCache's full layers, an
      EncoderDecoderCache's static self part): :func:`jaxkv.attention.blockwise.blockwise_attend`
      over the stacked buffers: only filled blocks are read (the CPU kernel on CPU).
    * :class:`~jaxkv.caches.QuantizedView`: the same blockwise loop, dequantizing each
      block as it is read (never the whole layer), with the exact residual tokens patched
      in; on CPU the kernel reads the codes, scales and residual in place.
    * :class:`~jaxkv.caches.PagedView` (PagedCache): the same loop, each block's pages
      gathered through the row's block table (dequantized for int8/int4 pages); on CPU the
      kernel reads the pool through the table, float or int8/int4.
    * On a GPU, contiguous, quantized and paged views go to the Pallas split-K kernels of
      :mod:`jaxkv.attention.pallas_gpu` where they apply (``JAXKV_PALLAS_GPU``: ``auto``,
      ``1`` forces them, in interpret mode off a GPU; ``0`` turns them off).
    * :class:`~jaxkv.caches.LayerView` (rings, DynamicCache, encoder states): dense
      :func:`attend` with per-slot positions. A ring's own window wins; a model asking for
      another window is an error.

    Raises:
        ValueError: the view's window differs from ``sliding_window``; errors of the paths.
        TypeError: not a view.
    """
    if pallas_gpu.use_pallas(queries, view):  # on a GPU (or JAXKV_PALLAS_GPU=1): the Pallas kernels
        return pallas_gpu.pallas_attend_view(
            queries, view, q_positions=q_positions, sliding_window=sliding_window, logit_softcap=logit_softcap,
            scale=scale, interpret=pallas_gpu.interpret_default(),
        )
    if isinstance(view, ContiguousView):
        return blockwise_attend(
            queries, view.keys, view.values, layer_idx=view.layer, q_positions=q_positions,
            kv_lengths=view.lengths, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
            kv_dtype=view.dtype,
        )
    if isinstance(view, PagedView):
        return paged_blockwise_attend(
            queries, view, q_positions=q_positions, sliding_window=sliding_window, logit_softcap=logit_softcap,
            scale=scale,
        )
    if isinstance(view, QuantizedView):
        return quantized_blockwise_attend(
            queries, view, q_positions=q_positions, sliding_window=sliding_window, logit_softcap=logit_softcap,
            scale=scale,
        )
    if isinstance(view, LayerView):
        if view.sliding_window is not None:
            if sliding_window is not None and sliding_window != view.sliding_window:
                raise ValueError(
                    f"the cache layer has window {view.sliding_window} but the model asks for "
                    f"sliding_window={sliding_window}; build the cache with the model's window"
                )
            sliding_window = view.sliding_window
        return attend(
            queries, view.keys, view.values, q_positions=q_positions, kv_lengths=view.kv_lengths,
            kv_positions=view.kv_positions, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
        )
    raise TypeError(f"attend_view: expected a jaxkv layer view, got {type(view).__name__}")


def cache_attention(
    queries: jax.Array,  # [B, Hq, T, D]
    keys: jax.Array,  # [B, H, T, D]
    values: jax.Array,  # [B, H, T, D]
    cache: Any,
    layer_idx: int | jax.Array,
    *,
    positions: jax.Array,  # [B, T] int
    num_new: jax.Array | None = None,  # [B] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, Any]:
    """Writes one layer's new keys/values into any jaxkv cache, then attends over that layer.

    Every cache kind goes the same way: ``cache.write`` returns the layer's view, and
    :func:`attend_view` reads it by its layout. Framework modules (``jaxkv.nnx``,
    ``jaxkv.linen``) and the models call this.

    Args:
        queries: [B, Hq, T, D] position-encoded queries of the new tokens.
        keys: [B, H, T, D] position-encoded keys of the new tokens.
        values: [B, H, T, D] values of the new tokens.
        cache: any jaxkv cache, or None (the T tokens are the whole context).
        layer_idx: the cache layer to write and read.
        positions: [B, T] absolute positions of the new tokens (:func:`token_positions`).
        num_new: [B] real tokens per row; the rest is padding, never stored or attended
            to. Default all T. A DynamicCache cannot take it (its rows share one length).
        sliding_window, logit_softcap, scale: as in :func:`attend`.

    Returns:
        ``(out [B, Hq, T, D], new_cache)``; ``new_cache`` is None when ``cache`` is None.

    Raises:
        ValueError: ``num_new`` with a DynamicCache, a window mismatch, or any error of
            the cache's write or of attention.
    """
    invalid = None
    if cache is None:
        # Slot t holds the token at positions[:, t]. num_new is checked as a cache write checks
        # it (a concrete count outside [0, T] raises; a traced one makes its row NaN, where a
        # cache would flag it): a negative count gave a row of zeros.
        lengths, invalid = _new_counts(num_new, queries.shape[0], keys.shape[2], "cache_attention")
        if not _is_traced(num_new):  # checked on the host: nothing to poison, no select on the output
            invalid = None
        view = LayerView(keys, values, positions, lengths, None)
    else:
        cache, view = cache.write(keys, values, layer_idx, num_new=num_new)
    out = attend_view(
        queries, view, q_positions=positions, sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale
    )
    if invalid is not None:
        out = jnp.where(invalid[:, None, None, None], jnp.asarray(jnp.nan, out.dtype), out)
    return out, cache


def update_and_attend(
    queries: jax.Array,
    key_states: jax.Array,
    value_states: jax.Array,
    cache: Any,
    layer_idx: Any,
    *,
    positions: jax.Array,
    num_new: jax.Array | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, Any]:
    """:func:`cache_attention` under its earlier name (kept for existing callers)."""
    return cache_attention(
        queries, key_states, value_states, cache, layer_idx, positions=positions, num_new=num_new,
        sliding_window=sliding_window, logit_softcap=logit_softcap, scale=scale,
    )

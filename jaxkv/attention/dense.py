"""Attention of new queries over a layer's cached keys and values.

Shape letters: B batch, T new tokens (queries), S cache slots, D head dim,
H kv heads, Hq query heads (a multiple of H), G = Hq // H query heads per kv head.

Visibility is decided by positions, never by array indices alone: slot ``s`` of row
``b`` holds the token at absolute position ``kv_positions[b, s]`` (``s`` by default,
which is how :class:`jaxkv.StaticCache` lays tokens out) and is *filled* iff
``s < kv_lengths[b]``. The query at absolute position ``p`` sees slot ``s`` iff

* the slot is filled: ``s < kv_lengths[b]``;
* it is not in the future: ``kv_positions[b, s] <= p``;
* with a sliding window ``W``, it is recent: ``p - kv_positions[b, s] < W``
  (the query sees itself and the ``W - 1`` tokens before it, as HF transformers).

Non-finite keys and values: one contract for :func:`attend`, the blockwise XLA loop and
the native CPU kernel of :mod:`jaxkv.attention.blockwise`:

* a slot a query cannot see (unfilled, in its future, outside its window) never affects
  that query, whatever it holds (NaN, inf, garbage);
* if any slot the query sees has a non-finite raw logit (``q . k * scale``, before the
  soft cap: a NaN or infinite key gives one) or a non-finite value element, the query's
  whole output row is NaN;
* otherwise the usual softmax over the visible slots; a query that sees nothing gets zeros.

(``implementation="jax"`` tells non-finite logits from non-finite queries and keys, so
a product of finite ones that overflows is not caught there.)

Values are assumed well inside float32's range: the blockwise loop and the kernels add up
weighted values before normalising, so values near float32's largest (|v| ~ 1e37 and more,
float32 or bfloat16 caches) can overflow that sum and give a NaN row where :func:`attend`,
which normalises first, stays finite (review 65; no model's activations are near it).
Likewise for logits: the CPU kernel scales the queries before the product, the other paths
the product, so a ``q . k`` past float32's range (but not ``(q * scale) . k``) is a NaN row
everywhere but on the CPU kernel.

The computation is written as max / sum-of-exponentials / weighted-sum over slots so
that a blockwise version (reading only the filled blocks, cost scaling with tokens
stored instead of capacity) can replace the body without changing this interface.

* :func:`attend` / :func:`attention_mask`: the math, on plain arrays.
* :func:`token_positions` / :func:`cache_attention`: the glue to a jaxkv cache (positions
  of new tokens; write one layer, then attend over it) shared by ``jaxkv.nnx`` and
  ``jaxkv.linen``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxkv.attention.blockwise import as_index_arrays, check_int_inputs, check_softcap, pv_operands, window_reach

__all__ = ["attend", "attention_mask"]

Implementation = Literal["jaxkv", "jax"]


def _check_int_array(name: str, x: jax.Array, shape: tuple[int, ...], fix: str) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}; {fix}")
    check_int_inputs("", **{name: x})


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(
            f"sliding_window must be a positive Python int or None, got {sliding_window!r}; "
            "pass the number of tokens a query may see, itself included"
        )


def attention_mask(
    q_positions: jax.Array,  # [B, T] int
    kv_lengths: jax.Array,  # [B] int
    *,
    num_slots: int,
    kv_positions: jax.Array | None = None,  # [B, S] or [S] int
    sliding_window: int | None = None,
) -> jax.Array:  # [B, T, S] bool
    """Which cache slots each query may attend to.

    Args:
        q_positions: [B, T] absolute positions of the queries.
        kv_lengths: [B] number of filled slots per row (slots ``>= kv_lengths[b]`` are unused).
        num_slots: S, the number of cache slots.
        kv_positions: [B, S] or [S] absolute position held by each slot; ``arange(S)`` if None.
        sliding_window: if set, a query at ``p`` sees only positions ``> p - sliding_window``.

    Returns:
        [B, T, S] boolean mask, True where the query sees the slot.

    Raises:
        ValueError: on shapes that do not match or a non-positive window.
    """
    q_positions, kv_lengths, kv_positions = as_index_arrays(q_positions, kv_lengths, kv_positions)
    _check_window(sliding_window)
    if q_positions.ndim != 2:
        raise ValueError(
            f"q_positions must have shape [batch, new_tokens], got {list(q_positions.shape)}; "
            "use cache.positions(num_tokens, layer_idx)"
        )
    batch = q_positions.shape[0]
    _check_int_array("q_positions", q_positions, q_positions.shape, "")
    _check_int_array("kv_lengths", kv_lengths, (batch,), "use cache.seq_lengths(layer_idx) after the update")
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    if kv_positions is None:
        kv_positions = slots[None, :]
    elif kv_positions.shape == (num_slots,):
        check_int_inputs("", kv_positions=kv_positions)  # as the [B, S] form is: 1.9 was read as 1
        kv_positions = kv_positions[None, :]
    else:
        _check_int_array("kv_positions", kv_positions, (batch, num_slots), "or pass shape [slots]")
    q_pos = q_positions.astype(jnp.int32)[:, :, None]  # [B, T, 1]
    kv_pos = kv_positions.astype(jnp.int32)[:, None, :]  # [B or 1, 1, S]
    filled = slots[None, None, :] < kv_lengths.astype(jnp.int32)[:, None, None]  # [B, 1, S]
    mask = filled & (kv_pos <= q_pos)
    if sliding_window is not None:
        mask = mask & (q_pos - kv_pos <= window_reach(sliding_window))
    return mask


def attend(
    queries: jax.Array,  # [B, Hq, T, D]
    keys: jax.Array,  # [B, H, S, D]
    values: jax.Array,  # [B, H, S, D]
    *,
    q_positions: jax.Array,  # [B, T] int
    kv_lengths: jax.Array,  # [B] int
    kv_positions: jax.Array | None = None,  # [B, S] or [S] int
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    implementation: Implementation = "jaxkv",
) -> jax.Array:  # [B, Hq, T, D]
    """Grouped-query attention of new queries over a layer's cache buffers.

    Query head ``i`` reads kv head ``i // G`` (the grouping of HF ``repeat_kv``). Logits
    and the softmax are computed in float32 whatever the input dtype; the output has the
    dtype of ``queries``. A query that sees no slot at all gets a zero output.

    Args:
        queries: [B, Hq, T, D] queries, already position-encoded.
        keys: [B, H, S, D] the layer's key buffer, e.g. as returned by ``cache.update``.
        values: [B, H, S, D] the layer's value buffer.
        q_positions: [B, T] absolute positions of the queries (``cache.positions(T)``
            taken *before* the update).
        kv_lengths: [B] filled slots per row (``cache.seq_lengths(layer)`` *after* the update).
        kv_positions: [B, S] or [S] absolute position of each slot; ``arange(S)`` if None.
        sliding_window: optional window; see the module docstring for the exact rule.
        logit_softcap: if set, logits become ``c * tanh(logits / c)`` (Gemma-2 style).
        scale: logit scale, ``1 / sqrt(D)`` if None.
        implementation: ``"jaxkv"`` (default) works in the cache layout and supports
            everything above; ``"jax"`` calls ``jax.nn.dot_product_attention`` with an
            explicit mask (it cannot soft-cap, and transposes keys/values to its
            [B, S, H, D] layout).

    Returns:
        [B, Hq, T, D] attention output; rows NaN where a visible slot holds a non-finite
        key or value (the module docstring states the exact rule).

    Raises:
        ValueError: on mismatched shapes, ``Hq`` not a multiple of ``H``, a bad window,
            soft-cap or implementation.

    Example:
        >>> cache, k_all, v_all = cache.update(k, v, layer_idx)        # doctest: +SKIP
        >>> out = attend(q, k_all, v_all, q_positions=positions,       # doctest: +SKIP
        ...              kv_lengths=cache.seq_lengths(layer_idx))
    """
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have shape [batch, heads, tokens, head_dim], got {list(x.shape)}; "
                "transpose from [batch, tokens, heads, head_dim] with .transpose(0, 2, 1, 3)"
            )
    if keys.shape != values.shape:
        raise ValueError(f"keys and values must have the same shape, got {list(keys.shape)} and {list(values.shape)}")
    q_positions, kv_lengths, kv_positions = as_index_arrays(q_positions, kv_lengths, kv_positions)
    batch, num_q_heads, num_tokens, head_dim = queries.shape
    kv_batch, num_kv_heads, num_slots, kv_head_dim = keys.shape
    if kv_batch != batch or kv_head_dim != head_dim:
        raise ValueError(
            f"queries [batch={batch}, head_dim={head_dim}] do not match keys "
            f"[batch={kv_batch}, head_dim={kv_head_dim}]; both must come from the same layer and batch"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}) for grouped-query attention"
        )
    if q_positions.shape != (batch, num_tokens):
        raise ValueError(
            f"q_positions must have shape [batch, new_tokens] = {[batch, num_tokens]}, got {list(q_positions.shape)}; "
            "use cache.positions(num_tokens, layer_idx) taken before the update"
        )
    check_softcap("attend", logit_softcap)
    if implementation not in ("jaxkv", "jax"):
        raise ValueError(f"implementation must be 'jaxkv' or 'jax', got {implementation!r}")
    if implementation == "jax" and logit_softcap is not None:
        raise ValueError("implementation='jax' cannot soft-cap logits; use implementation='jaxkv'")

    mask = attention_mask(
        q_positions, kv_lengths, num_slots=num_slots, kv_positions=kv_positions, sliding_window=sliding_window
    )  # [B, T, S]
    if scale is None:
        scale = head_dim**-0.5
    # Any slot may hold NaN or inf, seen or not; a zero probability times NaN is still NaN,
    # so non-finite values are zeroed and the rows whose visible slots held one are marked.
    finite_values = jnp.isfinite(values)
    bad_values = ~jnp.all(finite_values, axis=-1)  # [B, H, S]
    values = jnp.where(finite_values, values, jnp.zeros((), values.dtype))
    groups = num_q_heads // num_kv_heads

    if implementation == "jax":
        bad_slots = bad_values | ~jnp.all(jnp.isfinite(keys), axis=-1)  # [B, H, S]
        bad_queries = ~jnp.all(jnp.isfinite(queries), axis=-1)  # [B, Hq, T]
        sees_any = jnp.any(mask, axis=-1)  # [B, T]
        marked = jnp.any(mask[:, None] & bad_slots[:, :, None, :], axis=-1)  # [B, H, T]
        marked = jnp.repeat(marked, groups, axis=1) | (bad_queries & sees_any[:, None])  # [B, Hq, T]
        # jax.nn.dot_product_attention takes one dtype: a bf16 query over an f32 cache is
        # computed in f32 and returned in the query's dtype, as the "jaxkv" path does.
        common = jnp.result_type(queries, keys, values)
        out = jax.nn.dot_product_attention(
            queries.astype(common).transpose(0, 2, 1, 3),
            jnp.where(jnp.isfinite(keys), keys, jnp.zeros((), keys.dtype)).astype(common).transpose(0, 2, 1, 3),
            values.astype(common).transpose(0, 2, 1, 3),
            mask=mask[:, None, :, :],
            scale=scale,
        ).transpose(0, 2, 1, 3).astype(queries.dtype)
        # jax spreads a query that sees nothing uniformly over all slots; jaxkv returns zeros.
        out = jnp.where(sees_any[:, None, :, None], out, jnp.zeros((), out.dtype))
        return jnp.where(marked[..., None], jnp.nan, out)

    q = queries.reshape(batch, num_kv_heads, groups, num_tokens, head_dim)
    # Non-finite key elements are zeroed before the product and their slots marked bad: the
    # forward is the same (a non-finite raw logit marks the query that sees it), and the
    # derivatives never multiply a zero cotangent by an unseen slot's NaN (jax.grad was NaN
    # everywhere when any unfilled slot held one).
    finite_keys = jnp.isfinite(keys)
    bad_keys = ~jnp.all(finite_keys, axis=-1)  # [B, H, S]
    keys = jnp.where(finite_keys, keys, jnp.zeros((), keys.dtype))
    logits = jnp.einsum("bhgtd,bhsd->bhgts", q, keys, preferred_element_type=jnp.float32) * scale
    mask = mask[:, None, None, :, :]  # [B, 1, 1, T, S]
    bad = ~jnp.isfinite(logits) | (bad_keys | bad_values)[:, :, None, None, :]  # [B, H, G, T, S]
    marked = jnp.any(mask & bad, axis=-1)  # [B, H, G, T]
    # Masking with where (not by adding -inf) keeps NaN logits of unseen slots out; the
    # soft cap sees only the kept logits (tanh' of a NaN would poison the derivative).
    mask = mask & ~bad
    logits = jnp.where(mask, logits, 0.0)
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)  # (no slots at all: 0 new tokens, no cache)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # a query that sees nothing
    weights = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgts,bhsd->bhgtd", *pv_operands(probs, values), preferred_element_type=jnp.float32)
    out = jnp.where(marked[..., None], jnp.nan, out)
    return out.reshape(batch, num_q_heads, num_tokens, head_dim).astype(queries.dtype)

"""Turning logits into tokens: greedy, temperature, top-k and top-p (nucleus) sampling.

Pure functions over ``[B, V]`` logits, usable inside jit. Filters replace the logits of
excluded tokens with ``-inf``; ``sample`` then draws from the softmax of what is left.
Order of application (the usual one): temperature, then top-k, then top-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingConfig", "greedy", "sample", "top_k_filter", "top_p_filter"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. Static (hashable): a jitted loop compiles per config.

    Attributes:
      temperature: > 0 divides the logits; 0 means greedy (argmax).
      top_k: keep the k most likely tokens (None or 0: no limit).
      top_p: keep the smallest set of most likely tokens whose mass reaches p (None or 1.0:
        no limit).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # NaN fails too; inf would make every logit 0 or NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def greedy(logits: jax.Array) -> jax.Array:  # [B, V] -> [B] int32
    """The most likely token (the lowest id on exact ties, as ``torch.argmax``).

    Same result as ``jnp.argmax`` (a NaN logit wins, the first one; ``tests/test_sampling.py``
    checks it against ``np.argmax``), in two plain reductions, a max and a min over ids,
    which XLA:CPU vectorises; its one-pass argmax reduction is not.
    """
    top = jnp.max(logits, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hits = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hits, ids, logits.shape[-1]), axis=-1).astype(jnp.int32)


def _keep_only(logits: jax.Array, ids: jax.Array, keep: jax.Array | bool = True) -> jax.Array:
    """``logits`` [B, V] with ``-inf`` except at ``ids`` [B, K] where ``keep`` [B, K] holds."""
    mask = jnp.zeros(logits.shape, bool).at[jnp.arange(logits.shape[0])[:, None], ids].set(keep)
    return jnp.where(mask, logits, -jnp.inf)


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Keeps exactly the ``k`` largest logits of each row; the rest become ``-inf``.

    On ties at the k-th value the lower ids are kept (the order of ``jax.lax.top_k``), so
    the kept set is the one :func:`sample` draws from.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    return _keep_only(logits, jax.lax.top_k(logits, k)[1])


def _top_p_keep_sorted(sorted_logits: jax.Array, p: float) -> jax.Array:  # [B, K] descending -> bool [B, K]
    """Top-p over logits already sorted most likely first: which of them to keep.

    A token is kept when the mass of the tokens before it is still below ``p``, so the most
    likely token is always kept.
    """
    probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < p


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability mass reaches ``p``.

    A token is kept when the mass of the tokens strictly more likely than it (in sorted
    order, lower ids first on ties) is still below ``p``; the most likely token is always
    kept.
    """
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1, stable=True)
    return _keep_only(logits, order, _top_p_keep_sorted(jnp.take_along_axis(logits, order, axis=-1), p))


def sample(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """Picks one token per row of ``logits`` [B, V] according to ``config``; int32 [B].

    With ``top_k`` the draw is over the k survivors only (``jax.lax.top_k`` gives them
    sorted, so top-p needs no sort over the vocabulary): the same distribution as
    ``softmax(top_p_filter(top_k_filter(logits / temperature)))``, at the cost of k
    rather than V per row after the top-k.
    """
    if config.is_greedy:
        return greedy(logits)
    logits = logits.astype(jnp.float32) / config.temperature
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    if config.top_k and config.top_k < logits.shape[-1]:
        survivors, ids = jax.lax.top_k(logits, config.top_k)  # [B, k], most likely first
        if top_p is not None:
            survivors = jnp.where(_top_p_keep_sorted(survivors, top_p), survivors, -jnp.inf)
        picked = jax.random.categorical(key, survivors, axis=-1)
        return jnp.take_along_axis(ids, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

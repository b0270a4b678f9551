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


def top_k_filter(logits: jax.Array, k: int) -> jax.Array:
    """Keeps the ``k`` largest logits of each row (ties at the k-th value are all kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]  # [B, 1]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def top_p_filter(logits: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability mass reaches ``p``.

    A token is kept when the mass of the tokens strictly more likely than it (in sorted
    order) is still below ``p``; the most likely token is always kept.
    """
    if p >= 1.0:
        return logits
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logits.shape[0])[:, None], order
    ].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """Picks one token per row of ``logits`` [B, V] according to ``config``; int32 [B]."""
    if config.is_greedy:
        return greedy(logits)
    logits = logits.astype(jnp.float32) / config.temperature
    if config.top_k:
        logits = top_k_filter(logits, config.top_k)
    if config.top_p is not None:
        logits = top_p_filter(logits, config.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

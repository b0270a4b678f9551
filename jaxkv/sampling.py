"""Turning logits into tokens: greedy, temperature, top-k, top-p (nucleus) and min-p
sampling, and penalties on tokens already seen.

Pure functions over ``[B, V]`` logits, usable inside jit. Filters replace the logits of
excluded tokens with ``-inf``; ``sample`` then draws from the softmax of what is left.
Order of application (HF transformers' order): the penalties on the raw logits
(:func:`apply_penalties`, greedy too), then temperature, top-k, top-p, min-p.

The penalties need each row's history, a :class:`TokenHistory` (which tokens its prompt
holds and how often each token was generated), carried through the decode loop:
:func:`init_history` from the prompts, :func:`record_tokens` after every step.
``jaxkv.generate``, ``jaxkv.stream``, ``PromptCacheStream``, ``sample_n``,
``speculative_generate``, ``beam_search`` (``repetition_penalty``) and ``PagedEngine`` do
this themselves.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.caches._checks import _widen

__all__ = [
    "SamplingConfig",
    "TokenHistory",
    "apply_penalties",
    "apply_temperature",
    "greedy",
    "init_history",
    "min_p_filter",
    "penalise",
    "record_tokens",
    "sample",
    "top_k_filter",
    "token_counts",
    "top_p_filter",
]


_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token. Static (hashable): a jitted loop compiles per config.

    Attributes:
      temperature: > 0 divides the logits; 0 means greedy (argmax).
      top_k: keep the k most likely tokens (None or 0: no limit).
      top_p: keep the smallest set of most likely tokens whose mass reaches p (None or 1.0:
        no limit).
      min_p: keep the tokens whose probability is at least ``min_p`` times the most likely
        token's (after temperature, top-k and top-p; HF's ``min_p``); None or 0: no limit.
      repetition_penalty: HF's ``repetition_penalty`` (CTRL's rule): the logit of every
        token in the row's prompt or generated so far is divided by it when positive and
        multiplied by it otherwise; > 1 discourages repeats. 1.0: off. Applies to greedy
        decoding too.
      presence_penalty: subtracted from the logit of every token generated at least once
        (OpenAI's / vLLM's; the prompt does not count). 0.0: off.
      frequency_penalty: subtracted once per time a token was generated (OpenAI's / vLLM's;
        the prompt does not count). 0.0: off.

    The penalties act on the raw logits before the temperature, repetition first (HF's and
    vLLM's order). Padding past a row's prompt length is never counted as seen.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        for name, optional in (("temperature", False), ("top_p", True), ("min_p", True), ("repetition_penalty", False)):
            value = getattr(self, name)  # a real number (NumPy's too), never a bool or a string
            if (value is None and optional) or (isinstance(value, numbers.Real) and not isinstance(value, bool)):
                continue
            raise ValueError(f"{name} must be a real number{' or None' if optional else ''}, "
                             f"got {value!r} of type {type(value).__name__}")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too; inf would make every logit 0 or NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k is not None and (
            isinstance(self.top_k, (bool, np.bool_)) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0
        ):  # a bool is an int to Python, but top_k=True would silently mean greedy
            raise ValueError(f"top_k must be a non-negative int or None, got {self.top_k!r}")
        if self.top_k is not None:  # NumPy's ints too, kept as a Python int (a static setting)
            object.__setattr__(self, "top_k", int(self.top_k))
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:  # NaN fails too
            raise ValueError(f"min_p must be in [0, 1] (0 or None for no limit), got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(
                f"repetition_penalty must be finite and > 0 (1.0 is off, > 1 discourages repeats), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            # a real number, NumPy's too (np.float32(0.5) was refused while temperature took it)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number (0.0 is off), got {value!r}")
        # The sampler computes in float32: a larger value is inf there (temperature 1e39 made
        # every logit 0, a penalty of 1e39 times a count of 0 made them NaN), silently.
        for name in ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if abs(value) > _FLOAT32_MAX:
                raise ValueError(f"{name}={value!r} overflows float32, the dtype the sampler computes in (its "
                                 f"magnitude must be at most {_FLOAT32_MAX:.4g})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Whether a penalty is on, so that picking a token needs the row's :class:`TokenHistory`."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class TokenHistory(NamedTuple):
    """What the penalties of :class:`SamplingConfig` look at, per row (a pytree).

    Attributes:
      in_prompt: bool [B, V], whether token ``v`` occurs in row ``b``'s prompt.
      counts: int32 [B, V], how many times row ``b`` has generated token ``v``.
    """

    in_prompt: jax.Array  # [B, V] bool
    counts: jax.Array  # [B, V] int32


def init_history(
    config: SamplingConfig, input_ids: jax.Array, prompt_lengths: jax.Array, vocab_size: int
) -> TokenHistory | None:
    """The history of rows that hold ``input_ids[b, :prompt_lengths[b]]`` and generated nothing yet.

    None when ``config`` has no penalty (nothing to carry). Padding (positions at or past a
    row's length) and ids outside ``[0, vocab_size)`` are not recorded.
    """
    if not config.needs_history:
        return None
    in_prompt = token_counts(input_ids, prompt_lengths, vocab_size) > 0
    return TokenHistory(in_prompt, jnp.zeros(in_prompt.shape, jnp.int32))


def token_counts(ids: jax.Array, lengths: jax.Array, vocab_size: int) -> jax.Array:  # [B, L], [B] -> int32 [B, V]
    """How often each id occurs in ``ids[b, :lengths[b]]``; ids outside ``[0, vocab_size)`` are not counted."""
    batch, width = ids.shape
    ids = _widen(ids)  # uint8 ids: vocab_size 256 wrapped to 0, counted as token 0 (review 82)
    valid = jnp.arange(width)[None, :] < jnp.asarray(lengths)[:, None]
    ids = jnp.where(valid & (ids >= 0), ids, vocab_size)  # an index past the end: dropped (a negative one would wrap)
    return jnp.zeros((batch, vocab_size), jnp.int32).at[jnp.arange(batch)[:, None], ids].add(1, mode="drop")


def record_tokens(history: TokenHistory | None, tokens: jax.Array, active: jax.Array | None = None) -> TokenHistory | None:
    """``history`` after each row generated ``tokens`` [B] (rows where ``active`` [B] is False
    generated nothing). Negative ids (:data:`jaxkv.generation.NAN_TOKEN`) and ids past the
    vocabulary are not recorded."""
    if history is None:
        return None
    vocab = history.counts.shape[-1]
    tokens = _widen(tokens)
    keep = tokens >= 0 if active is None else active & (tokens >= 0)
    ids = jnp.where(keep, tokens, vocab)  # an index past the end: dropped (a negative one would wrap)
    counts = history.counts.at[jnp.arange(tokens.shape[0]), ids].add(1, mode="drop")
    return history._replace(counts=counts)


def apply_penalties(logits: jax.Array, history: TokenHistory | None, config: SamplingConfig) -> jax.Array:
    """``logits`` [B, V] with ``config``'s penalties applied (float32); unchanged without one.

    Raises:
      ValueError: ``config`` has a penalty but ``history`` is None (the penalty would be
        silently skipped).
    """
    if not config.needs_history:
        return logits
    if history is None:
        raise ValueError(
            "this SamplingConfig has a repetition, presence or frequency penalty, which needs each row's "
            "TokenHistory: pass history=init_history(config, input_ids, prompt_lengths, vocab_size) and update it "
            "with record_tokens after every step"
        )
    if history.counts.shape != logits.shape:
        raise ValueError(f"the history is for [B, V] = {list(history.counts.shape)}, the logits are {list(logits.shape)}")
    return penalise(logits, history, config.repetition_penalty, config.presence_penalty, config.frequency_penalty)


def penalise(logits: jax.Array, history: TokenHistory, repetition, presence, frequency) -> jax.Array:
    """The penalties on ``logits`` [B, V] (float32), each strength a Python number or a
    per-row array [B] (``PagedEngine``'s requests); a Python 1.0 / 0.0 / 0.0 emits nothing."""

    def per_row(v):
        return float(v) if isinstance(v, numbers.Real) else jnp.asarray(v, jnp.float32)[:, None]

    def off(v, identity):
        return isinstance(v, numbers.Real) and v == identity

    x = logits.astype(jnp.float32)
    generated = history.counts > 0
    if not off(repetition, 1.0):
        r = per_row(repetition)
        x = jnp.where(history.in_prompt | generated, jnp.where(x > 0, x / r, x * r), x)
    if not off(frequency, 0.0):
        x = x - per_row(frequency) * history.counts.astype(jnp.float32)
    if not off(presence, 0.0):
        x = x - per_row(presence) * generated.astype(jnp.float32)
    return x


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
    likely token is always kept. That mass is the exclusive running sum (shifted ``cumsum``),
    not ``cumsum - probs``: the subtraction rounds, so with ``p`` equal to the mass of the
    top tokens (probabilities 0.4, 0.35, 0.25 and ``p = 0.4``) the mass before the second
    token came out just below ``p`` and it was kept too, a set larger than the smallest
    one reaching ``p`` (HF's ``TopPLogitsWarper`` keeps one token there).
    """
    probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
    running = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
    # The first token explicitly: a p below float32's smallest normal (1e-40) is flushed to 0,
    # and 0 < 0 kept nothing (every logit -inf: token 0 drawn).
    first = jnp.arange(sorted_logits.shape[-1]) == 0
    return (mass_before < p) | first


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


def min_p_filter(logits: jax.Array, min_p: float | None) -> jax.Array:
    """Keeps the tokens whose probability is at least ``min_p`` times the row's largest.

    In logit space: ``logit >= max_logit + log(min_p)`` (the softmax's normaliser cancels),
    so the most likely token is always kept. Renormalising after top-k or top-p does not
    change the ratio, so it keeps what HF's ``MinPLogitsWarper`` keeps after them.
    """
    if not min_p:
        return logits
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(logits >= top + math.log(min_p), logits, -jnp.inf)


def apply_temperature(logits: jax.Array, temperature) -> jax.Array:  # [..., V] -> float32 [..., V]
    """``logits / temperature`` shifted by the row's max: ``(logits - max) / temperature``.

    The shift leaves the softmax unchanged but keeps a tiny temperature (say 1e-40) from
    overflowing the logits to ``+-inf``: the row's largest logit becomes 0 and the others
    go towards ``-inf``, so the distribution tends to the argmax as the temperature -> 0.
    ``temperature`` is a positive scalar or broadcasts against ``logits`` (``[R, 1]``).
    Rows whose max is not finite (NaN anywhere, all ``-inf``, a ``+inf``) are not shifted,
    so they come out as plain ``logits / temperature`` (NaN stays NaN); ``-inf`` stays ``-inf``.
    """
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    # The max itself is pinned to 0: a temperature below float32's smallest normal may be
    # flushed to 0 by the backend, and 0 / 0 would make the most likely token NaN.
    return jnp.where(logits == top, 0.0, (logits - top) / temperature)


def sample(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> jax.Array:
    """Picks one token per row of ``logits`` [B, V] according to ``config``; int32 [B].

    With ``top_k`` the draw is over the k survivors only (``jax.lax.top_k`` gives them
    sorted, so top-p needs no sort over the vocabulary): the same distribution as
    ``softmax(min_p_filter(top_p_filter(top_k_filter(apply_temperature(logits, temperature)))))``, at the
    cost of k rather than V per row after the top-k.

    The penalties are not applied here (they need the rows' history): pass the logits
    through :func:`apply_penalties` first (``jaxkv.generation.select_token`` does).
    """
    if config.is_greedy:
        return greedy(logits)
    logits = apply_temperature(logits, config.temperature)
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    if config.top_k and config.top_k < logits.shape[-1]:
        survivors, ids = jax.lax.top_k(logits, config.top_k)  # [B, k], most likely first
        if top_p is not None:
            survivors = jnp.where(_top_p_keep_sorted(survivors, top_p), survivors, -jnp.inf)
        survivors = min_p_filter(survivors, config.min_p)
        picked = jax.random.categorical(key, survivors, axis=-1)
        return jnp.take_along_axis(ids, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    logits = min_p_filter(logits, config.min_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

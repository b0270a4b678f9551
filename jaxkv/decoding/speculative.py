"""Speculative decoding: a small draft model proposes, the target model verifies.

Each round, per row:

1. the draft proposes ``k`` tokens ``d_1..d_k``, one cheap forward each;
2. the target runs ``[last, d_1, .., d_k]`` in **one** ``k + 1``-token forward, which gives
   its distribution after every proposed prefix;
3. the longest acceptable prefix ``d_1..d_a`` is kept, plus one token from the target at
   position ``a`` (a correction if ``a < k``, a free "bonus" token if ``a == k``): every
   round emits ``a + 1 >= 1`` tokens;
4. rejected tokens are rolled back with ``cache.crop(int32[B])`` (any kind): each row keeps its
   own number of tokens and no data moves; the next round overwrites the stale slots.

Rows accept different counts, so rows drift apart in length; the per-row ``lengths`` of the
cache make that free. Rows that have their ``max_new_tokens`` pass ``num_new = 0`` and
stop writing while the others finish.

Acceptance:

* greedy (``config.is_greedy``): ``d_i`` is accepted while it equals the target's argmax,
  so the output is exactly the target's greedy output (up to float rounding of the
  different matmul shapes deciding a near-tie);
* sampling: ``d_i ~ q_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at
  the first rejection the token is drawn from ``max(0, p_i - q_i)`` renormalised; after
  ``k`` acceptances the bonus token is drawn from ``p_{k+1}``. ``p`` and ``q`` are the
  target's and draft's distributions after the same temperature / top-k / top-p. This
  rule makes every emitted token exactly distributed as the target's sampling
  distribution (Leviathan et al. 2023, Chen et al. 2023).

The draft cache trails the target cache by design: it never holds ``d_k`` when all ``k``
tokens were accepted (the draft never fed it). The next round then feeds the draft two
tokens, ``[d_k, last]``, with ``num_new = 2`` for those rows and 1 for the others.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv._checks import check_model, model_vocab_size
from jaxkv.decoding._common import check_positive_int, filtered_logits, forward, logits_at, logits_width
from jaxkv.generation import (
    NAN_TOKEN,
    check_prompts,
    init_model_cache,
    nan_rows_as_nan_token,
    pad_to_bucket,
    poison_bad_lengths,
)
from jaxkv.sampling import SamplingConfig, apply_penalties, greedy, init_history, record_tokens

__all__ = ["SpeculativeOutput", "speculative_generate"]


@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
    """What :func:`speculative_generate` returns.

    Attributes:
        tokens: int32 [B, N] generated tokens.
        accepted: int32 [B] draft tokens accepted per row, over all rounds.
        rounds: int32 [B] verification rounds (target forwards) each row took.
        num_draft_tokens: k, draft tokens proposed per round.
    """

    tokens: jax.Array
    accepted: jax.Array
    rounds: jax.Array
    num_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the whole batch."""
        return float(jnp.sum(self.accepted) / jnp.maximum(jnp.sum(self.rounds) * self.num_draft_tokens, 1))


jax.tree_util.register_dataclass(
    SpeculativeOutput, data_fields=["tokens", "accepted", "rounds"], meta_fields=["num_draft_tokens"]
)


def _leading_true(x: jax.Array) -> jax.Array:  # [B, k] bool -> [B] int32
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


@partial(
    jax.jit,
    static_argnames=("target_graphdef", "draft_graphdef", "max_new_tokens", "num_draft_tokens", "config", "cache_dtype",
                     "cache_kind"),
)
def _speculative(
    target_graphdef, target_state, draft_graphdef, draft_state, input_ids, prompt_lengths, key, *,
    max_new_tokens, num_draft_tokens, config, cache_dtype, cache_kind,
):
    target = nnx.merge(target_graphdef, target_state)
    draft = nnx.merge(draft_graphdef, draft_state)
    batch, prompt_len = input_ids.shape
    n, k = max_new_tokens, num_draft_tokens
    rows = jnp.arange(batch)
    input_ids, prompt_lengths = poison_bad_lengths(input_ids, prompt_lengths)  # traced bad lengths: NAN_TOKEN rows
    greedy_mode = config.is_greedy
    # An unfinished row holds < n tokens, all but the last in the cache, and writes k + 1.
    capacity = prompt_len + n + k
    # A round rolls back at most k + 1 tokens: ring layers keep that many extra slots.
    try:
        t_cache = init_model_cache(target, batch, capacity, cache_dtype, cache_kind, rollback=k + 1)
    except ValueError as err:  # say which of the two models cannot take the kind (review 71)
        raise ValueError(f"speculative_generate: the target model: {err}") from None
    # A hybrid target's draft may have no sliding layer (a plain small model): a hybrid cache
    # is a ring for sliding layers only, so such a draft takes the static kind.
    draft_slides = any(getattr(getattr(draft, "config", None), "sliding_layers", ()) or ())
    draft_kind = "static" if cache_kind == "hybrid" and not draft_slides else cache_kind
    try:
        d_cache = init_model_cache(draft, batch, capacity, cache_dtype, draft_kind, rollback=k + 1)
    except ValueError as err:
        raise ValueError(f"speculative_generate: the draft model: {err}") from None
    t_logits, t_cache = forward(target_graphdef, target_state, input_ids, t_cache, prompt_lengths)
    _, d_cache = forward(draft_graphdef, draft_state, input_ids, d_cache, prompt_lengths)
    t_logits = logits_at(t_logits, prompt_lengths - 1)
    # Penalties (None without one): the history holds the prompt and every emitted token.
    history = init_history(config, input_ids, prompt_lengths, t_logits.shape[-1])
    t_logits = apply_penalties(t_logits, history, config)
    key, first_key = jax.random.split(key)
    if greedy_mode:
        first = greedy(t_logits)
    else:
        first = jax.random.categorical(first_key, filtered_logits(t_logits, config), axis=-1).astype(jnp.int32)
    # A row of NaN logits (a traced out-of-range id or length) emits NAN_TOKEN, never an id
    # picked from NaN; fed back, -1 keeps its logits NaN (every token it emits is -1).
    first = nan_rows_as_nan_token(t_logits, first)

    # Room for a full round past n, so writes never need clipping.
    out = jnp.zeros((batch, n + k + 1), jnp.int32).at[:, 0].set(first)
    carry = dict(
        t_cache=t_cache,
        d_cache=d_cache,
        out=out,
        count=jnp.ones((batch,), jnp.int32),  # tokens generated per row
        last=first,  # the newest token: generated, not yet in either cache
        backlog=jnp.zeros((batch,), bool),  # the draft cache also lacks the token before `last`
        backlog_token=first,
        accepted=jnp.zeros((batch,), jnp.int32),
        rounds=jnp.zeros((batch,), jnp.int32),
        key=key,
        history=record_tokens(history, first),
    )

    def cond(c):
        return jnp.any(c["count"] < n)

    def body(c):
        active = c["count"] < n
        key, draft_key, accept_key, final_key = jax.random.split(c["key"], 4)
        draft_keys = jax.random.split(draft_key, k)
        t_len = c["t_cache"].seq_lengths(0)  # = prompt + count - 1 for every row

        # 1. Draft k tokens. The first forward also catches up on a backlog token.
        two = jnp.where(c["backlog"][:, None], jnp.stack([c["backlog_token"], c["last"]], 1), c["last"][:, None])
        num_new = jnp.where(active, 1 + c["backlog"].astype(jnp.int32), 0)
        d_logits, d_cache = forward(draft_graphdef, draft_state, two, c["d_cache"], num_new)
        d_logits = logits_at(d_logits, num_new - 1)
        # histories[j]: the emitted tokens, then d_1..d_j. The draft's d_{j+1} and the
        # target's token after d_j are both penalised with histories[j], so p and q are the
        # penalised conditionals given the same prefix and the acceptance rule stays exact.
        histories = [c["history"]]
        proposals, q_logits = [], []
        for i in range(k):
            d_logits = apply_penalties(d_logits, histories[i], config)
            if greedy_mode:
                token = greedy(d_logits)
            else:
                q = filtered_logits(d_logits, config)
                q_logits.append(q)
                token = jax.random.categorical(draft_keys[i], q, axis=-1).astype(jnp.int32)
            proposals.append(token)
            histories.append(record_tokens(histories[i], token, active))
            if i + 1 < k:  # d_k is verified but never fed to the draft
                d_logits, d_cache = forward(
                    draft_graphdef, draft_state, token[:, None], d_cache, active.astype(jnp.int32)
                )
                d_logits = d_logits[:, 0]
        proposals = jnp.stack(proposals, axis=1)  # [B, k]

        # 2. Verify all of them in one target forward.
        verify = jnp.concatenate([c["last"][:, None], proposals], axis=1)  # [B, k + 1]
        p_logits, t_cache = forward(
            target_graphdef, target_state, verify, c["t_cache"], jnp.where(active, k + 1, 0)
        )  # [B, k + 1, V]
        if config.needs_history:
            p_logits = jnp.stack([apply_penalties(p_logits[:, j], histories[j], config) for j in range(k + 1)], axis=1)

        # 3. Accept a prefix, then one token from the target.
        if greedy_mode:
            target_tokens = greedy(p_logits.reshape(batch * (k + 1), -1)).reshape(batch, k + 1)
            num_accepted = _leading_true(proposals == target_tokens[:, :k])
            final = target_tokens[rows, num_accepted]
        else:
            p = jax.nn.softmax(filtered_logits(p_logits, config), axis=-1)  # [B, k + 1, V]
            q = jax.nn.softmax(jnp.stack(q_logits, axis=1), axis=-1)  # [B, k, V]
            p_d = jnp.take_along_axis(p[:, :k], proposals[:, :, None], axis=2)[:, :, 0]
            q_d = jnp.take_along_axis(q, proposals[:, :, None], axis=2)[:, :, 0]
            u = jax.random.uniform(accept_key, (batch, k))
            num_accepted = _leading_true(u * q_d < p_d)  # u < p/q without dividing by q
            p_at = p[rows, num_accepted]  # [B, V]
            q_at = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, num_accepted]  # 0 after k accepts
            residual = jnp.maximum(p_at - q_at, 0.0)
            mass = jnp.sum(residual, axis=-1, keepdims=True)
            # p == q at the rejected position has zero residual mass but then rejection had
            # probability 0; fall back to p there so rounding can never produce NaN.
            dist = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
            final = jax.random.categorical(final_key, jnp.log(dist), axis=-1).astype(jnp.int32)

        # Emit d_1..d_a, then `final`, at each active row's next slots; a token whose
        # target logits hold a NaN is NAN_TOKEN (as in generate), `final` included.
        j = jnp.arange(k + 1)
        emitted = jnp.where(j[None, :] < num_accepted[:, None], jnp.pad(proposals, ((0, 0), (0, 1))), final[:, None])
        emitted = jnp.where(jnp.any(jnp.isnan(p_logits), axis=-1), NAN_TOKEN, emitted)
        final = emitted[rows, num_accepted]
        write = active[:, None] & (j[None, :] <= num_accepted[:, None])
        slots = jnp.where(write, c["count"][:, None] + j[None, :], n + k + 1)  # out of range: dropped
        out = c["out"].at[rows[:, None], slots].set(emitted, mode="drop")
        history = c["history"]
        for i in range(k + 1):
            history = record_tokens(history, emitted[:, i], write[:, i])

        # 4. Roll back the rejected tokens, per row, without moving data.
        keep = jnp.where(active, t_len + num_accepted + 1, t_len)
        t_cache = t_cache.crop(keep)
        d_cache = d_cache.crop(jnp.where(active, t_len + jnp.minimum(num_accepted + 1, k), d_cache.seq_lengths(0)))
        backlog = jnp.where(active, num_accepted == k, c["backlog"])
        return dict(
            t_cache=t_cache,
            d_cache=d_cache,
            out=out,
            count=c["count"] + jnp.where(active, num_accepted + 1, 0),
            last=jnp.where(active, final, c["last"]),
            backlog=backlog,
            backlog_token=jnp.where(active, proposals[:, k - 1], c["backlog_token"]),
            accepted=c["accepted"] + jnp.where(active, num_accepted, 0),
            rounds=c["rounds"] + active.astype(jnp.int32),
            key=key,
            history=history,
        )

    c = jax.lax.while_loop(cond, body, carry)
    return c["out"][:, :n], c["accepted"], c["rounds"]


def _check_key(key: Any, who: str) -> jax.Array:
    """One typed PRNG key (legacy ``jax.random.PRNGKey`` data, uint32 [2], is wrapped)."""
    dtype = getattr(key, "dtype", None)
    if isinstance(key, jax.Array) and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"{who}: key must be one PRNG key (shape ()), got shape {list(key.shape)}; "
                             "pass key=jax.random.key(seed)")
        return key
    if getattr(key, "shape", None) == (2,) and dtype == jnp.uint32:  # jax.random.PRNGKey(seed)
        return jax.random.wrap_key_data(jnp.asarray(key))
    raise TypeError(f"{who}: key must be a typed PRNG key from jax.random.key(seed), got {key!r}")


def speculative_generate(
    target: nnx.Module,
    draft: nnx.Module,
    input_ids: Any,  # [B, P] int
    max_new_tokens: int,
    *,
    num_draft_tokens: int = 4,
    config: SamplingConfig = SamplingConfig(),
    key: jax.Array | None = None,
    prompt_lengths: Any = None,  # [B] int
    cache_dtype: Any = None,
    cache_kind: str = "static",
    bucket: bool = True,
) -> SpeculativeOutput:
    """Generates with ``target``, drafting ``num_draft_tokens`` at a time with ``draft``.

    Args:
        target: the model whose output distribution is produced (e.g. the larger model).
        draft: a cheaper model with the same vocabulary (same tokenizer).
        input_ids: [B, P] prompts, right-padded when ragged.
        max_new_tokens: N >= 1 tokens per row.
        num_draft_tokens: k >= 1 tokens proposed per round.
        config: greedy by default (output == the target's greedy output); with a
            temperature, samples from the target's distribution (see module docstring).
            Min-p and the penalties apply to draft and target alike, each position
            penalised with the history of its own prefix.
        key: PRNG key, required when sampling.
        prompt_lengths: [B] real prompt lengths, in ``[1, P]``; default P.
        cache_dtype: key/value storage dtype of both caches; default each model's dtype.
        cache_kind: ``"static"`` (default), or another kind the model's ``init_cache`` offers
            (``Llama``: ``"hybrid"``, ``"quantized"``); every algorithm takes every kind.
        bucket: pad the prompt axis to the next power of two (>= 16), as ``generate`` does,
            so that prompts of nearby lengths share one compiled program.

    Returns:
        :class:`SpeculativeOutput`: ``tokens`` [B, N] and acceptance statistics.

    Raises:
        ValueError: bad sizes or prompts (a token id outside ``[0, V)`` included),
            vocabularies that differ, no key when sampling.
        TypeError: ``target`` or ``draft`` not an ``nnx.Module`` (a ``from_pretrained``
            bundle: pass ``loaded.model``).

    Example:
        >>> out = speculative_generate(target, draft, ids, 64, num_draft_tokens=4)  # doctest: +SKIP
        >>> out.tokens.shape, out.acceptance_rate                                   # doctest: +SKIP
    """
    who = "speculative_generate"
    check_model(target, who, name="target")
    check_model(draft, who, name="draft")
    input_ids, prompt_lengths = check_prompts(input_ids, prompt_lengths, who, vocab_size=model_vocab_size(target))
    n = check_positive_int(max_new_tokens, "max_new_tokens", who)
    k = check_positive_int(num_draft_tokens, "num_draft_tokens", who)
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"{who}: config must be a jaxkv.sampling.SamplingConfig, got {type(config).__name__}")
    widths = logits_width(target), logits_width(draft)
    if widths[0] != widths[1]:
        raise ValueError(
            f"{who}: target and draft vocabularies differ ({widths[0]} vs {widths[1]}); the draft must share "
            "the target's tokenizer"
        )
    if key is None:
        if not config.is_greedy:
            raise ValueError(f"{who}: sampling (temperature > 0) needs a key, e.g. key=jax.random.key(0)")
        key = jax.random.key(0)
    key = _check_key(key, who)
    t_graphdef, t_state = nnx.split(target)
    d_graphdef, d_state = nnx.split(draft)
    tokens, accepted, rounds = _speculative(
        t_graphdef,
        t_state,
        d_graphdef,
        d_state,
        pad_to_bucket(input_ids, 0, bucket),  # (any id: the padding is never stored)
        prompt_lengths,
        key,
        max_new_tokens=n,
        num_draft_tokens=k,
        config=config,
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
        cache_kind=cache_kind,
    )
    return SpeculativeOutput(tokens, accepted, rounds, k)

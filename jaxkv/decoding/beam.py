"""Beam search with length penalty and early stopping, compiled as one ``lax.while_loop``.

Each prompt is prefilled once; ``batch_repeat_interleave(num_beams)`` fans its cache out
into ``num_beams`` rows, and every step gathers the surviving beams' rows with
``reorder_cache`` inside the loop.

The search follows HF transformers' vectorised beam search (``generate(num_beams=k,
do_sample=False)``, transformers 4.50+/5.x), so that its tokens match token for token:

* Scores are sums of ``log_softmax`` (float32) of the chosen tokens. Each step keeps the
  ``2 * num_beams`` best continuations over all beams; the best ``num_beams`` of those that
  did not just finish are the next running beams.
* A continuation *finishes* when its token is ``eos_token_id`` (the EOS is part of the
  sequence) or when it reaches ``max_new_tokens``. Only finished continuations ranked in
  the top ``num_beams`` of the step enter the pool of finished hypotheses, scored
  ``sum_logprobs / generated_len ** length_penalty``, where ``generated_len`` counts the new
  tokens only (the prompt is excluded) and includes the EOS. The pool keeps the best
  ``num_beams``.
* ``early_stopping``: ``True`` stops a prompt once its pool holds ``num_beams`` finished
  hypotheses; ``False`` (HF's default) stops a prompt when the best running beam, scored at
  its current length, cannot beat the worst finished one (a heuristic when
  ``length_penalty > 0``); ``"never"`` uses the exact bound (the best running beam scored
  at ``max_new_tokens`` when ``length_penalty > 0``), so the result is the true best of
  everything the beam explores. The loop ends when every prompt has stopped, or when all
  running continuations hit ``max_new_tokens``. With one beam, transformers runs greedy
  search and ignores ``early_stopping``: here one beam stops at its first EOS whatever
  ``early_stopping`` says (``True``'s rule), which gives greedy's tokens. (With a
  ``repetition_penalty`` the two still differ: transformers' greedy penalises the logits,
  beam search the log-probabilities.)
* Beams that cannot exist (all but one at the start, or too few unfinished continuations)
  carry score ``-1e9`` as in HF, never ``-inf``, so no NaN arises.

Returned sequences hold the generated tokens only, padded with ``pad_token_id`` after
each hypothesis' length.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_model, model_vocab_size
from jaxkv.decoding._common import (
    check_positive_int,
    check_token_id,
    forward,
    logits_at,
)
from jaxkv.generation import NAN_TOKEN, NO_STOP, check_prompts, init_model_cache, pad_to_bucket, poison_bad_lengths
from jaxkv.sampling import SamplingConfig, apply_penalties, init_history, record_tokens

__all__ = ["BeamSearchOutput", "beam_search"]

_NEG = -1.0e9  # HF's "impossible" score: finite, so sums never become NaN
_STOP_FALSE, _STOP_TRUE, _STOP_NEVER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class BeamSearchOutput:
    """What :func:`beam_search` returns (best hypothesis first).

    Attributes:
        sequences: int32 [B, R, N] generated tokens, ``pad_token_id`` past each length.
        lengths: int32 [B, R] tokens per hypothesis (an EOS counts).
        scores: float32 [B, R] ``sum_logprobs / lengths ** length_penalty``.
    """

    sequences: jax.Array
    lengths: jax.Array
    scores: jax.Array


jax.tree_util.register_dataclass(BeamSearchOutput, data_fields=["sequences", "lengths", "scores"], meta_fields=[])


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:  # [B, K, ...], [B, M] -> [B, M, ...]
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


@partial(
    jax.jit,
    static_argnames=(
        "graphdef", "max_new_tokens", "num_beams", "cache_dtype", "cache_kind", "penalties",
    ),
)
def _beam_search(
    graphdef, state, input_ids, prompt_lengths, length_penalty, early_stopping, eos_token_id, pad_token_id, *,
    max_new_tokens, num_beams, cache_dtype, cache_kind, penalties=SamplingConfig(),
):
    # eos_token_id (NO_STOP: none) and pad_token_id are traced int32: any value reuses the search.
    # length_penalty (float32) and early_stopping (int32: 0 False, 1 True, 2 "never") are
    # traced, so changing them reuses the compiled search.
    model = nnx.merge(graphdef, state)
    batch, prompt_len = input_ids.shape
    n, k = max_new_tokens, num_beams
    keep = 2 * k  # HF: max(2, 1 + number of EOS ids) * num_beams
    input_ids, prompt_lengths = poison_bad_lengths(input_ids, prompt_lengths)  # traced bad lengths: NaN rows
    # Each step feeds the chosen tokens (the last one too, whose logits go unused).
    cache = init_model_cache(model, batch, prompt_len + n, cache_dtype, cache_kind, fanout=k)
    logits, cache = forward(graphdef, state, input_ids, cache, prompt_lengths)
    logits = logits_at(logits, prompt_lengths - 1)
    # A row of NaN logits (a traced out-of-range id or length): every hypothesis of it is
    # NAN_TOKEN with a NaN score, never ids picked from NaN.
    poisoned = jnp.any(jnp.isnan(logits), axis=-1)  # [B]
    logits = jnp.repeat(logits, k, axis=0)  # [B*K, V]
    cache = cache.batch_repeat_interleave(k)
    vocab = logits.shape[-1]
    if k * vocab < keep:  # a 1-token vocabulary: lax.top_k's own error named none of this
        raise ValueError(
            f"beam_search: each step keeps 2 * num_beams = {keep} candidates out of num_beams * vocab_size = "
            f"{k * vocab}; a vocabulary of {vocab} token has too few (a model with one token has one output: "
            "use jaxkv.generate)"
        )
    row_offset = (jnp.arange(batch, dtype=jnp.int32) * k)[:, None]
    # HF applies its processors (repetition_penalty) to each beam's log-probabilities, with
    # the beam's prompt and tokens as its history; None without a penalty.
    history = init_history(penalties, jnp.repeat(input_ids, k, axis=0), jnp.repeat(prompt_lengths, k), vocab)

    def penalized(scores, length):
        return scores / (length.astype(jnp.float32) ** length_penalty)

    carry = dict(
        step=jnp.int32(0),
        done=jnp.bool_(False),
        logits=logits,
        cache=cache,
        running=jnp.full((batch, k, n), pad_token_id, jnp.int32),
        running_scores=jnp.zeros((batch, k), jnp.float32).at[:, 1:].set(_NEG),
        finished=jnp.full((batch, k, n), pad_token_id, jnp.int32),
        finished_scores=jnp.full((batch, k), _NEG, jnp.float32),
        finished_lengths=jnp.zeros((batch, k), jnp.int32),
        is_finished=jnp.zeros((batch, k), bool),
        can_improve=jnp.ones((batch,), bool),
        history=history,
    )

    def cond(c):
        return (c["step"] < n) & ~c["done"]

    def body(c):
        t = c["step"]
        log_probs = apply_penalties(jax.nn.log_softmax(c["logits"], axis=-1), c["history"], penalties)
        log_probs = log_probs.reshape(batch, k, vocab)
        log_probs = (log_probs + c["running_scores"][:, :, None]).reshape(batch, k * vocab)
        top_scores, top_idx = jax.lax.top_k(log_probs, keep)  # [B, 2K], sorted
        top_beam = (top_idx // vocab).astype(jnp.int32)
        # A beam whose logits turned NaN mid-sequence (a token embedding NaN weights) goes on as
        # NAN_TOKEN, as generate's rows do: its ids were argmax-of-NaN 0s, valid-looking (review 76).
        top_token = jnp.where(jnp.isnan(top_scores), NAN_TOKEN, (top_idx % vocab).astype(jnp.int32))
        top_seqs = _gather(c["running"], top_beam).at[:, :, t].set(top_token)  # [B, 2K, N]
        hits = jnp.broadcast_to(t + 1 >= n, top_token.shape) | (top_token == eos_token_id)

        # The next running beams: the best K continuations that did not just finish.
        alive_scores = top_scores + jnp.where(hits, _NEG, 0.0)
        next_idx = jax.lax.top_k(alive_scores, k)[1]
        running = _gather(top_seqs, next_idx)
        running_scores = _gather(alive_scores, next_idx)
        source_beam = _gather(top_beam, next_idx)

        # Finished hypotheses: only those ranked in the step's top K may enter the pool.
        just_finished = hits & (jnp.arange(keep) < k)[None, :]
        length = t + 1
        candidate = penalized(top_scores, length)
        pool_full = jnp.all(c["is_finished"], axis=1, keepdims=True) & (early_stopping == _STOP_TRUE)
        candidate = candidate + jnp.where(pool_full, _NEG, 0.0)
        candidate = candidate + jnp.where(c["can_improve"][:, None], 0.0, _NEG)
        candidate = candidate + jnp.where(just_finished, 0.0, _NEG)
        merged_scores = jnp.concatenate([c["finished_scores"], candidate], axis=1)
        best = jax.lax.top_k(merged_scores, k)[1]
        finished = _gather(jnp.concatenate([c["finished"], top_seqs], axis=1), best)
        finished_scores = _gather(merged_scores, best)
        finished_lengths = _gather(
            jnp.concatenate([c["finished_lengths"], jnp.full((batch, keep), length, jnp.int32)], axis=1), best
        )
        is_finished = _gather(jnp.concatenate([c["is_finished"], just_finished], axis=1), best)

        cache = c["cache"].reorder_cache((row_offset + source_beam).reshape(-1))
        history = c["history"]
        if history is not None:  # each new beam inherits its parent's history, plus its new token
            parent = (row_offset + source_beam).reshape(-1)
            history = record_tokens(jax.tree.map(lambda h: h[parent], history), running[:, :, t].reshape(-1))

        # Can the best running beam still beat the worst finished hypothesis?
        best_length = jnp.where((early_stopping == _STOP_NEVER) & (length_penalty > 0.0), n, length)
        best_running = penalized(running_scores[:, :1], best_length)  # [B, 1]
        worst_finished = jnp.where(is_finished, jnp.min(finished_scores, axis=1, keepdims=True), _NEG)
        can_improve = c["can_improve"] & jnp.any(best_running > worst_finished, axis=1)
        keep_going = jnp.any(can_improve) & ~jnp.all(hits)
        keep_going = keep_going & ~(jnp.all(is_finished) & (early_stopping == _STOP_TRUE))

        logits, cache = forward(graphdef, state, running[:, :, t].reshape(-1, 1), cache)
        return dict(
            step=length,
            done=~keep_going,
            logits=logits[:, 0],
            cache=cache,
            running=running,
            running_scores=running_scores,
            finished=finished,
            finished_scores=finished_scores,
            finished_lengths=finished_lengths,
            is_finished=is_finished,
            can_improve=can_improve,
            history=history,
        )

    c = jax.lax.while_loop(cond, body, carry)
    sequences = jnp.where(poisoned[:, None, None], NAN_TOKEN, c["finished"])
    return sequences, c["finished_lengths"], jnp.where(poisoned[:, None], jnp.nan, c["finished_scores"])


def beam_search(
    model: nnx.Module,
    input_ids: Any,  # [B, P] int
    max_new_tokens: int,
    *,
    num_beams: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    repetition_penalty: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    num_return_sequences: int = 1,
    prompt_lengths: Any = None,  # [B] int
    cache_dtype: Any = None,
    cache_kind: str = "static",
    bucket: bool = True,
) -> BeamSearchOutput:
    """Beam search over each prompt; the whole search is one jitted ``while_loop``.

    Matches ``transformers`` ``generate(num_beams=num_beams, do_sample=False,
    length_penalty=..., early_stopping=..., num_return_sequences=...)`` token for token
    (see the module docstring for the exact rules).

    Args:
        model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
        input_ids: [B, P] prompts, right-padded when ragged (no left padding).
        max_new_tokens: N >= 1, the most tokens a hypothesis may hold.
        num_beams: K >= 1 beams per prompt.
        length_penalty: exponent on the generated length dividing a finished score
            (> 0 favours longer hypotheses).
        early_stopping: ``True``, ``False`` or ``"never"``, as in transformers.
        repetition_penalty: transformers' (1.0: off), applied as it applies it in beam
            search: to each beam's log-probabilities, over the beam's prompt and tokens.
        eos_token_id: token that finishes a hypothesis, or None (every hypothesis runs N).
        pad_token_id: fills sequences past their length; default ``eos_token_id`` or 0.
        num_return_sequences: R <= K best hypotheses returned per prompt.
        prompt_lengths: [B] real prompt lengths, in ``[1, P]``; default P.
        cache_dtype: key/value storage dtype; default the model's parameter dtype.
        cache_kind: ``"static"`` (default), or another kind the model's ``init_cache`` offers
            (``Llama``: ``"hybrid"``, ``"quantized"``); every algorithm takes every kind.
        bucket: pad the prompt axis to the next power of two (>= 16), as ``generate`` does,
            so that prompts of nearby lengths share one compiled program (the EOS and pad
            ids are traced: any value shares it too).

    Returns:
        A :class:`BeamSearchOutput` with ``sequences`` [B, R, N], ``lengths`` [B, R] and
        ``scores`` [B, R], best first.

    Raises:
        ValueError: bad sizes, token ids (in the prompts: outside ``[0, V)``),
            ``early_stopping`` value, or prompts.
        TypeError: ``model`` not an ``nnx.Module`` (a ``from_pretrained`` bundle: pass
            ``loaded.model``).

    Example:
        >>> out = beam_search(model, jnp.array([[5, 6, 7]]), 16, num_beams=4,  # doctest: +SKIP
        ...                   eos_token_id=0, length_penalty=1.0)
        >>> best = out.sequences[0, 0, : out.lengths[0, 0]]                      # doctest: +SKIP
    """
    who = "beam_search"
    check_model(model, who)
    input_ids, prompt_lengths = check_prompts(input_ids, prompt_lengths, who, vocab_size=model_vocab_size(model))
    n = check_positive_int(max_new_tokens, "max_new_tokens", who)
    k = check_positive_int(num_beams, "num_beams", who)
    r = check_positive_int(num_return_sequences, "num_return_sequences", who)
    if r > k:
        raise ValueError(f"{who}: num_return_sequences ({r}) must be <= num_beams ({k})")
    if isinstance(early_stopping, np.bool_):
        early_stopping = bool(early_stopping)
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):  # 1 or 1.0 are not True here
        raise ValueError(f"{who}: early_stopping must be True, False or 'never', got {early_stopping!r}")
    if (
        isinstance(length_penalty, bool)
        or not isinstance(length_penalty, numbers.Real)
        or not math.isfinite(float(length_penalty))
    ):
        raise ValueError(
            f"{who}: length_penalty must be a finite real number (e.g. 1.0), got {length_penalty!r}; "
            "nan, inf and bools give meaningless scores"
        )
    vocab = model_vocab_size(model)  # None: the ids go unchecked
    eos = check_token_id(eos_token_id, "eos_token_id", vocab, who)
    pad = check_token_id(pad_token_id, "pad_token_id", vocab, who)
    if pad is None:
        pad = 0 if eos is None else eos
    penalties = SamplingConfig(repetition_penalty=repetition_penalty)  # its checks; static: 1.0 compiles no history
    if k == 1:  # transformers' greedy fallback: the first EOS ends the one beam ("never" went on past it)
        early_stopping = True
    graphdef, state = nnx.split(model)
    sequences, lengths, scores = _beam_search(
        graphdef,
        state,
        pad_to_bucket(input_ids, pad, bucket),
        prompt_lengths,
        jnp.float32(length_penalty),
        jnp.int32({False: _STOP_FALSE, True: _STOP_TRUE, "never": _STOP_NEVER}[early_stopping]),
        jnp.int32(NO_STOP if eos is None else eos),
        jnp.int32(pad),
        max_new_tokens=n,
        num_beams=k,
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
        cache_kind=cache_kind,
        penalties=penalties,
    )
    return BeamSearchOutput(sequences[:, :r], lengths[:, :r], scores[:, :r])

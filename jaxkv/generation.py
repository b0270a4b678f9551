"""Generation through any jaxkv cache kind: one compiled program, or a token stream.

* :func:`generate` runs prefill and the whole decode loop (a ``lax.while_loop``) inside one
  ``jax.jit``: greedy or sampled (temperature, top-k, top-p, a PRNG key), per-row stop
  tokens with finished rows frozen (they write nothing more into the cache), ragged
  prompts without left padding, and prompt lengths bucketed so that a new prompt length
  usually reuses a compiled program.
* :func:`stream` yields tokens one step at a time for interactive use: a jitted prefill,
  then a jitted decode step with the cache donated (updated in place).
* :func:`prefill`, :func:`decode_step` and :func:`select_token` are the pieces, for
  writing other loops (beam search, speculative decoding, serving).

The model is any ``nnx.Module`` with ``init_cache(batch_size, max_length, dtype=)`` and
``__call__(tokens [B, T], cache, num_new, *, logits_at=None) -> (logits [B, T, V], cache)``
(``logits_at``: [B] index of the one token per row whose logits to return), such as
:class:`jaxkv.models.Llama`. Inside jit it travels as ``nnx.split`` halves: the graph
definition (static, hashable) and the parameter state (a pytree).

Randomness is per row: row ``b`` draws its token at step ``t`` with
``fold_in(row_keys[b], t)``, so a row's samples do not depend on which other rows share
its batch (``key`` may be one key, split into B row keys, or B keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_model, check_token_ids, model_vocab_size
from jaxkv.caches import KVCache
from jaxkv.caches._checks import _widen
from jaxkv.sampling import SamplingConfig, TokenHistory, apply_penalties, greedy, init_history, record_tokens, sample

__all__ = [
    "GenerateOutput",
    "TokenStream",
    "bucket_length",
    "decode_step",
    "generate",
    "prefill",
    "select_token",
    "stream",
]

GREEDY = SamplingConfig()
#: The token :func:`select_token` returns for a row whose logits hold a NaN.
NAN_TOKEN = -1
# Prompts longer than this are prefilled in chunks (bounded activations, see generate).
DEFAULT_PREFILL_CHUNK = 512
# Decode steps per device call in stream (see its tokens_per_call).
DEFAULT_TOKENS_PER_CALL = 16


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """What :func:`generate` returns.

    Attributes:
      tokens: int32 [B, N] generated tokens; after a row's stop token, ``pad_token_id``.
      lengths: int32 [B] tokens each row generated, its stop token included.
    """

    tokens: jax.Array
    lengths: jax.Array


def bucket_length(prompt_len: int, *, minimum: int = 16) -> int:
    """The padded prompt length a compiled program is built for: the next power of two."""
    return max(minimum, 1 << (int(prompt_len) - 1).bit_length())


#: A stop id no token ever is (ids are >= 0, NAN_TOKEN is -1): "no EOS" as a traced value,
#: so a program compiled for one stop id serves every other and none.
NO_STOP = -2


def pad_to_bucket(input_ids: jax.Array, fill: int, bucket: bool = True) -> jax.Array:
    """``input_ids`` [B, P] padded with ``fill`` to ``bucket_length(P)`` columns (``bucket``),
    so that prompts of nearby lengths share one compiled program; the padding lies past
    every row's ``prompt_lengths`` and is never stored."""
    width = input_ids.shape[1]
    padded = bucket_length(width) if bucket else width
    return input_ids if padded == width else jnp.pad(input_ids, ((0, 0), (0, padded - width)), constant_values=fill)


def select_token(
    logits: jax.Array,  # [B, V]
    row_keys: jax.Array | None = None,  # [B] keys
    step: jax.Array | int = 0,
    sampling: SamplingConfig = GREEDY,
    history: TokenHistory | None = None,
) -> jax.Array:  # [B] int32
    """Greedy, or one sample per row with key ``fold_in(row_keys[b], step)``.

    A config with a penalty needs the rows' ``history`` (:func:`jaxkv.sampling.init_history`,
    then :func:`jaxkv.sampling.record_tokens` after each step); without one it raises
    rather than skip the penalty. A row whose logits hold a NaN (the model's answer to a
    traced out-of-range id) gets :data:`NAN_TOKEN` (-1), never a valid-looking id.
    """
    raw = logits
    logits = apply_penalties(logits, history, sampling)
    if not sampling.is_greedy:
        _check_row_keys(row_keys, logits.shape[0])
    if sampling.is_greedy:
        picked = greedy(logits)
    else:

        def one(row_logits, key):
            return sample(row_logits[None], jax.random.fold_in(key, step), sampling)[0]

        picked = jax.vmap(one)(logits, row_keys)
    return nan_rows_as_nan_token(raw, picked)


def _check_row_keys(row_keys, batch: int) -> None:
    """Sampling draws row b's token with ``row_keys[b]``: B typed keys (shapes are static, so
    this check also runs under jit)."""
    how = f"pass jax.random.split(jax.random.key(seed), {batch})"
    if row_keys is None:
        raise ValueError(f"select_token: a sampling config needs row_keys, one PRNG key per row; {how}")
    if not (isinstance(row_keys, jax.Array) and jnp.issubdtype(row_keys.dtype, jax.dtypes.prng_key)):
        raise TypeError(f"select_token: row_keys must be typed PRNG keys (jax.random.key), got "
                        f"{getattr(row_keys, 'dtype', type(row_keys).__name__)}; {how}")
    if row_keys.shape != (batch,):
        raise ValueError(f"select_token: row_keys must hold {batch} keys (one per row of the logits), got shape "
                         f"{list(row_keys.shape)}; {how}")


def poison_bad_lengths(input_ids: jax.Array, prompt_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows whose (traced) length is outside ``[1, P]`` are fed one token id -1 instead.

    Such a length would read a padding position's logits as the first token (0), or take
    padding as prompt (> P). The model embeds id -1 as NaN, so the row's logits and the
    key/value it leaves are NaN, and every decoding loop turns a row of NaN logits into
    :data:`NAN_TOKEN` (see :func:`nan_rows_as_nan_token`), as for a bad id. Valid rows are
    unchanged.
    """
    prompt_lengths, input_ids = _widen(prompt_lengths), _widen(input_ids)  # uint8 ids: the -1 was id 255
    bad = (prompt_lengths < 1) | (prompt_lengths > input_ids.shape[1])
    input_ids = input_ids.at[:, 0].set(jnp.where(bad, -1, input_ids[:, 0]))
    return input_ids, jnp.where(bad, 1, prompt_lengths)


def nan_rows_as_nan_token(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``tokens`` ([...]) with :data:`NAN_TOKEN` where ``logits`` ([..., V]) hold a NaN: the
    row was poisoned (a traced out-of-range id or length); no valid-looking id comes out."""
    return jnp.where(jnp.any(jnp.isnan(logits), axis=-1), NAN_TOKEN, tokens)


def prefill(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    input_ids: jax.Array,  # [B, P] int
    prompt_lengths: jax.Array,  # [B] int
    cache: KVCache,
    row_keys: jax.Array | None = None,
    sampling: SamplingConfig = GREEDY,
    chunk_size: int | None = None,
    history: TokenHistory | None = None,
) -> tuple[jax.Array, KVCache]:  # ([B] int32, cache)
    """Writes the prompts into ``cache`` and returns each row's first generated token.

    Row ``b``'s prompt is ``input_ids[b, :prompt_lengths[b]]``; the rest is padding that is
    neither stored nor attended to. With ``chunk_size`` C < P the prompt enters in chunks of
    C tokens inside a ``lax.fori_loop`` (one traced forward pass), so the activations held at
    once are those of C tokens, not P; the result equals one-shot prefill up to float
    rounding. C must divide P (bucketed prompt lengths are powers of two). ``history``: as
    in :func:`select_token` (the whole prompt's, for a config with a penalty).

    A concrete ``prompt_lengths`` outside ``[1, P]`` is a ``ValueError``; under ``jax.jit``
    such a row yields :data:`NAN_TOKEN` (its cache row holds one NaN token), never a
    valid-looking id.
    """
    model = nnx.merge(graphdef, state)
    batch, prompt_len = input_ids.shape
    if not isinstance(prompt_lengths, jax.core.Tracer):
        host = np.asarray(prompt_lengths)
        bad = (host < 1) | (host > prompt_len)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"prefill: prompt_lengths[{row}] = {int(host[row])} is outside [1, {prompt_len}]")
    else:
        input_ids, prompt_lengths = poison_bad_lengths(input_ids, prompt_lengths)
    if chunk_size is None or chunk_size >= prompt_len:
        # Only each row's last real prompt token needs logits: no [B, P, V] product.
        logits, cache = model(input_ids, cache, prompt_lengths, logits_at=prompt_lengths - 1)  # [B, 1, V]
        return select_token(logits[:, 0], row_keys, 0, sampling, history), cache
    if prompt_len % chunk_size:
        raise ValueError(
            f"prefill: chunk_size {chunk_size} must divide the (bucketed) prompt length {prompt_len}; "
            "use a power of two with bucket=True, or chunk_size=None"
        )

    def chunk(i, carry):
        first, cache = carry
        start = i * chunk_size
        tokens = jax.lax.dynamic_slice_in_dim(input_ids, start, chunk_size, axis=1)
        num_new = jnp.clip(prompt_lengths - start, 0, chunk_size).astype(jnp.int32)
        logits, cache = model(tokens, cache, num_new, logits_at=jnp.maximum(num_new - 1, 0))  # [B, 1, V]
        # A row's first token comes from the last chunk that still held its prompt tokens.
        picked = select_token(logits[:, 0], row_keys, 0, sampling, history)
        return jnp.where(num_new > 0, picked, first), cache

    first = jnp.zeros((batch,), jnp.int32)
    return jax.lax.fori_loop(0, prompt_len // chunk_size, chunk, (first, cache))


def decode_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,  # [B] int
    cache: KVCache,
    row_keys: jax.Array | None = None,
    step: jax.Array | int = 1,
    sampling: SamplingConfig = GREEDY,
    active: jax.Array | None = None,  # [B] bool
    history: TokenHistory | None = None,
) -> tuple[jax.Array, KVCache]:  # ([B] int32, cache)
    """Feeds one token per row and picks the next; inactive rows write nothing.

    ``history`` as in :func:`select_token`; it must already hold ``tokens`` (recorded when
    they were picked)."""
    model = nnx.merge(graphdef, state)
    num_new = None if active is None else active.astype(jnp.int32)
    logits, cache = model(tokens[:, None], cache, num_new)  # [B, 1, V]
    return select_token(logits[:, 0], row_keys, step, sampling, history), cache


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:  # [B] bool
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


def _next_tokens(graphdef, state, last, cache, row_keys, step, sampling, done, stop_ids, pad_id, history):
    """One step of the decode loop shared by ``generate`` and ``stream`` (so both give the
    same tokens): rows already done get ``pad_id`` and write nothing; returns
    ``(tokens [B], cache, done [B], history)`` with ``done`` and ``history`` updated by the
    new tokens."""
    nxt, cache = decode_step(graphdef, state, last, cache, row_keys, step, sampling, active=~done, history=history)
    nxt = jnp.where(done, pad_id, nxt)
    return nxt, cache, done | _is_stop(nxt, stop_ids), record_tokens(history, nxt, ~done)


def _start(graphdef, state, input_ids, prompt_lengths, cache, row_keys, sampling, chunk_size, history_ids,
           history_lengths):
    """Prefill plus the history the penalties need (None without one), the first token in it."""
    vocab = model_vocab_size(nnx.merge(graphdef, state)) if sampling.needs_history else 0
    history = init_history(sampling, history_ids, history_lengths, vocab)
    first, cache = prefill(graphdef, state, input_ids, prompt_lengths, cache, row_keys, sampling, chunk_size, history)
    return first, cache, record_tokens(history, first)


def init_model_cache(
    model, batch: int, capacity: int, dtype: Any = None, kind: str = "static", *, rollback: int = 0, fanout: int = 1
):
    """An empty cache of ``kind`` from the model's ``init_cache`` (shared by ``generate``,
    ``stream`` and every decoding algorithm, so each takes every kind the model offers).

    ``rollback``: the most tokens a ``crop`` may take back (speculative decoding); a kind
    with ring layers gets that many extra slots so rolled-back positions are still held.
    ``fanout``: rows each of the ``batch`` rows becomes (``batch_repeat_interleave``: beams,
    samples); a paged pool gets pages for every one of them at ``capacity``, so the
    algorithm can never run out (forks share pages until they diverge).
    """
    if kind == "static":  # the plain protocol: any model with init_cache(batch, length, dtype=)
        return model.init_cache(batch, capacity, dtype=dtype)
    if kind in ("paged", "paged-quantized"):
        pages = batch * fanout * -(-capacity // 16)
        return model.init_cache(batch, capacity, dtype=dtype, kind=kind, page_size=16, num_pages=pages)
    if rollback and kind == "hybrid":
        return model.init_cache(batch, capacity, dtype=dtype, kind=kind, extra_slots=rollback)
    return model.init_cache(batch, capacity, dtype=dtype, kind=kind)


@partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "capacity", "sampling", "cache_dtype", "cache_kind", "chunk_size"),
)
def _generate(
    graphdef, state, input_ids, prompt_lengths, row_keys, stop_ids, pad_id, *, max_new_tokens, capacity, sampling,
    cache_dtype, cache_kind="static", chunk_size=None,
):
    model = nnx.merge(graphdef, state)
    batch = input_ids.shape[0]
    cache = init_model_cache(model, batch, capacity, cache_dtype, cache_kind)
    first, cache, history = _start(graphdef, state, input_ids, prompt_lengths, cache, row_keys, sampling, chunk_size,
                                   input_ids, prompt_lengths)
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, stop_ids)
    lengths = jnp.ones((batch,), jnp.int32)

    def cond(carry):
        step, _, _, done, _, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, last, cache, done, tokens, lengths, history = carry
        nxt, cache, now_done, history = _next_tokens(
            graphdef, state, last, cache, row_keys, step, sampling, done, stop_ids, pad_id, history
        )
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, nxt, step, axis=1)
        lengths = lengths + (~done).astype(jnp.int32)
        return step + 1, nxt, cache, now_done, tokens, lengths, history

    carry = (jnp.int32(1), first, cache, done, tokens, lengths, history)
    _, _, _, _, tokens, lengths, _ = jax.lax.while_loop(cond, body, carry)
    return tokens, lengths


def check_prompts(
    input_ids: Any, prompt_lengths: Any, who: str, *, vocab_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Validates ``[B, P]`` prompts and ``[B]`` lengths; returns both as int32 arrays.

    With ``vocab_size`` V, concrete ids must lie in ``[0, V)`` (padding included); traced
    ids cannot be checked (see :func:`jaxkv.models.Llama.__call__` for what they do).

    Raises:
        ValueError: ``input_ids`` not 2-D or empty, an id outside ``[0, V)``, lengths of
            the wrong shape or outside ``[1, P]``.
        TypeError: non-integer ids or lengths.
    """
    if not isinstance(input_ids, jax.Array):
        # Checked on the host first: converting to int32 would wrap ids >= 2**31.
        input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"{who}: input_ids must have shape [batch, prompt_len] with prompt_len >= 1, got "
            f"{list(input_ids.shape)}; add a batch axis with input_ids[None]"
        )
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"{who}: input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    check_token_ids(input_ids, vocab_size, who)
    input_ids = jnp.asarray(input_ids)
    batch, prompt_len = input_ids.shape
    if prompt_lengths is None:
        prompt_lengths = jnp.full((batch,), prompt_len, jnp.int32)
    if not isinstance(prompt_lengths, jax.Array):
        # Checked on the host first, as the ids: jnp.asarray would wrap int64 / uint64 lengths
        # to 32 bits (2**32 + 3 became 3, a valid length, silently).
        prompt_lengths = np.asarray(prompt_lengths)
    if prompt_lengths.shape != (batch,):
        raise ValueError(
            f"{who}: prompt_lengths must have shape [batch] = [{batch}], got {list(prompt_lengths.shape)}"
        )
    if not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
        raise TypeError(f"{who}: prompt_lengths must be integers, got dtype {prompt_lengths.dtype}")
    if not isinstance(prompt_lengths, jax.core.Tracer):
        host = np.asarray(prompt_lengths)
        bad = (host < 1) | (host > prompt_len)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(
                f"{who}: prompt_lengths[{row}] = {int(host[row])} is outside [1, {prompt_len}]: every row "
                "needs at least one prompt token and at most input_ids.shape[1]"
            )
    else:
        # Traced: tested in their own dtype, against this width (bucketing pads it later);
        # a bad one becomes 0, which prefill turns into a row of NAN_TOKEN.
        prompt_lengths = _widen(prompt_lengths)
        ok = (prompt_lengths >= 1) & (prompt_lengths <= prompt_len)
        prompt_lengths = jnp.where(ok, prompt_lengths, 0)
    return input_ids.astype(jnp.int32), jnp.asarray(prompt_lengths, jnp.int32)



def _prepare(model, input_ids, max_new_tokens, prompt_lengths, key, eos_token_id, pad_token_id, sampling, bucket,
             chunk_size, who):
    # The checks beam_search / sample_n / ServingLoop use (a lazy import: jaxkv.decoding imports this module).
    from jaxkv.decoding._common import check_positive_int, check_token_id

    check_model(model, who)
    input_ids, prompt_lengths = check_prompts(input_ids, prompt_lengths, who, vocab_size=model_vocab_size(model))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1
    ):  # True is an int to Python: it would prefill one token per chunk
        raise ValueError(f"prefill_chunk_size must be None or a Python int >= 1, got {chunk_size!r}")
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens", who)
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a jaxkv.sampling.SamplingConfig, got {type(sampling).__name__}")
    batch, prompt_len = input_ids.shape
    if not sampling.is_greedy and key is None:
        raise ValueError("sampling needs a PRNG key: pass key=jax.random.key(seed)")
    if sampling.needs_history and model_vocab_size(model) is None:
        raise ValueError(f"{who}: the sampling config's penalties need the vocabulary size, and the model has no "
                         "config.vocab_size")
    row_keys = None
    if key is not None:
        key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            row_keys = jax.random.split(key, batch) if key.ndim == 0 else key
        else:
            raise TypeError("key must be a typed PRNG key from jax.random.key(seed) (or B of them)")
        if row_keys.shape != (batch,):
            raise ValueError(f"key must be one key or {batch} keys (one per row), got shape {list(row_keys.shape)}")
    vocab = model_vocab_size(model)
    if eos_token_id is None:
        stop = []
    elif (isinstance(eos_token_id, Sequence) and not isinstance(eos_token_id, (str, bytes))) or (
        isinstance(eos_token_id, (np.ndarray, jax.Array)) and eos_token_id.ndim == 1
    ):
        stop = [check_token_id(t, f"eos_token_id[{i}]", vocab, who, allow_none=False)
                for i, t in enumerate(eos_token_id)]
    else:
        stop = [check_token_id(eos_token_id, "eos_token_id", vocab, who)]
    # The pad is emitted after a stop: -1 would read as NAN_TOKEN, an id >= V as a real token to no one.
    pad_token_id = check_token_id(pad_token_id, "pad_token_id", vocab, who, allow_none=False)
    # A stop list matching no id (not even NAN_TOKEN) keeps the array non-empty for the compare.
    stop_ids = jnp.asarray(stop or [np.iinfo(np.int32).min], jnp.int32)
    padded_len = bucket_length(prompt_len) if bucket else prompt_len
    if chunk_size is not None and padded_len > chunk_size:
        padded_len = -(-padded_len // chunk_size) * chunk_size  # whole chunks; the padding is never stored
    ids = input_ids
    if padded_len > prompt_len:
        ids = jnp.pad(ids, ((0, 0), (0, padded_len - prompt_len)), constant_values=pad_token_id)
    chunk = None if chunk_size is None or chunk_size >= padded_len else int(chunk_size)
    return ids, prompt_lengths, row_keys, stop_ids, chunk, pad_token_id, max_new_tokens


def generate(
    model: nnx.Module,
    input_ids: Any,  # [B, P] int
    max_new_tokens: int,
    *,
    prompt_lengths: Any = None,  # [B] int
    sampling: SamplingConfig = GREEDY,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    cache_dtype: Any = None,
    cache_kind: str = "static",
    bucket: bool = True,
    prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
) -> GenerateOutput:
    """Decodes a batch of (possibly ragged) prompts in one compiled program.

    Prefill and every decode step run through a jaxkv cache (``cache_kind``) inside one
    ``jax.jit``; the loop is a ``lax.while_loop`` that ends when every row has stopped or
    N tokens are out. A second call with the same batch size, prompt bucket, N and
    sampling config compiles nothing.

    Args:
      model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
      input_ids: [B, P] prompt token ids. Ragged prompts are right-padded (no left
        padding): row ``b`` holds its prompt in ``input_ids[b, :prompt_lengths[b]]``.
      max_new_tokens: N >= 1, tokens to generate per row at most.
      prompt_lengths: [B] real prompt length of each row, in ``[1, P]``; default P.
      sampling: :class:`jaxkv.sampling.SamplingConfig`; default greedy. With a penalty,
        each row's history (its prompt, not the padding after it, and its tokens so far)
        rides in the loop: two [B, V] arrays.
      key: a PRNG key (``jax.random.key``), or B keys, one per row. Needed to sample.
      eos_token_id: stop token(s). A row that emits one is finished: it is frozen (its
        cache gets no more writes) and its remaining tokens are ``pad_token_id``.
      pad_token_id: filler after a row's stop token and for prompt bucketing.
      cache_dtype: key/value storage dtype; default the model's parameter dtype.
      cache_kind: ``"static"`` (default), or another kind the model's ``init_cache``
        offers (``Llama``: ``"hybrid"`` ring buffers for sliding layers, ``"quantized"``
        int8 keys/values).
      bucket: pad the prompt axis to the next power of two (>= 16) so that nearby prompt
        lengths share one compiled program.
      prefill_chunk_size: prompts longer than this enter the cache in chunks of this many
        tokens (a loop inside the program), so prefill holds the activations of one chunk,
        not of the whole prompt (peak memory); ``None`` prefills in one shot.

    Returns:
      :class:`GenerateOutput` with ``tokens`` int32 [B, N] and ``lengths`` int32 [B].

    Raises:
      ValueError: ``input_ids`` not 2-D or empty, a token id outside ``[0, V)`` (the
        message names the id, its position and V; padding is checked too),
        ``max_new_tokens < 1``, ``prompt_lengths`` of the wrong shape or outside ``[1, P]``,
        sampling without a key, wrong key count.
      TypeError: ``model`` not an ``nnx.Module`` (a ``from_pretrained`` bundle: pass
        ``loaded.model``), non-integer ids or lengths, a bad sampling config or key.

    Under an outer ``jax.jit`` the ids are traced and cannot be checked: an out-of-range
    id gives NaN logits for its row (see :meth:`jaxkv.models.Llama.__call__`), and that
    row's tokens are then ``NAN_TOKEN`` (-1), never a valid-looking id. Other rows are
    unaffected. A traced ``prompt_lengths`` entry outside ``[1, P]`` does the same.

    Example:
      >>> out = jaxkv.generate(model, jnp.array([[1, 2, 3], [4, 5, 0]]), 8,  # doctest: +SKIP
      ...                      prompt_lengths=jnp.array([3, 2]), eos_token_id=0,
      ...                      sampling=SamplingConfig(temperature=0.8, top_p=0.95),
      ...                      key=jax.random.key(0))
      >>> out.tokens, out.lengths                                            # doctest: +SKIP
    """
    ids, lengths, row_keys, stop_ids, chunk, pad_token_id, max_new_tokens = _prepare(
        model, input_ids, max_new_tokens, prompt_lengths, key, eos_token_id, pad_token_id, sampling, bucket,
        prefill_chunk_size, "generate",
    )
    graphdef, state = nnx.split(model)
    tokens, out_lengths = _generate(
        graphdef,
        state,
        ids,
        lengths,
        row_keys,
        stop_ids,
        jnp.int32(pad_token_id),
        max_new_tokens=int(max_new_tokens),
        capacity=ids.shape[1] + int(max_new_tokens),
        sampling=sampling,
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
        cache_kind=cache_kind,
        chunk_size=chunk,
    )
    return GenerateOutput(tokens=tokens, lengths=out_lengths)


@lru_cache(maxsize=32)
def _stream_programs(graphdef: nnx.GraphDef, treedef: Any):
    """Jitted prefill and donated multi-step decode for one model structure, built once.

    The graph definition and the parameters' tree structure are bound here, so a call
    passes only a flat list of arrays: hashing a graph definition and flattening an
    ``nnx.State`` on every call would cost about a millisecond of Python per call.
    """

    def run_prefill(leaves, input_ids, prompt_lengths, cache, row_keys, history_ids, history_lengths, *, sampling,
                    chunk_size):
        state = jax.tree.unflatten(treedef, leaves)
        return _start(graphdef, state, input_ids, prompt_lengths, cache, row_keys, sampling, chunk_size, history_ids,
                      history_lengths)

    def run_decode(leaves, last, cache, row_keys, step, done, stop_ids, pad_id, limit, history, *, sampling,
                   num_steps):
        """Up to ``num_steps`` steps of ``generate``'s loop from ``step``; ends early at step
        ``limit`` or once every row is done. Returns ``(tokens [num_steps, B], count, last,
        cache, done, history)``: rows ``tokens[:count]`` are the new steps."""
        state = jax.tree.unflatten(treedef, leaves)
        tokens = jnp.full((num_steps, last.shape[0]), pad_id, jnp.int32)

        def cond(carry):
            i, step, _, _, done, _, _ = carry
            return (i < num_steps) & (step < limit) & ~jnp.all(done)

        def body(carry):
            i, step, last, cache, done, tokens, history = carry
            nxt, cache, done, history = _next_tokens(graphdef, state, last, cache, row_keys, step, sampling, done,
                                                     stop_ids, pad_id, history)
            tokens = jax.lax.dynamic_update_index_in_dim(tokens, nxt, i, axis=0)
            return i + 1, step + 1, nxt, cache, done, tokens, history

        count, _, last, cache, done, tokens, history = jax.lax.while_loop(
            cond, body, (jnp.int32(0), step, last, cache, done, tokens, history)
        )
        return tokens, count, last, cache, done, history

    jit_prefill = jax.jit(run_prefill, static_argnames=("sampling", "chunk_size"), donate_argnames="cache")
    jit_decode = jax.jit(run_decode, static_argnames=("sampling", "num_steps"), donate_argnames=("cache", "history"))
    return jit_prefill, jit_decode


class TokenStream:
    """Iterable over generated tokens, one decode step at a time (see :func:`stream`).

    Each item is a NumPy int32 [B] array: the token each row produced at that step
    (``pad_token_id`` for rows that already stopped). ``done`` holds the rows that have
    stopped as of the last item yielded; ``cache`` is the current cache (of
    ``cache_kind``). The first item comes from the prefill call alone; later items come
    ``tokens_per_call`` at a time from one device call each (a ``lax.while_loop`` that ends
    early once every row is done or the last step is reached), so ``cache`` is the one
    after the call that produced the last item: it may already hold up to
    ``tokens_per_call - 1`` fed tokens beyond it (with ``tokens_per_call=1``, exactly the
    tokens fed so far). When the stream ends, it holds the prompt and every fed token.

    Every ``iter()`` starts over from the prompt with a fresh, empty cache, so iterating
    again yields the same tokens (greedy, or sampling with the same key: row keys are
    folded with the step number). ``cache`` and ``done`` follow the iteration that last
    produced a token; the caches of earlier iterations were donated to their decode calls
    and are gone.

    The stream holds the model's weights as they were when it was built: a later change to
    the model (a training step, ``nnx.update``) is not seen by it, nor by a new ``iter()``;
    call :func:`stream` again for the new weights.
    """

    def __init__(
        self, model, ids, lengths, row_keys, stop_ids, pad_id, max_new_tokens, sampling, cache_dtype, chunk,
        cache_kind="static", tokens_per_call=1,
    ):
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self._prefill, self._decode = _stream_programs(graphdef, treedef)
        self._args = (ids, lengths, row_keys, stop_ids, pad_id, max_new_tokens, sampling, chunk)
        # The prompt the penalties count (PromptCacheStream feeds only the part its file lacks).
        self._history_prompt = (ids, lengths)
        self.tokens_per_call = tokens_per_call
        batch = ids.shape[0]
        dtype = None if cache_dtype is None else jnp.dtype(cache_dtype)
        self._empty_cache = partial(init_model_cache, model, batch, ids.shape[1] + max_new_tokens, dtype, cache_kind)
        jax.eval_shape(self._empty_cache)  # a bad cache_kind / cache_dtype raises here, as generate's would
        self._cache: KVCache | None = None  # allocated when first asked for (PromptCacheStream sets its own)
        self._cache_unused = True  # the first iteration takes this one instead of allocating
        self.done = np.zeros((batch,), bool)

    @property
    def cache(self) -> KVCache | None:
        """The current cache: before the first iteration the empty one it will prefill."""
        if self._cache is None and self._cache_unused:
            self._cache = self._empty_cache()
        return self._cache

    @cache.setter
    def cache(self, value: KVCache | None) -> None:
        self._cache = value

    def __iter__(self) -> Iterator[np.ndarray]:
        ids, lengths, row_keys, stop_ids, pad_id, max_new_tokens, sampling, chunk = self._args
        stop = np.asarray(stop_ids)
        if self._cache_unused:
            cache = self.cache  # (allocated now if nothing asked for it or set one)
            self._cache_unused = False
        else:
            # Dropping the previous iteration's cache first keeps one cache alive, not two.
            self.cache = None
            cache = self._empty_cache()
        last, cache, history = self._prefill(self._leaves, ids, lengths, cache, row_keys, *self._history_prompt,
                                             sampling=sampling, chunk_size=chunk)
        self.cache = cache
        first = np.array(last)
        done = np.isin(first, stop)
        self.done = done
        yield first
        step, limit, pad = 1, jnp.int32(max_new_tokens), jnp.int32(pad_id)
        device_done = jnp.asarray(done)
        while step < max_new_tokens and not done.all():
            tokens, count, last, cache, device_done, history = self._decode(
                self._leaves, last, cache, row_keys, jnp.int32(step), device_done, stop_ids, pad, limit, history,
                sampling=sampling, num_steps=self.tokens_per_call,
            )
            self.cache = cache
            tokens, count = jax.device_get((tokens, count))
            tokens = np.array(tokens[:count])  # [count, B], writable: each item is one row of it
            # The done flags after each of these steps, as the device loop computed them.
            done_after = np.logical_or.accumulate(np.isin(tokens, stop), axis=0) | done
            for row, row_done in zip(tokens, done_after):
                self.done = row_done
                yield row
            done = done_after[-1]
            step += int(count)


def stream(
    model: nnx.Module,
    input_ids: Any,
    max_new_tokens: int,
    *,
    prompt_lengths: Any = None,
    sampling: SamplingConfig = GREEDY,
    key: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    cache_dtype: Any = None,
    cache_kind: str = "static",
    bucket: bool = True,
    prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
    tokens_per_call: int = DEFAULT_TOKENS_PER_CALL,
) -> TokenStream:
    """Like :func:`generate`, but yields each step's tokens as soon as they exist.

    A jitted prefill, then a jitted decode loop of up to ``tokens_per_call`` steps per call
    whose cache argument is donated, so the cache is updated in place. Arguments and errors
    as in :func:`generate`; with the same key the tokens equal ``generate``'s. Iterating the
    returned :class:`TokenStream` again starts over from the prompt with a fresh cache and
    yields the same tokens.

    Args:
      tokens_per_call: decode steps per device call (default 16): each call costs a
        dispatch and a device-to-host copy, which at one step per call cost more than the
        step itself for small models. The tokens are the same for every value; a larger
        one only delays the first token of each call's batch (by ``tokens_per_call`` steps)
        and lets ``TokenStream.cache`` run ahead of the items yielded. 1 gives one step per
        call.

    Raises:
      ValueError: as :func:`generate`, and ``tokens_per_call`` not a Python int >= 1.

    Example:
      >>> for tokens in jaxkv.stream(model, ids, 32, eos_token_id=0):  # doctest: +SKIP
      ...     print(tokenizer.decode([int(tokens[0])]), end="", flush=True)
    """
    if not isinstance(tokens_per_call, (int, np.integer)) or isinstance(tokens_per_call, bool) or tokens_per_call < 1:
        raise ValueError(f"tokens_per_call must be a Python int >= 1, got {tokens_per_call!r}")
    ids, lengths, row_keys, stop_ids, chunk, pad_token_id, max_new_tokens = _prepare(
        model, input_ids, max_new_tokens, prompt_lengths, key, eos_token_id, pad_token_id, sampling, bucket,
        prefill_chunk_size, "stream",
    )
    return TokenStream(model, ids, lengths, row_keys, stop_ids, int(pad_token_id), int(max_new_tokens), sampling,
                       cache_dtype, chunk, cache_kind, int(tokens_per_call))

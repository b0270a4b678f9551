"""A serving loop: fixed batch slots decoding continuously, refilled as requests finish.

The cache has ``num_slots`` rows. Each row (slot) serves one request at a time:

* **admit**: a free slot takes the next waiting request; its row is emptied with
  ``cache.reset(rows=...)`` (lengths and flags only, no data moves);
* **prefill**: the prompt enters that row in chunks of ``chunk_size`` tokens
  (:func:`jaxkv.decoding.prefill_chunk`), ``num_new`` = each row's chunk length, while the
  other rows keep their caches untouched. Up to ``prefill_rows`` (R) rows prefill per step:
  with R < S they are gathered into an R-row cache (``batch_select_indices``), run as one
  ``[R, C]`` forward and written back to their slots, so one refilled slot costs a
  ``[R, C]`` forward instead of an ``[S, C]`` one; with R = S the whole batch runs with
  ``num_new = 0`` on the rows that are not prefilling;
* **decode**: one ``[S, 1]`` forward per step for every row that is generating,
  ``num_new = 0`` for the rest;
* **retire**: a request finishes at its EOS (kept) or after ``max_new_tokens``; its slot is
  free for the next request at the next step.

Two programs are compiled, once each: the chunk step and the decode step, both with the
cache donated. Request lengths, arrival order and slot assignment are data (``num_new``,
``reset`` masks, tokens), never shapes, so nothing recompiles while serving.

Decoding is greedy (argmax, lowest id on ties), and per-row caches make a request's
tokens independent of whatever else shares the batch: any arrival order gives each
request the tokens it gets alone.

``policy="static"`` is the baseline the benchmark compares against: a new batch is admitted
only when every slot is free, so each batch waits for its longest request.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_model, model_vocab_size
from jaxkv.decoding._common import check_positive_int, check_request, check_token_id, forward
from jaxkv.decoding.chunked import prefill_chunk
from jaxkv.generation import init_model_cache, nan_rows_as_nan_token
from jaxkv.sampling import greedy

__all__ = ["Completion", "Request", "ServingLoop"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
        prompt: token ids (at least one).
        max_new_tokens: the most tokens to generate (>= 1).
        arrival: the loop step at which the request becomes visible (0: from the start).
        id: anything hashable that names the request; default its index in ``run``.
    """

    prompt: Sequence[int]
    max_new_tokens: int
    arrival: int = 0
    id: Any = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request.

    Attributes:
        id: the request's id.
        tokens: generated token ids, the EOS included when it ended the request.
        finish_reason: ``"eos"`` or ``"length"``.
        slot: the batch row that served it.
        admitted_step, finished_step: loop steps at admission and at the last token.
    """

    id: Any
    tokens: tuple[int, ...]
    finish_reason: str
    slot: int
    admitted_step: int
    finished_step: int


@dataclasses.dataclass
class _Slot:
    request: Request
    request_id: Any
    admitted_step: int
    prefilled: int = 0
    fresh: bool = True  # its row still holds the previous request: reset on the first chunk
    tokens: list[int] = dataclasses.field(default_factory=list)


def _put_rows(cache: Any, rows: jax.Array, part: Any) -> Any:
    """Writes ``part``'s rows into ``cache`` at ``rows`` (int32[R]); entries ``>= S`` are the
    batch's unused entries: skipped, not flagged (an out-of-range row would flag every row)."""
    return cache.put_rows(rows, part, mask=rows < cache.batch_size)


# Traces of the two programs, by name: they are module-level programs with the model's graph
# static, so a second loop over the same model and sizes compiles nothing (a jit of a partial
# made per loop compiled both again for every loop; review 81).
_TRACES: collections.Counter = collections.Counter()


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _prefill_program(graphdef, state, cache, rows, tokens, num_new, reset):
    # rows: int32[R] slots (>= S: an unused entry); tokens [R, C]; num_new [R]; reset bool[R].
    _TRACES["prefill"] += 1  # runs only while tracing: counts compilations
    if rows.shape[0] == cache.batch_size:  # the whole batch: masking alone, rows in order
        cache = cache.reset(rows=reset)
        last, _, cache = prefill_chunk(graphdef, state, cache, tokens, num_new)
        return _greedy(last), cache
    part = cache.batch_select_indices(rows).reset(rows=reset)
    last, _, part = prefill_chunk(graphdef, state, part, tokens, num_new)
    return _greedy(last), _put_rows(cache, rows, part)


@partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def _decode_program(graphdef, state, cache, tokens, active):
    _TRACES["decode"] += 1
    logits, cache = forward(graphdef, state, tokens[:, None], cache, active.astype(jnp.int32))
    return _greedy(logits[:, 0]), cache


def _greedy(logits: jax.Array) -> jax.Array:
    # A row of NaN logits (NaN weights, an overflow) is NAN_TOKEN (-1), as in every other loop:
    # argmax made it token 0, a real id that could even end the request as its EOS (review 76).
    return nan_rows_as_nan_token(logits, greedy(logits))


class ServingLoop:
    """Continuous batching over a fixed number of cache rows.

    Args:
        model: an ``nnx.Module`` decoder such as :class:`jaxkv.models.Llama`.
        num_slots: S, requests decoded together (the cache batch size).
        max_length: cache capacity per slot; a request needs
            ``len(prompt) + max_new_tokens - 1 <= max_length``.
        chunk_size: C, prompt tokens per prefill chunk.
        prefill_rows: R, rows prefilled per step (1 <= R <= S). Default: S for the static
            policy (a batch prefills together), ``max(1, S // 4)`` for continuous batching
            (slots free up one at a time).
        eos_token_id: the token that ends a request (kept in its output), or None.
        policy: ``"continuous"`` (refill a slot as soon as it frees) or ``"static"``
            (admit a new batch only when all slots are free: the baseline).
        cache_dtype: key/value storage dtype; default the model's parameter dtype.
        cache_kind: ``"static"`` (default), or another kind the model's ``init_cache`` offers
            (``Llama``: ``"hybrid"``, ``"quantized"``); every algorithm takes every kind.

    Raises:
        TypeError: ``model`` not an ``nnx.Module`` (a ``from_pretrained`` bundle: pass
            ``loaded.model``).
        ValueError: bad sizes, policy or ``eos_token_id``.

    Example:
        >>> loop = ServingLoop(model, num_slots=4, max_length=256, chunk_size=32, eos_token_id=0)  # doctest: +SKIP
        >>> done = loop.run([Request([5, 6, 7], 64), Request([8, 9], 16, arrival=3)])           # doctest: +SKIP
        >>> done[0].tokens, loop.compile_counts                                                  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        num_slots: int,
        max_length: int,
        chunk_size: int = 32,
        prefill_rows: int | None = None,
        eos_token_id: int | None = None,
        policy: str = "continuous",
        cache_dtype: Any = None,
        cache_kind: str = "static",
    ):
        who = "ServingLoop"
        check_model(model, who)
        self.num_slots = check_positive_int(num_slots, "num_slots", who)
        self.max_length = check_positive_int(max_length, "max_length", who)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size", who)
        self._vocab_size = model_vocab_size(model)
        self.eos_token_id = check_token_id(eos_token_id, "eos_token_id", self._vocab_size, who)
        if policy not in ("continuous", "static"):
            raise ValueError(f"{who}: policy must be 'continuous' or 'static', got {policy!r}")
        self.policy = policy
        if prefill_rows is None:
            prefill_rows = self.num_slots if policy == "static" else max(1, self.num_slots // 4)
        self.prefill_rows = check_positive_int(prefill_rows, "prefill_rows", who)
        if self.prefill_rows > self.num_slots:
            raise ValueError(f"{who}: prefill_rows ({prefill_rows}) must be <= num_slots ({num_slots})")
        self._graphdef, self._state = nnx.split(model)
        self._cache = init_model_cache(model, self.num_slots, self.max_length, cache_dtype, cache_kind)
        self._traces_before = collections.Counter(_TRACES)
        self.stats: dict[str, float] = {}

    @property
    def compile_counts(self) -> dict[str, int]:
        """How many times each program was traced (compiled) since this loop was built:
        ``{"prefill": n, "decode": m}``. A loop over the same model and sizes as an earlier
        one reuses its programs (0, 0)."""
        return {name: _TRACES[name] - self._traces_before[name] for name in ("prefill", "decode")}

    def _fetch(self, tokens: jax.Array) -> np.ndarray:
        """The call's tokens on the host, with the cache's flags in the same transfer: a
        flagged row (a write the cache refused) raises ``CacheError`` instead of decoding on."""
        tokens, flags = jax.device_get((tokens, self._cache.flags))
        if np.any(flags):
            self._cache.check()
        return np.asarray(tokens)

    def _check(self, request: Request, index: int, who: str) -> None:
        check_request(request.prompt, request.max_new_tokens, request.arrival, self.max_length, self._vocab_size,
                      who, index, f"request {index}" if request.id is None else f"request {request.id!r}")

    def run(self, requests: Sequence[Request]) -> list[Completion]:
        """Serves ``requests`` to completion; returns their completions in request order.

        A request becomes visible at its ``arrival`` step; waiting requests are admitted
        in (arrival, index) order. ``self.stats`` afterwards holds the step and token counts
        and the wall time.

        Raises:
            ValueError: an empty prompt, a prompt token id outside ``[0, V)``,
                ``max_new_tokens < 1``, or a request that does not fit ``max_length``.
            jaxkv.CacheError: a cache row got flagged (checked after every device call;
                the requests are checked up front, so this means a bug, never a
                request's fault).
        """
        who = "ServingLoop.run"
        if isinstance(requests, Request):  # "'Request' object is not iterable" (review 84)
            raise TypeError(f"{who} takes a list of Requests, got one Request; pass [request].")
        requests = list(requests)
        for index, request in enumerate(requests):
            if not isinstance(request, Request):  # a (prompt, n) tuple: AttributeError 'prompt' before
                raise TypeError(f"{who}: request {index} must be a Request(prompt, max_new_tokens, ...), got "
                                f"{type(request).__name__}")
            self._check(request, index, who)
        ids = [i if r.id is None else r.id for i, r in enumerate(requests)]
        pending = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
        waiting: collections.deque[int] = collections.deque()
        slots: list[_Slot | None] = [None] * self.num_slots
        done: dict[int, Completion] = {}
        index_of = {}
        step = 0
        prefill_calls = decode_calls = 0
        prefill_s = decode_s = 0.0
        start = time.perf_counter()
        s, c = self.num_slots, self.chunk_size

        def retire(row: int, reason: str) -> None:
            slot = slots[row]
            done[index_of[row]] = Completion(
                slot.request_id, tuple(slot.tokens), reason, row, slot.admitted_step, step
            )
            slots[row] = None

        def after_token(row: int, token: int) -> None:
            slot = slots[row]
            slot.tokens.append(token)
            if self.eos_token_id is not None and token == self.eos_token_id:
                retire(row, "eos")
            elif len(slot.tokens) >= slot.request.max_new_tokens:
                retire(row, "length")

        while len(done) < len(requests):
            if pending and not waiting and all(slot is None for slot in slots):
                # Nothing to do before the next arrival: jump there (the idle steps did nothing).
                step = max(step, int(requests[pending[0]].arrival))
            while pending and requests[pending[0]].arrival <= step:
                waiting.append(pending.pop(0))
            if self.policy == "continuous" or all(slot is None for slot in slots):
                for row in range(s):
                    if slots[row] is None and waiting:
                        i = waiting.popleft()
                        slots[row] = _Slot(requests[i], ids[i], step)
                        index_of[row] = i

            # Rows with prompt left, earliest admitted first, up to R of them.
            prefilling = sorted(
                (row for row in range(s) if slots[row] and slots[row].prefilled < len(slots[row].request.prompt)),
                key=lambda row: (slots[row].admitted_step, row),
            )[: self.prefill_rows]
            if prefilling:
                r = self.prefill_rows
                rows = np.full((r,), s, np.int32) if r < s else np.arange(s, dtype=np.int32)
                tokens = np.zeros((r, c), np.int32)
                num_new = np.zeros((r,), np.int32)
                reset = np.zeros((r,), bool)
                # Entry j of the R-row batch holds the j-th prefilling row; with R = S, row order.
                place = {row: (j if r < s else row) for j, row in enumerate(prefilling)}
                for row, j in place.items():
                    slot = slots[row]
                    chunk = slot.request.prompt[slot.prefilled : slot.prefilled + c]
                    rows[j], tokens[j, : len(chunk)], num_new[j], reset[j] = row, chunk, len(chunk), slot.fresh
                    slot.prefilled += len(chunk)
                    slot.fresh = False
                tick = time.perf_counter()
                first, self._cache = _prefill_program(self._graphdef, self._state, self._cache, rows, tokens,
                                                      num_new, reset)
                first = self._fetch(first)
                prefill_s += time.perf_counter() - tick
                prefill_calls += 1
                for row, j in place.items():
                    if slots[row].prefilled == len(slots[row].request.prompt):
                        after_token(row, int(first[j]))

            # Rows with a first token generate; one whose prompt just ended joins at once.
            decoding = [row for row in range(s) if slots[row] and slots[row].tokens]
            if decoding:
                tokens = np.zeros((s,), np.int32)
                active = np.zeros((s,), bool)
                for row in decoding:
                    tokens[row] = slots[row].tokens[-1]
                    active[row] = True
                tick = time.perf_counter()
                nxt, self._cache = _decode_program(self._graphdef, self._state, self._cache, tokens, active)
                nxt = self._fetch(nxt)
                decode_s += time.perf_counter() - tick
                decode_calls += 1
                for row in decoding:
                    after_token(row, int(nxt[row]))
            step += 1

        wall = time.perf_counter() - start
        generated = sum(len(cpl.tokens) for cpl in done.values())
        self.stats = dict(
            steps=step,
            prefill_calls=prefill_calls,
            decode_calls=decode_calls,
            prefill_s=prefill_s,
            decode_s=decode_s,
            generated_tokens=generated,
            wall_s=wall,
            tokens_per_s=generated / wall if wall > 0 else float("inf"),
        )
        return [done[i] for i in range(len(requests))]

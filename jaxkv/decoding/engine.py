"""A serving engine on a paged cache: continuous batching, prefix caching, preemption.

:class:`PagedEngine` keeps up to ``max_rows`` requests in one :class:`~jaxkv.PagedCache`
whose pool of ``num_pages`` pages is shared by them, so a request holds pages for the
tokens it has, not ``max_length`` slots: the pool admits as many requests as its pages
can hold.

Each step is one compiled call over the busy rows only (picked out of the cache with
``take_rows``, which moves block tables, not pages; padded to a bucket of 1, 4, 16, ... up
to R rows, so a few programs serve every mix):

* **mixed step** (some row has prompt left): a ``[N, C]`` forward where a prefilling row
  brings its next chunk of up to ``C`` prompt tokens and a generating row its one new
  token (``num_new`` per row: chunked prefill rides along with decoding);
* **decode step** (nobody prefilling): ``[N, 1]``.

Both sample inside the program, per row: greedy at temperature 0, else temperature,
top-p and min-p with the key ``fold_in(PRNGKey(seed), token_index)``: a request's tokens
depend on its prompt, its settings and its seed only, never on what else shares the batch,
its row, or whether it was preempted. A request's repetition, presence and frequency
penalties (``jaxkv.sampling.SamplingConfig``'s) act on its logits first, greedy or not:
the engine keeps a ``[R, V]`` history per row on the device (``TokenHistory``), filled at
admission from the request's prompt and the tokens it has generated (so a preempted request
resumes with its own counts) and updated inside the step; steps whose rows have no penalty
run a program without it.

**Admission** takes waiting requests in arrival order while rows and pages last (a
request needs the pages of its uncached prompt plus one). **Prefix cache**: every full
page of a prompt is indexed by a hash chain ``h_i = sha256(h_{i-1}, page tokens)`` as soon
as it is written, and the index pins it (``PagedCache.retain``); a new request whose
prompt starts with indexed pages attaches them (``attach_prefix``: shared, no copy) and
prefills only the rest. A request whose next uncached page is being written by another
row waits one step for it rather than computing it twice. Unpinned by LRU eviction when
the pool runs short (only pages no row holds, and never the pages a request being
admitted has just matched). **Preemption**: when a step needs more
pages than are free (after eviction), the most recently admitted requests give their row
back (pages freed; shared prefix pages stay with the index) and rejoin the front of the
queue with their generated tokens appended to the prompt, to be recomputed; their
output is unchanged. A request that cannot get a page even alone (pages pinned outside
the engine's index) raises RuntimeError, at admission or mid-generation; a write the cache
flags after a step (``cache.check()``) raises CacheError.

Stop conditions per request: ``max_new_tokens``, ``stop_token_ids`` (kept in the output).
:meth:`PagedEngine.stream` yields ``(request id, token)`` as tokens are produced;
:meth:`PagedEngine.run` collects them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import numbers
import sys
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_model, check_token_ids, model_vocab_size
from jaxkv.caches import NO_PAGE
from jaxkv.decoding._common import check_integer_ids, check_positive_int, check_request, forward
from jaxkv.generation import nan_rows_as_nan_token
from jaxkv.sampling import SamplingConfig, TokenHistory, apply_temperature, penalise, record_tokens, token_counts

__all__ = ["EngineRequest", "EngineResult", "PagedEngine", "PrefixIndex"]


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One request to :class:`PagedEngine`.

    Attributes:
        prompt: token ids (at least one).
        max_new_tokens: the most tokens to generate (>= 1).
        temperature: 0 for greedy (lowest id on ties), else the sampling temperature.
        top_p: nucleus mass in (0, 1], or None (no filter).
        min_p: keep tokens at least ``min_p`` times as likely as the most likely one (after
            top-p), or None / 0 (no filter).
        repetition_penalty, presence_penalty, frequency_penalty: as in
            :class:`jaxkv.sampling.SamplingConfig` (1.0, 0.0, 0.0: off); they apply to
            greedy requests too.
        seed: sampling seed, an int in ``[0, 2**32)``; token ``i`` uses ``fold_in(PRNGKey(seed), i)``.
        stop_token_ids: tokens that end the request (kept in its output).
        arrival: the engine step at which the request becomes visible.
        id: anything hashable naming the request (default: its index); the requests of one
            run must have different ids.
    """

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    arrival: int = 0
    id: Any = None


def _stops_as_tuple(request: Any) -> Any:
    """``request`` with its stop ids as a tuple, when they are some other iterable (left as
    they are when not iterable, or a sequence already, for the check's own message)."""
    stops = getattr(request, "stop_token_ids", ())
    if not isinstance(request, EngineRequest) or isinstance(stops, (list, tuple, np.ndarray, range, str, bytes)):
        return request
    try:
        return dataclasses.replace(request, stop_token_ids=tuple(stops))
    except TypeError:
        return request


@dataclasses.dataclass(frozen=True)
class EngineResult:
    """A finished request: its tokens, why it ended (``"stop"`` or ``"length"``), how many
    prompt tokens came from the prefix cache, how often it was preempted, the engine
    steps of admission, first token and last token, and the seconds from the start of the
    run to its first token."""

    id: Any
    tokens: tuple[int, ...]
    finish_reason: str
    cached_tokens: int
    preemptions: int
    admitted_step: int
    first_token_step: int
    finished_step: int
    first_token_s: float = float("nan")


class PrefixIndex:
    """Host-side index of full cache pages by the tokens they hold (and all before them).

    Key of page ``i`` of a sequence: ``sha256(key of page i-1 || page tokens)``, so equal
    keys mean equal token prefixes. Each entry pins its page in the pool; entries are
    evicted least recently used first, and only when no row holds the page. Evicting a page
    also drops the entries of the pages after it in its chains: a lookup walks a chain from
    its first page, so they could never be found again and only held pool space.
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> page, LRU order
        self._children: dict[bytes, set[bytes]] = {}  # key -> indexed keys of the pages right after it
        self._parent: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def keys_of(self, tokens: Sequence[int]) -> list[bytes]:
        """The chain keys of every full page of ``tokens``."""
        keys, parent, ps = [], b"", self.page_size
        for i in range(len(tokens) // ps):
            chunk = np.asarray(tokens[i * ps : (i + 1) * ps], np.int64).tobytes()
            parent = hashlib.sha256(parent + chunk).digest()
            keys.append(parent)
        return keys

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest indexed prefix of ``keys`` (marked recently used)."""
        pages = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            self._pages.move_to_end(key)
            pages.append(page)
        return pages

    def insert(self, key: bytes, page: int, parent: bytes | None = None) -> bool:
        """Indexes ``page`` under ``key`` (``parent``: the key of the page before it, None for a
        first page); False if the key is already there, or its parent is not (evicted while
        this page was written: no lookup could reach it), and nothing is pinned."""
        if key in self._pages:
            self._pages.move_to_end(key)
            return False
        if parent is not None and parent not in self._pages:
            return False
        self._pages[key] = page
        if parent is not None:
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)
        return True

    def evictable(self, refcount: np.ndarray) -> list[tuple[bytes, int]]:
        """Entries whose page only the index holds, least recently used first."""
        return [(k, p) for k, p in self._pages.items() if refcount[p] == 1]

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def remove(self, key: bytes) -> list[int]:
        """Drops ``key`` and every indexed page after it in its chains; returns their pages
        (``key``'s first), each of which the caller unpins."""
        pages, stack = [], [key]
        while stack:
            k = stack.pop()
            pages.append(self._pages.pop(k))
            parent = self._parent.pop(k, None)
            if parent is not None and parent in self._children:
                self._children[parent].discard(k)
            stack.extend(self._children.pop(k, ()))
        return pages


@dataclasses.dataclass
class _Running:
    index: int  # in the run's request list
    request: EngineRequest
    admitted_step: int
    prompt: list[int]  # what the row must hold before it generates (the prompt, plus tokens regenerated after preemption)
    written: int  # tokens of `prompt` in the row
    cached: int  # of them, attached from the prefix index
    keys: list[bytes]  # chain keys of the prompt's full pages
    indexed: int  # of those keys, how many this row has offered to the index


def _per_row_top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:  # [R, V], [R]
    probs = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-probs, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    # The mass before each token is the exclusive running sum: cumsum - probs rounds, and with
    # top_p equal to the top tokens' mass it kept one token more (see sampling._top_p_keep_sorted).
    running = jnp.cumsum(sorted_probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(running[:, :1]), running[:, :-1]], axis=-1)
    # the most likely token always (a top_p below float32's smallest normal is flushed to 0)
    keep_sorted = (mass_before < top_p[:, None]) | (jnp.arange(logits.shape[-1]) == 0)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    # A row without top_p (p = 1) keeps every token, as generate's filter-free path does: the
    # rounded running sum can reach 1 before the tail and would drop it.
    keep = keep | (top_p[:, None] >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def _is_real(value: Any) -> bool:
    """A real number (Python or NumPy, e.g. ``np.float32(0.5)``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _sample_rows(logits, temperature, top_p, min_p, seeds, index):  # [R, V], [R] each -> int32 [R]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = apply_temperature(logits, jnp.where(temperature > 0, temperature, 1.0)[:, None])
    filtered = _per_row_top_p(scaled, top_p)
    # min-p after top-p (HF's order); log(0) = -inf keeps every token of a row without it.
    top = jnp.max(filtered, axis=-1, keepdims=True)
    filtered = jnp.where(filtered >= top + jnp.log(min_p)[:, None], filtered, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, index)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


# Compiled once per (model structure, shapes) for every engine: engines over the same model
# and sizes share their programs. Tracing bumps the counter (compile_counts).
_TRACES: collections.Counter = collections.Counter()


@partial(jax.jit, static_argnames="graphdef", donate_argnames=("cache", "history"))
def _step_program(graphdef, state, cache, rows, tokens, num_new, sampling, history=None, emits=None):
    # Only the busy rows run: `rows` int32[N] (padding >= R) pick them out of the cache
    # without moving page data (take_rows / merge_rows share the pool).
    _TRACES[f"step{tokens.shape[0]}x{tokens.shape[1]}" + ("+history" if history is not None else "")] += 1
    temperature, top_p, min_p, seeds, index, rep, pres, freq = sampling
    sub = cache.take_rows(rows)
    logits, sub = forward(graphdef, state, tokens, sub, num_new)
    cache = cache.merge_rows(rows, sub)
    last = jnp.take_along_axis(logits, jnp.clip(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    raw = last
    if history is not None:
        mine = TokenHistory(*(jnp.take(h, rows, axis=0, mode="fill", fill_value=0) for h in history))
        last = penalise(last, mine, rep, pres, freq)  # per-row strengths: 1.0 / 0.0 / 0.0 leave a row as it was
    # a row whose logits are NaN gets NAN_TOKEN (-1), as from generate: argmax gave 0, a real id
    picked = nan_rows_as_nan_token(raw, _sample_rows(last, temperature, top_p, min_p, seeds, index))
    if history is not None:
        # The rows that emitted a token this step (not a prefill chunk short of its prompt's end).
        counts = record_tokens(mine, picked, emits).counts
        history = history._replace(counts=history.counts.at[rows].set(counts, mode="drop"))
    # One int32[2] for the host: free pages, and whether any row's write was flagged.
    status = jnp.stack([cache.free_pages, jnp.any(cache.flags != 0).astype(jnp.int32)])
    return picked, status, cache, history


@partial(jax.jit, donate_argnames="history")
def _history_admit_program(history, rows, prompts, prompt_lengths, generated, generated_lengths):
    # rows int32[N] (>= R: unused); prompts / generated int32[N, L] with their lengths [N].
    vocab = history.counts.shape[1]
    in_prompt = token_counts(prompts, prompt_lengths, vocab) > 0
    counts = token_counts(generated, generated_lengths, vocab)
    return TokenHistory(history.in_prompt.at[rows].set(in_prompt, mode="drop"),
                        history.counts.at[rows].set(counts, mode="drop"))


@partial(jax.jit, donate_argnames="cache")
def _admit_program(cache, rows, pages, num_tokens):
    # rows: int32[N] (>= R: unused); pages: int32[N, M]; empties the rows, attaches prefixes.
    cache = cache.reset(jnp.zeros((cache.batch_size,), bool).at[rows].set(True, mode="drop"))
    for i in range(rows.shape[0]):
        cache = cache.attach_prefix(rows[i], pages[i], num_tokens[i])
    return cache


@partial(jax.jit, donate_argnames="cache", static_argnames="delta")
def _pin_program(cache, pages, delta):
    return cache.retain(pages) if delta > 0 else cache.release(pages)


class PagedEngine:
    """Continuous batching over a paged cache with prefix caching (see the module doc).

    Args:
        model: an ``nnx.Module`` decoder with ``init_cache(kind="paged", ...)``
            (:class:`jaxkv.models.Llama`).
        max_rows: R, requests decoded together (rows of the cache).
        max_length: the most tokens one request may hold (prompt + generated - 1).
        num_pages: pages in the pool shared by all rows.
        page_size: tokens per page (a power of two).
        chunk_size: C, prompt tokens a row prefills per step.
        prefix_cache: index full prompt pages and reuse them across requests.
        cache_dtype: key/value dtype (default: the model's).
        bits: None for float pages, 8 or 4 for quantized pages.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``.
        ValueError: bad sizes; a pool that cannot hold one request of ``max_length``.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        max_rows: int,
        max_length: int,
        num_pages: int,
        page_size: int = 16,
        chunk_size: int = 64,
        prefix_cache: bool = True,
        cache_dtype: Any = None,
        bits: int | None = None,
    ):
        who = "PagedEngine"
        check_model(model, who)
        self.max_rows = check_positive_int(max_rows, "max_rows", who)
        self.max_length = check_positive_int(max_length, "max_length", who)
        self.num_pages = check_positive_int(num_pages, "num_pages", who)
        self.page_size = check_positive_int(page_size, "page_size", who)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size", who)
        if num_pages < -(-max_length // page_size) + 1:
            raise ValueError(
                f"{who}: num_pages={num_pages} cannot hold one request of max_length={max_length} "
                f"({-(-max_length // page_size)} pages of {page_size}) plus one page; allocate more pages."
            )
        self._vocab_size = model_vocab_size(model)
        self._graphdef, self._state = nnx.split(model)
        self._cache = model.init_cache(
            self.max_rows, self.max_length, dtype=cache_dtype, kind="paged" if bits is None else "paged-quantized",
            bits=bits, page_size=self.page_size, num_pages=self.num_pages,
        )
        self.max_pages = self._cache.max_pages
        self._buckets = sorted({min(4**i, self.max_rows) for i in range(16) if 4 ** (i - 1) < self.max_rows} | {self.max_rows})
        self.prefix = PrefixIndex(self.page_size) if prefix_cache else None
        self._traces_before = collections.Counter(_TRACES)
        self._step = partial(_step_program, self._graphdef)
        self._admit = _admit_program
        self._pin = _pin_program
        self._history: TokenHistory | None = None  # [R, V] per row, made when a request first has a penalty
        self.stats: dict[str, float] = {}
        self._open: object | None = None  # the run or stream now using the cache's rows

    @property
    def compile_counts(self) -> dict[str, int]:
        """Step programs traced (compiled, by this or any engine) since this one was built, by shape
        ``"step<rows>x<tokens>"`` (rows: a bucket of busy rows, 1, 4, 16, ... up to R;
        tokens: 1 for decode, C with a prefill); an engine over the same model and sizes as
        an earlier one reuses its programs."""
        return {k: v - self._traces_before[k] for k, v in _TRACES.items() if v - self._traces_before[k]}

    # ---- checks

    def _check(self, request: EngineRequest, index: int, who: str) -> None:
        if not isinstance(request, EngineRequest):  # a (prompt, n) tuple or a dict: AttributeError before
            raise TypeError(f"{who}: request {index} must be an EngineRequest(prompt, max_new_tokens, ...), "
                            f"got {type(request).__name__}")
        check_request(request.prompt, request.max_new_tokens, request.arrival, self.max_length, self._vocab_size,
                      who, index, f"request {index}")
        t = request.temperature
        if not (_is_real(t) and np.isfinite(t) and t >= 0):
            raise ValueError(f"{who}: request {index} temperature must be a finite number >= 0 (0 is greedy), "
                             f"got {t!r}")
        p = request.top_p
        if p is not None and not (_is_real(p) and 0 < p <= 1):
            raise ValueError(f"{who}: request {index} top_p must be a number in (0, 1] or None, got {p!r}")
        seed = request.seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"{who}: request {index} seed must be an int (e.g. seed=0), got {seed!r} of type "
                            f"{type(seed).__name__}; a non-integral seed would be truncated")
        if not 0 <= seed < 2**32:  # seeds are uint32 on the device: a wider one would wrap onto another
            raise ValueError(f"{who}: request {index} seed must be in [0, 2**32), got {seed}")
        try:  # SamplingConfig's own checks and messages (a temperature past float32's range: review 76)
            SamplingConfig(temperature=t, top_p=p, min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                           presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{who}: request {index} {e}") from None
        if _has_penalty(request) and self._vocab_size is None:
            raise ValueError(f"{who}: request {index} has a penalty, which needs the vocabulary size; the model has "
                             "no config.vocab_size")
        try:
            stops = list(request.stop_token_ids)
        except TypeError:
            raise TypeError(f"{who}: request {index} stop_token_ids must be a sequence of token ids (e.g. (2,)), got "
                            f"{request.stop_token_ids!r}") from None
        check_integer_ids(stops, who, f"request {index} stop_token_ids")
        check_token_ids(list(request.stop_token_ids), self._vocab_size, who, name=f"requests[{index}].stop_token_ids")

    # ---- the loop

    def run(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """Serves ``requests`` to completion; results in request order (see :meth:`stream`)."""
        requests = list(requests)  # a generator would be used up before the results are ordered
        results: dict[int, EngineResult] = {}
        for event in self._serve(requests):
            if isinstance(event, _Done):
                results[event.index] = event.result
        return [results[i] for i in range(len(requests))]

    def stream(self, requests: Sequence[EngineRequest]) -> Iterator[tuple[Any, int]]:
        """Serves ``requests``, yielding ``(request id, token)`` as each token is produced.

        One run or stream uses the engine's rows at a time: starting another while a stream
        is still open (neither iterated to its end nor closed) raises RuntimeError. Close a
        stream left part-way (``stream.close()``, or leave the ``for`` loop and drop it).
        """
        for event in self._serve(requests):
            if isinstance(event, tuple):
                yield event

    def _serve(self, requests: Sequence[EngineRequest]):
        # One run or stream at a time: each keeps its own row bookkeeping over the one cache,
        # and emptying the rows at its start or end would empty another's mid-run (it then
        # decoded from emptied rows: wrong tokens, no error).
        if self._open is not None:
            raise RuntimeError(
                "PagedEngine: another run or stream of this engine is still open (a stream neither iterated to its "
                "end nor closed) and uses its rows. Finish it or close it (stream.close()) first, or use a second "
                "engine."
            )
        self._open = token = object()
        # A stream abandoned part-way (a break out of stream(), an exception) leaves rows
        # holding pages: they are emptied when it is closed, and at the start of every run.
        try:
            self._empty_rows()
            yield from self._serve_steps(requests)
        finally:
            if self._open is token:
                self._open = None
                if not sys.is_finalizing():  # a stream still open at interpreter exit: nothing to free
                    self._empty_rows()

    def _empty_rows(self) -> None:
        held = np.flatnonzero((np.asarray(self._cache.block_table) >= 0).any(axis=1)
                              | (np.asarray(self._cache.lengths) > 0).any(axis=0)
                              | (np.asarray(self._cache.flags) != 0))
        if held.size:
            self._cache = self._admit(self._cache, *self._admission_arrays([(int(r), [], 0) for r in held]))

    def _serve_steps(self, requests: Sequence[EngineRequest]):
        who = "PagedEngine.run"
        # Stop ids are read at every step: a one-shot iterable (a generator, iter([...]))
        # would be used up by the check below and then never match. Taken once, as a tuple.
        requests = [_stops_as_tuple(r) for r in requests]
        for index, request in enumerate(requests):
            self._check(request, index, who)
        ids = [i if r.id is None else r.id for i, r in enumerate(requests)]
        _check_unique_ids(ids, requests, who)
        pending = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
        waiting: collections.deque[int] = collections.deque()
        rows: list[_Running | None] = [None] * self.max_rows
        generated: dict[int, list[int]] = {i: [] for i in range(len(requests))}
        preempted = collections.Counter()
        first_step: dict[int, int] = {}
        first_time: dict[int, float] = {}
        cached_of: dict[int, int] = {}
        admitted_at: dict[int, int] = {}
        # chain keys rows are writing now, with how many rows write each (two rows of one
        # prompt that ends on a page boundary both write its last page)
        in_flight: collections.Counter[bytes] = collections.Counter()
        finished = 0
        step = 0
        free = self._cache.free_pages
        ps, c, r_rows = self.page_size, self.chunk_size, self.max_rows
        row_len = [0] * r_rows  # tokens each row holds (host mirror of the cache's lengths)
        counters = collections.Counter({
            k: 0 for k in ("preemptions", "evicted_pages", "cached_tokens", "prefill_tokens", "forward_tokens",
                           "forward_calls", "peak_rows", "row_steps", "backlog_steps", "backlog_row_steps")
        })
        start = time.perf_counter()

        def pages_for(n: int) -> int:
            return -(-n // ps)

        def evict(wanted: int, keep: set[int] | frozenset[int] = frozenset()) -> int:
            """Unpins least recently used index pages until ``wanted`` are free; returns free.

            Pages in ``keep`` stay: prefix hits of requests being admitted, which no row holds
            yet (their refcount is the index's 1). Evicting one would count it as free although
            the admitted row takes it over, and drop its entry from the index.
            """
            nonlocal free
            if self.prefix is None or free >= wanted:
                return free
            refcount = np.asarray(self._cache.refcount)
            drop, freed = [], 0
            for key, page in self.prefix.evictable(refcount):
                if free + freed >= wanted:
                    break
                if page in keep or key not in self.prefix:  # kept, or dropped with a page before it
                    continue
                # the pages after it in its chains go too (unreachable); those a row still
                # holds stay allocated to it, only the index's pin is dropped
                dropped = self.prefix.remove(key)
                drop += dropped
                freed += sum(int(refcount[p]) == 1 for p in dropped)
            if drop:
                self._cache = self._pin(self._cache, self._pad_pages(drop), delta=-1)
                free += freed
                counters["evicted_pages"] += freed
            return free

        def release_row(row: int) -> None:
            nonlocal free
            run = rows[row]
            for key in run.keys[run.indexed:]:
                _done_writing(in_flight, key)
            rows[row] = None
            self._cache = self._admit(self._cache, *self._admission_arrays([(row, [], 0)]))
            free = self._cache.free_pages
            row_len[row] = 0

        # The figures of a stream closed part-way too (they kept the previous run's).
        try:
            while finished < len(requests):
                while pending and requests[pending[0]].arrival <= step:
                    waiting.append(pending.pop(0))

                # ---- admission: rows and pages permitting, in order; wait for in-flight prefixes
                admitted, deferred = [], collections.deque()
                hits_admitted: set[int] = set()  # pages this round attaches: not evictable before _admit
                while waiting and None in rows:
                    i = waiting.popleft()
                    request = requests[i]
                    prompt = list(request.prompt) + generated[i]
                    # Every full page of the prompt is offered to the index once written, but the
                    # lookup keeps the last token out: its logits start generation, so a prompt
                    # that ends on a page boundary recomputes that page (an extension reuses it).
                    keys = self.prefix.keys_of(prompt) if self.prefix is not None else []
                    usable = min(len(keys), (len(prompt) - 1) // ps)
                    hit = self.prefix.lookup(keys[:usable]) if self.prefix is not None else []
                    if len(hit) < usable and keys[len(hit)] in in_flight:
                        deferred.append(i)  # another row is writing that page: reuse it next step
                        continue
                    need = pages_for(len(prompt) + 1) - len(hit)
                    # Pages the running prefills will still take are spoken for.
                    reserved = sum(
                        pages_for(len(run.prompt) + 1) - pages_for(row_len[j])
                        for j, run in enumerate(rows) if run is not None and run.written < len(run.prompt)
                    )
                    if evict(need + reserved, keep=hits_admitted | set(hit)) < need + reserved:
                        waiting.appendleft(i)
                        break
                    hits_admitted.update(hit)
                    row = rows.index(None)
                    rows[row] = _Running(i, request, step, prompt, len(hit) * ps, len(hit) * ps, keys, len(hit))
                    admitted.append((row, hit, len(hit) * ps))
                    admitted_at.setdefault(i, step)
                    cached_of.setdefault(i, len(hit) * ps)
                    row_len[row] = len(hit) * ps
                    for key in keys[len(hit):]:
                        in_flight[key] += 1
                waiting.extendleft(reversed(deferred))
                if admitted:
                    self._cache = self._admit(self._cache, *self._admission_arrays(admitted))
                    self._admit_histories([(row, rows[row].request, generated[rows[row].index]) for row, _, _ in admitted])
                    for row, _, n in admitted:
                        row_len[row] = n
                    free = self._cache.free_pages
                    counters["cached_tokens"] += sum(n for _, _, n in admitted)

                active = [row for row in range(r_rows) if rows[row] is not None]
                if not active:
                    if waiting:  # nothing runs, so nothing will free a page: waiting would never end
                        raise RuntimeError(
                            f"{who}: request {waiting[0]} cannot be admitted although no row is running: only "
                            f"{free} of {self._cache.num_pages} pages are free and no index page can be evicted. "
                            "Release pages pinned outside the engine's index, or build the engine with more pages."
                        )
                    if not pending:
                        break
                    step = max(step + 1, int(requests[pending[0]].arrival))  # idle: jump to the next arrival
                    continue

                # ---- what each row brings this step
                prefilling = any(rows[row].written < len(rows[row].prompt) for row in active)
                width = c if prefilling else 1
                take = {}
                for row in active:
                    run = rows[row]
                    left = len(run.prompt) - run.written
                    take[row] = min(left, width) if left > 0 else 1
                # Pages this step will take; preempt the youngest until they fit.
                while True:
                    need = sum(pages_for(row_len[row] + take[row]) - pages_for(row_len[row]) for row in take)
                    if evict(need) >= need:
                        break
                    if len(take) == 1:
                        # One row left and still no page for it: only pages pinned outside the
                        # index can do this (the pool holds one whole request). Writing on would
                        # drop its tokens (out_of_pages) and sample from what is not there.
                        (row,) = take
                        raise RuntimeError(
                            f"{who}: request {rows[row].index} needs {need} more page(s) to go on with no other "
                            f"row running, but only {free} of {self._cache.num_pages} pages are free and no "
                            "index page can be evicted. Release pages pinned outside the engine's index, or "
                            "build the engine with more pages."
                        )
                    victim = max(take, key=lambda row: (rows[row].admitted_step, row))
                    i = rows[victim].index
                    preempted[i] += 1
                    counters["preemptions"] += 1
                    release_row(victim)
                    waiting.appendleft(i)
                    del take[victim]
                    active.remove(victim)

                counters["peak_rows"] = max(counters["peak_rows"], len(take))  # requests in this step
                counters["row_steps"] += len(take)
                if waiting:  # requests wait for rows or pages: the pool is the limit now
                    counters["backlog_steps"] += 1
                    counters["backlog_row_steps"] += len(take)
                # The busy rows, padded to a bucket (1, 4, 16, ... up to R rows): a handful of
                # compiled programs, and a step costs what its rows need, not all R.
                busy = sorted(take)
                n = next(b for b in self._buckets if b >= len(busy))
                row_ids = np.full((n,), r_rows, np.int32)
                tokens = np.zeros((n, width), np.int32)
                num_new = np.zeros((n,), np.int32)
                temperature = np.zeros((n,), np.float32)
                top_p = np.ones((n,), np.float32)
                min_p = np.zeros((n,), np.float32)
                seeds = np.zeros((n,), np.uint32)
                index = np.zeros((n,), np.int32)
                rep = np.ones((n,), np.float32)
                pres = np.zeros((n,), np.float32)
                freq = np.zeros((n,), np.float32)
                emits = np.zeros((n,), bool)
                slot_of = {}
                for j, row in enumerate(busy):
                    k = take[row]
                    slot_of[row] = j
                    run = rows[row]
                    req = run.request
                    row_ids[j] = row
                    if run.written < len(run.prompt):
                        tokens[j, :k] = run.prompt[run.written : run.written + k]
                    else:
                        tokens[j, 0] = generated[run.index][-1]
                    num_new[j] = k
                    temperature[j] = req.temperature
                    top_p[j] = 1.0 if req.top_p is None else req.top_p
                    min_p[j] = req.min_p or 0.0
                    seeds[j] = np.uint32(int(req.seed))  # checked: in [0, 2**32)
                    index[j] = len(generated[run.index])
                    rep[j], pres[j], freq[j] = req.repetition_penalty, req.presence_penalty, req.frequency_penalty
                    emits[j] = run.written + k >= len(run.prompt)
                sampling = (temperature, top_p, min_p, seeds, index, rep, pres, freq)
                if any(_has_penalty(rows[row].request) for row in busy):
                    sampled, status, self._cache, self._history = self._step(
                        self._state, self._cache, row_ids, tokens, num_new, sampling, self._history, emits
                    )
                else:
                    sampled, status, self._cache, _ = self._step(
                        self._state, self._cache, row_ids, tokens, num_new, sampling
                    )
                sampled = np.asarray(sampled)
                free, flagged = (int(v) for v in np.asarray(status))
                if flagged:
                    # A dropped or misplaced write (the page accounting above should make this
                    # impossible): an error naming the rows, never tokens sampled from it.
                    self._cache.check()
                counters["forward_tokens"] += int(num_new.sum())
                counters["forward_calls"] += 1

                for row, k in take.items():
                    run = rows[row]
                    row_len[row] += k
                    i = run.index
                    if run.written < len(run.prompt):
                        run.written += k
                        counters["prefill_tokens"] += k
                        self._offer_pages(run, row, in_flight)
                        if run.written < len(run.prompt):
                            continue  # more prompt to go
                    # A token: the first after the prompt, or the next one.
                    token = int(sampled[slot_of[row]])
                    generated[i].append(token)
                    first_step.setdefault(i, step)
                    first_time.setdefault(i, time.perf_counter() - start)
                    yield (ids[i], token)
                    reason = None
                    if token in run.request.stop_token_ids:
                        reason = "stop"
                    elif len(generated[i]) >= run.request.max_new_tokens:
                        reason = "length"
                    if reason is not None:
                        result = EngineResult(
                            ids[i], tuple(generated[i]), reason, cached_of[i], preempted[i], admitted_at[i],
                            first_step[i], step, first_time[i],
                        )
                        release_row(row)
                        finished += 1
                        yield _Done(i, result)
                step += 1
        finally:
            wall = time.perf_counter() - start
            total = sum(len(g) for g in generated.values())
            self.stats = dict(
                steps=step, wall_s=wall, generated_tokens=total,
                tokens_per_s=total / wall if wall > 0 else float("inf"), **counters,
            )

    # ---- helpers

    def _offer_pages(self, run: _Running, row: int, in_flight: collections.Counter) -> None:
        """Indexes the prompt pages this row has completed (pinning them)."""
        if self.prefix is None:
            return
        full = min(run.written // self.page_size, len(run.keys))
        if full <= run.indexed:
            return
        table = np.asarray(self._cache.block_table[row])
        pin = []
        for j in range(run.indexed, full):
            _done_writing(in_flight, run.keys[j])
            if self.prefix.insert(run.keys[j], int(table[j]), run.keys[j - 1] if j else None):
                pin.append(int(table[j]))
        run.indexed = full
        if pin:
            self._cache = self._pin(self._cache, self._pad_pages(pin), delta=1)

    def _admit_histories(self, admitted: list[tuple[int, EngineRequest, list[int]]]) -> None:
        """Fills the history rows of admitted requests that have a penalty: their prompt, and
        as generated the tokens they produced before a preemption (fed again as prompt)."""
        admitted = [item for item in admitted if _has_penalty(item[1])]
        if not admitted:
            return
        n, width = self.max_rows, self.max_length
        if self._history is None:
            self._history = TokenHistory(jnp.zeros((n, self._vocab_size), bool),
                                         jnp.zeros((n, self._vocab_size), jnp.int32))
        rows = np.full((n,), n, np.int32)
        prompts, generated = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)
        prompt_lengths, generated_lengths = np.zeros((n,), np.int32), np.zeros((n,), np.int32)
        for j, (row, request, tokens) in enumerate(admitted):
            rows[j] = row
            prompt_lengths[j], generated_lengths[j] = len(request.prompt), len(tokens)
            prompts[j, : len(request.prompt)] = request.prompt
            generated[j, : len(tokens)] = tokens
        self._history = _history_admit_program(self._history, rows, prompts, prompt_lengths, generated,
                                               generated_lengths)

    def _pad_pages(self, pages: list[int]) -> jax.Array:
        # A few fixed sizes so pinning compiles a handful of programs, not one per count.
        size = max(8, 1 << (len(pages) - 1).bit_length())
        return jnp.asarray(pages + [NO_PAGE] * (size - len(pages)), jnp.int32)

    def _admission_arrays(self, admitted: list[tuple[int, list[int], int]]):
        n = self.max_rows  # one program: every admission is padded to R entries
        rows = np.full((n,), self.max_rows, np.int32)
        pages = np.full((n, self.max_pages), NO_PAGE, np.int32)
        num_tokens = np.zeros((n,), np.int32)
        for j, (row, hit, count) in enumerate(admitted):
            rows[j], num_tokens[j] = row, count
            pages[j, : len(hit)] = hit
        return jnp.asarray(rows), jnp.asarray(pages), jnp.asarray(num_tokens)


def _done_writing(in_flight: collections.Counter, key: bytes) -> None:
    """One row less writes ``key``'s page; the key leaves when none does."""
    in_flight[key] -= 1
    if in_flight[key] <= 0:
        del in_flight[key]


def _check_unique_ids(ids: list, requests: Sequence[EngineRequest], who: str) -> None:
    """stream() yields (id, token): two requests of one id could not be told apart."""
    first: dict = {}
    for index, rid in enumerate(ids):
        try:
            seen = first.setdefault(rid, index)
        except TypeError:
            raise TypeError(f"{who}: request {index} id must be hashable, got {rid!r} of type "
                            f"{type(rid).__name__}") from None
        if seen != index:
            named = "" if requests[seen].id is not None else f" (request {seen} has no id: its id is its index)"
            raise ValueError(f"{who}: requests {seen} and {index} have the same id {rid!r}{named}; streamed tokens "
                             "are tagged by id, so each request needs its own (or leave every id None)")


def _has_penalty(request: EngineRequest) -> bool:
    return request.repetition_penalty != 1.0 or request.presence_penalty != 0.0 or request.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True)
class _Done:
    index: int
    result: EngineResult

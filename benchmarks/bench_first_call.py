"""First calls: what a new shape costs before it runs, and whether the cheaper build runs slower.

Two changes, each measured against the code it replaced, side by side in this one run:

1. Prefill through the XLA blockwise loop (chunks of more than 16 queries; on CPU shorter
   ones go to the native kernel). The loop read the last, partly filled block at the
   smallest of four sizes that holds it (block, /2, /4, /8), each size a loop body of its
   own; chunks of more than ``PARTIAL_BLOCK_MAX_QUERIES`` queries now read it whole, as the
   last trip of the masked-block loop. ``before`` sets that threshold above the chunk, which
   brings the four sizes back (the merged full-size loop and the skipped window-only loop
   stay: they compute the same blocks in the same order). For a forward of L layers over a
   StaticCache and a PagedCache: the program's compile time and its median run time.
2. Eager ops on a new shape, StaticCache and PagedCache: ``update``, ``crop(-1)`` and a
   fork (``batch_repeat_interleave(2)``). They ran op by op (some 40 small programs to
   compile on an update's first call, ~150 for a page pool) and now run as one jitted
   program each. ``before`` turns the jit off (``KVCache.EAGER_PROGRAMS`` and the
   pool's write program), the same code op by op. First call, then the median of later ones.

    python benchmarks/bench_first_call.py [--layers 6] [--repeats 20] [--json benchmarks/results/first_call.json]

On CPU, on a shared machine: read the before/now ratios of one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, print_table, time_calls, write_json
from jaxkv import KVCache, PagedCache, StaticCache
from jaxkv.attention import blockwise, cache_attention
from jaxkv.caches import paged

# The embedded model's attention shape (6 query heads, 2 kv heads of 32).
HEADS, KV_HEADS, HEAD_DIM, BATCH, CAPACITY = 6, 2, 32, 4, 512


def make_cache(kind: str, layers: int):
    if kind == "paged":
        return PagedCache.init(num_layers=layers, batch_size=BATCH, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               max_length=CAPACITY, page_size=16)
    return StaticCache.init(num_layers=layers, batch_size=BATCH, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                            max_length=CAPACITY)


def prefill_program(layers: int, chunk: int, fill: int):
    """A forward's attention part: every layer writes ``chunk`` tokens and attends over its
    cache, after ``fill`` tokens already there (so the last block is partly filled)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((BATCH, HEADS, chunk, HEAD_DIM), np.float32))
    k = jnp.asarray(rng.standard_normal((BATCH, KV_HEADS, chunk, HEAD_DIM), np.float32))
    pos = jnp.broadcast_to(fill + jnp.arange(chunk, dtype=jnp.int32), (BATCH, chunk))

    def forward(cache, q, k):
        out = jnp.zeros_like(q)
        for layer in range(layers):
            o, cache = cache_attention(q, k, k, cache, layer, positions=pos)
            out = out + o
        return out, cache

    return forward, q, k


def measure_prefill(kind: str, layers: int, chunk: int, repeats: int, partial_sizes: bool) -> dict:
    saved = blockwise.PARTIAL_BLOCK_MAX_QUERIES
    blockwise.PARTIAL_BLOCK_MAX_QUERIES = 1 << 30 if partial_sizes else saved
    try:
        fill = 40  # a prefix of 40 tokens, then the chunk: its end is inside a block
        cache = make_cache(kind, layers)
        filler = jnp.zeros((BATCH, KV_HEADS, fill, HEAD_DIM), jnp.float32)
        for layer in range(layers):
            cache = cache.update(filler, filler, layer)[0]
        forward, q, k = prefill_program(layers, chunk, fill)
        start = time.perf_counter()
        compiled = jax.jit(forward).lower(cache, q, k).compile()
        compile_s = time.perf_counter() - start
        out = compiled(cache, q, k)
        run_ms = 1e3 * time_calls(lambda: jax.block_until_ready(compiled(cache, q, k)), repeats=repeats)
        return {"compile_s": compile_s, "run_ms": run_ms, "out": np.asarray(out[0])}
    finally:
        blockwise.PARTIAL_BLOCK_MAX_QUERIES = saved


def measure_eager_update(kind: str, layers: int, repeats: int, jitted: bool, batch: int) -> dict:
    """First eager update of a fresh shape (``batch`` rows), then the median of repeats.
    ``jitted`` False restores the op-by-op path: the container's own ops
    (``KVCache.EAGER_PROGRAMS``) and the page pool's write."""
    saved = paged._write_program, KVCache.EAGER_PROGRAMS
    if not jitted:
        paged._write_program = lambda store, *args: store._write(*args)
        KVCache.EAGER_PROGRAMS = False
    try:
        cache = (PagedCache.init(num_layers=layers, batch_size=batch, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                 max_length=CAPACITY, page_size=16) if kind == "paged" else
                 StaticCache.init(num_layers=layers, batch_size=batch, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  max_length=CAPACITY))
        k = jnp.ones((batch, KV_HEADS, 3, HEAD_DIM), jnp.float32)
        ops = {
            "update": lambda c: c.update(k, k, 0)[1],
            "crop": lambda c: c.crop(-1).lengths,
            "fork": lambda c: c.batch_repeat_interleave(2).lengths,
        }
        out = {}
        for name, op in ops.items():
            start = time.perf_counter()
            jax.block_until_ready(op(cache))
            out[f"{name}_first_s"] = time.perf_counter() - start
            out[f"{name}_again_ms"] = 1e3 * time_calls(lambda: jax.block_until_ready(op(cache)), repeats=repeats)
            if name == "update":
                cache = cache.update(k, k, 0)[0]
        return out
    finally:
        paged._write_program, KVCache.EAGER_PROGRAMS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--chunks", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="benchmarks/results/first_call.json")
    args = parser.parse_args()

    rows, results = [], {"machine": machine(), "layers": args.layers, "prefill": [], "eager_update": []}
    for kind in ("static", "paged"):
        for chunk in args.chunks:
            before = measure_prefill(kind, args.layers, chunk, args.repeats, partial_sizes=True)
            now = measure_prefill(kind, args.layers, chunk, args.repeats, partial_sizes=False)
            same = bool(np.array_equal(before.pop("out"), now.pop("out")))
            results["prefill"].append({"kind": kind, "chunk": chunk, "before": before, "now": now, "identical": same})
            rows.append([kind, chunk, f"{before['compile_s']:.2f}", f"{now['compile_s']:.2f}",
                         f"{now['compile_s'] / before['compile_s']:.2f}x", f"{before['run_ms']:.2f}",
                         f"{now['run_ms']:.2f}", f"{now['run_ms'] / before['run_ms']:.2f}x", same])
    print(f"Prefill attention, {args.layers} layers, batch {BATCH}, {CAPACITY} slots, 40 tokens then the chunk "
          "(before: the last block at 4 sizes; now: whole)")
    print_table(["cache", "chunk", "compile before s", "compile now s", "ratio", "run before ms", "run now ms",
                 "ratio", "identical"], rows)

    rows = []
    for kind in ("static", "paged"):
        for i, batch in enumerate((3, 5)):  # a fresh shape each time, in both orders
            order = (False, True) if i == 0 else (True, False)
            got = {jitted: measure_eager_update(kind, args.layers, args.repeats, jitted, batch) for jitted in order}
            before, now = got[False], got[True]
            results["eager_update"].append({"kind": kind, "batch": batch, "first": "before" if i == 0 else "now",
                                            "before": before, "now": now})
            for op in ("update", "crop", "fork"):
                b1, n1 = before[f"{op}_first_s"], now[f"{op}_first_s"]
                b2, n2 = before[f"{op}_again_ms"], now[f"{op}_again_ms"]
                rows.append([kind, batch, "before" if i == 0 else "now", op, f"{b1:.2f}", f"{n1:.2f}", f"{n1 / b1:.2f}x",
                             f"{b2:.2f}", f"{n2:.2f}", f"{n2 / b2:.2f}x"])
    print("\nEager ops on a fresh shape (before: op by op; now: one jitted program)")
    print_table(["cache", "rows", "ran first", "op", "first call before s", "first call now s", "ratio",
                 "later before ms", "later now ms", "ratio"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()

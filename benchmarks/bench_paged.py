"""PagedCache benchmarks (issue 15), one section per goal; ``--sections`` picks some.

* ``attention`` (goal (c)): decode attention over a paged cache within 1.2x of a contiguous
  one at the same fill, on CPU. For each fill and dtype, a jitted, donated two-layer decode
  step (write one token per row, then attend; layer 1's key/value come from layer 0's
  output, as in a decoder) over a ``StaticCache`` and over a ``PagedCache`` (pages of 16
  tokens, shuffled in the pool so that reads are not accidentally contiguous, pool sized to
  the tokens held), timed side by side in alternating rounds of this one run; each figure
  is the best round's median. Each step rolls its token back (``crop(-1)``), so every call
  sees the same fill. The same table has attention alone (the kernel over each view, no
  write), which isolates the reading from the storage's write.

    python benchmarks/bench_paged.py [--sections attention] [--fills 1024 8192 32768]
        [--dtypes float32 bfloat16] [--repeats 10] [--rounds 3] [--json benchmarks/results/paged.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, print_table, time_calls, write_json
from jaxkv import PagedCache, StaticCache
from jaxkv.attention import attend_view, cache_attention

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE_SIZE = 2, 1, 8, 16, 128, 16


def shuffled_pages(cache: PagedCache, seed: int = 0) -> PagedCache:
    """The same cache with its pages moved to a random permutation of the pool's ids (the
    data, the block table and the counts together): a row's pages are then scattered over
    the pool, as after a while of serving, instead of the allocator's ascending run."""
    store = cache.stores[0]
    perm = np.random.default_rng(seed).permutation(store.num_pages)
    inverse = np.argsort(perm)  # page at new id j was at old id inverse[j]
    pools = {f: getattr(store, f)[:, inverse] for f in ("keys", "values", "key_scales", "value_scales")}
    table = jnp.where(store.block_table >= 0, jnp.asarray(perm, jnp.int32)[jnp.maximum(store.block_table, 0)], -1)
    store = dataclasses.replace(store, **pools, block_table=table, refcount=store.refcount[inverse])
    return dataclasses.replace(cache, stores=(store,))


def make_cache(kind: str, fill: int, dtype) -> StaticCache | PagedCache:
    sizes = dict(num_layers=LAYERS, batch_size=BATCH, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
    capacity = fill + 8 * PAGE_SIZE
    if kind == "static":
        cache = StaticCache.init(max_length=capacity, **sizes)
    else:  # the pool holds the tokens plus a few pages: what a serving pool would hold for them
        cache = PagedCache.init(max_length=capacity, page_size=PAGE_SIZE, num_pages=BATCH * (fill // PAGE_SIZE + 8),
                                **sizes)

    def prefill(cache, k):
        for layer in range(LAYERS):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    k = jax.random.normal(jax.random.key(0), (BATCH, KV_HEADS, fill, HEAD_DIM), jnp.float32)
    cache = jax.jit(prefill, donate_argnums=0)(cache, k)
    return shuffled_pages(cache) if kind == "paged" else cache


def decode_step():
    def step(cache, x):  # x: [B, Hq, 1, D]
        positions = cache.positions(1)
        for layer in range(LAYERS):
            kv = x[:, :KV_HEADS] * 0.5  # this layer's new key/value, from the previous layer's output
            x, cache = cache_attention(x, kv, kv, cache, layer, positions=positions)
        return cache.crop(-1), x

    return jax.jit(step, donate_argnums=0)


def attention_only():
    def attend_all(cache, x):  # every layer's attention over the cache as it is, no write
        positions = cache.positions(1) - 1
        out = x
        for layer in range(LAYERS):
            out = out + attend_view(x, cache.view(layer), q_positions=positions)
        return out

    return jax.jit(attend_all)


def attention_table(args) -> dict:
    """Section "attention": paged / contiguous decode-step and attention times."""
    x = jax.random.normal(jax.random.key(1), (BATCH, Q_HEADS, 1, HEAD_DIM), jnp.float32)
    results, rows = {}, []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        for fill in args.fills:
            states = {kind: {"cache": make_cache(kind, fill, dtype)} for kind in ("static", "paged")}
            steps, attends = decode_step(), attention_only()
            best = {(kind, what): float("inf") for kind in states for what in ("step", "attention")}
            for _ in range(args.rounds):
                for kind, state in states.items():

                    def step_call(state=state):
                        state["cache"], out = steps(state["cache"], x)
                        out.block_until_ready()

                    def attend_call(state=state):
                        attends(state["cache"], x).block_until_ready()

                    best[kind, "step"] = min(best[kind, "step"], time_calls(step_call, repeats=args.repeats))
                    best[kind, "attention"] = min(best[kind, "attention"], time_calls(attend_call, repeats=args.repeats))
            entry = {f"{kind}_{what}_ms": t * 1e3 for (kind, what), t in best.items()}
            entry["step_ratio"] = best["paged", "step"] / best["static", "step"]
            entry["attention_ratio"] = best["paged", "attention"] / best["static", "attention"]
            results[f"{dtype_name} {fill}"] = entry
            rows.append([dtype_name, fill, f"{entry['static_step_ms']:.3f}", f"{entry['paged_step_ms']:.3f}",
                         f"{entry['step_ratio']:.2f}x", f"{entry['static_attention_ms']:.3f}",
                         f"{entry['paged_attention_ms']:.3f}", f"{entry['attention_ratio']:.2f}x"])
            print(f"  {dtype_name} {fill}: step {entry['step_ratio']:.2f}x, attention {entry['attention_ratio']:.2f}x",
                  flush=True)
    print(
        f"\ndecode, {LAYERS} chained layers, batch {BATCH}, {KV_HEADS} kv / {Q_HEADS} query heads, head_dim "
        f"{HEAD_DIM}, pages of {PAGE_SIZE} shuffled in the pool, jitted ({jax.default_backend()}); step: write + "
        "attend, donated; attention: both layers' attention alone. Goal (c): paged / contiguous <= 1.2x."
    )
    print_table(
        ["dtype", "fill", "static step ms", "paged step ms", "paged / static", "static attn ms", "paged attn ms",
         "paged / static"],
        rows,
    )
    return results


SECTIONS = {"attention": attention_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--fills", type=int, nargs="*", default=[1024, 8192, 32768])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/paged.json")
    args = parser.parse_args()
    results = {name: SECTIONS[name](args) for name in args.sections}
    write_json(args.json, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()

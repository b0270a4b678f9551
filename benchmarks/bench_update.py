"""Update cost against capacity: DynamicCache (concatenation) vs StaticCache donated / not.

One decode step = one new token written into every layer. For each capacity C the static
caches hold C/2 tokens and the dynamic cache holds C/2 tokens (it has no capacity: its cost
grows with what it stores). All timings come from this one run; read the ratios.

    python benchmarks/bench_update.py [--max-capacity 131072] [--json benchmarks/results/update.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp

from common import machine, print_table, time_calls, write_json
from jaxkv import DynamicCache, StaticCache

LAYERS, BATCH, HEADS, HEAD_DIM = 2, 1, 4, 64


def step(cache, k, v):
    for layer in range(LAYERS):
        cache, _, _ = cache.update(k, v, layer)
    return cache


def bench_static(capacity: int, donate: bool, repeats: int) -> float:
    cache = StaticCache.init(
        num_layers=LAYERS, batch_size=BATCH, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_length=capacity
    )
    cache = cache.crop(0)
    fill = jnp.zeros((BATCH, HEADS, capacity // 2, HEAD_DIM))
    cache = jax.jit(step, donate_argnums=0)(cache, fill, fill)
    k = jnp.ones((BATCH, HEADS, 1, HEAD_DIM))
    if donate:
        fn = jax.jit(step, donate_argnums=0)
        state = {"cache": cache}

        def run():
            state["cache"] = fn(state["cache"], k, k)
            state["cache"].lengths.block_until_ready()

    else:
        fn = jax.jit(step)

        def run():
            fn(cache, k, k).keys.block_until_ready()

    return time_calls(run, repeats=repeats)


def bench_dynamic(capacity: int, repeats: int) -> float:
    fill = jnp.zeros((BATCH, HEADS, capacity // 2, HEAD_DIM))
    cache = DynamicCache()
    for layer in range(LAYERS):
        cache, _, _ = cache.update(fill, fill, layer)
    k = jnp.ones((BATCH, HEADS, 1, HEAD_DIM))
    fn = jax.jit(step)
    return time_calls(lambda: fn(cache, k, k).layers[-1][0].block_until_ready(), repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-capacity", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default="benchmarks/results/update.json")
    args = parser.parse_args()

    capacities = []
    c = 1024
    while c <= args.max_capacity:
        capacities.append(c)
        c *= 4 if c < args.max_capacity // 2 else 2
    results = []
    for capacity in capacities:
        row = {
            "capacity": capacity,
            "cache_mb": 2 * LAYERS * BATCH * HEADS * HEAD_DIM * capacity * 4 / 2**20,
            "dynamic_us": bench_dynamic(capacity, args.repeats) * 1e6,
            "static_donated_us": bench_static(capacity, True, args.repeats * 10) * 1e6,
            "static_copied_us": bench_static(capacity, False, args.repeats) * 1e6,
        }
        results.append(row)
        print(f"capacity {capacity}: done", flush=True)

    base = results[0]
    rows = [
        [
            r["capacity"],
            f"{r['cache_mb']:.1f}",
            f"{r['dynamic_us']:.0f}",
            f"{r['static_copied_us']:.0f}",
            f"{r['static_donated_us']:.0f}",
            f"{r['static_donated_us'] / base['static_donated_us']:.2f}x",
            f"{r['static_copied_us'] / r['static_donated_us']:.0f}x",
            f"{r['dynamic_us'] / r['static_donated_us']:.0f}x",
        ]
        for r in results
    ]
    print(
        f"\nOne decode-step update ({LAYERS} layers, batch {BATCH}, {HEADS} kv heads, head_dim "
        f"{HEAD_DIM}, float32; dynamic/static hold capacity/2 tokens); median of {args.repeats} calls ({args.repeats * 10} donated)."
    )
    print_table(
        [
            "capacity",
            "cache MB",
            "dynamic us",
            "static copied us",
            "static donated us",
            "donated vs 1K",
            "copied/donated",
            "dynamic/donated",
        ],
        rows,
    )
    ratio = results[-1]["static_donated_us"] / base["static_donated_us"]
    verdict = "met" if ratio <= 1.2 else "NOT met"
    print(f"\ngoal: donated StaticCache at {results[-1]['capacity']} within 1.2x of 1024: {ratio:.2f}x ({verdict})")
    write_json(args.json, {"machine": machine(), "config": dict(layers=LAYERS, batch=BATCH, heads=HEADS, head_dim=HEAD_DIM), "results": results, "donated_ratio_max_vs_1k": ratio})


if __name__ == "__main__":
    main()

"""Decode-step time of every cache kind at a fixed fill, capacity 32K against 1K.

One protocol, one attention path: a kind's decode step should cost O(tokens stored), not
O(capacity). For each kind this times a jitted, donated two-layer decode step (one new
token per row; layer 1's keys/values are computed from layer 0's attention output, so the
layers are chained as in a decoder) at ``--fill`` tokens, in a cache of capacity 1K and
one of 32K, and prints the ratio. Each step rolls its token back (``crop(-1)``), so every
call sees the same fill. Both capacities are timed in alternating rounds in this one run;
each figure is the best round's median.

Goal (issue 12): every kind within 1.3x from 1K to 32K.

    python benchmarks/bench_capacity.py [--fill 512] [--capacities 1024 32768] [--repeats 15]
        [--rounds 3] [--kinds static int8 ...] [--json benchmarks/results/capacity.json]

To measure an earlier version of the package with this script (as the README's "before"
figures were): ``git worktree add /tmp/old <commit>`` and run with ``PYTHONPATH=/tmp/old``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp

from common import machine, print_table, time_calls, write_json
from jaxkv.attention import cache_attention
from jaxkv.caches import (
    FULL,
    SLIDING,
    CrossAttentionCache,
    EncoderDecoderCache,
    HybridCache,
    QuantizedCache,
    SlidingWindowCache,
    StaticCache,
)

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, WINDOW = 2, 1, 8, 16, 128, 256


def kinds(capacity: int) -> dict:
    sizes = dict(batch_size=BATCH, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    static = dict(num_layers=LAYERS, max_length=capacity, **sizes)
    return {
        "static": lambda: StaticCache.init(**static),
        "static, bfloat16 cache": lambda: StaticCache.init(dtype=jnp.bfloat16, **static),
        f"sliding (W={WINDOW})": lambda: SlidingWindowCache.init(num_layers=LAYERS, window=WINDOW, **sizes),
        "hybrid (full + sliding)": lambda: HybridCache.init(
            layer_types=[FULL, SLIDING], max_length=capacity, window=WINDOW, **sizes
        ),
        "hybrid (2 full)": lambda: HybridCache.init(layer_types=[FULL, FULL], max_length=capacity, **sizes),
        "int8": lambda: QuantizedCache.init(bits=8, **static),
        "int4": lambda: QuantizedCache.init(bits=4, **static),
        "int8 + residual 64": lambda: QuantizedCache.init(bits=8, residual_length=64, **static),
        "encoder-decoder (static self)": lambda: EncoderDecoderCache.create(
            StaticCache.init(**static),
            CrossAttentionCache.from_layers([(jnp.ones((BATCH, KV_HEADS, 16, HEAD_DIM)),) * 2] * LAYERS),
        ),
    }


def make_step():
    def step(cache, x):  # x: [B, Hq, 1, D]
        positions = cache.positions(1)
        for layer in range(LAYERS):
            kv = x[:, :KV_HEADS] * 0.5  # this layer's new key/value, from the previous layer's output
            x, cache = cache_attention(x, kv, kv, cache, layer, positions=positions)
        return cache.crop(-1), x

    return jax.jit(step, donate_argnums=0)


def prefilled(make, fill: int):
    def prefill(cache, k):
        for layer in range(LAYERS):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    k = jax.random.normal(jax.random.key(0), (BATCH, KV_HEADS, fill, HEAD_DIM), jnp.float32)
    return jax.jit(prefill, donate_argnums=0)(make(), k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fill", type=int, default=512)
    parser.add_argument("--capacities", type=int, nargs=2, default=[1024, 32768])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", help="only these kinds (names as printed)")
    parser.add_argument("--json", default="benchmarks/results/capacity.json")
    args = parser.parse_args()
    small, large = args.capacities
    x = jax.random.normal(jax.random.key(1), (BATCH, Q_HEADS, 1, HEAD_DIM), jnp.float32)

    results = {}
    for name in args.kinds or kinds(small):
        states, steps = {}, {}
        for cap in (small, large):
            states[cap] = {"cache": prefilled(kinds(cap)[name], args.fill)}
            steps[cap] = make_step()
        best = {small: float("inf"), large: float("inf")}
        for _ in range(args.rounds):
            for cap in (small, large):
                state, step = states[cap], steps[cap]

                def call(state=state, step=step):
                    state["cache"], out = step(state["cache"], x)
                    out.block_until_ready()

                best[cap] = min(best[cap], time_calls(call, repeats=args.repeats))
        results[name] = {"ms_small": best[small] * 1e3, "ms_large": best[large] * 1e3,
                         "ratio": best[large] / best[small]}
        print(f"  {name}: {results[name]['ratio']:.2f}x", flush=True)

    print(
        f"\ndecode step, {LAYERS} chained layers, batch {BATCH}, {KV_HEADS} kv / {Q_HEADS} query heads, "
        f"head_dim {HEAD_DIM}, float32 model, fill {args.fill}, donated, jitted ({jax.default_backend()})"
    )
    print_table(
        ["kind", f"ms @ {small}", f"ms @ {large}", f"{large} / {small}"],
        [[n, f"{r['ms_small']:.3f}", f"{r['ms_large']:.3f}", f"{r['ratio']:.2f}x"] for n, r in results.items()],
    )
    write_json(args.json, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()

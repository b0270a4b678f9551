"""Attention over a StaticCache: capacity independence, bandwidth, copies and compiles.

Everything is measured side by side in one run; read the ratios.

1. Capacity: one decode step (1 query token) at fill 1K in caches of capacity 1K..64K, for
   plain masked attention over the whole buffer (``attend``), ``jax.nn.dot_product_attention``
   (``attend(implementation="jax")``) and ``blockwise_attend`` (its XLA loop, and on CPU
   its native kernel, ``jaxkv._kernels``).
2. Bandwidth: attention of one token over L layers x N cached tokens, as GB/s of cache read,
   against a jitted ``jnp.sum`` over a buffer of the same size (this machine's read bandwidth),
   for the kernel and the XLA loop; a profiler breakdown shows where the XLA loop's time goes.
3. Loop: a synthetic decoder (projections + blockwise attention) run for many steps in one
   jitted, donated step function: compile count, cache-sized copies in the compiled HLO,
   step time against capacity, and a scan-over-layers variant against the unrolled one.

    python benchmarks/bench_attention.py [--quick] [--json benchmarks/results/attention.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, op_times, print_table, time_calls, write_json
from jaxkv import StaticCache, _kernels
from jaxkv.attention import attend
from jaxkv.attention.blockwise import blockwise_attend

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _one_token_inputs(batch, capacity, fill, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, Q_HEADS, 1, HEAD_DIM), np.float32))
    k = jnp.asarray(rng.standard_normal((batch, KV_HEADS, capacity, HEAD_DIM), np.float32))
    v = jnp.asarray(rng.standard_normal((batch, KV_HEADS, capacity, HEAD_DIM), np.float32))
    q_pos = jnp.full((batch, 1), fill - 1, jnp.int32)
    kv_len = jnp.full((batch,), fill, jnp.int32)
    return q, k, v, q_pos, kv_len


STRATEGIES = {
    "masked (attend)": lambda q, k, v, p, n: attend(q, k, v, q_positions=p, kv_lengths=n),
    "jax.nn.dot_product_attention": lambda q, k, v, p, n: attend(
        q, k, v, q_positions=p, kv_lengths=n, implementation="jax"
    ),
    "blockwise, XLA loop": lambda q, k, v, p, n: blockwise_attend(q, k, v, q_positions=p, kv_lengths=n,
                                                                  implementation="xla"),
}
if jax.default_backend() == "cpu" and _kernels.available():
    STRATEGIES["blockwise, CPU kernel"] = lambda q, k, v, p, n: blockwise_attend(
        q, k, v, q_positions=p, kv_lengths=n, implementation="kernel")


def capacity_table(capacities, fill, repeats, rounds=3):
    """Median of ``repeats`` calls per cell, best over ``rounds`` interleaved rounds (every
    strategy and capacity once per round), so a slow spell of the shared machine does not
    land on one cell alone."""
    jitted = {name: jax.jit(fn) for name, fn in STRATEGIES.items()}
    inputs = {capacity: _one_token_inputs(1, capacity, fill) for capacity in capacities}
    results = {name: {} for name in STRATEGIES}
    for _ in range(rounds):
        for name, fn in jitted.items():
            for capacity, args in inputs.items():
                t = time_calls(lambda: fn(*args).block_until_ready(), repeats=repeats)
                results[name][capacity] = min(t, results[name].get(capacity, t))
    print(f"\n1. One decode step at fill {fill}, batch 1, {Q_HEADS} q heads / {KV_HEADS} kv heads, D={HEAD_DIM}, f32 "
          f"(median of {repeats} calls, best of {rounds} interleaved rounds)")
    headers = ["strategy"] + [f"cap {c} us" for c in capacities] + [f"cap {capacities[-1]} / cap {capacities[0]}"]
    rows = []
    for name, row in results.items():
        rows.append([name] + [f"{row[c] * 1e6:.0f}" for c in capacities] + [f"{row[capacities[-1]] / row[capacities[0]]:.2f}x"])
    print_table(headers, rows)
    return {name: {str(c): t for c, t in row.items()} for name, row in results.items()}


def bandwidth_table(layers, tokens, batches, repeats, profile=False):
    impls = ["kernel", "xla"] if jax.default_backend() == "cpu" and _kernels.available() else ["xla"]
    out = []
    for batch in batches:
        shape = (layers, batch, KV_HEADS, tokens, HEAD_DIM)
        keys = jnp.asarray(np.random.default_rng(1).standard_normal(shape, np.float32))
        values = keys + 1.0
        q = jnp.ones((batch, Q_HEADS, 1, HEAD_DIM), jnp.float32)
        q_pos = jnp.full((batch, 1), tokens - 1, jnp.int32)
        kv_len = jnp.full((batch,), tokens, jnp.int32)

        def all_layers(q, keys, values, impl):
            outs = [
                blockwise_attend(q, keys, values, layer_idx=i, q_positions=q_pos, kv_lengths=kv_len, implementation=impl)
                for i in range(layers)
            ]
            return jnp.stack(outs)

        @jax.jit
        def read_all(keys, values):
            return jnp.sum(keys) + jnp.sum(values)

        steps = {impl: jax.jit(partial(all_layers, impl=impl)) for impl in impls}
        # Interleaved rounds, so that a slow spell of this shared machine hits every column.
        times = {name: [] for name in [*impls, "sum"]}
        for _ in range(3):
            for impl, step in steps.items():
                times[impl].append(time_calls(lambda: step(q, keys, values).block_until_ready(), repeats=repeats))
            times["sum"].append(time_calls(lambda: read_all(keys, values).block_until_ready(), repeats=repeats))
        best = {name: min(ts) for name, ts in times.items()}
        nbytes = 2 * keys.size * keys.dtype.itemsize
        row = dict(batch=batch, cache_mb=nbytes / 2**20, sum_gbs=nbytes / best["sum"] / 1e9, sum_ms=best["sum"] * 1e3)
        for impl in impls:
            row[f"{impl}_gbs"] = nbytes / best[impl] / 1e9
            row[f"{impl}_ms"] = best[impl] * 1e3
        out.append(row)
        if profile:  # where the XLA loop's time goes, grouped by kind of op
            ops = op_times(lambda: steps["xla"](q, keys, values).block_until_ready(), calls=3, top=200)
            kinds = {"block slices copied (dynamic-slice fusions)": 0.0, "products (ynn_fusion / dot)": 0.0, "other": 0.0}
            for name, ms, _ in ops:
                kind = ("block slices copied (dynamic-slice fusions)" if name.startswith("dynamic-slice")
                        else "products (ynn_fusion / dot)" if name.startswith(("ynn_fusion", "dot")) else "other")
                kinds[kind] += ms
            out[-1]["xla_profile_ms"] = kinds
    print(f"\n2. Attention of 1 token over {layers} layers x {tokens} tokens, f32, vs jnp.sum over the same bytes "
          "(best of 3 interleaved rounds)")
    headers = ["batch", "cache MB", "sum GB/s"]
    for impl in impls:
        headers += [f"{impl} ms", f"{impl} GB/s", f"{impl} / sum"]
    rows = []
    for r in out:
        cells = [r["batch"], f"{r['cache_mb']:.0f}", f"{r['sum_gbs']:.1f}"]
        for impl in impls:
            cells += [f"{r[impl + '_ms']:.1f}", f"{r[impl + '_gbs']:.1f}", f"{r[impl + '_gbs'] / r['sum_gbs'] * 100:.0f}%"]
        rows.append(cells)
    print_table(headers, rows)
    for r in out:
        if "xla_profile_ms" in r:
            print(f"   batch {r['batch']}: XLA loop, profiler, ms per call by kind of op: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["xla_profile_ms"].items()))
    return out


# --------------------------------------------------------------- synthetic decoder loop

LAYERS, EMBED = 4, 256


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    shapes = dict(wq=(LAYERS, EMBED, Q_HEADS * HEAD_DIM), wk=(LAYERS, EMBED, KV_HEADS * HEAD_DIM),
                  wv=(LAYERS, EMBED, KV_HEADS * HEAD_DIM), wo=(LAYERS, Q_HEADS * HEAD_DIM, EMBED))
    return {k: jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[1])) for k, s in shapes.items()}


def _layer(x, w, cache, i, positions):
    batch = x.shape[0]
    q = (x @ w["wq"]).reshape(batch, 1, Q_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    k = (x @ w["wk"]).reshape(batch, 1, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    v = (x @ w["wv"]).reshape(batch, 1, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
    cache, _, _ = cache.update(k, v, i)
    # Read blocks straight from the stacked buffer (no per-layer slice).
    att = blockwise_attend(q, cache.keys, cache.values, layer_idx=i, q_positions=positions,
                           kv_lengths=cache.seq_lengths(i))
    x = x + att.transpose(0, 2, 1, 3).reshape(batch, Q_HEADS * HEAD_DIM) @ w["wo"]
    return jnp.tanh(x), cache


def step_unrolled(weights, x, cache):
    positions = cache.positions(1)
    for i in range(LAYERS):
        x, cache = _layer(x, jax.tree.map(lambda a: a[i], weights), cache, i, positions)
    return x, cache


def step_scanned(weights, x, cache):
    positions = cache.positions(1)

    def body(carry, w):
        x, cache, i = carry
        x, cache = _layer(x, w, cache, i, positions)
        return (x, cache, i + 1), None

    (x, cache, _), _ = jax.lax.scan(body, (x, cache, jnp.int32(0)), weights)
    return x, cache


def loop_table(capacities, fill, steps):
    weights = _weights()
    results = []
    for variant, fn in (("unrolled", step_unrolled), ("scan over layers", step_scanned)):
        for capacity in capacities:
            traces = []

            def traced(w, x, c, fn=fn):
                traces.append(1)
                return fn(w, x, c)

            step = jax.jit(traced, donate_argnums=2)
            cache = StaticCache.init(num_layers=LAYERS, batch_size=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     max_length=capacity)
            hlo = step.lower(weights, jnp.ones((1, EMBED)), cache).compile().as_text()
            buffer = f"f32[{LAYERS},1,{KV_HEADS},{capacity},{HEAD_DIM}]"
            copies = sum(1 for line in hlo.splitlines() if " copy(" in line and buffer in line)
            prefill = jnp.ones((1, KV_HEADS, fill, HEAD_DIM))
            for i in range(LAYERS):
                cache, _, _ = cache.update(prefill, prefill, i)
            x = jnp.ones((1, EMBED))
            x, cache = step(weights, x, cache)
            x.block_until_ready()
            start = time.perf_counter()
            for _ in range(steps):
                x, cache = step(weights, x, cache)
            x.block_until_ready()
            per_step = (time.perf_counter() - start) / steps
            results.append(dict(variant=variant, capacity=capacity, traces=len(traces), compiled=step._cache_size(),
                                hlo_cache_copies=copies, step_us=per_step * 1e6, final_length=int(cache.seq_lengths(0)[0])))
    print(f"\n3. {steps}-step donated decode loop, synthetic {LAYERS}-layer decoder, fill {fill} at start")
    print_table(["variant", "capacity", "traces", "programs", "cache-sized copies in HLO", "us/step", "length after"],
                [[r["variant"], r["capacity"], r["traces"], r["compiled"], r["hlo_cache_copies"], f"{r['step_us']:.0f}",
                  r["final_length"]] for r in results])
    by = {(r["variant"], r["capacity"]): r["step_us"] for r in results}
    lo, hi = capacities[0], capacities[-1]
    print(f"unrolled: capacity {hi} / {lo} = {by[('unrolled', hi)] / by[('unrolled', lo)]:.2f}x; "
          f"scan / unrolled at {hi} = {by[('scan over layers', hi)] / by[('unrolled', hi)]:.2f}x")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--json", default="benchmarks/results/attention.json")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="also break the bandwidth case down by op kind (jax.profiler trace)")
    args = parser.parse_args()
    if args.quick:
        capacities, bw, loop = [1024, 4096], dict(layers=2, tokens=4096, batches=[1]), dict(capacities=[2048, 8192], steps=50)
    else:
        capacities, bw, loop = [1024, 4096, 16384, 65536], dict(layers=8, tokens=32768, batches=[1, 8]), dict(
            capacities=[2048, 65536], steps=1000)
    payload = {"machine": machine()}
    payload["capacity"] = capacity_table(capacities, fill=1024, repeats=30)
    payload["bandwidth"] = bandwidth_table(repeats=10, profile=args.profile, **bw)
    payload["loop"] = loop_table(fill=1024, **loop)
    write_json(args.json, payload)


if __name__ == "__main__":
    main()

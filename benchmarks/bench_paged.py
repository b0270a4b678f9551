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

* ``memory`` (goal (a)): requests with lognormal prompt/output lengths through a
  ``PagedEngine`` whose pool is a fixed budget: concurrent requests vs fixed slots.
* ``prefix`` (goal (b)): 64 requests sharing a 1K-token system prompt, with and without
  the prefix cache: prompt tokens computed, time to first token, throughput.
* ``fork``: copy-on-write fan-out of a 1K-token prompt to 16 rows, static vs paged.
* ``pool``: the decode step at one fill over pools of 1K to 1M tokens (the write's page
  plan reads [P]-sized arrays; a step that needs no new page skips it).
* ``pool_rows``: 16 rows growing at staggered fills (some row takes a new page on most
  steps), 8K- against 1M-token pool.

    python benchmarks/bench_paged.py [--sections attention memory prefix fork pool pool_rows] [--fills 1024 8192 32768]
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

LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 1, 8, 16, 128
PAGE_SIZE = 16  # attention section; --page-size sets it


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


def decode_step(kv_heads: int = KV_HEADS):
    def step(cache, x):  # x: [B, Hq, 1, D]
        positions = cache.positions(1)
        for layer in range(LAYERS):
            kv = x[:, :kv_heads] * 0.5  # this layer's new key/value, from the previous layer's output
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


def _model(num_layers: int = 2):
    from flax import nnx

    from jaxkv.models import Llama, LlamaConfig

    return Llama(LlamaConfig.tiny(num_layers=num_layers, vocab_size=256), rngs=nnx.Rngs(0))


def memory_table(args) -> dict:
    """Goal (a): how many requests a fixed cache budget holds at once, paged vs fixed slots.

    Requests with lognormal prompt and output lengths go through a real PagedEngine whose
    pool is the budget; the concurrency is counted from the steps it ran. Fixed slots (the
    ServingLoop, HF-style static caches) reserve max_length per request, so the same budget
    holds budget // max_length requests, whatever they actually use.
    """
    from jaxkv.decoding.engine import EngineRequest, PagedEngine

    rng = np.random.default_rng(0)
    n, page, max_length, budget = args.requests, 16, 1024, args.budget_tokens
    prompts = np.clip(rng.lognormal(np.log(96), 0.8, n), 8, 640).astype(int)
    outputs = np.clip(rng.lognormal(np.log(48), 0.8, n), 4, max_length - 640).astype(int)
    requests = [
        EngineRequest(list(rng.integers(1, 256, p)), int(o)) for p, o in zip(prompts, outputs)
    ]
    engine = PagedEngine(
        _model(), max_rows=256, max_length=max_length, num_pages=budget // page, page_size=page, chunk_size=64,
        prefix_cache=False,
    )
    engine.run(requests)
    stats = engine.stats
    slots = budget // max_length
    # Concurrency while requests were waiting (the budget, not the arrivals, was the limit).
    mean_rows = stats["backlog_row_steps"] / max(1, stats["backlog_steps"])
    print(
        f"\nmemory (goal (a): >= 3x): {n} requests, prompt lengths lognormal (median {int(np.median(prompts))}, "
        f"max {prompts.max()}), outputs (median {int(np.median(outputs))}, max {outputs.max()}); cache budget "
        f"{budget} tokens; max_length {max_length}."
    )
    rows = [
        ["fixed slots (ServingLoop / static)", slots, slots, "-"],
        ["PagedEngine (pages of 16)", stats["peak_rows"], f"{mean_rows:.1f}", stats["preemptions"]],
        ["paged / slots", f"{stats['peak_rows'] / slots:.2f}x", f"{mean_rows / slots:.2f}x", ""],
    ]
    print_table(["cache", "peak concurrent requests", "mean concurrent while requests wait", "preemptions"], rows)
    return dict(budget_tokens=budget, max_length=max_length, slots=slots, paged_peak=stats["peak_rows"],
                paged_mean=mean_rows, preemptions=stats["preemptions"], engine_stats=stats)


def prefix_table(args) -> dict:
    """Goal (b): 64 requests sharing a 1K-token system prompt, with and without the prefix
    cache: prompt tokens run through the model, mean time to first token, throughput."""
    from jaxkv.decoding.engine import EngineRequest, PagedEngine

    rng = np.random.default_rng(1)
    system = list(rng.integers(1, 256, 1024))
    requests = [EngineRequest(system + list(rng.integers(1, 256, int(rng.integers(8, 40)))), 16) for _ in range(64)]
    model = _model()
    out = {}
    rows = []
    for cached in (False, True):
        engine = PagedEngine(
            model, max_rows=64, max_length=1088, num_pages=64 * 68 + 8, page_size=16, chunk_size=64,
            prefix_cache=cached,
        )
        engine.run(requests)  # compile every step shape this run uses outside the timing
        engine = PagedEngine(
            model, max_rows=64, max_length=1088, num_pages=64 * 68 + 8, page_size=16, chunk_size=64,
            prefix_cache=cached,
        )
        results = engine.run(requests)
        ttft = float(np.mean([r.first_token_s for r in results]))
        st = engine.stats
        out[cached] = dict(prefill_tokens=st["prefill_tokens"], ttft_s=ttft, tokens_per_s=st["tokens_per_s"],
                           wall_s=st["wall_s"], cached_tokens=st["cached_tokens"])
        rows.append([("prefix cache" if cached else "no prefix cache"), st["prefill_tokens"], f"{ttft * 1e3:.0f}",
                     f"{st['wall_s']:.2f}", f"{st['tokens_per_s']:.0f}"])
    off, on = out[False], out[True]
    rows.append(["without / with", f"{off['prefill_tokens'] / on['prefill_tokens']:.1f}x",
                 f"{off['ttft_s'] / on['ttft_s']:.1f}x", f"{off['wall_s'] / on['wall_s']:.1f}x",
                 f"{on['tokens_per_s'] / off['tokens_per_s']:.1f}x (with / without)"])
    print("\nprefix cache (goal (b): >= 5x on prefill work): 64 requests = one 1024-token system prompt + 8-40 own "
          "tokens, 16 new tokens each, PagedEngine (64 rows, chunks of 64), tiny model.")
    print_table(["run", "prompt tokens computed", "mean TTFT ms", "wall s", "generated tokens/s"], rows)
    return {"without": off, "with": on}


def fork_table(args) -> dict:
    """Copy-on-write forks: a 1K-token prompt fanned out to 16 rows (``batch_repeat_interleave``)
    and one token decoded on each, static vs paged: bytes the cache holds, fork time."""
    layers, heads, dim, prompt, fan = 2, 8, 128, 1024, 16
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.standard_normal((1, heads, prompt, dim)), jnp.float32)
    caches = {
        "static": StaticCache.init(num_layers=layers, batch_size=1, num_kv_heads=heads, head_dim=dim,
                                   max_length=prompt + 64),
        "paged": PagedCache.init(num_layers=layers, batch_size=1, num_kv_heads=heads, head_dim=dim,
                                 max_length=prompt + 64, page_size=16, num_pages=fan * (prompt + 64) // 16),
    }
    token = jnp.asarray(rng.standard_normal((fan, heads, 1, dim)), jnp.float32)

    @jax.jit
    def fill(cache):
        for layer in range(layers):
            cache = cache.update(k, k, layer)[0]
        return cache

    fork = jax.jit(lambda c: c.batch_repeat_interleave(fan), donate_argnums=0)

    def time_fork(cache) -> float:
        """Median of donated forks, each of its own copy of the filled cache."""
        import time

        times = []
        for _ in range(max(3, args.repeats)):
            copy = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
            tick = time.perf_counter()
            jax.block_until_ready(fork(copy))
            times.append(time.perf_counter() - tick)
        return float(np.median(times))

    @jax.jit
    def step(cache):
        for layer in range(layers):
            cache = cache.update(token, token, layer)[0]
        return cache

    token_bytes = layers * heads * dim * 4 * 2  # keys and values, every layer
    rows, out = [], {}
    for name, cache in caches.items():
        cache = fill(cache)
        seconds = time_fork(cache)
        after = step(fork(jax.tree.map(jnp.copy, cache)))
        if name == "static":
            held = fan * (prompt + 64) * token_bytes  # every row its own capacity
            used = held
        else:
            pages_held = after.num_pages - after.free_pages
            held = used = pages_held * 16 * token_bytes
        out[name] = dict(fork_s=seconds, bytes_after_one_step=used)
        rows.append([name, f"{seconds * 1e3:.3f}", f"{used / 2**20:.1f}"])
    rows.append(["static / paged", f"{out['static']['fork_s'] / out['paged']['fork_s']:.1f}x",
                 f"{out['static']['bytes_after_one_step'] / out['paged']['bytes_after_one_step']:.1f}x"])
    print(f"\nfork: a {prompt}-token prompt (2 layers, 8 kv heads, head_dim 128, f32) fanned out to {fan} rows "
          "(jitted, donated), then one token each (paged: pages of 16, the written page copied on write).")
    print_table(["cache", "batch_repeat_interleave ms", "cache MiB after one step"], rows)
    return out


def _alternating(states: dict, program, x, args) -> dict:
    """Best-round median seconds per call of ``program(cache, x) -> (cache, out)`` on each
    state's cache (donated, carried on), the states timed side by side in alternating rounds."""
    best = {key: float("inf") for key in states}
    for _ in range(args.rounds):
        for key, state in states.items():

            def call(state=state):
                state["cache"], out = program(state["cache"], x)
                out.block_until_ready()

            best[key] = min(best[key], time_calls(call, repeats=args.repeats))
    return best


def pool_table(args) -> dict:
    """Section "pool": the decode step of section "attention" at one fill (not on a page
    boundary: each step writes into a page its row alone holds, as 15 of 16 decode steps do)
    over pools of growing size. The write's page plan (free pages, copy-on-write holders) reads
    [P]-sized arrays; a step that needs no new page skips it, so the step should not grow with
    the pool."""
    # A small head (2 kv / 4 query heads of 16): attention over the fill is cheap, so what grows
    # with the pool shows; and a 1M-token pool is 512 MiB.
    kv_heads, q_heads, head_dim = 2, 4, 16
    x = jax.random.normal(jax.random.key(1), (BATCH, q_heads, 1, head_dim), jnp.float32)
    fill = args.pool_fill
    sizes = dict(num_layers=LAYERS, batch_size=BATCH, num_kv_heads=kv_heads, head_dim=head_dim)
    states = {}
    for tokens in args.pool_tokens:
        cache = PagedCache.init(max_length=fill + 8 * PAGE_SIZE, page_size=PAGE_SIZE, num_pages=tokens // PAGE_SIZE,
                                **sizes)
        k = jax.random.normal(jax.random.key(0), (BATCH, kv_heads, fill, head_dim), jnp.float32)
        for layer in range(LAYERS):
            cache, _, _ = cache.update(k, k, layer)
        states[tokens] = {"cache": shuffled_pages(cache)}
    best = _alternating(states, decode_step(kv_heads), x, args)
    smallest = min(best)
    results = {str(tokens): {"pages": tokens // PAGE_SIZE, "step_ms": t * 1e3, "vs_smallest": t / best[smallest]}
               for tokens, t in best.items()}
    print(f"\npool: the decode step of section attention with {kv_heads} kv / {q_heads} query heads of {head_dim} "
          f"(float32, fill {fill}, pages of {PAGE_SIZE} shuffled in the pool, crop(-1) after each step), pools of "
          "growing size, timed side by side in alternating rounds (best round's median).")
    print_table(["pool tokens", "pages", "step ms", f"vs {smallest}"],
                [[tokens, r["pages"], f"{r['step_ms']:.3f}", f"{r['vs_smallest']:.2f}x"]
                 for tokens, r in ((int(t), r) for t, r in results.items())])
    return results


def pool_rows_table(args) -> dict:
    """Section "pool_rows": 16 rows at staggered fills growing one token per step (no crop), so
    that on most steps some row takes a new page and the write runs its page plan, over an
    8K-token pool and a 1M-token one."""
    kv_heads, q_heads, head_dim, batch, steps_per_call = 2, 4, 16, 16, 8
    x = jnp.ones((batch, q_heads, 1, head_dim), jnp.float32)

    def grow(cache, x):
        for _ in range(steps_per_call):
            positions = cache.positions(1)
            y = x
            for layer in range(LAYERS):
                kv = y[:, :kv_heads] * 0.5
                y, cache = cache_attention(y, kv, kv, cache, layer, positions=positions)
        return cache, y

    grow = jax.jit(grow, donate_argnums=0)
    states = {}
    for tokens in (8192, 1048576):
        cache = PagedCache.init(num_layers=LAYERS, batch_size=batch, num_kv_heads=kv_heads, head_dim=head_dim,
                                max_length=4096, page_size=PAGE_SIZE, num_pages=tokens // PAGE_SIZE)
        k = jnp.ones((batch, kv_heads, 320, head_dim))
        fills = jnp.asarray(200 + np.arange(batch) * 7, jnp.int32)  # rows cross page boundaries on different steps
        for layer in range(LAYERS):
            cache, _, _ = cache.update(k, k, layer, num_new=fills)
        states[tokens] = {"cache": cache}
    best = {tokens: t / steps_per_call for tokens, t in _alternating(states, grow, x, args).items()}
    ratio = best[1048576] / best[8192]
    print(f"\npool_rows: {batch} rows at staggered fills, one token per step ({LAYERS} layers, {kv_heads} kv / "
          f"{q_heads} query heads of {head_dim}, pages of {PAGE_SIZE}): {best[8192] * 1e3:.3f} ms per step with an "
          f"8K-token pool, {best[1048576] * 1e3:.3f} ms with a 1M-token one ({ratio:.2f}x)")
    return {"step_ms_8k": best[8192] * 1e3, "step_ms_1m": best[1048576] * 1e3, "ratio": ratio}


SECTIONS = {"attention": attention_table, "memory": memory_table, "prefix": prefix_table, "fork": fork_table,
            "pool": pool_table, "pool_rows": pool_rows_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--fills", type=int, nargs="*", default=[1024, 8192, 32768])
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16, help="attention: tokens per page")
    parser.add_argument("--requests", type=int, default=300, help="memory: requests served")
    parser.add_argument("--budget-tokens", type=int, default=16384, help="memory: cache budget in tokens")
    parser.add_argument("--pool-fill", type=int, default=1000, help="pool: tokens held")
    parser.add_argument("--pool-tokens", type=int, nargs="*", default=[1152, 131072, 1048576],
                        help="pool: pool sizes in tokens")
    parser.add_argument("--json", default="benchmarks/results/paged.json")
    args = parser.parse_args()
    global PAGE_SIZE
    PAGE_SIZE = args.page_size
    results = {name: SECTIONS[name](args) for name in args.sections}
    write_json(args.json, {"machine": machine(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()

"""Memory and decode-step time of every cache kind beside the plain StaticCache.

Memory: bytes of all pytree leaves (data, scales, lengths, flags, positions), from
``jax.eval_shape`` (nothing is allocated), for a 32-layer model with 8 kv heads and 4096
tokens of capacity, head_dim 64 and 128, model dtype bfloat16 and float32. The ratio is
StaticCache bytes / kind bytes (higher: smaller cache).

Time: one jitted, donated decode step = one new token per row written into every layer
("update": the cache's own cost), and the same followed by attention of one query per
layer over what the layer returns ("update + attend": a sliding layer reads its window, a
quantized layer dequantizes its whole capacity). Median of repeated calls, all in this one
run; the ratio is kind time / StaticCache time (lower: faster).

Quality (``--quality-tokens N``, default 256): the embedded model (jaxkv/_assets/pycoder)
generates N greedy tokens through a float32 StaticCache; each quantized cache then reads
the same tokens (teacher forcing) and we report the largest logit error relative to the
largest float logit, the share of steps whose argmax equals the float run's token, and,
decoding freely, how many tokens agree before the first divergence.

    python benchmarks/bench_cache_kinds.py [--capacity 2048] [--repeats 20]
        [--quality-tokens 256] [--json benchmarks/results/cache_kinds.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np

from common import machine, print_table, time_calls, write_json
from jaxkv import StaticCache
from jaxkv.attention import update_and_attend
from jaxkv.caches import FULL, SLIDING, HybridCache
from jaxkv.caches import QuantizedCache
from jaxkv.caches import SlidingWindowCache


def kinds(*, layers: int, batch: int, heads: int, head_dim: int, capacity: int, window: int, dtype) -> dict:
    """Constructors of every kind for one model shape (call them to allocate)."""
    sizes = dict(num_layers=layers, batch_size=batch, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    hybrid_types = [SLIDING if i % 2 == 0 else FULL for i in range(layers)]  # alternating local/global
    return {
        "static": lambda: StaticCache.init(max_length=capacity, **sizes),
        f"sliding (W={window})": lambda: SlidingWindowCache.init(window=window, **sizes),
        "hybrid (1/2 sliding)": lambda: HybridCache.init(
            layer_types=hybrid_types, max_length=capacity, window=window,
            **{k: v for k, v in sizes.items() if k != "num_layers"},
        ),
        "int8": lambda: QuantizedCache.init(max_length=capacity, bits=8, **sizes),
        "int4": lambda: QuantizedCache.init(max_length=capacity, bits=4, **sizes),
        "int8 + residual 128": lambda: QuantizedCache.init(max_length=capacity, bits=8, residual_length=128, **sizes),
        "int4 + residual 128": lambda: QuantizedCache.init(max_length=capacity, bits=4, residual_length=128, **sizes),
    }


def nbytes(make) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(make)))


def memory_table() -> dict:
    results = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        for head_dim in (64, 128):
            makers = kinds(layers=32, batch=1, heads=8, head_dim=head_dim, capacity=4096, window=512, dtype=dtype)
            sizes = {name: nbytes(make) for name, make in makers.items()}
            results[f"{jnp.dtype(dtype).name}, head_dim={head_dim}"] = {
                name: {"bytes": b, "ratio_vs_static": sizes["static"] / b} for name, b in sizes.items()
            }
    return results


def step_time(
    make, *, attention: bool, layers: int, batch: int, heads: int, head_dim: int, fill: int, repeats: int
) -> float:
    cache = make()
    q_heads = 2 * heads

    def prefill(cache, k):
        for layer in range(layers):
            cache, _, _ = cache.update(k, k, layer)
        return cache

    cache = jax.jit(prefill, donate_argnums=0)(cache, jnp.full((batch, heads, fill, head_dim), 0.1, jnp.float32))
    q = jnp.full((batch, q_heads, 1, head_dim), 0.1, jnp.float32)
    k = jnp.full((batch, heads, 1, head_dim), 0.2, jnp.float32)

    def decode(cache, q, k):
        positions = cache.positions(1)
        total = jnp.zeros((), jnp.float32)
        for layer in range(layers):
            if attention:
                out, cache = update_and_attend(q, k, k, cache, layer, positions=positions)
                # As in a decoder, the next layer's inputs come from this layer's output: that
                # orders its in-place write after this layer's read. Without it XLA may write
                # first and keep the read valid by copying the whole cache (README "StaticCache"),
                # which is what an earlier version of this benchmark timed for the kernel path.
                q, k = q + out, k + out[:, :heads]
                total = total + out.sum()
            else:
                cache, _, _ = cache.update(k, k, layer)
        # Roll back the token just written so every timed step sees the same fill level.
        return cache.crop(fill), total

    step = jax.jit(decode, donate_argnums=0)
    state = {"cache": cache}

    def call():
        state["cache"], total = step(state["cache"], q, k)
        total.block_until_ready()

    return time_calls(call, repeats=repeats)


def quality(num_tokens: int) -> dict:
    from flax import nnx

    import jaxkv
    from jaxkv.models import from_pretrained

    loaded = from_pretrained(str(Path(jaxkv.__file__).parent / "_assets" / "pycoder"))
    model, config = loaded.model, loaded.config
    prompt = np.asarray([loaded.tokenizer.encode("def fibonacci(n):\n").ids], np.int32)
    capacity = prompt.shape[1] + num_tokens
    sizes = dict(num_layers=config.num_layers, batch_size=1, num_kv_heads=config.num_kv_heads,
                 head_dim=config.head_dim, max_length=capacity)

    @nnx.jit
    def step(model, tokens, cache):
        logits, cache = model(tokens, cache)
        return logits[:, -1], cache

    def run(cache, forced=None):
        """Logits [N, V] and tokens [N]: greedy, or reading `forced` tokens."""
        logits, cache = step(model, jnp.asarray(prompt), cache)
        all_logits, tokens = [np.asarray(logits[0])], [int(jnp.argmax(logits[0]))]
        for i in range(num_tokens - 1):
            feed = tokens[-1] if forced is None else int(forced[i])
            logits, cache = step(model, jnp.asarray([[feed]], jnp.int32), cache)
            all_logits.append(np.asarray(logits[0]))
            tokens.append(int(jnp.argmax(logits[0])))
        return np.stack(all_logits), np.asarray(tokens)

    ref_logits, ref_tokens = run(StaticCache.init(**sizes))
    results = {}
    for name, kwargs in {
        "int8": dict(bits=8), "int4": dict(bits=4),
        "int8 + residual 32": dict(bits=8, residual_length=32), "int4 + residual 32": dict(bits=4, residual_length=32),
    }.items():
        logits, tokens = run(QuantizedCache.init(**sizes, **kwargs), forced=ref_tokens)
        _, free = run(QuantizedCache.init(**sizes, **kwargs))
        diverged = np.flatnonzero(free != ref_tokens)
        results[name] = {
            "max_rel_logit_error": float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
            "argmax_agreement": float((tokens == ref_tokens).mean()),
            "free_run_tokens_before_divergence": int(diverged[0]) if diverged.size else num_tokens,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quality-tokens", type=int, default=256)
    parser.add_argument("--json", default="benchmarks/results/cache_kinds.json")
    args = parser.parse_args()

    memory = memory_table()
    for config, rows in memory.items():
        print(f"\nmemory, 32 layers x 8 kv heads x 4096 tokens, {config}")
        print_table(
            ["kind", "MiB", "static / kind"],
            [[name, f"{r['bytes'] / 2**20:.1f}", f"{r['ratio_vs_static']:.2f}x"] for name, r in rows.items()],
        )

    shape = dict(layers=4, batch=1, heads=8, head_dim=128)
    fill, window = args.capacity // 2, 256
    makers = kinds(**shape, capacity=args.capacity, window=window, dtype=jnp.float32)
    timing = {
        mode: {
            name: step_time(make, attention=mode == "update + attend", **shape, fill=fill, repeats=args.repeats)
            for name, make in makers.items()
        }
        for mode in ("update", "update + attend")
    }
    base = {mode: t["static"] for mode, t in timing.items()}
    print(
        f"\ndecode step (1 token x {shape['layers']} layers, 8 kv heads, head_dim 128, float32, capacity "
        f"{args.capacity}, {fill} tokens held, window {window}), donated, jitted"
    )
    print_table(
        ["kind", "update ms", "update / static", "update + attend ms", "(update + attend) / static"],
        [
            [
                name,
                f"{timing['update'][name] * 1e3:.3f}",
                f"{timing['update'][name] / base['update']:.2f}x",
                f"{timing['update + attend'][name] * 1e3:.3f}",
                f"{timing['update + attend'][name] / base['update + attend']:.2f}x",
            ]
            for name in makers
        ],
    )
    tokens = args.quality_tokens
    quality_results = quality(tokens)
    print(f"\nquality: embedded model, {tokens} greedy tokens, quantized cache vs float32 StaticCache")
    print_table(
        ["kind", "max |logit error| / max |logit|", "argmax agreement (teacher-forced)", "free run: tokens before divergence"],
        [
            [name, f"{r['max_rel_logit_error']:.4f}", f"{r['argmax_agreement']:.3f}",
             f"{r['free_run_tokens_before_divergence']} / {tokens}"]
            for name, r in quality_results.items()
        ],
    )
    write_json(
        args.json,
        {
            "machine": machine(),
            "memory": memory,
            "quality": {"model": "jaxkv/_assets/pycoder", "tokens": tokens, "results": quality_results},
            "decode_step": {
                "config": {**shape, "dtype": "float32", "capacity": args.capacity, "fill": fill, "window": window},
                "seconds": timing,
                "ratio_vs_static": {
                    mode: {name: t / base[mode] for name, t in times.items()} for mode, times in timing.items()
                },
            },
        },
    )


if __name__ == "__main__":
    main()

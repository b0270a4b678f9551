"""``python -m jaxkv.demo``: the caches at work, printed step by step.

``make demo`` generates text with the embedded model (``jaxkv generate``); this script,
``make demo-caches``, shows the cache vocabulary: update, per-row lengths, crop, reorder,
overflow policy, and a jitted, donated decode loop that compiles once.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxkv import CacheError, DynamicCache, StaticCache


def main() -> None:
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    key = jax.random.key(0)
    layers, batch, heads, head_dim = 2, 2, 2, 8

    print("\n# DynamicCache: grows by concatenation, every method returns a new cache")
    cache = DynamicCache(num_layers=layers)
    k = jax.random.normal(key, (batch, heads, 5, head_dim))
    grown, keys, _ = cache.update(k, -k, layer_idx=0)
    print(f"old cache length {cache.get_seq_length(0)}, new cache length {grown.get_seq_length(0)}, keys {keys.shape}")
    swapped = grown.reorder_cache(jnp.array([1, 0]))
    same = bool(jnp.array_equal(swapped[0][0][0], grown[0][0][1]))
    print(f"crop(-2) -> {grown.crop(-2).get_seq_length(0)} tokens; reorder_cache([1, 0]) swaps rows: {same}")

    print("\n# StaticCache: preallocated, per-row lengths, no left padding")
    static = StaticCache.init(
        num_layers=layers, batch_size=batch, num_kv_heads=heads, head_dim=head_dim, max_length=32
    )
    prompt_lengths = jnp.array([5, 2], jnp.int32)  # a ragged batch
    for layer in range(layers):
        static, _, _ = static.update(k, -k, layer, num_new=prompt_lengths)
    print(f"lengths per row after prefill: {static.seq_lengths().tolist()}")
    print(f"positions of the next token:   {static.positions(1)[:, 0].tolist()}")

    traces = []

    def decode_step(cache, k_new):
        traces.append(1)
        for layer in range(layers):
            cache, _, _ = cache.update(k_new, -k_new, layer)
        return cache

    step = jax.jit(decode_step, donate_argnums=0)
    k_new = jnp.ones((batch, heads, 1, head_dim))
    static = step(static, k_new)  # the first call compiles
    start = time.perf_counter()
    for _ in range(19):
        static = step(static, k_new)
    static.lengths.block_until_ready()
    elapsed = time.perf_counter() - start
    print(
        f"20 jitted, donated decode steps: lengths {static.seq_lengths().tolist()}, "
        f"traced {len(traces)} time(s), {elapsed / 19 * 1e6:.0f} us/step after the first"
    )
    rolled = static.crop(jnp.array([-3, -1], jnp.int32))
    print(f"per-row rollback crop([-3, -1]): lengths {rolled.seq_lengths().tolist()}")

    print("\n# Overflow is never silent")
    try:
        static.update(jnp.ones((batch, heads, 8, head_dim)), jnp.ones((batch, heads, 8, head_dim)), 0)
    except ValueError as err:
        print(f"eager: ValueError: {err}")
    over, _, _ = jax.jit(lambda c, x: c.update(x, x, 0))(static, jnp.ones((batch, heads, 8, head_dim)))
    print(f"jit: writes past capacity dropped, overflowed = {over.overflowed.tolist()}")
    try:
        over.check()
    except CacheError as err:
        print(f"host check: CacheError: {err}")


if __name__ == "__main__":
    main()

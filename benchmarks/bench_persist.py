"""Saving and loading caches (jaxkv.persist): throughput against the bytes, and the time to
first token of a 4K-token prompt restored from a prompt-state file against recomputing it.

1. Throughput. A bfloat16 ``StaticCache`` of each size, filled with random bits, saved and
   loaded through each path; GB/s = the cache's bytes / wall time, best of R (the cores are
   shared with other jobs; the minimum is the figure least inflated by them):

   * ``safetensors``: :func:`save_cache` (device to host, CRC-32 per array, write, atomic
     rename) and :func:`load_cache` (read, checksum check, to the device);
   * ``orbax``: the same through an Orbax checkpoint directory (tensorstore), if installed;
   * ``sequence``: :func:`save_sequence` / :func:`load_sequence` of one row holding half
     the capacity (GB/s over the row's bytes written / read).

   Files go to a temporary directory (``--dir``): on this machine, page cache, so the
   figures are the software path's, not a disk's.

2. Time to first token. A small Llama (random weights, float32) and a 4096-token prompt:
   ``fresh`` is :func:`jaxkv.stream`'s first token (prefill of the whole prompt, chunks of
   512); ``restored`` builds a :class:`PromptCacheStream` from the file the first run saved
   (load the state of 4095 tokens into the cache, prefill the last token) and takes its first
   token. Both warm (compiled), best of R; the fingerprint of the weights (hashed once per
   loaded model, as the CLI does) is timed apart. The ratio is measured in this run.

    python benchmarks/bench_persist.py            # writes benchmarks/results/persist.json
    python benchmarks/bench_persist.py --quick    # smaller sizes, a 1K prompt, writes nothing
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, print_table, write_json  # noqa: E402

from jaxkv import StaticCache  # noqa: E402
from jaxkv.persist import (  # noqa: E402
    PromptCacheStream,
    load_cache,
    load_sequence,
    model_fingerprint,
    save_cache,
    save_sequence,
)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def block(tree):
    jax.block_until_ready(tree)
    return tree


def random_cache(megabytes: int) -> StaticCache:
    """A bf16 cache of about ``megabytes`` MB: 8 layers, 2 rows, 8 kv heads, head dim 128."""
    per_slot = 8 * 2 * 8 * 128 * 2 * 2  # layers * rows * heads * dim * (k, v) * bytes
    capacity = max(16, megabytes * 2**20 // per_slot)
    cache = StaticCache.init(num_layers=8, batch_size=2, num_kv_heads=8, head_dim=128, max_length=capacity,
                             dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    store = cache.stores[0]
    keys = jnp.asarray(rng.integers(0, 2**16, store.keys.shape, dtype=np.uint16))
    values = jnp.asarray(rng.integers(0, 2**16, store.values.shape, dtype=np.uint16))
    import dataclasses

    store = dataclasses.replace(store, keys=keys, values=values)
    return block(dataclasses.replace(cache, stores=(store,), lengths=jnp.full(cache.lengths.shape, capacity // 2,
                                                                                   jnp.int32)))


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def throughput(sizes: list[int], directory: str, repeats: int) -> list[dict]:
    try:
        import orbax.checkpoint  # noqa: F401

        formats = ["safetensors", "orbax"]
    except ImportError:
        formats = ["safetensors"]
    rows = []
    for mb in sizes:
        cache = random_cache(mb)
        size = nbytes(cache)
        for fmt in formats:
            path = os.path.join(directory, f"cache-{mb}.{fmt}")
            save = best_of(lambda: save_cache(path, cache, format=fmt), repeats)
            load = best_of(lambda: block(load_cache(path, like=cache)), repeats)
            rows.append({"path": fmt, "bytes": size, "save_s": save, "load_s": load})
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        n = int(cache.lengths[0, 0])
        path = os.path.join(directory, f"row-{mb}.safetensors")
        ids = np.arange(n) % 1000
        save = best_of(lambda: save_sequence(path, cache, 0, model_fingerprint="bench", token_ids=ids), repeats)
        load = best_of(
            lambda: block(load_sequence(path, cache, 1, model_fingerprint="bench", token_ids=ids)), repeats
        )
        rows.append({"path": "sequence", "bytes": os.path.getsize(path), "save_s": save, "load_s": load})
        os.remove(path)
        del cache
    return rows


def time_to_first_token(prompt_tokens: int, directory: str, repeats: int) -> dict:
    from flax import nnx

    from jaxkv.generation import stream
    from jaxkv.models import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=64)
    model = Llama(config, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, size=(1, prompt_tokens))
    path = os.path.join(directory, "prompt.safetensors")

    fingerprint_s = best_of(lambda: model_fingerprint(model), repeats)
    fingerprint = model_fingerprint(model)
    fresh_stream = stream(model, prompt, 1)
    first = next(iter(fresh_stream))  # compiles the prefill
    fresh_s = best_of(lambda: next(iter(fresh_stream)), repeats)

    def restored():
        made = PromptCacheStream(path, model, prompt, 1, fingerprint=fingerprint)
        token = next(iter(made))
        assert made.restored == prompt_tokens - 1 and int(token[0]) == int(first[0])
        return token

    saving = PromptCacheStream(path, model, prompt, 1, fingerprint=fingerprint)
    assert int(next(iter(saving))[0]) == int(first[0])  # the first run saves the prompt's state
    restored()  # compiles the one-token prefill and the row placement
    restored_s = best_of(restored, repeats)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    return {
        "prompt_tokens": prompt_tokens, "params": int(params), "file_bytes": os.path.getsize(path),
        "fresh_s": fresh_s, "restored_s": restored_s, "fingerprint_s": fingerprint_s, "speedup": fresh_s / restored_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and a 1K prompt; writes nothing")
    parser.add_argument("--dir", default=None, help="directory for the files (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [16, 64] if args.quick else [16, 128, 512]
    prompt_tokens = 1024 if args.quick else 4096
    directory = args.dir or tempfile.mkdtemp(prefix="jaxkv-persist-")
    try:
        rows = throughput(sizes, directory, args.repeats)
        ttft = time_to_first_token(prompt_tokens, directory, args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    print("\nSave / load throughput (bfloat16 StaticCache; best of", args.repeats, "runs)")
    print_table(
        ["path", "MB", "save ms", "save GB/s", "load ms", "load GB/s"],
        [[r["path"], f"{r['bytes'] / 1e6:.1f}", f"{r['save_s'] * 1e3:.1f}", f"{r['bytes'] / r['save_s'] / 1e9:.2f}",
          f"{r['load_s'] * 1e3:.1f}", f"{r['bytes'] / r['load_s'] / 1e9:.2f}"] for r in rows],
    )
    print(f"\nTime to first token, {ttft['prompt_tokens']}-token prompt ({ttft['params'] / 1e6:.1f}M-parameter "
          f"Llama, f32; state file {ttft['file_bytes'] / 1e6:.1f} MB)")
    print_table(
        ["fresh prefill ms", "restored ms", "fresh / restored", "fingerprint ms (once per model)"],
        [[f"{ttft['fresh_s'] * 1e3:.1f}", f"{ttft['restored_s'] * 1e3:.1f}", f"{ttft['speedup']:.1f}x",
          f"{ttft['fingerprint_s'] * 1e3:.1f}"]],
    )
    if not args.quick:
        write_json(os.path.join(os.path.dirname(__file__), "results", "persist.json"),
                   {"machine": machine(), "throughput": rows, "time_to_first_token": ttft})


if __name__ == "__main__":
    main()

"""Decode-step time with the cache offloaded to host memory, against the cache on the device.

For each capacity, a Llama decoder's jitted, donated decode step (one token per row, at a
fill of ``--fill`` tokens) runs with a ``StaticCache`` in device memory and with an
``OffloadedCache`` in ``pinned_host`` memory (every layer copied to the device a layer
ahead of use, the new tokens written back). Prints ms per step, the ratio, the bytes one
step moves between host and device and the rate that implies.

On CPU the host and the device are the same RAM: the "copies" are memory reads, and the
ratio measures what staging a whole layer costs against attention that reads only the
filled blocks in place. On a GPU the copies cross PCIe/NVLink and the question is how much
of them the prefetch hides (``--quick`` is the short run for the device tool).

    python benchmarks/bench_offload.py [--fill 512] [--capacities 1024 4096 16384] [--batch 4]
        [--repeats 20] [--rounds 3] [--quick] [--json benchmarks/results/offload.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common import machine, print_table, time_calls, write_json
from jaxkv import StaticCache
from jaxkv.generation import decode_step, prefill
from jaxkv.models import Llama, LlamaConfig
from jaxkv.offload import OffloadedCache, host_memory_kind, step_copy_bytes

CONFIG = LlamaConfig.tiny(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32
)


def measure(model, kind: str, batch: int, fill: int, capacity: int, repeats: int, rounds: int) -> dict:
    graphdef, state = nnx.split(model)
    spec = model.cache_spec
    sizes = dict(num_layers=spec.num_layers, batch_size=batch, num_kv_heads=spec.num_kv_heads,
                 head_dim=spec.head_dim, max_length=capacity)
    cache = OffloadedCache.init(**sizes) if kind == "offloaded" else StaticCache.init(**sizes)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, CONFIG.vocab_size, (batch, fill)), jnp.int32)
    lengths = jnp.full((batch,), fill, jnp.int32)
    run_prefill = jax.jit(lambda s, i, n, c: prefill(graphdef, s, i, n, c), donate_argnums=3)
    run_step = jax.jit(lambda s, t, c: decode_step(graphdef, s, t, c), donate_argnums=2)
    token, cache = run_prefill(state, ids, lengths, cache)
    live = {"token": token, "cache": cache}
    # The first steps' tokens (compiled and checked before the clock): main() asserts that
    # both kinds of cache decode the same ones, so the two timings are of one computation.
    first = [np.asarray(token)]
    for _ in range(4):
        live["token"], live["cache"] = run_step(state, live["token"], live["cache"])
        first.append(np.asarray(live["token"]))

    def step():
        live["token"], live["cache"] = run_step(state, live["token"], live["cache"])
        live["token"].block_until_ready()

    # Other load on the machine only ever adds time: keep the best round's median.
    seconds = min(time_calls(step, repeats=repeats) for _ in range(rounds))
    out = live["cache"]
    row = {"kind": kind, "capacity": capacity, "fill": fill, "ms": seconds * 1e3,
           "first_tokens": np.stack(first, axis=1).tolist()}
    if kind == "offloaded":
        row["memory_kind"] = out.stores[0].keys.sharding.memory_kind
        row["bytes"] = step_copy_bytes(out)
    assert not np.asarray(out.flags).any(), f"{kind}: flags set {out.flags}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fill", type=int, default=512)
    parser.add_argument("--capacities", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --repeats steps; the best median is kept")
    parser.add_argument("--quick", action="store_true", help="short run (device tool): capacities 4K and 32K")
    parser.add_argument("--json", default="benchmarks/results/offload.json")
    args = parser.parse_args()
    if args.quick:
        args.capacities, args.repeats, args.rounds = [4096, 32768], 10, 1
    if host_memory_kind() is None:
        print(f"{jax.devices()[0]} has no pinned_host memory: nothing to offload to; measuring nothing.")
        return
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    rows, results = [], []
    for capacity in args.capacities:
        if capacity < args.fill + args.rounds * (args.repeats + 3) + 12:
            raise SystemExit(f"capacity {capacity} is too small for fill {args.fill} plus the timed steps")
        pair = {}
        for kind in ("device", "offloaded"):
            try:
                pair[kind] = measure(model, kind, args.batch, args.fill, capacity, args.repeats, args.rounds)
            except Exception as e:  # a backend without host compute: report it, keep going
                pair[kind] = {"kind": kind, "capacity": capacity, "error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{kind} at {capacity}: {pair[kind]['error']}")
        results.extend(pair.values())
        dev, off = pair["device"], pair["offloaded"]
        if "ms" in dev and "ms" in off:
            if dev["first_tokens"] != off["first_tokens"]:
                raise SystemExit(f"capacity {capacity}: the offloaded cache decoded other tokens than the device "
                                 f"cache ({off['first_tokens']} against {dev['first_tokens']}): not one computation")
            moved = off["bytes"]["to_device"] + off["bytes"]["to_host"]
            rows.append([
                capacity, f"{dev['ms']:.2f}", f"{off['ms']:.2f}", f"{off['ms'] / dev['ms']:.2f}x",
                f"{off['bytes']['to_device'] / 2**20:.1f}", f"{off['bytes']['to_host'] / 2**10:.1f}",
                f"{moved / (off['ms'] * 1e-3) / 1e9:.1f}",
            ])
    print(f"decode step, batch {args.batch}, fill {args.fill}, {CONFIG.num_layers} layers x {CONFIG.num_kv_heads} "
          f"kv heads x {CONFIG.head_dim} dims, f32, on {jax.devices()[0].device_kind}")
    print_table(
        ["capacity", "device ms", "offloaded ms", "ratio", "to device MiB/step", "to host KiB/step", "moved GB/s"],
        rows,
    )
    write_json(args.json, {"machine": machine(), "config": str(CONFIG), "batch": args.batch, "results": results})


if __name__ == "__main__":
    main()

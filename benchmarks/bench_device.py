"""The prepared accelerator run (issue 7, goal 7): every performance table on one device.

Meant to be run once, as is, on a GPU (or TPU) machine, and to finish in a few minutes:

    python benchmarks/bench_device.py --json "$OUT/device.json"

It runs, on ``jax.devices()[0]``, the same measurements as the CPU benchmarks, side by side
in one run:

1. capacity independence: one decode step at fill 1K, capacity 1K-64K, blockwise vs masked
   attention (``bench_attention.capacity_table``);
2. bandwidth: blockwise attention of one token over 8 layers x 32K tokens at batch 1 and 8
   against a jitted ``jnp.sum`` over the same bytes (on a GPU: the HBM read rate);
3. the donated 1000-step decode loop: traces, programs, cache-sized copies, flat time;
4. decode step time of ``jaxkv.generate`` against Flax NNX's cache on the same config
   (transformers is left out: its GPU build is not what this project installs), with the
   read floor of ``bench_generate``.

``--quick`` shrinks every size (a smoke run for CPU, a minute). The JSON holds the device
description, so GPU figures can sit beside the CPU ones in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402

import bench_attention as ba  # noqa: E402
import bench_generate as bg  # noqa: E402
from common import machine, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke run")
    parser.add_argument("--json", default=None, help="where to write the figures (default: results/device_<backend>.json)")
    args = parser.parse_args()
    backend = jax.default_backend()
    start = time.perf_counter()
    print(f"device: {jax.devices()[0]} (backend {backend}, {jax.device_count()} device(s))")
    if args.quick:
        capacities, bw, loop = [1024, 4096], dict(layers=2, tokens=4096, batches=[1]), dict(capacities=[2048, 8192], steps=50)
        cells, steps = [(1, 256)], 16
    else:
        capacities, bw, loop = [1024, 4096, 16384, 65536], dict(layers=8, tokens=32768, batches=[1, 8]), dict(
            capacities=[2048, 65536], steps=1000)
        cells, steps = [(1, 128), (1, 1024), (1, 4096), (8, 128), (8, 1024), (8, 4096)], 128
    payload = {"machine": machine(), "device": str(jax.devices()[0])}
    payload["capacity"] = ba.capacity_table(capacities, fill=1024, repeats=30)
    payload["bandwidth"] = ba.bandwidth_table(repeats=10, profile=backend == "cpu", **bw)
    payload["loop"] = ba.loop_table(fill=1024, **loop)
    generate = bg.run_benchmark(bg.FULL, cells, steps=steps, repeats=3, strategies=("jaxkv", "nnx"))
    bg.report(generate)
    payload["generate"] = generate
    payload["wall_s"] = time.perf_counter() - start
    print(f"total {payload['wall_s']:.0f} s")
    write_json(args.json or str(HERE / "results" / f"device_{backend}{'_quick' if args.quick else ''}.json"), payload)


if __name__ == "__main__":
    main()

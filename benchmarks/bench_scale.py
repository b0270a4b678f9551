"""Generation throughput on 1, 2, 4 and 8 devices (data-parallel, and data x model-parallel).

Runs ``jaxkv.generate`` on a mesh (``jaxkv.distributed``: tensor-parallel weights, cache
split by rows and kv heads, rows split over the data axis) and prints generated tokens
per second for each mesh: the best of ``--repeats`` alternating rounds of compiled calls.

On this machine the "devices" are virtual CPU devices (``--xla_force_host_platform_device_count``)
sharing 2 cores: more devices cannot be faster here. The figures measure the overhead of
partitioning (collectives, smaller per-device work), not a speedup. On real accelerators
the same script measures scaling.

    python benchmarks/bench_scale.py [--batch 8] [--new-tokens 32] [--repeats 5]
        [--json benchmarks/results/scale.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--child" not in sys.argv and "jax" not in sys.modules:
    # The device count is fixed when jax starts: run the measurement in a child process.
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(subprocess.call([sys.executable, __file__, "--child", *sys.argv[1:]], env=env))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from flax import nnx

import jaxkv
from common import machine, print_table, write_json
from jaxkv.distributed import make_mesh, place, sharded_model
from jaxkv.models import Llama, LlamaConfig
from jax.sharding import NamedSharding, PartitionSpec as P

CONFIG = LlamaConfig.tiny(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32
)
MESHES = ((1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (8, 1), (4, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds; the best is kept")
    parser.add_argument("--json", default="benchmarks/results/scale.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    largest_data_axis = max(data for data, model_axis in MESHES if data * model_axis <= jax.device_count())
    if args.batch < 1 or args.batch % largest_data_axis:
        parser.error(f"--batch must be a multiple of {largest_data_axis} (the largest data axis of the meshes run "
                     f"here), got {args.batch}")
    ids = np.random.default_rng(0).integers(1, CONFIG.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    lengths = np.full((args.batch,), args.prompt, np.int32)
    runs = []
    for data, model_axis in MESHES:
        if data * model_axis > jax.device_count():
            continue
        mesh = make_mesh(data, model_axis)
        model = sharded_model(Llama(CONFIG, rngs=nnx.Rngs(0)), mesh)
        replicated = NamedSharding(mesh, P())
        placed = place(ids, replicated), place(lengths, replicated)

        def run(model=model, placed=placed):
            out = jaxkv.generate(model, placed[0], args.new_tokens, prompt_lengths=placed[1])
            return np.asarray(out.tokens)

        runs.append((data, model_axis, run, run()))  # the first call compiles
    # Alternating rounds, best per mesh: other load on the machine hits every mesh alike.
    best = [float("inf")] * len(runs)
    for _ in range(args.repeats):
        for i, (_, _, run, _) in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    rows, results = [], []
    reference = runs[0][3]
    for (data, model_axis, _, tokens), seconds in zip(runs, best):
        same = bool((tokens == reference).all())
        rate = args.batch * args.new_tokens / seconds
        base = args.batch * args.new_tokens / best[0]
        results.append({"devices": data * model_axis, "data": data, "model": model_axis, "seconds": seconds,
                        "tokens_per_s": rate, "same_tokens_as_one_device": same})
        rows.append([data * model_axis, f"{data} x {model_axis}", f"{seconds * 1e3:.0f}", f"{rate:.0f}",
                     f"{rate / base:.2f}x", "yes" if same else "NO"])
    print(f"generate: batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"{CONFIG.num_layers} layers, hidden {CONFIG.hidden_size}; {os.cpu_count()} CPU cores shared by all devices")
    print_table(["devices", "data x model", "ms", "tokens/s", "vs 1 device", "same tokens"], rows)
    write_json(args.json, {"machine": machine(), "config": str(CONFIG), "results": results})


if __name__ == "__main__":
    main()

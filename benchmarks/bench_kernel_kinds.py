"""Decode attention over one layer, the CPU kernel against the XLA loop, for every row kind the
kernel reads: float32, bfloat16, int8 and int4 codes (bf16 scales), and int4 with a residual.

One query per row, ``--groups`` query heads per kv head, ``--heads`` kv heads, ``--fill``
tokens held of ``--capacity``; median of ``--repeats`` jitted calls, both implementations in
this one run (the machine is shared: compare the ratio). The bytes column is what the kernel
reads per call (codes, scales and residual of the filled slots).

    python benchmarks/bench_kernel_kinds.py [--fill 1024] [--capacity 2048] [--repeats 50]
        [--json benchmarks/results/kernel_kinds.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import machine, print_table, time_calls, write_json  # noqa: E402

from jaxkv import QuantizedCache, _kernels  # noqa: E402
from jaxkv.attention.blockwise import blockwise_attend, quantized_blockwise_attend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fill", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default="benchmarks/results/kernel_kinds.json")
    args = parser.parse_args()
    if not _kernels.available():
        sys.exit("the CPU kernel is unavailable here (no compiler, or JAXKV_CPU_KERNEL=0): nothing to compare")
    batch, heads, dim, fill = 1, args.heads, args.head_dim, args.fill
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, heads * args.groups, 1, dim)), jnp.float32)
    q_pos = jnp.full((batch, 1), fill - 1, jnp.int32)
    lengths = jnp.full((batch,), fill, jnp.int32)
    tokens = jnp.asarray(rng.standard_normal((batch, heads, fill, dim)), jnp.float32)

    def float_case(dtype):
        keys = jnp.zeros((1, batch, heads, args.capacity, dim), dtype).at[0, :, :, :fill].set(tokens.astype(dtype))

        def run(implementation):
            f = jax.jit(lambda q, k: blockwise_attend(q, k, k, layer_idx=0, q_positions=q_pos, kv_lengths=lengths,
                                                      implementation=implementation))
            return lambda: f(q, keys).block_until_ready()

        return run, 2 * fill * heads * dim * jnp.dtype(dtype).itemsize

    def quantized_case(bits, residual):
        cache = QuantizedCache.init(num_layers=1, batch_size=batch, num_kv_heads=heads, head_dim=dim,
                                    max_length=args.capacity, bits=bits, residual_length=residual)
        cache, _, _ = jax.jit(lambda c: c.update(tokens, tokens, 0))(cache)

        def run(implementation):
            f = jax.jit(lambda q, cache: quantized_blockwise_attend(q, cache.view(0), q_positions=q_pos,
                                                                    implementation=implementation))
            return lambda: f(q, cache).block_until_ready()

        code_bytes = fill * heads * dim * bits // 8 + fill * heads * 2  # codes + bf16 scales
        return run, 2 * (code_bytes + residual * heads * dim * 4)

    cases = {
        "float32": lambda: float_case(jnp.float32),
        "bfloat16": lambda: float_case(jnp.bfloat16),
        "int8": lambda: quantized_case(8, 0),
        "int4": lambda: quantized_case(4, 0),
        "int4 + residual 128": lambda: quantized_case(4, 128),
    }
    rows, records = [], []
    for name, make in cases.items():
        run, nbytes = make()
        # The two compute the same attention (checked before timing; review 69): the kernel
        # and the loop read the same codes, so they differ by float rounding only.
        diff = float(jnp.max(jnp.abs(run("kernel")().astype(jnp.float32) - run("xla")().astype(jnp.float32))))
        if not diff < 5e-2:
            raise SystemExit(f"{name}: the kernel and the XLA loop differ by {diff}: not one computation")
        kernel = time_calls(run("kernel"), repeats=args.repeats)
        xla = time_calls(run("xla"), repeats=args.repeats)
        rows.append([name, f"{nbytes / 2**20:.2f}", f"{kernel * 1e3:.3f}", f"{xla * 1e3:.3f}", f"{xla / kernel:.2f}x",
                     f"{nbytes / kernel / 1e9:.1f}", f"{diff:.1e}"])
        records.append(dict(kind=name, bytes=nbytes, kernel_s=kernel, xla_s=xla, xla_over_kernel=xla / kernel,
                            max_abs_diff=diff))
    print(f"\none query per row, {heads} kv heads x {args.groups} query heads each, head_dim {dim}, {fill} of "
          f"{args.capacity} tokens held; median of {args.repeats} calls")
    print_table(["kind", "MiB read", "kernel ms", "XLA loop ms", "XLA / kernel", "kernel GB/s", "max abs diff"], rows)
    write_json(args.json, dict(machine=machine(), args=vars(args), rows=records))


if __name__ == "__main__":
    main()

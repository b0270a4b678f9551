"""The prepared accelerator run (issue 7, goal 7): every performance table on one device.

Meant to be run once, as is, on a GPU (or TPU) machine, and to finish in a few minutes:

    python benchmarks/bench_device.py --json "$OUT/device.json"

It runs, on ``jax.devices()[0]``, side by side in one run:

0. issue 14, decode attention kernels (:mod:`jaxkv.attention.pallas_gpu`): one decode token
   over L layers x 32K filled tokens at batch 1 and 8, for a float32, a bfloat16 and an int8
   cache (bf16 model, per-token bf16 scales): the Pallas split-K kernel, the blockwise XLA
   loop, cuDNN (``jax.nn.dot_product_attention(implementation="cudnn",
   key_value_seq_lengths=...)``, over its own [B, S, H, D] copy of the cache; where it
   refuses an input the reason is printed), JAX's reference Pallas decode kernel
   (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``, on the same copy) and masked attention over the whole buffer, each
   as GB/s of cache bytes (codes + scales for int8) and as % of a jitted ``jnp.sum`` over
   the same arrays; then fill 1K at capacities 1K..64K, kernel vs masked vs XLA loop. Heads
   are the Llama-3.2-1B shape (32 query / 8 kv heads, head dim 64). Off a GPU the kernel
   runs in Pallas interpret mode (correct but not a speed: the table says so);
1. capacity independence: one decode step at fill 1K, capacity 1K-64K, blockwise vs masked
   attention (``bench_attention.capacity_table``);
2. bandwidth: blockwise attention of one token over 8 layers x 32K tokens at batch 1 and 8
   against a jitted ``jnp.sum`` over the same bytes (on a GPU: the HBM read rate);
3. the donated 1000-step decode loop: traces, programs, cache-sized copies, flat time;
4. decode step time of ``jaxkv.generate`` against Flax NNX's cache on the same config
   (transformers is left out: its GPU build is not what this project installs), with the
   read floor of ``bench_generate``;
5. ``llama1b`` (:mod:`bench_llama1b`): a Llama-3.2-1B-shaped bfloat16 model, jaxkv (both layer
   layouts) against its read floor and transformers' static cache eager and with
   ``torch.compile``, batch 1 and 32 with 1K prompts, and the first ``generate`` call's time;
6. ``xla`` (:func:`bench_llama1b.run_xla_variants`): the same model's decode step, both layouts,
   under XLA options side by side in one process (default, dynamic-slice fusion, command
   buffers with the loop inside them, both, no autotuning), against the read floor, with
   each decode program's first run (its compile);
7. ``sweep``: the Pallas kernel's launch options (``--sweep-set``).

``--quick`` shrinks every size (a smoke run for CPU, a minute). ``--sections`` picks parts
(``kernels`` is part 0; default: all). They run in the order of ``SECTIONS`` (kernels, llama1b,
xla, sweep, capacity, loop, bandwidth, generate: the issue's goals first), each on its own: one that fails
is recorded under ``errors`` and the others run; the JSON is rewritten after every section,
so a run cut short by the device's time limit keeps what it finished. The JSON holds the device description, so GPU
figures can sit beside the CPU ones in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_attention as ba  # noqa: E402
import bench_generate as bg  # noqa: E402
import bench_llama1b  # noqa: E402
from common import machine, print_table, time_calls, write_json  # noqa: E402
from jaxkv.attention import attend, blockwise_attend, pallas_attend_view, quantized_blockwise_attend  # noqa: E402
from jaxkv.caches._bits import from_bits  # noqa: E402
from jaxkv.caches.quantized import dequantize  # noqa: E402
from jaxkv.caches.views import ContiguousView, QuantizedView  # noqa: E402

# Issue-14 tables: the Llama-3.2-1B attention shape.
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
SECTIONS = ("kernels", "llama1b", "xla", "sweep", "capacity", "loop", "bandwidth", "generate")  # run in this order


def _kv_buffers(kind, layers, batch, capacity, seed=0):
    """Stacked cache arrays as jaxkv stores them (drawn on the device: a batch-8 f32 cache
    at 32K is 8.6 GB), and the bytes a full read touches."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (layers, batch, KV_HEADS, capacity, HEAD_DIM)
    if kind == "int8":
        codes = [jax.random.randint(k, shape, -127, 128, jnp.int8) for k in keys[:2]]
        scales = [jax.lax.bitcast_convert_type(jax.random.uniform(k, shape[:-1], jnp.float32, 0.005, 0.02)
                                               .astype(jnp.bfloat16), jnp.uint16) for k in keys[2:]]
        return dict(codes=codes, scales=scales), sum(x.nbytes for x in codes + scales)
    dtype = _model_dtype(kind)
    arrays = [jax.random.normal(k, shape, dtype) for k in keys[:2]]
    if dtype == jnp.bfloat16:  # as StaticCache keeps it: uint16 bits
        arrays = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in arrays]
    return dict(kv=arrays), sum(x.nbytes for x in arrays)


def _model_dtype(kind):
    return jnp.float32 if kind == "f32" else jnp.bfloat16


def _view(kind, buffers, layer, lengths):
    if kind == "int8":
        (kc, vc), (ks, vs) = buffers["codes"], buffers["scales"]
        batch = kc.shape[1]
        empty = jnp.zeros((batch, KV_HEADS, 0, HEAD_DIM), jnp.bfloat16)
        return QuantizedView(kc, vc, ks, vs, empty, empty, jnp.zeros((batch, 0), jnp.int32), layer, lengths, 8,
                             jnp.bfloat16, jnp.bfloat16)
    keys, values = buffers["kv"]
    return ContiguousView(keys, values, layer, lengths, _model_dtype(kind))


def _dense_layer(view):
    """The layer as a float array, read whole (what masked attention and cuDNN consume)."""
    if isinstance(view, QuantizedView):
        return tuple(dequantize(c[view.layer], from_bits(s[view.layer], jnp.bfloat16), 8, jnp.bfloat16)
                     for c, s in ((view.keys, view.key_scales), (view.values, view.value_scales)))
    return tuple(from_bits(x[view.layer], view.dtype) for x in (view.keys, view.values))


def _strategies(kind, interpret):
    """name -> fn(q, q_pos, view) for one layer; cuDNN gets [B, S, H, D] arrays instead."""
    def pallas(q, pos, view):
        return pallas_attend_view(q, view, q_positions=pos, interpret=interpret)

    def xla(q, pos, view):
        if isinstance(view, QuantizedView):
            return quantized_blockwise_attend(q, view, q_positions=pos)
        return blockwise_attend(q, view.keys, view.values, layer_idx=view.layer, q_positions=pos,
                                kv_lengths=view.lengths, implementation="xla", kv_dtype=view.dtype)

    def masked(q, pos, view):
        keys, values = _dense_layer(view)
        return attend(q, keys, values, q_positions=pos, kv_lengths=view.lengths)

    return {"pallas kernel": pallas, "XLA loop": xla, "masked": masked}


def _cudnn_step(layers):
    """One token over every layer with cuDNN's fused attention, on [B, S, H, D] arrays
    (its layout: jaxkv's cache would need a transposed copy, so it gets its own)."""
    def step(q, keys, values, lengths):  # q [B, 1, Hq, D]; keys/values: lists of [B, S, H, D]
        return jnp.stack([jax.nn.dot_product_attention(q, keys[i], values[i], key_value_seq_lengths=lengths,
                                                       implementation="cudnn") for i in range(layers)])
    return jax.jit(step)


def _jax_gqa_step(layers):
    """One token over every layer with ``jax.experimental.pallas.ops.gpu.decode_attention.gqa``
    (JAX's reference split-K kernel, its defaults), on [B, S, H, D] arrays: how far a Pallas
    (Triton) kernel gets on this shape, beside jaxkv's."""
    from jax.experimental.pallas.ops.gpu.decode_attention import gqa

    def step(q, keys, values, lengths):  # q [B, Hq, D]
        return jnp.stack([gqa(q, keys[i], values[i], kv_seq_len=lengths) for i in range(layers)])
    return jax.jit(step)


def decode_kernel_tables(*, layers, tokens, batches, kinds, capacities, capacity_kinds, fill, repeats):
    """Issue 14's figures: GB/s of each decode-attention strategy against jnp.sum, and
    fill-1K step times against capacity. Interleaved rounds, best of 3 (a slow spell of a
    shared machine then hits every column, not one)."""
    backend = jax.default_backend()
    interpret = backend != "gpu"
    note = " (Pallas INTERPRET mode: a correctness run, not a speed)" if interpret else ""
    rows, results = [], {"bandwidth": [], "capacity": {}, "interpret": interpret}
    for kind in kinds:
        for batch in batches:
            buffers, nbytes = _kv_buffers(kind, layers, batch, tokens)
            lengths = jnp.full((batch,), tokens, jnp.int32)
            pos = jnp.full((batch, 1), tokens - 1, jnp.int32)
            q = jnp.asarray(np.random.default_rng(2).standard_normal((batch, Q_HEADS, 1, HEAD_DIM)), _model_dtype(kind))
            calls, skipped, outputs = {}, {}, {}
            for name, fn in _strategies(kind, interpret).items():
                def all_layers(q, buffers, fn=fn):
                    return jnp.stack([fn(q, pos, _view(kind, buffers, i, lengths)) for i in range(layers)])
                step = jax.jit(all_layers)
                calls[name] = lambda step=step: step(q, buffers).block_until_ready()
                if name in ("pallas kernel", "XLA loop"):
                    try:  # a first compile by Triton may fail: the cell says why, the table goes on
                        outputs[name] = np.asarray(step(q, buffers), np.float32)
                    except Exception as err:  # noqa: BLE001
                        skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            arrays = [x for group in buffers.values() for x in group]
            read = jax.jit(lambda arrays: sum(jnp.sum(x, dtype=jnp.float32 if x.dtype == jnp.float32 else jnp.int32)
                                              for x in arrays))
            calls["jnp.sum"] = lambda: read(arrays).block_until_ready()
            if backend != "gpu":
                for name in ("cuDNN", "JAX gqa kernel"):
                    skipped[name] = f"needs a CUDA GPU (backend here: {backend})"
            else:
                # Both read their own [B, S, H, D] copy of the layers (int8: dequantized).
                dense = [_dense_layer(_view(kind, buffers, i, lengths)) for i in range(layers)]
                keys = [k.transpose(0, 2, 1, 3) for k, _ in dense]
                values = [v.transpose(0, 2, 1, 3) for _, v in dense]
                del dense
                others = {"cuDNN": (_cudnn_step(layers), q.transpose(0, 2, 1, 3)),
                          "JAX gqa kernel": (_jax_gqa_step(layers), q[:, :, 0])}
                for name, (step, q_in) in others.items():
                    try:  # cuDNN refuses some shapes/dtypes: say why
                        step(q_in, keys, values, lengths).block_until_ready()
                        calls[name] = (lambda step=step, q_in=q_in:
                                       step(q_in, keys, values, lengths).block_until_ready())
                    except Exception as err:  # noqa: BLE001
                        skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            best = {}
            for _ in range(3):
                for name, call in calls.items():
                    if name in skipped:
                        continue
                    try:
                        t = time_calls(call, repeats=repeats, warmup=1 if interpret else 3)
                    except Exception as err:
                        skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                        continue
                    best[name] = min(t, best.get(name, t))
            # The kernel must compute what the XLA loop computes, at this size too.
            agreement = (float(np.max(np.abs(outputs["pallas kernel"] - outputs["XLA loop"])))
                         if len(outputs) == 2 else float("nan"))
            row = dict(kind=kind, batch=batch, cache_mb=nbytes / 2**20, kernel_vs_loop_max_abs=agreement,
                       gbs={name: nbytes / t / 1e9 for name, t in best.items()},
                       ms={name: t * 1e3 for name, t in best.items()}, skipped=skipped)
            results["bandwidth"].append(row)
            del buffers, arrays, calls
    print(f"\n0a. Decode attention, 1 token x {layers} layers x {tokens} filled tokens, {Q_HEADS}/{KV_HEADS} heads, "
          f"D={HEAD_DIM}: GB/s of cache bytes and % of jnp.sum over the same arrays{note}")
    names = ["pallas kernel", "XLA loop", "cuDNN", "JAX gqa kernel", "masked"]
    headers = ["cache", "batch", "MB", "jnp.sum GB/s"] + [f"{n} GB/s (%)" for n in names] + ["kernel vs loop, max abs diff"]
    for r in results["bandwidth"]:
        ref = r["gbs"].get("jnp.sum")
        cells = [r["kind"], r["batch"], f"{r['cache_mb']:.0f}", f"{ref:.1f}" if ref else "-"]
        for n in names:
            cells.append(f"{r['gbs'][n]:.1f} ({r['gbs'][n] / ref * 100:.0f}%)" if n in r["gbs"] and ref else "skipped")
        rows.append(cells + [f"{r['kernel_vs_loop_max_abs']:.1e}"])
    print_table(headers, rows)
    print("   GB/s = the cache's bytes (int8: codes + scales) / time, for every column; masked attention and cuDNN "
          "read float copies (cuDNN and JAX's gqa kernel: their own [B, S, H, D] arrays; int8: dequantized to bf16)")
    for r in results["bandwidth"]:
        for name, why in r["skipped"].items():
            print(f"   {r['kind']} batch {r['batch']}: {name} skipped: {why}")

    # Fill 1K: the step must not grow with capacity, and beat masked attention everywhere.
    table = {}
    for kind in capacity_kinds:
        inputs = {}
        for capacity in capacities:
            buffers, _ = _kv_buffers(kind, 1, 1, capacity)
            q = jnp.ones((1, Q_HEADS, 1, HEAD_DIM), _model_dtype(kind))
            inputs[capacity] = (q, buffers)
        lengths, pos = jnp.full((1,), fill, jnp.int32), jnp.full((1, 1), fill - 1, jnp.int32)
        steps = {name: jax.jit(lambda q, buffers, fn=fn: fn(q, pos, _view(kind, buffers, 0, lengths)))
                 for name, fn in _strategies(kind, interpret).items()}
        times = {name: {} for name in steps}
        for _ in range(3):
            for name, step in steps.items():
                for capacity, args in inputs.items():
                    try:
                        t = time_calls(lambda: step(*args).block_until_ready(), repeats=repeats,
                                       warmup=1 if interpret else 3)
                    except Exception as err:  # noqa: BLE001  (printed once; the cell reads nan)
                        if capacity not in times[name]:
                            print(f"   0b {kind} {name} capacity {capacity} failed: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:160]}")
                        t = float("nan")
                    times[name][capacity] = t if np.isnan(t) else min(t, times[name].get(capacity, t))
        table[kind] = times
        del inputs
    print(f"\n0b. One decode step at fill {fill}, batch 1, one layer, capacity {capacities[0]}..{capacities[-1]} "
          f"(us; best of 3 interleaved rounds){note}")
    headers = ["cache", "strategy"] + [f"cap {c}" for c in capacities] + [f"{capacities[-1]} / {capacities[0]}"]
    rows = []
    for kind, times in table.items():
        for name, row in times.items():
            rows.append([kind, name] + [f"{row[c] * 1e6:.0f}" for c in capacities]
                        + [f"{row[capacities[-1]] / row[capacities[0]]:.2f}x"])
    print_table(headers, rows)
    results["capacity"] = {kind: {name: {str(c): t for c, t in row.items()} for name, row in times.items()}
                           for kind, times in table.items()}
    results["shape"] = dict(layers=layers, tokens=tokens, batches=batches, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                            head_dim=HEAD_DIM, fill=fill, capacities=capacities)
    return results


def kernel_sweep(*, layers, tokens, cases, configs, repeats, budget_s):
    """The kernel's launch options against its read rate: one decode token over ``layers`` x
    ``tokens`` filled tokens per case (kind, batch), for each config (block_k, num_splits,
    num_warps, num_stages), as GB/s and % of a jitted ``jnp.sum`` over the same arrays, with
    each config's max abs difference from the default config's output (same function, other
    blocking). Stops starting configs after ``budget_s`` seconds (the table says how many ran)."""
    interpret = jax.default_backend() != "gpu"
    begun, results = time.perf_counter(), []
    for kind, batch in cases:
        buffers, nbytes = _kv_buffers(kind, layers, batch, tokens)
        lengths = jnp.full((batch,), tokens, jnp.int32)
        pos = jnp.full((batch, 1), tokens - 1, jnp.int32)
        q = jnp.asarray(np.random.default_rng(2).standard_normal((batch, Q_HEADS, 1, HEAD_DIM)), _model_dtype(kind))
        arrays = [x for group in buffers.values() for x in group]
        read = jax.jit(lambda arrays: sum(jnp.sum(x, dtype=jnp.float32 if x.dtype == jnp.float32 else jnp.int32)
                                          for x in arrays))
        sum_s = min(time_calls(lambda: read(arrays).block_until_ready(), repeats=repeats, warmup=3) for _ in range(2))
        reference = None
        for config in configs:
            if time.perf_counter() - begun > budget_s:
                break
            options = {k: v for k, v in config.items() if v is not None}

            def all_layers(q, buffers, options=options):
                return jnp.stack([pallas_attend_view(q, _view(kind, buffers, i, lengths), q_positions=pos,
                                                     interpret=interpret, **options) for i in range(layers)])

            step = jax.jit(all_layers)
            row = dict(kind=kind, batch=batch, cache_mb=nbytes / 2**20, sum_gbs=nbytes / sum_s / 1e9, **config)
            try:
                out = np.asarray(step(q, buffers), np.float32)
                reference = out if reference is None else reference
                row["max_abs_vs_first"] = float(np.max(np.abs(out - reference)))
                t = min(time_calls(lambda: step(q, buffers).block_until_ready(), repeats=repeats, warmup=2)
                        for _ in range(2))
                row.update(gbs=nbytes / t / 1e9, us=t * 1e6)
            except Exception as err:  # noqa: BLE001  (a config Triton refuses: say why, go on)
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            results.append(row)
            print(f"   sweep {kind} B={batch} {config}: " + (f"{row['gbs']:.0f} GB/s ({row['gbs'] / row['sum_gbs']:.0%} "
                  f"of sum), max abs vs first {row['max_abs_vs_first']:.1e}" if "gbs" in row else row["error"]),
                  flush=True)
        del buffers, arrays
    print(f"\nS. Kernel launch options, 1 token x {layers} layers x {tokens} tokens, {Q_HEADS}/{KV_HEADS} heads, "
          f"D={HEAD_DIM}" + (" (INTERPRET mode: not a speed)" if interpret else ""))
    rows = [[r["kind"], r["batch"], r["block_k"], r["num_splits"] or "auto", r["num_warps"], r["num_stages"],
             r.get("f32_precision", "highest") + ("" if r.get("full_blocks", True) else ", all masked"),
             f"{r['sum_gbs']:.0f}", f"{r['gbs']:.0f}" if "gbs" in r else "-",
             f"{r['gbs'] / r['sum_gbs']:.0%}" if "gbs" in r else r.get("error", "-")[:40]] for r in results]
    print_table(["cache", "batch", "block_k", "splits", "warps", "stages", "f32 products / blocks", "sum GB/s",
                 "kernel GB/s", "% of sum"], rows)
    best = {}
    for r in results:
        if "gbs" in r and r["gbs"] > best.get((r["kind"], r["batch"]), {}).get("gbs", 0):
            best[(r["kind"], r["batch"])] = r
    for (kind, batch), r in best.items():
        print(f"   best {kind} B={batch}: block_k {r['block_k']}, splits {r['num_splits'] or 'auto'}, warps "
              f"{r['num_warps']}, stages {r['num_stages']}, f32 products {r.get('f32_precision', 'highest')}: "
              f"{r['gbs'] / r['sum_gbs']:.0%} of sum")
    return {"rows": results, "configs_run": len(results), "budget_s": budget_s}


def sweep_configs(quick, which="launch"):
    """``launch``: block size, warps and stages (run B of 2026-12-04: nothing beat the
    defaults). ``splits``: more programs than the default's 512 (64 splits at batch 1 x 8
    kv heads, 8 at batch 8), and 2 warps for the 16 padded query rows: whether the kernel is
    short of memory-level parallelism (programs in flight per SM) rather than of bandwidth."""
    if quick:
        return ([dict(block_k=b, num_splits=None, num_warps=4, num_stages=2) for b in (16, 32)]
                + [dict(block_k=16, num_splits=None, num_warps=4, num_stages=2, f32_precision="tf32x3")])
    if which == "splits":
        # first (the budget may cut the list): the default; every block masked (the kernel
        # before 2026-12-05's whole-block loop); 3 stages (with 2, Triton waits for the
        # next block's copy before any work overlaps it: ``cp.async.wait_group 0`` in
        # scripts/kernel_ptx.py's PTX); float32 products as three TF32 tensor-core products
        return ([dict(block_k=64, num_splits=None, num_warps=4, num_stages=2),
                 dict(block_k=64, num_splits=None, num_warps=4, num_stages=2, full_blocks=False),
                 dict(block_k=64, num_splits=None, num_warps=4, num_stages=3),
                 dict(block_k=64, num_splits=None, num_warps=4, num_stages=2, f32_precision="tf32x3")]
                + [dict(block_k=64, num_splits=n, num_warps=4, num_stages=2) for n in (32, 128, 256, 512)]
                + [dict(block_k=64, num_splits=n, num_warps=2, num_stages=2) for n in (None, 128, 256)]
                + [dict(block_k=32, num_splits=n, num_warps=2, num_stages=3) for n in (256, 512)])
    configs = [dict(block_k=b, num_splits=None, num_warps=w, num_stages=st)
               for b in (64, 128, 256) for st in (2, 4) for w in (4, 8)]
    return configs + [dict(block_k=b, num_splits=16, num_warps=4, num_stages=4) for b in (128, 256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke run")
    parser.add_argument("--json", default=None, help="where to write the figures (default: results/device_<backend>.json)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--sweep-seconds", type=float, default=120.0, help="time budget of the sweep section")
    parser.add_argument("--sweep-set", choices=("launch", "splits"), default="launch",
                        help="which launch options the sweep section tries (see sweep_configs)")
    parser.add_argument("--no-hf-timing", action="store_true",
                        help="llama1b: leave out transformers' step times (its greedy tokens are still compared)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    backend = jax.default_backend()
    start = time.perf_counter()
    print(f"device: {jax.devices()[0]} (backend {backend}, {jax.device_count()} device(s))")
    if args.quick:
        kernels = dict(layers=2, tokens=1024, batches=[1], kinds=["f32", "bf16", "int8"], capacities=[1024, 4096],
                       capacity_kinds=["bf16"], fill=512, repeats=3)
        capacities, bw, loop = [1024, 4096], dict(layers=2, tokens=4096, batches=[1]), dict(capacities=[2048, 8192], steps=50)
        cells, steps = [(1, 256)], 16
    else:
        # Sized to end within the device call's 600 s with the tests (each cell compiles its
        # programs): capacities 1K / 16K / 64K answer "64K within 1.1x of 1K".
        kernels = dict(layers=8, tokens=32768, batches=[1, 8], kinds=["f32", "bf16", "int8"],
                       capacities=[1024, 16384, 65536], capacity_kinds=["f32", "bf16"], fill=1024, repeats=20)
        capacities, bw, loop = [1024, 16384, 65536], dict(layers=8, tokens=32768, batches=[1, 8]), dict(
            capacities=[2048, 65536], steps=1000)
        cells, steps = [(1, 128), (1, 1024), (1, 4096), (8, 1024)], 128
    path = args.json or str(HERE / "results" / f"device_{backend}{'_quick' if args.quick else ''}.json")
    payload = {"machine": machine(), "device": str(jax.devices()[0]), "sections": sections, "errors": {},
               "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if payload["xla_flags"]:
        print(f"XLA_FLAGS={payload['xla_flags']}")
    bg.STRICT_TOKENS = False  # a token mismatch is recorded, not fatal: the device time is one shot

    def llama1b():
        if args.quick:
            llama = bench_llama1b.run(bench_llama1b.TINY, [(1, 16)], steps=8, repeats=2, hf_compiled=False,
                                      hf_timing=not args.no_hf_timing)
        else:
            llama = bench_llama1b.run(bench_llama1b.LLAMA_1B, [(1, 128), (1, 1024), (32, 1024)], steps=32, repeats=3,
                                      hf_compiled=backend == "gpu", hf_timing=not args.no_hf_timing)
        bench_llama1b.report(llama)
        return llama

    def xla():
        if args.quick:
            variants = bench_llama1b.run_xla_variants(bench_llama1b.TINY, [(1, 16)], steps=8, repeats=2)
        else:
            variants = bench_llama1b.run_xla_variants(bench_llama1b.LLAMA_1B, [(1, 128), (32, 1024)], steps=32,
                                                      repeats=3)
        bench_llama1b.report_xla(variants)
        return variants

    def generate():
        table = bg.run_benchmark(bg.FULL, cells, steps=steps, repeats=3, strategies=("jaxkv", "nnx"))
        bg.report(table)
        return table

    sweep = dict(layers=2, tokens=1024, cases=[("bf16", 1), ("f32", 1)], repeats=3) if args.quick else dict(
        layers=8, tokens=32768, cases=[("bf16", 1), ("bf16", 8), ("f32", 1), ("int8", 8)], repeats=10)
    run = {
        "sweep": lambda: kernel_sweep(configs=sweep_configs(args.quick, args.sweep_set), budget_s=args.sweep_seconds, **sweep),
        "kernels": lambda: decode_kernel_tables(**kernels),
        "llama1b": llama1b,
        "xla": xla,
        "capacity": lambda: ba.capacity_table(capacities, fill=1024, repeats=30),
        "loop": lambda: ba.loop_table(fill=1024, **loop),
        "bandwidth": lambda: ba.bandwidth_table(repeats=10, profile=backend == "cpu", **bw),
        "generate": generate,
    }
    # In the order of SECTIONS (the goals first), each on its own: a section that
    # fails is recorded and the others still run, and the JSON is written after every one,
    # so a run stopped by the device tool's time limit keeps what it finished.
    for name in [s for s in SECTIONS if s in sections]:
        begun = time.perf_counter()
        try:
            payload[name] = run[name]()
        except Exception as err:  # noqa: BLE001  (recorded, printed, and the run goes on)
            payload["errors"][name] = f"{type(err).__name__}: {err}"
            print(f"SECTION {name} FAILED: {type(err).__name__}: {err}")
            traceback.print_exc()
        payload.setdefault("section_s", {})[name] = time.perf_counter() - begun
        payload["token_mismatches"] = bg.TOKEN_MISMATCHES
        payload["wall_s"] = time.perf_counter() - start
        write_json(path, payload)
        print(f"[{name}: {payload['section_s'][name]:.0f} s; {payload['wall_s']:.0f} s so far; written to {path}]")
    print(f"total {payload['wall_s']:.0f} s" + (f"; failed sections: {sorted(payload['errors'])}" if payload["errors"] else ""))

if __name__ == "__main__":
    main()

"""The Pallas decode kernel's PTX for an H100/H200 (sm_90), made on a machine without a GPU.

The kernel cannot be timed here, but what it asks of the GPU per block of slots can be read:
this script lowers ``jaxkv.attention.pallas_gpu``'s kernel for CUDA (Pallas -> Triton IR, as
``tests/test_pallas_gpu.py`` does), compiles that IR with the ``triton`` package for sm_90
(Triton's own passes and LLVM's NVPTX backend; no GPU needed), and counts the instructions of
each block loop (the basic blocks of each inner loop of the PTX) by kind, with the pipelining the
compiler chose (``cp.async.wait_group N``: with N = 0 the next block's copy is waited for
before any work overlaps it).

An older kernel: ``git show REV:jaxkv/attention/pallas_gpu.py > jaxkv/attention/pallas_gpu.py``,
run this, ``git checkout jaxkv/attention/pallas_gpu.py``.

XLA compiles the same Triton IR with its own copy of Triton's passes, so counts here are a
proxy for what runs on the device, not a measurement; ``benchmarks/bench_device.py`` times it.

    pip install triton==3.6.0            # the compiler only (no torch); any machine
    python scripts/kernel_ptx.py [--kind bf16|f32|int8] [--softcap] [--f32-precision highest|tf32x3]
                                 [--warps 4] [--stages 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def triton_ir(kind: str, softcap: bool, f32_precision: str = "highest", shape=(8, 1, 8, 32768, 64)) -> str:
    """The kernel's Triton IR (text) for a bench_device-shaped call: L, B, H, S, D; G = 4."""
    from jax._src.pallas.triton import lowering

    from jaxkv.attention.pallas_gpu import pallas_attend_view
    from jaxkv.caches.views import ContiguousView, QuantizedView

    layers, batch, heads, slots, dim = shape
    sds = jax.ShapeDtypeStruct
    q_dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
    q, pos = sds((batch, 4 * heads, 1, dim), q_dtype), sds((batch, 1), jnp.int32)
    lengths, layer = sds((batch,), jnp.int32), sds((), jnp.int32)
    options = dict(logit_softcap=30.0 if softcap else None)
    if f32_precision != "highest":  # only then: the kernel of an older commit has no such option
        options["f32_precision"] = f32_precision
    if kind in ("bf16", "f32"):
        stored = jnp.uint16 if kind == "bf16" else jnp.float32
        arrays = [sds((layers, batch, heads, slots, dim), stored)] * 2

        def attend(q, pos, keys, values, lengths, layer):
            view = ContiguousView(keys, values, layer, lengths, jnp.bfloat16 if kind == "bf16" else jnp.float32)
            return pallas_attend_view(q, view, q_positions=pos, **options)
    elif kind == "int8":
        arrays = ([sds((layers, batch, heads, slots, dim), jnp.int8)] * 2
                  + [sds((layers, batch, heads, slots), jnp.uint16)] * 2
                  + [sds((batch, heads, 0, dim), jnp.bfloat16)] * 2 + [sds((batch, 0), jnp.int32)])

        def attend(q, pos, *rest):
            *rest, lengths, layer = rest
            view = QuantizedView(*rest, layer, lengths, 8, jnp.bfloat16, jnp.bfloat16)
            return pallas_attend_view(q, view, q_positions=pos, **options)
    else:
        raise SystemExit(f"--kind must be bf16, f32 or int8, got {kind!r}")
    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    try:
        triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        args = (q, pos, *arrays, lengths, layer)
        jax.export.export(jax.jit(attend), platforms=["cuda"], disabled_checks=[triton_call])(*args)
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    (module,) = modules
    return module


def compile_ptx(ir_path: str, warps: int, stages: int) -> tuple[str, int]:
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = triton.compile(ir_path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return kernel.asm["ptx"], kernel.metadata.shared


def block_loops(ptx: str) -> list[list[str]]:
    """The instructions of each inner loop of the PTX, in program order (the basic blocks a
    loop header reaches that reach it back)."""
    blocks, order, current = {"entry": []}, ["entry"], "entry"
    headers = []
    for line in ptx.splitlines():
        label = re.match(r"^(\$L__BB\d+_\d+):", line)
        if label:
            current = label.group(1)
            blocks[current], order = [], order + [current]
            if "Inner Loop Header" in line:
                headers.append(current)
            continue
        text = line.strip()
        if text.endswith(";") and not text.startswith(("//", ".")):
            blocks[current].append(text)
    if not headers:
        raise SystemExit("no inner loop found in the PTX")
    successors = {}
    for i, name in enumerate(order):
        body = blocks[name]
        targets = {m.group(1) for text in body for m in [re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)", text)] if m}
        if i + 1 < len(order) and not (body and body[-1].startswith(("bra.uni", "ret"))):
            targets.add(order[i + 1])
        successors[name] = targets

    def reach(start):
        seen, stack = set(), [start]
        while stack:
            for nxt in successors[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    loops = []
    for header in headers:
        inside = reach(header)
        loop = [name for name in order if name == header or (name in inside and header in reach(name))]
        loops.append([text for name in loop for text in blocks[name]])
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="bf16", help="bf16, f32 or int8")
    parser.add_argument("--softcap", action="store_true", help="with a logit soft cap")
    parser.add_argument("--f32-precision", default="highest", help="highest or tf32x3 (pallas_attend_view's option)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the Triton IR and the PTX here")
    args = parser.parse_args()
    ir = triton_ir(args.kind, args.softcap, args.f32_precision)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.out or scratch) / f"decode_{args.kind}{'_softcap' if args.softcap else ''}.ttir"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(ir)
        ptx, shared = compile_ptx(str(path), args.warps, args.stages)
        if args.out:
            path.with_suffix(f".w{args.warps}s{args.stages}.ptx").write_text(ptx)
    loops = block_loops(ptx)
    waits = sorted(set(re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)))
    print(f"{args.kind}{' soft cap' if args.softcap else ''}, f32 products {args.f32_precision}, {args.warps} warps, "
          f"{args.stages} stages: shared memory {shared} bytes, cp.async.wait_group {waits}; block loops in "
          f"program order (with full blocks: masked, whole blocks, masked): "
          + " / ".join(str(len(loop)) for loop in loops) + " PTX instructions")
    for loop in loops:
        kinds = collections.Counter((text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]
                                    for text in loop)
        print(f"  {len(loop)}: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))


if __name__ == "__main__":
    main()

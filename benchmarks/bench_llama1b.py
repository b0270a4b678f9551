"""A Llama-3.2-1B-shaped model in bfloat16: jaxkv.generate against its read floor and transformers.

Issue 14's third and fourth goals, measured side by side in one run on ``jax.devices()[0]``
(meant for the GPU; ``--quick`` is a CPU smoke run of every code path on a tiny config):

* the model: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 query / 8 kv heads, head dim
  64, MLP 8192, vocabulary 128256, tied embeddings) with random weights, built by
  transformers, saved with ``save_pretrained`` and read back by ``jaxkv.models.from_pretrained``
  in bfloat16, so both hold the same weights;
* ``first call``: wall time of the first ``jaxkv.generate`` call of each layer layout
  (``scan_layers=True``, the TPU default, and ``False``, one block per layer, the CPU and GPU default), compile
  included;
* per cell (batch, prompt length), seconds per decode step of
  - ``jaxkv scan`` / ``jaxkv per-layer``: ``bench_generate.time_jaxkv`` (a jitted loop of
    ``generate``'s decode step on a donated prefilled cache, its tokens checked equal to
    ``jaxkv.generate``'s);
  - ``floor``: a jitted ``jnp.sum`` over one bfloat16 buffer as large as the weights plus the
    cache at that fill, what any step must read at least;
  - ``hf eager``: transformers ``generate`` with ``cache_implementation="static"`` and
    ``disable_compile=True``; ``hf compiled``: the same with transformers' automatic
    ``torch.compile`` of the forward (its default for a static cache on CUDA), the first
    call compiling outside the clock. Step time: the median gap between logits-processor
    calls, best of R (``bench_generate.time_hf``);
  - greedy tokens of jaxkv and transformers compared over the first steps (bfloat16 rounding
    differs between the two, so a late divergence is reported, not raised).

Ratios printed: jaxkv / floor (goals <= 1.3 at batch 1 and <= 1.5 at batch 32, 1K prompt),
hf eager / jaxkv (goal >= 2), hf compiled / jaxkv, first call (goal < 10 s).

    python benchmarks/bench_llama1b.py [--json PATH]     # on the GPU
    python benchmarks/bench_llama1b.py --quick           # CPU smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import bench_generate as bg  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402


Shape = bg.BenchConfig
LLAMA_1B = Shape(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                 num_kv_heads=8, head_dim=64, max_position_embeddings=4096)
TINY = Shape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=512)


def hf_config(shape: Shape):
    """transformers' config of ``shape`` as Llama 3.2 1B has it: tied embeddings, RoPE theta 500000."""
    import transformers

    kwargs = {**shape.hf_kwargs(), "tie_word_embeddings": True, "rope_theta": 500000.0, "dtype": "bfloat16"}
    return transformers.LlamaConfig(**kwargs)


def build(shape: Shape, directory: str, device: str):
    """The transformers model (bfloat16, on ``device``) and its checkpoint in ``directory``."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(hf_config(shape)).to(torch.bfloat16).eval()
    hf.save_pretrained(directory)
    return hf


def read_floor(model, shape: Shape, batch: int, context: int, repeats: int) -> float:
    """Seconds for a jitted ``jnp.sum`` over as many bfloat16 values as weights + cache."""
    weights = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cache = 2 * shape.num_layers * batch * shape.num_kv_heads * context * shape.head_dim
    buffer = jax.random.normal(jax.random.key(0), (weights + cache,), jnp.bfloat16)
    read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    read(buffer).block_until_ready()
    return bg.best_time(lambda: read(buffer).block_until_ready(), max(repeats, 10))


def attention_path(model, batch: int, capacity: int) -> str:
    """Which attention a decode step of ``model`` runs over a cache of ``capacity`` slots:
    ``"pallas kernel"`` if its traced program holds a Pallas call, else ``"XLA"`` (traced
    on abstract inputs: nothing is compiled or allocated)."""
    from jaxkv import generation

    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, capacity))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    program = jax.make_jaxpr(lambda state, tokens, cache: generation.decode_step(graphdef, state, tokens, cache))(
        state, tokens, cache)
    return "pallas kernel" if "pallas_call" in str(program) else "XLA"


def time_hf(hf, ids: np.ndarray, steps: int, repeats: int, *, compiled: bool, device: str) -> float:
    """transformers' static-cache decode step (median gap between logits-processor calls).

    With ``compiled``, raises if transformers did not actually build its ``torch.compile``'d
    forward (its automatic compilation has conditions of its own).
    """
    import torch
    import transformers

    def generate(n, stamps):
        class Stamp:
            def __call__(self, input_ids, scores):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())
                return scores

        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                      cache_implementation="static", disable_compile=not compiled, logits_processor=[Stamp()])
        if compiled and not device.startswith("cuda"):
            # transformers compiles automatically on accelerators only; this flag is its own
            # switch for other devices (the --quick smoke run of this path)
            config = transformers.CompileConfig()
            config._compile_all_devices = True
            kwargs["compile_config"] = config
        with torch.inference_mode():
            tokens = torch.as_tensor(ids, device=device)
            return hf.generate(tokens, attention_mask=torch.ones_like(tokens), **kwargs)

    generate(steps + 1, [])  # warm-up: the compiled variant compiles here
    if compiled and not hasattr(hf, "_compiled_call"):
        raise RuntimeError("transformers did not compile its forward; the 'hf compiled' figure would be eager")
    runs = []
    for _ in range(repeats):
        stamps: list[float] = []
        generate(steps + 1, stamps)
        runs.append(float(np.median(np.diff(stamps))))
    return min(runs)


def hf_tokens(hf, ids: np.ndarray, steps: int, device: str) -> np.ndarray:
    import torch

    with torch.inference_mode():
        tokens = torch.as_tensor(ids, device=device)
        out = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=steps,
                          min_new_tokens=steps, do_sample=False, pad_token_id=0, cache_implementation="static",
                          disable_compile=True)
    return out[:, ids.shape[1]:].cpu().numpy()


def run(shape: Shape, cells: list[tuple[int, int]], *, steps: int, repeats: int, hf_compiled: bool,
        hf_timing: bool = True) -> dict:
    """The figures of every cell (see the module docstring). ``hf_timing=False`` leaves out
    transformers' step times (its greedy tokens are still compared): a short device rerun of
    the jaxkv columns alone."""
    import jaxkv
    from jaxkv.models import from_pretrained

    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    payload: dict = {"shape": dataclasses.asdict(shape), "steps": steps, "repeats": repeats, "rows": [],
                     "first_call_s": {}}
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        hf = build(shape, directory, device)
        models = {}
        for name, scan in (("jaxkv scan", True), ("jaxkv per-layer", False)):
            models[name] = from_pretrained(directory, dtype=jnp.bfloat16, scan_layers=scan).model
        payload["build_s"] = time.perf_counter() - start
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(models["jaxkv scan"], nnx.Param)))
    payload["parameters"] = int(parameters)
    print(f"model: {parameters / 1e9:.3f}B parameters (bfloat16), built and loaded in {payload['build_s']:.0f} s")

    first_ids = np.random.default_rng(1).integers(1, shape.vocab_size, (1, 128 if shape is LLAMA_1B else 16))
    for name, model in models.items():
        start = time.perf_counter()
        jaxkv.generate(model, jnp.asarray(first_ids), 16).tokens.block_until_ready()
        payload["first_call_s"][name] = time.perf_counter() - start
        print(f"first generate call, {name}: {payload['first_call_s'][name]:.1f} s (compile included)")

    for batch, prompt in cells:
        ids = np.random.default_rng(batch * 7919 + prompt).integers(1, shape.vocab_size, (batch, prompt))
        row = {"batch": batch, "prompt": prompt,
               "attention": attention_path(models["jaxkv scan"], batch, prompt + steps + 1)}
        for name, model in models.items():
            row[name] = bg.time_jaxkv(model, ids, steps, repeats)
        row["floor"] = read_floor(models["jaxkv scan"], shape, batch, prompt + steps // 2, repeats)
        row["hf eager"] = time_hf(hf, ids, steps, repeats, compiled=False, device=device) if hf_timing else None
        row["hf compiled"] = (time_hf(hf, ids, steps, repeats, compiled=True, device=device)
                              if hf_compiled and hf_timing else None)
        ours = np.asarray(jaxkv.generate(models["jaxkv scan"], jnp.asarray(ids), 16).tokens)
        theirs = hf_tokens(hf, ids, 16, device)
        same = ours == theirs
        row["tokens_equal_first_16"] = bool(same.all())
        row["first_divergence"] = int(np.argmin(same.all(0))) if not same.all() else None
        payload["rows"].append(row)
        print(f"  B={batch} P={prompt}: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in row.items() if isinstance(v, float)), flush=True)
    return payload


#: XLA options compared by :func:`run_xla_variants` (the scanned step was ~1 ms slower than
#: per-layer on the H200, about what copying every layer's weights out of the stacks would
#: cost; the per-layer step was ~2x its read floor at batch 1, many small kernels per layer):
#: dynamic-slice fusion lets a cuBLAS matmul read its operand at an offset of the stacked
#: buffer; command buffers (CUDA graphs) with the loop's while/conditional inside them
#: launch a step's kernels as one graph. Ignored by XLA:CPU (the --quick run).
_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
                    "xla_gpu_graph_min_graph_size": 1}
XLA_VARIANTS = {
    "default": {},
    "dynamic-slice fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "command buffers": _COMMAND_BUFFERS,
    "both": {"xla_gpu_enable_dynamic_slice_fusion": True, **_COMMAND_BUFFERS},
    # Compile time (issue 14: first generate call under 10 s): XLA times GEMM and fusion
    # candidates while compiling; level 0 takes its heuristics instead (faster compile, the
    # step may be slower). The "first run s" column says what it saves.
    "no autotune": {"xla_gpu_autotune_level": 0},
}


def run_xla_variants(shape: Shape, cells: list[tuple[int, int]], *, steps: int, repeats: int) -> dict:
    """jaxkv's decode step of both layer layouts under each of :data:`XLA_VARIANTS`, side by
    side in one process on the same random weights (no transformers: the model is built
    directly), with the read floor of each cell. A variant whose tokens differ from the
    default's is recorded (``tokens_differ``), not raised; one that fails to compile is
    recorded in ``errors`` and the others go on."""
    from jaxkv.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)
    start = time.perf_counter()
    models = {name: Llama(config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scan_layers=scan)
              for name, scan in (("scan", True), ("per-layer", False))}
    payload: dict = {"shape": dataclasses.asdict(shape), "steps": steps, "repeats": repeats,
                     "variants": XLA_VARIANTS, "rows": [], "errors": {}, "build_s": time.perf_counter() - start}
    for batch, prompt in cells:
        ids = np.random.default_rng(batch * 7919 + prompt).integers(1, shape.vocab_size, (batch, prompt))
        row: dict = {"batch": batch, "prompt": prompt, "floor": read_floor(models["scan"], shape, batch,
                                                                            prompt + steps // 2, repeats)}
        reference: dict = {}
        for layout, model in models.items():
            for variant, options in XLA_VARIANTS.items():
                key = f"{layout} / {variant}"
                try:
                    run = bg.jaxkv_decode_loop(model, ids, steps, options)
                    start = time.perf_counter()
                    tokens = np.asarray(run())  # compiles the decode program (the prefill's is apart)
                    first = time.perf_counter() - start
                    seconds = bg.time_decode(run, repeats)
                except Exception as error:  # noqa: BLE001 - a variant XLA refuses is a result, not the end of the run
                    payload["errors"][f"B={batch} P={prompt} {key}"] = f"{type(error).__name__}: {error}"[:500]
                    print(f"  B={batch} P={prompt} {key}: failed ({type(error).__name__})", flush=True)
                    continue
                row[key] = seconds / steps
                row[f"{key} first_s"] = first
                if layout not in reference:
                    reference[layout] = tokens
                elif not np.array_equal(tokens, reference[layout]):
                    row.setdefault("tokens_differ", []).append(key)
                print(f"  B={batch} P={prompt} {key}: {row[key] * 1e3:.2f} ms per step "
                      f"({row[key] / row['floor']:.2f}x the floor), first run {first:.1f} s", flush=True)
        payload["rows"].append(row)
    return payload


def report_xla(payload: dict) -> None:
    keys = [f"{layout} / {variant}" for layout in ("scan", "per-layer") for variant in payload["variants"]]
    rows = []
    for r in payload["rows"]:
        for key in keys:
            if key in r:
                rows.append([r["batch"], r["prompt"], key, f"{r[key] * 1e3:.2f}", f"{r['floor'] * 1e3:.2f}",
                             f"{r[key] / r['floor']:.2f}x", f"{r[f'{key} first_s']:.1f}",
                             "differ" if key in r.get("tokens_differ", []) else "same"])
    print_table(["B", "prompt", "layout / XLA options", "ms per step", "floor ms", "/ floor",
                 "first run s (compile)", "tokens vs layout's default"], rows)
    for key, error in payload["errors"].items():
        print(f"failed: {key}: {error}")


def report(payload: dict) -> None:
    best = lambda r: min(r["jaxkv scan"], r["jaxkv per-layer"])  # noqa: E731
    rows = []
    for r in payload["rows"]:
        compiled, eager = r["hf compiled"], r["hf eager"]
        rows.append([
            r["batch"], r["prompt"], f"{r['jaxkv scan'] * 1e3:.2f}", f"{r['jaxkv per-layer'] * 1e3:.2f}",
            f"{r['floor'] * 1e3:.2f}", f"{best(r) / r['floor']:.2f}x",
            "-" if eager is None else f"{eager * 1e3:.2f}", "-" if eager is None else f"{eager / best(r):.2f}x",
            "-" if compiled is None else f"{compiled * 1e3:.2f}",
            "-" if compiled is None else f"{compiled / best(r):.2f}x",
            "yes" if r["tokens_equal_first_16"] else f"from step {r['first_divergence']}", r.get("attention", "-"),
        ])
    print_table(
        ["B", "prompt", "jaxkv scan ms", "per-layer ms", "floor ms", "jaxkv/floor", "hf eager ms", "hf eager/jaxkv",
         "hf compiled ms", "hf compiled/jaxkv", "same greedy tokens", "decode attention"],
        rows,
    )
    print("first generate call: " + ", ".join(f"{k} {v:.1f} s" for k, v in payload["first_call_s"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny config on any backend: a smoke run")
    parser.add_argument("--json", default=None, help="where to write the figures (default: results/llama1b_<backend>.json)")
    parser.add_argument("--hf-compiled", choices=("auto", "yes", "no"), default="auto",
                        help="time transformers with torch.compile (auto: on a GPU only; inductor on a CPU is slow)")
    parser.add_argument("--no-hf-timing", action="store_true",
                        help="leave out transformers' step times (its greedy tokens are still compared)")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    hf_compiled = args.hf_compiled == "yes" or (args.hf_compiled == "auto" and on_gpu)
    if args.quick:
        payload = run(TINY, [(1, 16), (2, 64)], steps=8, repeats=2, hf_compiled=hf_compiled,
                      hf_timing=not args.no_hf_timing)
    else:
        payload = run(LLAMA_1B, [(1, 128), (1, 1024), (32, 1024)], steps=32, repeats=3, hf_compiled=hf_compiled,
                      hf_timing=not args.no_hf_timing)
    payload["machine"], payload["device"] = machine(), str(jax.devices()[0])
    report(payload)
    if args.json or not args.quick:
        write_json(args.json or str(HERE / "results" / f"llama1b_{jax.default_backend()}.json"), payload)


if __name__ == "__main__":
    main()

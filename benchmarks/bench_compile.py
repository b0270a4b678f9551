"""Compile time against depth: the unrolled Llama (before) and the scan over layers (now).

Issue 14: compile time must not grow with depth. For each depth this builds the same
small Llama twice from the same seed (so the same weights; the script checks the logits
agree): ``before``, the model file as it was before the scan (``jaxkv/models/llama.py`` at
``--before``, read with ``git show``: a Python list of blocks, unrolled), and ``scan``,
the current model (stacked layer weights, ``lax.scan``). It measures, side by side in
this one run:

* ``generate 1st``: wall time of the first ``jaxkv.generate`` call (trace + compile + run;
  a fresh model structure compiles a fresh program), and ``generate 2nd`` of the second,
  which compiles nothing: their difference is the compile cost;
* ``step compile``: ``jax.jit(decode_step, donate cache)`` lowered, then compiled;
* ``step ms``: the donated decode step, median per call after a 64-token prefill (batch 1),
  before and scan in alternating rounds, best round.

Then the donated decode step of a medium model (E=1024, 8 layers, 394 MB of float32
weights: the step reads more than the caches hold), before and scan: on XLA:CPU the scan
copies each layer's weights out of the stacked arrays (a dot cannot read a dynamic slice
in place), which shows where the weights dominate the step (``--no-medium`` skips it).

Then the same ``generate`` program for a Llama-3.2-1B-shaped model (16 layers, hidden 2048,
32/8 heads, head_dim 64, vocab 128256, bfloat16; issue 14's "first generate call under
10 s") lowered and compiled from abstract weights (nothing is allocated; run time
excluded): ``--no-big`` skips it.

    python benchmarks/bench_compile.py [--depths 2 4 8 16] [--before <commit>] [--no-medium] [--no-big]
        [--json benchmarks/results/compile.json]

On CPU; machines here are shared, so compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
from common import machine, print_table, time_calls, write_json
from jaxkv.generation import decode_step, prefill
from jaxkv.models import Llama, LlamaConfig

REPO = Path(__file__).resolve().parent.parent
# The last commit whose llama.py unrolls a Python list of blocks.
BEFORE = "b67f4fb"
# The embedded model's shape (jaxkv/_assets/pycoder), at each depth.
SMALL = dict(vocab_size=4096, hidden_size=192, intermediate_size=512, num_heads=6, num_kv_heads=2, head_dim=32)
BIG = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
    head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
)
MEDIUM = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
)
PROMPT, NEW_TOKENS, CAPACITY = 64, 32, 512


def before_llama(commit: str) -> type:
    """The ``Llama`` class of ``jaxkv/models/llama.py`` at ``commit`` (a module of its own)."""
    source = subprocess.run(
        ["git", "show", f"{commit}:jaxkv/models/llama.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("jaxkv_llama_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:jaxkv/models/llama.py", "exec"), module.__dict__)
    return module.Llama


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


def measure_depth(make, config: LlamaConfig, prompt: jax.Array) -> dict:
    model = make(config)
    first, t_first = timed(lambda: jaxkv.generate(model, prompt, NEW_TOKENS).tokens)
    second, t_second = timed(lambda: jaxkv.generate(model, prompt, NEW_TOKENS).tokens)
    assert np.array_equal(first, second)

    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, tokens, cache: decode_step(graphdef, state, tokens, cache), donate_argnums=2)
    cache = model.init_cache(prompt.shape[0], CAPACITY)
    tokens = prompt[:, -1]
    lowered, t_lower = timed(lambda: step.lower(state, tokens, cache))
    compiled, t_compile = timed(lambda: lowered.compile())
    _, cache = jax.jit(prefill, static_argnums=0)(
        graphdef, state, prompt, jnp.full((prompt.shape[0],), prompt.shape[1]), cache
    )
    logits = nnx.jit(lambda m, t: m(t, None)[0])(model, prompt)
    return dict(
        model=model, tokens=np.asarray(first), logits=np.asarray(logits), generate_first_s=t_first,
        generate_second_s=t_second, step_lower_s=t_lower, step_compile_s=t_compile, step=compiled,
        state=state, cache=cache, next_tokens=tokens,
    )


def medium_step_ms(makers: dict, prompt: jax.Array, rounds: int, repeats: int) -> dict:
    """ms per donated decode step of the MEDIUM model, before and scan, after a prefill."""
    config = LlamaConfig(**MEDIUM)
    runs = {}
    for name, make in makers.items():
        model = make(config)
        graphdef, state = nnx.split(model)
        step = jax.jit(lambda state, tokens, cache, g=graphdef: decode_step(g, state, tokens, cache), donate_argnums=2)
        _, cache = jax.jit(prefill, static_argnums=0)(
            graphdef, state, prompt, jnp.full((prompt.shape[0],), prompt.shape[1]), model.init_cache(1, CAPACITY)
        )
        runs[name] = dict(step=step, state=state, cache=cache, next_tokens=prompt[:, -1])
    return step_times(runs, rounds, repeats)


def step_times(runs: dict, rounds: int, repeats: int) -> dict:
    """Median ms per donated decode step, best of ``rounds`` alternating rounds."""
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            def call():
                tokens, run["cache"] = run["step"](run["state"], run["next_tokens"], run["cache"])
                run["next_tokens"] = tokens
                jax.block_until_ready(tokens)

            best[name] = min(best[name], 1e3 * time_calls(call, repeats=repeats))
    return best


def big_generate_compile(make) -> tuple[float, float]:
    """Lower and compile ``jaxkv.generate`` for the 1B shape from abstract bf16 weights."""
    config = LlamaConfig(**BIG)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(config, param_dtype=jnp.bfloat16)))
    prompt = jnp.ones((1, PROMPT), jnp.int32)

    def program(state):
        return jaxkv.generate(nnx.merge(graphdef, state), prompt, NEW_TOKENS).tokens

    lowered, t_lower = timed(lambda: jax.jit(program).lower(abstract))
    _, t_compile = timed(lambda: lowered.compile())
    return t_lower, t_compile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--before", default=BEFORE, help="commit of the unrolled llama.py")
    parser.add_argument("--no-medium", action="store_true", help="skip the medium model's step time")
    parser.add_argument("--no-big", action="store_true", help="skip the 1B-shape compile")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default="benchmarks/results/compile.json")
    args = parser.parse_args()

    OldLlama = before_llama(args.before)
    makers = {
        "before": lambda config, **kw: OldLlama(config, rngs=nnx.Rngs(0), **kw),
        "scan": lambda config, **kw: Llama(config, rngs=nnx.Rngs(0), scan_layers=True, **kw),
    }
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, SMALL["vocab_size"], (1, PROMPT)), jnp.int32)
    rows, results = [], []
    for depth in args.depths:
        config = LlamaConfig(num_layers=depth, **SMALL)
        runs = {name: measure_depth(make, config, prompt) for name, make in makers.items()}
        before, scan = runs["before"], runs["scan"]
        # Same seed, same weights: the two programs must agree.
        logits_diff = float(np.max(np.abs(before["logits"] - scan["logits"])))
        assert logits_diff < 1e-4, f"depth {depth}: logits differ by {logits_diff}"
        assert np.array_equal(before["tokens"], scan["tokens"]), f"depth {depth}: generated tokens differ"
        ms = step_times(runs, args.rounds, args.repeats)
        entry = dict(depth=depth, logits_max_abs_diff=logits_diff)
        for name, run in runs.items():
            entry[name] = dict(
                generate_first_s=run["generate_first_s"], generate_second_s=run["generate_second_s"],
                step_lower_s=run["step_lower_s"], step_compile_s=run["step_compile_s"], step_ms=ms[name],
            )
        results.append(entry)

        def gen_compile(run):
            return run["generate_first_s"] - run["generate_second_s"]

        def step_build(run):
            return run["step_lower_s"] + run["step_compile_s"]

        rows.append([
            depth,
            f"{before['generate_first_s']:.2f}", f"{scan['generate_first_s']:.2f}",
            f"{gen_compile(before) / gen_compile(scan):.2f}x",
            f"{step_build(before):.2f}", f"{step_build(scan):.2f}",
            f"{step_build(before) / step_build(scan):.2f}x",
            f"{ms['before']:.3f}", f"{ms['scan']:.3f}", f"{ms['scan'] / ms['before']:.2f}x",
        ])
        print(f"depth {depth} done", flush=True)

    print(
        f"\nSmall Llama (E={SMALL['hidden_size']}, {SMALL['num_heads']}/{SMALL['num_kv_heads']} heads, "
        f"V={SMALL['vocab_size']}, f32), batch 1, prompt {PROMPT}, {NEW_TOKENS} new tokens, capacity {CAPACITY}; "
        f"before = llama.py at {args.before} (unrolled), scan = now. Times in s unless ms."
    )
    print_table(
        ["layers", "generate 1st before", "generate 1st scan", "gen compile before/scan",
         "step lower+compile before", "step lower+compile scan", "before/scan",
         "step ms before", "step ms scan", "scan/before"],
        rows,
    )
    first = {name: [r[name]["generate_first_s"] for r in results] for name in makers}
    if len(results) > 1:
        print(
            f"growth of the first generate call from {results[0]['depth']} to {results[-1]['depth']} layers: "
            f"before {first['before'][-1] / first['before'][0]:.2f}x, scan {first['scan'][-1] / first['scan'][0]:.2f}x"
        )

    medium = None
    if not args.no_medium:
        medium = medium_step_ms(makers, prompt, args.rounds, max(5, args.repeats // 3))
        print(f"\nMedium Llama ({MEDIUM}, f32): donated decode step, ms (best round's median)")
        print_table(
            ["before", "scan", "scan/before"],
            [[f"{medium['before']:.2f}", f"{medium['scan']:.2f}", f"{medium['scan'] / medium['before']:.2f}x"]],
        )

    big = None
    if not args.no_big:
        big = {name: big_generate_compile(make) for name, make in makers.items()}
        print("\nLlama-3.2-1B shape (16 layers, bf16): jaxkv.generate lowered + compiled from abstract weights (s)")
        print_table(
            ["", "lower", "compile", "total"],
            [[name, f"{lo:.2f}", f"{co:.2f}", f"{lo + co:.2f}"] for name, (lo, co) in big.items()],
        )
        big = {name: dict(lower_s=lo, compile_s=co) for name, (lo, co) in big.items()}

    if args.json:
        write_json(args.json, dict(
            machine=machine(), before_commit=args.before, small_config=SMALL, prompt=PROMPT,
            new_tokens=NEW_TOKENS, capacity=CAPACITY, depths=results, medium_config=MEDIUM, medium_step_ms=medium,
            big_config=BIG, big_generate=big,
        ))


if __name__ == "__main__":
    main()

"""Decode step time of jaxkv.generate against transformers and Flax NNX, and peak memory.

One Llama config; jaxkv and transformers run the *same* random weights (a random
``LlamaForCausalLM`` saved with ``save_pretrained`` and read back with
``jaxkv.models.from_pretrained``). For each batch size and context length (prompt tokens
already in the cache) we measure the decode step time, seconds per step (one new token
per row), of:

* ``jaxkv``: the decode steps of ``jaxkv.generate``, timed apart from its prefill: one
  jitted program of N ``generation.decode_step`` calls (the body of ``generate``'s while
  loop) in a ``lax.fori_loop`` on a donated copy of the prefilled cache, its tokens checked
  equal to ``jaxkv.generate``'s; step time = program time / N, best of R.
* ``hf_dynamic`` / ``hf_static``: transformers ``model.generate(do_sample=False)``
  (PyTorch CPU, ``inference_mode``, threads = cores) with its default dynamic cache and
  with ``cache_implementation="static"``. Step time = median gap between consecutive calls
  of a logits processor, i.e. one forward + generate's own per-step work (the prefill is
  not in any gap), best of R generate calls. (The difference method above would need two long prefills per cell.)
* ``nnx``: an equivalent decoder on ``nnx.MultiHeadAttention(decode=True)`` (same hidden
  size, layers, MLP, 8 query / 2 kv heads: flax 0.12 has ``num_kv_heads``, so its cache has
  the same size; it has no RoPE, which only makes it cheaper). Its cache (capacity
  context + N) is filled with random keys/values and ``cache_index`` set to the context;
  then N single-token greedy steps run under ``nnx.jit``, step time = total / N, best of R.

Best-of-R everywhere: the cores are shared with other jobs, and the minimum is the
figure least inflated by them.

Context C is the prompt length; the N steps then read C..C+N-1 stored tokens. All figures
of a table come from this one run; machines here are shared, so compare ratios, not
absolute times. Each cell also times a *read floor*: a jitted ``jnp.sum`` over as many
bytes as the weights plus the cache (:func:`time_read_floor`), what any implementation must
read per step. ``--memory`` (on by default) measures peak RSS of jaxkv.generate in fresh
subprocesses (see :func:`memory_report`).

    python benchmarks/bench_generate.py            # full run, writes results/generate.json
    python benchmarks/bench_generate.py --quick    # smoke run (~1 min), writes nothing
    python benchmarks/bench_generate.py --memory-only  # only the memory table (updates the JSON)
    python benchmarks/bench_generate.py --plot-only  # redraw docs/decode_step_time.png
    python benchmarks/bench_generate.py --profile 8 2048  # where jaxkv's step goes, by op
"""

from __future__ import annotations

import argparse
from functools import partial
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from common import machine, print_table, write_json  # noqa: E402
from jaxkv import generation  # noqa: E402

STRATEGIES = ("jaxkv", "hf_dynamic", "hf_static", "nnx")
GOALS = {"hf_dynamic": 5.0, "hf_static": 5.0, "nnx": 1.2}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 8192 + 512

    def hf_kwargs(self) -> dict:
        return dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
        )


FULL = BenchConfig()
TINY = BenchConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=2048)


# --------------------------------------------------------------------------- models


def build_models(config: BenchConfig, directory: str, *, seed: int = 0):
    """A random HF LlamaForCausalLM and the jaxkv Llama holding the same weights."""
    import torch
    import transformers

    from jaxkv.models import from_pretrained

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.hf_kwargs())).eval()
    hf.save_pretrained(directory)
    return hf, from_pretrained(directory).model


class NNXBlock(nnx.Module):
    def __init__(self, c: BenchConfig, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(c.hidden_size, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, in_features=c.hidden_size,
            qkv_features=c.num_heads * c.head_dim, out_features=c.hidden_size, use_bias=False,
            decode=True, rngs=rngs,
        )
        self.mlp_norm = nnx.RMSNorm(c.hidden_size, rngs=rngs)
        self.gate = nnx.Linear(c.hidden_size, c.intermediate_size, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.hidden_size, c.intermediate_size, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.intermediate_size, c.hidden_size, use_bias=False, rngs=rngs)

    def __call__(self, x):  # [B, 1, E]
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class NNXDecoder(nnx.Module):
    """The same shapes as the Llama config, attention by ``nnx.MultiHeadAttention(decode=True)``."""

    def __init__(self, c: BenchConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(c, rngs) for _ in range(c.num_layers)])
        self.norm = nnx.RMSNorm(c.hidden_size, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs)

    def fill_cache(self, batch: int, capacity: int, context: int, *, seed: int = 0) -> None:
        """A cache of ``capacity`` slots whose first ``context`` hold random keys/values."""
        rng = np.random.default_rng(seed)
        for block in self.blocks:
            attn = block.attn
            attn.init_cache((batch, capacity, attn.in_features))
            shape = attn.cached_key.shape
            filled = np.zeros(shape, np.float32)
            filled[:, :context] = rng.standard_normal((batch, context, *shape[2:]), np.float32)
            attn.cached_key[...] = jnp.asarray(filled)
            attn.cached_value[...] = jnp.asarray(filled[:, :, :, ::-1].copy())
            attn.cache_index[...] = jnp.int32(context)

    def __call__(self, tokens):  # [B, 1] -> [B, 1, V]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


@nnx.jit
def nnx_step(model: NNXDecoder, tokens):  # [B] -> [B]
    return jnp.argmax(model(tokens[:, None])[:, 0], axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------- timing


def best_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def jaxkv_decode_loop(model, ids: np.ndarray, steps: int, compiler_options: dict | None = None):
    """``generate``'s decode steps as one program, apart from its prefill.

    Returns ``run()``, which runs ``steps`` calls of ``generation.decode_step`` (the body of
    ``generate``'s while loop) in a jitted ``lax.fori_loop`` on a donated copy of the
    prefilled cache and returns the tokens. The copy is made before the clock starts in
    :func:`time_jaxkv`; ``run`` itself includes it (use ``run.decode`` and ``run.fresh``).
    ``compiler_options`` (XLA debug options, e.g. ``{"xla_gpu_enable_dynamic_slice_fusion":
    True}``) go to the decode program's ``jax.jit``; the prefill is compiled without them.
    """
    ids = jnp.asarray(ids)
    batch, prompt = ids.shape
    graphdef, state = nnx.split(model)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    capacity = prompt + steps + 1

    # The weights are arguments, not closed-over constants: captured, XLA would embed every
    # weight in the program (2.5 GB for the 1B shape of bench_llama1b.py).
    @jax.jit
    def prefilled(state):
        cache = model.init_cache(batch, capacity)
        return generation.prefill(graphdef, state, ids, lengths, cache, chunk_size=generation.DEFAULT_PREFILL_CHUNK)

    @partial(jax.jit, donate_argnums=2, compiler_options=compiler_options or None)
    def decode_with(state, first, cache):
        def body(i, carry):
            last, cache, out = carry
            nxt, cache = generation.decode_step(graphdef, state, last, cache, step=i + 1)
            return nxt, cache, out.at[:, i + 1].set(nxt)

        out = jnp.zeros((batch, steps + 1), jnp.int32).at[:, 0].set(first)
        _, cache, out = jax.lax.fori_loop(0, steps, body, (first, cache, out))
        return out, cache  # returned, so the donated input buffers become the loop's own

    decode = partial(decode_with, state)
    first, cache = prefilled(state)

    def fresh():
        return jax.block_until_ready(jax.tree.map(jnp.copy, cache))

    def run():
        return jax.block_until_ready(decode(first, fresh()))[0]

    run.decode, run.fresh, run.first = decode, fresh, first
    return run


#: A timed loop whose tokens differ from ``jaxkv.generate``'s raises unless this is False
#: (the one-shot device run: a mismatch is recorded in ``TOKEN_MISMATCHES`` and printed, and
#: the figures of the other cells survive).
STRICT_TOKENS = True
TOKEN_MISMATCHES: list[dict] = []


def time_jaxkv(model, ids: np.ndarray, steps: int, repeats: int, compiler_options: dict | None = None) -> float:
    """Decode steps of ``jaxkv.generate``, timed apart from the prefill.

    One jitted program runs ``steps`` decode steps (:func:`jaxkv_decode_loop`); step time =
    program time / steps, best of ``repeats``. Its tokens are checked equal to
    ``jaxkv.generate``'s, so this is the same computation without the prefill in the clock
    (subtracting a 1-token ``generate`` from an N-token one let prefill noise swamp the
    steps at long contexts). ``compiler_options``: see :func:`jaxkv_decode_loop`.
    """
    import jaxkv

    run = jaxkv_decode_loop(model, ids, steps, compiler_options)
    want = jaxkv.generate(model, jnp.asarray(ids), steps + 1).tokens
    got = np.asarray(run())
    if not np.array_equal(got, np.asarray(want)):
        if STRICT_TOKENS:
            raise AssertionError("the timed decode loop's tokens differ from jaxkv.generate's")
        first = int(np.argmax((got != np.asarray(want)).any(axis=0)))
        TOKEN_MISMATCHES.append({"batch": int(ids.shape[0]), "context": int(ids.shape[1]), "first_step": first})
        print(f"WARNING: B={ids.shape[0]} C={ids.shape[1]}: the timed loop's tokens differ from jaxkv.generate's "
              f"from step {first} (recorded; timing kept)")
    return time_decode(run, repeats) / steps


def time_decode(run, repeats: int) -> float:
    """Best of ``repeats`` seconds of ``run.decode`` (:func:`jaxkv_decode_loop`) on a fresh
    copy of the prefilled cache each time (the copy made outside the clock)."""
    samples = []
    for _ in range(repeats):
        cache = run.fresh()
        start = time.perf_counter()
        jax.block_until_ready(run.decode(run.first, cache))
        samples.append(time.perf_counter() - start)
    return min(samples)


def profile_cell(config: BenchConfig, batch: int, context: int, steps: int) -> None:
    """Where one cell's decode step goes, by op (XLA:CPU profiler; the cache copies made
    before each timed call show up as ``copy``)."""
    from common import op_times

    with tempfile.TemporaryDirectory() as directory:
        _, model = build_models(config, directory)
    ids = np.random.default_rng(0).integers(1, config.vocab_size, (batch, context))
    run = jaxkv_decode_loop(model, ids, steps)
    ops = op_times(run, calls=3, top=30)
    print(f"\nB={batch} context={context}: ops by time, us per decode step ({steps} steps per call)")
    print_table(["op", "us per step", "runs per call"], [[name, f"{ms / steps * 1e3:.0f}", f"{n:.0f}"] for name, ms, n in ops])
    attention = sum(ms for name, ms, _ in ops if name.startswith("ffi_call"))
    print(f"attention kernel calls (ffi_call): {attention / steps * 1e3:.0f} us per step of "
          f"{sum(ms for _, ms, _ in ops) / steps * 1e3:.0f} us in the ops listed")


def hf_generate(hf, ids: np.ndarray, steps: int, cache: str | None, stamps: list | None = None):
    import torch

    class Stamp:
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    if cache is not None:
        kwargs["cache_implementation"] = cache
    if stamps is not None:
        kwargs["logits_processor"] = [Stamp()]
    with torch.inference_mode():
        return hf.generate(torch.as_tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), **kwargs)


def time_hf(hf, ids: np.ndarray, steps: int, cache: str | None, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        stamps: list[float] = []
        hf_generate(hf, ids, steps + 1, cache, stamps)
        runs.append(float(np.median(np.diff(stamps))))
    return min(runs)


def time_nnx(config: BenchConfig, batch: int, context: int, steps: int, repeats: int, nnx_model=None) -> float:
    model = nnx_model or NNXDecoder(config, nnx.Rngs(0))
    tokens0 = jnp.zeros((batch,), jnp.int32)

    def run():
        model.fill_cache(batch, context + steps, context)
        jax.block_until_ready(nnx.state(model, nnx.Cache))
        start = time.perf_counter()
        tokens = tokens0
        for _ in range(steps):
            tokens = nnx_step(model, tokens)
        tokens.block_until_ready()
        return (time.perf_counter() - start) / steps

    run()  # compile
    return min(run() for _ in range(repeats))


def time_read_floor(model, config: BenchConfig, batch: int, context: int, repeats: int) -> float:
    """What one decode step must read at least, timed: a jitted ``jnp.sum`` over one float32
    buffer as large as all weights plus the keys and values cached at this context.

    A decode step reads every weight and every cached key and value once; at this machine's
    reduction rate (a multi-threaded YNNPACK kernel, the fastest read XLA:CPU has) that read
    alone takes this long. An implementation reading float32 weights and cache once per step
    cannot beat it by much, so ``their time / floor`` bounds the speed-up any could show.
    """
    weights = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cache = 2 * config.num_layers * batch * config.num_kv_heads * context * config.head_dim
    buffer = jnp.asarray(np.random.default_rng(0).standard_normal(weights + cache, np.float32))
    read = jax.jit(jnp.sum)
    read(buffer).block_until_ready()
    return best_time(lambda: read(buffer).block_until_ready(), max(repeats, 10))


def check_same_tokens(hf, model, ids: np.ndarray, steps: int) -> bool:
    """jaxkv and transformers pick the same greedy tokens (same weights, same model)."""
    import jaxkv

    ours = np.asarray(jaxkv.generate(model, jnp.asarray(ids), steps).tokens)
    theirs = hf_generate(hf, ids, steps, None).numpy()[:, ids.shape[1]:]
    return bool((ours == theirs).all())


def run_benchmark(config: BenchConfig, cells: list[tuple[int, int]], *, steps: int, repeats: int,
                  strategies=STRATEGIES, threads: int | None = None, log=print) -> dict:
    """Step time per strategy for each (batch, context) cell; returns the JSON payload."""
    import torch

    torch.set_num_threads(threads or os.cpu_count())
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        hf, model = build_models(config, directory)
        rng = np.random.default_rng(0)
        parity = check_same_tokens(hf, model, rng.integers(1, config.vocab_size, (2, 16)), 8)
        log(f"jaxkv == transformers greedy tokens (same weights): {parity}")
        hf_generate(hf, rng.integers(1, config.vocab_size, (1, 16)), 4, None)  # warm torch up
        nnx_model = NNXDecoder(config, nnx.Rngs(0)) if "nnx" in strategies else None
        for batch, context in cells:
            ids = rng.integers(1, config.vocab_size, (batch, context))
            row = {"batch": batch, "context": context}
            for name in strategies:
                start = time.perf_counter()
                if name == "jaxkv":
                    row[name] = time_jaxkv(model, ids, steps, repeats)
                elif name == "nnx":
                    row[name] = time_nnx(config, batch, context, steps, repeats, nnx_model)
                else:
                    row[name] = time_hf(hf, ids, steps, None if name == "hf_dynamic" else "static", repeats)
                log(f"  B={batch} C={context} {name}: {row[name] * 1e3:.3f} ms/step "
                    f"({time.perf_counter() - start:.1f} s)")
            row["read_floor"] = time_read_floor(model, config, batch, context + steps // 2, repeats)
            rows.append(row)
    return {
        "machine": machine(),
        "config": dataclasses.asdict(config),
        "steps": steps,
        "repeats": repeats,
        "torch_threads": threads or os.cpu_count(),
        "parity_greedy_tokens": parity,
        "method": {
            "jaxkv": "one jitted, donated loop of N decode steps (its tokens checked equal to jaxkv.generate's) / N, "
                     "best of R runs, compiled before the clock",
            "hf_dynamic": "median gap between logits-processor calls in one model.generate, best of R runs",
            "hf_static": "same, cache_implementation='static'",
            "nnx": "N nnx.jit single-token steps over a pre-filled MultiHeadAttention(decode=True) cache / N, "
                   "best of R runs",
            "read_floor": "jitted jnp.sum over one f32 buffer of weights + cache bytes at context + N/2, best of 10",
        },
        "unit": "seconds per decode step (one token per row)",
        "rows": rows,
    }


def report(payload: dict) -> list[list]:
    """Prints the table: ms/step, tokens/s (batch x steps/s) and jaxkv's speed-up, met or not."""
    strategies = [s for s in STRATEGIES if s in payload["rows"][0]]
    others = [s for s in strategies if s != "jaxkv"]
    floor = "read_floor" in payload["rows"][0]
    headers = ["B", "context"] + [f"{s} ms" for s in strategies] + ["jaxkv tok/s"]
    headers += [f"x {s} (goal {GOALS[s]}x)" for s in others]
    if floor:
        headers += ["read floor ms", "jaxkv / floor", "best possible x hf_static"]
    table = []
    for r in payload["rows"]:
        cells = [r["batch"], r["context"]] + [f"{r[s] * 1e3:.2f}" for s in strategies]
        cells.append(f"{r['batch'] / r['jaxkv']:.0f}" if r["jaxkv"] > 0 else "-")
        for s in others:
            if r["jaxkv"] <= 0:  # a time of 0 (a timer that did not tick): no ratio
                cells.append("noise")
                continue
            ratio = r[s] / r["jaxkv"]
            cells.append(f"{ratio:.2f} {'met' if ratio >= GOALS[s] else 'NOT met'}")
        if floor:
            cells += [f"{r['read_floor'] * 1e3:.2f}", f"{r['jaxkv'] / r['read_floor']:.1f}x"]
            cells.append(f"{r['hf_static'] / r['read_floor']:.1f}x" if "hf_static" in r else "-")
        table.append(cells)
    print_table(headers, table)
    return table


# --------------------------------------------------------------------------- memory


MEMORY_CHILD = r"""
import gc, json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from flax import nnx
import jaxkv
from jaxkv.generation import GREEDY, _generate
from jaxkv.models import Llama, LlamaConfig  # noqa


def status(field):  # kB -> bytes, from /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


tiny = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
jaxkv.generate(tiny, jnp.ones((1, 16), jnp.int32), 2).tokens.block_until_ready()  # runtime loaded and warm
from jaxkv.models import from_pretrained
import ctypes
gc.collect()
# Free heap pages left by the warm-up go back to the OS first: from_pretrained ends with
# malloc_trim, which would otherwise hand them back too and shrink the weights' growth.
ctypes.CDLL("libc.so.6").malloc_trim(0)
before_model = status("VmRSS")
model = from_pretrained({checkpoint!r}).model  # what a user does: safetensors -> device arrays
jax.block_until_ready(nnx.state(model))
gc.collect()
after_model = status("VmRSS")
graphdef, state = nnx.split(model)
ids = jnp.ones(({batch}, {context}), jnp.int32)
args = (graphdef, state, ids, jnp.full(({batch},), {context}, jnp.int32), None, jnp.array([-1], jnp.int32), jnp.int32(0))
kw = dict(max_new_tokens={steps}, capacity={context} + {steps}, sampling=GREEDY, cache_dtype=None, chunk_size={chunk})
reset_peak()
compiled = _generate.lower(*args, **kw).compile()  # the compiler's own peak, apart from the run's
compile_peak = status("VmHWM")
plan = compiled.memory_analysis()
gc.collect()
before_run = status("VmRSS")
reset_peak()
jax.block_until_ready(compiled(*args[1:]))
run_peak = status("VmHWM")
print(json.dumps(dict(before_model=before_model, after_model=after_model, compile_peak=compile_peak,
                      before_run=before_run, run_peak=run_peak, xla_temp=int(plan.temp_size_in_bytes),
                      xla_output=int(plan.output_size_in_bytes))))
"""


def memory_report(config: BenchConfig, *, batch: int, context: int, steps: int, chunk: int | None = 512) -> dict:
    """Peak process memory of one generate program run, apart from compiling it.

    Each measurement runs in a fresh subprocess that loads the JAX runtime (a warm generate
    on the tiny test model), then measures with ``/proc/self/status`` (resetting the peak,
    ``VmHWM``, through ``/proc/self/clear_refs`` before each phase):

    * weights: RSS growth when the model is loaded with ``from_pretrained`` from a
      safetensors checkpoint (a random transformers model of the config, saved once);
    * run: peak RSS while the compiled ``generate`` program (prefill + decode loop, the
      cache allocated inside it) runs, minus RSS just before it ran;
    * compile: peak RSS while XLA compiles the program, reported apart: compiling is not
      generating, and its scratch memory is gone before the first token.

    Measured memory = weights + run growth, against weights + cache + activations computed
    from the config. Activations are the largest live set of one prefill chunk of C tokens
    (``prefill_chunk_size``; the whole prompt when ``chunk`` is None): the MLP's two
    [B, C, F], four [B, C, max(E, Hq*D)] and the blockwise attention's scores and weights,
    2 x [B, Hq, block, C] (``blockwise_attend``'s default block: 128 for chunks of more than
    16 tokens), plus the [B, V] logits. XLA's own plan
    (``memory_analysis().temp_size_in_bytes``) is reported beside it as an independent figure.
    """
    with tempfile.TemporaryDirectory() as directory:
        build_models(config, directory)
        code = MEMORY_CHILD.format(root=str(ROOT), checkpoint=directory, batch=batch, context=context, steps=steps,
                                   chunk=chunk)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    c, f32 = config, 4
    capacity = context + steps  # context is a power of two, so the prompt bucket is the context itself
    weights = f32 * (
        2 * c.vocab_size * c.hidden_size
        + c.num_layers * (
            c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            + c.num_heads * c.head_dim * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
            + 2 * c.hidden_size
        )
        + c.hidden_size
    )
    cache = f32 * 2 * c.num_layers * batch * capacity * c.num_kv_heads * c.head_dim
    tokens = min(chunk or context, context)
    widest = max(c.hidden_size, c.num_heads * c.head_dim)
    block = min(512 if tokens <= 16 else 128, capacity)  # blockwise_attend's default block
    activations = f32 * batch * (
        tokens * (2 * c.intermediate_size + 4 * widest) + 2 * c.num_heads * block * tokens + c.vocab_size
    )
    expected = weights + cache + activations
    measured_weights = m["after_model"] - m["before_model"]
    run_growth = m["run_peak"] - m["before_run"]
    measured = measured_weights + run_growth
    return {
        "batch": batch, "context": context, "steps": steps, "prefill_chunk_size": chunk,
        "weights": weights, "cache": cache, "activations": activations, "expected": expected,
        "measured_weights": measured_weights, "run_growth": run_growth, "measured": measured,
        "ratio": measured / expected,
        "compile_peak_growth": m["compile_peak"] - m["after_model"],
        "xla_temp": m["xla_temp"], "ratio_vs_xla_plan": measured / (weights + cache + m["xla_temp"]),
    }


def memory_table(batch: int, context: int) -> list[dict]:
    """Memory of generate: chunked prefill (the default) and one-shot prefill at (batch,
    context), and chunked prefill at 4x the batch (a cache 4x as large)."""
    settings = [(batch, 512), (batch, None), (4 * batch, 512)]
    rows = [memory_report(FULL, batch=b, context=context, steps=16, chunk=chunk) for b, chunk in settings]
    mib = 2**20
    print(f"\nPeak memory of generate, {context}-token prompts, 16 new tokens (MiB; goal: measured <= 1.1x "
          "weights + cache + activations)")
    print_table(
        ["B", "prefill", "weights", "cache", "activations", "expected", "measured (weights + run peak growth)",
         "ratio", "XLA temp plan", "compile peak growth"],
        [[r["batch"], f"chunks of {r['prefill_chunk_size']}" if r["prefill_chunk_size"] else "one shot",
          f"{r['weights'] / mib:.1f}", f"{r['cache'] / mib:.1f}", f"{r['activations'] / mib:.1f}",
          f"{r['expected'] / mib:.1f}",
          f"{r['measured_weights'] / mib:.1f} + {r['run_growth'] / mib:.1f} = {r['measured'] / mib:.1f}",
          f"{r['ratio']:.3f} {'met' if r['ratio'] <= 1.1 else 'NOT met'}", f"{r['xla_temp'] / mib:.1f}",
          f"{r['compile_peak_growth'] / mib:.0f}"] for r in rows],
    )
    return rows


# --------------------------------------------------------------------------- plot


def plot(payload: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in payload["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.6), squeeze=False)
    labels = {"jaxkv": "jaxkv.generate", "hf_dynamic": "transformers (dynamic cache)",
              "hf_static": "transformers (static cache)", "nnx": "Flax NNX MultiHeadAttention(decode=True)"}
    for ax, batch in zip(axes[0], batches):
        rows = sorted((r for r in payload["rows"] if r["batch"] == batch), key=lambda r: r["context"])
        for s in STRATEGIES:
            if s in rows[0]:
                ax.plot([r["context"] for r in rows], [r[s] * 1e3 for r in rows], "o-", label=labels[s])
        if "read_floor" in rows[0]:
            ax.plot([r["context"] for r in rows], [r["read_floor"] * 1e3 for r in rows], "k--",
                    label="read floor: jnp.sum over as many bytes as weights + cache")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens in the cache)")
        ax.set_ylabel("decode step time (ms)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
    c = payload["config"]
    fig.suptitle(f"Decode step time, Llama L={c['num_layers']} E={c['hidden_size']} Hq={c['num_heads']} "
                 f"H={c['num_kv_heads']} D={c['head_dim']} V={c['vocab_size']}, f32, "
                 f"{payload['machine']['backend']} ({payload['machine']['cpus']} cores, shared)", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend below the panels
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run; writes nothing")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-context-batch8", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", default=str(HERE / "results" / "generate.json"))
    parser.add_argument("--png", default=str(ROOT / "docs" / "decode_step_time.png"))
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help="only the memory table (updates the JSON)")
    parser.add_argument("--profile", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                        help="only a profiler breakdown of jaxkv's decode step in one cell")
    args = parser.parse_args()

    if args.profile:
        profile_cell(FULL, *args.profile, steps=64)
        return
    if args.plot_only:
        with open(args.json) as f:
            plot(json.load(f), args.png)
        return
    if args.quick:
        args.contexts, args.batches, args.steps, args.repeats = [256], [1], 16, 2
    cells = [(b, c) for b in args.batches for c in args.contexts if b == 1 or c <= args.max_context_batch8]
    start = time.perf_counter()
    if args.memory_only:
        payload = {"machine": machine(), "memory": memory_table(1, 8192)}
        if os.path.exists(args.json):  # keep the step-time rows of the last full run
            with open(args.json) as f:
                payload = {**json.load(f), "memory": payload["memory"]}
        write_json(args.json, payload)
        return
    payload = run_benchmark(FULL, cells, steps=args.steps, repeats=args.repeats)
    report(payload)
    if args.memory:
        # Large enough that the data outweighs the runtime's own noise.
        batch, context = (1, 1024) if args.quick else (1, 8192)
        payload["memory"] = memory_table(batch, context)
    payload["wall_s"] = time.perf_counter() - start
    print(f"total {payload['wall_s']:.0f} s")
    if not args.quick:
        write_json(args.json, payload)
        plot(payload, args.png)


if __name__ == "__main__":
    main()

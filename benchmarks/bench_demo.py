"""The demo's cost (``make demo``: ``python -m jaxkv generate "def fibonacci(" --max-new-tokens 120``).

Two tables, all figures from this one run (the machines here are shared: compare ratios):

* Stream rate, in this process, on the embedded model with the demo's sampling
  (temperature 0.8, top-k 40, top-p 0.95, seed 0) and no stop token, after a warm-up
  iteration (so nothing compiles while timed), best of R iterations:

  - ``old``: the path before issue 17, rebuilt here: one jitted decode step per token, the
    token copied to the host, padded, copied back, and the whole output detokenized again
    for every token, sampling over the whole vocabulary (an argsort of 4096 probabilities
    for top-p; :func:`sample_over_vocabulary`);
  - ``stream k=16, sort over V``: the stream below with that same full-vocabulary sampling;
  - ``stream k=1``: :func:`jaxkv.stream` with one step per device call, the CLI's
    incremental detokenizer;
  - ``stream k=16``: the CLI's setting (16 steps per device call);
  - ``device only``: the same 16-step decode calls with no host work between them: the
    floor the stream approaches. The greedy rows show how much of it is sampling
    (top-k/top-p sort and the Gumbel draw over the 4096-token vocabulary).

* Cold start: ``python -m jaxkv generate`` in fresh subprocesses, time from launch to the
  first generated character on stdout and to exit, without the compilation cache
  (``JAXKV_COMPILATION_CACHE=0``), with an empty cache directory (the first run fills it),
  and with the filled one. Best of R for each. ``--other-pythonpath DIR`` adds the filled
  case alternated with ``PYTHONPATH=DIR`` (``constraints.txt``: ml_dtypes 0.7.0's import).

    python benchmarks/bench_demo.py            # writes benchmarks/results/demo.json
    python benchmarks/bench_demo.py --quick    # fewer tokens and repeats, writes nothing
    pip install --target /tmp/mld070 --no-deps ml_dtypes==0.7.0
    python benchmarks/bench_demo.py --other-pythonpath /tmp/mld070
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import machine, print_table, write_json  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv.generation  # noqa: E402
from jaxkv.cli import Detokenizer, embedded_model_path  # noqa: E402
from jaxkv.generation import _prepare, _stream_programs, decode_step, init_model_cache, prefill, stream  # noqa: E402
from jaxkv.models import from_pretrained  # noqa: E402
from jaxkv.sampling import SamplingConfig  # noqa: E402

PROMPT = "def fibonacci("
DEMO_SAMPLING = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)
GREEDY = SamplingConfig()


def sample_over_vocabulary(logits, key, config):
    """``jaxkv.sampling.sample`` before it drew over the top-k survivors: the top-k as a
    threshold over all V logits, top-p by an argsort of all V probabilities, the draw over V."""
    if config.is_greedy:
        return jaxkv.generation.greedy(logits)
    logits = logits.astype(jnp.float32) / config.temperature
    if config.top_k:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if config.top_p is not None:
        probs = jax.nn.softmax(logits, axis=-1)
        order = jnp.argsort(-probs, axis=-1, stable=True)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        keep_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < config.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@contextlib.contextmanager
def sampling_over_vocabulary():
    """Programs traced inside use :func:`sample_over_vocabulary` (stream's cached programs are rebuilt)."""
    current = jaxkv.generation.sample
    _stream_programs.cache_clear()
    jaxkv.generation.sample = sample_over_vocabulary
    try:
        yield
    finally:
        jaxkv.generation.sample = current
        _stream_programs.cache_clear()


def old_stream(model, ids, max_new_tokens, sampling, key):
    """The stream and CLI loop before issue 17: one donated jitted step per token, a host
    round trip per token, the whole output detokenized again per token. Yields text."""
    ids, lengths, row_keys, stop_ids, chunk, _, _ = _prepare(
        model, ids, max_new_tokens, None, key, None, 0, sampling, True, 512, "old"
    )
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def run_prefill(leaves, input_ids, prompt_lengths, cache, row_keys):
        return prefill(graphdef, jax.tree.unflatten(treedef, leaves), input_ids, prompt_lengths, cache, row_keys,
                       sampling, chunk)

    def run_step(leaves, tokens, cache, row_keys, step, active):
        return decode_step(graphdef, jax.tree.unflatten(treedef, leaves), tokens, cache, row_keys, step, sampling,
                           active)

    jit_prefill = jax.jit(run_prefill, donate_argnames="cache")
    jit_step = jax.jit(run_step, donate_argnames="cache")
    stop = set(np.asarray(stop_ids).tolist())

    def run(tokenizer):
        cache = init_model_cache(model, 1, ids.shape[1] + max_new_tokens)
        tokens, cache = jit_prefill(leaves, ids, lengths, cache, row_keys)
        done = np.zeros((1,), bool)
        generated, printed = [], ""
        for step in range(max_new_tokens):
            if step:
                tokens, cache = jit_step(leaves, tokens, cache, row_keys, jnp.int32(step), jnp.asarray(~done))
            host = np.asarray(tokens).copy()
            host[done] = 0
            tokens = jnp.asarray(host)
            done = done | np.isin(host, list(stop))
            generated.append(int(host[0]))
            text = tokenizer.decode(generated)
            if not text.endswith("\ufffd") and text.startswith(printed):
                yield text[len(printed):]
                printed = text

    return run


def new_stream(model, ids, max_new_tokens, sampling, key, tokens_per_call):
    """The CLI's loop now: jaxkv.stream and the incremental detokenizer. Yields text."""
    s = stream(model, ids, max_new_tokens, sampling=sampling, key=key, tokens_per_call=tokens_per_call)

    def run(tokenizer):
        detokenizer = Detokenizer(tokenizer)
        for tokens in s:
            text = detokenizer.push(int(tokens[0]))
            if text:
                yield text

    return run


def device_only(model, ids, max_new_tokens, sampling, key, tokens_per_call):
    """The stream's decode calls back to back, nothing on the host but the call loop."""
    s = stream(model, ids, max_new_tokens, sampling=sampling, key=key, tokens_per_call=tokens_per_call)
    _, lengths, row_keys, stop_ids, pad_id, _, _, chunk = s._args

    def run(tokenizer):
        last, cache, history = s._prefill(s._leaves, s._args[0], lengths, s._empty_cache(), row_keys,
                                          *s._history_prompt, sampling=sampling, chunk_size=chunk)
        done, limit = jnp.zeros((1,), bool), jnp.int32(max_new_tokens)
        for step in range(1, max_new_tokens, tokens_per_call):
            tokens, _, last, cache, done, history = s._decode(
                s._leaves, last, cache, row_keys, jnp.int32(step), done, stop_ids, jnp.int32(pad_id), limit,
                history, sampling=sampling, num_steps=tokens_per_call,
            )
        tokens.block_until_ready()
        yield from ()

    return run


def time_stream(run, tokenizer, tokens, repeats):
    """Best tokens/s over ``repeats`` iterations, timed from the second token on (the first
    is the prefill, the same in every path), text written to a StringIO as the CLI does."""
    best = 0.0
    for i in range(repeats + 1):  # the first iteration compiles
        out = io.StringIO()
        start = time.perf_counter()
        for text in run(tokenizer):
            out.write(text)
        elapsed = time.perf_counter() - start
        if i:
            best = max(best, (tokens - 1) / elapsed)
    return best


def stream_table(tokens: int, repeats: int) -> list[dict]:
    loaded = from_pretrained(embedded_model_path())
    ids = jnp.asarray([loaded.tokenizer.encode(PROMPT).ids], jnp.int32)
    key = jax.random.key(0)
    rows = []
    for name, sampling in (("demo sampling", DEMO_SAMPLING), ("greedy", GREEDY)):
        # Each path is built inside its sampling context: jitted programs trace on first
        # call and read the sampler then, and stream's programs are shared per model.
        paths = {
            "old": lambda: old_stream(loaded.model, ids, tokens, sampling, key),
            "stream k=16, sort over V": lambda: new_stream(loaded.model, ids, tokens, sampling, key, 16),
            "stream k=1": lambda: new_stream(loaded.model, ids, tokens, sampling, key, 1),
            "stream k=16": lambda: new_stream(loaded.model, ids, tokens, sampling, key, 16),
            "device only k=16": lambda: device_only(loaded.model, ids, tokens, sampling, key, 16),
        }
        rates = {}
        for path, make in paths.items():
            with sampling_over_vocabulary() if path in ("old", "stream k=16, sort over V") else contextlib.nullcontext():
                rates[path] = time_stream(make(), loaded.tokenizer, tokens, repeats)
        for path, rate in rates.items():
            rows.append(dict(sampling=name, path=path, tokens_per_s=rate, ms_per_token=1e3 / rate,
                             vs_old=rate / rates["old"]))
    return rows


def cold_run(env: dict) -> tuple[float, float, str]:
    """(seconds to the first generated character, seconds to exit, the summary line)."""
    command = [sys.executable, "-m", "jaxkv", "generate", PROMPT, "--max-new-tokens", "120"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    echoed = process.stdout.read(len(PROMPT.encode()))
    assert echoed == PROMPT.encode(), echoed
    first = process.stdout.read(1)
    first_token = time.perf_counter() - start
    rest = process.stdout.read()
    stderr = process.stderr.read()
    if process.wait() != 0 or not first:
        raise RuntimeError(f"jaxkv generate failed: {stderr.decode()}")
    total = time.perf_counter() - start
    summary = (first + rest).decode().strip().splitlines()[-1]
    return first_token, total, summary


def cold_table(repeats: int, other_pythonpath: str | None = None) -> list[dict]:
    """The cold-start rows. With ``other_pythonpath``, two more filled-cache rows, alternated
    run by run: this environment as it is, and with ``PYTHONPATH=other_pythonpath`` in front
    (e.g. a ``pip install --target DIR --no-deps ml_dtypes==0.7.0``: its import time)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    rows = []

    def add(name, runs):
        first, total = min(r[0] for r in runs), min(r[1] for r in runs)
        rows.append(dict(case=name, first_token_s=first, total_s=total, runs=len(runs), summary=runs[-1][2]))

    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-xla-") as directory:
        cases = [
            ("no compilation cache", {**env, "JAXKV_COMPILATION_CACHE": "0"}, repeats),
            ("empty cache (first run)", {**env, "JAXKV_COMPILATION_CACHE": directory}, 1),
            ("filled cache", {**env, "JAXKV_COMPILATION_CACHE": directory}, repeats),
        ]
        for name, case_env, n in cases:
            add(name, [cold_run(case_env) for _ in range(n)])
        if other_pythonpath is not None:
            filled = {**env, "JAXKV_COMPILATION_CACHE": directory}
            other = {**filled, "PYTHONPATH": os.pathsep.join(p for p in (other_pythonpath, env.get("PYTHONPATH")) if p)}
            pairs = [(cold_run(filled), cold_run(other)) for _ in range(repeats)]
            add("filled cache, alternated: as installed", [a for a, _ in pairs])
            add(f"filled cache, alternated: PYTHONPATH={other_pythonpath}", [b for _, b in pairs])
    base = rows[0]
    for row in rows:
        row["first_token_vs_no_cache"] = row["first_token_s"] / base["first_token_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats; writes nothing")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per timed stream (default 512)")
    parser.add_argument("--other-pythonpath", default=None, metavar="DIR",
                        help="also time the filled-cache cold start with PYTHONPATH=DIR, alternated with the "
                             "plain one (e.g. DIR from `pip install --target DIR --no-deps ml_dtypes==0.7.0`)")
    args = parser.parse_args()
    tokens = args.tokens or (128 if args.quick else 512)
    repeats = 2 if args.quick else 5

    print(f"## Stream rate, embedded model, {tokens} tokens, best of {repeats} (tokens/s from the second token)")
    stream_rows = stream_table(tokens, repeats)
    print_table(
        ["sampling", "path", "tokens/s", "ms/token", "vs old"],
        [[r["sampling"], r["path"], f"{r['tokens_per_s']:.0f}", f"{r['ms_per_token']:.3f}", f"{r['vs_old']:.2f}x"]
         for r in stream_rows],
    )
    print()
    print(f"## Cold start: python -m jaxkv generate {PROMPT!r} --max-new-tokens 120, best of {repeats}")
    cold_rows = cold_table(repeats, args.other_pythonpath)
    print_table(
        ["compilation cache", "first token (s)", "exit (s)", "first token vs no cache"],
        [[r["case"], f"{r['first_token_s']:.2f}", f"{r['total_s']:.2f}", f"{r['first_token_vs_no_cache']:.2f}x"]
         for r in cold_rows],
    )
    print(f"last summary line: {cold_rows[-1]['summary']}")
    if not args.quick:
        write_json(os.path.join(os.path.dirname(__file__), "results", "demo.json"),
                   dict(machine=machine(), tokens=tokens, repeats=repeats, stream=stream_rows, cold_start=cold_rows))


if __name__ == "__main__":
    main()

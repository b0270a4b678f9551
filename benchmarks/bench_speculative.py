"""Speculative decoding with the embedded pycoder model and its draft: acceptance and speedup.

Target: ``jaxkv/_assets/pycoder`` (6 layers, width 192). Draft: ``jaxkv/_assets/pycoder-draft``
(2 layers, width 96, same tokenizer; ``scripts/train_draft.py``). Both greedy, so the
speculative tokens must equal the target's own greedy tokens (checked on every prompt).

Baseline: target-only greedy decoding as one compiled program (prefill + ``lax.scan`` of
single-token steps, ``jaxkv.decoding.sample_n`` with a greedy config). Speculative: the
same prompts through ``speculative_generate`` for several draft lengths k. Every timing is
the median of ``--repeats`` runs after a compile run, measured in this one process, so the
ratios compare like with like on this (shared, 2-core) machine.

    python benchmarks/bench_speculative.py            # table + benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from common import machine, print_table, time_calls, write_json  # noqa: E402
from jaxkv.decoding import sample_n, speculative_generate  # noqa: E402
from jaxkv.models import from_pretrained  # noqa: E402
from jaxkv.sampling import SamplingConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(",
    "        if not isinstance(value, str):\n            raise",
    "def read_file(path):\n    with open(path",
    '"""Utilities for parsing command line arguments."""\n\nimport',
    "        self.assertEqual(",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO / "jaxkv/_assets/pycoder"))
    p.add_argument("--draft", default=str(REPO / "jaxkv/_assets/pycoder-draft"))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 3, 4, 6])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8],
                   help="prompts decoded together (all 8 prompts run, in batches of this size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/speculative.json"))
    args = p.parse_args(argv)

    target, draft = from_pretrained(args.target), from_pretrained(args.draft)
    if target.tokenizer.to_str() != draft.tokenizer.to_str():
        raise SystemExit("target and draft tokenizers differ; retrain the draft with scripts/train_draft.py")
    encoded = [target.tokenizer.encode(text).ids for text in PROMPTS]
    width = max(len(e) for e in encoded)
    n = args.new_tokens
    greedy = SamplingConfig()
    rows, results = [], []
    for batch in args.batch:
        # Batches of `batch` prompts covering every prompt once; timings are summed over them.
        groups = [list(range(i, i + batch)) for i in range(0, len(encoded), batch)]
        inputs = []
        for group in groups:
            ids = np.zeros((batch, width), np.int32)
            lengths = np.zeros((batch,), np.int32)
            for b, i in enumerate(group):
                ids[b, : len(encoded[i])] = encoded[i]
                lengths[b] = len(encoded[i])
            inputs.append((ids, lengths))

        def run_all(fn):
            return [np.asarray(fn(ids, lengths)) for ids, lengths in inputs]

        def greedy_tokens(model):
            def fn(ids, lengths):
                return sample_n(model, ids, n, num_return_sequences=1, key=jax.random.key(0), config=greedy,
                                prompt_lengths=lengths)[:, 0]
            return fn

        want = np.concatenate(run_all(greedy_tokens(target.model)))
        t_base = time_calls(lambda: run_all(greedy_tokens(target.model)), repeats=args.repeats, warmup=0)
        t_draft = time_calls(lambda: run_all(greedy_tokens(draft.model)), repeats=args.repeats, warmup=1)
        tokens = len(encoded) * n
        rows.append([batch, "target only", "-", "-", "-", f"{tokens / t_base:.0f}", f"{t_base * 1e3:.0f}", "1.00"])
        rows.append([batch, "draft only", "-", "-", "-", f"{tokens / t_draft:.0f}", f"{t_draft * 1e3:.0f}",
                     f"{t_base / t_draft:.2f}"])
        results.append(dict(batch=batch, method="target_only", seconds=t_base, tokens_per_s=tokens / t_base))
        results.append(dict(batch=batch, method="draft_only", seconds=t_draft, tokens_per_s=tokens / t_draft))
        for k in args.draft_tokens:
            def spec(k=k):
                outs = [speculative_generate(target.model, draft.model, ids, n, num_draft_tokens=k,
                                             prompt_lengths=lengths) for ids, lengths in inputs]
                for out in outs:
                    out.tokens.block_until_ready()
                return outs

            outs = spec()
            got = np.concatenate([np.asarray(out.tokens) for out in outs])
            same = bool((got == want).all())
            mismatched_rows = int((got != want).any(axis=1).sum())
            t_spec = time_calls(spec, repeats=args.repeats, warmup=0)
            accepted = np.concatenate([np.asarray(out.accepted) for out in outs])
            rounds = np.concatenate([np.asarray(out.rounds) for out in outs])
            rate = float(accepted.sum() / (rounds.sum() * k))
            per_round = float(((accepted + rounds) / rounds).mean())
            rows.append([batch, "speculative", k, f"{rate:.2f}", f"{per_round:.2f}", f"{tokens / t_spec:.0f}",
                         f"{t_spec * 1e3:.0f}", f"{t_base / t_spec:.2f}"])
            results.append(dict(
                batch=batch, method="speculative", num_draft_tokens=k, acceptance_rate=rate,
                tokens_per_round=per_round, seconds=t_spec, tokens_per_s=tokens / t_spec, speedup=t_base / t_spec,
                tokens_equal_target_greedy=same, rows_differing=mismatched_rows,
            ))
            if not same:
                print(f"warning: batch {batch}, k={k}: {mismatched_rows} row(s) differ from target greedy "
                      "(a near-tie decided differently by the (k+1)-token forward)")

    print(f"\n{len(encoded)} prompts x {n} new tokens; median of {args.repeats} runs after compilation")
    print_table(["batch", "method", "k", "acceptance", "tokens/round", "tokens/s", "ms", "speedup"], rows)

    # Why: per-forward costs inside a compiled loop, and the acceptance a round needs to pay off.
    capacity = width + n + max(args.draft_tokens)
    cost_rows, costs = [], []
    for batch in args.batch:
        t1 = forward_ms(target.model, batch, 1, capacity)
        d1, d2 = forward_ms(draft.model, batch, 1, capacity), forward_ms(draft.model, batch, 2, capacity)
        for k in args.draft_tokens:
            verify = forward_ms(target.model, batch, k + 1, capacity)
            round_steps = (d2 + (k - 1) * d1 + verify) / t1
            needed = break_even_acceptance(k, round_steps)
            cost_rows.append([batch, k, f"{t1:.2f}", f"{d1:.2f}", f"{verify:.2f}", f"{round_steps:.2f}",
                              "never" if needed is None else f"{needed:.2f}"])
            costs.append(dict(batch=batch, num_draft_tokens=k, target_step_ms=t1, draft_step_ms=d1,
                              draft_two_token_step_ms=d2, verify_ms=verify, round_cost_in_target_steps=round_steps,
                              break_even_acceptance=needed))
    print("\nper-forward cost inside a compiled loop (ms) and the acceptance needed to break even")
    print_table(["batch", "k", "target T=1", "draft T=1", "target T=k+1", "round / target step", "break-even acc."],
                cost_rows)
    write_json(args.out, dict(
        command=("python benchmarks/bench_speculative.py " + " ".join(argv or sys.argv[1:])).strip(),
        target=_rel(args.target), draft=_rel(args.draft), new_tokens=n, repeats=args.repeats,
        target_parameters=int(sum(x.size for x in jax.tree.leaves(_params(target.model)))),
        draft_parameters=int(sum(x.size for x in jax.tree.leaves(_params(draft.model)))),
        results=results, forward_costs=costs, machine=machine(),
    ))


def forward_ms(model, batch, num_tokens, capacity, iters=50):
    """Milliseconds per ``[batch, num_tokens]`` cached forward inside a compiled loop."""
    import time

    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.decoding._common import forward

    graphdef, state = nnx.split(model)
    prefix = 16

    @jax.jit
    def run(state, cache):
        def body(_, carry):
            cache, acc = carry
            logits, cache = forward(graphdef, state, jnp.ones((batch, num_tokens), jnp.int32), cache)
            return cache.crop(prefix), acc + logits[:, -1, 0]

        return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros((batch,))))[1]

    cache = model.init_cache(batch, capacity)
    _, cache = forward(graphdef, state, jnp.ones((batch, prefix), jnp.int32), cache)
    run(state, cache).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run(state, cache).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best / iters * 1e3


def break_even_acceptance(k, round_cost):
    """Per-token acceptance a at which (1 - a^(k+1)) / (1 - a) tokens per round pay for
    ``round_cost`` (in target single-token steps); None if even a = 1 does not."""
    def tokens(a):
        return k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)

    if tokens(1.0) < round_cost:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens(mid) < round_cost else (lo, mid)
    return hi


def _params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def _rel(path):
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main()

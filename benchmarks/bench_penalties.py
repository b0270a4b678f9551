"""What the penalties cost per generated token: jaxkv.generate and transformers' generate,
each with and without them, on the same weights, side by side in one run.

For each model and batch size, a ``generate`` call of N tokens (greedy, no stop token, so
every call runs all N steps) is timed, best of R, with:

* ``plain``: no penalty;
* ``rep``: ``repetition_penalty=1.2`` (HF's; the prompt counts);
* ``all``: ``repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2`` (jaxkv
  only: transformers has no presence / frequency penalty);
* ``sampled`` / ``sampled rep``: jaxkv with the demo's sampling (temperature 0.8, top-k 40,
  top-p 0.95), without and with ``repetition_penalty=1.2``;

and the ratio to ``plain`` of the same library is the figure: what turning the penalty on
costs. jaxkv carries a ``[B, V]`` history through its loop (``jaxkv.sampling.TokenHistory``);
transformers' ``RepetitionPenaltyLogitsProcessor`` gathers and scatters over ``input_ids``
every step. ``same tokens`` says whether jaxkv's greedy tokens with ``rep`` equal
transformers' (same weights, float32). Models: the embedded model (V 4096, 6 layers) and a
random Llama with a 32000-token vocabulary (``bench_generate.BenchConfig``). The cores are
shared: compare the ratios of one run, not absolute times.

    python benchmarks/bench_penalties.py           # writes results/penalties.json
    python benchmarks/bench_penalties.py --quick   # smoke run, writes nothing
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from common import machine, print_table, write_json  # noqa: E402

REP = dict(repetition_penalty=1.2)
ALL = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)


def cell(hf, model, batch: int, prompt: int, steps: int, repeats: int, vocab: int) -> dict:
    import torch

    from jaxkv import SamplingConfig, generate

    ids = np.random.default_rng(batch).integers(1, vocab, size=(batch, prompt)).astype(np.int32)
    demo = dict(temperature=0.8, top_k=40, top_p=0.95)
    configs = {"plain": SamplingConfig(), "rep": SamplingConfig(**REP), "all": SamplingConfig(**ALL),
               "sampled": SamplingConfig(**demo), "sampled_rep": SamplingConfig(**demo, **REP)}

    def jaxkv_run(config):
        key = jax.random.key(0)
        return lambda: np.asarray(generate(model, ids, steps, sampling=config, key=key).tokens)

    # No stop token on either side, so both run all N steps and emit the same tokens (with
    # min_new_tokens instead, transformers would forbid its EOS id where jaxkv may pick it).
    hf.generation_config.eos_token_id = None
    prompt_ids = torch.tensor(ids, dtype=torch.long)
    mask = torch.ones_like(prompt_ids)

    def hf_run(**kwargs):
        def run():
            with torch.inference_mode():
                return hf.generate(prompt_ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                                   pad_token_id=0, **kwargs).numpy()[:, prompt:]
        return run

    row = {"batch": batch, "prompt": prompt, "steps": steps}
    runs = {f"jaxkv_{name}": jaxkv_run(config) for name, config in configs.items()}
    runs |= {"hf_plain": hf_run(), "hf_rep": hf_run(**REP)}
    times = {name: [] for name in runs}
    for name, fn in runs.items():
        fn()  # compile / warm up
    for _ in range(repeats):  # interleaved, so a change in load hits every variant alike
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        row[f"{name}_ms_per_token"] = 1000 * min(ts) / steps
    row["jaxkv_rep_ratio"] = row["jaxkv_rep_ms_per_token"] / row["jaxkv_plain_ms_per_token"]
    row["jaxkv_all_ratio"] = row["jaxkv_all_ms_per_token"] / row["jaxkv_plain_ms_per_token"]
    row["jaxkv_sampled_rep_ratio"] = row["jaxkv_sampled_rep_ms_per_token"] / row["jaxkv_sampled_ms_per_token"]
    row["hf_rep_ratio"] = row["hf_rep_ms_per_token"] / row["hf_plain_ms_per_token"]
    row["same_tokens"] = bool((runs["jaxkv_rep"]() == runs["hf_rep"]()).all())
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small cell per model; writes nothing")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers

    from bench_generate import BenchConfig, build_models
    from jaxkv.cli import embedded_model_path
    from jaxkv.models import from_pretrained

    torch.set_num_threads(os.cpu_count())
    steps = 32 if args.quick else 128
    repeats = args.repeats or (2 if args.quick else 5)
    batches = (1,) if args.quick else (1, 16)
    rows = []
    embedded = embedded_model_path()
    models = {"embedded (V 4096)": (transformers.AutoModelForCausalLM.from_pretrained(embedded).eval(),
                                    from_pretrained(embedded).model, 4096)}
    with tempfile.TemporaryDirectory() as tmp:
        config = BenchConfig(vocab_size=32000)
        hf, model = build_models(config, tmp)
        models["random (V 32000)"] = (hf, model, config.vocab_size)
        for label, (hf, model, vocab) in models.items():
            for batch in batches:
                row = {"model": label, **cell(hf, model, batch, 32, steps, repeats, vocab)}
                rows.append(row)
                print(f"{label} batch {batch}: jaxkv rep {row['jaxkv_rep_ratio']:.2f}x all {row['jaxkv_all_ratio']:.2f}x"
                      f" sampled rep {row['jaxkv_sampled_rep_ratio']:.2f}x"
                      f" | transformers rep {row['hf_rep_ratio']:.2f}x | same tokens {row['same_tokens']}", flush=True)
    table = [[r["model"], r["batch"], f"{r['jaxkv_plain_ms_per_token']:.3f}", f"{r['jaxkv_rep_ratio']:.2f}x",
              f"{r['jaxkv_all_ratio']:.2f}x", f"{r['jaxkv_sampled_ms_per_token']:.3f}",
              f"{r['jaxkv_sampled_rep_ratio']:.2f}x", f"{r['hf_plain_ms_per_token']:.3f}", f"{r['hf_rep_ratio']:.2f}x",
              f"{r['hf_plain_ms_per_token'] / r['jaxkv_plain_ms_per_token']:.1f}x",
              f"{r['hf_rep_ms_per_token'] / r['jaxkv_rep_ms_per_token']:.1f}x", r["same_tokens"]]
             for r in rows]
    print_table(["model", "batch", "jaxkv ms/token", "jaxkv rep / plain", "jaxkv all / plain",
                 "jaxkv sampled ms/token", "sampled rep / sampled", "HF ms/token", "HF rep / plain", "HF / jaxkv plain", "HF / jaxkv rep", "same tokens"], table)
    if not args.quick:
        write_json(str(HERE / "results" / "penalties.json"),
                   {"machine": machine(), "torch_threads": torch.get_num_threads(), "steps": steps,
                    "repeats": repeats, "rows": rows})


if __name__ == "__main__":
    main()

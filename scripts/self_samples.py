#!/usr/bin/env python
"""Rejection-sampled self-training data: the model's own functions that parse.

The embedded model continues the ``def`` headers of the **training** files of this Python's
stdlib (never a validation file, whose headers the goal is scored on, nor a tuning package)
exactly as ``scripts/eval_embedded.py`` continues its prompts (``jaxkv.generate``, top-k 40,
top-p 0.95, each temperature of ``--temperatures``, ``--max-new-tokens``). A continuation is
kept when the scorer of ``eval_embedded.py`` says it **finished** (the function ended within
the budget, at a line at column 0 or the end-of-text token) and **parses**, and when at
most ``--max-repeat-share`` of its tokens repeat an 8-token n-gram it already holds (the
stdlib's own functions: 0.8%; the loops the model falls into: 23-55%, see
``scripts/unlikelihood.py``). Each kept function is written as a function document of
``train_embedded.py --function-docs`` (header + body + newline, between end-of-text tokens),
re-encoded with the tokenizer so that the training sees the canonical token ids.

This is rejection-sampling fine-tuning (expert iteration, STaR: Zelikman et al. 2022;
ReST: Gulcehre et al. 2023): the next run trains on a mix of the corpus and these documents
(``train_embedded.py --self-data FILE --self-rows N``). Unlike the unlikelihood loss (runs
12-15) it is plain next-token likelihood on text that ends well, so there is no loss to
escape by ending a function early.

    python scripts/self_samples.py --out /tmp/rft/self.npz [--model DIR] [--headers 4000]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from eval_embedded import function_headers, pick_evenly, score  # noqa: E402
from stdlib_corpus import collect_sources, split_files  # noqa: E402


def repeat_share(ids, n: int = 8) -> float:
    """The share of ``ids`` that complete an ``n``-gram ending earlier in ``ids``."""
    seen, repeats = set(), 0
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1 : t + 1])
        repeats += gram in seen
        seen.add(gram)
    return repeats / max(1, len(ids))


def keep(scored: dict, body_ids, max_repeat_share: float) -> bool:
    """A continuation worth training on: finished, parses, and no loop."""
    return scored["finished"] and scored["parses"] and repeat_share(body_ids) <= max_repeat_share


def training_headers() -> list[tuple[str, int, str]]:
    """``(file, line, header)`` of every multi-line function of this stdlib's training files."""
    train_files, _ = split_files(collect_sources(Path(sysconfig.get_paths()["stdlib"])))
    return function_headers(train_files)


def without(headers, banned) -> list[tuple[str, int, str]]:
    """``headers`` less those whose text is one of ``banned`` (held-out or tuning prompts):
    a training file may hold the same signature (``def run(self):``) as a held-out one, and
    its prompt would then be the scored prompt itself."""
    banned = set(banned)
    return [h for h in headers if h[2] not in banned]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded model)")
    p.add_argument("--out", required=True, help="where the token stream (.npz) and its record (.json) go")
    p.add_argument("--headers", type=int, default=4000, help="training-file headers, evenly spaced")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-prompt-tokens", type=int, default=64, help="longer headers are skipped (one program)")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--max-repeat-share", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxkv import SamplingConfig, generate
    from jaxkv.cli import embedded_model_path
    from jaxkv.models import from_pretrained

    path = args.model or embedded_model_path()
    loaded = from_pretrained(path)
    tok = loaded.tokenizer
    eot = tok.token_to_id("<|endoftext|>")
    from eval_embedded import held_out_headers, tuning_headers

    # Run 17's data (docs/self_samples.json) was made before this exclusion: 43 of the 100
    # held-out header strings and 18 of the 200 tuning ones were among its 5973 prompts.
    scored = [h for _, _, h in held_out_headers(100)[1] + tuning_headers(200)[1]]
    headers = [h for h in pick_evenly(without(training_headers(), scored), args.headers)
               if len(tok.encode(h[2]).ids) <= args.max_prompt_tokens]
    print(f"{path}: {len(headers)} training-file headers, temperatures {args.temperatures}", flush=True)

    docs, record = [], {"model": str(path), "args": vars(args), "headers": len(headers), "by_temperature": []}
    seen = set()
    t0 = time.perf_counter()
    for ti, temperature in enumerate(args.temperatures):
        sampling = SamplingConfig(temperature=temperature, top_k=40, top_p=0.95)
        counts = {"temperature": temperature, "samples": 0, "finished_and_parse": 0, "kept": 0, "duplicates": 0}
        for start in range(0, len(headers), args.batch):
            chunk = headers[start : start + args.batch]
            encoded = [tok.encode(h).ids for _, _, h in chunk]
            ids = np.full((args.batch, args.max_prompt_tokens), eot, np.int32)  # one shape: one program
            lengths = np.ones((args.batch,), np.int32)
            for row, e in enumerate(encoded):
                ids[row, : len(e)] = e
                lengths[row] = len(e)
            key = jax.random.key(args.seed * 1000 + ti * 100 + start // args.batch)
            out = generate(loaded.model, jnp.asarray(ids), args.max_new_tokens, prompt_lengths=jnp.asarray(lengths),
                           sampling=sampling, key=key, eos_token_id=eot)
            tokens, n_out = np.asarray(out.tokens), np.asarray(out.lengths)
            for row, (_, _, header) in enumerate(chunk):
                row_tokens = tokens[row, : n_out[row]].tolist()
                eos = bool(row_tokens) and row_tokens[-1] == eot
                scored = score(header, tok.decode([t for t in row_tokens if t != eot]), eos)
                counts["samples"] += 1
                counts["finished_and_parse"] += scored["finished"] and scored["parses"]
                body_ids = tok.encode(scored["text"][len(header):], add_special_tokens=False).ids
                if not keep(scored, body_ids, args.max_repeat_share):
                    continue
                if scored["text"] in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(scored["text"])
                docs.append(scored["text"])
                counts["kept"] += 1
            print(f"T {temperature}: {counts['samples']} samples, {counts['kept']} kept "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        record["by_temperature"].append(counts)

    from train_embedded import encode_stream

    if not docs:
        raise SystemExit("self_samples.py: no continuation was kept; nothing written")
    stream = encode_stream(tok, docs, eot)
    out = Path(args.out).with_suffix(".npz")  # what np.savez_compressed writes
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, ids=stream)
    record.update(documents=len(docs), tokens=int(len(stream)), seconds=round(time.perf_counter() - t0, 1),
                  examples=docs[:: max(1, len(docs) // 5)][:5])
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: {len(docs)} functions, {len(stream)} tokens", flush=True)


if __name__ == "__main__":
    main()

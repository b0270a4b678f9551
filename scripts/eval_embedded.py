#!/usr/bin/env python
"""Does the embedded model write Python? Continuations of held-out function headers, parsed.

The prompts are the ``def`` headers (the signature up to its ``:``, dedented) of the
functions in the validation files of ``train_embedded.py``'s split: stdlib files the model
never trained on. 100 of them, evenly spaced in (file, line) order. For each temperature
the model continues all 100 in one batch through ``jaxkv.generate`` (ragged prompts, top-k
40 and top-p 0.95 as the CLI's defaults, per-row keys), once per sampling seed (``--seeds``,
5 by default: one seed's 100 samples move the rates by several points from seed to seed),
and each continuation is scored:

* the function ends at its first non-blank line at column 0 after the ``def`` line, or at
  the end-of-text token;
* a continuation that reaches ``--max-new-tokens`` first is cut after its last complete line
  (``finished`` is False for it);
* it **parses** when ``ast.parse(header + body)`` accepts it. An empty body does not parse.

``parse`` counts every prompt (finished or cut at a line); ``finished_and_parse`` counts only
functions that ended within the budget. The same scorer also runs on the held-out code itself (each
function's real body, cut to the same token budget: ``reference`` in the JSON), which is the
metric's ceiling: the 100 held-out functions score 87% at 192 tokens, 96% at 384
(``--max-new-tokens 384``), and all of them parse uncut (``reference_scores`` with a budget
of 100000 tokens). Validation loss (nats/token) comes from the model on
the same validation files, all of them, in 256-token windows.

    python scripts/eval_embedded.py [--model DIR] [--json docs/embedded_eval.json]
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import sysconfig
import textwrap
import time
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from stdlib_corpus import collect_sources, dedent_lines, multiline_functions, split_files  # noqa: E402

TEMPERATURES = (0.2, 0.5, 0.8)


def _signature(text: str) -> str:
    """``text`` (starting at a ``def``) up to and including the ``:`` that ends the signature."""
    depth = 0
    lines = text.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type == tokenize.OP and tok.string == ":" and depth == 0:
            row, col = tok.end
            return "".join(lines[: row - 1]) + lines[row - 1][:col]
    raise ValueError("no signature end")


def function_headers(files) -> list[tuple[str, int, str]]:
    """``(file, line, header)``: each function's signature, dedented, ending at its ``:``.

    Functions whose body starts on the ``def`` line are skipped. The header has no newline
    after the ``:``: the tokenizer merges a newline with the indentation after it, so the
    model writes that token itself.
    """
    out = []
    for name, source in files:
        lines = source.splitlines(keepends=True)
        for node in multiline_functions(ast.parse(source)):
            rest = textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].lineno]))
            try:
                header = _signature(rest)
            except (tokenize.TokenError, IndentationError, ValueError):
                continue
            out.append((name, node.lineno, header))
    out.sort(key=lambda item: (item[0], item[1]))
    return out


END_SENTINEL = "pass\n"  # a line at column 0 after the function: the scorer sees it end


def reference_continuation(source: str, line: int, header: str) -> str | None:
    """What the stdlib itself writes after ``header``: the function's own source, dedented
    by its ``def``'s column, after the header, then a line at column 0 (``END_SENTINEL``).

    Scored like a model's continuation (cut to the same token budget), it is the metric's
    ceiling: the share a model that wrote exactly the held-out code would get. None when
    the dedented source does not start with the header (a body indented less than its def).
    """
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno == line)
    text = dedent_lines(source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno], node.col_offset)
    if not text.startswith(header):
        return None
    rest = text[len(header):]
    return rest + ("" if rest.endswith("\n") else "\n") + END_SENTINEL


def held_out_headers(n: int):
    """``(val_files, headers)``: the validation files of ``train_embedded.py``'s split of this
    Python's stdlib and ``n`` of their function headers, evenly spaced (``function_headers``)."""
    _, val_files = split_files(collect_sources(Path(sysconfig.get_paths()["stdlib"])))
    return val_files, pick_evenly(function_headers(val_files), n)


#: Installed pure-Python packages no training run read (pip's vendored packages, which run 3
#: trained on, are not among them): the source of ``tuning_headers``.
TUNING_PACKAGES = ("click", "attr", "jinja2", "h11", "dateutil", "filelock", "humanize", "absl")


def tuning_headers(n: int):
    """``(files, headers)``: ``n`` function headers, evenly spaced, from ``TUNING_PACKAGES``:
    code the model never trained on that is not the stdlib validation split, for choosing
    decoding settings without looking at the 100 headers the goal is scored on."""
    from stdlib_corpus import collect_packages

    files, _ = collect_packages(TUNING_PACKAGES)
    return files, pick_evenly(function_headers(files), n)


def pick_evenly(items, n):
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def score(header: str, continuation: str, ended_by_eos: bool) -> dict:
    """Cuts ``continuation`` where the function ends and parses header + body.

    The continuation's first piece (up to its first newline) finishes the ``def`` line.
    """
    lines = continuation.split("\n")
    complete = lines if ended_by_eos else lines[:-1]  # the last piece may be a partial line
    if not complete:
        return {"parses": False, "finished": ended_by_eos, "text": header}
    body, ended = [complete[0]], ended_by_eos
    for line in complete[1:]:
        if line.strip() and not line[0].isspace():
            ended = True  # back at column 0: the function is over
            break
        body.append(line)
    text = header + "\n".join(body) + "\n"
    try:
        ast.parse(text)
        parses = True
    except (SyntaxError, ValueError):
        parses = False
    return {"parses": parses, "finished": ended, "text": text}


def validation_loss(loaded, files, context=256) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np

    ids = [0]
    for _, text in files:
        ids += loaded.tokenizer.encode(text).ids[1:] + [0]  # <|endoftext|> doc <|endoftext|> ...
    ids = np.asarray(ids, np.int32)
    windows = np.stack([ids[s : s + context + 1] for s in range(0, len(ids) - context - 1, context)])
    model = loaded.model

    @jax.jit
    def nll(batch):  # [16, context + 1] -> [16]: each window's summed negative log-likelihood
        logits, _ = model(batch[:, :-1], None, None)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0].sum(axis=-1)

    total = 0.0
    for i in range(0, len(windows), 16):
        chunk = windows[i : i + 16]
        real = len(chunk)
        if real < 16:  # one program: pad the last chunk, count only its real windows
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], 16 - real, 0)])
        total += float(np.asarray(nll(jnp.asarray(chunk)))[:real].sum())
    return total / (len(windows) * context)


def reference_scores(headers, sources, tok, max_new_tokens) -> dict:
    """The scorer run on the real continuations (``reference_continuation``), each cut to
    ``max_new_tokens`` tokens of the model's tokenizer as a generated one would be."""
    scored = []
    for name, line, header in headers:
        rest = reference_continuation(sources[name], line, header)
        if rest is None:
            scored.append({"file": name, "line": line, "parses": False, "finished": False, "text": None})
            continue
        ids = tok.encode(rest).ids[1:]  # without the <|endoftext|> the tokenizer prepends
        cut = tok.decode(ids[:max_new_tokens])
        scored.append({"file": name, "line": line, "tokens": len(ids), **score(header, cut, False)})
    return {**rates(scored), "scored": scored}


def rates(scored) -> dict:
    """The shares of scored continuations that parse, finish, and do both."""
    n = len(scored)
    return {
        "parse": sum(s["parses"] for s in scored) / n,
        "finished": sum(s["finished"] for s in scored) / n,
        "finished_and_parse": sum(s["parses"] and s["finished"] for s in scored) / n,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded model)")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=0, help="the first sampling seed")
    p.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="continue every prompt once per seed (seed, seed + 1, ...): the rates are over prompts x seeds, "
        "each seed's under by_seed, the first seed's texts under scored",
    )
    p.add_argument("--json", default=None, help="write the results (and every scored text) here")
    p.add_argument("--prompt-set", choices=("eval", "tune"), default="eval",
                   help="eval: the held-out stdlib headers the goal is scored on (default); tune: 200 headers of "
                   "packages no training run read (tuning_headers), to choose decoding settings on")
    p.add_argument("--temperatures", type=float, nargs="+", default=list(TEMPERATURES))
    p.add_argument("--min-p", type=float, default=None, help="jaxkv's min-p filter (default: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="HF's repetition penalty (default 1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import SamplingConfig, generate
    from jaxkv.cli import embedded_model_path
    from jaxkv.models import from_pretrained

    path = args.model or embedded_model_path()
    loaded = from_pretrained(path)
    tok = loaded.tokenizer
    val_files, headers = held_out_headers(args.prompts)
    sources = dict(val_files)
    if args.prompt_set == "tune":
        files, headers = tuning_headers(200 if args.prompts == 100 else args.prompts)
        sources = dict(files)
    penalties = dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                     presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    encoded = [tok.encode(header).ids for _, _, header in headers]
    width = max(map(len, encoded))
    ids = np.zeros((len(encoded), width), np.int32)
    for row, e in enumerate(encoded):
        ids[row, : len(e)] = e
    lengths = np.asarray([len(e) for e in encoded], np.int32)
    print(f"{path}: {len(headers)} held-out function headers from {len({h[0] for h in headers})} validation "
          f"files, prompts {lengths.min()}-{lengths.max()} tokens, up to {args.max_new_tokens} new tokens")

    t0 = time.perf_counter()
    val = validation_loss(loaded, val_files)
    print(f"validation loss {val:.4f} nats/token ({time.perf_counter() - t0:.1f} s)")

    results = {"model": str(Path(path).name), "prompt_set": args.prompt_set, "prompts": len(headers),
               "seeds": args.seeds, "max_new_tokens": args.max_new_tokens, "sampling": penalties,
               "val_loss": val, "reference": reference_scores(headers, sources, tok, args.max_new_tokens),
               "runs": []}
    ref = results["reference"]
    print(f"the held-out code itself, cut to the same budget: parse {ref['parse']:.0%}  finished "
          f"{ref['finished']:.0%}  finished and parse {ref['finished_and_parse']:.0%} (the metric's ceiling)")
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature, top_k=40, top_p=0.95, **penalties)
        t0 = time.perf_counter()
        by_seed = []
        for seed in range(args.seed, args.seed + args.seeds):
            out = generate(loaded.model, jnp.asarray(ids), args.max_new_tokens, prompt_lengths=jnp.asarray(lengths),
                           sampling=sampling, key=jax.random.key(seed), eos_token_id=0)
            tokens = np.asarray(out.tokens)
            n_out = np.asarray(out.lengths)
            scored = []
            for row, (name, line, header) in enumerate(headers):
                row_tokens = tokens[row, : n_out[row]].tolist()
                eos = bool(row_tokens) and row_tokens[-1] == 0
                text = tok.decode([t for t in row_tokens if t != 0])
                scored.append({"file": name, "line": line, **score(header, text, eos)})
            by_seed.append({"seed": seed, **rates(scored), "_scored": scored})
        seconds = time.perf_counter() - t0
        kept = by_seed[0]["_scored"]  # the first seed's texts go into the JSON
        everything = [s for r in by_seed for s in r.pop("_scored")]
        run = {
            "temperature": temperature, "top_k": 40, "top_p": 0.95,
            **rates(everything),  # over prompts x seeds
            "by_seed": by_seed,
            "generate_s": round(seconds, 2),
            "scored": kept,
        }
        results["runs"].append(run)
        per_seed = [r["parse"] for r in by_seed]
        print(f"temperature {temperature}: parse {run['parse']:.1%} (one seed: {min(per_seed):.0%}-{max(per_seed):.0%})  "
              f"finished {run['finished']:.1%}  finished and parse {run['finished_and_parse']:.1%}  "
              f"({args.seeds} x {len(headers)}, {seconds:.1f} s)")
    middle = results["runs"][len(results["runs"]) // 2]
    example = next((s for s in middle["scored"] if s["parses"] and s["finished"]), None)
    if example:
        print(f"--- an example (temperature {middle['temperature']}, {example['file']}:{example['line']}):\n"
              f"{example['text']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

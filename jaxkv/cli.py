"""The ``jaxkv`` command line: stream text from a checkpoint through a jaxkv cache.

    jaxkv generate "def fibonacci(" [--model PATH] [--max-new-tokens N] [--temperature T]
                   [--top-k K] [--top-p P] [--seed S]

With no ``--model`` it uses the embedded model shipped inside the package (a tiny
Llama trained by ``scripts/train_embedded.py`` on the Python standard library). Errors are
one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources

EMBEDDED_MODEL = "pycoder"


def embedded_model_path() -> str:
    """Directory of the embedded default checkpoint."""
    return str(resources.files("jaxkv") / "_assets" / EMBEDDED_MODEL)


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Key/value-cached decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a continuation of a prompt")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", default=None, help="HF-format checkpoint directory (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=int, default=120, help="tokens to generate (default 120)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 for no limit (default 40)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus mass; 1.0 for no limit (default 0.95)")
    gen.add_argument("--seed", type=int, default=0, help="PRNG seed (default 0)")
    return parser


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _max_context(path: str) -> int | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def run_generate(args: argparse.Namespace, out=sys.stdout) -> None:
    # Imports are deferred so that `jaxkv --help` and argument errors are instant.
    import jax
    import jax.numpy as jnp

    from jaxkv.generation import stream
    from jaxkv.models import CheckpointError, from_pretrained
    from jaxkv.sampling import SamplingConfig

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = SamplingConfig(
            temperature=args.temperature, top_k=args.top_k or None, top_p=None if args.top_p >= 1.0 else args.top_p
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    path = args.model or embedded_model_path()
    try:
        loaded = from_pretrained(path)
    except (CheckpointError, TypeError) as err:
        raise CliError(str(err)) from None
    if loaded.tokenizer is None:
        raise CliError(f"{path}: no tokenizer.json, so the prompt cannot be encoded")
    ids = loaded.tokenizer.encode(args.prompt).ids
    if not ids:
        raise CliError("the prompt encodes to zero tokens; give some text")
    context = _max_context(path)
    if context is not None and len(ids) + args.max_new_tokens > context:
        raise CliError(
            f"prompt ({len(ids)} tokens) plus --max-new-tokens ({args.max_new_tokens}) exceeds the model's "
            f"context of {context} tokens; shorten the prompt or lower --max-new-tokens"
        )
    eos = _eos_id(loaded)

    out.write(args.prompt)
    out.flush()
    generated: list[int] = []
    printed = ""
    start = None
    step = 0
    cache_bytes = 0
    tokens_stream = stream(
        loaded.model,
        jnp.asarray([ids], jnp.int32),
        args.max_new_tokens,
        sampling=sampling,
        key=jax.random.key(args.seed),
        eos_token_id=eos,
    )
    for step, tokens in enumerate(tokens_stream):
        if step == 0:
            cache = tokens_stream.cache
            cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
        if step == 1:
            # Steps 0 and 1 include compiling the prefill and the decode step: the rate
            # below is steady-state decoding.
            start = time.perf_counter()
        token = int(tokens[0])
        if eos is not None and token == eos:
            break
        generated.append(token)
        text = loaded.tokenizer.decode(generated)
        # Byte-level BPE: hold back a partial multi-byte character until it completes.
        if not text.endswith("\ufffd") and text.startswith(printed):
            out.write(text[len(printed) :])
            out.flush()
            printed = text
    elapsed = time.perf_counter() - start if start is not None else 0.0
    decode_tokens = max(step - 1, 0) if start is not None else 0
    rate = decode_tokens / elapsed if elapsed > 0 else float("nan")
    out.write("\n")
    out.write(
        f"[jaxkv] prompt {len(ids)} tokens | new {len(generated)} tokens | {rate:.1f} tokens/s (decode) | "
        f"cache {_human_bytes(cache_bytes)} ({type(cache).__name__}) | model {os.path.basename(os.path.normpath(path))}\n"
    )
    out.flush()


def _eos_id(loaded) -> int | None:
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(loaded.path, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        return 0
    except CliError as err:
        print(f"jaxkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\njaxkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

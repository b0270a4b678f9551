#!/usr/bin/env python
"""How often the demo's own prompt gives Python: ``make demo``'s prompt (``def fibonacci(``),
sampling (temperature 0.8, top-k 40, top-p 0.95) and budget (120 tokens), continued in one
batch of ``--rows`` rows (per-row keys from ``jax.random.key(--seed)``) and scored as
``scripts/eval_embedded.py`` scores (the function ends at a line at column 0 or end-of-text;
a row still running at the budget is cut after its last complete line).

    python scripts/demo_parse_rate.py [--model DIR] [--rows 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from eval_embedded import score  # noqa: E402

PROMPT = "def fibonacci("


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded model)")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import SamplingConfig, generate
    from jaxkv.cli import embedded_model_path
    from jaxkv.models import from_pretrained

    loaded = from_pretrained(args.model or embedded_model_path())
    tok = loaded.tokenizer
    eot = tok.token_to_id("<|endoftext|>")
    ids = jnp.asarray([tok.encode(PROMPT).ids] * args.rows, jnp.int32)
    out = generate(loaded.model, ids, 120, sampling=SamplingConfig(temperature=0.8, top_k=40, top_p=0.95),
                   key=jax.random.key(args.seed), eos_token_id=eot)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    parses = 0
    for row in range(args.rows):
        generated = tokens[row, : lengths[row]].tolist()
        ended = bool(generated) and generated[-1] == eot
        parses += score(PROMPT, tok.decode([t for t in generated if t != eot]), ended)["parses"]
    print(f"{parses} of {args.rows} continuations of {PROMPT!r} parse")


if __name__ == "__main__":
    main()

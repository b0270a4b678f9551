#!/usr/bin/env python
"""Train the draft model for speculative decoding with the embedded "pycoder" model.

The draft is trained exactly the way ``scripts/train_embedded.py`` trains pycoder (same
corpus, same loss, optimiser, schedule and seeds: this script calls its ``main``), with two
differences:

* a much smaller config (2 layers, width 96, one kv head), so that a draft step costs a
  fraction of a target step and the weights stay under 3 MB, trained on shorter windows
  and smaller batches (see ``DRAFT_CONFIG``);
* the tokenizer is *not* retrained: the shipped ``jaxkv/_assets/pycoder/tokenizer.json``
  is loaded instead, so draft and target share token ids by construction (speculative
  decoding compares token ids).

The training log (loss history, timings, samples) lands next to the weights as
``training_log.json``.

Command used for the shipped draft (from the repository root):

    nice -n 5 python scripts/train_draft.py --steps 100000 --bf16 --extra-train-dirs test --function-docs --train-minutes 8

(the options are train_embedded.py's, as for the shipped target).

It needs what ``train_embedded.py`` needs (torch, transformers, tokenizers, safetensors,
numpy, matplotlib).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import train_embedded  # noqa: E402

# Fewer tokens per step than the target (8 x 128 instead of 16 x 256): within the time
# budget on shared cores this buys several hundred optimizer steps, with a warmup short
# enough that the cosine decay actually runs.
DRAFT_CONFIG = [
    "--hidden", "96",
    "--layers", "2",
    "--heads", "3",
    "--kv-heads", "1",
    "--intermediate", "256",
    "--batch", "8",
    "--context", "128",
    "--warmup", "30",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="jaxkv/_assets/pycoder", help="the target model directory (its tokenizer is reused)")
    p.add_argument("--out", default="jaxkv/_assets/pycoder-draft")
    p.add_argument("--max-minutes", default="7.5", help="wall-clock budget, as in train_embedded.py")
    p.add_argument("--steps", default="800")
    args, rest = p.parse_known_args(argv)

    from tokenizers import Tokenizer

    target_tokenizer = REPO / args.target / "tokenizer.json"
    if not target_tokenizer.is_file():
        raise SystemExit(f"{target_tokenizer}: not found; train the target first (scripts/train_embedded.py)")

    def shared_tokenizer(texts, vocab_size):
        return Tokenizer.from_file(str(target_tokenizer))

    train_embedded.train_tokenizer = shared_tokenizer
    out = REPO / args.out
    with tempfile.TemporaryDirectory() as docs:
        train_embedded.main(
            ["--out", str(out), "--docs", docs, "--max-minutes", args.max_minutes, "--steps", args.steps]
            + DRAFT_CONFIG
            + rest
        )
        shutil.copy(Path(docs) / "training_log.json", out / "training_log.json")
    if (out / "tokenizer.json").read_bytes() != target_tokenizer.read_bytes():
        # save_hf_dir re-serialises the tokenizer; the ids must be the target's.
        shutil.copy(target_tokenizer, out / "tokenizer.json")
    print(f"draft saved to {out}")


if __name__ == "__main__":
    main()

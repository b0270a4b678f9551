#!/usr/bin/env python
"""Validation loss against training loss on the same kind of text: how much a model memorised.

The embedded model's validation files are 10 stdlib modules; its training split holds the
other stdlib modules, the stdlib's test suite and (``--packages``) installed packages. This
prints the model's mean loss (nats/token, 256-token windows, the same random sample of
windows for every model) on the validation files, on 100 training files of the stdlib, on 100
test-suite files, and on (up to) 100 files of packages no training run read (the tuning set's).

    python scripts/loss_by_split.py [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from stdlib_corpus import collect_extra, collect_packages, collect_sources, split_files  # noqa: E402

WINDOW = 256


def mean_loss(model, tok, files, rng, max_windows=200):
    ids = [i for _, text in files for i in tok.encode(text).ids]
    n_all = len(ids) // WINDOW
    starts = sorted(rng.sample(range(n_all), min(n_all, max_windows)))
    x = torch.tensor([ids[s * WINDOW : (s + 1) * WINDOW] for s in starts])
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), 16):
            b = x[i : i + 16]
            total += model(b, labels=b).loss.item() * len(b)
    return total / len(x), len(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "jaxkv" / "_assets" / "pycoder"))
    args = p.parse_args()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val = split_files(collect_sources(stdlib))
    rng = random.Random(0)
    tune, _ = collect_packages(["click", "jinja2", "h11", "dateutil"])
    for name, files in (
        ("validation files", val),
        ("100 stdlib training files", rng.sample(train, 100)),
        ("100 stdlib test-suite files", rng.sample(collect_extra(stdlib, ["test"]), 100)),
        (f"{min(100, len(tune))} files of unread packages", rng.sample(tune, min(100, len(tune)))),
    ):
        loss, n = mean_loss(model, tok, files, rng)
        print(f"{name:30s} {loss:.3f} nats/token ({n} windows)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Validation loss against training loss on the same kind of text: how much a model memorised.

The embedded model's validation files are 10 stdlib modules; its training split holds the
other stdlib modules, the stdlib's test suite and (``--extra-train-packages``) installed
packages. This prints the model's loss (nats/token, every 256-token window, as
``eval_embedded.py``'s validation loss) on the validation files, on 50 training files of the
stdlib, on 50 test-suite files and on 50 files of the tuning set's packages, which no training
run read (the same files for every model: a fixed seed).

    python scripts/loss_by_split.py [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from eval_embedded import TUNING_PACKAGES, validation_loss  # noqa: E402
from stdlib_corpus import collect_extra, collect_packages, collect_sources, split_files  # noqa: E402

FILES = 50


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF-format model directory (default: the embedded model)")
    args = p.parse_args()
    from jaxkv.cli import embedded_model_path
    from jaxkv.models import from_pretrained

    loaded = from_pretrained(args.model or embedded_model_path())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val = split_files(collect_sources(stdlib))
    rng = random.Random(0)
    for name, files in (
        ("validation files", val),
        (f"{FILES} stdlib training files", rng.sample(train, FILES)),
        (f"{FILES} stdlib test-suite files", rng.sample(collect_extra(stdlib, ["test"]), FILES)),
        (f"{FILES} files of unread packages", rng.sample(collect_packages(TUNING_PACKAGES)[0], FILES)),
    ):
        print(f"{name:30s} {validation_loss(loaded, files):.3f} nats/token", flush=True)


if __name__ == "__main__":
    main()

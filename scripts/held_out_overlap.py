#!/usr/bin/env python
"""Parse rates of the held-out headers split by whether run 17's self-sampling prompts
(``self_samples.training_headers()``, 6000 evenly spaced, as ``docs/self_samples.json``
records) held the same header string, on the first seed's texts each eval JSON keeps.

    python scripts/held_out_overlap.py docs/embedded_eval_run11.json docs/embedded_eval.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import self_samples  # noqa: E402
from eval_embedded import held_out_headers, pick_evenly  # noqa: E402


def main(paths):
    picked = {h for *_, h in pick_evenly(self_samples.training_headers(), 6000)}
    _, held = held_out_headers(100)
    shared = [h in picked for *_, h in held]
    print(f"{sum(shared)} of {len(held)} held-out header strings were sampling prompts")
    for path in paths:
        for run in json.loads(Path(path).read_text())["runs"]:
            for name, want in (("untouched", False), ("shared", True)):
                got = [s["parses"] for s, o in zip(run["scored"], shared) if o == want]
                print(f"{path} T {run['temperature']}: {name} {sum(got) / len(got):.0%} of {len(got)}")


if __name__ == "__main__":
    main(sys.argv[1:])

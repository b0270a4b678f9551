"""scripts/eval_embedded.py's prompts and scoring, on hand-written sources (no model)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import eval_embedded  # noqa: E402

SOURCE = '''
import os

@decorator
def plain(a, b=(1, 2),
          *, c: "dict[str, int]" = {}) -> int:  # a comment on the def line
    # a comment before the body
    return a

def one_liner(): return 1

class K:
    async def method(self, x=[0]):
        """Doc."""
        return x
'''


def test_headers_are_signatures_up_to_their_colon_dedented():
    headers = eval_embedded.function_headers([("m.py", SOURCE)])
    assert [(line, header) for _, line, header in headers] == [
        (5, 'def plain(a, b=(1, 2),\n          *, c: "dict[str, int]" = {}) -> int:'),
        (13, "async def method(self, x=[0]):"),
    ]


def test_pick_evenly_keeps_both_ends():
    assert eval_embedded.pick_evenly(list(range(10)), 4) == [0, 3, 6, 9]
    assert eval_embedded.pick_evenly([1, 2], 5) == [1, 2]


def test_score_cuts_at_the_end_of_the_function():
    got = eval_embedded.score("def f(x):", "\n    y = x\n    return y\n\nprint(f(1))\n", ended_by_eos=False)
    assert got == {"parses": True, "finished": True, "text": "def f(x):\n    y = x\n    return y\n\n"}


def test_score_unfinished_keeps_complete_lines_only():
    got = eval_embedded.score("def f(x):", "\n    y = x\n    return (y +", ended_by_eos=False)
    assert got["parses"] and not got["finished"] and got["text"] == "def f(x):\n    y = x\n"
    # an unclosed bracket across complete lines does not parse
    assert not eval_embedded.score("def f(x):", "\n    return (x,\n    y = 1\n", ended_by_eos=False)["parses"]


def test_score_end_of_text_finishes_and_empty_bodies_fail():
    got = eval_embedded.score("def f():", "\n    pass", ended_by_eos=True)
    assert got["parses"] and got["finished"]
    assert not eval_embedded.score("def f():", "\nx = 1\n", ended_by_eos=False)["parses"]
    assert not eval_embedded.score("def f():", "", ended_by_eos=True)["parses"]
    assert not eval_embedded.score("def f():", "no newline yet", ended_by_eos=False)["parses"]


def test_reference_continuation_is_the_held_out_code_and_scores_finished():
    """The ceiling row: the function's own dedented source after its header, then a line at
    column 0; scored whole it parses and finishes, cut before its end it does not finish."""
    headers = eval_embedded.function_headers([("m.py", SOURCE)])
    rests = [eval_embedded.reference_continuation(SOURCE, line, header) for _, line, header in headers]
    assert rests == [
        "  # a comment on the def line\n    # a comment before the body\n    return a\n" + eval_embedded.END_SENTINEL,
        '\n    """Doc."""\n    return x\n' + eval_embedded.END_SENTINEL,
    ]
    for (_, _, header), rest in zip(headers, rests):
        whole = eval_embedded.score(header, rest, ended_by_eos=False)
        assert whole["parses"] and whole["finished"]
        assert whole["text"] + eval_embedded.END_SENTINEL == header + rest
        cut = eval_embedded.score(header, rest[: rest.rindex("return")], ended_by_eos=False)
        assert not cut["finished"]


def test_tuning_packages_were_never_trained_on():
    """The decoding-settings prompts come from packages no training run read (their own
    command lines and corpus records, in docs/training_log.json for the shipped model and
    docs/training_log_cpu_runs.json for the CPU runs before it), nor vendored inside one that
    was (pip)."""
    import json
    import importlib.util

    docs = Path(__file__).resolve().parent.parent / "docs"
    runs = []
    for name in ("training_log.json", "training_log_cpu_runs.json"):
        log = json.loads((docs / name).read_text())
        runs += [log, *log.get("previous_runs", [])]
    trained = set()
    for run in runs:
        # a run on data made by --write-data lists its packages in the corpus record
        trained |= set(run.get("corpus", {}).get("extra_train_packages", {}))
        words = run["command"].split()
        if "--extra-train-packages" in words:
            for word in words[words.index("--extra-train-packages") + 1:]:
                if word.startswith("--"):
                    break
                trained.add(word)
    assert {"jax", "numpy", "pip", "torch", "scipy", "sympy"} <= trained  # the parse found the runs' packages
    assert trained.isdisjoint(eval_embedded.TUNING_PACKAGES)
    vendored = Path(importlib.util.find_spec("pip").submodule_search_locations[0]) / "_vendor"
    assert vendored.is_dir()
    assert not any((vendored / name).exists() for name in eval_embedded.TUNING_PACKAGES)

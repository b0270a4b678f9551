"""scripts/train_embedded.py's data hand-off (--write-data / --data) and --init-from's guard,
on a tokenizer trained on a few lines (no stdlib corpus, no training)."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import train_embedded  # noqa: E402

TEXTS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "import os\nprint(os.sep)\n"] * 4


@pytest.fixture(scope="module")
def tok():
    return train_embedded.train_tokenizer(TEXTS, vocab_size=300)


def test_written_data_loads_back_unchanged(tok, tmp_path):
    train_ids = train_embedded.encode_stream(tok, TEXTS[:2], 0)
    val_ids = train_embedded.encode_stream(tok, TEXTS[2:3], 0)
    corpus = {"python": "3.11.7", "train_tokens": len(train_ids), "val_tokens": len(val_ids), "sha256": "x"}
    train_embedded.write_data(tmp_path, tok, train_ids, val_ids, corpus)
    tok2, train2, val2, corpus2 = train_embedded.load_data(tmp_path)
    assert train2.dtype == np.uint16 and val2.dtype == np.uint16
    np.testing.assert_array_equal(train2, train_ids)
    np.testing.assert_array_equal(val2, val_ids)
    assert corpus2 == corpus
    for text in TEXTS[:3]:
        assert tok2.encode(text).ids == tok.encode(text).ids
    # The stream is <eot> doc <eot> doc <eot>, decoding back to the texts.
    assert train_ids[0] == 0 and train_ids[-1] == 0
    assert tok.decode(train_ids.tolist(), skip_special_tokens=True) == "".join(TEXTS[:2])


def test_incomplete_or_inconsistent_data_is_refused(tok, tmp_path):
    ids = train_embedded.encode_stream(tok, TEXTS[:1], 0)
    train_embedded.write_data(tmp_path, tok, ids, ids, {"python": "3", "train_tokens": len(ids), "val_tokens": len(ids)})
    record = json.loads((tmp_path / "corpus.json").read_text())
    record["train_tokens"] += 1
    (tmp_path / "corpus.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="do not have the lengths corpus.json records"):
        train_embedded.load_data(tmp_path)
    (tmp_path / "val_ids.npz").unlink()
    with pytest.raises(SystemExit, match="missing val_ids.npz; write it with --write-data"):
        train_embedded.load_data(tmp_path)


def test_init_from_refuses_a_model_with_another_tokenizer(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text(tok.to_str(pretty=True).replace("return", "retrun"))
    args = Namespace(init_from=str(tmp_path), docs=str(tmp_path))
    with pytest.raises(SystemExit, match="differs from the tokenizer trained on this corpus"):
        train_embedded.load_init(args, tok, 0)


def test_extra_sources_that_copy_held_out_code_are_dropped():
    from stdlib_corpus import drop_overlapping

    held = "\n".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(6))
    reindented = "class Vendored:\n" + "\n\n".join("    " + ln for ln in held.splitlines())  # a copy, re-indented
    two_runs = "\n".join(held.splitlines()[:5]) + "\nprint('mine')\n"  # 5 lines: two 4-line runs in common
    unrelated = "\n".join(f"y{i} = {i}" for i in range(40))
    kept, dropped = drop_overlapping(
        [("copy.py", reindented), ("header.py", two_runs), ("own.py", unrelated)], [("val.py", held)]
    )
    assert dropped == ["copy.py"]
    assert [n for n, _ in kept] == ["header.py", "own.py"]
    assert drop_overlapping([("a.py", held)], []) == ([("a.py", held)], [])


def test_extra_train_packages_reads_an_installed_package(tmp_path, monkeypatch):
    from stdlib_corpus import collect_packages

    pkg = tmp_path / "tinypkg_for_corpus"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def answer():\n    return 42  # long enough to count as a source: 64 characters or more\n")
    (pkg / "sub" / "mod.py").write_text("class Thing:\n    def method(self):\n        return 'a thing of some length'\n")
    (pkg / "sub" / "broken.py").write_text("def broken(:\n    pass  # does not parse, so it is left out of the corpus\n")
    (tmp_path / "single_module_for_corpus.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    files, versions = collect_packages(["tinypkg_for_corpus"])
    assert [n for n, _ in files] == ["site-packages/tinypkg_for_corpus/__init__.py",
                                     "site-packages/tinypkg_for_corpus/sub/mod.py"]
    assert files[1][1].startswith("class Thing:")
    assert versions == {"tinypkg_for_corpus": None}  # no distribution metadata
    for bad in ("no_such_package_for_corpus", "single_module_for_corpus"):
        with pytest.raises(SystemExit, match="is not an installed package folder"):
            collect_packages([bad])


def test_declared_context_defaults_to_the_trained_window():
    assert train_embedded.parse_args(["--context", "512"]).max_positions == 512
    assert train_embedded.parse_args([]).max_positions == 256
    assert train_embedded.parse_args(["--context", "512", "--max-positions", "1024"]).max_positions == 1024


def test_function_documents_are_each_function_dedented_to_column_0():
    from stdlib_corpus import function_documents

    source = (
        "import os\n"
        "\n"
        "class Walker:\n"
        "    @property\n"
        "    def root(self):\n"
        '        """The root.\n'
        "\n"
        'Kept as written."""\n'
        "        \n"
        "        def inner(x):\n"
        "            return x\n"
        "        return os.sep\n"
        "\n"
        "    def one_line(self): return 1\n"
        "\n"
        "async def fetch(url,\n"
        "                timeout=1):\n"
        "    await url\n"
        "x = 1"
    )
    root = ('def root(self):\n    """The root.\n\nKept as written."""\n\n'
            "    def inner(x):\n        return x\n    return os.sep\n")
    docs = function_documents([("walker.py", source), ("broken.py", "def f(:\n    pass\n")])
    assert sorted(docs) == sorted([
        root,  # decorator left out; the blank line inside the body is kept, less its spaces
        "def inner(x):\n    return x\n",  # nested: a document of its own too
        "async def fetch(url,\n                timeout=1):\n    await url\n",
    ])  # one_line (body on the def line) and the file that does not parse are left out
    for doc in docs:
        compile(doc, "<doc>", "exec")


def test_grow_depth_keeps_the_function_and_trains_the_new_layers():
    """--grow-layers: the deeper model's logits equal the source model's (the new layers add
    exactly 0 to the residual stream), its KV-cached greedy decode equals an uncached one (each
    layer has its own cache index), and the new layers' zeroed projections get gradient."""
    import torch

    torch.manual_seed(0)
    args = Namespace(hidden=32, intermediate=64, layers=3, heads=4, kv_heads=2, max_positions=64)
    model = train_embedded.make_model(args, 300, 0).eval()
    with torch.no_grad():  # norms away from 1, so a copied layer is not a trivial one
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    ids = torch.randint(1, 300, (2, 12))
    before = model(input_ids=ids).logits.detach()

    origin = train_embedded.grow_depth(model, 7)
    assert origin == [0, 0, 1, 1, 2, 2, 2]  # 4 new layers spread over 3: one after 0 and 1, two after 2
    assert len(model.model.layers) == 7 == model.config.num_hidden_layers
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(7))
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)

    with torch.no_grad():  # give the new layers weight, so that they change the output
        for i in (1, 3, 5, 6):
            model.model.layers[i].self_attn.o_proj.weight.normal_(0, 0.2)
            model.model.layers[i].mlp.down_proj.weight.normal_(0, 0.2)
    assert not torch.allclose(model(input_ids=ids).logits, before)
    cached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)

    fresh = train_embedded.make_model(args, 300, 0)
    train_embedded.grow_depth(fresh, 4)
    train_embedded.lm_loss(fresh, ids).backward()
    new = fresh.model.layers[3]
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(SystemExit, match="only adds layers"):
        train_embedded.grow_depth(fresh, 2)


def _log(out, sha=None):
    log = {"command": f"train --out {out}", "args": {"out": str(out)}, "model": {}}
    if sha is not None:
        log["model"]["weights_sha256"] = sha
    return log


def test_prior_log_is_found_by_the_weights_it_wrote(tmp_path):
    """A continued run carries the log of the run that made its starting weights: by their
    hash when the log records it (the weights may have been copied anywhere), else by the
    directory the run wrote; a log of other weights is never taken."""
    model = tmp_path / "copied" / "pycoder"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights of run 8")
    sha = train_embedded.weights_sha256(model)
    by_hash, other, by_dir = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    by_hash.write_text(json.dumps(_log("/tmp/run8/pycoder", sha)))
    other.write_text(json.dumps(_log(str(model), "0" * 64)))  # same directory, other weights
    by_dir.write_text(json.dumps(_log(str(model))))
    assert train_embedded.find_prior_log(model, [tmp_path / "missing.json", by_hash])["args"]["out"] == "/tmp/run8/pycoder"
    assert train_embedded.find_prior_log(model, [other]) is None
    assert train_embedded.find_prior_log(model, [other, by_dir])["command"] == f"train --out {model}"
    assert train_embedded.find_prior_log(tmp_path / "nowhere", [by_hash, other]) is None


def test_the_shipped_model_finds_the_repository_log():
    """docs/training_log.json documents jaxkv/_assets/pycoder (its run wrote /tmp/runN and was
    copied), so continuing the shipped model carries that log forward."""
    log = train_embedded.find_prior_log(train_embedded.SHIPPED_MODEL, [train_embedded.SHIPPED_LOG])
    assert log is not None
    assert log == json.loads(train_embedded.SHIPPED_LOG.read_text())


# ----------------------------------------------------- --unlikelihood-every (scripts/unlikelihood.py)

import unlikelihood  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 5))
def test_repeat_candidates_are_the_later_occurrences_of_an_ngram(ids, n):
    """Position t is a candidate iff the n tokens ending at t also end at some s < t."""
    expected = [t >= n - 1 and any(ids[s - n + 1 : s + 1] == ids[t - n + 1 : t + 1] for s in range(n - 1, t))
                for t in range(len(ids))]
    assert unlikelihood.repeat_candidates(ids, n).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_function_length_keeps_what_the_evaluation_scores(data):
    """The kept tokens are the function eval_embedded.score parses, wherever the token
    boundaries fall: up to the first non-blank line at column 0, or the end-of-text piece."""
    import eval_embedded

    header = "def f(x):"
    body = data.draw(st.sampled_from(["\n    return x\n", "\n    y = x\n\n    return y\n", "\n    pass\n  \n"]))
    after = data.draw(st.sampled_from(["def g():\n    pass\n", "x = 1\n", "<eot>", ""]))
    text = body + ("" if after == "<eot>" else after)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(text) - 1), max_size=8))) | {len(body)} - {len(text)})
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])] + (["<eot>"] if after == "<eot>" else [])
    k = unlikelihood.function_length(pieces, "<eot>")
    assert "".join(pieces[:k]) == body
    scored = eval_embedded.score(header, text, after == "<eot>")
    alone = eval_embedded.score(header, "".join(pieces[:k]), True)
    assert alone["text"].rstrip("\n") == scored["text"].rstrip("\n") and alone["parses"] == scored["parses"]


def test_a_piece_that_starts_the_next_line_at_column_0_is_not_kept():
    assert unlikelihood.function_length(["\n    return x", "\n", "def", " g"]) == 2
    assert unlikelihood.function_length(["\n    return x", "\ndef", " g"]) == 2  # newline + column 0 in one piece
    assert unlikelihood.function_length(["\n    return x", "\n    y"]) == 2  # no end: all of it


def test_an_unlikelihood_step_lowers_the_probability_of_the_repeated_tokens(tok):
    """On a tiny model: continuations come back left-padded with the prompt at the right
    end, and one SGD step on the loss lowers p(token) where the continuation repeats itself
    while the loss ignores the prompt and the tokens past the function."""
    import torch

    torch.manual_seed(0)
    args = Namespace(hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, max_positions=64)
    model = train_embedded.make_model(args, tok.get_vocab_size(), 0)
    headers = ["def f(x):", "class A:\n    def g(self):"]
    out, mask, width, kept = unlikelihood.continuations(
        model, tok, headers, eot_id=0, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, width + 6) and mask[:, width:].all()
    for b, h in enumerate(headers):
        ids = tok.encode(h).ids
        assert out[b, width - len(ids) : width].tolist() == ids and not mask[b, : width - len(ids)].any()
    assert all(0 <= k <= 6 for k in kept)

    # hand-made continuations after 3 prompt slots: row 0 generates 5 6 5 6 5 6, whose
    # 2-grams repeat at positions 6, 7, 8; row 1's function ends after 2 generated tokens
    # (6 5: no repeat), so its later repeats do not count
    out = torch.tensor([[0, 9, 7, 5, 6, 5, 6, 5, 6], [9, 9, 5, 6, 5, 6, 5, 6, 5]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    loss, candidates, tokens = unlikelihood.unlikelihood_loss(model, out, mask, 3, [6, 2], 2)
    assert (candidates, tokens) == (3, 8)

    def p_repeats():
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            probs = model(input_ids=out[:1, :-1], attention_mask=mask[:1, :-1], position_ids=positions[:1, :-1]).logits
            probs = probs.softmax(-1)[0]
        return torch.stack([probs[t - 1, out[0, t]] for t in (6, 7, 8)])

    before = p_repeats()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert (p_repeats() < before).all()


def test_kept_lengths_end_at_the_end_of_text_token(tok):
    """generate pads a finished row with the end-of-text id after its EOS; decode skipped that
    special token (an empty piece), so the padding counted as the function's repeated tokens."""
    body = tok.encode("\n    return x + 1\n", add_special_tokens=False).ids
    rows = [body + [0, 0, 0, 0], body + tok.encode("def g", add_special_tokens=False).ids]
    assert unlikelihood.kept_lengths(tok, rows, 0) == [len(body), len(body)]


# ------------------------------------------- --self-data (scripts/self_samples.py, rejection sampling)

import self_samples  # noqa: E402


def test_self_rows_come_from_the_self_stream_and_none_keeps_the_old_draws():
    train_ids = np.arange(1000, dtype=np.uint16)
    self_ids = np.arange(5000, 5100, dtype=np.uint16)
    got = train_embedded.training_windows(np.random.default_rng(3), train_ids, self_ids, 8, 3, 17)
    assert got.shape == (8, 17) and got.dtype == np.int64
    assert (got[:5] < 1000).all() and (got[5:] >= 5000).all()
    assert (np.diff(got, axis=1) == 1).all()  # each row is one contiguous window of its stream
    # without self rows: exactly the draws the script made before --self-data existed
    rng_old, rng_new = np.random.default_rng(3), np.random.default_rng(3)
    starts = rng_old.integers(0, len(train_ids) - 17, size=8)
    want = np.stack([train_ids[s : s + 17] for s in starts]).astype(np.int64)
    np.testing.assert_array_equal(train_embedded.training_windows(rng_new, train_ids, None, 8, 0, 17), want)


def test_self_data_options_go_together():
    for argv in (["--self-data", "x.npz"], ["--self-rows", "2"], ["--self-data", "x.npz", "--self-rows", "17"]):
        with pytest.raises(SystemExit):
            train_embedded.parse_args(argv)  # --batch is 16


def test_repeat_share_counts_tokens_that_close_an_earlier_ngram():
    def brute(ids, n):
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        return sum(g in grams[:i] for i, g in enumerate(grams)) / max(1, len(ids))

    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 3, size=int(rng.integers(0, 30))).tolist()
        n = int(rng.integers(1, 5))
        assert self_samples.repeat_share(ids, n) == pytest.approx(brute(ids, n))


def test_only_finished_parsing_loop_free_functions_are_kept():
    import eval_embedded

    header = "def f(x):"
    good = eval_embedded.score(header, "\n    return x + 1\n\ndef g():\n", False)
    unfinished = eval_embedded.score(header, "\n    return x + 1\n    y = 2\n    z", False)
    broken = eval_embedded.score(header, "\n    return (x\n\ndef g():\n", False)
    assert self_samples.keep(good, list(range(20)), 0.05)
    assert not self_samples.keep(unfinished, list(range(20)), 0.05)
    assert not self_samples.keep(broken, list(range(20)), 0.05)
    assert not self_samples.keep(good, [1, 2] * 10, 0.05)  # a loop: 12 of its 20 tokens close an earlier 8-gram


def test_self_sampling_prompts_leave_out_the_scored_headers():
    headers = [("a.py", 1, "def run(self):"), ("a.py", 9, "def f(x):"), ("b.py", 3, "def run(self):")]
    assert self_samples.without(headers, ["def run(self):"]) == [("a.py", 9, "def f(x):")]

"""The `jaxkv` command line, run as a subprocess like a user would."""

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from jaxkv.cli import compilation_cache_dir, embedded_model_path, main

# Subprocesses leave the user's compilation cache alone: they share one of this test process's
# own (removed at exit), so a program the CLI compiled for one test loads in the next; what the
# cache itself does is tested with a directory of the test's own.
_CACHE = tempfile.mkdtemp(prefix="jaxkv-test-cli-xla-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXKV_COMPILATION_CACHE": _CACHE}


def run(*args, timeout=300, env=ENV):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv", *args], capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.slow
def test_generate_streams_text_and_prints_summary(tmp_path):
    """Also the compilation cache: the first run fills the directory it is given, the
    second loads its programs from there and prints the same text."""
    env = {**ENV, "JAXKV_COMPILATION_CACHE": str(tmp_path / "xla")}
    args = ("generate", "def fibonacci(", "--max-new-tokens", "24", "--seed", "3")
    result = run(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert len(os.listdir(tmp_path / "xla")) >= 2  # at least the prefill and the decode loop
    again = run(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:-1] == result.stdout.splitlines()[:-1]  # all but the summary's timing
    out = result.stdout
    assert out.startswith("def fibonacci(")
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("[jaxkv] prompt ") and "tokens/s" in summary
    assert re.search(r"\| cache [\d.]+ KiB \(StaticCache\) \|", summary), summary
    new = int(re.search(r"\| new (\d+) tokens \|", summary).group(1))
    assert 1 <= new <= 24  # fewer only if the model emitted its end-of-text token
    assert len(out) > len("def fibonacci(") + 20  # some text was produced
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (["--model", "/no/such/dir"], "not a directory"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
        # argparse alone read "-1e-3" as another option ("expected one argument" and its usage)
        (["--temperature", "-1e-3"], "--temperature must be a finite number >= 0 (0 is greedy), got -0.001"),
        (["--presence-penalty", "-inf"], "--presence-penalty must be a finite number, got -inf"),
        (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be finite and > 0"),
        (["--repetition-penalty", "nan"], "--repetition-penalty must be a finite number"),
        (["--presence-penalty", "inf"], "--presence-penalty must be a finite number"),
        (["--frequency-penalty", "nan"], "--frequency-penalty must be a finite number"),
        (["--seed", str(2**64)], "--seed must be an integer in [0, 2**32), got 18446744073709551616"),
        # jax.random.key keeps 32 bits: 2**32 + 1 gave seed 1's text, -1 seed 2**32 - 1's.
        (["--seed", str(2**32 + 1)], "--seed must be an integer in [0, 2**32), got 4294967297"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**32), got -1"),
    ],
)
def test_bad_input_is_one_clean_line(args, match, capsys):
    assert main(["generate", "x = 1", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxkv: error:") and match in lines[0], captured.err
    assert captured.out == ""


def test_a_negative_value_in_exponent_form_is_the_option_value():
    from jaxkv.cli import _attach_negative_values, _parser

    parser = _parser()
    argv = ["generate", "x", "--presence-penalty", "-1e-3", "--frequency-penalty", "-2", "--seed", "3"]
    args = parser.parse_args(_attach_negative_values(argv, parser.numeric_flags))
    assert (args.prompt, args.presence_penalty, args.frequency_penalty, args.seed) == ("x", -1e-3, -2.0, 3)
    # after "--" everything is positional, and a non-number after an option is left to argparse
    assert _attach_negative_values(["--", "--seed", "-1e3"], {"--seed"}) == ["--", "--seed", "-1e3"]
    assert _attach_negative_values(["--seed", "-h"], {"--seed"}) == ["--seed", "-h"]


def test_sampling_flags_reach_the_sampler(monkeypatch, capsys):
    """--min-p and the penalties: the text equals jaxkv.stream's with the same config and key."""
    import jax
    import jax.numpy as jnp

    from jaxkv.generation import stream
    from jaxkv.models import from_pretrained
    from jaxkv.sampling import SamplingConfig

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")  # in this process: leave JAX's settings alone
    prompt, flags = "def add(a, b):", ["--min-p", "0.05", "--repetition-penalty", "1.3", "--presence-penalty", "0.2",
                                       "--frequency-penalty", "0.1", "--seed", "5", "--max-new-tokens", "12"]
    assert main(["generate", prompt, *flags]) == 0
    printed, summary = capsys.readouterr().out.rsplit("\n[jaxkv]", 1)
    # 12 tokens end inside the first two (compiling) calls: no rate, said so (not "nan tokens/s")
    assert "nan" not in summary and "| decode rate not measured (it needs 18 or more new tokens: the first 17 come from the calls that compile) |" in summary
    loaded = from_pretrained(embedded_model_path())
    config = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.2, frequency_penalty=0.1)
    ids = jnp.asarray([loaded.tokenizer.encode(prompt).ids], jnp.int32)
    tokens = [int(t[0]) for t in stream(loaded.model, ids, 12, sampling=config, key=jax.random.key(5), eos_token_id=0)]
    tokens = tokens[: tokens.index(0)] if 0 in tokens else tokens
    assert printed == prompt + loaded.tokenizer.decode(tokens)


def test_every_stop_id_of_the_checkpoint_ends_the_text(tmp_path, monkeypatch, capsys):
    """eos_token_id as a list (chat models end a turn with any of several ids): the CLI stops
    at the first of them it emits, not only at the list's first entry."""
    import jax
    import jax.numpy as jnp

    from jaxkv.generation import stream
    from jaxkv.models import from_pretrained
    from jaxkv.sampling import SamplingConfig

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    model = tmp_path / "two_stops"
    shutil.copytree(embedded_model_path(), model)
    prompt, loaded = "def add(a, b):", from_pretrained(model)
    ids = jnp.asarray([loaded.tokenizer.encode(prompt).ids], jnp.int32)
    greedy = [int(t[0]) for t in stream(loaded.model, ids, 8, sampling=SamplingConfig(), key=jax.random.key(0))]
    greedy = greedy[: greedy.index(0)] if 0 in greedy else greedy  # 0: the model's own end of text
    at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [0, greedy[at]]}))
    assert main(["generate", prompt, "--model", str(model), "--temperature", "0", "--max-new-tokens", "8"]) == 0
    printed, summary = capsys.readouterr().out.rsplit("\n[jaxkv]", 1)
    assert printed == prompt + loaded.tokenizer.decode(greedy[:at])
    assert f"| new {at} tokens |" in summary
    # An id past the vocabulary: one clean line and status 2 (it was a traceback, status 1).
    vocab = loaded.model.config.vocab_size
    (model / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [0, vocab]}))
    assert main(["generate", prompt, "--model", str(model), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"names id {vocab}, outside the model's vocabulary [0, {vocab})" in err[0], err
    # A generation_config.json that is not a JSON object is refused, naming the file: it was
    # skipped, and config.json (without eos_token_id here) left the text with no stop id.
    del_eos = json.loads((model / "config.json").read_text())
    del_eos.pop("eos_token_id", None)
    (model / "config.json").write_text(json.dumps(del_eos))
    for text, says in [('{"eos_token_id": 0,,}', "not a readable JSON file"), ("[0]", "expected a JSON object")]:
        (model / "generation_config.json").write_text(text)
        assert main(["generate", prompt, "--model", str(model), "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "generation_config.json" in err[0] and says in err[0], err


@pytest.fixture
def no_context_model(tmp_path):
    """The embedded model without max_position_embeddings: only memory bounds its context."""
    model = tmp_path / "no_context"
    shutil.copytree(embedded_model_path(), model)
    config = json.loads((model / "config.json").read_text())
    del config["max_position_embeddings"]
    (model / "config.json").write_text(json.dumps(config))
    return model


def _too_large_for_memory(model) -> str:
    """The refusal for 10**9 new tokens, its sizes worked out here from the config and the
    weights file: a float32 key and value per layer, kv head and head dim for each token."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    tokens = 10**9 + 16  # the prompt's bucket on top
    cache_tib = tokens * per_token / 2**40
    weights_mib = (model / "model.safetensors").stat().st_size / 2**20
    return (rf"--max-new-tokens 1000000000 needs a {cache_tib:.1f} TiB cache \({tokens} tokens\) besides the "
            rf"{weights_mib:.1f} MiB of weights, but only .* is free; lower --max-new-tokens to at most about \d+")


@pytest.mark.parametrize(
    "max_new_tokens, match",
    [
        # 10**9 tokens of this model's cache (3 KiB each for the 6-layer model) is terabytes,
        # more than any machine running this has.
        (10**9, _too_large_for_memory),
        (2**31, lambda model: (
            r"--max-new-tokens 2147483648 asks for a cache of 2147483664 tokens; positions are int32, .*")),
    ],
)
def test_cache_too_large_is_refused_up_front(no_context_model, max_new_tokens, match, capsys):
    match = match(no_context_model)  # the expected message, from the model's files
    assert main(["generate", "x", "--model", str(no_context_model), "--max-new-tokens", str(max_new_tokens)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch("jaxkv: error: " + match, lines[0]), lines


@pytest.mark.slow
def test_invalid_utf8_prompt_is_one_clean_line():
    # Bytes in argv that are not UTF-8, as a shell passes them.
    result = subprocess.run(
        [sys.executable, "-m", "jaxkv", "generate", b"def f(\xff\xfe"], capture_output=True, timeout=300,
        env=ENV,
    )
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode() == (
        "jaxkv: error: the prompt is not valid UTF-8 (byte 0xff at position 6); pass UTF-8 text\n"
    )


@pytest.mark.slow
def test_closed_stdout_pipe_exits_quietly():
    # Like `jaxkv generate "def f(" | head -c 6`: the reader leaves after the echoed prompt,
    # while the model is still compiling, so the next write meets a closed pipe.
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxkv", "generate", "def f(", "--max-new-tokens", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
    )
    assert process.stdout.read(6) == b"def f("
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 1  # what Python's docs advise on EPIPE
    assert stderr == b"", stderr.decode()


@pytest.mark.slow
def test_prompt_longer_than_context_and_unsupported_model(tmp_path):
    with open(os.path.join(embedded_model_path(), "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]  # the positions it was trained on
    result = run("generate", "x = 1\n" * context, "--max-new-tokens", "8")
    assert result.returncode == 2 and f"exceeds the model's context of {context} tokens" in result.stderr
    bad = tmp_path / "gpt2"
    shutil.copytree(embedded_model_path(), bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    result = run("generate", "x", "--model", str(bad))
    assert result.returncode == 2 and "GPT2LMHeadModel" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_detokenizer_prints_what_decoding_the_whole_output_prints():
    """The CLI's incremental detokenizer (a window of the last ids) against the old rule:
    decode every id so far, print what is new unless it ends in a partial character."""
    from tokenizers import Tokenizer

    from jaxkv.cli import Detokenizer

    tokenizer = Tokenizer.from_file(os.path.join(embedded_model_path(), "tokenizer.json"))
    text = "def f(x):\n    return x  # é, ∑, 😀, 汉字\n\tif  x  >=  0 :\n"
    rng = __import__("numpy").random.default_rng(0)
    encoded = tokenizer.encode(text).ids
    random_ids = [rng.integers(0, tokenizer.get_vocab_size(), 60).tolist() for _ in range(20)]
    for ids in [encoded, *random_ids]:
        detokenizer, printed, got = Detokenizer(tokenizer), "", ""
        for n, token in enumerate(ids, 1):
            got += detokenizer.push(token)
            whole = tokenizer.decode(ids[:n])
            if not whole.endswith("\ufffd") and whole.startswith(printed):
                printed = whole
            assert got == printed, (ids[:n], got, printed)
        if ids is encoded:  # multi-byte characters split across tokens come out whole
            assert got == text


def _sentencepiece_style_tokenizer(decoder):
    """A tiny tokenizer with Llama-2 / Mistral's pieces: words carry a leading "▁", and
    characters outside the vocabulary are byte pieces (byte fallback)."""
    from tokenizers import Tokenizer, models

    pieces = ["<unk>", "▁hello", "▁world", "▁there", "wor", "l", "d", "▁", "x", "=", "<0xC3>", "<0xA9>"]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                     byte_fallback=True))
    tokenizer.decoder = decoder
    return tokenizer, {p: i for i, p in enumerate(pieces)}


def test_detokenizer_keeps_the_space_a_sentencepiece_decoder_strips_from_a_first_token():
    """SentencePiece-style decoders drop the leading space of the first token they decode, so
    the first new token decoded alone lost the space after the prompt ('hello worldthere');
    the prompt's ids are the context. The printed text is what decoding prompt + output
    adds to the prompt's text, for both decoder spellings and a prompt ending in a character
    split into byte pieces (é = <0xC3><0xA9>)."""
    from tokenizers import decoders

    from jaxkv.cli import Detokenizer

    spellings = [
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                           decoders.Strip(" ", 1, 0)]),  # Llama-2 / Mistral tokenizer.json
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]),
    ]
    for decoder in spellings:
        tokenizer, v = _sentencepiece_style_tokenizer(decoder)
        cases = [
            (["▁hello", "▁world"], ["▁there", "▁there"]),
            (["▁hello"], ["▁", "wor", "l", "d", "▁there"]),
            (["▁hello", "x", "<0xC3>", "<0xA9>"], ["▁there", "<0xC3>", "<0xA9>", "x"]),
            (["<0xA9>", "▁world"], ["=", "▁there"]),  # context that starts inside a character
            ([], ["▁hello", "▁world"]),
        ]
        for prompt, new in cases:
            prompt_ids, new_ids = [v[p] for p in prompt], [v[p] for p in new]
            detokenizer = Detokenizer(tokenizer, prompt_ids)
            got = "".join(detokenizer.push(t) for t in new_ids)
            want = tokenizer.decode(prompt_ids + new_ids)[len(tokenizer.decode(prompt_ids)):]
            assert got == want, (decoder, prompt, new, got, want)
            if prompt and new[0].startswith("▁"):  # a word after the prompt keeps its space
                assert got.startswith(" ")
    # the case the review found, as the CLI prints it
    tokenizer, v = _sentencepiece_style_tokenizer(spellings[0])
    detokenizer = Detokenizer(tokenizer, [v["▁hello"], v["▁world"]])
    assert "hello world" + detokenizer.push(v["▁there"]) + detokenizer.push(v["▁there"]) == "hello world there there"


def test_compilation_cache_dir(monkeypatch):
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    assert compilation_cache_dir() is None  # the opt-out
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "/some/dir")
    assert compilation_cache_dir() == "/some/dir"
    monkeypatch.delenv("JAXKV_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert compilation_cache_dir() == "/xdg/jaxkv/xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert compilation_cache_dir() == "/home/someone/.cache/jaxkv/xla"
    # An on spelling is the default directory, not ./true; off spellings as the other switches;
    # a relative directory is made absolute once (review 67).
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "true")
    assert compilation_cache_dir() == "/home/someone/.cache/jaxkv/xla"
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "Off")
    assert compilation_cache_dir() is None
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "xla-here")
    assert compilation_cache_dir() == os.path.join(os.getcwd(), "xla-here")


def test_nan_logits_a_foreign_tokenizer_and_an_unwritable_stdout_are_one_line(tmp_path, monkeypatch, capsys):
    """A checkpoint whose weights hold a NaN (its logits are NaN, so the stream gives NAN_TOKEN)
    and a tokenizer whose ids pass the model's vocabulary were tracebacks (decode(-1)
    overflowed; the stream's id check); a full stdout was a traceback too. Each is one line."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    model = tmp_path / "nan"
    shutil.copytree(embedded_model_path(), model)
    weights = load_file(model / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("down_proj.weight"))
    weights[name] = weights[name].copy()
    weights[name].flat[0] = np.nan
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert main(["generate", "def f(", "--model", str(model), "--max-new-tokens", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("def f(") and "[jaxkv] prompt" not in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "the model produced NaN logits (at new token 1)" in err[0], err
    small = tmp_path / "small_vocab"
    shutil.copytree(embedded_model_path(), small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    weights = load_file(small / "model.safetensors")
    save_file({n: w[:100] if w.shape[0] == config["vocab_size"] else w for n, w in weights.items()},
              small / "model.safetensors", metadata={"format": "pt"})
    assert main(["generate", "def fibonacci(", "--model", str(small), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "but the model's vocabulary is [0, 100)" in err[0], err

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["generate", "def f(", "--max-new-tokens", "4"]) == 1
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["generate", "def f(", "--max-new-tokens", "4"]) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxkv: error: cannot write the output: [Errno 28] No space left on device",
                   "jaxkv: error: stdout is closed; nowhere to write the text"], err


def test_empty_paths_failed_saves_encodings_closed_stderr_and_abbreviations(tmp_path, monkeypatch, capsys):
    """`--model ""` ran the embedded model; `--prompt-cache ""` or a name too long to save
    was a traceback after the prompt was printed; an ascii stdout a UnicodeEncodeError
    traceback; with stderr closed the prompt-cache line went into the text on stdout;
    `--presence -1e-3` (an abbreviation) missed the negative-value fix."""
    import io

    from jaxkv.cli import _attach_negative_values, _parser

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    common = ["generate", "def f(x):", "--max-new-tokens", "2"]
    assert main(common + ["--model", ""]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxkv: error: --model is empty; give a checkpoint directory, or leave --model out for the embedded model")
    assert main(common + ["--prompt-cache", ""]) == 2
    assert capsys.readouterr().err.strip().endswith("the path must name a file, got ''.")
    assert main(common + ["--prompt-cache", str(tmp_path)]) == 2  # a directory: nothing to delete
    assert "Delete" not in capsys.readouterr().err
    too_long = str(tmp_path / ("a" * 300))
    assert main(common + ["--prompt-cache", too_long]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"jaxkv: error: {too_long}: the prompt cache could not be saved") and "Traceback" not in err[0]

    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert main(["generate", "s = 'é'", "--max-new-tokens", "2"]) == 1
    assert capsys.readouterr().err.strip() == (
        "jaxkv: error: cannot write the output: stdout's encoding (ascii) cannot write 'é'; set PYTHONIOENCODING=utf-8")

    text = io.StringIO()
    monkeypatch.setattr(sys, "stdout", text)
    monkeypatch.setattr(sys, "stderr", None)
    assert main(common + ["--prompt-cache", str(tmp_path / "p.safetensors")]) == 0
    assert text.getvalue().startswith("def f(x):") and "prompt cache" not in text.getvalue()

    parser = _parser()
    assert _attach_negative_values(["generate", "x", "--presence", "-1e-3"], parser.numeric_flags,
                                   parser.long_flags)[-1] == "--presence-penalty=-1e-3"


@pytest.mark.parametrize("args", [["--top-k", "abc"], ["--seed", "1.5"], ["--no-such-flag"]])
def test_argparse_errors_are_one_line_too(args, capsys):
    """A value argparse itself refuses (not an int) printed its usage block, 9 lines, where the
    README promises one line on stderr and status 2 (review 59)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "x = 1", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("jaxkv generate: error:", "jaxkv: error:")), captured.err
    assert captured.out == ""


def test_environment_problems_are_one_line_each(tmp_path, monkeypatch, capsys):
    """Review 66: a bad JAXKV_PALLAS_GPU was a 45-line traceback after the prompt was echoed;
    an unwritable compilation cache was 14 two-line JAX warnings inside the text; a core-only
    install (no flax) was an 11-line ModuleNotFoundError."""
    import jax

    from jaxkv.cli import _use_compilation_cache

    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    monkeypatch.setenv("JAXKV_PALLAS_GPU", "gpu")
    assert main(["generate", "x = 1", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "jaxkv: error: JAXKV_PALLAS_GPU must be one of 'auto', '1', '0' (or true/on/yes, false/off/no, or unset), got 'gpu'."]
    monkeypatch.delenv("JAXKV_PALLAS_GPU")

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        monkeypatch.setenv("JAXKV_COMPILATION_CACHE", str(tmp_path / "xla"))
        monkeypatch.setattr(os, "access", lambda path, mode: False)  # (root may write anywhere)
        _use_compilation_cache()
        monkeypatch.undo()
        assert jax.config.jax_compilation_cache_dir is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("[jaxkv] compilation cache ") and "is not writable" in err[0], err
    finally:
        jax.config.update("jax_compilation_cache_dir", before)

    # No kernel on CPU (no compiler, a failed build): its warning is one line before the
    # text (it landed in the middle of the text's first line).
    import warnings

    from jaxkv import _kernels

    warned = []

    def unavailable():  # as the real one: it warns once
        if not warned:
            warned.append(1)
            warnings.warn("jaxkv: the CPU decode-attention kernel is unavailable (no C++ compiler found);\n "
                          "attention runs the XLA loop", RuntimeWarning, stacklevel=2)
        return False

    monkeypatch.setattr(_kernels, "start_background_build", lambda: False)
    monkeypatch.setattr(_kernels, "available", unavailable)
    monkeypatch.setenv("JAXKV_COMPILATION_CACHE", "0")
    if jax.default_backend() == "cpu":
        assert main(["generate", "def f(", "--max-new-tokens", "2"]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("def f(") and "kernel" not in captured.out
        assert captured.err.strip().splitlines()[0] == ("[jaxkv] jaxkv: the CPU decode-attention kernel is unavailable "
                                                         "(no C++ compiler found); attention runs the XLA loop")
    monkeypatch.undo()

    no_flax = "import sys; sys.modules['flax'] = None; from jaxkv.cli import main; sys.exit(main(['generate', 'x = 1']))"
    done = subprocess.run([sys.executable, "-c", no_flax], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.strip().splitlines() == [
        "jaxkv: error: jaxkv generate needs the models extra (import of flax halted; None in sys.modules): "
        "pip install 'jaxkv[models]'"], done.stderr

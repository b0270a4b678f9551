"""The `jaxkv` command line, run as a subprocess like a user would."""

import json
import re
import os
import shutil
import subprocess
import sys

import pytest

from jaxkv.cli import embedded_model_path


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_generate_streams_text_and_prints_summary():
    result = run("generate", "def fibonacci(", "--max-new-tokens", "24", "--seed", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("def fibonacci(")
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("[jaxkv] prompt ") and "tokens/s" in summary and "cache" in summary
    new = int(re.search(r"\| new (\d+) tokens \|", summary).group(1))
    assert 1 <= new <= 24  # fewer only if the model emitted its end-of-text token
    assert len(out) > len("def fibonacci(") + 20  # some text was produced
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        (["--model", "/no/such/dir"], "not a directory"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--top-p", "0"], "top_p must be in"),
        (["--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_input_is_one_clean_line(args, match):
    result = run("generate", "x = 1", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxkv: error:") and match in lines[0], result.stderr


def test_prompt_longer_than_context_and_unsupported_model(tmp_path):
    result = run("generate", "x = 1\n" * 400, "--max-new-tokens", "8")
    assert result.returncode == 2 and "exceeds the model's context of 1024 tokens" in result.stderr
    bad = tmp_path / "gpt2"
    shutil.copytree(embedded_model_path(), bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    result = run("generate", "x", "--model", str(bad))
    assert result.returncode == 2 and "GPT2LMHeadModel" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

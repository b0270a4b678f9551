"""The embedded model: loads in jaxkv and in HF transformers, same greedy tokens."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cli import embedded_model_path
from jaxkv.generation import generate
from jaxkv.models import from_pretrained

pytestmark = pytest.mark.slow  # transformers on the embedded checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self, item):"]


def test_embedded_model_is_small_and_loads():
    path = embedded_model_path()
    size = sum(f.stat().st_size for f in pathlib.Path(path).glob("model*.safetensors"))
    assert size <= 20 * 10**6, size  # issue 17's budget for the package: <= 20 MB of weights
    loaded = from_pretrained(path)
    assert loaded.tokenizer is not None and loaded.config.architecture == "LlamaForCausalLM"
    text = "    def __init__(self):\n        return  # tabs\tand spaces\n"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text).ids) == text


def test_embedded_model_greedy_tokens_equal_transformers():
    path = embedded_model_path()
    loaded = from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = loaded.tokenizer.encode(prompt).ids
        prompt_ids = torch.tensor([ids])
        with torch.no_grad():
            # The prompt starts with <|endoftext|> (id 0), which is also the pad id: without an
            # explicit mask transformers takes it for padding and masks it out.
            ref = hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0).numpy()[0, len(ids):]
        got = np.asarray(generate(loaded.model, jnp.asarray([ids]), 32).tokens[0])
        np.testing.assert_array_equal(got, ref)

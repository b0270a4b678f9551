"""Malformed ``config.json`` files: each is one CheckpointError naming the file and the key."""

import json
import shutil

import pytest

from jaxkv.cli import embedded_model_path, main
from jaxkv.models import CheckpointError, from_pretrained


@pytest.fixture
def checkpoint(tmp_path):
    """A copy of the embedded model and a function that rewrites its config.json."""
    directory = tmp_path / "model"
    shutil.copytree(embedded_model_path(), directory)
    config_path = directory / "config.json"
    original = json.loads(config_path.read_text())

    def write(edit):
        config_path.write_text(json.dumps(edit(dict(original))))
        return directory

    return write


def _drop(*keys):
    def edit(config):
        for key in keys:
            del config[key]
        return config

    return edit


def _set(**changes):
    return lambda config: config | changes


@pytest.mark.parametrize(
    "edit, key, match",
    [
        (lambda config: [config], None, "expected a JSON object of config keys, got a list"),
        (_set(hidden_size="64"), "hidden_size", 'must be a positive integer, got the string "64"'),
        (_set(vocab_size=4096.5), "vocab_size", "must be a positive integer, got the number 4096.5"),
        (_set(num_hidden_layers=0), "num_hidden_layers", "must be a positive integer, got the number 0"),
        (_set(max_position_embeddings=True), "max_position_embeddings", "got the boolean true"),
        (_drop("architectures"), "architectures", "is missing or empty \\(model_type is 'llama'\\); add e.g."),
        (_set(architectures="LlamaForCausalLM"), "architectures", "must be a list of architecture names"),
        (_set(architectures=["GPT2LMHeadModel"]), None, "unsupported architecture \\['GPT2LMHeadModel'\\]"),
        (_set(tie_word_embeddings="false"), "tie_word_embeddings", 'must be true or false, got the string "false"'),
        (_set(rms_norm_eps=-1e-5), "rms_norm_eps", "must be a positive finite number"),
        (_set(rope_parameters=[10000.0]), "rope_parameters", "must be an object, got a list"),
        (_set(rope_parameters={"rope_theta": "1e4"}), "rope_parameters.rope_theta", "must be a positive finite number"),
        # 0 loaded and gave NaN logits (the top-level key was checked, the nested one was not)
        (_set(rope_parameters={"rope_theta": 0}), "rope_parameters.rope_theta", "must be a positive finite number"),
        (_set(layer_types=["full_attention"] * 3), "layer_types", "has 3 entries, expected one per layer"),
        (
            _set(num_key_value_heads=4),
            "num_attention_heads",
            "\\(6\\) must be a multiple of 'num_key_value_heads' \\(4\\)",
        ),
        (
            lambda config: _drop("head_dim")(config) | {"hidden_size": 190},
            "hidden_size",
            "\\(190\\) is not divisible by 'num_attention_heads' \\(6\\)",
        ),
        # null is no default (transformers refuses it): float(None) was the whole message, or,
        # inside a rope dict, a TypeError at the first forward
        # (with no rope dict: a dict's own rope_theta is what transformers reads then)
        (lambda config: {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
         | {"rope_theta": None}, "rope_theta", "must be a positive finite number \\(leave the key out"),
        (_set(rms_norm_eps=None), "rms_norm_eps", "must be a positive finite number .*, got null"),
        (_set(rope_parameters={"rope_type": "linear", "factor": None}), "rope_parameters.factor", "got null"),
        (_set(use_sliding_window=True, max_window_layers=None), "max_window_layers", "when use_sliding_window"),
        # transformers runs a model with is_causal false bidirectionally; jaxkv decoded it causally
        (_set(is_causal=False), "is_causal", "which no key/value cache can decode"),
        (_set(is_causal="false"), "is_causal", "must be true or false"),
        (_drop("vocab_size"), "vocab_size", "missing required key"),
        (_set(hidden_act="gelu"), "hidden_act", "is not supported"),
    ],
)
def test_malformed_config_names_file_and_key(checkpoint, edit, key, match):
    directory = checkpoint(edit)
    with pytest.raises(CheckpointError, match=match) as info:
        from_pretrained(directory)
    message = str(info.value)
    assert message.startswith(f"{directory / 'config.json'}: "), message
    if key is not None:
        assert key in message.removeprefix(str(directory)), message


def test_keys_transformers_reads_past_are_no_errors(checkpoint):
    """A null top-level rope_theta beside a rope dict holding one, and a partial_rotary_factor
    in a default RoPE's dict: transformers reads the dict's theta and computes its default
    frequencies over the whole head (a re-saved config moves a top-level factor into the dict),
    so the model is the one without them; jaxkv refused both (review 75)."""
    theta = json.loads((checkpoint(lambda config: config) / "config.json").read_text()).get("rope_theta", 10000.0)
    plain = from_pretrained(checkpoint(_set(rope_parameters={"rope_type": "default", "rope_theta": theta}))).config
    for edit in (_set(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": theta}),
                 _set(rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5})):
        assert from_pretrained(checkpoint(edit)).config == plain


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_cli_reports_a_malformed_config_in_one_line(checkpoint, capsys):
    directory = checkpoint(_set(num_attention_heads="6"))
    assert main(["generate", "x", "--model", str(directory)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxkv: error: {directory / 'config.json'}: key 'num_attention_heads'")


def test_cli_reports_a_bad_eos_token_id(checkpoint, capsys):
    directory = checkpoint(lambda config: config)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "0"}))
    assert main(["generate", "x", "--model", str(directory)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxkv: error: {directory / 'generation_config.json'}: key 'eos_token_id' must be a token id "
                   "(an integer >= 0) or a list of them, got '0'"]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, -3]}))
    assert main(["generate", "x", "--model", str(directory)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("or a list of them, got [0, -3]"), err

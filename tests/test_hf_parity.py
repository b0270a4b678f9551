"""jaxkv.models against HF transformers on tiny random checkpoints, and loading errors.

Each family gets a random tiny config saved with ``save_pretrained``. Norm weights and
biases are moved off their initial constants (ones / zeros) so a weight loaded into the
wrong place, or a missing bias, makes the test fail.
"""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxkv.generation import generate  # noqa: E402
from jaxkv.models import CheckpointError, from_pretrained  # noqa: E402

VOCAB = 128
# float32 logits against transformers: measured 0.9-1.7e-6 of the largest logit; 1e-4 let a
# wrong rms_norm_eps (2.5e-6 for 1e-6) through (review 72).
F32_REL = 1e-5
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
    # Wider than the 0.02 default: peaked logits, so greedy argmax has clear margins.
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
FAMILIES = {
    # llama3 RoPE scaling with a short original context, so all three bands are used;
    # attention_bias puts biases on q/k/v/o.
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16),
        rope_theta=500000.0, attention_bias=True,
    )),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24)),
    # A window shorter than the sequences, so sliding-window masking is exercised.
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8)),
}


@nnx.jit
def forward(model, tokens, cache):
    return model(tokens, cache)


def _build(family, directory, **extra):
    model_cls, config_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**(COMMON | kwargs | extra))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    hf = _build(request.param, directory)
    return request.param, hf, from_pretrained(directory), directory


def _prompts(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length))


@pytest.mark.slow
def test_logits_match_transformers(family):
    name, hf, loaded, _ = family
    ids = _prompts(3, 20)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    # Through the cache: prefill 12 tokens, then 8 decode steps.
    cache = loaded.model.init_cache(batch_size=3, max_length=20)
    chunks = []
    for start, stop in [(0, 12)] + [(t, t + 1) for t in range(12, 20)]:
        logits, cache = forward(loaded.model, jnp.asarray(ids[:, start:stop], jnp.int32), cache)
        chunks.append(np.asarray(logits))
    got = np.concatenate(chunks, axis=1)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"\n{name}: max |jaxkv - HF| / max |HF| = {rel:.2e}")
    assert rel <= F32_REL


@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(family):
    _, hf, loaded, _ = family
    ids = _prompts(3, 9, seed=1)  # the ragged test's shape: one compilation serves both
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=32, do_sample=False).numpy()[:, 9:]
    got = np.asarray(generate(loaded.model, ids, 32).tokens)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama"], indirect=True)  # the penalty is the sampler's: one family
def test_repetition_penalty_matches_transformers_generate(family):
    """Greedy decoding with HF's repetition penalty (the prompt counts) equals transformers' generate."""
    _, hf, loaded, _ = family
    from jaxkv.sampling import SamplingConfig

    ids = _prompts(3, 9, seed=4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), max_new_tokens=24, do_sample=False, repetition_penalty=1.3).numpy()[:, 9:]
        plain = hf.generate(torch.tensor(ids), max_new_tokens=24, do_sample=False).numpy()[:, 9:]
    assert (ref != plain).any(), "the penalty changed nothing in transformers either: pick another seed"
    got = np.asarray(generate(loaded.model, ids, 24, sampling=SamplingConfig(repetition_penalty=1.3)).tokens)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
def test_ragged_batch_matches_each_prompt_alone_in_transformers(family):
    _, hf, loaded, _ = family
    lengths = np.array([9, 3, 6])
    ids = _prompts(3, 9, seed=2)
    for b, n in enumerate(lengths):
        ids[b, n:] = VOCAB - 1  # padding after the prompt: must be ignored
    got = np.asarray(generate(loaded.model, ids, 32, prompt_lengths=lengths).tokens)
    for b, n in enumerate(lengths):
        with torch.no_grad():
            alone = hf.generate(torch.tensor(ids[b : b + 1, :n]), max_new_tokens=32, do_sample=False).numpy()
        np.testing.assert_array_equal(got[b], alone[0, n:])


def test_bfloat16_load(family):
    _, hf, _, directory = family
    loaded = from_pretrained(directory, dtype=jnp.bfloat16)
    ids = _prompts(2, 10, seed=3)
    logits, cache = forward(loaded.model, jnp.asarray(ids, jnp.int32), loaded.model.init_cache(2, 10))
    assert logits.dtype == jnp.bfloat16 and cache.keys.dtype == jnp.bfloat16
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(logits, np.float32) - ref).max() / np.abs(ref).max() < 5e-2


# --------------------------------------------------------------------------- loading


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small llama checkpoint directory (with a tokenizer) that tests copy and damage."""
    directory = str(tmp_path_factory.mktemp("ckpt"))
    hf = _build("qwen2", directory, tie_word_embeddings=False)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return directory, hf


@pytest.fixture
def damaged(checkpoint, tmp_path):
    directory = str(tmp_path / "damaged")
    shutil.copytree(checkpoint[0], directory)
    return directory


def test_sharded_checkpoint_and_tokenizer(checkpoint, tmp_path):
    directory, hf = checkpoint
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    ids = jnp.asarray(_prompts(1, 6), jnp.int32)
    whole, shards = from_pretrained(directory), from_pretrained(sharded)
    np.testing.assert_array_equal(
        np.asarray(forward(whole.model, ids, None)[0]), np.asarray(forward(shards.model, ids, None)[0])
    )
    assert shards.tokenizer is None
    assert whole.tokenizer.encode("w5 w7 nope").ids == [5, 7, VOCAB - 1]
    assert whole.config.architecture == "Qwen2ForCausalLM" and whole.path == directory


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | changes, f)


def _edit_weights(directory, fn):
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_directory_and_files(damaged, tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        from_pretrained(tmp_path / "nowhere")
    os.remove(os.path.join(damaged, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no weights found; expected model.safetensors"):
        from_pretrained(damaged)
    os.remove(os.path.join(damaged, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        from_pretrained(damaged)


def test_unsupported_architecture(damaged):
    _edit_config(damaged, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        from_pretrained(damaged)


def test_corrupt_config_and_tokenizer(damaged):
    with open(os.path.join(damaged, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: corrupt tokenizer file"):
        from_pretrained(damaged)
    with open(os.path.join(damaged, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: corrupt JSON"):
        from_pretrained(damaged)


def test_missing_tensor(damaged):
    _edit_weights(damaged, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        from_pretrained(damaged)


def test_misshaped_tensor(damaged):
    def shrink(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:10]

    _edit_weights(damaged, shrink)
    with pytest.raises(
        CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[10, 64\], expected \[96, 64\]"
    ):
        from_pretrained(damaged)


def test_unexpected_tensor(damaged):
    _edit_weights(damaged, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        from_pretrained(damaged)


def test_corrupt_safetensors(damaged):
    path = os.path.join(damaged, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or unreadable safetensors file"):
        from_pretrained(damaged)


def test_index_naming_a_missing_shard(checkpoint, tmp_path):
    sharded = str(tmp_path / "sharded")
    checkpoint[1].save_pretrained(sharded, max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(CheckpointError, match=f"{shard}: file not found"):
        from_pretrained(sharded)


def test_bad_dtype(checkpoint):
    # "auto" (transformers' word) and a torch dtype were NumPy's "data type not understood"
    for bad in (jnp.int8, "auto", torch.bfloat16):
        with pytest.raises(TypeError, match="dtype must be jnp.float32, jnp.bfloat16"):
            from_pretrained(checkpoint[0], dtype=bad)


# --------------------------------------------------------------------------- config keys as transformers reads them


def _relative_error_against_transformers(directory, length=12):
    """max |jaxkv - HF| / max |HF| of the logits, HF being what AutoModelForCausalLM loads
    from the same directory (so its reading of the config and the weights is the reference)."""
    import warnings

    ids = _prompts(2, length, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(from_pretrained(directory).model(jnp.asarray(ids, jnp.int32), None)[0])
    return np.abs(got - ref).max() / np.abs(ref).max()


def test_llama3_top_level_original_context_wins_as_in_transformers(tmp_path):
    """transformers' standardize_rope_params gives a top-level original_max_position_embeddings
    priority over the one inside the llama3 rope dict; jaxkv read only the dict's (16 here)."""
    directory = str(tmp_path)
    _build("llama", directory)
    _edit_config(directory, original_max_position_embeddings=64)
    assert _relative_error_against_transformers(directory) <= F32_REL


def test_tied_config_with_its_own_lm_head_keeps_it_as_transformers_does(tmp_path):
    """tie_word_embeddings true, yet the file holds an lm_head.weight unlike the embedding:
    transformers keeps the two apart (the config is wrong); jaxkv used the embedding."""
    directory = str(tmp_path)
    _build("qwen2", directory)  # tied: the file has no lm_head.weight
    _edit_weights(directory, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"][::-1] * 0.5 + 0.1}))
    assert _relative_error_against_transformers(directory) <= F32_REL
    assert not from_pretrained(directory).config.tie_word_embeddings


def test_a_tied_checkpoint_holding_only_lm_head_loads_as_in_transformers(tmp_path):
    """transformers ties in both directions: with tie_word_embeddings and only lm_head.weight
    in the file, the embedding is that matrix. jaxkv refused it (missing embed_tokens)."""
    directory = str(tmp_path)
    _build("qwen2", directory)  # tied: the file has the embedding only
    _edit_weights(directory, lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}))
    assert _relative_error_against_transformers(directory) <= F32_REL
    assert from_pretrained(directory).config.tie_word_embeddings


def test_transformers_weights_names_the_file_to_load_as_in_transformers(checkpoint, tmp_path):
    """config.json's transformers_weights names the weights transformers loads (a file or an
    index, before model.safetensors); jaxkv read the stale model.safetensors beside it."""
    directory, hf = checkpoint
    named = str(tmp_path / "named")
    shutil.copytree(directory, named)
    torch.manual_seed(1)
    other = type(hf)(hf.config).eval()
    other.save_pretrained(str(tmp_path / "other"))
    shutil.copy(tmp_path / "other" / "model.safetensors", os.path.join(named, "weights-v2.safetensors"))
    _edit_config(named, transformers_weights="weights-v2.safetensors")
    assert _relative_error_against_transformers(named) <= F32_REL
    np.testing.assert_array_equal(  # and not by chance: the stale file's weights differ
        np.asarray(from_pretrained(named).model.embed_tokens.embedding[...]),
        other.model.embed_tokens.weight.detach().numpy())

    other.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    for name in os.listdir(tmp_path / "sharded"):
        if name.startswith("model-"):
            shutil.copy(tmp_path / "sharded" / name, named)
    shutil.copy(tmp_path / "sharded" / "model.safetensors.index.json", os.path.join(named, "v2.safetensors.index.json"))
    _edit_config(named, transformers_weights="v2.safetensors.index.json")
    assert _relative_error_against_transformers(named) <= F32_REL

    for value, match in [("../model.safetensors", "must name a file inside the checkpoint directory"),
                         ("pytorch_model.bin", "must name a .safetensors file or a .safetensors.index.json"),
                         (3, "got the number 3"),
                         ("gone.safetensors", "gone.safetensors: file not found \\(named by 'transformers_weights'")]:
        _edit_config(named, transformers_weights=value)
        with pytest.raises(CheckpointError, match=match):
            from_pretrained(named)


@pytest.mark.parametrize(
    "family, keys",
    [
        ("mistral", dict(attention_bias=True, mlp_bias=True)),
        ("qwen2", dict(mlp_bias=True)),
        ("qwen3", dict(mlp_bias=True)),
    ],
)
def test_bias_keys_the_transformers_model_does_not_read_are_ignored(tmp_path, family, keys):
    """Mistral has no biases and Qwen2/Qwen3 no MLP biases whatever config.json says; jaxkv
    asked the file for bias tensors that model never has (and refused the checkpoint)."""
    directory = str(tmp_path)
    _build(family, directory)
    _edit_config(directory, **keys)
    assert _relative_error_against_transformers(directory) <= F32_REL


def test_model_type_naming_another_model_is_refused(damaged):
    """transformers' Auto classes build the model model_type names (here a Llama, with no q/k/v
    biases) whatever architectures says; jaxkv silently built the Qwen2 of architectures."""
    _edit_config(damaged, model_type="llama")
    assert type(transformers.AutoConfig.from_pretrained(damaged)).__name__ == "LlamaConfig"
    with pytest.raises(
        CheckpointError, match=r"config\.json: model_type 'llama' does not match architecture 'Qwen2ForCausalLM'"
    ):
        from_pretrained(damaged)


@pytest.mark.parametrize(
    "changes, match",
    [
        # rope parameters per layer type: transformers' Qwen2 rotary embedding raises KeyError
        # 'rope_type'; jaxkv used rope_theta 10000 for every layer.
        (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
         "per-layer-type rope parameters"),
        # a top-level partial_rotary_factor joins a scaled RoPE's dict: transformers rotates a
        # quarter of each head (and fails); jaxkv rotated all of it.
        (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4), partial_rotary_factor=0.25),
         "partial_rotary_factor"),
    ],
    ids=["per-layer-type", "partial-rotary"],
)
def test_rope_configs_jaxkv_does_not_implement_are_refused(damaged, changes, match):
    _edit_config(damaged, **changes)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(damaged)


def test_corrupt_weight_index_is_a_checkpoint_error(damaged):
    os.remove(os.path.join(damaged, "model.safetensors"))
    with open(os.path.join(damaged, "model.safetensors.index.json"), "w") as f:
        json.dump([{"weight_map": {}}], f)
    with pytest.raises(CheckpointError, match=r"index\.json: no 'weight_map' object"):
        from_pretrained(damaged)


def test_single_file_comes_before_an_index_as_in_transformers(checkpoint, tmp_path):
    """A directory holding model.safetensors and a (stale) sharded index of other weights:
    transformers loads model.safetensors; jaxkv loaded the shards."""
    directory, hf = checkpoint
    both = str(tmp_path / "both")
    shutil.copytree(directory, both)
    torch.manual_seed(1)
    other = type(hf)(hf.config).eval()
    other.save_pretrained(str(tmp_path / "other"), max_shard_size="40KB")
    for name in os.listdir(tmp_path / "other"):
        if name.startswith("model-") or name == "model.safetensors.index.json":
            shutil.copy(tmp_path / "other" / name, both)
    assert _relative_error_against_transformers(both) <= F32_REL


@pytest.mark.parametrize(
    "raw",
    [
        dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, num_attention_heads=32),
        dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=100, num_attention_heads=3,
             num_key_value_heads=1),
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=64),
        dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=64, num_attention_heads=16),
        dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=16),
        dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=16,
             num_key_value_heads=None, hidden_act="swish"),
    ],
)
def test_keys_config_json_leaves_out_read_as_transformers_does(raw):
    """A trimmed config.json: the geometry transformers' config class fills in (Qwen3 head_dim
    128; num_key_value_heads 32 for Qwen2/Qwen3, 8 for Mistral, null: one per query head).
    jaxkv took hidden_size // num_attention_heads and num_attention_heads."""
    import warnings

    from jaxkv.models import LlamaConfig
    from jaxkv.models.loading import _check_hf_config

    raw = dict(vocab_size=32, intermediate_size=48, num_hidden_layers=1) | raw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoConfig.for_model(**raw)
        hf_attention = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    _check_hf_config(raw, "config.json")
    config = LlamaConfig.from_hf(raw)
    assert (config.head_dim, config.num_kv_heads) == (hf_attention.head_dim, hf.num_key_value_heads)
    assert config.num_kv_heads * config.head_dim == hf_attention.k_proj.out_features


@pytest.mark.parametrize("form", ["mistral config.json with layer_types", "as transformers re-saves it", "ministral"])
def test_alternating_sliding_layers_as_transformers_loads_them(form, tmp_path):
    """A Mistral config.json with a layer_types key is Ministral for AutoConfig.from_pretrained
    (full and sliding layers alternating, Ministral-8B's layout): jaxkv slid every layer, as
    MistralModel does, 1.6 of the largest logit off (review 75). Both forms, loaded from the
    directory by transformers' Auto classes as a user would, against jaxkv through its cache."""
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    kwargs = COMMON | dict(num_hidden_layers=3, sliding_window=3)
    torch.manual_seed(0)
    if form == "ministral":
        # (transformers' MinistralAttention needs an explicit head_dim: None fails in its forward)
        config = transformers.MinistralConfig(**kwargs, layer_types=types, head_dim=16)
        transformers.MinistralForCausalLM(config).save_pretrained(tmp_path)
    else:
        transformers.MistralForCausalLM(transformers.MistralConfig(**kwargs)).save_pretrained(tmp_path)
        raw = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(raw | {"layer_types": types}))
        if form == "as transformers re-saves it":  # model_type ministral, architectures MistralForCausalLM (review 82)
            transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path)
            resaved = json.loads((tmp_path / "config.json").read_text())
            assert (resaved["model_type"], resaved["architectures"]) == ("ministral", ["MistralForCausalLM"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MinistralForCausalLM" and list(hf.config.layer_types) == types
    loaded = from_pretrained(str(tmp_path))
    assert loaded.config.sliding_layers == (False, True, True) and loaded.config.sliding_window == 3
    ids = _prompts(2, 10, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    cache = loaded.model.init_cache(batch_size=2, max_length=10)
    first, cache = forward(loaded.model, jnp.asarray(ids[:, :7], jnp.int32), cache)
    rest, cache = forward(loaded.model, jnp.asarray(ids[:, 7:], jnp.int32), cache)
    got = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= F32_REL

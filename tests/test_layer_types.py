"""One rule decides which layers slide: the model config and the cache agree.

``LlamaConfig.from_hf`` (the model) and ``HybridCache.from_config`` (the cache) both go
through ``jaxkv.models.layer_types_from_config``. Each case states what transformers' own
config class and attention do with it.
"""

import os
import tempfile

import pytest

from jaxkv.caches import FULL, SLIDING, HybridCache
from jaxkv.models import LlamaConfig, layer_types_from_config

BASE = dict(num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64)
CASES = [
    # Llama's attention has no window: transformers ignores a sliding_window key there.
    (dict(model_type="llama", architectures=["LlamaForCausalLM"], sliding_window=4), (FULL,) * 3, None),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4), (SLIDING,) * 3, 4),
    # No sliding_window key: MistralConfig's default, 4096 (a null one means no window).
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]), (SLIDING,) * 3, 4096),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None), (FULL,) * 3, None),
    # Qwen2: without use_sliding_window the window is None, whatever layer_types says.
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=4, max_window_layers=1,
          layer_types=[FULL, SLIDING, SLIDING]), (FULL,) * 3, None),
    (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=4, max_window_layers=1,
          use_sliding_window=True), (FULL, SLIDING, SLIDING), 4),
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], sliding_window=4, use_sliding_window=True,
          layer_types=[SLIDING, FULL, SLIDING]), (SLIDING, FULL, SLIDING), 4),
    # model_type absent: the architecture names it.
    (dict(architectures=["MistralForCausalLM"], sliding_window=2), (SLIDING,) * 3, 2),
]


@pytest.mark.parametrize("extra, types, window", CASES)
def test_model_config_and_cache_agree(extra, types, window):
    hf = {**BASE, **extra}
    assert layer_types_from_config(hf) == (types, window)
    config = LlamaConfig.from_hf(hf, source="config.json")
    assert config.sliding_layers == tuple(t == SLIDING for t in types) and config.sliding_window == window
    if window is not None:
        assert HybridCache.from_config(hf, batch_size=1, max_length=8).layer_types == types


def test_unknown_pattern_is_refused_by_both():
    hf = {**BASE, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4}
    with pytest.raises(ValueError, match="Pass layer_types"):
        layer_types_from_config(hf)
    with pytest.raises(ValueError, match="Pass layer_types"):
        HybridCache.from_config(hf, batch_size=1, max_length=8)


@pytest.mark.parametrize(
    "extra",
    [
        dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, num_hidden_layers=30),  # max_window_layers: 28
        dict(model_type="qwen3", use_sliding_window=True, max_window_layers=1),  # sliding_window: 4096
        dict(model_type="qwen2", use_sliding_window=True, num_hidden_layers=30),  # both left out
        dict(model_type="mistral"),  # sliding_window: 4096
        dict(model_type="mistral", sliding_window=None),
    ],
)
def test_keys_config_json_leaves_out_mean_what_transformers_assumes(extra):
    """A trimmed or hand-written config.json: transformers' config class fills the missing
    keys with its defaults (Qwen2/3 max_window_layers 28, sliding_window 4096; Mistral
    sliding_window 4096), and so must jaxkv, or the layers past 28 silently stop sliding."""
    transformers = pytest.importorskip("transformers")
    raw = {**BASE, **extra}
    hf = transformers.AutoConfig.for_model(**raw)
    if hasattr(hf, "layer_types") and hf.layer_types is not None:
        want = tuple(hf.layer_types) if hf.sliding_window is not None else (FULL,) * hf.num_hidden_layers
    else:  # Mistral: every layer uses config.sliding_window
        want = ((SLIDING if hf.sliding_window is not None else FULL),) * hf.num_hidden_layers
    window = hf.sliding_window if SLIDING in want else None
    assert layer_types_from_config(raw) == (want, window)


MOE = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=64, max_position_embeddings=64, sliding_window=4)
MOE_CASES = {
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], use_sliding_window=True,
                      max_window_layers=3, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                      num_experts=2, num_experts_per_tok=1),
    "qwen2_moe, no model_type": dict(architectures=["Qwen2MoeForCausalLM"], use_sliding_window=True,
                                     max_window_layers=3, moe_intermediate_size=16,
                                     shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], use_sliding_window=True,
                      max_window_layers=2, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1, head_dim=8),
    "mixtral, layer_types": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=2,
                                 num_experts_per_tok=1, layer_types=[FULL, SLIDING] * 2),
    # not MoE: a MistralConfig object's layer_types is ignored (every layer slides), but a
    # config.json with the key is loaded as Ministral, whose layers follow it (review 75)
    # (head_dim given: transformers' MinistralAttention fails on a null one)
    "mistral, layer_types": dict(model_type="mistral", architectures=["MistralForCausalLM"], head_dim=8,
                                 layer_types=[FULL, FULL, FULL, SLIDING]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_configs_slide_where_transformers_attention_slides(name):
    """Measured, not read off the config: each decoder layer of the transformers model records
    the mask it is given (12 tokens, window 4: a layer slides iff its last query cannot see
    token 0). Qwen2-MoE slides its even layers below max_window_layers, Qwen3-MoE every layer,
    Mixtral and Mistral every layer whatever layer_types says; jaxkv had F,F,S,* for the first
    two and Mixtral's and Mistral's layer_types (HybridCache.from_config put rings on the wrong
    layers, and Llama.from_pretrained attended without the window where transformers slides).
    A Mistral config.json with layer_types is loaded as Ministral, whose layers follow it."""
    import json

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = {**MOE, **MOE_CASES[name]}

    def measured(config):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        seen = {}
        for i, layer in enumerate(model.model.layers):
            def hook(module, args, kwargs, i=i):
                mask = kwargs["attention_mask"]
                hidden = bool(mask[0, 0, -1, 0] < -1e30) if mask.dtype != torch.bool else not bool(mask[0, 0, -1, 0])
                seen[i] = SLIDING if hidden else FULL

            layer.register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            model(torch.arange(12)[None])
        return tuple(seen[i] for i in range(4))

    # A config object, as built in Python, and the same keys as a config.json loaded from its
    # directory (AutoConfig.from_pretrained may pick another class: mistral -> ministral).
    # (Auto cannot load a config.json without model_type: there the object is the reference.)
    config = transformers.AutoConfig.for_model(**{"model_type": raw.get("model_type", "qwen2_moe"), **raw})
    want = want_json = measured(config)
    if "model_type" in raw:
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(raw, f)
            want_json = measured(transformers.AutoConfig.from_pretrained(directory))
    assert SLIDING in want and SLIDING in want_json
    if name == "mistral, layer_types":
        assert want == (SLIDING,) * 4 and want_json == (FULL, FULL, FULL, SLIDING)
    assert layer_types_from_config(config) == (want, 4)
    assert layer_types_from_config(raw) == (want_json, 4)
    assert HybridCache.from_config(raw, batch_size=1, max_length=16).layer_types == want_json
    # the object as its class reads it (review 82: its to_dict() went through config.json's rule)
    assert HybridCache.from_config(config, batch_size=1, max_length=16).layer_types == want


def test_a_config_built_by_hand_needs_a_window_for_its_sliding_layers():
    """Layers marked sliding with no window attended to every token, silently."""
    from jaxkv.models import LlamaConfig

    with pytest.raises(ValueError, match="marks layers as sliding but sliding_window is None"):
        LlamaConfig.tiny(sliding_layers=(True, False))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
            LlamaConfig.tiny(sliding_window=bad, sliding_layers=(True, False))
    assert LlamaConfig.tiny(sliding_window=4, sliding_layers=(True, False)).sliding_window == 4

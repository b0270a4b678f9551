"""Which layers of an HF decoder config use sliding-window attention: the one rule.

Used by :meth:`jaxkv.models.LlamaConfig.from_hf` (the model) and by
:meth:`jaxkv.HybridCache.from_config` (the cache), so a model and its cache always agree.
Pure Python: importing it needs neither flax nor jax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FULL", "SLIDING", "layer_types_from_config"]

FULL = "full_attention"
SLIDING = "sliding_attention"

# Model types whose configs say which layers slide with use_sliding_window/max_window_layers.
_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Model types whose sliding_window, when set, applies to every layer.
_ALL_SLIDING_TYPES = ("mistral", "ministral", "mixtral", "qwen3_moe")
# Model types whose attention reads config.sliding_window alone: a layer_types attribute of
# their config objects is ignored by transformers (MistralModel, MixtralModel, Qwen3MoeModel:
# one mask for all). A mistral config.json with a layer_types key is another model: see
# _config_json_type.
_IGNORE_LAYER_TYPES = ("mistral", "mixtral", "qwen3_moe")
# Model types whose attention has no window at all: transformers ignores sliding_window.
_NO_WINDOW_TYPES = ("llama",)
# What transformers' config classes assume for a key config.json leaves out (checked against
# transformers 5.24: Qwen2Config, Qwen3Config, Qwen2MoeConfig, MistralConfig). A present but
# null sliding_window still means no window.
_DEFAULTS = {
    "mistral": {"sliding_window": 4096},
    "ministral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen2_moe": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"sliding_window": 4096},
}
# The same for the attention's geometry (null: the Llama rule, num_key_value_heads =
# num_attention_heads, head_dim = hidden_size // num_attention_heads). Read by the models'
# configs and by HybridCache.from_config, so a model and its cache always agree.
_DEFAULT_KV_HEADS = {"mistral": 8, "ministral": 8, "qwen2": 32, "qwen3": 32}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_TYPE_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _model_type(cfg: Mapping[str, Any]) -> str:
    model_type = str(cfg.get("model_type") or "").lower()
    if not model_type:
        archs = cfg.get("architectures") or []
        model_type = next((_TYPE_OF_ARCHITECTURE[a] for a in archs if a in _TYPE_OF_ARCHITECTURE), "")
    return model_type


def _config_json_type(config: Any) -> str:
    """The model type transformers builds for ``config``: a config.json (a mapping) of
    model_type mistral with a ``layer_types`` key is loaded as Ministral by ``AutoConfig.
    from_pretrained`` (alternating full and sliding layers, Ministral-8B's layout), whose
    layers follow ``layer_types`` (review 75: jaxkv slid every layer, as MistralModel does
    for a MistralConfig object that carries the attribute, which it ignores)."""
    if isinstance(config, Mapping):
        model_type = _model_type(config)
        if model_type == "mistral" and "layer_types" in config:
            return "ministral"
        return model_type
    return _model_type(config.to_dict())


def attention_geometry(config: Any) -> tuple[int | None, int | None]:
    """``(num_kv_heads, head_dim)`` of an HF decoder config (dict or ``PretrainedConfig``) as
    transformers reads it: a key left out takes the config class's default (Mistral 8 kv
    heads, Qwen2/3 32, Qwen3 head_dim 128); None where the Llama rule applies (all heads,
    hidden_size // num_attention_heads)."""
    cfg = config if isinstance(config, Mapping) else config.to_dict()
    model_type = _config_json_type(config)
    kv_heads = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else _DEFAULT_KV_HEADS.get(model_type)
    head_dim = cfg["head_dim"] if "head_dim" in cfg else _DEFAULT_HEAD_DIM.get(model_type)
    return kv_heads, head_dim


def layer_types_from_config(config: Any) -> tuple[tuple[str, ...], int | None]:
    """Which layers slide, and the window, from an HF config (dict or ``PretrainedConfig``).

    Rules, in order (those of transformers' configs and attention modules):

    * Qwen2/Qwen3 (``model_type`` qwen2, qwen3 or their MoE variants): without
      ``use_sliding_window`` no layer slides, whatever ``layer_types`` says (transformers
      then sets the window to None). With it, ``layer_types`` if given, else layer ``i``
      slides iff ``i >= max_window_layers`` (qwen2, qwen3), iff ``i`` is even and
      ``i < max_window_layers`` (qwen2_moe, ``Qwen2MoeConfig``'s rule), every layer
      (qwen3_moe: its attention reads ``sliding_window`` alone).
    * ``layer_types`` given: used as is (each ``"full_attention"`` or
      ``"sliding_attention"``), with ``sliding_window`` as the window; except for Mistral,
      Mixtral and Qwen3-MoE, whose attention ignores it. A Mistral config.json (a mapping)
      with a ``layer_types`` key is Ministral, as ``AutoConfig.from_pretrained`` reads it:
      its ``layer_types`` applies.
    * Mistral/Ministral/Mixtral: every layer slides when ``sliding_window`` is set.
    * Llama: every layer is full (its attention has no window; transformers ignores a
      ``sliding_window`` key there).
    * Any config without ``sliding_window``: every layer is full.

    ``model_type`` comes from the config, or from its ``architectures`` when absent.

    Returns:
      ``(layer_types, sliding_window)``; ``sliding_window`` is None when no layer slides.

    Raises:
      ValueError: ``layer_types`` of the wrong length or with another kind of layer
        (e.g. linear attention); layers marked sliding without a window; a config of
        another model type that sets ``sliding_window`` without ``layer_types`` (its
        pattern is not known here: pass ``layer_types``).
    """
    cfg = config if isinstance(config, Mapping) else config.to_dict()
    num_layers = cfg.get("num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"layer_types_from_config: num_hidden_layers must be an int >= 1, got {num_layers!r}.")
    model_type = _config_json_type(config)
    cfg = {**_DEFAULTS.get(model_type, {}), **cfg}  # a key left out means the class default, as in transformers
    window = cfg.get("sliding_window")
    qwen = model_type in _QWEN_TYPES
    if (qwen and not cfg.get("use_sliding_window", False)) or model_type in _NO_WINDOW_TYPES:
        return (FULL,) * num_layers, None
    types = None if model_type in _IGNORE_LAYER_TYPES else cfg.get("layer_types")
    if types:
        types = tuple(types)
        if len(types) != num_layers:
            raise ValueError(
                f"layer_types_from_config: layer_types has {len(types)} entries, expected one per layer "
                f"({num_layers})."
            )
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise ValueError(
                f"layer_types_from_config: only {FULL!r} and {SLIDING!r} layers have a jaxkv cache, got {other}."
            )
    elif model_type in _ALL_SLIDING_TYPES or window is None:
        types = ((SLIDING if window is not None else FULL),) * num_layers
    elif qwen:
        if "max_window_layers" not in cfg:
            raise ValueError(
                f"layer_types_from_config: a {model_type} config with use_sliding_window but neither layer_types "
                "nor max_window_layers; which layers slide is not known. Pass layer_types."
            )
        last = cfg["max_window_layers"]
        if model_type == "qwen2_moe":  # the even layers below max_window_layers (Qwen2MoeConfig)
            types = tuple(SLIDING if i % 2 == 0 and i < last else FULL for i in range(num_layers))
        else:
            types = tuple(SLIDING if i >= last else FULL for i in range(num_layers))
    else:
        raise ValueError(
            f"layer_types_from_config: a {model_type or 'config'} with sliding_window={window} but no "
            "layer_types; which layers slide is not known for this model type. Pass layer_types."
        )
    if SLIDING not in types:
        return types, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"layer_types_from_config: layers are marked sliding but the sliding window is {window!r}.")
    return types, int(window)

"""Reference Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a jaxkv cache.

Read top to bottom: Config -> RMSNorm -> RoPE -> attention -> MLP -> block -> model.
The variants differ only in configuration:

* Llama: optional llama3 RoPE frequency scaling, optional attention / MLP biases.
* Mistral: sliding-window attention on every layer (when ``sliding_window`` is set).
* Qwen2: biases on the q/k/v projections; optional sliding window on upper layers.
* Qwen3: RMSNorm over each query and key head, an explicit ``head_dim``.

The model is an ``nnx.Module`` whose cache is an explicit argument and return value::

    model = Llama(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(batch_size=2, max_length=64)
    logits, cache = model(tokens, cache)                # prefill, tokens: int32 [B, T]
    logits, cache = model(next_tokens[:, None], cache)  # decode: the same code

Numerics follow HF transformers: norms and RoPE angles in float32, matmuls in the
parameter dtype, attention softmax in float32.

Shape letters: B batch, T new tokens, E hidden size, V vocabulary, F MLP width,
Hq query heads, H kv heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv._checks import check_token_ids
from jaxkv.caches import DynamicCache, KVCache, StaticCache, check_cache
from jaxkv.caches._checks import _check_sizes, _widen
from jaxkv.models.layer_types import FULL, SLIDING, attention_geometry, layer_types_from_config
from jaxkv.nnx import CacheSpec, KVAttention, init_cache, token_positions

__all__ = ["ARCHITECTURES", "Block", "Llama", "LlamaConfig", "RMSNorm", "apply_rope", "layer_plan", "rope_frequencies"]

#: HF ``architectures`` entries this file implements.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")

# --------------------------------------------------------------------------- config

_LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")

#: The HF ``model_type`` of each architecture. transformers' Auto classes build the model that
#: ``model_type`` names, so a config whose ``model_type`` names another one is refused.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
}
# transformers' config defaults for max_position_embeddings (what llama3 RoPE falls back to).
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 131072, "MinistralForCausalLM": 131072,
                          "Qwen2ForCausalLM": 32768, "Qwen3ForCausalLM": 32768}
# HF hidden_act names of the SiLU (transformers' ACT2FN maps both to it).
_SILU_NAMES = ("silu", "swish")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (hashable: it is static jit metadata).

    Attributes:
        vocab_size: V.
        hidden_size: E.
        intermediate_size: F, width of the SwiGLU MLP.
        num_layers: decoder blocks.
        num_heads: Hq.
        num_kv_heads: H; Hq must be a multiple.
        head_dim: D (Qwen3 sets it explicitly; otherwise E // Hq).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: None, or sorted ``(key, value)`` pairs of HF ``rope_parameters``
            for ``rope_type`` "linear" or "llama3".
        tie_word_embeddings: the output projection reuses the embedding matrix.
        qkv_bias: bias on q/k/v projections (Qwen2; Llama ``attention_bias``).
        out_bias: bias on the attention output projection (Llama ``attention_bias``).
        mlp_bias: bias on the MLP projections (Llama ``mlp_bias``).
        qk_norm: RMSNorm on each query/key head (Qwen3).
        sliding_window: window size for layers marked sliding, None if there are none.
        sliding_layers: per layer, whether it uses the sliding window.
        architecture: the HF architecture name this config came from.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_layers:
            object.__setattr__(self, "sliding_layers", (False,) * self.num_layers)
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"sliding_layers has {len(self.sliding_layers)} entries, expected one per layer ({self.num_layers})"
            )
        if any(self.sliding_layers) and self.sliding_window is None:
            raise ValueError(
                "sliding_layers marks layers as sliding but sliding_window is None; give the window "
                "(sliding_window=W) or mark no layer sliding"
            )
        if self.sliding_window is not None:
            _check_sizes("LlamaConfig", sliding_window=self.sliding_window)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> LlamaConfig:
        """Builds a config from an HF ``config.json`` dictionary.

        Accepts both the transformers 4 layout (``rope_theta`` and ``rope_scaling`` at the
        top level) and the transformers 5 layout (``rope_parameters``), resolved as
        transformers' own config resolves them: ``rope_scaling``, when given, replaces
        ``rope_parameters``; a ``rope_theta`` missing from that dict comes from the top level
        (10000 by default); llama3 scaling takes a top-level ``original_max_position_embeddings``
        over the dict's, and without either uses ``max_position_embeddings``. Keys the file
        leaves out take the defaults of the architecture's transformers config class (e.g.
        Qwen3 ``head_dim`` 128, Mistral ``num_key_value_heads`` 8), and bias flags count only
        for the models whose transformers implementation reads them.

        Args:
            hf: the parsed ``config.json``.
            source: the file name used in error messages.

        Raises:
            ValueError: an unsupported architecture, activation or RoPE type (or per-layer-type
                RoPE parameters, or a partial rotary factor), a ``model_type`` naming another
                model than the architecture, or a missing required key (the message names
                ``source`` and the key).
        """
        if not isinstance(hf, Mapping):  # a path gave "'str' object has no attribute 'get'" (review 84)
            raise TypeError(f"LlamaConfig.from_hf takes the config.json dictionary, got {type(hf).__name__}; "
                            "for a checkpoint directory use jaxkv.models.from_pretrained(path).")
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"jaxkv.models supports {', '.join(ARCHITECTURES)}"
            )

        model_type = hf.get("model_type")
        if model_type == "ministral" and arch == "MistralForCausalLM":
            # transformers re-saves a Mistral config.json with layer_types so (review 82), and
            # its Auto classes build Ministral from it: the same weights, layers per layer_types
            arch = "MinistralForCausalLM"
        if model_type and model_type != MODEL_TYPES[arch]:
            # transformers' AutoModel goes by model_type: it would build another model.
            raise ValueError(
                f"{source}: model_type {model_type!r} does not match architecture {arch!r} "
                f"(model_type {MODEL_TYPES[arch]!r}); transformers builds the model model_type names"
            )

        def need(key):
            if key not in hf or hf[key] is None:
                raise ValueError(f"{source}: missing required key {key!r} for {arch}")
            return hf[key]

        if hf.get("is_causal", True) is False:
            # transformers' masks then let every token see every other (an embedding model's
            # bidirectional use): there is no cached decoding of such a model.
            raise ValueError(
                f"{source}: is_causal is false: transformers runs this model bidirectionally (every token "
                "sees the later ones), which no key/value cache can decode; jaxkv loads causal models only"
            )
        if hf.get("hidden_act", "silu") not in _SILU_NAMES:
            raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported, expected 'silu'")
        num_heads = need("num_attention_heads")
        num_layers = need("num_hidden_layers")
        # As transformers' config does: a (legacy) rope_scaling replaces rope_parameters whole,
        # and rope_theta missing from the dict comes from the top level.
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        nested = sorted(k for k, v in rope.items() if isinstance(v, Mapping))
        if nested:
            # Per-layer-type RoPE (e.g. {"full_attention": {...}, "sliding_attention": {...}}):
            # no Llama-family model of transformers reads it (their rotary embedding raises).
            raise ValueError(
                f"{source}: per-layer-type rope parameters ({', '.join(map(repr, nested))}) are not supported; "
                "jaxkv expects one flat rope_parameters object"
            )
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(
                f"{source}: rope_type {rope_type!r} is not supported; jaxkv implements "
                "'default', 'linear' and 'llama3'"
            )
        # A top-level partial_rotary_factor joins the dict in transformers; its default RoPE
        # ignores it wherever it is (these models compute their default frequencies over the
        # whole head; a re-saved config moves the key into the dict: review 75), the scaled
        # ones rotate only that fraction of each head.
        partial = rope.get("partial_rotary_factor")
        if partial is None:
            partial = hf.get("partial_rotary_factor")
        if rope_type != "default" and partial is not None and partial != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor != 1.0 is not supported with rope_type {rope_type!r}")
        scaling = None
        if rope_type == "llama3":
            if hf.get("original_max_position_embeddings") is not None:
                # transformers (standardize_rope_params) gives a top-level value priority over the dict's
                rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            elif "original_max_position_embeddings" not in rope:
                # transformers' default: the context the config declares, else its class default
                context = hf.get("max_position_embeddings")
                rope["original_max_position_embeddings"] = _DEFAULT_MAX_POSITIONS.get(arch) if context is None else context
        if rope_type != "default":
            required = {"linear": ("factor",), "llama3": _LLAMA3_KEYS}[rope_type]
            missing = [k for k in required if rope.get(k) is None]
            if missing:
                raise ValueError(f"{source}: rope_type {rope_type!r} needs rope parameter(s) {missing}")
            scaling = tuple(sorted((k, rope[k]) for k in required)) + (("rope_type", rope_type),)

        try:
            # The architecture picked above decides the model type (model_type may be absent).
            types, sliding_window = layer_types_from_config({**hf, "model_type": "", "architectures": [arch]})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        sliding = tuple(t == SLIDING for t in types)

        # Which biases each transformers model has: Llama reads attention_bias (q/k/v/o) and
        # mlp_bias; Qwen3 attention_bias only; Qwen2 always has q/k/v biases and no others;
        # Mistral none. A key the model does not read is ignored, as transformers ignores it.
        attention_bias = bool(hf.get("attention_bias", False)) and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        mlp_bias = bool(hf.get("mlp_bias", False)) and arch == "LlamaForCausalLM"
        # what transformers' config classes assume for a key config.json leaves out (shared
        # with HybridCache.from_config); a null value means the Llama rule
        kv_heads, head_dim = attention_geometry({**hf, "model_type": MODEL_TYPES[arch]})
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=kv_heads or num_heads,
            head_dim=head_dim or need("hidden_size") // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            out_bias=attention_bias and not is_qwen2,
            mlp_bias=mlp_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            sliding_layers=sliding,
            architecture=arch,
        )

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A two-layer GQA preset for tests and examples (V=128, E=64, Hq=4, H=2, D=16)."""
        base = dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16,
        )
        return cls(**(base | overrides))

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(self.num_layers, self.num_kv_heads, self.head_dim)


# --------------------------------------------------------------------------- RMSNorm


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, normalised in float32.

    As in HF, the normalised activations are cast back to the input dtype before the
    weight multiplies them.
    """

    def __init__(self, dim: int, *, eps: float, param_dtype: Any = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


# --------------------------------------------------------------------------- RoPE


def rope_frequencies(head_dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] | None) -> np.ndarray:
    """Inverse frequencies [D/2] of rotary embeddings, with optional linear/llama3 scaling.

    llama3 scaling (Llama 3.1) keeps high frequencies (wavelength shorter than
    ``original_max_position_embeddings / high_freq_factor``), divides low frequencies
    (wavelength longer than ``... / low_freq_factor``) by ``factor``, and blends smoothly
    in between.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        return (inv_freq / params["factor"]).astype(np.float32)
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    return inv_freq


def apply_rope(
    x: jax.Array,  # [B, heads, T, D]
    positions: jax.Array,  # [B, T] int
    inv_freq: jax.Array,  # [D/2]
) -> jax.Array:  # [B, heads, T, D]
    """Rotates the two halves of each head by angle ``position * inv_freq`` (HF layout)."""
    angles = positions.astype(jnp.float32)[:, None, :, None] * inv_freq[None, None, None, :]  # [B, 1, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- blocks


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=config.mlp_bias, param_dtype=param_dtype, rngs=rngs)

        self.gate_proj = linear(config.hidden_size, config.intermediate_size)
        self.up_proj = linear(config.hidden_size, config.intermediate_size)
        self.down_proj = linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, E]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    A block holds weights only; which cache layer it writes and its attention window come
    with each call, so one block structure serves every layer: :class:`Llama` holds one
    block per layer, or one block whose weights are stacked along a leading [L] axis and
    runs it with ``lax.scan``.
    """

    def __init__(self, config: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs):
        def norm(dim):
            return RMSNorm(dim, eps=config.rms_norm_eps, param_dtype=param_dtype)

        self.input_layernorm = norm(config.hidden_size)
        self.self_attn = KVAttention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            qkv_bias=config.qkv_bias,
            out_bias=config.out_bias,
            q_norm=norm(config.head_dim) if config.qk_norm else None,
            k_norm=norm(config.head_dim) if config.qk_norm else None,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = norm(config.hidden_size)
        self.mlp = MLP(config, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cache, *, layer_idx, sliding_window, positions, num_new, rope):
        with jax.named_scope("attention"):
            h, cache = self.self_attn(
                self.input_layernorm(x), cache, positions=positions, num_new=num_new, rope=rope,
                layer_idx=layer_idx, sliding_window=sliding_window,
            )
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


def _check_cache_windows(cache: Any, config: LlamaConfig) -> None:
    """A cache layer that keeps only a window of tokens must serve a layer with that window.

    A ring storage (SlidingWindowCache, a HybridCache's sliding layers) drops every token
    older than its window; a full-attention layer reading it would attend to the window
    alone, and its outputs would drift from the model's once a row outgrows the window,
    with no error or flag. So a ring under a full layer is an error, as is a ring whose
    window is not the layer's. (A StaticCache under a sliding layer is fine: the window
    is applied as a mask.) Storage windows are static, so this holds under ``jax.jit``.
    """
    cache = getattr(cache, "self_attention", cache)  # an EncoderDecoderCache: its self part
    if not isinstance(cache, KVCache):
        return
    windows = tuple(config.sliding_window if s else None for s in config.sliding_layers)
    for i, (want, g) in enumerate(zip(windows, cache.groups)):
        ring = getattr(cache.stores[g], "window", None)
        if ring is None or ring == want:
            continue
        kind = type(cache).__name__
        if want is None:
            raise ValueError(
                f"Llama.__call__: layer {i} of this model attends to every token, but layer {i} of the "
                f"{kind} keeps only the last {ring} (a ring buffer); its outputs would silently differ "
                "from the model's once a row holds more tokens. Build the cache with "
                "model.init_cache(batch_size, max_length) (kind='hybrid' rings only the config's sliding layers)"
            )
        raise ValueError(
            f"Llama.__call__: layer {i} of this model has sliding_window={want}, but layer {i} of the {kind} "
            f"is a ring of window {ring}; build the cache with model.init_cache(batch_size, max_length, kind='hybrid')"
        )


def layer_plan(kinds: tuple[Any, ...]) -> tuple[tuple[int, int, int], ...]:
    """How :class:`Llama` runs its layers: ``(start, unit, repeats)`` segments.

    ``kinds[i]`` is whatever must be static about layer i (its sliding window, the cache
    storage it lives in); layers ``start .. start + unit * repeats`` repeat a unit of
    ``unit`` layers of equal kinds, and each segment is one ``lax.scan`` of ``repeats``
    steps over an unrolled unit, so what is compiled grows with the unit, not with the
    depth. A uniform model is one segment ``(0, 1, L)``; Gemma-like ``5 sliding + 1 full``
    patterns scan the 6-layer unit; Qwen2's ``max_window_layers`` (full layers, then sliding
    ones) gives one segment per run. Each segment covers the most layers it can (the
    shorter unit on a tie); a layer no unit repeats over is a segment with ``repeats == 1``.
    """
    plan, start, num_layers = [], 0, len(kinds)
    while start < num_layers:
        rest = kinds[start:]
        best_unit, best_repeats = 1, 1
        for unit in range(1, len(rest) // 2 + 1):
            repeats = 1
            while (repeats + 1) * unit <= len(rest) and rest[repeats * unit : (repeats + 1) * unit] == rest[:unit]:
                repeats += 1
            if repeats >= 2 and unit * repeats > best_unit * best_repeats:
                best_unit, best_repeats = unit, repeats
        plan.append((start, best_unit, best_repeats))
        start += best_unit * best_repeats
    return tuple(plan)


def _storage_caches(cache: KVCache) -> tuple[tuple[KVCache, ...], Any]:
    """One single-storage cache per storage of ``cache`` (each takes a traced layer index),
    and the function that puts them back together.

    A ``HybridCache`` keeps full and sliding layers in storages of different shapes, so its
    own layer index must be a Python int; its storages taken one at a time are ordinary
    one-storage caches (layer ``i`` of storage ``g`` is the i-th layer of that kind), which
    a scan can index with a traced layer number. They share the rows' flags: each part
    starts from the cache's, and the merge ORs what every part added. Only the small
    length and flag arrays are gathered and scattered; the storages pass through whole.
    """
    if len(cache.stores) == 1:
        return (cache,), lambda parts: parts[0]
    layers = [np.array([i for i, g in enumerate(cache.groups) if g == store]) for store in range(len(cache.stores))]
    parts = tuple(
        KVCache(stores=(store,), lengths=cache.lengths[idx], flags=cache.flags, groups=(0,) * len(idx),
                sharding=cache.sharding)
        for store, idx in zip(cache.stores, layers)
    )

    def merge(parts):
        lengths, flags = cache.lengths, cache.flags
        for part, idx in zip(parts, layers):
            lengths = lengths.at[idx].set(part.lengths)
            flags = flags | part.flags
        return dataclasses.replace(cache, stores=tuple(p.stores[0] for p in parts), lengths=lengths, flags=flags)

    return parts, merge


# --------------------------------------------------------------------------- model


class Llama(nnx.Module):
    """Llama-family causal LM over a jaxkv cache.

    Parameter names mirror the HF checkpoint (``embed_tokens``, ``layers...self_attn.q_proj``
    ...), with ``nnx.Linear`` kernels stored [in, out] (HF stores [out, in]). The decoder
    layers come in one of two layouts, chosen at construction (``scan_layers``):

    * stacked (``scan_layers=True``): ``layers`` is one :class:`Block` whose parameters have a
      leading [L] axis (HF's ``model.layers.{i}.self_attn.q_proj.weight`` is
      ``layers.self_attn.q_proj.kernel[i]``, transposed: [L, E, Hq * D]), run as
      ``lax.scan`` over the stacked weights, carrying the hidden states and the cache
      (never scanning the cache as ``xs``/``ys``, which would copy it). The compiled
      program holds one layer body however deep the model is (see :func:`layer_plan` for
      sliding-window patterns). A ``HybridCache`` keeps full and sliding layers in
      storages of different shapes and takes only Python layer indices: the scan carries
      its storages as separate one-storage caches, each indexed by a traced layer number,
      and scans the repeating (sliding, full) unit. A ``DynamicCache`` (shapes that grow
      per layer) is unrolled.
    * per layer (``scan_layers=False``): ``layers[i]`` is layer i's :class:`Block`, unrolled
      in the program. Compile time grows with depth; each weight is its own buffer.

    Why both: XLA:CPU copies a layer's weights out of the stacked arrays on every step of
    the scan (its dot cannot read a dynamic slice in place), which made a weight-bound CPU
    decode step 1.25-1.35x (the embedded model's shape) to 3x (420 MB of weights) slower than per-layer
    weights (``benchmarks/bench_compile.py``). On an H200 (jax 0.11.2) the scan was slower
    too: a Llama-3.2-1B-shaped bf16 decode step took 2.74 / 2.62 / 2.99 ms scanned against
    1.54 / 1.82 / 1.99 ms per layer (batch 1 at 128 and 1K tokens, batch 32 at 1K;
    ``benchmarks/bench_llama1b.py``). The extra ~1 ms is about what copying the layers'
    1.95 GB of weights out of the stacks once per step would cost (read and write at ~3.5
    TB/s): an inference from the arithmetic, not a profile. Its first ``generate`` call
    compiled in 6.6 s against 12.1 s. So the default is per-layer weights on the CPU and
    the GPU, and the scan elsewhere (TPU: not measured here); ``scan_layers=True`` trades
    the step time for a compile that does not grow with depth.

    Args:
        config: the :class:`LlamaConfig`.
        param_dtype: dtype of every parameter (and hence of the computation).
        rngs: initialisation randomness. Both layouts draw the same weights from one seed.
        scan_layers: the layout above; None: per layer when ``jax.default_backend()`` is
            the CPU or a GPU, stacked elsewhere. The parameter tree differs between the
            layouts: pass it explicitly when saved parameters must restore into a model
            built on another backend.
    """

    def __init__(
        self, config: LlamaConfig, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs, scan_layers: bool | None = None
    ):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, param_dtype=param_dtype, rngs=rngs)
        if scan_layers is None:
            scan_layers = jax.default_backend() not in ("cpu", "gpu")
        self.scan_layers = bool(scan_layers)
        # Built one by one in both layouts (the same random weights from the same seed).
        blocks = [Block(config, param_dtype=param_dtype, rngs=rngs) for _ in range(config.num_layers)]
        if self.scan_layers:
            stacked = jax.tree.map(lambda *w: jnp.stack(w), *(nnx.state(b) for b in blocks))
            self.layers = nnx.merge(nnx.graphdef(blocks[0]), stacked)
        else:
            self.layers = nnx.List(blocks)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        )

    @property
    def cache_spec(self) -> CacheSpec:
        return self.config.cache_spec

    @property
    def dtype(self) -> jnp.dtype:
        return self.embed_tokens.embedding[...].dtype

    def init_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        dtype: Any = None,
        kind: str = "static",
        bits: int | None = None,
        residual_length: int | None = None,
        extra_slots: int | None = None,
        sharding: Any = None,
        page_size: int | None = None,
        num_pages: int | None = None,
    ) -> Any:
        """An empty cache for this model; keys/values in the parameter dtype by default.

        Args:
            batch_size: B.
            max_length: capacity in tokens (prompt plus everything generated).
            dtype: storage dtype (quantized: the dtype of the dequantized keys/values).
            kind: ``"static"`` (a :class:`StaticCache`; sliding layers are masked),
                ``"hybrid"`` (full layers in a StaticCache, the config's sliding layers in
                ring buffers of ``sliding_window`` slots: memory O(window) for them), or
                ``"quantized"`` (int8 / int4 keys and values, see ``bits``), ``"paged"``
                (a :class:`~jaxkv.caches.PagedCache`: pages of ``page_size`` tokens from a
                pool of ``num_pages`` shared by the rows, forks share pages) or
                ``"paged-quantized"`` (the same with int8 / int4 pages, see ``bits``).
            bits: 8 (default) or 4, for ``kind="quantized"`` and ``"paged-quantized"``.
            residual_length: recent tokens kept in full precision, for ``kind="quantized"``
                (default 0). An option of another kind is a ValueError.
            extra_slots: ring slots beyond the window, for ``kind="hybrid"``: how many
                tokens a ``crop`` may roll back once a window is full (speculative decoding).
            sharding: optional ``NamedSharding`` of one layer's ``[B, H, S, D]`` (every kind).
            page_size, num_pages: for the paged kinds (default 16 tokens a page; pool: every row at
                ``max_length``).

        Raises:
            ValueError: an unknown kind, ``"hybrid"`` for a config without sliding layers, or
                an option of another kind (``kind="static", bits=4`` built a float cache,
                silently).
        """
        dtype = self.dtype if dtype is None else dtype
        spec = self.cache_spec
        given = {name: value for name, value in (("bits", bits), ("residual_length", residual_length),
                                                  ("extra_slots", extra_slots), ("page_size", page_size),
                                                  ("num_pages", num_pages)) if value is not None}
        takes = {"static": (), "hybrid": ("extra_slots",), "quantized": ("bits", "residual_length"),
                 "paged": ("page_size", "num_pages"), "paged-quantized": ("bits", "page_size", "num_pages")}
        if kind in takes and (foreign := sorted(set(given) - set(takes[kind]))):
            raise ValueError(
                f"Llama.init_cache: {', '.join(foreign)} do(es) not apply to kind={kind!r} (it takes "
                f"{', '.join(takes[kind]) or 'none of bits, residual_length, extra_slots, page_size, num_pages'}); "
                "pick the kind the option is for"
            )
        bits = 8 if bits is None else bits
        residual_length = 0 if residual_length is None else residual_length
        extra_slots = 0 if extra_slots is None else extra_slots
        page_size = 16 if page_size is None else page_size
        if kind == "static":
            return init_cache(spec, batch_size, max_length, dtype=dtype, sharding=sharding)
        if kind == "hybrid":
            from jaxkv.caches import HybridCache

            if self.config.sliding_window is None or not any(self.config.sliding_layers):
                raise ValueError(
                    "kind='hybrid' needs a config with sliding-window layers; this one has none "
                    "(use kind='static')"
                )
            return HybridCache.init(
                layer_types=[SLIDING if s else FULL for s in self.config.sliding_layers],
                batch_size=batch_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                max_length=max_length, window=self.config.sliding_window, extra_slots=extra_slots, dtype=dtype,
                sharding=sharding,
            )
        if kind == "quantized":
            from jaxkv.caches import QuantizedCache

            return QuantizedCache.init(
                num_layers=spec.num_layers, batch_size=batch_size, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, max_length=max_length, bits=bits, residual_length=residual_length,
                dtype=dtype, sharding=sharding,
            )
        if kind in ("paged", "paged-quantized"):
            from jaxkv.caches import PagedCache

            return PagedCache.init(
                num_layers=spec.num_layers, batch_size=batch_size, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, max_length=max_length, page_size=page_size, num_pages=num_pages,
                bits=bits if kind == "paged-quantized" else None, dtype=dtype, sharding=sharding,
            )
        raise ValueError(
            f"Llama.init_cache: kind must be 'static', 'hybrid', 'quantized', 'paged' or 'paged-quantized', got "
            f"{kind!r} (the cache_kind= of generate, sample_n, beam_search and the serving loops is this kind)"
        )

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int
        cache: Any = None,
        num_new: jax.Array | None = None,  # [B] int
        *,
        logits_at: jax.Array | None = None,  # [B] int
    ) -> tuple[jax.Array, Any]:
        """Runs T new tokens per row through the decoder, writing them into the cache.

        Prefill (T = prompt length) and decode (T = 1) are the same call. Row ``b``'s new
        tokens take positions ``cache.seq_lengths(0)[b] + t``.

        Token ids must lie in ``[0, V)``. Concrete ids are checked (``ValueError``). Under
        ``jax.jit`` they are traced and nothing can raise; instead a row with an
        out-of-range id (negative ones included) among its real (non-padding) tokens gets
        NaN logits at every position of this call, and the bad id embeds as NaN, so the
        key/value it leaves in the cache is NaN too. Other rows are unaffected, and no bad
        id is ever read as a valid token (no wrap-around, no clamp).

        Args:
            tokens: [B, T] token ids.
            cache: any jaxkv cache, or None for a full forward over ``tokens`` alone.
            num_new: [B] real tokens per row (ragged prompts without left padding: row b
                holds ``num_new[b]`` tokens followed by padding). Default: all T.
            logits_at: optional [B] index into the T tokens: return only that token's
                logits per row, ``[B, 1, V]``. A prefill needs just the last real token's;
                skipping the others saves a ``[B, T, V]`` product and its memory.

        Returns:
            ``(logits [B, T, V] (or [B, 1, V] with logits_at), new_cache)``. Logits at
            padding tokens are meaningless.

        Raises:
            ValueError: tokens not [B, T]; a cache shaped for another model; a cache with a
                ring (sliding-window) layer where the model's layer is full or has another
                window; a concrete
                (not traced) token id outside ``[0, V)``, padding included.
            TypeError: tokens that are not integers (float or bool ids). A nested list is
                taken, as ``generate`` takes one.
        """
        if not isinstance(tokens, (jax.Array, np.ndarray)):
            tokens = np.asarray(tokens)  # a nested list, as generate takes them
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape [batch, new_tokens], got {list(tokens.shape)}; add a batch axis")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"Llama.__call__: tokens must hold integer token ids, got dtype {tokens.dtype}; "
                            "pass jnp.asarray(ids, jnp.int32)")
        check_token_ids(tokens, self.config.vocab_size, "Llama.__call__", name="tokens")
        if cache is not None:
            check_cache(cache, "Llama.__call__")
            # Every kind states its geometry (a DynamicCache only what its seeded layers show).
            names = ("num_layers", "num_kv_heads", "head_dim", "batch_size")
            want = (self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, tokens.shape[0])
            got = tuple(getattr(cache, n, None) for n in names)
            if got[0] is None and len(cache):  # a DynamicCache: its layers are its length
                got = (len(cache),) + got[1:]
            if any(g is not None and g != w for g, w in zip(got, want)) or len(cache) not in (0, want[0]):
                raise ValueError(
                    f"cache has (layers, kv_heads, head_dim, batch) = {got}, the model needs {want}; "
                    "create it with model.init_cache(batch_size, max_length)"
                )
            _check_cache_windows(cache, self.config)
        batch, num_tokens = tokens.shape
        if num_new is not None and jnp.ndim(num_new) == 0:  # a scalar, as the caches and KVAttention take it
            num_new = jnp.broadcast_to(jnp.asarray(num_new), (batch,))
        positions = token_positions(cache, batch, num_tokens)

        # A NumPy constant: derived from the config, so it is no parameter and never loaded.
        inv_freq = jnp.asarray(rope_frequencies(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling))

        def rope(x):
            return apply_rope(x, positions, inv_freq)

        # Traced ids are unchecked. jnp.take (inside nnx.Embed) would wrap negative ids to
        # V - 1 ..; every bad id embeds as NaN instead, and its row's logits are NaN below.
        tokens = _widen(tokens)  # a uint8 id < 256 was out of a 256-token vocabulary (review 77)
        in_vocab = (tokens >= 0) & (tokens < self.config.vocab_size)  # [B, T]
        x = self.embed_tokens(tokens)
        x = jnp.where(in_vocab[..., None], x, jnp.asarray(jnp.nan, x.dtype))
        is_real = True if num_new is None else jnp.arange(num_tokens)[None, :] < jnp.asarray(num_new)[:, None]
        bad_row = jnp.any(~in_vocab & is_real, axis=1)  # [B]; padding is never stored, so it may hold anything
        flagged = getattr(cache, "self_attention", cache)  # the part an EncoderDecoderCache writes
        eager_scan = (self.scan_layers and isinstance(flagged, KVCache) and not isinstance(x, jax.core.Tracer)
                      and flagged.flags.is_fully_addressable)  # a global cache over processes: no host read
        before = np.asarray(flagged.flags) if eager_scan else None
        x, cache = self._run_layers(x, cache, positions=positions, num_new=num_new, rope=rope)
        if eager_scan:
            # Called eagerly, the unrolled layout's writes raise on overflow (or an empty page
            # pool); the scan traces every write, so they drop and flag instead. The same
            # error here, from the flags this call set (it returned wrong logits silently).
            after = getattr(cache, "self_attention", cache)
            new = np.asarray(after.flags) & ~before
            if new.any():
                dataclasses.replace(after, flags=jnp.asarray(new)).check()
        if logits_at is not None:
            at = jnp.asarray(logits_at)
            if not jnp.issubdtype(at.dtype, jnp.integer) or at.shape != (batch,):
                # a float index was truncated (1.7 read as 1), a scalar an IndexError (review 84)
                raise TypeError(f"Llama.__call__: logits_at must be an integer array of shape [{batch}] (one token "
                                f"index per row), got {at.dtype}{list(at.shape)}")
            if not isinstance(at, jax.core.Tracer) and at.size and not ((at >= 0) & (at < num_tokens)).all():
                raise ValueError(f"Llama.__call__: logits_at must index the {num_tokens} tokens, [0, {num_tokens}), "
                                 f"got {np.asarray(at).tolist()} (e.g. num_new - 1 of a row with no tokens)")
            # traced: an index outside [0, T) reads NaN (take_along_axis fills), -1 no longer wraps to the last
            at = _widen(at)  # an int8 -1 past 127 tokens: num_tokens wrapped (review 82)
            at = jnp.where(at < 0, num_tokens, at).astype(jnp.int32)
            x = jnp.take_along_axis(x, at[:, None, None], axis=1, mode="fill", fill_value=jnp.nan)  # [B, 1, E]
        x = self.norm(x)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(x)
        else:
            logits = self.lm_head(x)
        logits = jnp.where(bad_row[:, None, None], jnp.asarray(jnp.nan, logits.dtype), logits)
        return logits, cache

    def _run_layers(self, x, cache, *, positions, num_new, rope):
        """All decoder layers: a ``lax.scan`` per :func:`layer_plan` segment, or unrolled."""
        config = self.config
        windows = tuple(config.sliding_window if s else None for s in config.sliding_layers)
        if not self.scan_layers:
            for i, block in enumerate(self.layers):
                with jax.named_scope(f"layer_{i}"):
                    x, cache = block(
                        x, cache, layer_idx=i, sliding_window=windows[i], positions=positions, num_new=num_new,
                        rope=rope,
                    )
            return x, cache
        graphdef, weights = nnx.split(self.layers)

        def run(layer, window, x, cache, cache_layer):  # layer, cache_layer: Python ints or traced int32
            layer_weights = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, 0, False), weights)
            block = nnx.merge(graphdef, layer_weights)
            return block(
                x, cache, layer_idx=cache_layer, sliding_window=window, positions=positions, num_new=num_new, rope=rope
            )

        if not (cache is None or isinstance(cache, KVCache)):  # a DynamicCache: Python layer indices
            for i in range(config.num_layers):
                with jax.named_scope(f"layer_{i}"):
                    x, cache = run(i, windows[i], x, cache, i)
            return x, cache

        # Layer i writes layer local[i] of storage groups[i] (both static).
        groups = (0,) * config.num_layers if cache is None else cache.groups
        local = [groups[:i].count(groups[i]) for i in range(config.num_layers)]
        parts, merge = ((None,), lambda parts: None) if cache is None else _storage_caches(cache)

        def run_layer(layer, start, unit, step, carry):
            # Layer ``start + step * unit + j`` (j = layer - start, static); with step traced.
            x, parts = carry
            g = groups[layer]
            per_unit = groups[start : start + unit].count(g)
            x, part = run(start + step * unit + (layer - start), windows[layer], x, parts[g],
                          local[layer] + step * per_unit)
            return x, parts[:g] + (part,) + parts[g + 1:]

        carry = (x, parts)
        for start, unit, repeats in layer_plan(tuple(zip(windows, groups))):
            if repeats == 1:  # nothing repeats here: static indices, no loop
                for i in range(start, start + unit):
                    with jax.named_scope(f"layer_{i}"):
                        carry = run_layer(i, start, unit, 0, carry)
                continue

            def body(carry, step, start=start, unit=unit):
                for layer in range(start, start + unit):
                    carry = run_layer(layer, start, unit, step, carry)
                return carry, None

            with jax.named_scope(f"layers_{start}_{start + unit * repeats}"):
                carry, _ = jax.lax.scan(body, carry, jnp.arange(repeats, dtype=jnp.int32))
        x, parts = carry
        return x, merge(parts)

"""Loading HF-format checkpoints from a local directory.

A directory holds ``config.json``, the weights as ``model.safetensors`` or as shards listed
in ``model.safetensors.index.json``, and optionally ``tokenizer.json``. Nothing is
downloaded. Every failure names the file (and the tensor key where there is one).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.llama import ARCHITECTURES, Llama, LlamaConfig

__all__ = ["CheckpointError", "Pretrained", "from_pretrained", "hf_weight_names"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

# Tensors some checkpoints carry that the model recomputes instead of loading.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and key."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """What :func:`from_pretrained` returns.

    Attributes:
        model: the :class:`~jaxkv.models.llama.Llama` module with loaded weights.
        config: its :class:`~jaxkv.models.llama.LlamaConfig`.
        tokenizer: a ``tokenizers.Tokenizer`` if the directory has ``tokenizer.json``, else None.
        path: the directory it was loaded from.
    """

    model: Llama
    config: LlamaConfig
    tokenizer: Any
    path: str


def hf_weight_names(
    config: LlamaConfig, *, stacked: bool = True
) -> Iterator[tuple[str, tuple[Any, ...], int | None, bool]]:
    """The checkpoint tensors a config needs.

    Args:
        config: the model config.
        stacked: the model's layer layout (``Llama.scan_layers``): decoder-layer parameters
            stacked along a leading [L] axis, or one block per layer.

    Yields:
        ``(hf_key, model_path, layer, transpose)``: the safetensors key, the path of the
        matching parameter in ``nnx.state(model)``, for a decoder layer's tensor in the
        stacked layout its index along that parameter's leading [L] axis (else None), and
        whether the HF ``[out, in]`` matrix must be transposed into an ``nnx.Linear``
        kernel ``[in, out]``.
    """
    yield "model.embed_tokens.weight", ("embed_tokens", "embedding"), None, False
    yield "model.norm.weight", ("norm", "weight"), None, False
    if not config.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), None, True

    def linear(hf_prefix, path, layer, bias):
        yield f"{hf_prefix}.weight", path + ("kernel",), layer, True
        if bias:
            yield f"{hf_prefix}.bias", path + ("bias",), layer, False

    for layer in range(config.num_layers):
        hf = f"model.layers.{layer}"
        me, i = (("layers",), layer) if stacked else (("layers", layer), None)
        yield f"{hf}.input_layernorm.weight", me + ("input_layernorm", "weight"), i, False
        yield f"{hf}.post_attention_layernorm.weight", me + ("post_attention_layernorm", "weight"), i, False
        for name in ("q_proj", "k_proj", "v_proj"):
            yield from linear(f"{hf}.self_attn.{name}", me + ("self_attn", name), i, config.qkv_bias)
        yield from linear(f"{hf}.self_attn.o_proj", me + ("self_attn", "o_proj"), i, config.out_bias)
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield f"{hf}.self_attn.{name}.weight", me + ("self_attn", name, "weight"), i, False
        for name in ("gate_proj", "up_proj", "down_proj"):
            yield from linear(f"{hf}.mlp.{name}", me + ("mlp", name), i, config.mlp_bias)


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found; an HF checkpoint directory needs {what}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from e


# config.json keys the loader reads, by the JSON type each must have. Required keys that are
# absent are reported by ``LlamaConfig.from_hf``; these are checked wherever they are present.
_INT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "max_window_layers",
    "original_max_position_embeddings",
)
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "is_causal")
_ROPE_KEYS = ("rope_parameters", "rope_scaling")
_ROPE_NUMBER_KEYS = ("rope_theta", "factor", "high_freq_factor", "low_freq_factor",
                     "original_max_position_embeddings", "partial_rotary_factor")


def _json_type(value: Any) -> str:
    """How a parsed JSON value reads in an error message: its type, and scalars' values."""
    if isinstance(value, bool):
        return f"the boolean {json.dumps(value)}"
    if isinstance(value, str):
        return f"the string {json.dumps(value)}"
    if isinstance(value, int | float):
        return f"the number {json.dumps(value)}"
    return {dict: "an object", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_hf_config(hf: Any, source: str) -> None:
    """Checks the types and the head arithmetic of a parsed ``config.json``.

    ``LlamaConfig.from_hf`` trusts the JSON types (``bool("false")`` is True, ``"64" // 4``
    raises a bare TypeError); this turns each such problem into a :class:`CheckpointError`
    naming ``source`` and the key.

    Raises:
        CheckpointError: the file is not a JSON object, ``architectures`` is missing or not a
            list of names, a key has the wrong JSON type or a non-positive size, or the head
            counts do not divide.
    """
    if not isinstance(hf, dict):
        raise CheckpointError(f"{source}: expected a JSON object of config keys, got {_json_type(hf)}")

    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(f"{source}: key {key!r} must be {expected}, got {_json_type(hf[key])}")

    archs = hf.get("architectures")
    if not archs:
        model_type = hf.get("model_type")
        hint = f" (model_type is {model_type!r})" if model_type is not None else ""
        raise CheckpointError(
            f"{source}: key 'architectures' is missing or empty{hint}; add e.g. "
            f'"architectures": ["LlamaForCausalLM"] (jaxkv.models supports {", ".join(ARCHITECTURES)})'
        )
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise bad("architectures", "a list of architecture names")
    for key in _INT_KEYS:
        value = hf.get(key)
        if value is None:
            continue
        # max_window_layers 0 is meaningful (Qwen2: every layer slides); sizes must be >= 1.
        minimum = 0 if key == "max_window_layers" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise bad(key, "a positive integer" if minimum else "an integer >= 0")
    rope_dict = hf.get("rope_scaling") or hf.get("rope_parameters")
    for key in _NUMBER_KEYS:
        # null is no default: transformers refuses it (rope_theta null made float(None) fail),
        # unless the rope dict holds the value, which transformers then reads (review 75)
        if key == "rope_theta" and hf.get(key) is None and isinstance(rope_dict, dict) and "rope_theta" in rope_dict:
            continue
        if key in hf and not (_is_number(hf[key]) and 0 < hf[key] < math.inf):
            raise bad(key, "a positive finite number (leave the key out for the default)")
    if hf.get("use_sliding_window") and "max_window_layers" in hf and hf["max_window_layers"] is None:
        raise bad("max_window_layers", "an integer >= 0 when use_sliding_window is true")
    for key in _BOOL_KEYS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise bad(key, "true or false")
    if hf.get("hidden_act") is not None and not isinstance(hf["hidden_act"], str):
        raise bad("hidden_act", "a string")
    for key in _ROPE_KEYS:
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise bad(key, "an object")
        for name in _ROPE_NUMBER_KEYS:  # every one positive: a rope_theta of 0 gave NaN logits
            value = rope.get(name)
            if name in rope and not (_is_number(value) and 0 < value < math.inf):
                raise CheckpointError(
                    f"{source}: key '{key}.{name}' must be a positive finite number, got {_json_type(value)}"
                )
    layer_types = hf.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types)
    ):
        raise bad("layer_types", "a list of strings")
    layers = hf.get("num_hidden_layers")
    if layer_types and layers is not None and len(layer_types) != layers:
        raise CheckpointError(
            f"{source}: key 'layer_types' has {len(layer_types)} entries, expected one per layer "
            f"('num_hidden_layers' is {layers})"
        )

    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads")
    hidden = hf.get("hidden_size")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise CheckpointError(
            f"{source}: key 'num_attention_heads' ({heads}) must be a multiple of "
            f"'num_key_value_heads' ({kv_heads})"
        )
    # Qwen3's config class has a head_dim of its own (128) when the file leaves it out.
    head_dim_known = hf.get("head_dim") is not None or ("head_dim" not in hf and "Qwen3ForCausalLM" in archs)
    if heads is not None and hidden is not None and not head_dim_known and hidden % heads:
        raise CheckpointError(
            f"{source}: key 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads' ({heads}) "
            "and there is no 'head_dim' to say the size of a head"
        )


def _weight_files(directory: str, hf: dict, config_path: str) -> tuple[dict[str, str], str]:
    """Maps each tensor key to the safetensors file that holds it, and names the file (or
    index) the map came from.

    As in transformers' ``from_pretrained``: the file the config's ``transformers_weights``
    names (a ``.safetensors`` file or a ``.safetensors.index.json`` inside the directory)
    comes first, then ``model.safetensors``, then the index (a directory re-saved with other
    shard sizes may keep both).
    """
    single = os.path.join(directory, WEIGHTS_FILE)
    index = os.path.join(directory, INDEX_FILE)
    explicit = hf.get("transformers_weights")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise CheckpointError(
                f"{config_path}: key 'transformers_weights' must name a .safetensors file or a "
                f".safetensors.index.json index, got {_json_type(explicit)}"
            )
        named = os.path.join(directory, explicit)
        base = os.path.abspath(directory)
        if os.path.commonpath([base, os.path.abspath(named)]) != base:
            raise CheckpointError(
                f"{config_path}: key 'transformers_weights' must name a file inside the checkpoint directory, "
                f"got {explicit!r}"
            )
        if not os.path.isfile(named):
            raise CheckpointError(f"{named}: file not found (named by 'transformers_weights' in {config_path})")
        single, index = (None, named) if explicit.endswith(".index.json") else (named, None)
    if single is not None and os.path.isfile(single):
        from safetensors import safe_open

        with _open_safetensors(single, safe_open) as f:
            return {key: single for key in f.keys()}, single
    if index is not None and os.path.isfile(index):
        index_json = _read_json(index, "a weight index")
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor keys to shard files")
        return {key: os.path.join(directory, shard) for key, shard in weight_map.items()}, index
    raise CheckpointError(
        f"{directory}: no weights found; expected {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors are supported)"
    )


def _open_safetensors(path: str, safe_open):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found (listed in the weight index)")
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt files
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({e})") from e


def _lm_head_differs(files: dict[str, str]) -> bool:
    """Whether a checkpoint holds an ``lm_head.weight`` that is not its embedding matrix.

    transformers ties the two only where the checkpoint does not contradict it: with both
    tensors present and different it keeps them apart (and warns that the config is wrong).
    """
    from safetensors import safe_open

    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if head not in files or embed not in files:
        return False
    arrays = []
    for key in (head, embed):
        with _open_safetensors(files[key], safe_open) as f:
            try:
                arrays.append(f.get_tensor(key))
            except Exception as e:
                raise CheckpointError(f"{files[key]}: tensor {key!r} is corrupt ({e})") from e
    return arrays[0].shape != arrays[1].shape or not np.array_equal(arrays[0], arrays[1])


def _load_tensors(
    config: LlamaConfig, directory: str, dtype: jnp.dtype, model_shapes: dict[tuple[Any, ...], tuple[int, ...]],
    *, stacked: bool, files: dict[str, str], source: str,
) -> dict[tuple[Any, ...], jax.Array]:
    """Reads, checks and converts every tensor the model needs, one shard open at a time.

    ``source``: the weight file or index ``files`` came from (for messages)."""
    from safetensors import safe_open

    needed = {key: (path, layer, transpose) for key, path, layer, transpose in hf_weight_names(config, stacked=stacked)}
    stored = {key: key for key in needed}  # the checkpoint's name of each needed tensor
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if config.tie_word_embeddings and embed not in files and head in files:
        # transformers ties in either direction: a tied checkpoint may keep only the output projection
        stored[embed] = head
        files = {**files, embed: files[head]}
    missing = [key for key in needed if key not in files]
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f" needed by {config.architecture}"
        )
    unexpected = [
        key
        for key in files
        if key not in needed
        and not key.endswith(_IGNORED_SUFFIXES)
        and not (key == head and config.tie_word_embeddings)
    ]
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f"; the config describes a {config.architecture} that has no such weight"
        )

    # A stacked parameter gathers its layers in one host buffer, which goes to the device
    # as soon as its last layer is in; reading each file's keys parameter by parameter keeps
    # at most one such buffer on the host at a time (per shard file the parameter spans).
    layers_left = {}
    for path, layer, _ in needed.values():
        if layer is not None:
            layers_left[path] = layers_left.get(path, 0) + 1
    by_file: dict[str, list[str]] = {}
    for key in needed:
        by_file.setdefault(files[key], []).append(key)
    loaded, stacking = {}, {}
    for file, keys in by_file.items():
        keys.sort(key=lambda k: (needed[k][0], -1 if needed[k][1] is None else needed[k][1]))
        with _open_safetensors(file, safe_open) as f:
            for key in keys:
                path, layer, transpose = needed[key]
                expected = model_shapes[path] if layer is None else model_shapes[path][1:]
                hf_shape = tuple(expected[::-1]) if transpose else tuple(expected)
                try:
                    got = tuple(f.get_slice(stored[key]).get_shape())
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor {key!r} is listed but cannot be read ({e})") from e
                if got != hf_shape:
                    raise CheckpointError(
                        f"{file}: tensor {stored[key]!r} has shape {list(got)}, expected {list(hf_shape)} "
                        f"from {CONFIG_FILE}; the weights and the config do not belong together"
                    )
                try:
                    array = f.get_tensor(stored[key])
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor {stored[key]!r} is corrupt ({e})") from e
                if not np.issubdtype(array.dtype, np.floating) and array.dtype != jnp.bfloat16:
                    raise CheckpointError(f"{file}: tensor {key!r} has dtype {array.dtype}, expected a float")
                if layer is None:
                    # One host copy at most (dtype change and transpose together), then the
                    # device array; the host copy is freed before the next tensor is read.
                    loaded[path] = jax.device_put(np.ascontiguousarray(array.T if transpose else array, dtype=dtype))
                else:
                    if path not in stacking:
                        stacking[path] = np.empty(model_shapes[path], dtype)
                    stacking[path][layer] = array.T if transpose else array
                    layers_left[path] -= 1
                    if not layers_left[path]:
                        loaded[path] = jax.device_put(stacking.pop(path))
                del array
    return loaded


def _release_free_heap() -> None:
    """Returns the heap pages freed by loading (each tensor's host copy) to the OS.

    glibc keeps freed memory for reuse, so after a load the process holds a few MiB more
    than its weights until something else reuses them (measured: 24-25 -> 21 MiB of RSS growth
    for 19.5 MiB of float32 weights, ``benchmarks/bench_generate.py --memory-only``).
    ``malloc_trim`` hands them back; elsewhere (no glibc) this does nothing.
    """
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def from_pretrained(
    path: str | os.PathLike, *, dtype: Any = jnp.float32, scan_layers: bool | None = None
) -> Pretrained:
    """Loads an HF-format Llama / Mistral / Qwen2 / Qwen3 checkpoint from a local directory.

    Args:
        path: directory with ``config.json``, ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``) and optionally ``tokenizer.json``.
        dtype: parameter dtype, ``jnp.float32``, ``jnp.bfloat16`` or ``jnp.float16``; weights are converted.
        scan_layers: the model's layer layout (see :class:`~jaxkv.models.llama.Llama`):
            True stacks the per-layer tensors and scans them, False keeps one block per
            layer; None: one block per layer on the CPU and on a GPU (faster steps there,
            measured on an H200), stacked elsewhere (TPU).

    Returns:
        A :class:`Pretrained` with ``.model``, ``.config`` and ``.tokenizer``. As in
        transformers, a config with ``tie_word_embeddings`` whose checkpoint nevertheless holds
        an ``lm_head.weight`` different from the embedding keeps that output projection
        (``config.tie_word_embeddings`` is then False).

    Raises:
        CheckpointError (a ValueError): a missing directory or file, corrupt JSON or
            safetensors, a malformed ``config.json`` (not an object, no ``architectures``,
            a key of the wrong type, head counts that do not divide), an unsupported
            architecture or one its ``model_type`` contradicts, an unsupported RoPE variant,
            a missing, unexpected or mis-shaped tensor. The message names the
            file and the config key or tensor key.
        TypeError: ``dtype`` is not float32 / bfloat16 / float16.

    Example:
        >>> loaded = from_pretrained("/path/to/Qwen3-0.6B", dtype=jnp.bfloat16)  # doctest: +SKIP
        >>> ids = loaded.tokenizer.encode("Hello").ids                          # doctest: +SKIP
        >>> jaxkv.generate(loaded.model, jnp.array([ids]), 16)                   # doctest: +SKIP
    """
    directory = os.fspath(path)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:  # "auto", a torch dtype: NumPy's "data type not understood"
        raise TypeError(f"dtype must be jnp.float32, jnp.bfloat16 or jnp.float16, got {dtype!r}") from None
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"dtype must be jnp.float32, jnp.bfloat16 or jnp.float16, got {dtype}")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory; from_pretrained reads a local HF checkpoint directory")
    config_path = os.path.join(directory, CONFIG_FILE)
    hf_config = _read_json(config_path, "a model config")
    _check_hf_config(hf_config, config_path)
    try:
        config = LlamaConfig.from_hf(hf_config, source=config_path)
    except (TypeError, KeyError, ValueError) as e:
        message = str(e)
        raise CheckpointError(message if message.startswith(config_path) else f"{config_path}: {message}") from e
    files, source = _weight_files(directory, hf_config, config_path)
    if config.tie_word_embeddings and _lm_head_differs(files):
        # As transformers does: the checkpoint's own output projection, not the embedding.
        config = dataclasses.replace(config, tie_word_embeddings=False)

    # An abstract model (shapes only, nothing allocated or initialised) gives the parameter
    # tree; the checkpoint's tensors then fill it.
    abstract = nnx.eval_shape(lambda: Llama(config, param_dtype=dtype, rngs=nnx.Rngs(0), scan_layers=scan_layers))
    graphdef, state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(state)
    tensors = _load_tensors(
        config, directory, dtype, {p: var.get_value().shape for p, var in flat_state}, stacked=abstract.scan_layers,
        files=files, source=source,
    )
    flat = [(p, var.replace(tensors[p])) for p, var in flat_state]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    _release_free_heap()

    tokenizer = None
    tokenizer_path = os.path.join(directory, TOKENIZER_FILE)
    if os.path.isfile(tokenizer_path):
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(tokenizer_path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{tokenizer_path}: corrupt tokenizer file ({e})") from e
    return Pretrained(model=model, config=config, tokenizer=tokenizer, path=directory)

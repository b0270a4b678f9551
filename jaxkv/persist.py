"""Saving caches to disk and loading them back: whole caches, and one sequence's prompt state.

Whole caches (any kind, any pytree of arrays):

* :func:`save_cache` ``(path, cache)`` writes one safetensors file: every array leaf by its
  pytree path, plus a JSON header (key ``"jaxkv"``) with the format version, the kind, a
  description of the tree structure (node types and their static metadata: sizes, dtypes,
  layer layout) and, per leaf, its dtype, shape and CRC-32. Nothing in the format is
  specific to a kind: a new kind saves and loads as long as its static metadata are plain
  values (ints, strings, tuples, dtypes, a sharding).
* ``save_cache(path, cache, format="orbax")`` writes an Orbax checkpoint directory (the
  arrays through tensorstore, each process writing its own shards) with the same JSON
  description beside them. :func:`load_cache` restores it onto any mesh or device count:
  pass ``sharding=`` (the one-layer ``[B, H, S, D]`` ``NamedSharding`` that the kinds'
  ``init`` takes, over the new mesh) or ``like=`` (a cache, or ``jax.eval_shape`` of
  one, whose leaves carry the target shardings).
* :func:`load_cache` ``(path, like=None, sharding=None)`` reads either. With ``like`` the
  kind, the structure and every leaf's shape and dtype must match; otherwise the saved
  description rebuilds the cache by itself.

Per-sequence prompt state (llama.cpp's session files are the model):

* :func:`save_sequence` stores one row: only its filled part (every axis a storage names
  ``"seq"`` is cut to the row's length; rings keep their slots), its token ids, the cache
  dtype and a :func:`model_fingerprint` (hash of the model config and weights).
* :func:`load_sequence` writes it into a row of a cache of the same kind and layout, of any
  capacity and batch size, and returns ``(cache, k)``: the tokens restored, the common
  prefix of the stored ids and the prompt's (see its docstring).

Writes are atomic (a temporary file renamed into place), so a crash never leaves a
truncated file under the name; a truncated or corrupt file, a mismatched model, dtype, kind
or shape is a :class:`CacheFileError` naming the file and what differs.

Dependencies: jax and numpy; safetensors for files, orbax-checkpoint for directories, both
imported only when used (``pip install jaxkv[persist]``).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.caches._checks import INVALID, OUT_OF_PAGES
from jaxkv.caches.container import (
    KVCache,
    _fitted_spec,
    _tree_shardings,
    check_divisible,
    memory_place,
    place_sharding,
)
from jaxkv.caches.paged import NO_PAGE as _NO_PAGE

__all__ = [
    "FORMAT_VERSION",
    "CacheFileError",
    "PromptCacheStream",
    "load_cache",
    "load_sequence",
    "model_fingerprint",
    "save_cache",
    "save_sequence",
]

#: Version of the file layout; a file of another version is refused with a clear error.
#: 2: the header and the extra arrays (a sequence file's token ids) carry checksums too.
FORMAT_VERSION = 2
_HEADER_KEY = "jaxkv"
_CACHE, _SEQUENCE = "jaxkv.cache", "jaxkv.sequence"
_TOKEN_IDS = "__token_ids__"
# dtypes the safetensors numpy API writes as they are; any other (bfloat16, float8, int4)
# goes to the file as unsigned integers of its width and is viewed back on load.
_NATIVE = frozenset(
    np.dtype(t) for t in (bool, np.int8, np.uint8, np.int16, np.uint16, np.float16, np.int32, np.uint32,
                          np.float32, np.int64, np.uint64, np.float64)
)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CacheFileError(ValueError):
    """A cache file that cannot be used: missing, truncated, corrupt, another format version,
    or made for another model, dtype, kind or shape. The message starts with the path."""


# --------------------------------------------------------------------------- tree description


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_BUILTIN_NODES = {"builtins:tuple": tuple, "builtins:list": list, "builtins:dict": dict, "builtins:NoneType": type(None)}


def _resolve_type(name: str, where: str) -> type:
    """The class a description names. Only pytree node types of jaxkv or of modules already
    imported are resolved: a file never makes this process import anything else."""
    if name in _BUILTIN_NODES:
        return _BUILTIN_NODES[name]
    module, _, qualname = name.partition(":")
    if module not in sys.modules and not module.startswith("jaxkv."):
        raise CacheFileError(f"{where}: the file names type {name!r} from a module that is not imported; import it first.")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise CacheFileError(f"{where}: the file names type {name!r}, which this jaxkv does not define.") from None
    if not isinstance(obj, type):
        raise CacheFileError(f"{where}: {name!r} is not a class.")
    return obj


def _encode_static(value: Any, where: str) -> Any:
    """A JSON value for a piece of static metadata (tagged so that it decodes to an equal value)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode_static(v, where) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode_static(v, where) for v in value]}
    if isinstance(value, np.dtype):
        return {"dtype": value.name}
    if isinstance(value, type) and issubclass(value, np.generic):
        return {"scalar_type": np.dtype(value).name}
    if isinstance(value, NamedSharding):
        # Live devices cannot be stored; the layout is restored onto the mesh the loader gives.
        mesh = value.mesh
        return {"sharding": {"axis_names": list(mesh.axis_names), "mesh_shape": list(mesh.devices.shape),
                             "spec": [list(a) if isinstance(a, tuple) else a for a in value.spec]}}
    raise TypeError(
        f"save_cache: cannot describe the static metadata {value!r} (type {type(value).__name__}) of {where}; "
        "static fields must be ints, floats, strings, tuples, dtypes or a NamedSharding."
    )


def _describe_shardings(tree: Any) -> list:
    """The static shardings of the caches in ``tree``, for the record (a load chooses its own)."""
    found = [x.sharding for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache))
             if isinstance(x, KVCache) and x.sharding is not None]
    return [_encode_static(s, "sharding") for s in found]


def _decode_static(obj: Any) -> Any:
    if isinstance(obj, dict):
        (tag, value), = obj.items()
        if tag == "tuple":
            return tuple(_decode_static(v) for v in value)
        if tag == "list":
            return [_decode_static(v) for v in value]
        if tag == "dtype":
            return jnp.dtype(value)
        if tag == "scalar_type":
            return jnp.dtype(value).type
        if tag == "sharding":
            return None  # the loader supplies the new layout (sharding= or like=)
        raise ValueError(f"unknown static tag {tag!r}")
    return obj


def _describe(treedef: Any, where: str = "cache") -> Any:
    """A JSON description of a treedef: ``None`` for a leaf, else ``[type, static, children]``."""
    data = treedef.node_data()
    if data is None:
        return None
    cls, aux = data
    children = [_describe(c, f"{where} > {cls.__name__}") for c in treedef.children()]
    return [_type_name(cls), _encode_static(aux, f"{where} > {cls.__name__}"), children]


def _rebuild(desc: Any, where: str) -> Any:
    """The treedef a description names (static shardings become None)."""
    if desc is None:
        return jax.tree.structure(0)
    try:
        name, aux, children = desc
        cls = _resolve_type(name, where)
        node = (cls, _decode_static(aux))
        kids = [_rebuild(c, where) for c in children]
        return jax.tree_util.PyTreeDef.from_node_data_and_children(jax.tree_util.default_registry, node, kids)
    except CacheFileError:
        raise
    except (TypeError, ValueError) as err:
        raise CacheFileError(f"{where}: the file's tree description is malformed ({err}).") from None


def _strip_sharding(tree: Any) -> Any:
    """``tree`` with every cache's static sharding set to None (layouts may differ)."""
    def strip(x):
        return dataclasses.replace(x, sharding=None) if isinstance(x, KVCache) else x

    return jax.tree.map(strip, tree, is_leaf=lambda x: isinstance(x, KVCache))


def _difference(saved: Any, target: Any, path: str = "") -> str | None:
    """Where two tree descriptions first differ, in words (None if they agree)."""
    if saved is None or target is None:
        return None if saved is target else f"{path or 'the cache'}: one holds an array where the other holds a node"
    (s_type, s_aux, s_kids), (t_type, t_aux, t_kids) = saved, target
    here = path or "the cache"
    if s_type != t_type:
        return f"{here}: the file holds a {s_type.split(':')[-1]}, the target is a {t_type.split(':')[-1]}"
    if s_aux != t_aux:
        return (f"{here} ({s_type.split(':')[-1]}): static metadata differ: the file has "
                f"{_decode_static(s_aux)!r}, the target {_decode_static(t_aux)!r}")
    if len(s_kids) != len(t_kids):
        return f"{here}: the file has {len(s_kids)} children, the target {len(t_kids)}"
    for i, (s, t) in enumerate(zip(s_kids, t_kids)):
        found = _difference(s, t, f"{here}[{i}]")
        if found:
            return found
    return None


def _leaf_names(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _kind(tree: Any) -> str:
    return type(tree).__name__


# --------------------------------------------------------------------------- files


def _require(module: str, extra: str = "persist") -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"jaxkv.persist needs {module.split('.')[0]} for this: pip install 'jaxkv[{extra}]'"
        ) from None


def _host(x: Any, path: str) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CacheFileError(
            f"{path}: the cache spans several processes; save it with format='orbax' (each process writes its shards)."
        )
    return np.asarray(x)


def _saveable(names: list[str], leaves: list[Any], who: str) -> list[Any]:
    """The leaves as they are saved (a Python number as :func:`_as_array` makes it), each a
    concrete array of numbers or booleans, or a named error saying what to do."""
    for name, leaf in zip(names, leaves):
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                f"{who}: leaf {name} is traced (inside jit, vmap or scan); save the cache the jitted "
                "function returns, outside it."
            )
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(f"{who}: leaf {name} is abstract (jax.eval_shape) and holds no values; save a concrete cache.")
        if isinstance(leaf, int) and not isinstance(leaf, bool):
            held = jnp.iinfo(jnp.asarray(0).dtype)  # what JAX makes of a Python int: int32, int64 with x64
            if not held.min <= leaf <= held.max:
                raise TypeError(
                    f"{who}: leaf {name} is the Python int {leaf}, past the {held.dtype} JAX makes of it; save it "
                    "as np.int64(...) (it loads with jax_enable_x64), or as a float."
                )
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"{who}: leaf {name} is a typed PRNG key array ({dtype}); save jax.random.key_data(key) "
                "and rebuild the key with jax.random.wrap_key_data after loading."
            )
        if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
            raise TypeError(
                f"{who}: leaf {name} is a {type(leaf).__name__} of dtype {dtype}; a cache file holds "
                "arrays of numbers or booleans only (keep other values outside the saved tree)."
            )
    return [_as_array(x) for x in leaves]


def _as_array(x: Any) -> Any:
    """An array leaf as it is; a Python number (a step count) as the array JAX makes of it
    (int32 / float32 without x64), so both formats save it alike and it loads back, like= too."""
    return x if hasattr(x, "dtype") else np.asarray(jnp.asarray(x))


def _file_array(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a if a.dtype in _NATIVE else a.view(_UINT[a.dtype.itemsize])


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(a.reshape(-1).view(np.uint8)) if a.size else 0


def _addressable(x: Any) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _array_crc(x: Any) -> int:
    """The CRC-32 of an array's bytes as the file stores them (a host copy of it)."""
    return _crc(_file_array(np.asarray(x)))


def _leaf_meta(name: str, a: np.ndarray) -> dict:
    return {"name": name, "dtype": a.dtype.name, "shape": list(a.shape)}


def _atomic_target(path: str) -> tuple[str, str]:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CacheFileError(f"{path}: the directory {directory} does not exist.")
    if os.path.isdir(path):
        raise CacheFileError(f"{path}: is a directory; a safetensors cache file needs a file path (format='orbax' "
                             "writes a directory).")
    # the name cut short: a name the OS takes (up to 255 bytes) must leave room for mkstemp's
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)[:100]}.", suffix=".tmp", dir=directory)
    os.close(fd)
    return directory, tmp


def _write_safetensors(path: str, tree: Any, header: dict, extra: dict[str, np.ndarray] | None = None,
                       who: str = "save_cache") -> None:
    st = _require("safetensors.numpy")
    path = os.fspath(path)
    leaves = jax.tree.leaves(tree)
    names = _leaf_names(tree)
    leaves = _saveable(names, leaves, who)
    arrays, described = {}, []
    for name, leaf in zip(names, leaves):
        a = _host(leaf, path)
        stored = _file_array(a)
        arrays[name] = stored
        place = memory_place(leaf)  # an offloaded cache's host buffers go back to host memory
        described.append(_leaf_meta(name, a) | {"crc32": _crc(stored)} | ({"memory": list(place)} if place else {}))
    extras = []
    for name, a in (extra or {}).items():
        arrays[name] = stored = _file_array(a)
        extras.append(_leaf_meta(name, a) | {"crc32": _crc(stored)})
    header = {"format": header.pop("format"), "version": FORMAT_VERSION, "kind": _kind(tree),
              "tree": _describe(jax.tree.structure(_strip_sharding(tree)), path), "leaves": described,
              "extra": extras, "sharding": _describe_shardings(tree)} | header
    _, tmp = _atomic_target(path)
    try:
        st.save_file(arrays, tmp, metadata={_HEADER_KEY: json.dumps(_sealed(header))})
        # The temporary file is 0600 (mkstemp, and safetensors writes its own); the file gets
        # what open() would give: an existing file's mode (a private prompt cache stays
        # private), else 0666 less the umask (one shared between users stays readable by them).
        try:
            mode = os.stat(path).st_mode & 0o777
        except FileNotFoundError:
            umask = os.umask(0o022)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        _fsync(tmp)  # the bytes reach the disk before the name does: a crash leaves the old file or the new
        os.replace(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_HEADER_CRC = "header_crc32"


def _fsync(path: str) -> None:
    """Flushes a file's (or a directory's entries') data to the disk; a file system that
    cannot (some refuse it on directories) is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _header_crc(header: dict) -> int:
    body = {k: v for k, v in header.items() if k != _HEADER_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _sealed(header: dict) -> dict:
    """The header with a CRC-32 of itself: the tree, static fields, shapes and fingerprint it
    describes are checked like the arrays (a flipped digit would rebuild another cache)."""
    return header | {_HEADER_CRC: _header_crc(header)}


def _check_header(path: str, header: Any, expected: str) -> dict:
    if not isinstance(header, dict) or "format" not in header:
        raise CacheFileError(f"{path}: not a jaxkv file (no jaxkv header).")
    if header.get("version") == FORMAT_VERSION and header.get(_HEADER_CRC) != _header_crc(header):
        raise CacheFileError(f"{path}: the file's header fails its checksum; the file is corrupt. Save it again.")
    if header["format"] != expected:
        what = {_CACHE: "a whole cache (load_cache)", _SEQUENCE: "one sequence (load_sequence)"}
        raise CacheFileError(
            f"{path}: this file holds {what.get(header['format'], header['format'])}, not "
            f"{what.get(expected, expected)}."
        )
    if header.get("version") != FORMAT_VERSION:
        raise CacheFileError(
            f"{path}: format version {header.get('version')!r}; this jaxkv reads version {FORMAT_VERSION}."
        )
    return header


def _read_safetensors(path: str, expected: str) -> tuple[dict, list[np.ndarray], dict[str, np.ndarray]]:
    """``(header, leaves, extra arrays)`` of a jaxkv safetensors file, every checksum verified."""
    safetensors = _require("safetensors")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CacheFileError(f"{path}: no such file.")
    if os.path.isdir(path):
        raise CacheFileError(f"{path}: a directory; Orbax checkpoints are read by load_cache.")
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            raw = (f.metadata() or {}).get(_HEADER_KEY)
            names = set(f.keys())
            header = _check_header(path, json.loads(raw) if raw else None, expected)
            def checked(leaf: dict) -> np.ndarray:  # one described array, its checksum verified
                if leaf["name"] not in names:
                    raise CacheFileError(f"{path}: array {leaf['name']!r} is missing; the file is damaged.")
                stored = f.get_tensor(leaf["name"])
                if _crc(stored) != leaf["crc32"]:
                    raise CacheFileError(
                        f"{path}: array {leaf['name']!r} fails its checksum; the file is corrupt. Save it again."
                    )
                return stored.view(jnp.dtype(leaf["dtype"])).reshape(leaf["shape"])

            leaves = [checked(leaf) for leaf in header["leaves"]]
            extra = {leaf["name"]: checked(leaf) for leaf in header.get("extra", [])}
            unknown = sorted(names - {leaf["name"] for leaf in header["leaves"]} - set(extra))
            if unknown:
                raise CacheFileError(f"{path}: arrays {unknown} are not described by the header; the file is damaged.")
    except CacheFileError:
        raise
    except (safetensors.SafetensorError, json.JSONDecodeError, KeyError, TypeError, ValueError, OSError) as err:
        raise CacheFileError(f"{path}: truncated or corrupt cache file ({err}).") from None
    return header, leaves, extra


# --------------------------------------------------------------------------- shardings


def _target_shardings(abstract: Any, like: Any, sharding: Any, path: str) -> list[Any]:
    """Per leaf: where the loaded array goes (None: the default device)."""
    leaves = jax.tree.leaves(abstract)
    if like is not None:
        # A leaf of jax.eval_shape(cache) has no sharding (jax 0.10): a sharded cache's own
        # layout then says where it goes (it loaded onto one device, the static field
        # still naming the mesh; review 64).
        def targets_of(node):
            own = [getattr(x, "sharding", None) for x in jax.tree.leaves(node)]
            if not (isinstance(node, KVCache) and node.sharding is not None) or all(s is not None for s in own):
                return own
            spec = _fitted_spec(node.sharding, node._name, node.batch_size)
            derived = jax.tree.leaves(_tree_shardings(node, node.sharding.mesh, spec))
            return [d if o is None else o for o, d in zip(own, derived)]

        return [t for node in jax.tree.leaves(like, is_leaf=lambda x: isinstance(x, KVCache)) for t in targets_of(node)]
    if sharding is None:
        return [None] * len(leaves)
    if isinstance(sharding, NamedSharding):
        def place(node):
            if isinstance(node, KVCache):
                # rows that do not split: replicated
                spec = _fitted_spec(sharding, f"load_cache({path!r})", node.batch_size)
                if node.stores:  # kv heads and every other sharded axis must split evenly
                    check_divisible(node, spec, sharding, f"load_cache({path!r}): the saved {node._name}")
                return _tree_shardings(node, sharding.mesh, spec)
            return NamedSharding(sharding.mesh, P())  # anything else: replicated over the mesh

        return jax.tree.leaves(jax.tree.map(place, abstract, is_leaf=lambda x: isinstance(x, KVCache)))
    given = jax.tree.leaves(sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(given) != len(leaves):
        raise ValueError(
            f"load_cache({path!r}): sharding= must be a NamedSharding of one layer's [B, H, S, D] or one "
            f"Sharding per array ({len(leaves)}), got {len(given)}."
        )
    return given


def _with_static_sharding(tree: Any, sharding: Any) -> Any:
    if not isinstance(sharding, NamedSharding):
        return tree

    def put(x):
        return dataclasses.replace(x, sharding=sharding) if isinstance(x, KVCache) else x

    return jax.tree.map(put, tree, is_leaf=lambda x: isinstance(x, KVCache))


# --------------------------------------------------------------------------- whole caches


def save_cache(path: str | os.PathLike, cache: Any, *, format: str = "safetensors") -> None:  # noqa: A002
    """Saves a whole cache (any kind or pytree of arrays).

    Args:
      path: a file for ``"safetensors"`` (replaced atomically), a directory for ``"orbax"``
        (replaced atomically if it exists: the new one is written beside it, then swapped in).
      cache: the cache; concrete arrays (not inside ``jit``).
      format: ``"safetensors"`` (single host: the arrays are gathered to this host) or
        ``"orbax"`` (sharded arrays, every process writes its own shards; call it on every
        process).

    Raises:
      CacheFileError: the directory does not exist, or a multi-process cache saved as
        safetensors.
      TypeError: a static field that cannot be described (see the module docstring).
      ImportError: safetensors / orbax-checkpoint is not installed.

    Example:
      >>> save_cache("/tmp/cache.safetensors", cache)                       # doctest: +SKIP
      >>> same = load_cache("/tmp/cache.safetensors", like=cache)            # doctest: +SKIP
    """
    path = os.fspath(path)
    if format == "safetensors":
        _write_safetensors(path, cache, {"format": _CACHE})
    elif format == "orbax":
        _save_orbax(path, cache)
    else:
        raise ValueError(f"save_cache: format must be 'safetensors' or 'orbax', got {format!r}.")


def load_cache(path: str | os.PathLike, *, like: Any = None, sharding: Any = None) -> Any:
    """Loads a cache saved by :func:`save_cache` (a file: safetensors; a directory: Orbax).

    Args:
      path: what :func:`save_cache` wrote.
      like: optional target: a cache or ``jax.eval_shape`` of one. The file must hold the
        same kind and structure with every leaf of the same shape and dtype; the result
        takes ``like``'s static metadata and its leaves' shardings.
      sharding: optional layout when ``like`` is not given: a ``NamedSharding`` of one
        layer's ``[B, H, S, D]`` (as the kinds' ``init(sharding=)``; any mesh, any device
        count), or one ``jax.sharding.Sharding`` per array leaf. Default: the default device.

    Returns:
      The cache.

    Raises:
      CacheFileError: missing, truncated or corrupt file, another format version, or a
        mismatch with ``like`` (the message names the file and what differs).
    """
    path = os.fspath(path)
    if like is not None and sharding is not None:
        raise ValueError("load_cache: pass like= (whose leaves' shardings the result takes) or sharding=, not both; "
                         "sharding= was ignored next to like=")
    if os.path.isdir(path):
        header, read = _open_orbax(path)
    else:
        header, leaves, _ = _read_safetensors(path, _CACHE)
        read = None
    treedef = _rebuild(header["tree"], path)
    for i, m in enumerate(header["leaves"]):
        held = jax.dtypes.canonicalize_dtype(jnp.dtype(m["dtype"]))
        # JAX without x64 holds a 64-bit leaf in 32 bits: fine for values that fit (a step
        # count saved from a Python int), an error for values it would wrap or round
        # (silently, before; Orbax then called the good checkpoint corrupt)
        if held != jnp.dtype(m["dtype"]) and (read is not None or not _fits(leaves[i], held)):
            raise CacheFileError(
                f"{path}: array {m['name']!r} is {m['dtype']} in the file"
                + ("" if read is not None else f" with values {held.name} cannot hold")
                + f", and JAX holds 64-bit arrays only with jax_enable_x64 (without it: {held.name}); call "
                "jax.config.update('jax_enable_x64', True) before loading it."
            )
    shapes = [jax.ShapeDtypeStruct(tuple(m["shape"]), jnp.dtype(m["dtype"])) for m in header["leaves"]]
    if len(shapes) != treedef.num_leaves:
        raise CacheFileError(f"{path}: {len(shapes)} arrays for a structure of {treedef.num_leaves}; the file is damaged.")
    abstract = jax.tree.unflatten(treedef, shapes)
    wide = _wide_static_dtypes(abstract)
    if wide:
        # Its buffers would load as 32-bit ones under a cache whose static dtype still says
        # 64-bit: writes and reads then disagree (review 77, as for a pickle; review 82: a
        # cache inside another, a page pool's scale dtype).
        raise CacheFileError(
            f"{path}: the file holds a cache of {', '.join(wide)} (its static dtype), and JAX holds 64-bit arrays "
            "only with jax_enable_x64; call jax.config.update('jax_enable_x64', True) before loading it."
        )
    if like is not None:
        _check_like(path, header, abstract, like)
        treedef = jax.tree.structure(like)
    # (a leaf committed to another device than the default records ("device") too: not offloaded)
    if sharding is not None and like is None and any(m.get("memory", [0, "device"])[1] != "device"
                                                     for m in header["leaves"]):
        raise CacheFileError(
            f"{path}: holds an offloaded cache (buffers in host memory), which is never sharded; load it without "
            "sharding= (its buffers go back to host memory) or with like= an offloaded cache."
        )
    targets = _target_shardings(abstract, like, sharding, path)
    try:  # no layout asked for: leaves saved outside device memory (offloaded) go back there
        targets = [place_sharding(tuple(m["memory"]), path) if t is None and "memory" in m else t
                   for t, m in zip(targets, header["leaves"])]
    except ValueError as err:
        raise CacheFileError(f"{err} (or pass like= or sharding=)") from None
    if read is not None:
        leaves = read(shapes, targets)
        return _with_static_sharding(jax.tree.unflatten(treedef, leaves), None if like is not None else sharding)
    out = [jnp.asarray(a) if s is None else jax.device_put(a, s) for a, s in zip(leaves, targets)]
    return _with_static_sharding(jax.tree.unflatten(treedef, out), None if like is not None else sharding)


def _wide_static_dtypes(tree: Any) -> list[str]:
    """The 64-bit dtypes the caches in ``tree`` name as static metadata (storage ``dtype``,
    ``scale_dtype``) that this process holds in 32 bits (no x64)."""
    from jaxkv.caches import KVCache

    wide = set()
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache)):
        for store in getattr(node, "stores", ()) if isinstance(node, KVCache) else ():
            for name in ("dtype", "scale_dtype"):
                dtype = getattr(store, name, None)
                if dtype is not None and jax.dtypes.canonicalize_dtype(dtype) != jnp.dtype(dtype):
                    wide.add(jnp.dtype(dtype).name)
    return sorted(wide)


def _check_like(path: str, header: dict, abstract: Any, like: Any) -> None:
    target = jax.tree.structure(_strip_sharding(like))
    if _kind(like) != header["kind"]:
        raise CacheFileError(f"{path}: the file holds a {header['kind']}, like= is a {_kind(like)}.")
    saved_dtype, like_dtype = getattr(abstract, "dtype", None), getattr(like, "dtype", None)
    if saved_dtype is not None and like_dtype is not None and jnp.dtype(saved_dtype) != jnp.dtype(like_dtype):
        raise CacheFileError(f"{path}: the file holds a {jnp.dtype(saved_dtype)} cache, like= is {jnp.dtype(like_dtype)}.")
    differs = _difference(header["tree"], _describe(target))
    if differs:
        raise CacheFileError(f"{path}: the cache does not match like=: {differs}.")
    # A DynamicCache's [B, H, S, D] layers follow its length: only S may differ from like='s.
    grows = getattr(like, "SHAPES_GROW", False)

    def sizes(shape):
        return tuple(n for axis, n in enumerate(shape) if not (grows and len(shape) == 4 and axis == 2))

    for meta, leaf in zip(header["leaves"], jax.tree.leaves(like)):
        shape, dtype = tuple(meta["shape"]), jnp.dtype(meta["dtype"])
        leaf = _as_array(leaf)
        if dtype != leaf.dtype or sizes(shape) != sizes(tuple(leaf.shape)):
            raise CacheFileError(
                f"{path}: array {meta['name']} is {dtype.name}{list(shape)} in the file, like= has "
                f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}; build like= with the same sizes and dtype."
            )


# --------------------------------------------------------------------------- Orbax


def _save_orbax(path: str, cache: Any) -> None:
    ocp = _require("orbax.checkpoint")
    leaves = jax.tree.leaves(cache)
    names = _leaf_names(cache)
    leaves = _saveable(names, leaves, "save_cache")
    described = [_leaf_meta(n, np.empty((0,), x.dtype)) | {"shape": list(x.shape)}
                 | ({"memory": list(memory_place(x))} if memory_place(x) else {})
                 | ({"crc32": _array_crc(x)} if _addressable(x) else {}) for n, x in zip(names, leaves)]
    # Orbax refuses zero-size arrays (and a checkpoint of none); the description alone rebuilds them.
    stored = [x for x in leaves if x.size]
    header = {"format": _CACHE, "version": FORMAT_VERSION, "kind": _kind(cache),
              "tree": _describe(jax.tree.structure(_strip_sharding(cache)), path), "leaves": described,
              "sharding": _describe_shardings(cache)}
    items = {"jaxkv": ocp.args.JsonSave(_sealed(header))} | ({"state": ocp.args.StandardSave(stored)} if stored else {})
    args = ocp.args.Composite(**items)
    where = os.path.realpath(os.path.abspath(path))  # through a link: the checkpoint it names is replaced
    parent, base = os.path.split(where)
    if "[" in where or "]" in where:
        # Orbax reads the path as a glob pattern: the checkpoint it writes there never loads
        raise CacheFileError(f"{path}: Orbax cannot save under a path holding '[' or ']'; choose another name.")
    if not os.path.isdir(parent):
        raise CacheFileError(f"{path}: the directory {parent} does not exist.")
    if os.path.exists(where) and not os.path.isdir(where):
        raise CacheFileError(f"{path}: is a file; format='orbax' writes a directory.")
    # Orbax's force=True deletes the old checkpoint before it writes the new one: a failed
    # save would lose both. The new one is written beside it and swapped in after, under
    # names every process derives alike (the hash keeps long names that share a prefix apart).
    tag = hashlib.sha256(base.encode()).hexdigest()[:12]
    new, old = (os.path.join(parent, f".{base[:80]}.{tag}.jaxkv-{what}") for what in ("new", "old"))

    def swap():
        if os.path.lexists(where):
            os.rename(where, old)
        os.rename(new, where)
        try:
            _remove(old)
        except OSError:  # the save is done; a leftover is removed by the next one
            pass

    _on_primary(lambda: [_remove(p) for p in (new, old)], "clear the previous save's leftovers", path)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(new, args)
        _on_primary(swap, "move the new checkpoint into place", path)
    finally:
        if jax.process_index() == 0:
            for left in [new, *glob.glob(glob.escape(new) + ".orbax-checkpoint-tmp*")]:
                try:
                    _remove(left)
                except OSError:
                    pass
        _sync("jaxkv_orbax_save_done")


def _fits(a: np.ndarray, dtype: Any) -> bool:
    """Whether every value of ``a`` survives a cast to ``dtype`` unchanged (NaN as NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer here, not a warning
        cast = a.astype(dtype)
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating):
        return bool(np.array_equal(cast.astype(a.dtype), a, equal_nan=True))
    return bool(np.array_equal(cast.astype(a.dtype), a))


def _remove(path: str) -> None:
    """Removes a file, a link (not what it names) or a directory tree; nothing if absent."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _on_primary(step, what: str, path: str) -> None:
    """Runs ``step`` on process 0 and tells every process whether it worked, so that all of
    them raise together (one that raised alone left the others waiting at a barrier)."""
    error = None
    if jax.process_index() == 0:
        try:
            step()
        except OSError as err:
            error = err
    ok = error is None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = bool(multihost_utils.broadcast_one_to_all(np.asarray(ok)))
    if error is not None:
        raise error
    if not ok:
        raise CacheFileError(f"{path}: process 0 could not {what} (its error says why).")


def _sync(name: str) -> None:
    """A barrier across processes (nothing with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _open_orbax(path: str):
    ocp = _require("orbax.checkpoint")
    where = os.path.abspath(path)

    def failed(err):
        return CacheFileError(f"{path}: not a readable jaxkv Orbax checkpoint ({type(err).__name__}: {err}).")

    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            header = ckptr.restore(where, ocp.args.Composite(jaxkv=ocp.args.JsonRestore()))["jaxkv"]
    except Exception as err:  # orbax raises many types for a damaged directory
        raise failed(err) from None
    header = _check_header(path, header, _CACHE)

    def read(shapes, targets):
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        wanted = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=t or device) for s, t in zip(shapes, targets)]
        restore = [w for w in wanted if w.size]
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
                args = ocp.args.Composite(state=ocp.args.StandardRestore(restore))
                stored = iter(ckptr.restore(where, args)["state"] if restore else [])
        except Exception as err:
            raise failed(err) from None
        out = [next(stored) if w.size else jax.device_put(np.zeros(w.shape, w.dtype), w.sharding) for w in wanted]
        # Each leaf's checksum (written where the saving process held the whole array):
        # Orbax's own files carry none, so a flipped byte would load as another cache.
        for meta, x in zip(header["leaves"], out):
            if "crc32" in meta and _addressable(x) and _array_crc(x) != meta["crc32"]:
                raise CacheFileError(
                    f"{path}: array {meta['name']!r} fails its checksum; the checkpoint is corrupt. Save it again."
                )
        return out

    return header, read


# --------------------------------------------------------------------------- sequences


def model_fingerprint(model: Any, *, config: Any = None) -> str:
    """A hex digest of a model's config and weights: equal digests, same model.

    SHA-256 over the config's ``repr`` (``config`` or ``model.config``), then every array
    of the model's state (an ``nnx.Module``) or pytree, with its path, dtype and shape.
    Each parameter byte is read once (about 1.5 GB/s on one core); compute it once per
    loaded model and pass it to :func:`save_sequence` / :func:`load_sequence`.
    """
    digest = hashlib.sha256()
    cfg = config if config is not None else getattr(model, "config", None)
    digest.update(b"config\0" + repr(cfg).encode() + b"\0")
    nnx = sys.modules.get("flax.nnx")
    state = nnx.state(model) if nnx is not None and isinstance(model, nnx.Module) else model
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}:{a.dtype.name}:{list(a.shape)}\0".encode())
        digest.update(a.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def _seq_fields(store: Any) -> dict[str, int]:
    """Field -> its ``"seq"`` axis (the capacity axis a row fills from slot 0)."""
    return {f: axes.index("seq") for f, axes in type(store).LEAF_AXES.items() if "seq" in axes}


def _fit_axis(x: Any, axis: int, size: int, fill: int) -> Any:
    """``x`` cut to ``size`` along ``axis``, or padded there with ``fill`` (NumPy or jax)."""
    if x.shape[axis] >= size:
        return x[(slice(None),) * axis + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return (jnp if isinstance(x, jax.Array) else np).pad(x, pad, constant_values=fill)


def _resize_seq(cache: KVCache, size_of) -> KVCache:
    """Every ``"seq"`` axis cut (or zero-padded) to ``size_of(store)`` slots (NumPy or
    jax leaves alike)."""
    stores = []
    for store in cache.stores:
        size, changed = size_of(store), {}
        for field, axis in _seq_fields(store).items():
            changed[field] = _fit_axis(getattr(store, field), axis, size, 0)
        stores.append(dataclasses.replace(store, **changed))
    return dataclasses.replace(cache, stores=tuple(stores))


def _resize_blocks(one: KVCache, target: KVCache) -> KVCache:
    """A paged row's block table cut or padded (with ``NO_PAGE``) to the target's pages per
    row: another capacity. The row was cropped to at most the target's capacity, so the
    entries cut name no page it still needs."""
    stores = []
    for mine, theirs in zip(one.stores, target.stores):
        changed = {}
        for field, axes in type(mine).LEAF_AXES.items():
            if "blocks" not in axes:
                continue
            axis = axes.index("blocks")
            changed[field] = _fit_axis(getattr(mine, field), axis, getattr(theirs, field).shape[axis], _NO_PAGE)
        stores.append(dataclasses.replace(mine, **changed))
    return dataclasses.replace(one, stores=tuple(stores))


def _row_like(one: KVCache, target: KVCache) -> KVCache:
    """A saved row (NumPy leaves) with the target's capacity (``"seq"`` axes cut or padded),
    block-table width, and a page pool of at least the target's pages per row (zero pages
    added, held by no one): the same shapes whatever the saved token count."""
    sizes = iter([_seq_size(s) for s in target.stores])
    one = _resize_blocks(_resize_seq(one, lambda store: next(sizes)), target)
    stores = []
    for mine, theirs in zip(one.stores, target.stores):
        changed = {}
        blocks = {f: axes.index("blocks") for f, axes in type(theirs).LEAF_AXES.items() if "blocks" in axes}
        want = max((getattr(theirs, f).shape[a] for f, a in blocks.items()), default=0)
        for field, axes in type(mine).LEAF_AXES.items():
            x = getattr(mine, field)
            if "pages" in axes and x is not None and x.shape[axes.index("pages")] < want:
                changed[field] = _fit_axis(x, axes.index("pages"), want, 0)
        stores.append(dataclasses.replace(mine, **changed))
    return dataclasses.replace(one, stores=tuple(stores))


@jax.jit
def _select_row(cache: KVCache, row: jax.Array) -> KVCache:
    return cache.batch_select_indices(row[None])


@jax.jit
def _cut_row(one: KVCache, keep: jax.Array) -> tuple[KVCache, jax.Array]:
    """``one`` rolled back to ``keep`` tokens, and whether that lost needed tokens (a ring
    rolled back past what it still holds)."""
    one = dataclasses.replace(one, flags=jnp.zeros_like(one.flags)).crop(keep)
    return one, (one.flags[0] & INVALID) != 0


@jax.jit
def _empty_row(cache: KVCache, row: jax.Array) -> KVCache:
    return cache.reset(jnp.arange(cache.batch_size) == row)


@jax.jit
def _put_row(cache: KVCache, one: KVCache, row: jax.Array) -> KVCache:
    """``cache`` with row ``row`` emptied and replaced by ``one`` (one program: the target
    is copied once, then written in place)."""
    sizes = iter([_seq_size(s) for s in cache.stores])
    one = _resize_seq(one, lambda store: next(sizes))  # the target's capacity: cut or zero-padded
    one = _resize_blocks(one, cache)
    emptied = cache.reset(jnp.arange(cache.batch_size) == row)
    return emptied.put_rows(row[None], dataclasses.replace(one, sharding=cache.sharding))


def _check_kv_cache(cache: Any, who: str) -> KVCache:
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"{who}: needs a preallocated cache (StaticCache, SlidingWindowCache, QuantizedCache, HybridCache, "
            f"...), got {type(cache).__name__}; for a DynamicCache use StaticCache.from_dynamic first."
        )
    return cache


def _check_row(row: Any, batch: int, who: str) -> int:
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < batch:
        raise ValueError(f"{who}: row must be an int in [0, {batch}), got {row!r}.")
    return int(row)


def _token_array(token_ids: Any, who: str) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{who}: token_ids must be a 1-D sequence of integer ids, got {ids.dtype}{list(ids.shape)}.")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        bad = ids[(ids < 0) | (ids > np.iinfo(np.int32).max)][0]
        raise ValueError(f"{who}: token ids must be in [0, 2**31) (files store them as int32), got {int(bad)}.")
    return ids.astype(np.int64)


def save_sequence(
    path: str | os.PathLike, cache: KVCache, row: int, *, model_fingerprint: str, token_ids: Any
) -> None:
    """Saves one row's prompt state: its filled part of every layer, with the token ids.

    Args:
      path: the file (safetensors; replaced atomically).
      cache: a preallocated cache whose row ``row`` holds the same number of tokens in
        every layer (a prefilled prompt) and no error flag.
      row: the row.
      model_fingerprint: :func:`model_fingerprint` of the model that filled the cache.
      token_ids: int[n]: the ``n`` tokens the row holds, in order.

    Raises:
      ValueError: an empty row, layers of different lengths, flags set, ``token_ids``
        of another length than the row's, or ids outside [0, 2**31) (stored as int32).
      TypeError: not a preallocated cache, or ids that are not integers.
    """
    who = "save_sequence"
    path = os.fspath(path)
    cache = _check_kv_cache(cache, who)
    row = _check_row(row, cache.batch_size, who)
    lengths, flags = np.asarray(cache.lengths)[:, row], int(np.asarray(cache.flags)[row])
    if flags:
        raise ValueError(f"{who}: row {row} has error flags {flags} set (overflow or a bad index); its contents "
                         "are incomplete.")
    n = int(lengths[0])
    if (lengths != n).any():
        raise ValueError(f"{who}: row {row} holds {lengths.tolist()} tokens per layer; a prompt state needs every "
                         "layer at the same length.")
    if n == 0:
        raise ValueError(f"{who}: row {row} holds no tokens.")
    ids = _token_array(token_ids, who)
    if ids.shape[0] != n:
        raise ValueError(f"{who}: token_ids has {ids.shape[0]} ids, row {row} holds {n} tokens.")
    one = _strip_sharding(_select_row(cache, jnp.int32(row)))
    one = _resize_seq(jax.tree.map(lambda x: _host(x, path), one), lambda store: n)
    # A paged row: its own pages only, not the pool the rows share (other rows' tokens).
    one = dataclasses.replace(one, stores=tuple(
        s.one_row_filled(n) if hasattr(s, "one_row_filled") else s for s in one.stores
    ))
    header = {"format": _SEQUENCE, "model_fingerprint": str(model_fingerprint), "dtype": jnp.dtype(cache.dtype).name,
              "num_tokens": n}
    _write_safetensors(path, one, header, {_TOKEN_IDS: ids.astype(np.int32)}, who="save_sequence")


def load_sequence(
    path: str | os.PathLike,
    cache: KVCache,
    row: int,
    *,
    model_fingerprint: str,
    token_ids: Any,
    max_tokens: int | None = None,
    strict: bool = False,
) -> tuple[KVCache, int]:
    """Restores a row's prompt state saved by :func:`save_sequence`.

    The stored ids and ``token_ids`` (the prompt about to be processed) are compared token
    by token; ``k`` is the length of their common prefix, capped at the cache's capacity
    and at ``max_tokens``. A
    longer stored sequence serves the prompt up to ``k``; a shorter one serves as a prefix
    (prefill the prompt from token ``k`` on). If they differ after ``k`` tokens, the first
    ``k`` are used (``strict=True`` raises instead). Row ``row`` then holds exactly those
    ``k`` tokens (``k = 0``: it is emptied); the other rows are untouched. A ring whose
    rollback to ``k`` would need evicted tokens restores nothing (``k = 0``). A quantized
    cache with a residual of ``R`` exact tokens takes at most ``P - R`` tokens from a file
    that holds more than the prompt's ``P`` (the file's exact copies are of its own last
    ``R`` tokens), so that once the rest of the prompt is prefilled the row holds what a
    fresh prefill of the prompt would.

    Args:
      path: the file.
      cache: a cache of the same kind, dtype and layer layout as the saved one; any batch
        size and capacity (rings: the same window and slots).
      row: the row to write.
      model_fingerprint: the loading model's :func:`model_fingerprint`; must equal the file's.
      token_ids: int[P]: the prompt.
      max_tokens: optional cap on ``k`` (``P - 1`` keeps the last prompt token to be fed
        again, for the logits that pick the first new token).
      strict: raise if neither sequence is a prefix of the other.

    Returns:
      ``(cache, k)``.

    Raises:
      CacheFileError: missing, truncated or corrupt file; another model, dtype, kind or
        layout; with ``strict``, diverging token ids.
      ValueError: a paged cache whose pool has too few free pages for the ``k`` tokens
        (the cache passed in is unchanged); token ids outside [0, 2**31).
    """
    who = "load_sequence"
    path = os.fspath(path)
    cache = _check_kv_cache(cache, who)
    row = _check_row(row, cache.batch_size, who)
    ids = _token_array(token_ids, who)
    header, leaves, extra = _read_safetensors(path, _SEQUENCE)
    if header.get("model_fingerprint") != str(model_fingerprint):
        raise CacheFileError(
            f"{path}: saved for another model (fingerprint {str(header.get('model_fingerprint'))[:16]}..., this "
            f"model's is {str(model_fingerprint)[:16]}...): other weights or config. Delete the file or use another path."
        )
    if header["kind"] != _kind(cache):
        raise CacheFileError(f"{path}: holds a {header['kind']} row, the cache is a {_kind(cache)}.")
    if header["dtype"] != jnp.dtype(cache.dtype).name:
        raise CacheFileError(f"{path}: holds a {header['dtype']} cache row, the cache is {jnp.dtype(cache.dtype).name}.")
    target = _strip_sharding(cache)
    differs = _difference(header["tree"], _describe(jax.tree.structure(target)))
    if differs:
        raise CacheFileError(f"{path}: the row does not fit this cache's layout: {differs}.")
    stored_ids = extra.get(_TOKEN_IDS)
    if stored_ids is None or stored_ids.shape != (header["num_tokens"],):
        raise CacheFileError(f"{path}: the token ids are missing or damaged.")
    common = min(stored_ids.shape[0], ids.shape[0])
    mismatch = np.flatnonzero(stored_ids[:common] != ids[:common])
    k = int(mismatch[0]) if mismatch.size else common
    if strict and mismatch.size:
        raise CacheFileError(
            f"{path}: token {k} differs (the file has id {int(stored_ids[k])}, the prompt {int(ids[k])}); "
            f"only the first {k} tokens match."
        )
    for cap in (cache.get_max_length(), max_tokens):
        k = k if cap is None else max(min(k, int(cap)), 0)
    residual = max((getattr(store, "residual_length", 0) for store in cache.stores), default=0)
    if residual and ids.shape[0] < stored_ids.shape[0]:
        # A quantized cache keeps exact copies of the last R tokens written. A fresh prefill
        # of this P-token prompt holds positions [P - R, P) exactly; the file holds exact
        # copies of its last R (of n > P) only, so positions below P - R are all the row
        # may take from it: the prefill then writes the rest, exactly, as a fresh one would.
        k = min(k, max(ids.shape[0] - residual, 0))
    one = jax.tree.unflatten(jax.tree.structure(target), list(leaves))  # NumPy leaves
    _check_row_shapes(path, one, target)
    # Sized like the target on the host: the row's own capacity and pages (its token count)
    # were shapes of the jitted cut and put, a program of each per saved length (review 81).
    one = jax.tree.map(jnp.asarray, _row_like(one, target))
    if k:
        one, lost = _cut_row(one, jnp.int32(k))
        k = 0 if bool(lost) else k
    if k == 0:
        return _empty_row(cache, jnp.int32(row)), 0
    out = _put_row(cache, one, jnp.int32(row))
    # The put runs jitted, where a paged pool without room for the row's pages drops it and
    # flags the row instead of raising: reported here, never as k restored tokens.
    if int(np.asarray(out.flags)[row]) & OUT_OF_PAGES:
        free = getattr(cache, "free_pages", None)
        raise ValueError(
            f"{who}: the page pool has too few free pages for the {k} restored tokens of row {row}"
            + ("" if free is None else f" (free now: {int(free)})")
            + "; the cache is unchanged. Free rows first or allocate a larger num_pages."
        )
    return out, k


def _seq_size(store: Any) -> int | None:
    fields = _seq_fields(store)
    if not fields:
        return None
    field, axis = next(iter(fields.items()))
    return getattr(store, field).shape[axis]


def _check_row_shapes(path: str, one: KVCache, target: KVCache) -> None:
    """Leaves agree with the target's except the batch axis (1 row), the capacity (``"seq"``
    axes, a block table's ``"blocks"``) and a page pool's size (``"pages"``)."""
    free = ("batch", "seq", "blocks", "pages")
    for i, (mine, theirs) in enumerate(zip(one.stores, target.stores)):
        for field, axes in type(theirs).LEAF_AXES.items():
            a, b = getattr(mine, field), getattr(theirs, field)
            differ = a.ndim == b.ndim and [n for j, n in enumerate(axes) if n not in free and a.shape[j] != b.shape[j]]
            if a.ndim != b.ndim or differ:
                raise CacheFileError(
                    f"{path}: stores[{i}].{field} is {list(a.shape)} in the file (one row), the cache has "
                    f"{list(b.shape)} (axes {list(axes)}): {', '.join(differ) or 'the rank'} differ(s). Only the "
                    "batch, the capacity and a page pool's size may differ; load into a cache built like the saved one."
                )
    if one.lengths.shape[0] != target.lengths.shape[0]:
        raise CacheFileError(f"{path}: {one.lengths.shape[0]} layers in the file, {target.lengths.shape[0]} in the cache.")


# --------------------------------------------------------------------------- prompt cache for generation


class PromptCacheStream:
    """:func:`jaxkv.stream` for one prompt, with its prompt state kept in a file.

    If ``path`` holds a state for this model, dtype and a prefix of the prompt, the cache
    starts from it and only the rest of the prompt is prefilled (at least the last token,
    whose logits give the first new token). Otherwise, or when the file covers less of the
    prompt, the prompt's state is saved to ``path`` right after prefill. The
    tokens equal a fresh ``stream``'s (same sampling, same key).

    Attributes:
      restored: prompt tokens taken from the file.
      prompt_tokens: prompt length P.
      cache: the current cache (see :class:`jaxkv.generation.TokenStream`).

    Iterate it once (a second pass would need the file's state again: build a new one).

    Raises:
      CacheFileError: the file is corrupt, or made by another model or cache dtype (delete
        it or use another path); the directory does not exist or cannot be written.
    """

    def __init__(self, path: str | os.PathLike, model: Any, input_ids: Any, max_new_tokens: int, *,
                 fingerprint: str | None = None, **stream_kwargs: Any):
        from jaxkv.generation import bucket_length, init_model_cache, stream

        self.path = os.fspath(path)
        if not self.path or self.path.endswith(os.sep):
            raise CacheFileError(f"PromptCacheStream: the path must name a file, got {self.path!r}.")
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise ValueError(f"PromptCacheStream: input_ids must be one prompt [1, P], got shape {list(ids.shape)}.")
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise CacheFileError(f"{self.path}: the directory {directory} does not exist or is not writable.")
        self.prompt_tokens = n = ids.shape[1]
        self._ids = ids[0]
        self.fingerprint = fingerprint or model_fingerprint(model)
        cache = init_model_cache(
            model, 1, bucket_length(n) + max_new_tokens, stream_kwargs.get("cache_dtype"),
            stream_kwargs.get("cache_kind", "static"),
        )
        self.restored = 0
        if os.path.exists(self.path):
            # The last prompt token is fed again for its logits: a file holding P - 1 of them is complete.
            cache, self.restored = load_sequence(
                self.path, cache, 0, model_fingerprint=self.fingerprint, token_ids=self._ids, max_tokens=n - 1
            )
        self._save = self.restored < n - 1
        self._inner = stream(model, ids[:, self.restored:], max_new_tokens, **stream_kwargs)
        # Penalties count the whole prompt, the restored part too (padded to a bucket: one program per bucket).
        width = bucket_length(n)
        self._inner._history_prompt = (
            jnp.asarray(np.pad(ids.astype(np.int32), ((0, 0), (0, width - n)))), jnp.asarray([n], jnp.int32)
        )
        # The stream's first iteration prefills into the cache it holds: this one (the stream
        # allocates its own only when asked for it first: one cache in memory, not two).
        self._inner.cache = cache
        self._used = False

    @property
    def cache(self) -> Any:
        return self._inner.cache

    @property
    def done(self) -> np.ndarray:
        return self._inner.done

    def __iter__(self) -> Iterator[np.ndarray]:
        if self._used:
            raise RuntimeError("PromptCacheStream: iterate it once; build a new one to generate again.")
        self._used = True
        for step, tokens in enumerate(self._inner):
            if step == 0 and self._save:  # after prefill, before the next step donates the cache
                try:
                    save_sequence(self.path, self._inner.cache, 0, model_fingerprint=self.fingerprint,
                                  token_ids=self._ids)
                except OSError as err:  # a full disk, a name too long: the documented error, not a traceback
                    raise CacheFileError(f"{self.path}: the prompt cache could not be saved ({err}).") from None
            yield tokens

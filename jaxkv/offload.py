"""Host offload: a cache whose layers live in host memory, fetched a layer ahead of use.

:class:`OffloadedCache` is a :class:`~jaxkv.caches.KVCache` (the whole vocabulary: crop,
reorder, select, repeat, reset, put_rows, flags) whose keys/values ``[L, B, H, S, D]``
sit in host memory (the JAX memory kind ``"pinned_host"``), so the cache may be larger
than device memory. Device memory holds two layers at a time:

* ``staged``: the layer the next write reads, already copied to the device;
* the layer being attended to.

Inside the compiled step, ``write`` for layer ``i``:

1. writes the new tokens into the staged device copy of layer ``i`` and attends over it;
2. moves the new tokens (``[B, H, T, D]``, not the layer) to host memory and scatters them
   into the host copy there (``compute_on("device_host")``);
3. issues the copy of layer ``i + 1`` (mod L) to the device: it depends on nothing that
   layer ``i``'s attention computes, so on an accelerator the transfer overlaps with
   layer ``i``'s attention and MLP (double buffering). After the last layer, layer 0 is
   staged for the next step.

So a decode step copies the whole cache host -> device once (``L * 2 * B*H*S*D`` elements)
and ``L * 2 * B*H*T*D`` elements back; :func:`step_copy_bytes` gives the figures.

The staged copy is tied to an order: a forward pass writes layers 0, 1, ..., L-1, as every
decoder does (an unrolled loop or a ``lax.scan``). Eagerly, a write to another layer than
the staged one restages it first (correct, just not overlapped). Under ``jax.jit`` that
cannot be known at trace time: the host copy still receives the new tokens correctly, but
that call's attention read the wrong layer, so every row of it is flagged ``INVALID``
(``cache.check()`` raises) -- never silent.

Where the device has no ``pinned_host`` memory, :meth:`OffloadedCache.init` raises, or
with ``fallback=True`` warns and keeps the buffers in device memory (same code, no
transfers). jax 0.10.2 on CPU has ``pinned_host`` and ``unpinned_host``; there the host and
the device are the same RAM, so offload is tested for its semantics and memory kinds, and
timed for its overhead, not for capacity.

:func:`offload_model` wraps a decoder so that :func:`jaxkv.generate` and
:func:`jaxkv.stream` allocate an offloaded cache (flax is imported only then).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as _compute_on_module
from jax.tree_util import register_dataclass

from jaxkv.caches import INVALID, ContiguousView, KVCache
from jaxkv.caches._bits import from_bits, stored_dtype, to_bits
from jaxkv.caches._checks import _check_sizes, _flag, _floating_dtype, _is_traced, _static_int
from jaxkv.caches.container import storage_field
from jaxkv.caches.contiguous import scatter_slots, token_slots

Array = jax.Array

__all__ = ["HOST_MEMORY_KIND", "HostStorage", "OffloadedCache", "host_memory_kind", "offload_model", "step_copy_bytes"]

#: The memory kind the host copy lives in: page-locked, so an accelerator can DMA it.
HOST_MEMORY_KIND = "pinned_host"


def host_memory_kind(device: Any = None) -> str | None:
    """``"pinned_host"`` if ``device`` (default: the first device) can address it, else None."""
    device = jax.devices()[0] if device is None else device
    kinds = {m.kind for m in device.addressable_memories()}
    return HOST_MEMORY_KIND if HOST_MEMORY_KIND in kinds else None


def _tracing() -> bool:
    # Inside a jit trace every new array is a tracer, inputs or not.
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def _index(i: Any) -> Any:
    """A layer index as an operand: a concrete one as a NumPy scalar, which follows the
    other operands' device (``jnp.asarray`` would commit it to the default device)."""
    return i if isinstance(i, jax.core.Tracer) else np.int32(i)


def _to_host(x: Array, like: Any = None) -> Array:
    """``x`` in host memory; eagerly, with ``like`` (a host buffer), that buffer's device's
    (a cache made with ``device=`` lives on that device, whatever device ``x`` is on)."""
    sharding = getattr(like, "sharding", None)
    if sharding is not None and not isinstance(like, jax.core.Tracer) and not isinstance(x, jax.core.Tracer):
        return jax.device_put(x, sharding)
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: Array) -> Array:
    return jax.device_put(x, jax.memory.Space.Device)


def _on_host(f: Any) -> Any:
    """``f`` compiled to run on the host, its result left in host memory. JAX 0.10 spells it
    ``compute_on("device_host")`` (a context manager); later versions replaced that with the
    keyword form (``compute_on2`` in 0.10), which names where each output lives."""
    keyword_form = getattr(_compute_on_module, "compute_on2", None)
    if keyword_form is None:
        keyword_form = _compute_on_module.compute_on
    return keyword_form(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


@_on_host
@jax.jit
def _host_scatter(buffer: Array, layer: Array, states: Array, slot: Array) -> Array:
    # Runs on the host, where ``buffer`` lives: only the new tokens crossed the link.
    return scatter_slots(buffer, layer, states, slot)


@_on_host
@jax.jit
def _host_concat(*layers: Array) -> Array:
    return jnp.concatenate(layers, axis=0)


@_on_host
@jax.jit
def _host_put_rows(buffer: Array, rows: Array, part: Array) -> Array:
    return buffer.at[:, rows].set(part, mode="drop")


def _host_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> Array:
    if _tracing():
        return _to_host(jnp.zeros(shape, dtype))
    # Straight from host RAM: an eager zeros on the device would need the device memory
    # that offload is there to avoid.
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_MEMORY_KIND)
    return jax.device_put(np.zeros(shape, dtype), sharding)


def _device_zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> Array:
    """Zeros committed to ``device``, like the host buffers beside them: a leaf on another
    device is refused by JAX in an op with them, and an uncommitted leaf made a jitted step
    compile twice (its first output, committed, was a new input signature)."""
    if _tracing() or not isinstance(device, jax.Device):  # (a stand-in device of the tests)
        return jnp.zeros(shape, dtype)
    return jax.device_put(np.zeros(shape, dtype), device)


@dataclasses.dataclass(frozen=True)
class HostStorage:
    """Keys/values of every layer in host memory plus one staged layer on the device.

    Attributes:
      keys: [L, B, H, S, D] key buffer in ``pinned_host`` memory, as stored (a 16-bit float
        as its uint16 bits, see :mod:`jaxkv.caches._bits`).
      values: [L, B, H, S, D] value buffer, likewise.
      staged_keys: [1, B, H, S, D] device copy of layer ``staged_layer``.
      staged_values: [1, B, H, S, D] likewise.
      staged_layer: int32[1, B] the layer each row's staged copy holds (all rows agree
        unless ``put_rows`` brought rows staged elsewhere).
      dtype: static, the float dtype held.
      offloaded: static; False when the buffers stayed on the device (``fallback``).
    """

    keys: Array
    values: Array
    staged_keys: Array
    staged_values: Array
    staged_layer: Array
    dtype: Any  # static
    offloaded: bool = True  # static

    LEAF_AXES: ClassVar[dict] = {
        "keys": ("layer", "batch", "heads", "seq", "dim"),
        "values": ("layer", "batch", "heads", "seq", "dim"),
        "staged_keys": ("stage", "batch", "heads", "seq", "dim"),
        "staged_values": ("stage", "batch", "heads", "seq", "dim"),
        "staged_layer": ("stage", "batch"),
    }

    @classmethod
    def zeros(cls, num_layers, batch_size, num_kv_heads, head_dim, max_length, dtype, *, offloaded, device):
        shape = (num_layers, batch_size, num_kv_heads, max_length, head_dim)
        stored = stored_dtype(dtype)
        if offloaded:
            keys, values = _host_zeros(shape, stored, device), _host_zeros(shape, stored, device)
        else:
            keys, values = _device_zeros(shape, stored, device), _device_zeros(shape, stored, device)
        staged = (1,) + shape[1:]
        return cls(
            keys, values, _device_zeros(staged, stored, device), _device_zeros(staged, stored, device),
            _device_zeros((1, batch_size), jnp.int32, device), jnp.dtype(dtype), offloaded,
        )

    num_layers = property(lambda self: self.keys.shape[0])
    num_kv_heads = property(lambda self: self.keys.shape[2])
    capacity = property(lambda self: self.keys.shape[3])
    head_dim = property(lambda self: self.keys.shape[4])

    def fetch(self, buffer: Array, layer: Any) -> Array:
        """[1, B, H, S, D] device copy of one layer of a host buffer."""
        try:
            one = jax.lax.dynamic_slice_in_dim(buffer, _index(layer), 1, axis=0)
        except ValueError as err:  # under jax.vmap the slice becomes a gather JAX refuses on host memory
            if "memory_space" not in str(err):
                raise
            raise ValueError(
                "OffloadedCache cannot run under jax.vmap: its layers are sliced out of host-memory buffers, "
                "which JAX does not batch (it refuses the gather a vmapped slice becomes). vmap a StaticCache, "
                "or give the offloaded cache the batch as its rows (batch_size=...)."
            ) from err
        return _to_device(one) if self.offloaded else one

    def write(self, read_layer, write_layer, layer_ok, keys, values, old, count):
        del layer_ok  # a bad layer writes at `write_layer` == L: dropped
        slot = token_slots(old, count, keys.shape[2], self.capacity)  # [B, T]
        key_bits, value_bits = to_bits(keys, self.dtype), to_bits(values, self.dtype)
        # 1. the staged device copy takes the new tokens; attention reads it.
        current_keys = scatter_slots(self.staged_keys, 0, key_bits, slot)
        current_values = scatter_slots(self.staged_values, 0, value_bits, slot)
        # 2. the host copy takes the same tokens.
        host_keys = self._write_back(self.keys, write_layer, key_bits, slot)
        host_values = self._write_back(self.values, write_layer, value_bits, slot)
        # 3. the next layer's copy, independent of this layer's attention: it overlaps it.
        nxt = (jnp.asarray(read_layer, jnp.int32) + 1) % self.num_layers
        new = dataclasses.replace(
            self, keys=host_keys, values=host_values,
            staged_keys=self.fetch(host_keys, nxt), staged_values=self.fetch(host_values, nxt),
            staged_layer=jnp.full_like(self.staged_layer, nxt),
        )
        lengths = jnp.minimum(old + count, self.capacity)
        return new, ContiguousView(current_keys, current_values, 0, lengths, self.dtype)

    def _write_back(self, buffer: Array, layer: Any, states: Array, slot: Array) -> Array:
        if not self.offloaded:
            return scatter_slots(buffer, layer, states, slot)
        # Only the tokens are moved explicitly; XLA places the small index operands.
        # The result is put in host memory explicitly: left to placement propagation it lands
        # in device memory for some argument placements (e.g. a cache restored by Orbax).
        return _to_host(_host_scatter(buffer, _index(layer), _to_host(states, buffer), slot))

    def staged_at(self, layer: Any) -> HostStorage:
        """This storage with ``layer`` copied to the device (a synchronous restage)."""
        return dataclasses.replace(
            self, staged_keys=self.fetch(self.keys, layer), staged_values=self.fetch(self.values, layer),
            staged_layer=jnp.full_like(self.staged_layer, jnp.asarray(layer, jnp.int32)),
        )

    def view(self, layer: Any, lengths: Array) -> ContiguousView:
        return ContiguousView(self.fetch(self.keys, layer), self.fetch(self.values, layer), 0, lengths, self.dtype)

    def crop(self, old: Array, new: Array, **_: Any):
        return self, jnp.zeros(new.shape, bool)

    def map_rows(self, fn) -> HostStorage:
        """A row gather or repeat, ``fn(leaf, batch_axis)``, on every leaf.

        JAX refuses a gather whose operand is in host memory, so the host buffers go one
        layer at a time through the device (device memory holds one layer of the result).
        """

        def rows_of(buffer):
            if not self.offloaded:
                return fn(buffer, 1)
            return _host_concat(*[_to_host(fn(self.fetch(buffer, i), 1)) for i in range(self.num_layers)])

        return dataclasses.replace(
            self, keys=rows_of(self.keys), values=rows_of(self.values), staged_keys=fn(self.staged_keys, 1),
            staged_values=fn(self.staged_values, 1), staged_layer=fn(self.staged_layer, 1),
        )

    def put_rows(self, rows: Array, other: HostStorage) -> tuple[HostStorage, Array]:
        """Rows ``rows`` (int[N]) replaced by ``other``'s N rows (a scatter, on the host)."""

        def put(mine, theirs, on_host):
            if on_host and self.offloaded:
                return _host_put_rows(mine, rows, theirs)
            return mine.at[:, rows].set(theirs, mode="drop")

        new = dataclasses.replace(
            self,
            keys=put(self.keys, other.keys, True),
            values=put(self.values, other.values, True),
            staged_keys=put(self.staged_keys, other.staged_keys, False),
            staged_values=put(self.staged_values, other.staged_values, False),
            staged_layer=put(self.staged_layer, other.staged_layer, False),
        )
        return new, jnp.ones(rows.shape, bool)

    def reset_rows(self, rows: Array) -> HostStorage:
        return self


register_dataclass(
    HostStorage,
    data_fields=["keys", "values", "staged_keys", "staged_values", "staged_layer"],
    meta_fields=["dtype", "offloaded"],
)


class OffloadedCache(KVCache):
    """A static (preallocated) cache kept in host memory, one layer staged on the device.

    Same semantics, overflow policy and operations as :class:`~jaxkv.StaticCache`; the
    module docstring says how a write moves data.

    Example:
      >>> cache = OffloadedCache.init(num_layers=2, batch_size=1, num_kv_heads=1,
      ...                             head_dim=4, max_length=16)
      >>> cache.keys.sharding.memory_kind, cache.staged_keys.sharding.memory_kind
      ('pinned_host', 'device')
    """

    EAGER_PROGRAMS = False  # host-memory storages: their ops stay op by op

    @classmethod
    def init(
        cls,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: Any = jnp.float32,
        device: Any = None,
        fallback: bool = False,
    ) -> OffloadedCache:
        """Allocates an empty cache in host memory (created there, never on the device).

        Args:
          num_layers, batch_size, num_kv_heads, head_dim, max_length: sizes (ints >= 1).
          dtype: a floating storage dtype.
          device: the device whose host memory holds the cache; default the first device.
          fallback: where the device has no ``pinned_host`` memory, warn and keep the
            buffers on the device instead of raising.

        Raises:
          ValueError: a size < 1, or no ``pinned_host`` memory and ``fallback`` false.
          TypeError: a non-floating dtype.
        """
        who = "OffloadedCache.init"
        _check_sizes(
            who, num_layers=num_layers, batch_size=batch_size, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_length=max_length,
        )
        dtype = _floating_dtype(dtype, who)
        device = jax.devices()[0] if device is None else device
        offloaded = host_memory_kind(device) is not None
        if not offloaded:
            kinds = sorted(m.kind for m in device.addressable_memories())
            message = (
                f"{who}: device {device} has no {HOST_MEMORY_KIND!r} memory (it has {kinds}), so the cache "
                "cannot live in host memory"
            )
            if not fallback:
                raise ValueError(message + "; pass fallback=True to keep it in device memory instead.")
            warnings.warn(message + "; keeping it in device memory (fallback=True).", stacklevel=2)
        cache = cls._allocate(
            lambda: [HostStorage.zeros(num_layers, batch_size, num_kv_heads, head_dim, max_length, dtype,
                                       offloaded=offloaded, device=device)],
            num_layers=num_layers, batch_size=batch_size, groups=(0,) * num_layers, sharding=None,
        )
        # Lengths and flags on the same device as the buffers (see _device_zeros).
        return dataclasses.replace(
            cache, lengths=_device_zeros(cache.lengths.shape, jnp.int32, device),
            flags=_device_zeros(cache.flags.shape, jnp.int32, device),
        )

    def write(self, key_states: Any, value_states: Any, layer_idx: Any, *, num_new: Any = None):
        """:meth:`KVCache.write`, reading the staged device copy (see the module docstring)."""
        store = self.stores[0]
        layer = _static_int(layer_idx)
        cache = self
        if layer is not None and not _is_traced(store.staged_layer) and 0 <= layer < self.num_layers:
            if (np.asarray(store.staged_layer) != layer).any():
                cache = dataclasses.replace(self, stores=(store.staged_at(layer),))
            return KVCache.write(cache, key_states, value_states, layer_idx, num_new=num_new)
        out, view = KVCache.write(cache, key_states, value_states, layer_idx, num_new=num_new)
        misstaged = store.staged_layer[0] != jnp.asarray(layer_idx, jnp.int32)  # [B]
        return dataclasses.replace(out, flags=out.flags | _flag(misstaged, INVALID)), view

    keys = storage_field("keys", "[L, B, H, S, D] key buffer in host memory.", dtype_of="dtype")
    values = storage_field("values", "[L, B, H, S, D] value buffer in host memory.", dtype_of="dtype")
    staged_keys = storage_field("staged_keys", "[1, B, H, S, D] the staged layer's keys, on the device.",
                                dtype_of="dtype")
    max_length = storage_field("capacity", "The capacity S.")

    def get_max_length(self) -> int:
        return self.max_length


def step_copy_bytes(cache: OffloadedCache, num_tokens: int = 1) -> dict[str, int]:
    """Bytes one forward pass of ``num_tokens`` tokens per row moves between host and device.

    Returns:
      ``{"to_device": ..., "to_host": ...}``: every layer's keys and values fetched once,
      and the new tokens' keys/values written back (index arrays not counted). Both are 0
      for a cache that stayed in device memory (``fallback=True``): nothing is moved.

    Raises:
      TypeError: not an :class:`OffloadedCache`, or ``num_tokens`` not an int.
      ValueError: ``num_tokens`` < 0.
    """
    if not isinstance(cache, OffloadedCache):
        raise TypeError(f"step_copy_bytes: expected an OffloadedCache, got {type(cache).__name__}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
        raise TypeError(f"step_copy_bytes: num_tokens must be an int, got {num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"step_copy_bytes: num_tokens must be >= 0, got {num_tokens}")
    store = cache.stores[0]
    if not store.offloaded:
        return {"to_device": 0, "to_host": 0}
    num_layers, batch, heads, capacity, head_dim = store.keys.shape
    item = store.keys.dtype.itemsize
    return {
        "to_device": 2 * num_layers * batch * heads * capacity * head_dim * item,
        "to_host": 2 * num_layers * batch * heads * num_tokens * head_dim * item,
    }


@functools.lru_cache(maxsize=1)
def _offloaded_model_class():
    from flax import nnx

    class OffloadedModel(nnx.Module):
        """A decoder whose ``init_cache`` returns an :class:`OffloadedCache`."""

        def __init__(self, model: nnx.Module, fallback: bool):
            self.model = model
            self.fallback = fallback

        @property
        def config(self):
            return self.model.config

        @property
        def cache_spec(self):
            return self.model.cache_spec

        def init_cache(self, batch_size: int, max_length: int, *, dtype: Any = None, kind: str = "offloaded",
                       **unused: Any) -> OffloadedCache:
            if kind not in ("static", "offloaded"):
                raise ValueError(f"an offloaded model allocates kind 'offloaded' (or 'static'), got {kind!r}")
            options = sorted(k for k, v in unused.items() if v is not None and k != "sharding")
            if options:  # dropped, they gave a plain float cache silently (review 84)
                raise ValueError(
                    f"an offloaded model's cache is a float cache in host memory: {', '.join(options)} "
                    "(another kind's options) cannot apply; offload the plain model for those kinds"
                )
            if unused.get("sharding") is not None:  # would be dropped: a silently unsharded cache
                raise ValueError(
                    "an offloaded model's cache lives in one device's host memory and cannot be sharded; "
                    "got sharding=" + repr(unused["sharding"])
                )
            spec = self.model.cache_spec
            return OffloadedCache.init(
                num_layers=spec.num_layers, batch_size=batch_size, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, max_length=max_length,
                dtype=self.model.dtype if dtype is None else dtype, fallback=self.fallback,
            )

        def __call__(self, *args: Any, **kwargs: Any):
            return self.model(*args, **kwargs)

    return OffloadedModel


def offload_model(model: Any, *, fallback: bool = False) -> Any:
    """Wraps ``model`` (e.g. :class:`jaxkv.models.Llama`) so its caches live in host memory.

    ``jaxkv.generate(offload_model(model), ids, n)`` gives the tokens ``generate(model, ...)``
    gives, with the cache offloaded. The wrapper shares the model's parameters.

    Args:
      model: an ``nnx.Module`` decoder with ``cache_spec``, ``dtype`` and the model call.
      fallback: see :meth:`OffloadedCache.init`.
    """
    return _offloaded_model_class()(model, fallback)

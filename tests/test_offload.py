"""Host offload: an OffloadedCache behaves as a StaticCache, with its layers in host memory.

On CPU the host and the device share RAM: these tests check the semantics and that every
buffer is in the memory kind the module claims, not a capacity gain.
"""

import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import INVALID, StaticCache
from jaxkv.generation import decode_step
from jaxkv.models import Llama, LlamaConfig
from jaxkv.offload import OffloadedCache, host_memory_kind, offload_model, step_copy_bytes

SIZES = dict(num_layers=2, batch_size=2, num_kv_heads=2, head_dim=4, max_length=8)


def _states(seed, batch=2, tokens=3):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, 2, tokens, 4)), jnp.float32)


def _pass(cache, keys, values, num_new=None):
    """One forward pass' writes, layers in order; returns the cache and each layer's view."""
    seen = []
    for layer in range(cache.num_layers):
        cache, k, v = cache.update(keys * (layer + 1), values - layer, layer, num_new=num_new)
        seen.append((k, v))
    return cache, seen


def _assert_memory_kinds(cache):
    assert cache.stores[0].keys.sharding.memory_kind == "pinned_host"
    assert cache.stores[0].values.sharding.memory_kind == "pinned_host"
    assert cache.stores[0].staged_keys.sharding.memory_kind == "device"
    assert cache.stores[0].staged_values.sharding.memory_kind == "device"


def test_cpu_has_pinned_host_memory():
    assert host_memory_kind() == "pinned_host"
    _assert_memory_kinds(OffloadedCache.init(**SIZES))


@pytest.mark.parametrize("how", ["pickle", "safetensors", "orbax"])
def test_saved_and_restored_cache_is_still_offloaded(how, tmp_path):
    """pickle and load_cache (no like=) put the host buffers back in host memory: in device
    memory the cache would no longer be offloaded though its static fields say it is."""
    import chex

    cache = _pass(OffloadedCache.init(**SIZES), _states(0), _states(1), num_new=jnp.array([3, 1]))[0]
    if how == "pickle":
        back = pickle.loads(pickle.dumps(cache))
    else:
        path = tmp_path / ("c.safetensors" if how == "safetensors" else "c")
        jaxkv.save_cache(path, cache, format=how)
        back = jaxkv.load_cache(path)
    _assert_memory_kinds(back)
    chex.assert_trees_all_equal(back, cache)
    after, _ = _pass(back, _states(2, tokens=1), _states(3, tokens=1))  # and writes stay on the host
    _assert_memory_kinds(after)


def test_writes_and_row_ops_equal_a_static_cache_eager_and_jitted():
    num_new = jnp.array([3, 2], jnp.int32)
    offloaded, seen_o = _pass(OffloadedCache.init(**SIZES), _states(0), _states(1), num_new)
    static, seen_s = _pass(StaticCache.init(**SIZES), _states(0), _states(1), num_new)
    for (ko, vo), (ks, vs) in zip(seen_o, seen_s):
        np.testing.assert_array_equal(ko, ks)
        np.testing.assert_array_equal(vo, vs)
    _assert_memory_kinds(offloaded)

    one = _states(2, tokens=1)

    def ops(cache):
        out = {
            "reorder": cache.reorder_cache(jnp.array([1, 0])),
            "repeat": cache.batch_repeat_interleave(2),
            "put": cache.put_rows(jnp.array([0]), cache.batch_select_indices(jnp.array([1]))),
        }
        # The next forward pass after each op reads the staged layer: it must be right too.
        def states(c):
            return jnp.broadcast_to(one[:1], (c.batch_size, 2, 1, 4))

        return {name: _pass(c, states(c), states(c) + 1) for name, c in out.items()}

    got, want = jax.jit(ops, donate_argnums=0)(offloaded), jax.jit(ops)(static)
    for name in want:
        (c_o, seen_o), (c_s, seen_s) = got[name], want[name]
        _assert_memory_kinds(c_o)
        np.testing.assert_array_equal(c_o.keys, c_s.keys, err_msg=name)
        np.testing.assert_array_equal(c_o.values, c_s.values, err_msg=name)
        np.testing.assert_array_equal(c_o.lengths, c_s.lengths, err_msg=name)
        np.testing.assert_array_equal(c_o.flags, 0, err_msg=name)
        for (ko, vo), (ks, vs) in zip(seen_o, seen_s):
            np.testing.assert_array_equal(ko, ks, err_msg=name)
            np.testing.assert_array_equal(vo, vs, err_msg=name)


def test_out_of_order_write_restages_eagerly_and_is_flagged_under_jit():
    k = _states(3)
    cache, _ = _pass(OffloadedCache.init(**SIZES), k, k)  # layer 0 staged for the next pass
    static, _ = _pass(StaticCache.init(**SIZES), k, k)
    one = _states(4, tokens=1)
    # Eagerly: layer 1 first is restaged and correct.
    eager, ke, _ = cache.update(one, one, 1)
    _, ks, _ = static.update(one, one, 1)
    np.testing.assert_array_equal(ke, ks)
    assert not eager.flags.any()
    # Under jit the order is not known at trace time: the host copy is still right, the rows
    # are flagged INVALID (check() raises), never silently wrong.
    jitted = jax.jit(lambda c: c.update(one, one, 1)[0])(cache)
    np.testing.assert_array_equal(jitted.flags, INVALID)
    np.testing.assert_array_equal(jitted.keys, eager.keys)
    with pytest.raises(jaxkv.CacheError):
        jitted.check()


def test_no_pinned_host_raises_or_falls_back_with_a_warning():
    class DeviceMemoryOnly:
        def addressable_memories(self):
            return [jax.devices()[0].default_memory()]

        def __str__(self):
            return "fake:0"

    assert host_memory_kind(DeviceMemoryOnly()) is None
    with pytest.raises(ValueError, match="has no 'pinned_host' memory.*fallback=True"):
        OffloadedCache.init(**SIZES, device=DeviceMemoryOnly())
    with pytest.warns(UserWarning, match="keeping it in device memory"):
        cache = OffloadedCache.init(**SIZES, device=DeviceMemoryOnly(), fallback=True)
    assert cache.stores[0].keys.sharding.memory_kind == "device"
    k = _states(5)
    got, seen_o = _pass(cache, k, k)
    want, seen_s = _pass(StaticCache.init(**SIZES), k, k)
    np.testing.assert_array_equal(got.keys, want.keys)
    np.testing.assert_array_equal(seen_o[-1][0], seen_s[-1][0])


@pytest.fixture(scope="module")
def model():
    # The offloaded step is built for the scan over layers (layer i+1 staged while layer i
    # is attended). With per-layer blocks (the CPU default) XLA copies the host cache around
    # the step: known, not fixed (issue 16 note).
    return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0), scan_layers=True)


def test_generate_gives_the_tokens_of_an_on_device_cache(model):
    ids = jnp.array([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]], jnp.int32)
    lengths = jnp.array([5, 3], jnp.int32)
    want = jaxkv.generate(model, ids, 6, prompt_lengths=lengths)
    got = jaxkv.generate(offload_model(model), ids, 6, prompt_lengths=lengths)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)


def test_donated_decode_step_copies_layers_not_the_cache(model):
    """The compiled step moves each layer to the device once and never copies a
    cache-sized buffer; the host buffers keep their memory kind through the step."""
    graphdef, state = nnx.split(model)
    cache = offload_model(model).init_cache(2, 64)
    step = jax.jit(lambda s, t, c: decode_step(graphdef, s, t, c), donate_argnums=2)
    hlo = step.lower(state, jnp.array([1, 2]), cache).compile().as_text()
    assert not re.search(r"= f32\[2,2,2,64,16\]\{[^}]*\} copy\(", hlo)
    assert len(re.findall(r"= f32\[1,2,2,64,16\]\{[^}]*\} copy\(", hlo)) <= 4  # 2 layers x (keys, values)
    assert re.search(r"f32\[2,2,2,64,16\]\{4,3,2,1,0:S\(5\)\}", hlo)  # host memory space in the layout
    _, cache = step(state, jnp.array([1, 2]), cache)
    _assert_memory_kinds(cache)
    # The step's own output is the same input signature as the fresh cache: one program
    # (the init's staged leaves were uncommitted beside committed host buffers: two).
    _, cache = step(state, jnp.array([3, 4]), cache)
    assert step._cache_size() == 1
    assert step_copy_bytes(cache) == {"to_device": 2 * 2 * 2 * 2 * 64 * 16 * 4, "to_host": 2 * 2 * 2 * 2 * 16 * 4}


def test_vmap_is_refused_with_a_message_that_says_so():
    """JAX does not batch a slice of a host-memory buffer: under jax.vmap the cache's layer
    fetch failed with JAX's own 'memory_space of all inputs passed to gather' message. It
    now says what cannot be done and what to do instead; a StaticCache vmaps as before."""
    shape = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_length=4)
    tokens = jnp.ones((3, 1, 1, 1, 2))
    lengths = jax.vmap(lambda k: StaticCache.init(**shape).update(k, k, 0)[0].lengths)(tokens)
    assert lengths.tolist() == [[[1]]] * 3  # [vmap, layers, rows]
    cache = OffloadedCache.init(**shape)
    with pytest.raises(ValueError, match="OffloadedCache cannot run under jax.vmap"):
        jax.vmap(lambda k: cache.update(k, k, 0)[0].lengths)(tokens)

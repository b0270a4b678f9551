"""Review of sharding and placement: jaxkv.distributed and the caches' ``sharding=`` /
device placement, each checked against the unsharded, one-device run.

The multi-device checks run in ONE subprocess (8 virtual CPU devices), as in
tests/test_sharding.py; the input checks of ``distributed.generate`` run in-process on a
1 x 1 mesh (they refuse before anything compiles).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxkv import distributed

SCRIPT = textwrap.dedent(
    """
    import os, pickle, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from jaxkv import StaticCache
    from jaxkv.offload import OffloadedCache
    import jaxkv.persist as persist

    assert jax.device_count() == 8, jax.devices()
    failures = []

    def devices_of(cache):
        return {d.id for x in jax.tree.leaves(cache) for d in x.sharding.device_set}

    # 1. An OffloadedCache made with device=d (d not the default device) pickled, and saved /
    #    loaded with jaxkv.persist: every leaf comes back on d (the host buffers in d's
    #    pinned_host memory, lengths / flags / the staged layer in d's device memory), and
    #    the ops after it give a StaticCache's contents. Before the fix the device-memory
    #    leaves came back on device 0 while the host buffers went back to d.
    S = dict(num_layers=2, batch_size=2, num_kv_heads=1, head_dim=2, max_length=6)
    k = jnp.arange(8.0).reshape(2, 1, 2, 2)
    tmp = tempfile.mkdtemp()

    def roundtrips(c):
        yield "pickle", pickle.loads(pickle.dumps(c))
        path = os.path.join(tmp, "c.safetensors")
        persist.save_cache(path, c)
        yield "persist", persist.load_cache(path)

    def after(c):
        c = c.reorder_cache(jnp.array([1, 0])).crop(-1)
        for layer in range(2):
            c = c.update(k * 2, k, layer, num_new=jnp.array([1, 2]))[0]
        return c

    d = jax.devices()[3]
    off = OffloadedCache.init(**S, device=d)
    ref = StaticCache.init(**S)
    for layer in range(2):
        off = off.update(k + layer, k, layer, num_new=jnp.array([2, 1]))[0]
        ref = ref.update(k + layer, k, layer, num_new=jnp.array([2, 1]))[0]
    want = after(ref)
    for how, back in roundtrips(off):
        if devices_of(back) != {3}:
            failures.append(f"offloaded {how}: leaves on devices {sorted(devices_of(back))}, want [3]")
        if back.stores[0].keys.sharding.memory_kind != "pinned_host":
            failures.append(f"offloaded {how}: host buffers not in pinned_host")
        for name, f in (("eager", after), ("jit", jax.jit(after))):
            got = f(back)
            if devices_of(got) != {3}:
                failures.append(f"offloaded {how} {name}: ops leave leaves on {sorted(devices_of(got))}")
            np.testing.assert_array_equal(np.asarray(got.keys), np.asarray(want.keys))
            np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    # A plain cache committed to device 3 also comes back there (it used to land on device 0).
    plain = jax.device_put(ref, d)
    for how, back in roundtrips(plain):
        if devices_of(back) != {3}:
            failures.append(f"static {how}: leaves on devices {sorted(devices_of(back))}, want [3]")
        np.testing.assert_array_equal(np.asarray(back.keys), np.asarray(ref.keys))
    # An uncommitted cache on the default device stays uncommitted (no placement recorded).
    back = pickle.loads(pickle.dumps(ref))
    assert not back.keys.committed and devices_of(back) == {0}

    # 2. OffloadedCache.init(device=d) put the host buffers on d but the staged copy, lengths
    #    and flags on the default device: the first eager update raised 'incompatible
    #    devices'. Every op now equals a StaticCache's, eagerly and under jit.
    def run_ops(c):
        for l in range(2):
            c, _, _ = c.update(k + l, k, l, num_new=jnp.array([2, 1]))
        c = c.reorder_cache(jnp.array([1, 0])).batch_repeat_interleave(2).batch_select_indices(jnp.array([0, 3]))
        c = c.put_rows(jnp.array([1]), c.batch_select_indices(jnp.array([0]))).crop(-1)
        seen = []
        for l in range(2):
            c, kk, _ = c.update(k * 2, k, l)
            seen.append(kk)
        return c, seen
    for f in (run_ops, jax.jit(run_ops)):
        (a, sa), (b, sb) = f(OffloadedCache.init(**S, device=jax.devices()[1])), f(StaticCache.init(**S))
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        for x, y in zip(sa, sb):
            np.testing.assert_array_equal(x, y)
        assert a.stores[0].keys.sharding.memory_kind == "pinned_host"
        assert devices_of(a) == {1}, devices_of(a)

    # 3. A row op can leave a row count the data axis does not divide: the cache then keeps
    #    its rows replicated. Pickling and persist (load_cache with sharding=) laid the stored
    #    spec on as is and failed with JAX's IndivisibleError; they now use the same fallback.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxkv import PagedCache
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    spec = NamedSharding(mesh, P("data", "model"))
    for cls, extra in ((StaticCache, {}), (PagedCache, dict(page_size=2, num_pages=16))):
        whole = cls.init(num_layers=1, batch_size=4, num_kv_heads=2, head_dim=2, max_length=6, sharding=spec, **extra)
        whole, _, _ = whole.update(jnp.ones((4, 2, 3, 2)), jnp.ones((4, 2, 3, 2)), 0, num_new=jnp.array([3, 1, 2, 3]))
        odd = whole.batch_select_indices(jnp.array([2, 0, 1]))
        path = os.path.join(tmp, cls.__name__ + "-odd.safetensors")
        persist.save_cache(path, odd)
        for how, back in (("pickle", pickle.loads(pickle.dumps(odd))), ("persist", persist.load_cache(path, sharding=spec))):
            np.testing.assert_array_equal(np.asarray(back.lengths), np.asarray(odd.lengths))
            np.testing.assert_array_equal(np.asarray(back[0][0]), np.asarray(odd[0][0]))
            if back.sharding != spec:
                failures.append(f"{cls.__name__} {how}: sharding {back.sharding}, want {spec}")

    assert not failures, "\\n".join(failures)
    print("ok")
    """
)


def test_placement_survives_pickle_and_persist_on_eight_virtual_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


IDS = np.array([[5, 6, 7], [1, 2, 3]], np.int64)


@pytest.mark.parametrize(
    "ids, lengths, error, match",
    [
        # An id past int32 wrapped onto a valid one (2**32 + 5 -> 5) and was decoded.
        (np.array([[2**32 + 5, 6, 7], [1, 2, 3]], np.int64), None, ValueError, "outside the vocabulary"),
        # Float ids were truncated to ints (5.7 -> 5); jaxkv.generate refuses them.
        (IDS + 0.7, None, TypeError, "integer token ids"),
        # A length past int32 wrapped (2**32 + 3 -> 3).
        (IDS, np.array([2**32 + 3, 3], np.int64), ValueError, r"prompt_lengths\[0\] = 4294967299"),
        # Float lengths were truncated (2.9 -> 2): another prompt than the caller's.
        (IDS, np.array([2.9, 3.0]), TypeError, "prompt_lengths must be integers"),
    ],
    ids=["huge-id", "float-ids", "huge-length", "float-lengths"],
)
def test_distributed_generate_refuses_what_generate_refuses(ids, lengths, error, match):
    """distributed.generate cast the prompts to int32 before jaxkv.generate checked them."""
    model = distributed._demo_model()
    with pytest.raises(error, match=match):
        distributed.generate(model, ids, 2, mesh=distributed.make_mesh(1, 1), prompt_lengths=lengths)

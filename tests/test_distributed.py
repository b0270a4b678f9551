"""Generation on a mesh: tensor-parallel weights, cache sharded by rows and kv heads,
data-parallel rows, across two processes (jax.distributed, gloo collectives on CPU), with
the tokens of one device."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv import distributed
from jaxkv.distributed import LLAMA_RULES, _spec_for
from jax.sharding import AbstractMesh, PartitionSpec as P

MESH = AbstractMesh((4, 2), ("data", "model"))


@pytest.mark.parametrize("layers", [(), (3,)], ids=["per-layer", "stacked"])
def test_rules_shard_the_trailing_axes_with_or_without_a_layer_axis(layers):
    def spec(*path, shape):
        return _spec_for(path, layers + shape, MESH, LLAMA_RULES)

    lead = (None,) * len(layers)
    assert spec("layers", "self_attn", "q_proj", "kernel", shape=(64, 64)) == P(*lead, None, "model")
    assert spec("layers", "self_attn", "k_proj", "kernel", shape=(64, 32)) == P(*lead, None, "model")
    assert spec("layers", "self_attn", "k_proj", "bias", shape=(32,)) == P(*lead, "model")
    assert spec("layers", "self_attn", "o_proj", "kernel", shape=(64, 64)) == P(*lead, "model", None)
    assert spec("layers", "mlp", "up_proj", "kernel", shape=(64, 96)) == P(*lead, None, "model")
    assert spec("layers", "mlp", "down_proj", "kernel", shape=(96, 64)) == P(*lead, "model", None)
    assert spec("layers", "input_layernorm", "weight", shape=(64,)) == P()
    assert spec("layers", "mlp", "gate_proj", "kernel", shape=(64, 95)) == P(*lead, None, None)  # 95 % 2: whole
    assert spec("embed_tokens", "embedding", shape=(128, 64)) == P()


def test_a_rule_may_name_a_tuple_of_mesh_axes():
    """P(None, ("data", "model")) splits over both axes; the divisibility check read
    mesh.shape[("data", "model")] (KeyError, review 57)."""
    rules = ((("q_proj", "kernel"), (None, ("data", "model"))),) + LLAMA_RULES
    assert _spec_for(("q_proj", "kernel"), (64, 64), MESH, rules) == P(None, ("data", "model"))
    assert _spec_for(("q_proj", "kernel"), (64, 12), MESH, rules) == P(None, None)  # 12 % 8: whole


def test_mesh_and_cache_sharding_errors():
    assert distributed.cache_sharding(distributed.make_mesh(1, 1), 2, 3).spec == P("data", "model")
    with pytest.raises(ValueError, match="batch size 3 is not a multiple of the data axis"):
        distributed.cache_sharding(MESH, 2, 3)
    with pytest.raises(ValueError, match="3 kv heads do not split over a model axis of 2"):
        distributed.cache_sharding(MESH, 3, 4)
    with pytest.raises(ValueError, match="needs 16 devices"):
        distributed.make_mesh(8, 2)


def test_two_processes_of_four_devices_give_the_tokens_of_one_device():
    """One scenario, two processes (one subprocess each): 8 virtual CPU devices as a
    data 4 x model 2 mesh spanning both processes."""
    ids, lengths = distributed.demo_batch()
    want = jaxkv.generate(distributed._demo_model(), ids, 8, prompt_lengths=lengths).tokens
    got = distributed.launch(num_processes=2, local_devices=4, model_parallel=2, max_new_tokens=8)
    assert (got["processes"], got["devices"], got["mesh"]) == (2, 8, {"data": 4, "model": 2})
    # a second generate on the placed model, an eager call with a global cache (both raised
    # reading another process's shards on the host, review 57)
    assert got["second_call_equal"] and got["eager_logits_finite"]
    np.testing.assert_array_equal(np.array(got["tokens"]), np.asarray(want))
    specs = got["param_specs"]

    def layer_specs(suffix):  # stacked ("layers/...") or per-layer ("layers/0/...") layout
        found = [spec for path, spec in specs.items() if path.startswith("layers/") and path.endswith(suffix)]
        assert found, (suffix, sorted(specs))
        return found

    assert all(spec[-2:] == [None, "model"] for spec in layer_specs("self_attn/q_proj/kernel"))
    assert all(spec[-2:] == ["model", None] for spec in layer_specs("self_attn/o_proj/kernel"))
    assert all(spec[-2:] == ["model", None] for spec in layer_specs("mlp/down_proj/kernel"))
    assert specs["embed_tokens/embedding"] == []
    # [L, B, H, S, D]: each device holds 1 of 4 rows and 1 of 2 kv heads.
    assert got["cache_spec"] == [None, "data", "model", None, None]
    assert got["cache_shard"] == [2, 1, 1, 16, 16]
    assert "lengths=<int32[2, 4] across processes>" in got["cache_repr"], got["cache_repr"]


def test_workers_keep_the_callers_xla_flags_but_not_a_forced_device_count():
    env = distributed._worker_env({"XLA_FLAGS": "--xla_a=1 --xla_force_host_platform_device_count=8 --xla_b", "X": "y"})
    assert env["XLA_FLAGS"] == "--xla_a=1 --xla_b" and env["X"] == "y" and env["JAX_PLATFORMS"] == "cpu"
    env = distributed._worker_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert "XLA_FLAGS" not in env


def test_a_failed_worker_ends_the_wait_at_once_with_its_stderr():
    # launch waited on each worker in turn, each up to the timeout: a worker whose peer had
    # died waits for it (in jax.distributed.initialize) and the error came only after the
    # whole timeout, without the dead worker's stderr. Plain Python processes stand in here.
    import subprocess
    import sys
    import time

    def start(code):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    waiting = start("import time; time.sleep(60)")
    dead = start("import sys; sys.stderr.write('worker 1 could not start'); sys.exit(3)")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"process 1 exited with 3:\nworker 1 could not start"):
        distributed._wait_all([waiting, dead], timeout=50)
    assert time.monotonic() - began < 20 and waiting.poll() is not None  # the other one was stopped
    slow = start("import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match=r"did not finish within 0.5 s \(still running: processes \[0\]\)"):
        distributed._wait_all([slow], timeout=0.5)
    assert slow.poll() is not None
    ok = [start("print('a')"), start("print('b')")]
    assert distributed._wait_all(ok, timeout=50) == [("a\n", ""), ("b\n", "")]


def test_placing_a_placed_array_hands_it_back():
    """distributed.generate places the weights on every call: each placed weight went to the
    host (np.asarray) and back, the whole model both ways per call (review 81)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    placed = distributed.place(np.arange(6.0).reshape(2, 3), sharding)
    assert distributed.place(placed, sharding) is placed
    np.testing.assert_array_equal(np.asarray(placed), np.arange(6.0).reshape(2, 3))

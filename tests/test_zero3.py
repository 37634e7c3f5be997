"""ZeRO-3 (jax_drain.zero3): parameters held as shards, gathered bucket by bucket at first use;
gradients equal to GradSync's on the gathered parameters, the reduce-scatter chain unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import data_mesh
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat, zero3

D, H, C, LAYERS = 16, 48, 8, 4


def _params(seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s, scale=0.3: jnp.asarray(rng.normal(size=s) * scale, jnp.float32)
    p = {"embed": n(C, D), "head_norm": 1.0 + n(D, scale=0.1)}
    for i in range(LAYERS):
        p[f"block{i}"] = {"w_in": n(D, H), "b_in": n(H, scale=0.1), "w_out": n(H, D)}
    return p


def _block(p, h):
    return h + jnp.tanh(h @ p["w_in"] + p["b_in"]) @ p["w_out"]


def _loss(remat: bool):
    block = jax.checkpoint(_block) if remat else _block

    def loss(p, batch):
        h = batch["x"] @ p["embed"]
        for i in range(LAYERS):
            h = block(p[f"block{i}"], h)
        logits = (h * p["head_norm"]) @ p["embed"].T  # the embedding again: read in two places
        return jnp.mean((logits - batch["y"]) ** 2)

    return loss


def _batch(seed=1, n=32):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(n, C)), jnp.float32), "y": jnp.asarray(rng.normal(size=(n, C)), jnp.float32)}


def _mesh(kind):
    devices = np.array(jax.devices("cpu")[:8])
    return data_mesh(8) if kind == "data" else Mesh(devices.reshape(2, 4), ("replica", "data"))


def _both(sync, loss, **options):
    """GradSync.value_and_grad on replicated params, zero3.value_and_grad on their shards."""
    microbatches = options.get("microbatches", 1)

    def reference(p, b):
        return sync.value_and_grad(loss, microbatches=microbatches)(p, b)

    def sharded(p, b):
        return zero3.value_and_grad(sync, loss, **options)(zero3.shard_params(sync, p), b)

    run = lambda fn: jax.jit(_compat.shard_map(fn, mesh=sync.mesh, in_specs=(P(), sync.batch_spec),
                                               out_specs=(P(), sync.shard_specs())))
    return run(reference), run(sharded)


@pytest.mark.parametrize("mesh_kind", ["data", "replica_data"])
@pytest.mark.parametrize("remat", [True, False], ids=["remat", "plain"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("drain", [True, False], ids=["drain", "nodrain"])
def test_gradients_equal_gradsync_bit_for_bit(mesh_kind, remat, reshard, drain):
    params, batch, loss = _params(), _batch(), _loss(remat)
    mesh = _mesh(mesh_kind)
    outer = {"outer_axis": "replica"} if mesh_kind == "replica_data" else {}
    # ~1.5 blocks per bucket: buckets span remat regions (gathered in both, gradients summed).
    sync = jd.GradSync(params, mesh, bucket_size=1200, drain=drain,
                       order=jd.grad_ready_order(loss, params, jax.tree.map(lambda x: x[:4], batch)), **outer)
    assert sync.num_buckets >= 4
    reference, sharded = _both(sync, loss, reshard_after_forward=reshard)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    assert float(got_loss) == float(want_loss)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    # And the mean gradient is the one-device gradient of the whole batch.
    mean = sync.unflatten(got)
    exact = jax.grad(loss)(params, batch)
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(mean), jax.tree.leaves(exact)):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_microbatches_reduce_each_micro_batch_and_accumulate():
    params, batch, loss = _params(), _batch(n=64), _loss(True)
    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    reference, sharded = _both(sync, loss, microbatches=2)
    (want_loss, want), (got_loss, got) = reference(params, batch), sharded(params, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unsupported_meshes_and_wrong_shards_are_refused():
    params = _params()
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("data", "model"))
    specs = {k: (P(None, "model") if k == "embed" else None) for k in params}
    tp = jd.GradSync(params, mesh, param_specs=specs)
    with pytest.raises(ValueError, match="tensor-parallel"):
        zero3.value_and_grad(tp, _loss(False))
    scan = jd.ScanGradSync({"blocks": {"w": jnp.zeros((3, 4, 4))}, "head": jnp.zeros((4,))}, data_mesh(8),
                           stacked={"blocks": True, "head": False})
    with pytest.raises(ValueError, match="scanned layer stack"):
        zero3.value_and_grad(scan, lambda p, x: 0.0)
    sync = jd.GradSync(params, data_mesh(8), bucket_size=1200)
    bad = jax.jit(_compat.shard_map(lambda p, b: zero3.value_and_grad(sync, _loss(False))(p, b), mesh=sync.mesh,
                                    in_specs=(P(), sync.batch_spec), out_specs=(P(), sync.shard_specs())))
    with pytest.raises(ValueError, match="zero3.shard_params"):
        bad(sync.flatten(params), _batch())  # whole buckets, not this device's shards


@pytest.mark.gpu_compile
def test_gpu_schedule_gathers_each_bucket_at_its_use_and_keeps_the_chain():
    """Compile-only 8xH100, a remat block stack: resharding, each bucket is gathered once in
    forward and again in backward inside its block; kept, once. Either way every bucket is one
    bf16 all-to-all with one bucket in flight (the drained chain), and the parameters are
    arguments at 1/8 of their size."""
    from jax_drain import plan
    from jax_drain.planner.schedule import parse_schedule

    mesh = plan.gpu_mesh((8,), ("data",))
    n, d = 6, 1024
    params = {f"w{i}": jax.ShapeDtypeStruct((d, d), jnp.bfloat16) for i in range(n)}
    block = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))

    def loss(p, x):
        for i in range(n):
            x = block(p[f"w{i}"], x)
        return jnp.mean(x.astype(jnp.float32) ** 2)

    batch = jax.ShapeDtypeStruct((8 * 256, d), jnp.bfloat16)
    sync = jd.GradSync(params, mesh, bucket_size=d * d,
                       order=jd.grad_ready_order(loss, params, jax.ShapeDtypeStruct((256, d), jnp.bfloat16)))
    shards = sync.pack_shards([jax.ShapeDtypeStruct(c.global_shard_shape(k), c.layout.buckets[k].dtype)
                               for c, k in sync.flat_chains])
    found = {}
    for reshard in (True, False):
        fn = zero3.value_and_grad(sync, loss, reshard_after_forward=reshard)
        step = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(sync.shard_specs(), P("data")),
                                         out_specs=(P(), sync.shard_specs())))
        report = plan.plan(step, shards, batch)
        sched = parse_schedule(step.lower(shards, batch).compile().as_text())
        gathers = [c for c in sched.collectives if c.kind == "all-gather" and c.in_scope("jax_drain/gather/bucket")]
        a2a = [c for c in sched.collectives if c.kind == "all-to-all" and c.in_scope("jax_drain/bucket")]
        assert len(a2a) == n and {c.dtype for c in a2a} == {"bf16"}
        assert report.chains_in_flight == {"dense": 1}
        assert report.argument_bytes < n * d * d * 2 / 4  # 1/8 of the bf16 params, plus the batch
        found[reshard] = (len(gathers), report.temp_bytes)
    assert found[False][0] == n
    # Backward gathers again inside each block (the last block's may be reused from forward).
    assert found[True][0] >= 2 * n - 1
    assert found[True][1] < found[False][1]

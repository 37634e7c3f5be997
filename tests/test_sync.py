"""GradSync on 8 virtual CPU devices: values against float64, drain invariance, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from helpers import per_device_grads, random_tree, reference_shards, run_reduce_scatter
from jax_drain import _compat

TEMPLATE = {
    "embed": jax.ShapeDtypeStruct((50, 24), jnp.bfloat16),
    "blocks": [
        {"w": jax.ShapeDtypeStruct((24, 40), jnp.bfloat16), "scale": jax.ShapeDtypeStruct((40,), jnp.float32)}
        for _ in range(3)
    ],
    "head": jax.ShapeDtypeStruct((24, 7), jnp.bfloat16),
}


def _rel_err(out, ref):
    return max(np.max(np.abs(o - r)) / np.max(np.abs(r)) for o, r in zip(out, ref))


@pytest.mark.parametrize("bucket_size", [None, 1000, 1])
@pytest.mark.parametrize("average", [True, False])
def test_reduce_scatter_matches_float64_reference(bucket_size, average):
    mesh = data_mesh(8)
    grads = per_device_grads(np.random.default_rng(1), TEMPLATE, 8)
    results = {}
    for mode in jd.REDUCE_MODES:
        for drain in (False, True):
            sync = jd.GradSync(TEMPLATE, mesh, bucket_size=bucket_size, reduce=mode, drain=drain, average=average)
            out = run_reduce_scatter(sync, grads, mesh)
            assert [o.shape for o in out] == [(s,) for s in sync.bucket_sizes]
            assert all(o.dtype == np.float32 for o in out)
            results[mode, drain] = out
    ref = reference_shards(sync, grads, average)
    assert _rel_err(results["fp32", True], ref) <= 1e-6
    assert _rel_err(results["fp32_accum", True], ref) <= 1e-6
    assert _rel_err(results["bf16", True], ref) > 1e-4  # rounded to bf16: not fp32-exact
    for mode in jd.REDUCE_MODES:  # the drain changes the schedule, never the values
        for a, b in zip(results[mode, False], results[mode, True]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_in_flight", [1, 2, 100])
def test_max_in_flight_keeps_values(max_in_flight):
    mesh = data_mesh(8)
    grads = per_device_grads(np.random.default_rng(2), TEMPLATE, 8)
    sync = jd.GradSync(TEMPLATE, mesh, bucket_size=1, max_in_flight=max_in_flight)
    assert sync.num_buckets == 8
    out = run_reduce_scatter(sync, grads, mesh)
    assert _rel_err(out, reference_shards(sync, grads, True)) <= 1e-6


def _loss(p, x):
    h = p["embed"][x]
    for block in p["blocks"]:
        h = jnp.tanh(h @ block["w"]).astype(jnp.float32) * block["scale"]
        h = (h @ block["w"].T.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.mean((h @ p["head"]).astype(jnp.float32) ** 2)


def _value_and_grad_step(sync, mesh):
    step = lambda p, x: sync.value_and_grad(_loss)(p, x)
    return jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data"))))


def test_value_and_grad_gives_reduced_local_gradients():
    mesh = data_mesh(8)
    rng = np.random.default_rng(3)
    params = random_tree(rng, TEMPLATE)
    tokens = jnp.asarray(rng.integers(0, 50, size=(8 * 4, 6)), jnp.int32)
    order = jd.grad_ready_order(_loss, params, tokens)
    sync = jd.GradSync(params, mesh, bucket_size=2000, reduce="fp32_accum", order=order)

    def step(p, x):  # also return each device's local gradient, from the same program
        (loss, shards), local = sync.value_and_grad(_loss)(p, x), jax.grad(_loss)(jd.local_params(p, "data"), x)
        return loss, shards, jax.tree.map(lambda g: g[None], local)

    step = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data"), P("data"))))
    loss, shards, local = step(params, tokens)
    assert _rel_err([np.asarray(s) for s in shards], reference_shards(sync, local, average=True)) <= 1e-6
    assert loss.shape == () and loss.dtype == jnp.float32

    # The local gradients are each device's own: check in float32, away from bf16 rounding noise.
    params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    sync32 = jd.GradSync(params32, mesh, bucket_size=2000, reduce="fp32", average=False)
    loss32, shards32 = _value_and_grad_step(sync32, mesh)(params32, tokens)
    losses, per_device = jax.vmap(jax.value_and_grad(_loss), in_axes=(None, 0))(params32, tokens.reshape(8, 4, 6))
    np.testing.assert_allclose(float(loss32), np.sum(np.asarray(losses, np.float64)), rtol=1e-5)  # average=False: sum
    assert _rel_err([np.asarray(s) for s in shards32], reference_shards(sync32, per_device, average=False)) <= 1e-5


def _all_reduce_shapes(hlo: str) -> list[str]:
    return [line.split("=")[1].split()[0] for line in hlo.splitlines()
            if " all-reduce(" in line or " all-reduce-start(" in line]


def test_no_hidden_gradient_all_reduce():
    mesh = data_mesh(8)
    sync = jd.GradSync(TEMPLATE, mesh, bucket_size=1000)
    tokens = jax.ShapeDtypeStruct((32, 6), jnp.int32)
    hlo = _value_and_grad_step(sync, mesh).lower(TEMPLATE, tokens).compile().as_text()
    assert _all_reduce_shapes(hlo) == ["f32[]"]  # only the scalar loss mean

    # The trap it avoids: jax.grad w.r.t. the replicated params all-reduces every gradient...
    naive = lambda p, x: jax.grad(_loss)(p, x)
    naive = jax.jit(_compat.shard_map(naive, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    assert any(s != "f32[]" for s in _all_reduce_shapes(naive.lower(TEMPLATE, tokens).compile().as_text()))
    # ...and reduce_scatter refuses such already-reduced gradients.
    trap = lambda p, x: sync.reduce_scatter(jax.grad(_loss)(p, x))
    trap = _compat.shard_map(trap, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    with pytest.raises(ValueError, match="do not vary along 'data'.*value_and_grad"):
        jax.jit(trap).lower(TEMPLATE, tokens)


def test_properties_and_table():
    mesh = data_mesh(8)
    sync = jd.GradSync(TEMPLATE, mesh, bucket_size=1000)
    assert sync.num_buckets == len(sync.bucket_sizes) >= 2
    assert all(s % np.lcm(8, 128) == 0 for s in sync.bucket_sizes)
    assert sync.shard_sizes == tuple(s // 8 for s in sync.bucket_sizes)
    assert "blocks/0/w" in sync.table() and "GradSync(" in repr(sync)
    rng = np.random.default_rng(4)
    tree = random_tree(rng, TEMPLATE)
    back = sync.unflatten(sync.flatten(tree))
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bad_inputs():
    mesh = data_mesh(8)
    with pytest.raises(ValueError, match="mesh has no axis 'dp'"):
        jd.GradSync(TEMPLATE, mesh, axis="dp")
    with pytest.raises(ValueError, match="bucket_size must be a positive"):
        jd.GradSync(TEMPLATE, mesh, bucket_size=0)
    with pytest.raises(TypeError, match="only floating-point leaves"):
        jd.GradSync({"n": jax.ShapeDtypeStruct((3,), jnp.int32)}, mesh)
    with pytest.raises(ValueError, match="unknown reduce mode 'fp8'"):
        jd.GradSync(TEMPLATE, mesh, reduce="fp8")
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
            jd.GradSync(TEMPLATE, mesh, max_in_flight=bad)
    with pytest.raises(ValueError, match="needs drain=True"):
        jd.GradSync(TEMPLATE, mesh, drain=False, max_in_flight=2)

    sync = jd.GradSync(TEMPLATE, mesh, bucket_size=1000)
    grads = per_device_grads(np.random.default_rng(5), TEMPLATE, 1)
    grads = jax.tree.map(lambda g: g[0], grads)
    with pytest.raises(ValueError, match="inside jax.shard_map over a mesh with axis 'data'"):
        sync.reduce_scatter(grads)

    def lower(tree_fn, template):
        fn = lambda g: sync.reduce_scatter(tree_fn(jax.tree.map(lambda x: x[0], g)))
        fn = _compat.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        stacked = jax.tree.map(lambda t: jax.ShapeDtypeStruct((8, *t.shape), t.dtype), template)
        return jax.jit(fn).lower(stacked)

    with pytest.raises(ValueError, match="grads structure differs"):
        lower(lambda g: {**g, "extra": g["head"]}, TEMPLATE)
    with pytest.raises(ValueError, match="grads leaf 'head' has shape \\(24, 8\\)"):
        lower(lambda g: g, {**TEMPLATE, "head": jax.ShapeDtypeStruct((24, 8), jnp.bfloat16)})
    with pytest.raises(TypeError, match="grads leaf 'head' has dtype float32"):
        lower(lambda g: g, {**TEMPLATE, "head": jax.ShapeDtypeStruct((24, 7), jnp.float32)})

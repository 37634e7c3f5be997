"""GradSync on 8 virtual CPU devices: values against float64, drain invariance, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from helpers import (
    DEVICE_SUM_RTOL, assert_bf16_sum_close, assert_padding_zero, assert_tree_close, assert_within_rounding, device_sum, leaves_of,
    per_device_grads, random_tree, rounding_chain, run_reduce_scatter, scale_by,
)
from jax_drain import _compat

TEMPLATE = {
    "embed": jax.ShapeDtypeStruct((50, 24), jnp.bfloat16),
    "blocks": [
        {"w": jax.ShapeDtypeStruct((24, 40), jnp.bfloat16), "scale": jax.ShapeDtypeStruct((40,), jnp.float32)}
        for _ in range(3)
    ],
    "head": jax.ShapeDtypeStruct((24, 7), jnp.bfloat16),
}

# The value tests' tree: odd sizes, bf16 and float32 leaves, and in each dtype leaves of very
# different scales sharing buckets (a 1e-3 norm scale next to a matrix of 1s).
VALUES = {
    "embed": jax.ShapeDtypeStruct((97, 13), jnp.bfloat16),
    "blocks": [
        {
            "w": jax.ShapeDtypeStruct((13, 29), jnp.bfloat16),
            "norm": jax.ShapeDtypeStruct((13,), jnp.bfloat16),
            "scale": jax.ShapeDtypeStruct((29,), jnp.float32),
            "mix": jax.ShapeDtypeStruct((3, 5, 7), jnp.float32),
        }
        for _ in range(3)
    ],
    "head": jax.ShapeDtypeStruct((13, 7), jnp.bfloat16),
}
SCALES = scale_by({"norm": 1e-3, "scale": 1e-3, "blocks/1/w": 1e-2, "head": 30.0})
FP32_MODES = ("fp32", "fp32_accum", "fp32_accum_streamed")


def _reference(stacked, average: bool):
    """float64 per-leaf sum (mean) over devices, and the per-element magnitude a float32 sum's
    error scales with: the sum (mean) of |g| over devices (for sums that cancel to near zero)."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    divisor = n if average else 1
    return device_sum(stacked, divisor=divisor), device_sum(stacked, divisor=divisor, absolute=True)


def _assert_fp32_close(sync, buckets, ref, magnitude, what, rtol=DEVICE_SUM_RTOL):
    assert_padding_zero(sync.layout, buckets, what)
    return assert_tree_close(leaves_of(sync, buckets), ref, rtol,
                             atol=jax.tree.map(lambda m: rtol * m, magnitude), what=what)


def _of_dtype(tree, dtype):
    """``{path: leaf}`` of the leaves whose parameter in ``VALUES`` has ``dtype``."""
    kept = {p for p, t in zip(jd.layout.leaf_paths(VALUES), jax.tree.leaves(VALUES)) if t.dtype == dtype}
    return {p: x for p, x in zip(jd.layout.leaf_paths(tree), jax.tree.leaves(tree)) if p in kept}


# Averaging scales each bucket alike, whatever the layout: the sum is checked on one layout.
# Undrained against drained on one layout of several buckets (one whole bucket has no drain; the
# drain orders buckets, whatever their number).
@pytest.mark.parametrize("bucket_size, average", [(None, True), (1000, True), (1, True), (1000, False)])
def test_reduce_scatter_matches_float64_reference(bucket_size, average):
    mesh = data_mesh(8)
    grads = per_device_grads(np.random.default_rng(1), VALUES, 8, scale=SCALES)
    ref, magnitude = _reference(grads, average)
    results, errors = {}, {}
    drains = (False, True) if bucket_size == 1000 and average else (True,)
    for mode in jd.REDUCE_MODES:
        for drain in drains:
            sync = jd.GradSync(VALUES, mesh, bucket_size=bucket_size, reduce=mode, drain=drain, average=average)
            out = run_reduce_scatter(sync, grads, mesh)
            assert [o.shape for o in out] == [(s,) for s in sync.bucket_sizes]
            assert all(o.dtype == np.float32 for o in out)
            results[mode, drain] = out
        if mode in FP32_MODES:
            errors[mode] = _assert_fp32_close(sync, results[mode, True], ref, magnitude, mode)
    # bf16: bf16 buckets are summed in bf16 (every bf16 leaf visibly rounded, each within bf16's
    # precision); float32 buckets are summed in their own dtype, as exact as the fp32 modes.
    bf16 = results["bf16", True]
    assert_padding_zero(sync.layout, bf16, "bf16")
    got = leaves_of(sync, bf16)
    # Within bf16's precision: a sum of 8 bf16 terms rounded at each of up to 7 steps (as a
    # ring reduce-scatter on GPUs does), and the mean's division.
    bf16_err = assert_bf16_sum_close(_of_dtype(got, jnp.bfloat16), _of_dtype(ref, jnp.bfloat16),
                                     _of_dtype(magnitude, jnp.bfloat16), roundings=8, what="bf16 mode, bf16 leaves")
    assert_tree_close(
        _of_dtype(got, jnp.float32), _of_dtype(ref, jnp.float32), DEVICE_SUM_RTOL,
        atol=_of_dtype(jax.tree.map(lambda m: DEVICE_SUM_RTOL * m, magnitude), jnp.float32),
        what="bf16 mode, float32 leaves")
    for path, err in bf16_err.items():  # rounded to bf16: every bf16 leaf measurably worse than fp32
        fp32_worst = max(errors[mode][path] for mode in FP32_MODES)
        assert err > 1e-4 and err > 100 * fp32_worst, (path, err, fp32_worst)
    if False in drains:
        for mode in jd.REDUCE_MODES:  # the drain changes the schedule, never the values
            for a, b in zip(results[mode, False], results[mode, True]):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("max_in_flight", [1, 2, 100])
def test_max_in_flight_keeps_values(max_in_flight):
    mesh = data_mesh(8)
    grads = per_device_grads(np.random.default_rng(2), VALUES, 8, scale=SCALES)
    sync = jd.GradSync(VALUES, mesh, bucket_size=1, max_in_flight=max_in_flight)
    assert sync.num_buckets == len(jax.tree.leaves(VALUES))
    out = run_reduce_scatter(sync, grads, mesh)
    _assert_fp32_close(sync, out, *_reference(grads, True), f"max_in_flight={max_in_flight}")


def _loss(p, x):
    h = p["embed"][x]
    for block in p["blocks"]:
        h = jnp.tanh(h @ block["w"]).astype(jnp.float32) * block["scale"]
        h = (h @ block["w"].T.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.mean((h @ p["head"]).astype(jnp.float32) ** 2)


def _value_and_grad_step(sync, mesh):
    step = lambda p, x: sync.value_and_grad(_loss)(p, x)
    return jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data"))))


# _loss's tree at odd sizes: vocabulary 97, width 13, hidden 29, 7 outputs.
ODD = {
    "embed": jax.ShapeDtypeStruct((97, 13), jnp.bfloat16),
    "blocks": [
        {"w": jax.ShapeDtypeStruct((13, 29), jnp.bfloat16), "scale": jax.ShapeDtypeStruct((29,), jnp.float32)}
        for _ in range(3)
    ],
    "head": jax.ShapeDtypeStruct((13, 7), jnp.bfloat16),
}


def test_value_and_grad_gives_reduced_local_gradients():
    mesh = data_mesh(8)
    rng = np.random.default_rng(3)
    # Small block-1 scales: the leaves' gradients span three orders of magnitude (the float32
    # bucket holds scale gradients of ~2 next to ~2000).
    params = random_tree(rng, ODD, scale=scale_by({"blocks/1/scale": 1e-2}))
    tokens = jnp.asarray(rng.integers(0, 97, size=(8 * 4, 6)), jnp.int32)
    order = jd.grad_ready_order(_loss, params, tokens)
    sync = jd.GradSync(params, mesh, bucket_size=2000, reduce="fp32_accum", order=order)

    def step(p, x):  # also return each device's local gradient, from the same program
        (loss, shards), local = sync.value_and_grad(_loss)(p, x), jax.grad(_loss)(jd.local_params(p, "data"), x)
        return loss, shards, jax.tree.map(lambda g: g[None], local)

    step = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data"), P("data"))))
    loss, shards, local = step(params, tokens)
    _assert_fp32_close(sync, shards, *_reference(local, True), "value_and_grad")
    assert loss.shape == () and loss.dtype == jnp.float32

    # The local gradients are each device's own: check in float32, away from bf16 rounding noise.
    params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    sync32 = jd.GradSync(params32, mesh, bucket_size=2000, reduce="fp32", average=False)
    loss32, shards32 = _value_and_grad_step(sync32, mesh)(params32, tokens)
    losses, per_device = jax.vmap(jax.value_and_grad(_loss), in_axes=(None, 0))(params32, tokens.reshape(8, 4, 6))
    # A separate computation (vmap, not shard_map) of each device's loss and gradient: their
    # chains' roundings, then the 8 devices' sum (average=False).
    local = tokens.reshape(8, 4, 6)[0]
    loss_chain = rounding_chain(_loss, params32, local) + 8
    assert_within_rounding(loss32, np.sum(np.asarray(losses, np.float64)), additions=loss_chain,
                           scale=np.sum(np.abs(np.asarray(losses, np.float64))), what="summed loss")
    assert_padding_zero(sync32.layout, shards32, "float32 value_and_grad")
    assert_within_rounding(leaves_of(sync32, shards32), device_sum(per_device),
                           additions=rounding_chain(jax.grad(_loss), params32, local) + 8,
                           scale=jax.tree.map(np.max, device_sum(per_device, absolute=True)),
                           what="float32 value_and_grad")  # each leaf's scale: its backward's terms cancel


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

"""A precision policy independent of the model's dtype: ``wire_dtype`` (bf16 wire for float32
gradients, float32 accumulation) and ``TrainConfig(param_dtype=...)`` (bf16 working params,
float32 master shards from the model's own values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from helpers import (
    EPS32, adam_rounding_bounds, assert_within, assert_within_rounding, loss_rounding_bounds, reference_run,
    rounding_chain,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat

SDS = jax.ShapeDtypeStruct
TREE = {"w": SDS((37, 29), jnp.float32), "norm": SDS((29,), jnp.float32), "head": SDS((29, 13), jnp.float32)}


def _reduce(sync, stacked):
    fn = _compat.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), mesh=sync.mesh,
                           in_specs=P("data"), out_specs=sync.shard_specs())
    return sync.unflatten(jax.jit(fn)(stacked))


def _stacked(seed=0):
    rng = np.random.default_rng(seed)
    scale = {"w": 1.0, "norm": 1e-3, "head": 30.0}
    return {k: jnp.asarray(rng.normal(size=(8, *s.shape)) * scale[k], jnp.float32) for k, s in TREE.items()}


def test_bf16_wire_for_float32_gradients_accumulates_in_float32():
    stacked = _stacked()
    exact = jd.GradSync(TREE, data_mesh(8), bucket_size=500, reduce="fp32_accum")
    wire = jd.GradSync(TREE, data_mesh(8), bucket_size=500, reduce="fp32_accum", wire_dtype=jnp.bfloat16)
    got, full = _reduce(wire, stacked), _reduce(exact, stacked)
    for k in TREE:
        want = np.asarray(stacked[k], np.float64).mean(axis=0)
        rel = lambda x: np.linalg.norm(np.asarray(x, np.float64) - want) / np.linalg.norm(want)
        assert rel(full[k]) < 1e-6
        assert 1e-5 < rel(got[k]) < 4e-3, (k, rel(got[k]))  # bf16 rounding of each input only
        assert got[k].dtype == jnp.float32
    # The sum of bf16-rounded inputs in float32, element for element.
    rounded = {k: np.asarray(v.astype(jnp.bfloat16), np.float64).mean(axis=0) for k, v in stacked.items()}
    for k in TREE:  # float32 sums of 8 terms, in another order
        magnitude = np.abs(np.asarray(stacked[k].astype(jnp.bfloat16), np.float64)).mean(axis=0)
        assert_within_rounding(got[k], rounded[k], additions=8, scale=magnitude, what=k)
    with pytest.raises(ValueError, match="wire_dtype must be a floating dtype"):
        jd.GradSync(TREE, data_mesh(8), wire_dtype=jnp.int8)


@pytest.mark.parametrize("reduce", ["fp32", "int8_accum", "fp8_accum", "fp16_accum", "int8_accum_streamed"])
def test_a_wire_dtype_that_only_rounds_is_refused(reduce):
    """fp32 sends float32 and the quantized modes their own bytes: a bf16 cast first would only
    add error."""
    with pytest.raises(ValueError, match="without sending fewer bytes"):
        jd.GradSync(TREE, data_mesh(8), reduce=reduce, wire_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="without sending fewer bytes"):
        jd.TrainConfig(reduce=reduce, wire_dtype=jnp.bfloat16)


@pytest.mark.parametrize("reduce", ["bf16", "fp32_accum", "fp32_accum_streamed"])
@pytest.mark.parametrize("wire,scaled", [(jnp.float16, "fp16_accum"), (jnp.float8_e4m3fn, "fp8_accum"),
                                         (jnp.float8_e5m2, "fp8_accum")])
def test_a_wire_with_less_range_than_float32_is_refused_naming_its_scaled_mode(reduce, wire, scaled):
    """Unscaled, a float16 or float8 wire turns large gradients into inf and small ones into zero:
    refused, naming the block-scaled mode and bf16 (float32's range at the same bytes)."""
    message = rf"wire_dtype={jnp.dtype(wire).name} has less range than float32.*reduce='{scaled}'.*bfloat16"
    with pytest.raises(ValueError, match=message):
        jd.GradSync(TREE, data_mesh(8), reduce=reduce, wire_dtype=wire)
    with pytest.raises(ValueError, match=message):
        jd.TrainConfig(reduce=reduce, wire_dtype=wire)


class MLP(nnx.Module):  # Flax's default: float32 params
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 32, rngs=rngs)
        self.b = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.gelu(self.a(x)))


def _batches(n):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(32, 16)).astype(np.float32), "y": rng.normal(size=(32, 4)).astype(np.float32)}
            for _ in range(n)]


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _loss_bounds(batches, *, rounding: float, per_gradient: int | None = None, loss_eps: float = EPS32) -> np.ndarray:
    """How far the losses of two ``optax.adam(1e-2)`` runs of ``MLP`` may differ when each
    gradient element is off by ``per_gradient`` (default: its whole chain's) roundings of
    ``rounding``, and each loss by its chain's roundings of ``loss_eps``: from the one-device
    run's own gradients."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    loss = lambda p, b: _loss(nnx.merge(graphdef, p), b)
    _, losses, gradients = reference_run(loss, params, optax.adam(1e-2), batches)
    chain = rounding_chain(jax.grad(loss), params, batches[0]) + 8
    bounds = adam_rounding_bounds(gradients, additions=per_gradient or chain, learning_rate=1e-2, params=params,
                                  rounding=rounding)
    return loss_rounding_bounds(losses, gradients, bounds, additions=chain, eps=loss_eps)


@pytest.mark.parametrize("lazy", [False, True], ids=["example_batch", "first_batch"])
def test_param_dtype_trains_a_float32_model_with_bf16_working_params(lazy):
    batches = _batches(4)
    runs = {}
    for dtype in (None, jnp.bfloat16):
        model = MLP(nnx.Rngs(0))
        step = jd.make_train_step(model, _loss, optax.adam(1e-2), data_mesh(8),
                                  jd.TrainConfig(bucket_size=300, param_dtype=dtype),
                                  example_batch=None if lazy else batches[0])
        state, losses = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics.loss))
        runs[dtype] = (model, step, state, losses)
    _, step, state, losses = runs[jnp.bfloat16]
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in state.opt_state.master} == {jnp.dtype(jnp.float32)}
    assert step.sync.layout.buckets[0].dtype == jnp.bfloat16  # bf16 gradients on the wire
    # Every operation of the bf16 forward and backward rounds to bf16's epsilon.
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    bf16 = _loss_bounds(batches, rounding=eps, loss_eps=eps)
    assert_within(np.asarray(losses), np.asarray(runs[None][3]), bf16, what="bf16 working params")
    # The master starts from the float32 model exactly (not from a bf16 copy) ...
    master0 = step.master_params(step.init())
    for got, want in zip(jax.tree.leaves(master0), jax.tree.leaves(nnx.to_pure_dict(nnx.state(MLP(nnx.Rngs(0)), nnx.Param)))):
        np.testing.assert_array_equal(got, want)
    # ... and update_model writes the float32 masters back into the float32 model.
    model = runs[jnp.bfloat16][0]
    step.update_model(model, state)
    assert model.a.kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(model.a.kernel[...], step.master_params(state)["a"]["kernel"])
    assert not np.array_equal(model.a.kernel[...], np.asarray(state.params["a"]["kernel"], np.float32))


@pytest.mark.gpu_compile
def test_bf16_wire_halves_the_all_to_all_of_a_float32_model():
    from jax_drain.planner.schedule import parse_schedule
    from jax_drain.planner.targets import gpu_mesh

    mesh = gpu_mesh((8,), ("data",))
    params = {f"w{i}": SDS((512, 512), jnp.float32) for i in range(4)}
    batch = SDS((8 * 64, 512), jnp.float32)
    loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w0"] @ p["w1"] @ p["w2"] @ p["w3"]) ** 2)

    def all_to_alls(wire):
        sync = jd.GradSync(params, mesh, bucket_size=512 * 512, wire_dtype=wire)
        step = jax.jit(_compat.shard_map(sync.value_and_grad(loss), mesh=mesh, in_specs=(P(), P("data")),
                                         out_specs=(P(), sync.shard_specs())))
        sched = parse_schedule(step.lower(params, batch).compile().as_text())
        return [(c.dtype, c.bytes) for c in sched.collectives if c.kind == "all-to-all" and c.in_scope("jax_drain/bucket")]

    full, half = all_to_alls(None), all_to_alls(jnp.bfloat16)
    assert len(full) == len(half) == 4
    assert {d for d, _ in full} == {"f32"} and {d for d, _ in half} == {"bf16"}
    assert sum(b for _, b in half) * 2 == sum(b for _, b in full)


@pytest.mark.parametrize("reduce, bound", [("int8_accum", 1e-2), ("fp8_accum", 5e-2), ("int8_accum_streamed", 1e-2)])
def test_quantized_wire_keeps_every_leaf_within_its_own_norm(reduce, bound):
    """The sync starts a scale block at every leaf: a 1e-3 leaf beside a 30x one keeps its value."""
    stacked = _stacked(1)
    got = _reduce(jd.GradSync(TREE, data_mesh(8), bucket_size=None, reduce=reduce), stacked)
    for k in TREE:
        want = np.asarray(stacked[k], np.float64).mean(axis=0)
        err = np.linalg.norm(np.asarray(got[k], np.float64) - want) / np.linalg.norm(want)
        assert err < bound, (reduce, k, err)


def test_int8_wire_trains_like_fp32_accum():
    batches = _batches(6)
    losses = {}
    for reduce in ("fp32_accum", "int8_accum"):
        step = jd.make_train_step(MLP(nnx.Rngs(0)), _loss, optax.adam(1e-2), data_mesh(8),
                                  jd.TrainConfig(bucket_size=300, reduce=reduce), example_batch=batches[0])
        state, losses[reduce] = step.init(), []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[reduce].append(float(metrics.loss))
    # Each device's gradient rounds to int8 steps of 1 / 127 of its block's largest value once.
    int8 = _loss_bounds(batches, rounding=1 / 127, per_gradient=1)
    assert_within(np.asarray(losses["int8_accum"]), np.asarray(losses["fp32_accum"]), int8, what="int8 wire")
    assert losses["int8_accum"] != losses["fp32_accum"]  # really quantized

"""The stage axis: a layer stack run as a GPipe pipeline equals the stack run in one place.

On 8 CPU devices as ``(data, stage)`` = (2, 4) and (4, 2): the pipeline's results and the
gradients of a loss through it, against the same stack applied on one device in float64, within
the float32 rounding of the computation (counted from its jaxpr).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_drain import pipeline as pp

from helpers import EPS32, assert_within_rounding, rounding_chain

LAYERS, WIDTH, ROWS = 8, 16, 3  # ROWS: rows of the batch on each device


def layer(h, w):
    return jnp.tanh(h @ w["kernel"] + w["bias"]) * w["scale"]


def stack(params, x):
    """Every layer of ``params`` (stacked ``[layers, ...]``) in order: the stack in one place."""
    return jax.lax.scan(lambda h, w: (layer(h, w), None), x, params)[0]


def _mesh(shape):
    return Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), ("data", "stage"))


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"kernel": rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH),
              "bias": rng.normal(size=(LAYERS, WIDTH)) * 0.1,
              "scale": 1.0 + 0.1 * rng.normal(size=(LAYERS, WIDTH))}
    return params, rng.normal(size=(8 * ROWS, WIDTH))


def _pipelined(mesh, microbatches, remat=True):
    """(params, x) -> (loss, grads, results): the stack as a pipeline over "stage", the batch split
    over ("data", "stage"), the loss a sum over every row."""
    rows = P(("data", "stage"))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), rows), out_specs=(P(), P("stage"), rows))
    def run(params, x):
        def loss(p):  # this device's rows' part of the loss
            y = pp.pipeline(stack, p, x, axis="stage", microbatches=microbatches, remat=remat)
            return jnp.sum(y ** 2), y

        # The parameters are the same on every data group, so jax sums their gradient over "data";
        # the stage axis's rows reach every stage's layers through the pipeline's collectives.
        (value, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return jax.lax.psum(value, ("data", "stage")), grads, y

    return run


@pytest.mark.parametrize("shape,microbatches,remat", [((2, 4), 4, True), ((2, 4), 12, False), ((4, 2), 3, True)])
def test_pipeline_equals_the_stack_in_one_place(shape, microbatches, remat):
    mesh = _mesh(shape)
    params, x = _problem()
    p32, x32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x))
    value, grads, y = _pipelined(mesh, microbatches, remat)(p32, x32)

    loss = lambda p, x: jnp.sum(stack(p, x) ** 2)  # noqa: E731
    with jax.enable_x64(True):
        p64, x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x))
        want_y = np.asarray(stack(p64, x64))
        want_value, want_grads = jax.value_and_grad(loss)(p64, x64)
        want_grads = jax.tree.map(np.asarray, want_grads)
    # The float32 roundings on the longest chain, forward and backward, of the one-place step
    # (the pipeline adds none: it moves values and drops the stand-in ticks' results).
    additions = rounding_chain(jax.grad(loss), p32, x32)
    assert_within_rounding(np.asarray(y), want_y, additions=rounding_chain(stack, p32, x32), scale=1.0,
                           what="results")
    magnitude = float(np.sum(want_y ** 2))
    assert abs(float(value) - float(want_value)) <= additions * EPS32 * magnitude
    # Scales: a gradient leaf sums over every row and layer after it; its float64 |terms| bound it.
    assert_within_rounding(jax.tree.map(np.asarray, grads), want_grads, additions=additions,
                           scale=magnitude, what="gradients")


def test_a_stage_that_divides_by_a_norm_keeps_finite_gradients():
    """The ticks before a micro-batch reaches a stage run on the first micro-batch, not zeros:
    a stage normalising its input would make zeros NaN, and the dropped results' gradient with it."""
    mesh = _mesh((2, 4))

    def normalised(params, x):
        h = stack(params, x)
        return h / jnp.linalg.norm(h, axis=-1, keepdims=True)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P(("data", "stage"))), out_specs=P("stage"))
    def grads(params, x):
        return jax.grad(lambda p: jnp.sum(pp.pipeline(normalised, p, x, axis="stage", microbatches=4)))(params)

    params, x = _problem(1)
    params = {**params, "bias": np.zeros_like(params["bias"])}  # tanh(0 @ w + 0) = 0: zeros stay zeros
    got = grads(*jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x)))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(got))


def test_schedule_sizes_and_refusals():
    assert pp.num_ticks(8, 4) == 11 and pp.bubble_fraction(8, 4) == pytest.approx(3 / 11)
    mesh = _mesh((2, 4))
    params, x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _problem())

    def call(**options):
        return jax.shard_map(lambda p, x: pp.pipeline(stack, p, x, axis="stage", **options), mesh=mesh,
                             in_specs=(P("stage"), P(("data", "stage"))), out_specs=P(("data", "stage")))(params, x)

    with pytest.raises(ValueError, match=r"5 micro-batches do not divide the 12 rows .* pick a divisor of 12"):
        call(microbatches=5)
    with pytest.raises(ValueError, match="unknown schedule '1f1b'"):
        call(microbatches=4, schedule="1f1b")
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        call(microbatches=0)

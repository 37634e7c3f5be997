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

import jax_drain as jd
from jax_drain import models, pipeline as pp

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


# -- a model's own layer scan, piped -------------------------------------------------------------


def _gpt(dtype):
    return models.GPTConfig(num_layers=4, d_model=32, num_heads=2, seq_len=8, vocab_size=64, scan_layers=True,
                               param_dtype=dtype)


@pytest.mark.parametrize("shape,microbatches", [((2, 4), 8), ((2, 4), 2), ((4, 2), 2)])
def test_a_scanned_gpt_piped_unchanged_equals_it_on_one_device(shape, microbatches):
    """jax_drain's nnx.scan GPT, its loss unchanged: the layer scan found in the trace and piped
    (micro-batches of 1, 4 and 2 rows against 2 rows per device), loss and gradients against the
    float64 model on the whole batch."""
    config = _gpt(jnp.float32)
    params = models.init_params(config, jax.random.key(0))
    batch = models.example_batch(config, 16, jax.random.key(1))
    loss_fn = models.make_loss(config)
    stacked = jd.stacked_leaves(loss_fn, params, batch)
    specs = jax.tree.map(lambda m: P("stage") if m else P(), stacked)
    piped = pp.pipelined(loss_fn, stacked, axis="stage", microbatches=microbatches)

    @jax.jit
    @jax.shard_map(mesh=_mesh(shape), in_specs=(specs, P(("data", "stage"))), out_specs=(P(), specs))
    def step(p, b):  # the mean over the 8 devices' rows, as the one-device loss of the whole batch
        value, grads = jax.value_and_grad(piped)(p, b)
        return jax.lax.psum(value, ("data", "stage")) / 8, jax.tree.map(lambda g: g / 8, grads)

    value, grads = step(params, batch)
    with jax.enable_x64(True):
        config64 = _gpt(jnp.float64)
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        want_value, want_grads = jax.value_and_grad(models.make_loss(config64))(p64, batch)
        want_grads = jax.tree.map(np.asarray, want_grads)
    additions = rounding_chain(jax.grad(loss_fn), params, batch)
    assert abs(float(value) - float(want_value)) <= additions * EPS32 * float(want_value)
    # Per leaf, its own largest gradient as the scale: what the backward adds up there.
    assert_within_rounding(jax.tree.map(np.asarray, grads), want_grads, additions=additions, what="gradients")


def _masked_loss(params, batch):
    """A scanned stack whose body reads a row mask computed from the batch (a loop invariant of
    one row per carried row), and a plain head."""
    keep = (batch["m"] > 0).astype(jnp.float32)[:, None]
    h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * keep, None), batch["x"], params["layers"])[0]
    return jnp.mean((h @ params["head"]) ** 2)


def test_a_row_mask_the_scan_reads_travels_with_its_rows():
    rng = np.random.default_rng(2)
    params = {"layers": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
              "head": jnp.asarray(rng.normal(size=(WIDTH, 2)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32),
             "m": jnp.asarray(rng.integers(0, 2, size=(8 * ROWS,)), jnp.int32)}
    stacked = {"layers": True, "head": False}
    specs = {"layers": P("stage"), "head": P()}
    piped = pp.pipelined(_masked_loss, stacked, axis="stage", microbatches=6)

    @jax.jit
    @jax.shard_map(mesh=_mesh((2, 4)), in_specs=(specs, P(("data", "stage"))), out_specs=(P(), specs))
    def step(p, b):
        value, grads = jax.value_and_grad(piped)(p, b)
        return jax.lax.psum(value, ("data", "stage")) / 8, jax.tree.map(lambda g: g / 8, grads)

    value, grads = step(params, batch)
    with jax.enable_x64(True):
        want_value, want_grads = jax.value_and_grad(_masked_loss)(
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params),
            {"x": jnp.asarray(batch["x"], jnp.float64), "m": batch["m"]})
        want_grads = jax.tree.map(np.asarray, want_grads)
    additions = rounding_chain(jax.grad(_masked_loss), params, batch)
    assert abs(float(value) - float(want_value)) <= additions * EPS32 * float(want_value)
    assert_within_rounding(jax.tree.map(np.asarray, grads), want_grads, additions=additions, what="gradients")


@pytest.mark.parametrize("loss,match", [
    (lambda p, b: (lambda s: jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * s, None), b["x"],
                                                   p["layers"])[0]))(jnp.mean(b["x"])),
     "computed from the batch but not one row per row"),
    (lambda p, b: jnp.mean(b["x"] @ p["layers"][0]), "'layers' is used by"),
    (lambda p, b: jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h), b["x"], p["layers"])[1]),
     "reads a per-layer output"),
    (lambda p, b: jnp.mean(b["x"]) + 0 * jnp.sum(p["layers"]), "is used by"),
])
def test_what_the_pipeline_cannot_give_each_micro_batch_is_refused(loss, match):
    rng = np.random.default_rng(3)
    params = {"layers": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32)}
    piped = pp.pipelined(loss, {"layers": True}, axis="stage", microbatches=4)
    run = jax.shard_map(lambda p, b: jax.lax.psum(piped(p, b), ("data", "stage")), mesh=_mesh((2, 4)),
                        in_specs=({"layers": P("stage")}, P(("data", "stage"))), out_specs=P())
    with pytest.raises(ValueError, match=match):
        run(params, batch)

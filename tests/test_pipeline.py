"""The stage axis: a layer stack run as a GPipe pipeline equals the stack run in one place.

On 8 CPU devices as ``(data, stage)`` = (2, 4) and (4, 2): the schedule's results and the
gradients through it, a model's own layer scan piped unchanged, and ``TrainConfig(stage_axis=)``
training (ZeRO-1 and ZeRO-3), each against one device in float64 or one-device optax, within the
float32 rounding of the computation (counted from its jaxpr); checkpoints that move between stage
counts; what is refused; and on compile-only 8xH100, each stage's drained chain.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_drain as jd
from jax_drain import models, pipeline as pp

from helpers import (
    EPS32, adam_rounding_bounds, assert_within, assert_within_rounding, reference_run, rounding_bound, rounding_chain,
    sgd_rounding_bounds, train_on,
)

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


def test_an_integer_the_carry_holds_travels_through_the_written_out_backward():
    """A carry of rows and an integer per row (a position each layer reads and advances): the
    gradient through GPipe's backward (no cotangent for the integer) is the one-place float64
    gradient's within its rounding."""
    def layer_at(w, carry):
        h, k = carry
        return jnp.tanh(h @ w["kernel"] + w["bias"] * k[:, None].astype(h.dtype)) * w["scale"], k + 1

    def stage(p, carry):
        return jax.lax.scan(lambda c, w: (layer_at(w, c), None), carry, p)[0]

    params, x = _problem(3)
    k = np.arange(x.shape[0]) % 5
    mesh = _mesh((2, 4))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P(("data", "stage")), P(("data", "stage"))),
                   out_specs=P("stage"))
    def grads(p, x_, k_):
        loss = lambda p_: jnp.sum(pp.pipeline(stage, p_, (x_, k_), axis="stage", microbatches=4)[0] ** 2)  # noqa: E731
        return jax.grad(loss)(p)

    p32, x32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x))
    got = grads(p32, x32, jnp.asarray(k, jnp.int32))
    loss = lambda p_, x_: jnp.sum(stage(p_, (x_, jnp.asarray(k, jnp.int32)))[0] ** 2)  # noqa: E731
    with jax.enable_x64(True):
        p64, x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x))
        want = jax.tree.map(np.asarray, jax.grad(loss)(p64, x64))
        magnitude = float(loss(p64, x64))
    assert_within_rounding(jax.tree.map(np.asarray, got), want, additions=rounding_chain(jax.grad(loss), p32, x32),
                           scale=magnitude, what="gradients")


def test_what_a_stage_closes_over_gets_its_gradient_summed_over_the_stages():
    """A stage that closes over a float the same on every stage (a scale, differentiated) and an
    integer computed in the step (positions): the written-out backward hoists them, and the
    scale's gradient is the one-place float64 gradient's within its rounding, summed over the
    stages once (not once per stage)."""
    params, x = _problem(5)
    mesh = _mesh((2, 4))

    def loss_of(p, x_, scale, shift):
        positions = (jnp.arange(x_.shape[1]) + shift) % 3

        def stage(p_, h):
            return jax.lax.scan(lambda c, w: (layer(c, w) * scale + positions * 0.01, None), h, p_)[0]

        return stage, positions

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P(("data", "stage")), P(), P()), out_specs=(P("stage"), P()))
    def grads(p, x_, scale, shift):
        def loss(p_, scale_):
            stage, _ = loss_of(p_, x_, scale_, shift)
            return jnp.sum(pp.pipeline(stage, p_, x_, axis="stage", microbatches=4) ** 2)

        return jax.grad(loss, argnums=(0, 1))(p, scale)  # an invariant input's: summed over every device

    def one_place(p, x_, scale):
        stage, _ = loss_of(p, x_, scale, 1)
        return jnp.sum(stage(p, x_) ** 2)

    p32, x32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x))
    got = grads(p32, x32, jnp.float32(0.9), jnp.int32(1))
    with jax.enable_x64(True):
        p64, x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x))
        want = jax.tree.map(np.asarray, jax.grad(one_place, argnums=(0, 2))(p64, x64, 0.9))
        magnitude = float(one_place(p64, x64, 0.9))
    additions = rounding_chain(jax.grad(one_place, argnums=(0, 2)), p32, x32, jnp.float32(0.9)) + 8
    assert_within_rounding(jax.tree.map(np.asarray, got), want, additions=additions, scale=magnitude,
                           what="gradients")


def _embed_stack_head(params, batch, weighted=False):
    """A loss with something before the stack (an embedding), a row mask the layers read, and a
    head after it: what 1F1B splits between stage 0's rows, the stages and the last stage.
    ``weighted``: the sum over the rows the mask keeps, and how many (a ``WeightedLoss``)."""
    h = jnp.tanh(batch["x"] @ params["embed"])
    keep = batch["keep"][:, None]
    h = jax.lax.scan(lambda h, w: (layer(h, w) * keep + h * (1 - keep), None), h, params["layers"])[0]
    per_row = jnp.sum((h @ params["head"]) ** 2, axis=-1)
    if weighted:
        return jd.WeightedLoss(jnp.sum(per_row * batch["keep"]), jnp.sum(batch["keep"]))
    return jnp.mean(per_row) / 2


@pytest.mark.parametrize("shape,microbatches,weighted,schedule", [
    ((2, 4), 4, False, "1f1b"), ((2, 4), 12, False, "1f1b"), ((4, 2), 2, False, "1f1b"), ((2, 4), 4, True, "1f1b"),
    ((2, 4), 12, False, "1f1b_lockstep"), ((4, 2), 6, True, "1f1b_lockstep")])
def test_one_f_one_b_gives_the_loss_and_gradients_of_the_model_in_one_place(shape, microbatches, weighted, schedule):
    """pipelined(..., schedule="1f1b"), and in lock step: each micro-batch's head and backward
    run as soon as its forward leaves the last stage; the loss summed over the devices and every
    gradient (the embedding's, through the scattered input cotangents; the head's, from the last
    stage; the layers', per stage) equal the one-place model's in float64 within the float32
    rounding of its gradient; a weighted loss's totals and counts add up."""
    rng = np.random.default_rng(5)
    layers, x = _problem(5)
    params = {"layers": layers, "embed": rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH),
              "head": rng.normal(size=(WIDTH, 2))}
    batch = {"x": x, "keep": (rng.random(8 * ROWS) < 0.7).astype(np.float32)}
    stacked = {"layers": {k: True for k in layers}, "embed": False, "head": False}
    specs = {"layers": {k: P("stage") for k in layers}, "embed": P(), "head": P()}
    loss_fn = lambda p, b: _embed_stack_head(p, b, weighted)  # noqa: E731
    piped = pp.pipelined(loss_fn, stacked, axis="stage", microbatches=microbatches, schedule=schedule)

    @jax.jit
    @jax.shard_map(mesh=_mesh(shape), in_specs=(specs, P(("data", "stage"))), out_specs=(P(), P(), specs))
    def run(p, b):
        # jax sums the invariant parameters' gradients over the devices
        (value, count), grads = jax.value_and_grad(lambda q: (lambda out: (out.total, out.count) if weighted else (
            out, jnp.float32(0)))(piped(q, b)), has_aux=True)(p)
        return jax.lax.psum(value, ("data", "stage")), jax.lax.psum(count, ("data", "stage")), grads

    p32, b32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, batch))
    value, count, grads = run(p32, b32)
    if weighted:
        assert float(count) == float(np.sum(batch["keep"]))
        total = lambda p, b: loss_fn(p, b).total  # noqa: E731
    else:
        total = lambda p, b: 8 * loss_fn(p, b)  # noqa: E731  (the devices' losses summed)
    with jax.enable_x64(True):
        p64, b64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, batch))
        want_value, want_grads = jax.value_and_grad(total)(p64, b64)
        want_grads = jax.tree.map(np.asarray, want_grads)
    # The one-place gradient's float32 chain, plus the micro-batches' and devices' sums and the
    # S / M scale of each micro-batch's mean.
    additions = rounding_chain(jax.grad(total), p32, b32) + microbatches + 8 + 1
    assert abs(float(value) - float(want_value)) <= additions * EPS32 * abs(float(want_value))
    # Scales as for GPipe: the loss is a sum of squares, its float64 value the sum of its |terms|.
    assert_within_rounding(jax.tree.map(np.asarray, grads), want_grads, additions=additions,
                           scale=float(want_value), what="1f1b gradients")
    assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))


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


@pytest.mark.parametrize("schedule", ["gpipe", "gpipe, every activation kept", "1f1b"])
def test_a_bf16_stage_s_gradient_is_summed_over_micro_batches_in_accum_dtype(schedule):
    """A bf16 stage ``h * w`` on 4 stages, 16 micro-batches of one row: each micro-batch adds its
    row to every stage's gradient of ``w`` exactly (small integers), 1 from fifteen of them and
    256 from the middle one. Summed in float32 the gradient is 271, cast once to bf16: 272. Summed
    in bf16 (``accum_dtype=None``), 256 + 1 rounds back to 256's neighbourhood at every step:
    264, whatever the order of the sum."""
    stages, microbatches, width = 4, 16, 8
    mesh = Mesh(np.array(jax.devices("cpu")[:stages]), ("stage",))
    rows = np.ones((microbatches, width), np.float32)
    rows[microbatches // 2] = 256.0
    w = jnp.ones((stages, width), jnp.bfloat16)
    stage_fn = lambda p, h: h * p[0]  # noqa: E731

    def grads(accum_dtype):
        if schedule.startswith("gpipe"):
            def loss(p, x):
                return jnp.sum(pp.pipeline(stage_fn, p, x, axis="stage", microbatches=microbatches,
                                           remat=schedule == "gpipe", accum_dtype=accum_dtype).astype(jnp.float32))

            run = lambda p, x: jax.grad(loss)(p, x)  # noqa: E731
            in_specs = (P("stage"), P("stage"))
            x = jnp.asarray(rows, jnp.bfloat16)
        else:
            def run(p, x):
                head = lambda hp, y, m: (jnp.sum(y.astype(jnp.float32)) * hp, ())  # noqa: E731
                return pp.one_f_one_b(stage_fn, p, x, head, jnp.float32(1), axis="stage",
                                      accum_dtype=accum_dtype).stage_grads

            in_specs = (P("stage"), P())
            x = jnp.asarray(rows[:, None, :], jnp.bfloat16)  # [microbatches, rows, width], read on stage 0
        return np.asarray(jax.jit(jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=P("stage")))(w, x),
                          np.float32)

    wide, narrow = grads(jnp.float32), grads(None)
    assert wide.dtype == np.float32 and np.all(wide == 272.0), wide
    assert np.all(narrow == 264.0), narrow


def test_schedule_sizes_and_refusals():
    assert pp.num_ticks(8, 4) == 11 and pp.bubble_fraction(8, 4) == pytest.approx(3 / 11)
    assert [pp.stage_inputs_held(m, 4, "1f1b") for m in (2, 7, 16)] == [2, 4, 4]
    assert [pp.stage_inputs_held(m, 4, "1f1b_lockstep") for m in (2, 7, 16)] == [2, 7, 7]
    assert pp.stage_inputs_held(16, 4) == 19
    mesh = _mesh((2, 4))
    params, x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _problem())

    def call(**options):
        return jax.shard_map(lambda p, x: pp.pipeline(stack, p, x, axis="stage", **options), mesh=mesh,
                             in_specs=(P("stage"), P(("data", "stage"))), out_specs=P(("data", "stage")))(params, x)

    with pytest.raises(ValueError, match=r"5 micro-batches do not divide the 12 rows .* pick a divisor of 12"):
        call(microbatches=5)
    with pytest.raises(ValueError, match="unknown schedule '1f1b'"):
        call(microbatches=4, schedule="1f1b")
    with pytest.raises(ValueError, match="remat=False keeps every activation, which only 'gpipe' does"):
        pp.pipelined(_stack_loss, {"layers": True, "head": False}, axis="stage", microbatches=4, schedule="1f1b",
                     remat=False)
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        call(microbatches=0)


def test_schedule_time_counts_each_tick_at_its_slowest_stage():
    """The closed forms for S >= 2 stages, a backward 2 forwards plus 1 to recompute: GPipe and
    lock step 4 (M + S - 1), Megatron's 1F1B 6 M + 4 S - 6 (its first S ticks forwards alone, a
    backward's every tick after); one stage: a forward and a backward per micro-batch in each."""
    for microbatches, stages in ((2, 2), (8, 2), (8, 4), (16, 4), (5, 3)):
        gpipe = 4 * (microbatches + stages - 1)
        assert pp.schedule_time(microbatches, stages) == gpipe
        assert pp.schedule_time(microbatches, stages, "1f1b_lockstep") == gpipe
        assert pp.schedule_time(microbatches, stages, "1f1b") == 6 * microbatches + 4 * stages - 6
    assert [pp.schedule_time(8, 1, s) for s in pp.SCHEDULES] == [32.0] * 3
    assert pp.schedule_time(8, 2, "1f1b", backward=1.0) == 2 + 2 * (2 * 8 + 2 - 2)  # S ticks of 1, then 2 each
    with pytest.raises(ValueError, match="unknown schedule 'interleaved'"):
        pp.schedule_time(8, 2, "interleaved")


@pytest.mark.parametrize("lockstep", [False, True])
def test_one_f_one_b_stashes_at_most_stages_micro_batches(lockstep):
    """The traced schedule on 4 stages with 16 micro-batches: its loop carries a stash of 4 stage
    inputs (Megatron's bound; in lock step 7), and runs 2 * (16 + 4 - 1) ticks of one forward or
    one backward (in lock step 16 + 2 * 3 of both). With the gradients equal to the model's
    (above), a stash that small shows each backward found its input before a later forward
    overwrote it."""
    stages, microbatches, width = 4, 16, 8
    mesh = Mesh(np.array(jax.devices("cpu")[:stages]), ("stage",))
    head = lambda hp, y, m: (jnp.sum(y * hp), ())  # noqa: E731

    def run(p, x):
        return pp.one_f_one_b(lambda w, h: jnp.tanh(h * w[0]), p, x, head, jnp.float32(1), axis="stage",
                              lockstep=lockstep).stage_grads

    jaxpr = jax.make_jaxpr(jax.shard_map(run, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P("stage")))(
        jnp.ones((stages, width)), jnp.ones((microbatches, 2, width)))
    (loop,) = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    # The carry's per-micro-batch buffers: the stash, and stage 0's input cotangents (all 16).
    held = sorted(v.aval.shape[0] for v in loop.outvars if v.aval.shape[1:] == (2, width))
    assert held == [7 if lockstep else 4, microbatches]
    assert held[0] == pp.stage_inputs_held(microbatches, stages, "1f1b_lockstep" if lockstep else "1f1b")
    assert loop.params["length"] == (microbatches + 2 * (stages - 1) if lockstep else 2 * (microbatches + stages - 1))


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


# -- a model's own layer scan, piped -------------------------------------------------------------


def _gpt(dtype):
    return models.GPTConfig(num_layers=4, d_model=32, num_heads=2, seq_len=8, vocab_size=64, scan_layers=True,
                               param_dtype=dtype)


@pytest.mark.parametrize("shape,microbatches", [((2, 4), 2)])
def test_a_scanned_gpt_piped_unchanged_equals_it_on_one_device(shape, microbatches):
    """jax_drain's nnx.scan GPT, its loss unchanged: the layer scan found in the trace and piped
    (micro-batches of 4 rows against 2 rows per device; the TrainConfig tests below pipe 1 and 2),
    loss and gradients against the float64 model on the whole batch."""
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


_TURNS = np.exp(1j * np.linspace(0.0, np.pi, WIDTH))  # a rotary-style table: a complex constant


def _rotary_loss(params, batch, turns=_TURNS):
    """A stack whose layers turn the activations by a complex table held outside the parameters."""
    table = jnp.asarray(turns, jnp.complex128 if batch["x"].dtype == jnp.float64 else jnp.complex64)

    def layer_(h, w):
        return jnp.tanh(jnp.real((h @ w).astype(table.dtype) * table)), None

    h = jax.lax.scan(layer_, batch["x"], params["layers"])[0]
    return jnp.mean((h @ params["head"]) ** 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_complex_constant_the_layers_read_pipes_in_both_schedules(schedule):
    """1F1B differentiates its stage by hand: a complex table no parameter reaches is held as a
    constant; the gradients equal the float64 model's. A complex value a parameter reaches is
    refused there (GPipe, jax's own gradient, takes it)."""
    rng = np.random.default_rng(4)
    params = {"layers": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
              "head": jnp.asarray(rng.normal(size=(WIDTH, 2)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32)}
    specs = {"layers": P("stage"), "head": P()}

    def run(loss):
        piped = pp.pipelined(loss, {"layers": True, "head": False}, axis="stage", microbatches=6, schedule=schedule)

        @jax.jit
        @jax.shard_map(mesh=_mesh((2, 4)), in_specs=(specs, P(("data", "stage"))), out_specs=(P(), specs))
        def step(p, b):
            value, grads = jax.value_and_grad(piped)(p, b)
            return jax.lax.psum(value, ("data", "stage")) / 8, jax.tree.map(lambda g: g / 8, grads)

        return step(params, batch)

    value, grads = run(_rotary_loss)
    with jax.enable_x64(True):
        want_value, want_grads = jax.value_and_grad(_rotary_loss)(
            jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params), {"x": jnp.asarray(batch["x"], jnp.float64)})
        want_grads = jax.tree.map(np.asarray, want_grads)
    additions = rounding_chain(jax.grad(_rotary_loss), params, batch)
    assert abs(float(value) - float(want_value)) <= additions * EPS32 * float(want_value)
    assert_within_rounding(jax.tree.map(np.asarray, grads), want_grads, additions=additions, what="gradients")

    def reached(p, b):  # the table turned by the head's first weight: a parameter reaches it
        return _rotary_loss(p, b, turns=jnp.exp(1j * p["head"][0, 0] * jnp.asarray(np.angle(_TURNS))))

    if schedule == "gpipe":
        assert np.isfinite(float(run(reached)[0]))
    else:
        with pytest.raises(ValueError, match="a complex value computed from the parameters"):
            run(reached)


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


# -- through TrainConfig(stage_axis=...) ---------------------------------------------------------

STEPS = 3


def _gpt_step(shape, microbatches, batch, shard_params=False, split_leaves=False, schedule="gpipe", accumulate=1):
    config = _gpt(jnp.float32)
    model = models.GPT(config, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    step = jd.make_train_step(model, lambda m, b: m.loss(b), optax.sgd(0.5, momentum=0.9), _mesh(shape),
                              jd.TrainConfig(stage_axis="stage", pipeline_microbatches=microbatches,
                                             pipeline_schedule=schedule, microbatches=accumulate,
                                             bucket_size=1000 if split_leaves else 4096, shard_params=shard_params,
                                             split_leaves=split_leaves),
                              example_batch=batch)
    return config, params, step


@pytest.mark.parametrize("shape,microbatches,shard_params,split_leaves,schedule,accumulate", [
    ((2, 4), 8, False, False, "gpipe", 1), ((4, 2), 4, True, False, "gpipe", 1), ((2, 4), 4, False, True, "1f1b", 1),
    ((4, 2), 2, True, True, "1f1b", 1), ((2, 4), 8, True, False, "1f1b_lockstep", 1),
    ((2, 4), 4, False, False, "1f1b", 2),
    ((4, 2), 2, True, False, "gpipe", 2)])
def test_a_stage_axis_trains_like_one_device_sgd_and_resumes_bit_for_bit(shape, microbatches, shard_params,
                                                                        split_leaves, schedule, accumulate, tmp_path):
    """An nnx scanned GPT, unchanged, with TrainConfig(stage_axis="stage"), ZeRO-1 and ZeRO-3,
    whole leaves or leaves split over buckets, GPipe and 1F1B (also in lock step), with gradient accumulation
    (``microbatches``) or without: each device holds its stage's layers (with ZeRO-3, its shard
    of them), and SGD with momentum follows one-device optax on whole batches within the
    rounding of its gradients (the one-place step's chain, plus the 8 devices and the
    micro-batches summed)."""
    batches = [models.example_batch(_gpt(jnp.float32), 16, jax.random.key(i)) for i in range(1, STEPS + 3)]
    config, params, step = _gpt_step(shape, microbatches, batches[0], shard_params, split_leaves, schedule, accumulate)
    assert (step.stage_axis, step.pipeline_microbatches, step.pipeline_schedule) == ("stage", microbatches, schedule)
    assert all(chain.layout.split == split_leaves for chain in step.sync.chains if chain.layout.num_buckets > 1)
    state = step.init()
    stages = shape[1]
    if shard_params:
        assert isinstance(state.params, jd.zero3.ParamShards)
    else:
        for path, x in jax.tree_util.tree_leaves_with_path(state.params):
            held = {s.data.shape for s in x.addressable_shards}
            if "blocks" in jax.tree_util.keystr(path):  # this stage's layers only
                assert held == {(config.num_layers // stages, *x.shape[1:])}, path
            else:
                assert held == {x.shape}, path
    state = train_on(step, batches[:STEPS], state)
    loss_fn = models.make_loss(config)
    want, _, gradients = reference_run(loss_fn, params, optax.sgd(0.5, momentum=0.9), batches[:STEPS])
    additions = rounding_chain(jax.grad(loss_fn), params, batches[0]) + 8 + microbatches + accumulate
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.5, momentum=0.9, params=params)
    got = step.master_params(state) if shard_params else state.params
    assert_within(jax.device_get(got), want, bounds[-1], what=f"{shape} after {STEPS} steps")

    # Saved, restored into a fresh step, run on: the same losses, bit for bit.
    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = [float(step(state, b)[1].loss) for b in batches[STEPS:STEPS + 1]]
    _, _, fresh = _gpt_step(shape, microbatches, batches[0], shard_params, split_leaves, schedule, accumulate)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", fresh.abstract_state())
    assert [float(fresh(restored, b)[1].loss) for b in batches[STEPS:STEPS + 1]] == continued


@pytest.mark.parametrize("shape,schedule,shard_params", [((2, 4), "gpipe", False), ((4, 2), "1f1b", True)])
def test_a_list_of_blocks_is_stacked_over_the_stages_and_trains_like_one_device(shape, schedule, shard_params,
                                                                                 tmp_path):
    """The unscanned GPT (``nnx.List`` of blocks, each with its own parameters), unchanged: the
    step stacks the blocks, reruns the loss's copies of the block as one scan, holds each
    stage's blocks on that stage, trains like one-device optax within the rounding of its
    gradients, with AdamW's weight-decay mask read on the model's own tree (by ``ndim``: a
    block's norm scale is 1-D there, 2-D stacked), gives the model its own tree back, and
    restores a checkpoint bit for bit, onto another stage count, onto the blocks one by one
    without a stage axis (with the other ZeRO stage) and back."""
    config = dataclasses.replace(_gpt(jnp.float32), scan_layers=False)
    LR, WD = 1e-2, 0.5
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731 - kernels and embeddings
    batches = [models.example_batch(config, 16, jax.random.key(i)) for i in range(1, STEPS + 3)]

    def build(mesh_shape, schedule=schedule, shard_params=shard_params, stage=True):
        model = models.GPT(config, rngs=nnx.Rngs(0))
        options = dict(stage_axis="stage", pipeline_microbatches=4, pipeline_schedule=schedule) if stage else {}
        mesh = _mesh(mesh_shape) if stage else Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
        return model, jd.make_train_step(model, lambda m, b: m.loss(b), jd.adamw(LR, weight_decay=WD, mask=decay), mesh,
                                         jd.TrainConfig(bucket_size=4096, shard_params=shard_params, **options),
                                         example_batch=batches[0])

    model, step = build(shape)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = step.init()
    if not shard_params:  # each stage holds its own blocks: a [layers / stages, ...] share of the stack
        stacked = state.params["blocks"]["[0..3]"]
        for leaf in jax.tree.leaves(stacked):
            assert {s.data.shape for s in leaf.addressable_shards} == {(4 // shape[1], *leaf.shape[1:])}
    state = train_on(step, batches[:STEPS], state)
    loss_fn = models.make_loss(config)
    want, _, gradients = reference_run(loss_fn, params, optax.adamw(LR, weight_decay=WD, mask=decay), batches[:STEPS])
    additions = rounding_chain(jax.grad(loss_fn), params, batches[0]) + 8 + 4
    bounds = adam_rounding_bounds(gradients, additions=additions, learning_rate=LR, params=params, weight_decay=WD)
    got = step.master_params(state)
    assert jax.tree.structure(got) == jax.tree.structure(params)  # the model's own tree: block by block
    assert_within(got, want, bounds[-1], what=f"{shape} {schedule} after {STEPS} steps")
    step.update_model(model, state)
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))), jax.tree.leaves(got)))

    jd.save_checkpoint(tmp_path / "ckpt", state)
    continued = float(step(state, batches[STEPS])[1].loss)
    _, fresh = build(shape)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", fresh.abstract_state())
    restored_params = fresh.master_params(restored)
    assert float(fresh(restored, batches[STEPS])[1].loss) == continued
    _, other = build(shape[::-1], schedule="gpipe" if schedule != "gpipe" else "1f1b")
    moved, _ = jd.restore_checkpoint(tmp_path / "ckpt", other.abstract_state())
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(other.master_params(moved))),
                                                    jax.tree.leaves(restored_params)))
    # To the blocks one by one (no stage axis) and back: the parameters bit for bit, the step runs on.
    _, flat = build(None, stage=False, shard_params=not shard_params)
    unstacked, _ = jd.restore_checkpoint(tmp_path / "ckpt", flat.abstract_state())
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(flat.master_params(unstacked))),
                                                    jax.tree.leaves(restored_params)))
    unstacked, metrics = flat(unstacked, batches[STEPS])
    # The same loss at the same parameters, summed in another order: within its forward's rounding
    # (a cross entropy of positive terms: the loss is their magnitude).
    forward = rounding_chain(loss_fn, params, batches[STEPS]) + 8 + 4
    assert abs(float(metrics.loss) - continued) <= rounding_bound(forward, abs(continued))
    jd.save_checkpoint(tmp_path / "flat", unstacked)
    _, again = build(shape)
    back, _ = jd.restore_checkpoint(tmp_path / "flat", again.abstract_state())
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(again.master_params(back))),
                                                    jax.tree.leaves(flat.master_params(unstacked))))
    assert np.isfinite(float(again(back, batches[STEPS + 1])[1].loss))


class _DropBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(jnp.tanh(self.linear(x)))


class _DropList(nnx.Module):
    """A list of blocks with dropout: each block's RNG stream is its own model state, or the
    blocks run in evaluation mode and only the head drops."""

    def __init__(self, rngs, blocks_drop=True):
        self.blocks = nnx.List([_DropBlock(rngs) for _ in range(4)])
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)
        if not blocks_drop:
            for block in self.blocks:
                block.dropout.deterministic = True

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.dropout(x))


def test_a_list_of_blocks_reads_the_model_s_state_and_refuses_a_stream_per_block():
    batch = {"x": jnp.asarray(np.random.default_rng(5).normal(size=(16, WIDTH)), jnp.float32)}
    config = jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4)
    loss = lambda m, b: jnp.mean(m(b["x"]) ** 2)  # noqa: E731
    step = jd.make_train_step(_DropList(nnx.Rngs(0), blocks_drop=False), loss, optax.sgd(0.1), _mesh((2, 4)), config,
                              example_batch=batch)
    state = step.init()
    counts = [np.asarray(x) for x in jax.tree.leaves(state.model_state)]
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics.loss))
    moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(counts, jax.tree.leaves(state.model_state))]
    assert any(moved)  # the head's stream moved on
    with pytest.raises(ValueError, match=r"blocks/\{0, 1, 2, 3\}: .*per-block model state"):
        jd.make_train_step(_DropList(nnx.Rngs(0)), loss, optax.sgd(0.1), _mesh((2, 4)), config, example_batch=batch)


def test_a_list_of_blocks_the_stages_cannot_run_stacked_is_refused_saying_why():
    """A mask that tells the identical blocks apart has no one entry for the stacked leaf; a
    block that reads another's parameters is not a copy of one block."""
    config = dataclasses.replace(_gpt(jnp.float32), scan_layers=False)
    batch = models.example_batch(config, 16, jax.random.key(1))
    stage = jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, bucket_size=4096)
    first_only = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: "blocks/0/" in jax.tree_util.keystr(path, simple=True, separator="/"), p)
    step = jd.make_train_step(models.GPT(config, rngs=nnx.Rngs(0)), lambda m, b: m.loss(b),
                              jd.adamw(1e-2, weight_decay=0.5, mask=first_only), _mesh((2, 4)), stage,
                              example_batch=batch)
    with pytest.raises(ValueError, match="tells the model's identical blocks apart"):
        step(step.init(), batch)

    def tied(model, batch):  # every block also reads block 0's output projection
        for block in model.blocks:
            block.attn.out.kernel = model.blocks[0].attn.out.kernel
        return model.loss(batch)

    with pytest.raises(ValueError, match=r"the loss has neither: .*blocks/\{0, 1, 2, 3\}"):
        jd.make_train_step(models.GPT(config, rngs=nnx.Rngs(0)), tied, optax.sgd(0.1), _mesh((2, 4)), stage,
                           example_batch=batch)

    # Blocks sharded unalike have no one spec for the stacked leaf.
    rng = np.random.default_rng(9)
    params = _as_list({"layers": {"up": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)), jnp.float32),
                                  "down": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)), jnp.float32)},
                       "head": jnp.asarray(rng.normal(size=(WIDTH, 1)), jnp.float32)})
    specs = {"layers": [{"up": P(None, "model"), "down": P("model", None)}] * (LAYERS - 1)
             + [{"up": P("model", None), "down": P(None, "model")}], "head": P()}
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
    xy = {"x": jnp.ones((8 * ROWS, WIDTH), jnp.float32), "y": jnp.ones((8 * ROWS, 1), jnp.float32)}
    with pytest.raises(ValueError, match="sharded unalike"):
        jd.make_train_step(params, _tp_loss("model"), optax.sgd(0.1), mesh,
                           jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, param_specs=specs),
                           example_batch=xy)


def _stack_loss(params, batch):
    if isinstance(params["layers"], list):  # a list of blocks, each with its own parameters
        h = batch["x"]
        for w in params["layers"]:
            h = layer(h, w)
    else:
        h = jax.lax.scan(lambda h, w: (layer(h, w), None), batch["x"], params["layers"])[0]
    return jnp.mean((h @ params["head"]) ** 2)


def _as_list(tree):
    """A scanned stack's ``layers`` as a list of per-layer blocks (the same values)."""
    layers = tree["layers"]
    count = len(jax.tree.leaves(layers)[0])
    return {**tree, "layers": [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(count)]}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_non_finite_step_on_one_stage_s_rows_keeps_every_stage_s_state(schedule):
    rng = np.random.default_rng(4)
    params, x = _problem(4)
    params = {"layers": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
              "head": jnp.asarray(rng.normal(size=(WIDTH, 2)), jnp.float32)}
    batch = {"x": jnp.asarray(x, jnp.float32)}
    step = jd.make_train_step(params, _stack_loss, optax.adam(1e-2), _mesh((2, 4)),
                              jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, pipeline_schedule=schedule),
                              example_batch=batch)
    state, _ = step(step.init(), batch)
    before = jax.device_get(state)
    bad = {"x": batch["x"].at[5, 3].set(jnp.nan)}  # a row of one device of one stage
    state, metrics = step(state, bad)
    assert bool(metrics.skipped)
    assert all(np.array_equal(a, b, equal_nan=True)
               for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before.params)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(state.opt_state)),
                                                    jax.tree.leaves(before.opt_state)))


@pytest.mark.parametrize("schedule,model_axis,blocks", [("gpipe", False, False), ("1f1b", False, False),
                                                       ("gpipe", True, False), ("1f1b", False, True)])
def test_error_feedback_per_stage_brings_an_int8_wire_closer_and_zero3_feeds_back_what_zero1_does(schedule,
                                                                                                  model_axis, blocks):
    """Each stage's chain carries its own residuals: over 30 SGD steps on (data, stage) = (2, 4),
    in either schedule, or on (data, stage, model) = (2, 2, 2) with the layers split over "model"
    by XLA (``tensor_parallel="gspmd"``), an int8 wire with error feedback lands closer to the
    fp32-accumulated step's parameters than without, and ZeRO-3 gives ZeRO-1's parameters and
    residuals bit for bit (the same gradient, the same residual added to each bucket). ``blocks``:
    the layers as a list of blocks, which the step stacks."""
    rng = np.random.default_rng(4)
    params, _ = _problem(4)
    params = {"layers": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
              "head": jnp.asarray(rng.normal(size=(WIDTH, 2)), jnp.float32)}
    params = _as_list(params) if blocks else params
    batches = [{"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32)} for _ in range(30)]

    def final(**options):
        config = dict(stage_axis="stage", pipeline_microbatches=4, pipeline_schedule=schedule, bucket_size=64,
                      reduce="int8_accum", error_feedback=True, donate=False) | options
        mesh = _mesh((2, 4))
        if model_axis:
            mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
            config |= dict(tensor_parallel="gspmd", param_specs={
                "layers": {"kernel": P(None, None, "model"), "bias": P(None, "model"), "scale": P(None, "model")},
                "head": P()})
        step = jd.make_train_step(params, _stack_loss, optax.sgd(0.1), mesh, jd.TrainConfig(**config),
                                  example_batch=batches[0])
        state = step.init()
        for batch in batches:
            state, _ = step(state, batch)
        got = step.master_params(state) if options.get("shard_params") or blocks else state.params
        residuals = None if state.error_feedback is None else jax.tree.leaves(jax.device_get(state.error_feedback))
        return jax.tree.leaves(jax.device_get(got)), residuals

    exact, _ = final(reduce="fp32_accum", error_feedback=False)
    (plain, _), (fed, residuals), (fed3, residuals3) = final(error_feedback=False), final(), final(shard_params=True)
    distance = lambda p: np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(p, exact)))  # noqa: E731
    assert distance(fed) < distance(plain), (distance(fed), distance(plain))
    assert len(residuals) >= 2 and all(np.asarray(r).any() for r in residuals)  # the stage's chain and the rest
    assert all(np.array_equal(a, b) for a, b in zip(residuals3, residuals))
    assert all(np.array_equal(a, b) for a, b in zip(fed3, fed))


@pytest.mark.parametrize("options,match", [
    (dict(stage_axis="stage", expert=lambda path: False), "stage_axis does not work with expert"),
    (dict(pipeline_microbatches=4), "give stage_axis too"),
    (dict(stage_axis="stage", pipeline_schedule="interleaved"), "must be one of gpipe, 1f1b"),
    (dict(stage_axis="data"), "besides the data axes"),
])
def test_a_stage_axis_refuses_what_it_does_not_do_yet(options, match):
    with pytest.raises(ValueError, match=match):
        jd.TrainConfig(**options)


def test_a_stage_axis_needs_a_stack_the_stages_split():
    params, x = _problem()
    params = {"layers": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
              "head": jnp.ones((WIDTH, 2), jnp.float32)}
    batch = {"x": jnp.asarray(x, jnp.float32)}
    config = jd.TrainConfig(stage_axis="stage")
    with pytest.raises(ValueError, match="give make_train_step an example_batch"):
        jd.make_train_step(params, _stack_loss, optax.sgd(0.1), _mesh((2, 4)), config)
    with pytest.raises(ValueError, match=r"8 micro-batches \(pipeline_microbatches\) do not divide the 12 rows"):
        jd.make_train_step(params, _stack_loss, optax.sgd(0.1), _mesh((2, 4)), config, example_batch=batch)
    config = jd.TrainConfig(stage_axis="stage", pipeline_microbatches=3)
    with pytest.raises(ValueError, match="the loss has neither"):
        jd.make_train_step(params, lambda p, b: jnp.mean(b["x"] @ p["head"]) + 0 * jnp.sum(p["layers"]["bias"]),
                           optax.sgd(0.1), _mesh((2, 4)), config, example_batch=batch)
    with pytest.raises(ValueError, match="the stack has 8 layers, which 3 stages do not split equally"):
        mesh = Mesh(np.array(jax.devices("cpu")[:6]).reshape(2, 3), ("data", "stage"))
        jd.make_train_step(params, _stack_loss, optax.sgd(0.1), mesh, config, example_batch={"x": batch["x"][:18]})


@pytest.mark.parametrize("saved_by,moved_to", [("gpipe", "1f1b"), ("1f1b", "gpipe")])
def test_a_stage_axis_checkpoint_moves_to_other_stage_counts_and_to_no_pipeline(saved_by, moved_to, tmp_path):
    """Saved on (data, stage) = (2, 4) by one schedule, restored onto (4, 2) with the other and
    onto a plain data-parallel step (whole-leaf buckets, or the scanned stack's in-scan sync):
    the parameters arrive bit for bit, and each step runs on from them."""
    batch = models.example_batch(_gpt(jnp.float32), 16, jax.random.key(1))
    _, _, staged = _gpt_step((2, 4), 8, batch, schedule=saved_by)
    state, _ = staged(staged.init(), batch)
    jd.save_checkpoint(tmp_path / "ckpt", state)
    saved = jax.device_get(state)
    data = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    for name, mesh, config in (
            ("stage=2", _mesh((4, 2)), jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, bucket_size=4096,
                                                      pipeline_schedule=moved_to)),
            ("no pipeline", data, jd.TrainConfig(bucket_size=4096)),
            ("no pipeline, in-scan sync", data, jd.TrainConfig(bucket_size=4096, scan_layers=True))):
        model = models.GPT(_gpt(jnp.float32), rngs=nnx.Rngs(0))
        other = jd.make_train_step(model, lambda m, b: m.loss(b), optax.sgd(0.5, momentum=0.9), mesh, config,
                                   example_batch=batch)
        restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", other.abstract_state())
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(restored.params)),
                                                        jax.tree.leaves(saved.params))), name
        assert np.isfinite(float(other(restored, batch)[1].loss)), name


class _NormBlock(nnx.Module):
    def __init__(self, rngs, train):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.BatchNorm(WIDTH, use_running_average=not train, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, deterministic=not train, rngs=rngs)

    def __call__(self, x):
        return self.dropout(jnp.tanh(self.norm(self.linear(x))))


class _NormStack(nnx.Module):
    """Flax's scan-over-layers pattern: blocks made under nnx.vmap, run under nnx.scan; each
    block's BatchNorm statistics and dropout RNG key and count are per-layer state beside its
    parameters."""

    def __init__(self, rngs, train=False):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(axis_size=LAYERS)
        def blocks(rngs):
            return _NormBlock(rngs, train)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        x, _ = nnx.scan(lambda h, block: (block(h), None))(x, self.blocks)
        return self.head(x)


def _norm_stack(train=False):
    model = _NormStack(nnx.Rngs(1), train)
    rng = np.random.default_rng(8)  # statistics that differ layer by layer, so each stage must read its own
    model.blocks.norm.mean[...] = jnp.asarray(rng.normal(size=(LAYERS, WIDTH)) / 2, jnp.float32)
    model.blocks.norm.var[...] = jnp.asarray(rng.uniform(0.5, 2.0, size=(LAYERS, WIDTH)), jnp.float32)
    return model


def _norm_loss(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


@pytest.mark.parametrize("shard_params,schedule", [(False, "gpipe"), (True, "gpipe"), (True, "1f1b")])
def test_per_layer_model_state_reaches_each_stage_s_layers(shard_params, schedule):
    """The layers' running statistics (evaluation mode) and dropout keys are per-layer model
    state: each stage reads its own layers' share, and SGD follows one-device optax on whole
    batches within the rounding of its gradients, ZeRO-1 and ZeRO-3, GPipe and 1F1B; the state
    itself is handed back unchanged."""
    rng = np.random.default_rng(9)
    batches = [{"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8 * ROWS,)), jnp.float32)} for _ in range(STEPS)]
    model = _norm_stack()
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    start = jax.device_get(nnx.to_pure_dict(params))  # before the step updates the model's variables
    plain = lambda state: [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
                           for x in jax.tree.leaves(nnx.to_pure_dict(state))]  # noqa: E731
    want_state = plain(other)
    step = jd.make_train_step(model, _norm_loss, optax.sgd(0.2), _mesh((2, 4)),
                              jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, shard_params=shard_params,
                                             pipeline_schedule=schedule),
                              example_batch=batches[0])
    step.update_model(model, train_on(step, batches))
    got_state = plain(nnx.state(model, nnx.Not(nnx.Param)))
    assert len(got_state) == len(want_state) == 4 and all(map(np.array_equal, got_state, want_state))

    loss_fn = lambda p, b: _norm_loss(nnx.merge(graphdef, p, other, copy=True), b)  # noqa: E731
    want, _, gradients = reference_run(lambda p, b: loss_fn(nnx.State(p), b), start, optax.sgd(0.2), batches)
    additions = rounding_chain(jax.grad(lambda p, b: loss_fn(nnx.State(p), b)), start, batches[0]) + 8 + 4
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.2, params=start)
    assert_within(nnx.to_pure_dict(nnx.state(model, nnx.Param)), want, bounds[-1], what="after 3 steps")


def test_a_stack_whose_layers_update_their_state_is_refused():
    batch = {"x": jnp.asarray(np.random.default_rng(6).normal(size=(8 * ROWS, WIDTH)), jnp.float32),
             "y": jnp.zeros((8 * ROWS,), jnp.float32)}
    config = jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4)
    with pytest.raises(ValueError, match="per-layer state the layers update"):
        jd.make_train_step(_norm_stack(train=True), _norm_loss, optax.sgd(0.1), _mesh((2, 4)), config,
                           example_batch=batch)


@pytest.mark.parametrize("shard_params,schedule", [(False, "gpipe"), (True, "1f1b")])
def test_a_model_that_is_all_stack_trains_like_one_device(shard_params, schedule, tmp_path):
    """Every parameter in the scanned stack, nothing before or after it: the stage axis splits all
    but the smallest stacked leaf ("bias"), which stays whole on every stage, each stage reading
    its own rows of it. 3 SGD steps on (data, stage) = (2, 4) follow one-device optax within the
    rounding of the gradients, GPipe with ZeRO-1 and 1F1B with ZeRO-3; the state restored from a
    checkpoint takes the next step bit for bit as the state itself does."""
    rng = np.random.default_rng(8)
    params, _ = _problem(8)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    batches = [{"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32)} for _ in range(STEPS)]
    loss = lambda p, b: jnp.mean((stack(p, b["x"]) - b["y"]) ** 2)  # noqa: E731
    step = jd.make_train_step(params, loss, optax.sgd(0.5), _mesh((2, 4)),
                              jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, bucket_size=256,
                                             shard_params=shard_params, pipeline_schedule=schedule),
                              example_batch=batches[0])
    state = train_on(step, batches)
    if not shard_params:
        held = {k: {s.data.shape for s in x.addressable_shards} for k, x in state.params.items()}
        assert held == {"kernel": {(LAYERS // 4, WIDTH, WIDTH)}, "bias": {(LAYERS, WIDTH)},
                        "scale": {(LAYERS // 4, WIDTH)}}, held
    want, _, gradients = reference_run(loss, params, optax.sgd(0.5), batches)
    additions = rounding_chain(jax.grad(loss), params, batches[0]) + 8 + 4
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.5, params=params)
    got = step.master_params(state) if shard_params else state.params
    assert_within(jax.device_get(got), want, bounds[-1], what=f"after {STEPS} steps ({schedule}, {shard_params=})")
    jd.save_checkpoint(tmp_path / "ckpt", state)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    assert float(step(restored, batches[0])[1].loss) == float(step(state, batches[0])[1].loss)


class _Count(nnx.Variable):
    pass


class _CountedCalls(nnx.Module):
    """A model that counts its calls in its state, outside the stack."""

    def __init__(self):
        self.model = _norm_stack()
        self.calls = _Count(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.model(x)


def test_one_f_one_b_refuses_a_loss_that_updates_its_state():
    """1F1B runs what follows the stack once per micro-batch on the last stage: a loss that
    updates its state would update it there alone. GPipe runs it once per device, and trains."""
    batch = {"x": jnp.asarray(np.random.default_rng(6).normal(size=(8 * ROWS, WIDTH)), jnp.float32),
             "y": jnp.asarray(np.random.default_rng(7).normal(size=(8 * ROWS,)), jnp.float32)}
    def build(model, schedule):
        config = jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, pipeline_schedule=schedule)
        return jd.make_train_step(model, _norm_loss, optax.sgd(0.1), _mesh((2, 4)), config, example_batch=batch)

    model = _CountedCalls()
    step = build(model, "gpipe")
    state, _ = step(step.init(), batch)
    step.update_model(model, state)
    assert int(model.calls[...]) == 1
    with pytest.raises(ValueError, match="the loss updates its state .* use pipeline_schedule='gpipe'"):
        step = build(_CountedCalls(), "1f1b")
        step(step.init(), batch)


@pytest.mark.gpu_compile
def test_one_f_one_b_s_bound_is_in_xla_s_buffer_assignment():
    """Compile-only 8xH100, 4 stages, 16 micro-batches of 1024 x 1024 bf16 rows (2 MiB each):
    Megatron's bound stashes 4 stage inputs where lock step stashes 7, and holds the last stage's
    cotangent for one tick, which lock step does not, so XLA assigns it 2 stage inputs less temp
    (to the nearest input: the other buffers are scalars and the stage's small weights)."""
    from jax_drain.planner.targets import gpu_mesh

    stages, microbatches, rows, width = 4, 16, 1024, 1024
    mesh = gpu_mesh((2, stages), ("data", "stage"))
    head = lambda hp, y, m: (jnp.sum(y.astype(jnp.float32)) * hp, ())  # noqa: E731

    def temp(lockstep):
        def grads(w, x):
            return pp.one_f_one_b(lambda p, h: jnp.tanh(h @ p[0]), w, x, head, jnp.float32(1), axis="stage",
                                  lockstep=lockstep).stage_grads

        step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P("stage")))
        w = jax.ShapeDtypeStruct((stages, width, width), jnp.bfloat16, sharding=NamedSharding(mesh, P("stage")))
        x = jax.ShapeDtypeStruct((microbatches, rows, width), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        return step.lower(w, x).compile().memory_analysis().temp_size_in_bytes

    stage_input = rows * width * 2
    bounded, lockstep = temp(False), temp(True)
    assert round((lockstep - bounded) / stage_input) == (7 - 4) - 1, (bounded, lockstep)


@pytest.mark.gpu_compile
def test_each_stage_s_drained_chain_holds_one_bucket_in_flight_on_the_gpu_schedule():
    """Compile-only 8xH100, (data, stage) = (2, 4), XLA allowed 4 collectives in flight: the
    stage's layer chain (4 buckets) keeps one bucket in flight drained, in either schedule, and 3
    undrained."""
    from jax_drain.planner.plan import plan
    from jax_drain.planner.targets import gpu_mesh

    config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, vocab_size=512, scan_layers=True)
    params, batch = models.abstract_params(config), models.example_batch(config, 16)
    in_flight = {}
    for schedule, drain in (("gpipe", True), ("1f1b", True), ("1f1b", False)):
        step = jd.make_train_step(params, models.make_loss(config), optax.adamw(1e-4), gpu_mesh((2, 4), ("data", "stage")),
                                  jd.TrainConfig(stage_axis="stage", pipeline_microbatches=8, bucket_size=40_000,
                                                 drain=drain, pipeline_schedule=schedule), example_batch=batch)
        layers = next(chain for chain in step.sync.chains if chain.axes == ("data",))
        assert layers.layout.num_buckets == 4
        report = plan(step, step.abstract_state(), batch,
                      compiler_options={"xla_gpu_experimental_parallel_collective_overlap_limit": 4})
        in_flight[schedule, drain] = report.chains_in_flight["expert"]
    assert in_flight == {("gpipe", True): 1, ("1f1b", True): 1, ("1f1b", False): 3}


@pytest.mark.gpu_compile
def test_a_list_of_blocks_compiles_to_the_scanned_stack_s_memory_on_the_gpu():
    """Compile-only 8xH100, (data, stage) = (2, 4), 1F1B: the GPT written as a list of blocks,
    stacked and rerolled by the step, gets XLA's buffer assignment of the same GPT written with
    ``nnx.scan`` (temp and arguments), and its stage chain holds one bucket in flight. (GPipe
    runs the same rerolled loss: the planner gives it the same temp too, 1,308.2 MiB for both
    presets at ``+pp2``.)"""
    from jax_drain.planner.plan import plan
    from jax_drain.planner.targets import gpu_mesh

    memory, in_flight, schedule = {}, {}, "1f1b"
    for scan in (True, False):
        config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, vocab_size=512, scan_layers=scan)
        params, batch = models.abstract_params(config), models.example_batch(config, 16)
        step = jd.make_train_step(params, models.make_loss(config), optax.adamw(1e-4), gpu_mesh((2, 4), ("data", "stage")),
                                  jd.TrainConfig(stage_axis="stage", pipeline_microbatches=8, bucket_size=40_000,
                                                 pipeline_schedule=schedule), example_batch=batch)
        report = plan(step, step.abstract_state(), batch,
                      compiler_options={"xla_gpu_experimental_parallel_collective_overlap_limit": 4})
        memory[scan] = (report.temp_bytes, report.argument_bytes)
        in_flight[scan] = report.chains_in_flight["expert"]
    assert memory[False] == memory[True], memory
    assert in_flight == {True: 1, False: 1}


@pytest.mark.gpu_compile
def test_with_xla_s_tensor_parallel_each_stage_s_chain_holds_one_bucket_in_flight_on_the_gpu_schedule():
    """Compile-only 8xH100, (data, stage, model) = (2, 2, 2), the scanned GPT's blocks split by
    Megatron's rule and partitioned by XLA (``tensor_parallel="gspmd"``), XLA allowed 4
    collectives in flight: the stage's layer chain keeps one bucket in flight drained, more
    undrained; each of its buckets is one reduce."""
    from jax_drain.planner.plan import plan
    from jax_drain.planner.targets import gpu_mesh

    config = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, vocab_size=512, scan_layers=True)
    params, batch = models.abstract_params(config), models.example_batch(config, 16)
    in_flight = {}
    for drain in (True, False):
        step = jd.make_train_step(params, models.make_loss(config), optax.adamw(1e-4),
                                  gpu_mesh((2, 2, 2), ("data", "stage", "model")),
                                  jd.TrainConfig(stage_axis="stage", pipeline_microbatches=4, bucket_size=20_000,
                                                 drain=drain, tensor_parallel="gspmd",
                                                 param_specs=models.tensor_parallel_specs(params, "model")),
                                  example_batch=batch)
        layers = next(chain for chain in step.sync.chains if chain.axes == ("data",))
        assert step.tensor_parallel == "gspmd" and layers.layout.num_buckets >= 3
        report = plan(step, step.abstract_state(), batch,
                      compiler_options={"xla_gpu_experimental_parallel_collective_overlap_limit": 4})
        reduced = sorted(ref[1] for refs in report.collective_buckets for ref in refs if ref[0] == "expert")
        assert reduced == list(range(layers.layout.num_buckets)), reduced
        in_flight[drain] = report.chains_in_flight["expert"]
    assert in_flight[True] == 1 and in_flight[False] > 1, in_flight


def _tp_layer(h, w, model_axis):
    """A Megatron MLP block: ``up`` split by columns, ``down`` by rows, one sum over the model axis
    (none on one device, where the weights are whole)."""
    out = jnp.tanh(h @ w["up"]) @ w["down"]
    return h + (out if model_axis is None else jax.lax.psum(out, model_axis))


def _tp_loss(model_axis):
    def loss(params, batch):
        if isinstance(params["layers"], list):  # a list of blocks, each with its own parameters
            h = batch["x"]
            for w in params["layers"]:
                h = _tp_layer(h, w, model_axis)
        else:
            h = jax.lax.scan(lambda h, w: (_tp_layer(h, w, model_axis), None), batch["x"], params["layers"])[0]
        return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

    return loss


def _all_gather_groups(program: str) -> list[set[frozenset[int]]]:
    """The replica groups of every all-gather in a compiled HLO ``program``, listed
    (``{{0,2},{1,3}}``) or in XLA's iota form (``[2,2]<=[2,2]T(1,0)``: device ids laid out as
    ``[2,2]``, transposed, cut into groups)."""
    found = []
    for line in program.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        listed = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
        iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        if listed:
            groups = [g.split(",") for g in re.findall(r"\{([\d,]+)\}", listed.group(1))]
        else:
            assert iota, f"an all-gather whose replica groups this test does not read: {line.strip()[:200]}"
            dims = [int(d) for d in iota.group(3).split(",")]
            ids = np.arange(int(np.prod(dims))).reshape(dims)
            if iota.group(4):
                ids = ids.transpose([int(a) for a in iota.group(4).split(",")])
            groups = ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
        found.append({frozenset(map(int, g)) for g in groups})
    return found


#: Gradient accumulation and leaves split over buckets, with each tensor-parallel mode.
ACCUMULATED = dict(microbatches=2, pipeline_microbatches=3, split_leaves=True, bucket_size=100)


@pytest.mark.parametrize("tensor_parallel,shard_params,schedule,extra,blocks", [
    ("manual", False, "gpipe", {}, False), ("manual", True, "gpipe", {}, False), ("manual", False, "1f1b", {}, False),
    ("manual", True, "1f1b", {}, False), ("gspmd", False, "gpipe", {}, False), ("declared", True, "gpipe", {}, False),
    ("gspmd", True, "1f1b", {}, False), ("declared", False, "1f1b", {}, False),
    ("manual", True, "gpipe", ACCUMULATED, False), ("gspmd", False, "1f1b", ACCUMULATED, False),
    ("manual", False, "1f1b", ACCUMULATED, True), ("gspmd", True, "gpipe", {}, True)])
def test_a_stage_axis_with_tensor_parallel_trains_like_one_device(tensor_parallel, shard_params, schedule, extra,
                                                                  blocks, tmp_path):
    """(data, stage, model) = (2, 2, 2): the stack's blocks split over "model" (their layer axis
    left to the stage axis), ZeRO-1 and ZeRO-3, GPipe and 1F1B, against one-device SGD. The
    tensor parallelism hand-written (``param_specs``, the blocks' own psum over "model", which
    1F1B's branches hold), or GSPMD: the same blocks on global shapes, the specs given with
    ``tensor_parallel="gspmd"`` or declared on the parameters; XLA partitions each stage's
    layers and gathers no weight over "model". ``extra``: gradient accumulation over two
    pipeline runs, leaves split over buckets. ``blocks``: the same layers as a list of blocks,
    each with its own specs, which the step stacks. A checkpoint of the state takes the next step
    bit for bit as the state itself does."""
    rng = np.random.default_rng(7)
    params = {"layers": {"up": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, 2 * WIDTH)) / 4, jnp.float32),
                         "down": jnp.asarray(rng.normal(size=(LAYERS, 2 * WIDTH, WIDTH)) / 6, jnp.float32)},
              "head": jnp.asarray(rng.normal(size=(WIDTH, 1)) / 4, jnp.float32)}
    batches = [{"x": jnp.asarray(rng.normal(size=(8 * ROWS, WIDTH)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(8 * ROWS, 1)), jnp.float32)} for _ in range(STEPS)]
    specs = {"layers": {"up": P(None, None, "model"), "down": P(None, "model", None)}, "head": P()}
    if blocks:
        params = _as_list(params)
        specs = {"layers": [{"up": P(None, "model"), "down": P("model", None)}] * LAYERS, "head": P()}
    mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
    options = dict(stage_axis="stage", pipeline_microbatches=4, bucket_size=256, shard_params=shard_params,
                   pipeline_schedule=schedule) | extra
    given = params
    if tensor_parallel == "declared":
        given = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
        config = jd.TrainConfig(**options)
    else:
        config = jd.TrainConfig(**options, param_specs=specs, tensor_parallel=tensor_parallel)
    loss = _tp_loss("model" if tensor_parallel == "manual" else None)
    step = jd.make_train_step(given, loss, optax.sgd(0.05), mesh, config, example_batch=batches[0])
    assert step.tensor_parallel == ("manual" if tensor_parallel == "manual" else "gspmd")
    state = step.init()
    if not shard_params:  # half the layers, half the columns (a list of blocks: the list becomes the stack)
        assert {s.data.shape for s in state.params["layers"]["up"].addressable_shards} == {(LAYERS // 2, WIDTH, WIDTH)}
    if tensor_parallel != "manual":
        model_groups = {frozenset(d.id for d in row) for row in mesh.devices.reshape(-1, 2)}
        gathered = _all_gather_groups(step.lower(state, batches[0]).compile().as_text())
        assert gathered and not [g for g in gathered if g == model_groups], "an all-gather over 'model'"
    state = train_on(step, batches, state)
    loss = _tp_loss(None)
    want, _, gradients = reference_run(loss, params, optax.sgd(0.05), batches)
    # The one-place chain, the 8 devices' and the pipeline's micro-batches' sums, and the
    # accumulation's, if any.
    additions = (rounding_chain(jax.grad(loss), params, batches[0]) + 8 + options["pipeline_microbatches"]
                 + extra.get("microbatches", 0))
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.05, params=params)
    got = step.master_params(state) if shard_params or blocks else state.params
    assert_within(jax.device_get(got), want, bounds[-1],
                  what=f"after {STEPS} steps ({tensor_parallel}, {shard_params=}, {schedule}, {extra}, {blocks=})")
    jd.save_checkpoint(tmp_path / "ckpt", state)
    restored, _ = jd.restore_checkpoint(tmp_path / "ckpt", step.abstract_state())
    assert float(step(restored, batches[0])[1].loss) == float(step(state, batches[0])[1].loss)

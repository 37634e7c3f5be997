"""Pipeline parallelism over a stage axis: a layer stack split into equal stages, activations
handed from stage to stage with ``ppermute``, micro-batches in the GPipe schedule.

Both functions run inside ``jax.shard_map`` with the stage axis manual; each device holds its
stage's layers (a stacked ``[layers / stages, ...]`` block of the stack's parameters, split over
the stage axis along the layer axis).

* :func:`gpipe`: the schedule itself. Micro-batch ``m`` enters stage 0 at tick ``m`` and stage
  ``s`` at tick ``m + s``; ``microbatches + stages - 1`` ticks in all, of which each stage idles
  ``stages - 1`` (:func:`bubble_fraction`). Differentiating through it gives GPipe's backward:
  every forward, then every backward, in reverse tick order.
* :func:`pipeline`: the stack applied to each device's own part of the batch, as if it ran
  there: the parts are gathered over the stage axis, cut into micro-batches, sent through
  :func:`gpipe`, and the last stage's results scattered back, so that what runs before and
  after the stack (embedding, head, loss) stays data parallel over the stage axis too.

Example::

    def stage_fn(layers, x):  # this stage's layers, [layers / stages, ...] each
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, layers)[0]

    @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P(("data", "stage"))), out_specs=P(("data", "stage")))
    def forward(stacked, x):
        return pipeline(stage_fn, stacked, x, axis="stage", microbatches=4)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_drain import _compat

PyTree = Any

#: The schedules :func:`pipeline` runs.
SCHEDULES = ("gpipe",)


def num_ticks(microbatches: int, stages: int) -> int:
    """Ticks of a GPipe schedule: the last micro-batch enters stage 0 at tick
    ``microbatches - 1`` and leaves the last stage ``stages - 1`` ticks later."""
    return microbatches + stages - 1


def bubble_fraction(microbatches: int, stages: int) -> float:
    """The share of a GPipe schedule's ticks each stage spends idle: ``(S - 1) / (M + S - 1)``.

    Example::

        >>> bubble_fraction(8, 4)
        0.2727272727272727
    """
    return (stages - 1) / num_ticks(microbatches, stages)


def gpipe(stage_fn: Callable[[PyTree, PyTree], PyTree], stage_params: PyTree, inputs: PyTree, *, axis: str,
          remat: bool = True) -> PyTree:
    """Runs ``inputs`` (a pytree of ``[microbatches, ...]`` arrays, read on stage 0) through every
    stage of ``axis`` in order, the GPipe schedule; the ``[microbatches, ...]`` results, valid on
    the last stage (zeros on the others).

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y``, one stage's layers on one micro-batch;
            ``y`` has ``x``'s structure, shapes and dtypes (a residual stream).
        stage_params: this stage's parameters (its local block inside ``shard_map``).
        inputs: every micro-batch; only stage 0 reads them.
        axis: the stage axis, manual in the enclosing ``shard_map``.
        remat: keep only each tick's stage input for backward and recompute the stage
            (``jax.checkpoint``); ``False`` keeps every activation of every tick.

    Each stage computes at every tick; the ticks before a micro-batch reaches it and after the
    last one left run on stand-in values whose results are dropped. They start from the first
    micro-batch rather than zeros, so that a stage that divides by a norm never sees zeros: a
    non-finite stand-in would make its dropped gradient ``0 * inf``.
    """
    stages = _compat.axis_size(axis)
    sizes = {x.shape[0] for x in jax.tree.leaves(inputs)}
    if len(sizes) != 1:
        raise ValueError(f"gpipe: every input leaf needs the same leading (micro-batch) dimension, got {sorted(sizes)}")
    (microbatches,) = sizes
    stage = jax.lax.axis_index(axis)
    inputs = jax.tree.map(lambda x: _compat.mark_varying(x, (axis,)), inputs)
    apply = jax.checkpoint(stage_fn) if remat else stage_fn
    forward = [(s, s + 1) for s in range(stages - 1)]

    def tick(carry: tuple[PyTree, PyTree], t: jax.Array) -> tuple[tuple[PyTree, PyTree], None]:
        state, outputs = carry
        entering = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
            x, jnp.minimum(t, microbatches - 1), keepdims=False), inputs)
        x = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), entering, state)
        y = apply(stage_params, x)
        # The last stage finishes micro-batch t - (stages - 1); a slot is written once.
        slot = t - (stages - 1)
        write = (stage == stages - 1) & (slot >= 0)
        at = jnp.clip(slot, 0, microbatches - 1)
        outputs = jax.tree.map(lambda o, v: jax.lax.dynamic_update_index_in_dim(
            o, jnp.where(write, v, jax.lax.dynamic_index_in_dim(o, at, keepdims=False)), at, 0), outputs, y)
        state = jax.tree.map(lambda v: jax.lax.ppermute(v, axis, forward), y)
        return (state, outputs), None

    first = jax.tree.map(lambda x: x[0], inputs)
    empty = jax.tree.map(jnp.zeros_like, inputs)
    (_, outputs), _ = jax.lax.scan(tick, (first, empty), jnp.arange(num_ticks(microbatches, stages)))
    return outputs


def pipeline(stage_fn: Callable[[PyTree, PyTree], PyTree], stage_params: PyTree, x: PyTree, *, axis: str,
             microbatches: int, schedule: str = "gpipe", remat: bool = True) -> PyTree:
    """The whole stack (every stage of ``axis`` in order) applied to this device's part of the
    batch, ``x`` (a pytree of ``[batch, ...]`` arrays): what running the stack here would give.

    The stage axis's parts are gathered (``S * batch`` rows), cut into ``microbatches``
    micro-batches in that order, run through :func:`gpipe`, and the last stage's results
    reduce-scattered back, each device its own rows. Differentiable: the backward sends the
    results' cotangents to the last stage and the inputs' cotangents back from stage 0 the same
    way.

    Args:
        stage_fn: one stage's layers on one micro-batch (:func:`gpipe`).
        stage_params: this stage's parameters.
        x: this device's rows; every device of the stage axis gives as many.
        axis: the stage axis, manual in the enclosing ``shard_map``.
        microbatches: micro-batches in flight; must divide ``S * batch``.
        schedule: ``"gpipe"`` (:data:`SCHEDULES`).
        remat: as for :func:`gpipe`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be a positive integer, got {microbatches!r}")
    stages = _compat.axis_size(axis)
    rows = {a.shape[0] for a in jax.tree.leaves(x)}
    if len(rows) != 1:
        raise ValueError(f"pipeline: every leaf of x needs the same leading (batch) dimension, got {sorted(rows)}")
    total = stages * rows.pop()
    if total % microbatches:
        raise ValueError(f"pipeline: {microbatches} micro-batches do not divide the {total} rows of the stage axis "
                         f"({stages} stages x {total // stages} rows each); pick a divisor of {total}")
    gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, axis, tiled=True), x)
    split = jax.tree.map(lambda a: a.reshape(microbatches, total // microbatches, *a.shape[1:]), gathered)
    results = gpipe(stage_fn, stage_params, split, axis=axis, remat=remat)
    last = jax.lax.axis_index(axis) == stages - 1
    joined = jax.tree.map(lambda a: jnp.where(last, a.reshape(total, *a.shape[2:]), 0), results)
    # Only the last stage's rows are nonzero: the reduce-scatter hands each device its own.
    return jax.tree.map(lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0, tiled=True), joined)

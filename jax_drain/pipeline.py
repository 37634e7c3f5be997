"""Pipeline parallelism over a stage axis: a layer stack split into equal stages, activations
handed from stage to stage with ``ppermute``, micro-batches in the GPipe schedule.

Both functions run inside ``jax.shard_map`` with the stage axis manual; each device holds its
stage's layers (a stacked ``[layers / stages, ...]`` block of the stack's parameters, split over
the stage axis along the layer axis).

* :func:`gpipe`: the schedule itself. Micro-batch ``m`` enters stage 0 at tick ``m`` and stage
  ``s`` at tick ``m + s``; ``microbatches + stages - 1`` ticks in all, of which each stage idles
  ``stages - 1`` (:func:`bubble_fraction`). Differentiating it gives GPipe's backward: every
  forward, then every backward, in reverse tick order, the stage's gradient summed over the
  micro-batches in ``accum_dtype``.
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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_drain import _compat, _jaxpr
from jax_drain._jaxpr import PLAIN_CALLS, LAYERWISE, call_body, layerwise_outputs
from jax_drain.losses import WeightedLoss

PyTree = Any

#: The schedules a stage axis runs: :func:`gpipe`, and :func:`one_f_one_b` with Megatron's bound
#: on the micro-batches a stage holds (``"1f1b"``) or in lock step (``"1f1b_lockstep"``).
SCHEDULES = ("gpipe", "1f1b", "1f1b_lockstep")


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


def stage_inputs_held(microbatches: int, stages: int, schedule: str = "gpipe") -> int:
    """The most micro-batches' stage inputs a stage holds for its backward (the stage recomputed
    from them): GPipe every tick's, ``microbatches + stages - 1``; 1F1B ``min(microbatches,
    stages)`` (stage 0; stage ``s`` holds ``stages - s``), Megatron's bound; 1F1B in lock step
    ``min(microbatches, 2 * stages - 1)`` (stage ``s``: ``2 * (stages - 1 - s) + 1``).

    Example::

        >>> [stage_inputs_held(16, 4, s) for s in ("gpipe", "1f1b", "1f1b_lockstep")]
        [19, 4, 7]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"stage_inputs_held: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if schedule == "gpipe":
        return num_ticks(microbatches, stages)
    return _OneFOneBTicks.of(microbatches, stages, lockstep=_lockstep(schedule)).slots


def schedule_time(microbatches: int, stages: int, schedule: str = "gpipe", *, backward: float = 2.0) -> float:
    """The stack's time in a step under ``schedule``, in units of one stage's forward on one
    micro-batch, from its ticks: all stages start a tick together, so a tick lasts as long as
    its slowest stage's work. A stage's backward costs ``backward`` forwards plus one to
    recompute the forward from the stashed input (every schedule here recomputes). Communication
    is taken as free; XLA's own estimate (:func:`jax_drain.plan` with a stage axis) prices the
    GPipe loops, not the 1F1B schedules' branches.

    With the defaults (a backward twice a forward, so 3 with the recompute) and ``S >= 2``:
    GPipe ``M + S - 1`` ticks of forwards, then as many of backwards, ``4 (M + S - 1)``. Lock
    step ``M + 2 (S - 1)`` ticks, ``S - 1`` of forwards alone, ``M`` of both and ``S - 1`` of
    backwards alone: the same ``4 (M + S - 1)``. 1F1B (Megatron's bound) ``2 (M + S - 1)``
    ticks: ``S`` of forwards alone, then a backward's each, ``6 M + 4 S - 6``; about 3/2 of the
    others for many micro-batches, the price of holding ``S`` stage inputs instead of ``2 S - 1``.

    Example::

        >>> [schedule_time(16, 4, s) for s in ("gpipe", "1f1b", "1f1b_lockstep")]
        [76.0, 106.0, 76.0]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule_time: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    back = backward + 1.0
    if schedule == "gpipe":
        return num_ticks(microbatches, stages) * (1.0 + back)
    ticks = _OneFOneBTicks.of(microbatches, stages, lockstep=_lockstep(schedule))
    return float(sum(max(ticks.forward(t, s)[1] * 1.0 + ticks.backward(t, s)[1] * back for s in range(stages))
                     for t in range(ticks.ticks)))


def _lockstep(schedule: str) -> bool:
    """Whether a 1F1B ``schedule`` (of :data:`SCHEDULES`) runs in lock step."""
    return schedule == "1f1b_lockstep"


def _hops(stages: int, *, back: bool = False) -> list[tuple[int, int]]:
    """``ppermute``'s pairs from each stage to the next (``back``: to the previous)."""
    return [(s + 1, s) if back else (s, s + 1) for s in range(stages - 1)]


class _OneFOneBTicks(NamedTuple):
    """When :func:`one_f_one_b` runs what: micro-batch ``m`` runs forward on stage ``s`` at tick
    ``stride * m + s`` and backward at ``stride * m + turn - s``; a stage's inputs wait in
    ``slots`` places between the two."""

    microbatches: int
    stride: int
    turn: int
    ticks: int
    slots: int

    @staticmethod
    def of(microbatches: int, stages: int, *, lockstep: bool) -> "_OneFOneBTicks":
        # Lock step: a forward and a backward per tick; the last stage turns a micro-batch around
        # in the tick it ends its forward. Otherwise one or the other: a stage's forwards fall on
        # ticks of one parity and its backwards on the other, the last stage's backward the tick
        # after its forward, so stage 0 starts a micro-batch every other tick and holds ``stages``.
        stride, turn = (1, 2 * (stages - 1)) if lockstep else (2, 2 * stages - 1)
        return _OneFOneBTicks(microbatches, stride, turn, stride * (microbatches - 1) + turn + 1,
                              min(microbatches, turn // stride + 1))

    def forward(self, t: Any, stage: Any) -> tuple[Any, Any]:
        """The micro-batch ``stage`` runs forward at tick ``t`` and whether it has one."""
        return self._at(t - stage)

    def backward(self, t: Any, stage: Any) -> tuple[Any, Any]:
        """... backward."""
        return self._at(t - self.turn + stage)

    def _at(self, offset: Any) -> tuple[Any, Any]:
        # Plain arithmetic: traced ticks in the schedule, Python ints in schedule_time.
        m = offset // self.stride
        return m, (offset >= 0) & (offset % self.stride == 0) & (m < self.microbatches)


def gpipe(stage_fn: Callable[..., PyTree], stage_params: PyTree, inputs: PyTree, *, axis: str,
          remat: bool = True, side: PyTree = None, accum_dtype: Any = jnp.float32) -> PyTree:
    """Runs ``inputs`` (a pytree of ``[microbatches, ...]`` arrays, read on stage 0) through every
    stage of ``axis`` in order, the GPipe schedule; the ``[microbatches, ...]`` results, valid on
    the last stage (zeros on the others).

    Args:
        stage_fn: ``stage_fn(stage_params, x) -> y`` (with ``side``: ``stage_fn(stage_params, x,
            side_m)``), one stage's layers on one micro-batch; ``y`` has ``x``'s structure,
            shapes and dtypes (a residual stream).
        stage_params: this stage's parameters (its local block inside ``shard_map``).
        inputs: every micro-batch; only stage 0 reads them.
        axis: the stage axis, manual in the enclosing ``shard_map``.
        remat: keep only each tick's stage input for backward and recompute the stage from
            it there; ``False`` keeps every activation of every tick.
        side: ``[microbatches, ...]`` arrays every stage reads along with the micro-batch it
            works on (an attention mask of those rows, say); ``None``: none.
        accum_dtype: what the gradient w.r.t. ``stage_params`` (and what ``stage_fn`` closes
            over) is summed in over the ticks when the schedule is differentiated (``None``:
            their own dtype). With ``remat`` the backward loop is written out and keeps that
            sum: a bf16 stage's float32 sum costs 2 bytes per parameter more than a bf16 one.
            Without, jax differentiates the forward loop, which reads the parameters through a
            copy in the wider dtype (2 bytes per parameter more again).

    Each stage computes at every tick; the ticks before a micro-batch reaches it and after the
    last one left run on stand-in values whose results are dropped. They start from the first
    micro-batch rather than zeros, so that a stage that divides by a norm never sees zeros: a
    non-finite stand-in would make its dropped gradient ``0 * inf``.
    """
    sizes = {x.shape[0] for x in jax.tree.leaves(inputs)}
    if len(sizes) != 1:
        raise ValueError(f"gpipe: every input leaf needs the same leading (micro-batch) dimension, got {sorted(sizes)}")
    (microbatches,) = sizes
    if side is not None and {x.shape[0] for x in jax.tree.leaves(side)} - {microbatches}:
        raise ValueError(f"gpipe: side inputs need the inputs' {microbatches} micro-batches as leading dimension")
    inputs = jax.tree.map(lambda x: _compat.mark_varying(x, (axis,)), inputs)
    call = _with_side(stage_fn, side)
    if remat:
        # The backward written out (_gpipe_remat): it recomputes each tick's stage from its
        # input and sums the parameters' gradient in the sum's dtype as it goes.
        fn, consts = jax.closure_convert(call, stage_params, _at(inputs, 0), _at(side, 0))
        return _gpipe_remat(fn, axis, accum_dtype, stage_params, tuple(consts), inputs, side)
    # Every activation kept: jax's own derivative of the loop, whose parameters are read through
    # a copy in the sum's dtype, so that the backward loop sums their cotangent there.
    dtypes = jax.tree.map(lambda a: a.dtype, stage_params)
    wide = jax.tree.map(lambda a: a.astype(_sum_dtype(a, accum_dtype)) if _inexact(a) else a, stage_params)
    narrowed = lambda p, x, s_: call(jax.tree.map(lambda a, d: a.astype(d), p, dtypes), x, s_)  # noqa: E731
    return _gpipe_ticks(narrowed, wide, inputs, side, axis)[0]


def _gpipe_ticks(apply: Callable[[PyTree, PyTree, PyTree], PyTree], stage_params: PyTree, inputs: PyTree,
                 side: PyTree, axis: str, *, keep_inputs: bool = False) -> tuple[PyTree, PyTree]:
    """:func:`gpipe`'s forward loop: ``(outputs, each tick's stage input)`` (the latter
    ``[ticks, ...]`` with ``keep_inputs``, else ``None``)."""
    stages, stage = _compat.axis_size(axis), jax.lax.axis_index(axis)
    (microbatches,) = {x.shape[0] for x in jax.tree.leaves(inputs)}

    def tick(carry: tuple[PyTree, PyTree], t: jax.Array) -> tuple[tuple[PyTree, PyTree], PyTree]:
        state, outputs = carry
        x = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), _at(inputs, jnp.minimum(t, microbatches - 1)),
                         state)
        # The micro-batch this stage works on (a stand-in tick reads a real one).
        y = apply(stage_params, x, _at(side, jnp.clip(t - stage, 0, microbatches - 1)))
        # The last stage finishes micro-batch t - (stages - 1); a slot is written once.
        slot = t - (stages - 1)
        outputs = _keep(outputs, jnp.clip(slot, 0, microbatches - 1), (stage == stages - 1) & (slot >= 0), y)
        state = jax.tree.map(lambda v: jax.lax.ppermute(v, axis, _hops(stages)), y)
        return (state, outputs), (x if keep_inputs else None)

    first = _at(inputs, 0)
    empty = jax.tree.map(jnp.zeros_like, inputs)
    (_, outputs), kept = jax.lax.scan(tick, (first, empty), jnp.arange(num_ticks(microbatches, stages)))
    return outputs, kept


def _gpipe_remat(fn: Callable[..., PyTree], axis: str, accum_dtype: Any, stage_params: PyTree, consts: tuple,
                 inputs: PyTree, side: PyTree) -> PyTree:
    """:func:`gpipe` with ``remat``: the forward keeps each tick's stage input; the backward
    loop runs the ticks in reverse, recomputes the stage from that input, sends the input's
    cotangent to the previous stage, and sums the gradients of the stage's parameters and of
    ``fn``'s closed-over ``consts`` in ``accum_dtype``. ``fn(stage_params, x, side_m, *consts)``."""

    def apply(p: PyTree, x: PyTree, s_: PyTree, c: tuple) -> PyTree:
        return fn(p, x, s_, *c)

    @jax.custom_vjp
    def run(stage_params: PyTree, consts: tuple, inputs: PyTree, side: PyTree) -> PyTree:
        return _gpipe_ticks(lambda p, x, s_: apply(p, x, s_, consts), stage_params, inputs, side, axis)[0]

    def forward(stage_params: PyTree, consts: tuple, inputs: PyTree, side: PyTree) -> tuple[PyTree, tuple]:
        outputs, kept = _gpipe_ticks(lambda p, x, s_: apply(p, x, s_, consts), stage_params, inputs, side, axis,
                                     keep_inputs=True)
        return outputs, (stage_params, consts, inputs, side, kept)

    def backward(residuals: tuple, cot: PyTree) -> tuple:
        stage_params, consts, inputs, side, kept = residuals
        stages, stage = _compat.axis_size(axis), jax.lax.axis_index(axis)
        (microbatches,) = {x.shape[0] for x in jax.tree.leaves(inputs)}
        # Each differentiated as ``fn`` was traced: an input the same on every stage (a
        # closed-over constant) gets its gradient summed over the stage axis in each tick by
        # jax's transpose, as differentiating the forward loop does.
        wrt = (stage_params, consts)

        def pull(x: PyTree, m: jax.Array, cot_y: PyTree) -> tuple:
            _, vjp = _vjp_inexact(lambda pc, x_, s_: apply(pc[0], x_, s_, pc[1]), wrt, x, _at(side, m))
            return vjp(cot_y)

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
            cot_in, sums, input_grads, side_grads = carry
            slot = t - (stages - 1)
            written = (stage == stages - 1) & (slot >= 0)
            # The outputs' cotangent (none for a leaf that is not floating: jax's float0).
            cot_y = jax.tree.map(lambda c, o: c + jnp.where(written, _at(o, jnp.clip(slot, 0, microbatches - 1)), 0)
                                 .astype(c.dtype) if _inexact(o) else c, cot_in, cot)
            m = t - stage  # the micro-batch this stage ran at tick t, if any
            real, at_m = (m >= 0) & (m < microbatches), jnp.clip(m, 0, microbatches - 1)
            # Every tick runs, as in the forward: a stand-in tick's input is real data and its
            # cotangent zero, so its parameter gradient is zero as it stands; its other results
            # are dropped. No branch, so XLA schedules (and prices) the loop as one body.
            d_wrt, dx, d_side = pull(_at(kept, t), at_m, cot_y)
            dx = jax.tree.map(lambda g: jnp.where(real, g, jnp.zeros_like(g)), dx)
            sums = jax.tree.map(lambda a, g: a + g.astype(a.dtype), sums, d_wrt)
            input_grads = _keep(input_grads, at_m, real & (stage == 0), dx)
            side_grads = _keep(side_grads, at_m, real, jax.tree.map(jnp.add, _at(side_grads, at_m), d_side))
            cot_in = jax.tree.map(lambda v: jax.lax.ppermute(v, axis, _hops(stages, back=True)), dx)
            return (cot_in, sums, input_grads, side_grads), None

        init = (_sums(_at(inputs, 0), None), _sums(wrt, accum_dtype), _sums(inputs, None), _sums(side, None))
        ticks = jnp.arange(num_ticks(microbatches, stages))[::-1]
        init = _compat.settle_carry(tick, init, ticks[0])
        (_, sums, input_grads, side_grads), _ = jax.lax.scan(tick, init, ticks)
        # Each gradient in its input's dtype, summed over the stage axis where the input is the
        # same on every stage (a closed-over constant).
        like = lambda g, x: _typed_like(g, x) if _inexact(x) else None  # noqa: E731
        d_params, d_consts = jax.tree.map(like, sums, wrt)
        return (d_params, d_consts, jax.tree.map(like, input_grads, inputs),
                None if side is None else jax.tree.map(like, side_grads, side))

    run.defvjp(forward, backward)
    return run(stage_params, consts, inputs, side)


def _at(tree: PyTree, i: Any) -> PyTree:
    """Entry ``i`` of every leaf's leading axis (``None`` stays ``None``)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _keep(buffer: PyTree, i: jax.Array, pred: jax.Array, value: PyTree) -> PyTree:
    """``buffer[i] = value`` where ``pred``, else ``buffer`` unchanged."""
    return jax.tree.map(lambda a, v, old: jax.lax.dynamic_update_index_in_dim(
        a, jnp.where(pred, v.astype(a.dtype), old), i, 0), buffer, value, _at(buffer, i))


def _with_side(stage_fn: Callable[..., PyTree], side: PyTree) -> Callable[[PyTree, PyTree, PyTree], PyTree]:
    """``stage_fn`` as ``(params, x, side_m)``: it takes ``side_m`` only where there is ``side``."""
    return stage_fn if side is not None else (lambda p, x, _: stage_fn(p, x))


def _zeros_of_result(fn: Callable[..., Any], *args: Any) -> PyTree:
    """Zeros shaped, typed and varying like ``fn(*args)``, which is not run."""
    return jax.tree.map(_compat.zeros_of, jax.eval_shape(fn, *args))


def _sums(tree: PyTree, accum_dtype: Any) -> PyTree:
    """Zero sums for ``tree``'s gradients: in ``accum_dtype`` (a wider dtype stays), float32
    where a leaf is not floating."""
    return jax.tree.map(lambda a: jnp.zeros(np.shape(a), _sum_dtype(a, accum_dtype)), tree)


def _typed_like(grad: jax.Array, like: Any) -> jax.Array:
    """``grad`` as a cotangent of ``like``: in its dtype, summed over the manual axes ``like`` does
    not vary along, and varying along those it does."""
    return _compat.mark_varying(_transpose_cast(grad.astype(like.dtype), like), tuple(_compat.varying_axes(like)))


def _when(pred: jax.Array, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` where ``pred``, else zeros of its result (``lax.cond``: only one runs)."""
    return jax.lax.cond(pred, fn, lambda *_: _zeros_of_result(fn, *args), *args)


class OneFOneB(NamedTuple):
    """What :func:`one_f_one_b` gives back on each stage (zeros where a stage has none)."""

    #: ``head``'s ``(total, extra)`` summed over the micro-batches: on the last stage.
    value: PyTree
    #: The gradient of the summed totals w.r.t. this stage's ``stage_params``.
    stage_grads: PyTree
    #: ... w.r.t. ``head_params``: on the last stage.
    head_grads: PyTree
    #: ... w.r.t. ``inputs`` (``[microbatches, ...]``): on stage 0.
    input_grads: PyTree
    #: ... w.r.t. ``side`` (``[microbatches, ...]``): this stage's layers' part (the sum over the
    #: stage axis is the whole).
    side_grads: PyTree


def one_f_one_b(stage_fn: Callable[..., PyTree], stage_params: PyTree, inputs: PyTree,
                head: Callable[[PyTree, PyTree, jax.Array], tuple[jax.Array, PyTree]], head_params: PyTree, *,
                axis: str, side: PyTree = None, accum_dtype: Any = jnp.float32,
                lockstep: bool = False) -> OneFOneB:
    """The 1F1B schedule, its gradients taken as it runs: each micro-batch's backward starts on
    the last stage as soon as its forward ends there, and stage ``s`` holds at most ``stages - s``
    micro-batches' stage inputs (Megatron's bound), where differentiating :func:`gpipe` holds
    every tick's.

    In one SPMD program the stages advance in ticks together, handing activations forward and
    cotangents back with ``ppermute`` at the end of each. Each tick a stage runs one forward or
    one backward: micro-batch ``m`` runs forward on stage ``s`` at tick ``2m + s`` and backward
    at ``2m + 2 * stages - 1 - s``, recomputing the stage's layers from the stashed input (as
    ``remat=True`` does). A stage's forwards and backwards fall on ticks of opposite parity, and
    neighbouring stages are in opposite phases, so in the steady state every tick costs a
    backward: ``2 * (microbatches + stages - 1)`` ticks of a backward each.

    ``lockstep=True``: one forward *and* one backward per tick, on every stage at once
    (``microbatches + 2 * (stages - 1)`` ticks of a forward and a backward): micro-batch ``m`` runs
    forward on stage ``s`` at tick ``m + s`` and backward at ``m + 2 * (stages - 1) - s``, so stage
    ``s`` holds ``2 * (stages - 1 - s) + 1`` (stage 0 ``2 * stages - 1``). With a backward twice a
    forward plus the recompute, lock step takes GPipe's time, about ``2/3`` of the bound's for
    many micro-batches (:func:`schedule_time`), for ``stages - 1`` more stashed inputs. A stage
    skips (``lax.cond``) a forward or backward it has none for, in either schedule.

    Args:
        stage_fn: ``stage_fn(stage_params, x)`` (with ``side``: ``stage_fn(stage_params, x,
            side_m)``), one stage's layers on one micro-batch, as for :func:`gpipe`.
        stage_params: this stage's parameters.
        inputs: every micro-batch, ``[microbatches, ...]`` arrays read on stage 0.
        head: ``head(head_params, y, m) -> (total, extra)``, run on the last stage: micro-batch
            ``m``'s loss from the stack's output ``y``; ``total`` a float scalar (differentiated,
            with cotangent 1), ``extra`` a pytree of arrays summed undifferentiated (a count).
        head_params: what ``head`` is differentiated for besides ``y``.
        axis: the stage axis, manual in the enclosing ``shard_map``.
        side: ``[microbatches, ...]`` arrays every stage reads with the micro-batch (:func:`gpipe`).
        accum_dtype: what the gradients are summed in over the micro-batches (``None``: their own
            dtype, as differentiating :func:`gpipe` sums them; a float32 sum of bf16 gradients
            holds twice their bytes).
        lockstep: run a forward and a backward each tick (above).

    Returns the :class:`OneFOneB` sums. Gradients are summed in ``accum_dtype`` and come back in their
    leaves' dtypes, each stage's own (varying along ``axis``: sum a parameter's over the stages
    where it is one); only floating leaves are differentiated (the others get zeros).

    Example::

        @jax.shard_map(mesh=mesh, in_specs=(P("stage"), P(), P()), out_specs=P("stage"))
        def grads(layers, head_w, x):  # x: [microbatches, rows, width], on every stage
            head = lambda w, y, m: (jnp.mean((y @ w) ** 2), ())
            return one_f_one_b(stage_fn, layers, x, head, head_w, axis="stage").stage_grads
    """
    stages = _compat.axis_size(axis)
    sizes = {x.shape[0] for x in jax.tree.leaves((inputs, side))}
    if len(sizes) != 1:
        raise ValueError(f"one_f_one_b: inputs and side need one leading (micro-batch) dimension, got {sorted(sizes)}")
    (microbatches,) = sizes
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    ticks = _OneFOneBTicks.of(microbatches, stages, lockstep=lockstep)
    vary = lambda tree: jax.tree.map(lambda x: _compat.mark_varying(x, (axis,)), tree)  # noqa: E731
    inputs, side = vary((inputs, side))
    # Each stage differentiates its own copy of the parameters: the sum over the stage axis that
    # jax's transpose would insert stays out of the branches that only some stages take.
    stage_params, head_params = _vary_inexact((stage_params, head_params), axis)
    call = _with_side(stage_fn, side)
    one = _at(inputs, 0)

    def stage_pull(x: PyTree, m: jax.Array, cot: PyTree) -> tuple:
        _, pull = _vjp_inexact(call, stage_params, x, _at(side, m))
        return pull(cot)

    def head_pull(y: PyTree, m: jax.Array) -> tuple:
        (total, extra), pull = _vjp_inexact(lambda hp, y_: head(hp, y_, m), head_params, y, has_aux=True)
        return total, extra, *pull(jnp.ones_like(total))


    def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
        received, cot_in, turned, stash, value, grads, head_grads, input_grads, side_grads = carry
        fm, has_f = ticks.forward(t, stage)
        fm = jnp.clip(fm, 0, microbatches - 1)
        x = jax.tree.map(lambda a, b: jnp.where(first, a, b), _at(inputs, fm), received)
        y = _when(has_f, lambda x_, m: call(stage_params, x_, _at(side, m)), x, fm)
        stash = _keep(stash, fm % ticks.slots, has_f, x)
        total, extra, d_head, dy = _when(has_f & last, head_pull, y, fm)
        value = jax.tree.map(jnp.add, value, (total, extra))
        # The last stage's cotangent waits in the carry for its backward tick, the next one (in
        # lock step this one: nothing waits).
        pending = dy if lockstep else jax.tree.map(lambda new, old: jnp.where(has_f & last, new, old), dy, turned)
        turned = () if lockstep else pending
        bm, has_b = ticks.backward(t, stage)
        bm = jnp.clip(bm, 0, microbatches - 1)
        cot = jax.tree.map(lambda a, c: jnp.where(last, a, c), pending, cot_in)
        d_stage, dx, d_side = _when(has_b, stage_pull, _at(stash, bm % ticks.slots), bm, cot)
        acc = lambda a, g: a + g.astype(a.dtype)  # noqa: E731
        grads, head_grads = jax.tree.map(acc, grads, d_stage), jax.tree.map(acc, head_grads, d_head)
        input_grads = _keep(input_grads, bm, has_b & first, dx)
        side_grads = _keep(side_grads, bm, has_b, jax.tree.map(jnp.add, _at(side_grads, bm), d_side))
        received = jax.tree.map(lambda v: jax.lax.ppermute(v, axis, _hops(stages)), y)
        cot_in = jax.tree.map(lambda v: jax.lax.ppermute(v, axis, _hops(stages, back=True)), dx)
        return (received, cot_in, turned, stash, value, grads, head_grads, input_grads, side_grads), None

    value = _zeros_of_result(lambda y, m: head(head_params, y, m), one, jnp.int32(0))
    stash = jax.tree.map(lambda a: jnp.zeros((ticks.slots, *a.shape), a.dtype), one)
    init = vary((one, one, () if lockstep else one, stash, value,
                 *(_sums(tree, accum_dtype) for tree in (stage_params, head_params, inputs, side))))
    steps = jnp.arange(ticks.ticks)
    carry, _ = jax.lax.scan(tick, _compat.settle_carry(tick, init, steps[0]), steps)
    _, _, _, _, value, grads, head_grads, input_grads, side_grads = carry
    cast = lambda acc, like: jax.tree.map(  # noqa: E731
        lambda a, x: a.astype(x.dtype) if _inexact(x) else a, acc, like)
    return OneFOneB(value, cast(grads, stage_params), cast(head_grads, head_params), cast(input_grads, inputs),
                    cast(side_grads, side))


def _extra_axes(x: Any, like: Any) -> tuple:
    """The manual axes along which ``x`` varies and ``like`` does not."""
    return tuple(sorted(_compat.varying_axes(x) - _compat.varying_axes(like), key=str))


def _transpose_cast(grad: jax.Array, like: Any) -> jax.Array:
    """``grad`` summed over the manual axes along which it varies and ``like`` does not: what
    differentiating through the implicit cast of an axis-invariant input gives."""
    extra = _extra_axes(grad, like)
    return jax.lax.psum(grad, extra) if extra else grad


def _one_seed(seed: jax.Array, grad: jax.Array) -> jax.Array:
    """``seed`` (a scalar cotangent) typed like ``grad``: where ``grad`` is already summed over
    devices that ``seed`` varies along, their seeds must agree (``jax.grad`` of the loss gives
    ones); where they do not, NaN, never a silently wrong gradient."""
    axes = _extra_axes(seed, grad)
    if not axes:
        return seed
    high, low = jax.lax.pmax(seed, axes), jax.lax.pmin(seed, axes)
    return jnp.where(high == low, high, jnp.nan)


def _vary_inexact(tree: PyTree, axis: str) -> PyTree:
    """``tree`` with its floating leaves varying along ``axis``."""
    return jax.tree.map(lambda x: _compat.mark_varying(x, (axis,)) if _inexact(x) else x, tree)


def _inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return jnp.issubdtype(dtype if dtype is not None else jnp.result_type(x), jnp.inexact)


def _sum_dtype(x: Any, accum_dtype: Any) -> Any:
    if not _inexact(x):
        return jnp.float32
    return x.dtype if accum_dtype is None else jnp.promote_types(x.dtype, accum_dtype)


def _vjp_inexact(fn: Callable[..., Any], *args: Any, has_aux: bool = False) -> tuple[Any, Callable[[Any], tuple]]:
    """``jax.vjp`` of ``fn(*args)`` between the floating leaves of ``args`` and of its output:
    ``(out, pull)``, where ``pull(cot)`` (``cot`` shaped like ``out``; its other leaves are not
    read) gives a cotangent per argument shaped like it, float32 zeros at the leaves that are not
    floating (integers, keys). With ``has_aux``, ``fn`` returns ``(out, aux)`` and so does the
    first result."""
    leaves, tree = jax.tree.flatten(args)
    wrt = [k for k, x in enumerate(leaves) if _inexact(x)]
    shape: dict[str, Any] = {}

    def of(*diff: Any) -> tuple[list, tuple]:
        full = list(leaves)
        for k, d in zip(wrt, diff):
            full[k] = d
        out = fn(*jax.tree.unflatten(tree, full))
        out, aux = out if has_aux else (out, None)
        flat, shape["tree"] = jax.tree.flatten(out)
        shape["keep"] = [_inexact(x) for x in flat]
        return [x for x, k in zip(flat, shape["keep"]) if k], ([x for x, k in zip(flat, shape["keep"]) if not k], aux)

    kept, pull, (others, aux) = jax.vjp(of, *[leaves[k] for k in wrt], has_aux=True)
    kept_it, others_it = iter(kept), iter(others)
    out = jax.tree.unflatten(shape["tree"], [next(kept_it) if k else next(others_it) for k in shape["keep"]])

    def pull_all(cot: Any) -> tuple:
        flat = shape["tree"].flatten_up_to(cot)
        grads = pull([_typed_like(c, x) for c, x, k in zip(flat, jax.tree.leaves(out), shape["keep"]) if k])
        full = [jnp.zeros(np.shape(x), jnp.float32) for x in leaves]
        for k, g in zip(wrt, grads):
            full[k] = g
        return tuple(jax.tree.unflatten(tree, full))

    return ((out, aux) if has_aux else out), pull_all


def pipeline(stage_fn: Callable[..., PyTree], stage_params: PyTree, x: PyTree, *, axis: str,
             microbatches: int, schedule: str = "gpipe", remat: bool = True, side: PyTree = None,
             accum_dtype: Any = jnp.float32) -> PyTree:
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
        schedule: ``"gpipe"`` (the forward alone; the ``"1f1b"`` schedules are :func:`one_f_one_b`).
        remat: as for :func:`gpipe`.
        side: arrays of this device's rows (``[batch, ...]``, as ``x``) that every stage reads
            with the rows it works on, without passing them on (:func:`gpipe`).
        accum_dtype: the stage's gradient sum over the micro-batches (:func:`gpipe`).
    """
    if schedule != "gpipe":
        hint = (" (1F1B interleaves each micro-batch's backward with the forward, so it needs the loss: use "
                "one_f_one_b or pipelined(..., schedule='1f1b'))" if schedule in SCHEDULES else "")
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; use 'gpipe'{hint}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be a positive integer, got {microbatches!r}")
    stages = _compat.axis_size(axis)
    rows = {a.shape[0] for a in jax.tree.leaves((x, side))}
    if len(rows) != 1:
        raise ValueError(f"pipeline: every leaf of x (and side) needs the same leading (batch) dimension, got "
                         f"{sorted(rows)}")
    total = stages * rows.pop()
    if total % microbatches:
        raise ValueError(f"pipeline: {microbatches} micro-batches do not divide the {total} rows of the stage axis "
                         f"({stages} stages x {total // stages} rows each); pick a divisor of {total}")
    def split(tree: PyTree) -> PyTree:  # the stage axis's rows, in micro-batches
        gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, axis, tiled=True), tree)
        return jax.tree.map(lambda a: a.reshape(microbatches, total // microbatches, *a.shape[1:]), gathered)

    results = gpipe(stage_fn, stage_params, split(x), axis=axis, remat=remat,
                    side=None if side is None else split(side), accum_dtype=accum_dtype)
    last = jax.lax.axis_index(axis) == stages - 1
    joined = jax.tree.map(lambda a: jnp.where(last, a.reshape(total, *a.shape[2:]), 0), results)
    # Only the last stage's rows are nonzero: the reduce-scatter hands each device its own.
    return jax.tree.map(lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0, tiled=True), joined)


def pipelined(loss_fn: Callable[[PyTree, PyTree], Any], stacked: PyTree, *, axis: str, microbatches: int,
              schedule: str = "gpipe", remat: bool = True, has_state: bool = False,
              accum_dtype: Any = jnp.float32) -> Callable[[PyTree, PyTree], Any]:
    """``loss_fn(params, batch)`` with its layer scan run as a pipeline over ``axis``: the model
    unchanged, called inside ``shard_map`` with ``axis`` manual, each stacked leaf of ``params``
    this stage's ``[layers / stages, ...]`` block and ``batch`` this device's rows (every leaf
    ``[rows, ...]``).

    The loss is traced, the ``jax.lax.scan`` whose scanned inputs are the ``stacked`` leaves
    (``nnx.scan``, ``nn.scan``, found through ``jit`` calls as :func:`jax_drain.stacked_leaves`
    finds it) is replaced by the pipeline of that scan over this stage's layers, and the rest
    runs as written. The layers see one micro-batch's rows at a time (as with
    ``TrainConfig(microbatches=...)``: a statistic over the rows inside a layer is the
    micro-batch's), so the loss is traced a second time at that size. What the scan carries must
    be rows (a residual stream ``[rows, ...]``); a loop-invariant input with a row per carried
    row (an attention mask) travels with its rows; a value computed from the batch that is not
    (a norm of all this device's rows, say) is refused: no micro-batch has it.

    The schedules:

    * ``"gpipe"`` (:func:`pipeline`): what runs before and after the stack runs on this
      device's rows, data parallel over ``axis`` too; the value is this device's loss.
    * ``"1f1b"`` and ``"1f1b_lockstep"`` (:func:`one_f_one_b`, with ``lockstep``): the loss
      after the stack runs on the last stage, one micro-batch at a time, so that each
      micro-batch's backward starts as soon as its forward ends; what runs before the stack
      stays data parallel. ``loss_fn`` returns a scalar mean or
      a :class:`~jax_drain.WeightedLoss` (with ``has_state``, ``(that, state)``, the state
      handed back unchanged); the loss of the stage axis's rows is the micro-batches' (a mean:
      the mean of their means, as for ``TrainConfig(microbatches=...)``). It lands on the last
      stage, zeros on the others, as the sum of the stage axis's devices' losses: summed over
      ``axis`` it is what ``"gpipe"`` gives summed. Its gradient is taken as the schedule
      runs; differentiate the result once (``jax.grad``), for the loss total only.

    Args:
        loss_fn: the model's loss, ``loss_fn(params, batch)``.
        stacked: a pytree of bools like ``params``: the leaves the layer scan iterates over.
        axis, microbatches, remat: as for :func:`pipeline` (the 1F1B schedules always recompute:
            ``remat=False`` is refused there).
        schedule: one of :data:`SCHEDULES`.
        has_state: ``loss_fn`` returns ``(output, new_state)`` (the 1F1B schedules only need it said).
        accum_dtype: what the stage's gradients are summed in over the micro-batches
            (:func:`gpipe`, :func:`one_f_one_b`; ``None``: their own dtype).

    Example::

        loss = pipelined(models.make_loss(config), jd.stacked_leaves(...), axis="stage", microbatches=8)
        grads = jax.grad(loss)(local_params, batch)   # inside shard_map over ("data", "stage")
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipelined: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if schedule != "gpipe" and not remat:
        raise ValueError(f"pipelined: the {schedule} schedule recomputes each stage in its backward from the "
                         "stashed stage input (what bounds its stash); remat=False keeps every activation, which "
                         "only 'gpipe' does")

    def wrapped(params: PyTree, batch: PyTree) -> Any:
        one_f_one_b_ = schedule != "gpipe"
        traced = _Traced.of(loss_fn, params, stacked, batch, axis, microbatches, stage_copies=one_f_one_b_)
        if one_f_one_b_:
            return _one_f_one_b_loss(traced, has_state, accum_dtype, lockstep=_lockstep(schedule))
        rewriter = _StackRewriter(traced, lambda stack: pipeline(
            stack.stage_fn, stack.layers, stack.carry, axis=axis, microbatches=microbatches, remat=remat,
            side=stack.side or None, accum_dtype=accum_dtype))
        outs = rewriter.eval(*traced.full_args())
        traced.check_found(rewriter)
        return jax.tree.unflatten(jax.tree.structure(traced.out_shape), [_piped(x) for x in outs])

    return wrapped


class _Traced(NamedTuple):
    """A loss traced for piping: at this device's rows (``full``) and at one micro-batch's
    (``small``, whose layer scan ``body`` is what each stage runs)."""

    full: Any
    small: Any
    body: Any
    leaves: list
    batch: list
    mask: list
    paths: list[str]
    out_shape: Any
    count: int
    size: int
    axis: str
    microbatches: int

    @staticmethod
    def of(loss_fn: Callable, params: PyTree, stacked: PyTree, batch: PyTree, axis: str, microbatches: int, *,
           stage_copies: bool = False) -> "_Traced":
        """``stage_copies``: the micro-batch's trace takes the floating parameters varying along
        ``axis``, as :func:`one_f_one_b` differentiates them."""
        leaves, treedef = jax.tree.flatten(params)
        mask = jax.tree.leaves(stacked)
        if jax.tree.structure(stacked) != treedef or not all(isinstance(m, bool) for m in mask):
            raise ValueError("pipelined: stacked must be a pytree of bools shaped like params "
                             "(jax_drain.stacked_leaves gives one)")
        flat_batch, batch_tree = jax.tree.flatten(batch)
        rows = {int(np.shape(b)[0]) if np.ndim(b) else None for b in flat_batch}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"pipelined: every batch leaf needs this device's rows as its leading dimension, got "
                             f"shapes {[tuple(np.shape(b)) for b in flat_batch]}")
        (count,) = rows
        total = _compat.axis_size(axis) * count
        if total % microbatches:
            raise ValueError(f"pipelined: {microbatches} micro-batches do not divide the {total} rows of the stage "
                             f"axis; pick a divisor of {total}")
        size = total // microbatches

        def flat_loss(*flat: Any) -> Any:
            return loss_fn(jax.tree.unflatten(treedef, flat[:len(leaves)]),
                           jax.tree.unflatten(batch_tree, flat[len(leaves):]))

        full, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*leaves, *flat_batch)
        # The same loss at one micro-batch's rows: the layer scan's body to pipe.
        # (Rows cut from the batch itself, so that they vary over the mesh axes as the batch does.)
        reps = -(-size // count)
        micro = [jax.lax.slice_in_dim(jnp.concatenate([b] * reps) if reps > 1 else b, 0, size) for b in flat_batch]
        small = jax.make_jaxpr(flat_loss)(*(_vary_inexact(leaves, axis) if stage_copies else leaves), *micro)
        body = _layer_scan(small.jaxpr, {small.jaxpr.invars[i] for i, m in enumerate(mask) if m})
        return _Traced(full, small, body, leaves, flat_batch, mask, leaf_paths_of(params), out_shape, count, size,
                       axis, microbatches)

    def full_args(self, leaves: list | None = None, batch: list | None = None) -> tuple:
        """``_StackRewriter.eval``'s arguments for the loss at this device's rows (``leaves`` and
        ``batch``: the traced ones unless given)."""
        return self._args(self.full, self.leaves if leaves is None else leaves, self.batch if batch is None else batch)

    def small_args(self, leaves: list, batch: list) -> tuple:
        """... at one micro-batch's rows, ``batch``."""
        return self._args(self.small, leaves, batch)

    def _args(self, closed: Any, leaves: list, batch: list) -> tuple:
        invars = closed.jaxpr.invars
        return (closed.jaxpr, closed.consts, [*leaves, *batch], {invars[i]: i for i, m in enumerate(self.mask) if m},
                set(invars[len(leaves):]))

    def check_found(self, rewriter: "_StackRewriter") -> None:
        if rewriter.stack is None:
            raise ValueError("pipelined: loss_fn has no jax.lax.scan over the stacked leaves; the stage axis "
                             "splits a scanned layer stack (nnx.scan, nn.scan or jax.lax.scan over stacked "
                             "parameters)")

    def split(self, tree: PyTree) -> PyTree:
        """This device's rows of ``tree`` gathered over the stage axis, as ``[microbatches, ...]``."""
        gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, self.axis, tiled=True), tree)
        return jax.tree.map(lambda a: a.reshape(self.microbatches, self.size, *a.shape[1:]), gathered)

    def scatter(self, tree: PyTree) -> PyTree:
        """:meth:`split`'s transpose: ``[microbatches, ...]`` summed over the stage axis, this
        device's rows of the sum."""
        return jax.tree.map(lambda a: jax.lax.psum_scatter(
            a.reshape(self.microbatches * self.size, *a.shape[2:]), self.axis, scatter_dimension=0, tiled=True),
            tree)


class _Stack(NamedTuple):
    """The layer scan as the rewriter met it: ``stage_fn(layers, x[, side])``'s operands."""

    stage_fn: Callable[..., list]
    layers: list  # the scanned (stacked) inputs: this stage's layers
    constants: list  # the scan's other loop-invariant inputs, the same at any rows
    carry: list  # rows
    side: list  # loop-invariant inputs with a row per row


def _one_f_one_b_loss(traced: _Traced, has_state: bool, accum_dtype: Any, *, lockstep: bool) -> Any:
    """The loss of :func:`pipelined` under :func:`one_f_one_b` (its ``"1f1b"`` schedules)."""
    out, state = traced.out_shape if has_state else (traced.out_shape, None)
    weighted = isinstance(out, WeightedLoss)
    if not weighted and (not hasattr(out, "shape") or out.shape != () or not _inexact(out)):
        raise ValueError("pipelined: the 1f1b schedule takes the loss per micro-batch: loss_fn must return a float "
                         "scalar (a mean) or a jax_drain.WeightedLoss" + (", with the state" if has_state else "")
                         + f", got {jax.tree.map(lambda x: (x.shape, str(x.dtype)), out)}")
    state_at = []
    if has_state:
        where = {v: k for k, v in enumerate(traced.full.jaxpr.invars)}
        for v in traced.full.jaxpr.outvars[len(jax.tree.leaves(out)):]:
            if _jaxpr.is_literal(v) or v not in where:
                raise ValueError("pipelined: the loss updates its state (training-mode batch statistics, RNG "
                                 "counters); the 1f1b schedule runs what follows the stack once per micro-batch "
                                 "on the last stage, which would update it there alone: use pipeline_schedule="
                                 "'gpipe', or run the model in evaluation mode")
            state_at.append(where[v])
    stages = _compat.axis_size(traced.axis)
    # A mean over each micro-batch's rows: the stage axis's devices' summed loss is S / M times
    # the micro-batches' summed means; a weighted loss's totals and counts just add up.
    scale = 1.0 if weighted else stages / traced.microbatches
    num_out = len(jax.tree.leaves(out))

    @jax.custom_vjp
    def loss(leaves: list, batch: list) -> list:
        return run(leaves, batch)[0]

    def run(leaves: list, batch: list) -> tuple[list, list]:
        captured = []

        def enter(leaves_: list) -> tuple:  # the stack's operands, from this device's rows
            rewriter = _StackRewriter(traced, lambda stack: captured.append(stack) or [
                jnp.zeros_like(c) for c in stack.carry])
            rewriter.eval(*traced.full_args(leaves_, batch))
            traced.check_found(rewriter)
            stack = captured[-1]
            return stack.layers, stack.constants, stack.carry, stack.side

        (layers, constants, carry, side), enter_pull = _vjp_inexact(enter, leaves)
        stage_fn = captured[-1].stage_fn
        fixed = _fixed_constants(enter, leaves, constants)
        micro_batch = traced.split(batch)

        # The loss after the stack, on one micro-batch: the loss at its rows, the stack's output
        # given. It reads few of the parameters (the head, the final norm): only those are
        # differentiated there, or each of the others would hold a zero gradient sum.
        base = _vary_inexact(leaves, traced.axis)

        def head_of(read: list[int]) -> Callable[[list, list, jax.Array], tuple]:
            def head(params_read: list, y: list, m: jax.Array) -> tuple:
                full = list(base)
                for k, v in zip(read, params_read):
                    full[k] = v
                rewriter = _StackRewriter(traced, lambda stack: y, micro=True)
                rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, keepdims=False), micro_batch)
                outs = [_piped(x) for x in rewriter.eval(*traced.small_args(full, rows))[:num_out]]
                return outs[0] * scale, outs[1:]
            return head

        inputs = traced.split(carry)
        every = list(range(len(leaves)))
        probe = jax.make_jaxpr(lambda ps, y: head_of(every)(ps, y, jnp.int32(0))[0])(
            base, [x[0] for x in inputs])
        read = [k for k, used in zip(every, _jaxpr.used_inputs(probe.jaxpr)) if used and _inexact(leaves[k])]
        # A complex constant no parameter reaches (a rotary table) is closed over, not differentiated.
        kept = [None if f else c for c, f in zip(constants, fixed)]
        with_fixed = lambda cs: [c if f else k for c, k, f in zip(constants, cs, fixed)]  # noqa: E731
        result = one_f_one_b(lambda p, x, s=(): stage_fn(p[0], x, s, with_fixed(p[1])),
                             _vary_inexact((layers, kept), traced.axis), inputs, head_of(read),
                             [base[k] for k in read], axis=traced.axis, side=traced.split(side) if side else None,
                             accum_dtype=accum_dtype, lockstep=lockstep)
        d_layers, d_constants = result.stage_grads
        d_constants = [jnp.zeros_like(c) if f else d for c, d, f in zip(constants, d_constants, fixed)]
        d_side = traced.scatter(result.side_grads) if side else side
        (d_enter,) = enter_pull((d_layers, d_constants, traced.scatter(result.input_grads), d_side))
        grads = [_transpose_cast(g, x) if _inexact(x) else g for g, x in zip(d_enter, leaves)]
        for k, g in zip(read, result.head_grads):
            grads[k] = grads[k] + _transpose_cast(g, leaves[k])
        total, extra = result.value
        return [total, *extra], grads

    def backward(grads: list, cot: list) -> tuple:
        # The stage axis's loss is on its last stage: so is the cotangent that scales it.
        last = jax.lax.axis_index(traced.axis) == stages - 1
        seed = jax.lax.psum(jnp.where(last, cot[0], 0), traced.axis)
        return [g * _one_seed(seed, g).astype(g.dtype) if _inexact(x) else None
                for g, x in zip(grads, traced.leaves)], None

    loss.defvjp(run, backward)  # the forward is the whole schedule, its gradients the residuals
    values = loss(traced.leaves, traced.batch)
    value = jax.tree.unflatten(jax.tree.structure(out), values)
    if not has_state:
        return value
    inputs = [*traced.leaves, *traced.batch]  # the state handed back is inputs, unchanged
    return value, jax.tree.unflatten(jax.tree.structure(state), [inputs[k] for k in state_at])


def _fixed_constants(enter: Callable[[list], tuple], leaves: list, constants: list) -> list[bool]:
    """Which of the stack's ``constants`` (``enter(leaves)[1]``) are complex and reached by no
    floating parameter: 1F1B closes over them. (Differentiated, a complex constant's cotangent
    loses its varying type in jax's transpose.) One that a parameter reaches is refused."""
    complex_at = [k for k, c in enumerate(constants) if jnp.issubdtype(c.dtype, jnp.complexfloating)]
    if not complex_at:
        return [False] * len(constants)
    probe = jax.make_jaxpr(lambda ls: [enter(ls)[1][k] for k in complex_at])(leaves)
    if any(used and _inexact(x) for used, x in zip(_jaxpr.used_inputs(probe.jaxpr), leaves)):
        raise ValueError("pipelined: the layer scan reads a complex value computed from the parameters; the 1f1b "
                         "schedules differentiate real values only: use pipeline_schedule='gpipe'")
    return [k in complex_at for k in range(len(constants))]


def leaf_paths_of(params: PyTree) -> list[str]:
    """``"blocks/attn/kernel"``-style paths of ``params``' leaves, for messages."""
    return [jax.tree_util.keystr(path, simple=True, separator="/")
            for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def _layer_scan(jaxpr: Any, stacked: set) -> Any:
    """The first ``scan`` equation of ``jaxpr`` (through plain calls) that scans a var of
    ``stacked``; ``None`` when there is none."""
    for eqn in jaxpr.eqns:
        hits = [k for k, v in enumerate(eqn.invars) if not isinstance(v, _compat.Literal) and v in stacked]
        if not hits:
            continue
        if eqn.primitive.name == "scan":
            return eqn
        body = call_body(eqn, PLAIN_CALLS)
        if body is not None:
            found = _layer_scan(body[0], {body[0].invars[k] for k in hits})
            if found is not None:
                return found
    return None


#: Stands for a per-layer output of the layer scan that the pipeline does not compute.
_NOT_PIPED = object()


def _piped(x: Any) -> Any:
    if x is _NOT_PIPED:
        raise ValueError("pipelined: the loss reads a per-layer output (ys) of the layer scan: a value a layer "
                         "returns, or per-layer state the layers update (training-mode batch statistics); the "
                         "pipeline hands on only what the scan carries and the layers' inputs unchanged: run such "
                         "layers in evaluation mode, or pass the value on through the carry")
    return x


class _StackRewriter:
    """Evaluates a traced loss (:class:`_Traced`) with its layer scan replaced by ``run(stack)``
    (the carry it hands on, given the scan as a :class:`_Stack`); tracks which values come from
    the batch, to tell the scan's row inputs from its constants."""

    def __init__(self, traced: _Traced, run: Callable[[_Stack], list], *, micro: bool = False):
        self.body, self.size, self.paths = traced.body, traced.size, traced.paths
        self.count = traced.size if micro else traced.count  # the rows of the loss evaluated
        self.run = run
        self.stack: _Stack | None = None

    def eval(self, jaxpr: Any, consts: Any, args: list, tracked: dict, batch: set) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v: Any) -> Any:
            return _piped(v.val if isinstance(v, _compat.Literal) else env[v])

        for eqn in jaxpr.eqns:
            operands = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
            hits = [(k, tracked[v]) for k, v in enumerate(eqn.invars)
                    if not isinstance(v, _compat.Literal) and v in tracked]
            invals = [read(v) for v in eqn.invars]
            with _compat.eqn_context(eqn):
                if hits and eqn.primitive.name not in LAYERWISE:
                    outs = self._rewrite(eqn, invals, hits, batch)
                else:
                    outs = _compat.bind_eqn(eqn, invals)
                    tracked.update(layerwise_outputs(eqn, hits))
            if any(v in batch for v in operands):
                batch.update(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        # A call may hand an output it does not compute on; reading it is what is refused.
        return [v.val if isinstance(v, _compat.Literal) else env[v] for v in jaxpr.outvars]

    def _rewrite(self, eqn: Any, invals: list, hits: list, batch: set) -> list:
        if eqn.primitive.name == "scan":
            return self._scan(eqn, invals, hits, batch)
        body = call_body(eqn, PLAIN_CALLS)
        if body is None:
            raise ValueError(f"pipelined: stacked leaf {self.paths[hits[0][1]]!r} is used by "
                             f"{eqn.primitive.name!r} outside the layer scan; each stage holds only its own layers, "
                             "so the stacked leaves must reach the scan unchanged, as its scanned inputs")
        jaxpr, consts = body
        inner_batch = {jaxpr.invars[k] for k, v in enumerate(eqn.invars)
                       if not isinstance(v, _compat.Literal) and v in batch}
        outs = self.eval(jaxpr, consts, invals, {jaxpr.invars[k]: j for k, j in hits}, inner_batch)
        batch.update(o for o, v in zip(eqn.outvars, jaxpr.outvars) if v in inner_batch)
        return outs

    def _scan(self, eqn: Any, invals: list, hits: list, batch: set) -> list:
        num_consts, num_carry = _compat.scan_counts(eqn.params)
        first_xs = num_consts + num_carry
        where = dict(hits)
        if self.body is None:  # pragma: no cover - the same loss traced at fewer rows lost its scan
            raise ValueError(f"pipelined: traced at {self.size} rows, loss_fn has no scan over the stacked leaves")
        if self.stack is not None:
            raise ValueError(f"pipelined: a second scan over stacked leaf {self.paths[hits[0][1]]!r}; the stage "
                             "axis pipelines one layer scan per loss")
        if min(where) < first_xs:
            raise ValueError(f"pipelined: stacked leaf {self.paths[where[min(where)]]!r} enters the layer scan as a "
                             "constant or carry, not as a scanned input")
        if any(k not in where for k in range(first_xs, len(eqn.invars))):
            raise ValueError("pipelined: the layer scan also scans inputs that are not stacked parameters (per-layer "
                             "random keys?); each stage would need its own layers' share of them: not supported yet")
        # Per-layer outputs (ys): nnx.scan hands the layers' parameters back unchanged, which are
        # this stage's own; any other is not piped, and reading it later is refused.
        inner = self.body.params["jaxpr"].jaxpr
        xs_in = {v: j for j, v in enumerate(inner.invars[first_xs:])}
        ys = [invals[first_xs + xs_in[v]] if not isinstance(v, _compat.Literal) and v in xs_in else _NOT_PIPED
              for v in inner.outvars[num_carry:]]
        carry = invals[num_consts:first_xs]
        if any(np.ndim(x) == 0 or np.shape(x)[0] != self.count for x in carry):
            raise ValueError(f"pipelined: what the layer scan carries must be this device's {self.count} rows "
                             f"([rows, ...] each), got shapes {[tuple(np.shape(x)) for x in carry]}")
        small = [v.aval for v in self.body.invars]
        side_at = []
        for k in range(num_consts):
            shape, want = tuple(np.shape(invals[k])), tuple(small[k].shape)
            if shape != want:
                if shape[1:] != want[1:] or (shape[:1], want[:1]) != ((self.count,), (self.size,)):
                    raise ValueError(f"pipelined: the layer scan reads a value of shape {shape} that is {want} at "
                                     f"{self.size} rows: neither a row per row nor the same at any batch size")
                side_at.append(k)
            elif not isinstance(eqn.invars[k], _compat.Literal) and eqn.invars[k] in batch and (
                    self.size != self.count or not shape or shape[0] != self.count):
                raise ValueError(f"pipelined: the layer scan reads a value of shape {shape} computed from the batch "
                                 "but not one row per row: each micro-batch would read this device's")
            elif not isinstance(eqn.invars[k], _compat.Literal) and eqn.invars[k] in batch:
                side_at.append(k)  # a micro-batch is a device's rows: its own rows' values
        body = self.body
        constants = [v for k, v in enumerate(invals[:num_consts]) if k not in side_at]

        def stage_fn(layers: list, x: list, side: Any = (), consts: list = constants) -> list:
            operands, given, rows = [], iter(consts), iter(side)
            for k in range(num_consts):
                operands.append(next(rows) if k in side_at else next(given))
            return _compat.bind_eqn(body, [*operands, *x, *layers])[:num_carry]

        self.stack = _Stack(stage_fn, list(invals[first_xs:]), constants, list(carry), [invals[k] for k in side_at])
        carried = self.run(self.stack)
        return [*carried, *ys]

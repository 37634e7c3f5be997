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
import numpy as np

from jax_drain import _compat
from jax_drain._jaxpr import PLAIN_CALLS, LAYERWISE, call_body, layerwise_outputs

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


def gpipe(stage_fn: Callable[..., PyTree], stage_params: PyTree, inputs: PyTree, *, axis: str,
          remat: bool = True, side: PyTree = None) -> PyTree:
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
        remat: keep only each tick's stage input for backward and recompute the stage
            (``jax.checkpoint``); ``False`` keeps every activation of every tick.
        side: ``[microbatches, ...]`` arrays every stage reads along with the micro-batch it
            works on (an attention mask of those rows, say); ``None``: none.

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
    if side is not None and {x.shape[0] for x in jax.tree.leaves(side)} - {microbatches}:
        raise ValueError(f"gpipe: side inputs need the inputs' {microbatches} micro-batches as leading dimension")

    def tick(carry: tuple[PyTree, PyTree], t: jax.Array) -> tuple[tuple[PyTree, PyTree], None]:
        state, outputs = carry
        entering = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
            x, jnp.minimum(t, microbatches - 1), keepdims=False), inputs)
        x = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), entering, state)
        if side is None:
            y = apply(stage_params, x)
        else:  # the micro-batch this stage works on (a stand-in tick reads a real one)
            mine = jnp.clip(t - stage, 0, microbatches - 1)
            y = apply(stage_params, x, jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, mine, keepdims=False), side))
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


def pipeline(stage_fn: Callable[..., PyTree], stage_params: PyTree, x: PyTree, *, axis: str,
             microbatches: int, schedule: str = "gpipe", remat: bool = True, side: PyTree = None) -> PyTree:
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
        side: arrays of this device's rows (``[batch, ...]``, as ``x``) that every stage reads
            with the rows it works on, without passing them on (:func:`gpipe`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
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
                    side=None if side is None else split(side))
    last = jax.lax.axis_index(axis) == stages - 1
    joined = jax.tree.map(lambda a: jnp.where(last, a.reshape(total, *a.shape[2:]), 0), results)
    # Only the last stage's rows are nonzero: the reduce-scatter hands each device its own.
    return jax.tree.map(lambda a: jax.lax.psum_scatter(a, axis, scatter_dimension=0, tiled=True), joined)


def pipelined(loss_fn: Callable[[PyTree, PyTree], Any], stacked: PyTree, *, axis: str, microbatches: int,
              schedule: str = "gpipe", remat: bool = True) -> Callable[[PyTree, PyTree], Any]:
    """``loss_fn(params, batch)`` with its layer scan run as a pipeline over ``axis``: the model
    unchanged, called inside ``shard_map`` with ``axis`` manual, each stacked leaf of ``params``
    this stage's ``[layers / stages, ...]`` block and ``batch`` this device's rows (every leaf
    ``[rows, ...]``).

    The loss is traced, the ``jax.lax.scan`` whose scanned inputs are the ``stacked`` leaves
    (``nnx.scan``, ``nn.scan``, found through ``jit`` calls as :func:`jax_drain.stacked_leaves`
    finds it) is replaced by :func:`pipeline` of that scan over this stage's layers, and the rest
    runs as written on this device's rows. The layers see one micro-batch's rows at a time (as
    with ``TrainConfig(microbatches=...)``: a statistic over the rows inside a layer is the
    micro-batch's), so the scan's body is traced a second time at that size. What the scan
    carries must be rows (a residual stream ``[rows, ...]``); a loop-invariant input with a row
    per carried row (an attention mask) travels with its rows; a value computed from the batch
    that is not (a norm of all this device's rows, say) is refused: no micro-batch has it.

    Args:
        loss_fn: the model's loss, ``loss_fn(params, batch)``.
        stacked: a pytree of bools like ``params``: the leaves the layer scan iterates over.
        axis, microbatches, schedule, remat: as for :func:`pipeline`.

    Example::

        loss = pipelined(models.make_loss(config), jd.stacked_leaves(...), axis="stage", microbatches=8)
        grads = jax.grad(loss)(local_params, batch)   # inside shard_map over ("data", "stage")
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipelined: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")

    def wrapped(params: PyTree, batch: PyTree) -> Any:
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

        closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*leaves, *flat_batch)
        # The same loss at one micro-batch's rows: the layer scan's body to pipe.
        # (Rows cut from the batch itself, so that they vary over the mesh axes as the batch does.)
        reps = -(-size // count)
        micro = [jax.lax.slice_in_dim(jnp.concatenate([b] * reps) if reps > 1 else b, 0, size) for b in flat_batch]
        small = jax.make_jaxpr(flat_loss)(*leaves, *micro)
        invars, small_invars = closed.jaxpr.invars, small.jaxpr.invars
        body = _layer_scan(small.jaxpr, {small_invars[i] for i, m in enumerate(mask) if m})
        rewriter = _StackRewriter(body, count, size, leaf_paths_of(params), axis, microbatches, schedule, remat)
        outs = rewriter.eval(closed.jaxpr, closed.consts, [*leaves, *flat_batch],
                             {invars[i]: i for i, m in enumerate(mask) if m}, set(invars[len(leaves):]))
        if not rewriter.found:
            raise ValueError("pipelined: loss_fn has no jax.lax.scan over the stacked leaves; the stage axis "
                             "splits a scanned layer stack (nnx.scan, nn.scan or jax.lax.scan over stacked "
                             "parameters)")
        return jax.tree.unflatten(jax.tree.structure(out_shape), [_piped(x) for x in outs])

    return wrapped


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
    """Evaluates a traced loss with its layer scan replaced by :func:`pipeline` of ``body`` (the
    scan traced at a micro-batch's ``size`` rows); tracks which values come from the batch, to
    tell the scan's row inputs from its constants."""

    def __init__(self, body: Any, count: int, size: int, paths: list[str], axis: str, microbatches: int,
                 schedule: str, remat: bool):
        self.body, self.count, self.size, self.paths = body, count, size, paths
        self.axis, self.microbatches, self.schedule, self.remat = axis, microbatches, schedule, remat
        self.found = False

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
                    outs = outs if eqn.primitive.multiple_results else [outs]
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
        if self.found:
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
        self.found = True
        constants, body = list(invals[:num_consts]), self.body

        def stage_fn(layers: list, x: list, side: Any = ()) -> list:
            operands = list(constants)
            for k, value in zip(side_at, side):
                operands[k] = value
            return list(_compat.bind_eqn(body, [*operands, *x, *layers])[:num_carry])

        carried = pipeline(stage_fn, list(invals[first_xs:]), list(carry), axis=self.axis,
                           microbatches=self.microbatches, schedule=self.schedule, remat=self.remat,
                           side=[invals[k] for k in side_at] if side_at else None)
        return [*carried, *ys]

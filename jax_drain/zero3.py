"""ZeRO-3: parameters sharded like the gradients, each bucket gathered just before its first use.

With a :class:`~jax_drain.GradSync` every device holds the whole parameter tree (ZeRO-1/2).
Here every device holds only its shard of each parameter bucket, in the parameter dtype
(:func:`shard_params`), laid out exactly like the gradient shards. :func:`value_and_grad`
traces the loss once and replays it with every parameter read replaced by its bucket's
all-gather, placed where the bucket is first used:

* **Forward**: bucket ``g_i`` (the ``i``-th bucket the loss reads) is all-gathered behind the
  first value the forward computes from bucket ``g_{i - gather_max_in_flight}``: at most
  ``gather_max_in_flight`` gathered buckets wait ahead of the compute, XLA cannot start every
  gather at once (keeping every gathered bucket alive), and it cannot combine them into one.
  The fence is a data dependency (:func:`jax_drain.drain.after`: the shard computed from that
  value), not an ``optimization_barrier``: XLA drops a barrier's operand whose output nothing
  reads, and the value a gather waits on has usually been read already, so barriers left most
  gathers of a remat-block model free to start at the step's beginning.
  ``gather_max_in_flight=None`` leaves the gathers unfenced (XLA places and may combine them).
* **Backward**: the gather is a ``jax.custom_vjp`` whose backward rule returns the bucket's
  whole local gradient (the pieces' cotangents laid back into the bucket) as the cotangent of a
  bucket-shaped zero input; the buckets then go through the sync's own drained chain
  (:meth:`BucketChain.reduce_scatter <jax_drain.BucketChain.reduce_scatter>`, the chosen mode),
  exactly as :meth:`GradSync.value_and_grad <jax_drain.GradSync.value_and_grad>` reduces them:
  each bucket's reduce-scatter starts once its gradient is complete and its predecessor has
  finished. A bucket read in two places gets both gradients summed before its one reduce.
* **Reshard after forward** (default): a bucket first read inside a ``jax.checkpoint``
  region of the model (``nnx.remat``, ``jax.checkpoint`` on a block, as large models use) is
  gathered *inside* the region, so the region's backward gathers it again where it recomputes
  the block, instead of keeping it from forward to backward. ``reshard_after_forward=False``
  gathers every bucket once, before the region, and keeps it until backward has used it (one
  all-gather per bucket; the parameters' full size alive at the turn of forward to backward).
  A model without remat keeps its gathered buckets either way: JAX saves what backward needs.

Placement reads the traced loss at its top level (and, resharding, inside each remat region):
a bucket read inside a ``jit``-ed function is gathered before that call. A bucket read by two
remat regions (it holds leaves of two blocks) is gathered in each, and its two gradients are
summed before its one reduce-scatter; a layout whose buckets follow the blocks avoids that.

Scanned stacks (:class:`~jax_drain.ScanGradSync`): the layer scan is rewritten as for the
in-scan sync (:mod:`jax_drain.scan`), its scanned inputs being each layer bucket's parameter
rows ``[num_layers, shard]``; the body is replayed with the same first-use gathers (inside the
block's remat region), and in each backward iteration the gathers' backward rules hand the
layer's bucket gradients to the layer chain, which reduce-scatters them drained, in its loop
order (:attr:`BucketChain.loop_dispatch <jax_drain.BucketChain.loop_dispatch>`), as the
in-scan sync does: neither the gathered stack nor the stacked gradient is ever formed. The
other leaves (embeddings, final norm) are gathered once, before the loss.

Supported: data-parallel axes (``axis``, several axes) and ``outer_axis`` (HSDP: shards are
replicated along it, the gradient shard is all-reduced over it as usual), and tensor parallel by
XLA (``tensor_parallel="gspmd"``): called in the step's data-parallel region, each gather and
its backward run on local blocks in the sync's nested region manual over the model axes
(:meth:`~jax_drain.chain.ChainedSync.on_local_blocks`), so every device holds its shard of its
own model blocks, a bucket is gathered over the data axes only, and the loss reads the pieces
as model-sharded global arrays; no weight is gathered over a model axis. A scanned stack's
layer buckets are gathered and reduced the same way inside the scan body. With hand-written
(``"manual"``) tensor parallel every mesh axis is manual already: the buckets hold each model
rank's local blocks, and the gathered pieces are those blocks; an expert chain's buckets are
sharded and gathered over its own axes (``expert_axis``). With ``"gspmd"``, tensor-parallel
leaves split over buckets are refused.

``jd.TrainConfig(shard_params=True)`` builds the whole train step on this module: the state's
parameters are a :class:`ParamShards`, the optimizer writes its updated shards instead of
gathering, and checkpoints move between ZeRO-3 and replicated parameters in both directions.

Measured (``benchmarks/memory.py``, compile-only 8xH100, strategy ``zero3+drain``): on
``gpt-blocks`` (403M params, 8 remat blocks) arguments 100 MiB against 772 MiB replicated, temp
278 MiB at 25 buckets and 206 MiB at 49; XLA's own FSDP (``gspmd_fsdp``) takes 578 MiB temp with
default flags and 210 MiB with its best ones (+100 MiB arguments). Reducing with
``fp32_accum_streamed`` (a chunk of scratch per bucket instead of the all-to-all's whole bucket)
takes 196 and 164 MiB. Few large buckets cost more (1.6 GiB at 1 or 2 buckets): a block's
rematerialised backward gathers all of its buckets. On the scanned preset (``gpt-blocks-scan``,
66 layer buckets) temp is 170 MiB (streamed 172) against 196 MiB for ``gspmd_fsdp`` with its
best flags (both +100 MiB arguments).

Example (inside ``shard_map``)::

    sync = jd.GradSync(params, mesh, axis="data", bucket_size=20_000_000)
    shards = zero3.shard_params(sync, params)          # this device's slice of every bucket
    loss, grads = zero3.value_and_grad(sync, loss_fn)(shards, batch)
    # grads: float32 gradient shards, laid out like `shards` (the sync's output type)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_drain import _compat
from jax_drain._jaxpr import REMAT, call_body
from jax_drain.chain import (
    GATHER_SCOPE, SCOPE_PREFIX, BucketChain, ChainedSync, accumulate_shards, check_microbatches,
    check_state_replicated,
)
from jax_drain.collectives import all_gather_bucket
from jax_drain.drain import after, check_max_in_flight
from jax_drain.feedback import check_error_feedback
from jax_drain.losses import check_loss_varies, pack_value, split_output
from jax_drain.optimizer import StateLayout

PyTree = Any


def check_shardable(sync: ChainedSync) -> None:
    """Raises unless ``sync``'s parameters can be sharded like its gradients (ZeRO-3): over each
    chain's data axes, each model rank's own blocks."""
    if sync.tensor_parallel != "gspmd":
        return
    for chain in sync.chains:
        # A gathered piece leaves the nested region as its parameter's global array: a whole leaf.
        split = [chain.layout.slots[p.leaf].path for b in chain.layout.buckets for p in b.pieces
                 if p.size != chain.layout.slots[p.leaf].size and sync.placements[chain.leaves[p.leaf]].spec_axes]
        if split:
            raise ValueError(
                f"shard_params=True with tensor_parallel='gspmd' gathers whole tensor-parallel leaves; "
                f"{sorted(set(split))[:4]} are split over buckets (split_leaves=True): use split_leaves=False"
            )


def shard_params(sync: ChainedSync, params: PyTree) -> Any:
    """This device's slice of every parameter bucket in the parameters' dtype (the sync's
    output type, laid out like its gradient shards); call inside ``shard_map`` (with
    ``tensor_parallel="gspmd"`` also in the step's data-parallel region, on whole parameters)."""
    if sync.in_data_region():
        return sync.manual_region(lambda p: shard_params(sync, p), (sync.param_specs,), sync.shard_specs())(params)
    sync.require_inside_shard_map("zero3.shard_params")
    check_shardable(sync)
    leaves = sync.check_tree(params, "params", local=True)
    out = []
    for chain in sync.chains:
        out.extend(chain.shard(b, k) for k, b in enumerate(chain.flatten(leaves)))
    return sync.pack_shards(out)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("shards",), meta_fields=("layout",))
@dataclasses.dataclass(frozen=True)
class ParamShards:
    """A ZeRO-3 train state's parameters: this device's slice of every bucket, in the parameter
    dtype, as the sync's output type (global arrays outside ``shard_map``, split like the
    gradient shards); a pytree. ``layout`` (static): the bucket layout they belong to, so a
    checkpoint can move them to another mesh, bucket size, or to replicated parameters."""

    shards: Any
    layout: StateLayout


def value_and_grad(
    sync: ChainedSync,
    loss_fn: Callable[..., Any],
    has_aux: bool = False,
    *,
    gather_max_in_flight: int | None = 1,
    reshard_after_forward: bool = True,
    has_state: bool = False,
    microbatches: int = 1,
    error_feedback: bool = False,
) -> Callable[..., Any]:
    """Like :meth:`GradSync.value_and_grad <jax_drain.GradSync.value_and_grad>`, with the
    parameters given as shards: ``fn(param_shards, *args) -> (value, grad_shards)``.

    ``param_shards``: :func:`shard_params`'s output (this device's slice of every bucket, in the
    parameter dtype). ``loss_fn(params, *args)`` sees whole local parameters, gathered bucket by
    bucket (module doc). The value and the float32 gradient shards are those
    ``sync.value_and_grad(loss_fn)`` gives for the gathered parameters; a
    :class:`~jax_drain.WeightedLoss`, ``has_aux`` and ``has_state`` work as there. With
    ``microbatches=k`` each micro-batch gathers the buckets again and reduce-scatters its own
    gradient; the float32 shards are accumulated.

    ``error_feedback`` (:mod:`jax_drain.feedback`): the function takes this device's residuals
    after the shards, ``(param_shards, residuals, *args)``, and returns ``(value, grad_shards,
    new_residuals)``. Each bucket is sent with its residual added, once per reduce-scatter: per
    micro-batch, the residual passing from one to the next (a bucket read in several places is
    still sent once, its gradients summed).
    """
    check_shardable(sync)
    check_microbatches(microbatches)
    gather_max_in_flight = check_max_in_flight(gather_max_in_flight)
    if error_feedback:
        check_error_feedback(sync)

    def wrapped(param_shards: Any, *args: Any, **kwargs: Any):
        sync.require_inside_shard_map("zero3.value_and_grad", data_region=bool(sync.auto_axes))
        shards = _check_shards(sync, param_shards)
        residuals, args = (list(sync.flat_shards(args[0])), args[1:]) if error_feedback else (None, args)
        state, args = (args[0], args[1:]) if has_state else (None, args)

        def run(state, residuals, a, kw):
            return sync.sharded_grad(loss_fn, has_aux, has_state, shards, state, a, kw,
                                     gather_max_in_flight=gather_max_in_flight,
                                     reshard_after_forward=reshard_after_forward, residuals=residuals)

        if microbatches == 1:
            step, grads, residuals = run(state, residuals, args, kwargs)
        else:
            step, grads, residuals = accumulate_shards(sync, run, state, residuals, args, kwargs, microbatches)
        loss, grads = sync.finish(step.total, step.count, sync.pack_shards(grads))
        value = pack_value(loss, step.aux, step.state, has_aux, has_state)
        return (value, grads, sync.pack_shards(residuals)) if error_feedback else (value, grads)

    return wrapped


# -- internals ------------------------------------------------------------------------------------


def _check_shards(sync: ChainedSync, param_shards: Any) -> list[jax.Array]:
    shards = list(sync.flat_shards(param_shards))
    want = [(sync.region_shard_shape(chain, k), chain.layout.buckets[k].dtype) for chain, k in sync.flat_chains]
    got = [(tuple(s.shape), jnp.dtype(s.dtype)) for s in shards]
    if got != [(tuple(s), jnp.dtype(d)) for s, d in want]:
        raise ValueError(f"param shards are {got}, expected {want} per device: pass zero3.shard_params(sync, params)")
    return shards


def replay_value_and_grad(sync, loss_fn, has_aux, has_state, shards, state, args, kwargs, *,
                          gather_max_in_flight: int, reshard_after_forward: bool, residuals=None):
    """An unrolled model's ZeRO-3 micro-batch (``GradSync.sharded_grad``): the traced loss
    replayed with every bucket gathered at its first use; ``(LocalStep, flat float32 gradient
    shards, new residuals)``. ``residuals`` (error feedback, flat): added to each bucket's
    gradient, once, as it is reduce-scattered; ``None`` without."""
    depth, reshard = gather_max_in_flight, reshard_after_forward
    flat_args, args_tree = jax.tree.flatten((state, args, kwargs))
    # Traced on values typed like the gathered leaves (varying along the data axes, and the model
    # axes a hand-written tensor-parallel block is split along; the shapes
    # the loss sees: local blocks, or global along gspmd's automatic axes), so the replay binds
    # the same casts; the zeros themselves are dead code.
    local = jax.tree.leaves(sync.local_params(jax.tree.unflatten(sync.treedef, [
        _compat.mark_varying(jnp.zeros(sync.region_shape(pl.global_shape, pl.spec), pl.dtype),
                             sync.region_axes(pl.spec_axes)) for pl in sync.placements])))

    def flat_loss(*flat):
        params = jax.tree.unflatten(sync.treedef, flat[:len(local)])
        st, a, kw = jax.tree.unflatten(args_tree, flat[len(local):])
        return loss_fn(params, st, *a, **kw) if has_state else loss_fn(params, *a, **kw)

    closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*local, *flat_args)
    out_tree = jax.tree.structure(out_shape)
    # One bucket-shaped zero per bucket (every model rank's, with gspmd): the gathers' backward
    # rules return each bucket's local gradient as its cotangent (XLA drops the zeros: nothing reads them).
    dummies = [sync.bucket_zeros(chain, k) for chain, k in sync.flat_chains]

    divisor = sync.data_size if sync.average else 1

    def differentiable(dummies):
        refs = [ParamRef(i) for i in range(len(local))]
        outs = replay_gathered(sync, closed.jaxpr, closed.consts, [*refs, *flat_args], sync.flat_chains, shards,
                               dummies, depth=depth, reshard=reshard)
        step = split_output(jax.tree.unflatten(out_tree, outs), has_aux, has_state)
        return step.total, step

    (_, step), buckets = jax.value_and_grad(differentiable, has_aux=True)(dummies)
    check_state_replicated(state, step.state, sync.data_axes)
    check_loss_varies(step.total, sync.data_axes)

    def reduce(buckets: list, residuals: list | None = None) -> Any:
        if residuals is None:
            return [shard for chain, part in zip(sync.chains, sync.per_chain(buckets))
                    for shard in chain.reduce_scatter(part, mode=sync.reduce, divisor=divisor,
                                                      max_in_flight=sync.max_in_flight)]
        shards, new = [], []
        for chain, part, mine in zip(sync.chains, sync.per_chain(buckets), sync.per_chain(residuals)):
            out, fed = chain.reduce_scatter(part, mode=sync.reduce, divisor=divisor,
                                            max_in_flight=sync.max_in_flight, residuals=mine)
            shards.extend(out)
            new.extend(fed)
        return shards, new

    refs = sync.flat_chains
    bucket_specs, shard_specs = [c.bucket_spec for c, _ in refs], [c.shard_spec for c, _ in refs]
    if residuals is None:
        shards = sync.on_local_blocks(reduce, (bucket_specs,), shard_specs)(list(buckets))
        return step, list(shards), None
    shards, new = sync.on_local_blocks(reduce, (bucket_specs, bucket_specs), (shard_specs, bucket_specs))(
        list(buckets), list(residuals))
    return step, list(shards), list(new)


def _make_gather(sync: ChainedSync, chain: BucketChain, k: int) -> Callable:
    """``gather(shard, dummy, fence) -> pieces`` for bucket ``k`` of ``chain``: forward, the
    all-gather of ``shard`` (computed from ``fence``: :func:`~jax_drain.drain.after`) cut into the
    bucket's pieces (a whole leaf in its shape, a split leaf's piece flat; typed as varying along
    the data axes so ``jax.grad`` gives local gradients); backward, the pieces' gradient laid back
    into the whole bucket, as ``dummy``'s cotangent. For a layer chain (inside a scan body)
    ``shard`` is one layer's row and ``dummy`` one layer's bucket.

    Called from the ``"gspmd"`` step's data-parallel region, both directions run on local blocks
    in the sync's nested region (:meth:`~jax_drain.chain.ChainedSync.on_local_blocks`): the shard
    enters as this device's, the gather is over the data axes only, and each piece leaves as its
    parameter's global array, sharded over the model axes like it (a model rank never sees
    another's block); backward, the pieces' gradients enter as their blocks."""
    bucket = chain.layout.buckets[k]
    in_loop = chain.num_layers is not None
    local_axes = chain.axes + chain.outer_axes
    scope = f"{GATHER_SCOPE}{chain.scope.removeprefix(SCOPE_PREFIX)}/bucket{k}"
    placements = [sync.placements[chain.leaves[p.leaf]] for p in bucket.pieces]
    # A layer chain's shard is one row of its [num_layers, shard] stack, its pieces one layer's
    # slices of the stacked leaves: their specs lose the leading (layer) entry.
    row = (lambda spec: P(*tuple(spec)[1:])) if in_loop else (lambda spec: spec)
    piece_specs = tuple(row(pl.spec) for pl in placements)
    shard_spec, bucket_spec = row(chain.shard_spec), row(chain.bucket_spec)

    def gather_pieces(shard):
        with jax.named_scope(scope):
            whole = (all_gather_bucket(shard, chain.reduce_axis, dtype=bucket.dtype) if in_loop
                     else chain.gather(k, shard))
        out = []
        for p, pl in zip(bucket.pieces, placements):
            piece = _compat.mark_varying(whole[p.offset:p.offset + p.size], local_axes)
            slot = chain.layout.slots[p.leaf]
            piece = piece.reshape(slot.shape) if p.size == slot.size else piece
            out.append(chain.as_leaf(piece, pl))
        return tuple(out)

    def lay_back(pieces):
        whole = chain.layout.assemble(k, pieces)
        # A bucket of model-replicated leaves is still one model rank's bucket.
        return _compat.mark_varying(whole, sync.region_axes(local_axes + chain.spec_axes))

    def forward(shard, fence):
        if fence is not None:
            shard = after(fence, shard, whole=bool(sync.auto_axes))
        return sync.on_local_blocks(gather_pieces, (shard_spec,), piece_specs)(shard)

    @jax.custom_vjp
    def gather(shard, dummy, fence):
        return forward(shard, fence)

    def fwd(shard, dummy, fence):
        return forward(shard, fence), None

    def bwd(_, pieces):
        return None, sync.on_local_blocks(lay_back, (piece_specs,), bucket_spec)(tuple(pieces)), None

    gather.defvjp(fwd, bwd)
    return gather


def _as_traced(var: Any, value: Any) -> Any:
    """``value`` typed varying along every axis ``var`` was traced varying along: a gathered
    bucket is invariant where the traced parameter was a varying copy, and a replayed equation
    binds its operands' traced types (a cast, no communication)."""
    if isinstance(var, _compat.Literal) or not hasattr(value, "aval"):
        return value
    missing = _compat.aval_varying_axes(var.aval) - _compat.varying_axes(value)
    return _compat.mark_varying(value, tuple(sorted(missing))) if missing else value


class ParamRef:
    """Stands for parameter leaf ``index`` (of the full tree) among the inputs given to
    :func:`replay_gathered`: the leaf is gathered where the jaxpr first reads it."""

    def __init__(self, index: int):
        self.index = index


def replay_gathered(sync: ChainedSync, jaxpr: Any, consts: Sequence[Any], invals: Sequence[Any],
                    refs: Sequence[tuple[BucketChain, int]], shards: Sequence[jax.Array], dummies: Sequence[jax.Array],
                    *, depth: int, reshard: bool) -> list:
    """Evaluates ``jaxpr`` with each :class:`ParamRef` input gathered from its bucket at its
    first use (inside the remat regions it is read in, with ``reshard``): bucket ``refs[b]`` of
    ``sync``'s chains from ``shards[b]``, its local gradient (summed over every region that
    reads it) leaving as ``dummies[b]``'s cotangent. The one replay an unrolled model's loss and
    a scanned model's layer body share."""
    replay = _GatherReplay(sync, refs, shards, dummies, depth=depth, reshard=reshard)
    return replay.run(jaxpr, consts, invals)


class _GatherReplay:
    """Evaluates a traced loss whose parameter inputs are replaced by per-bucket gathers, each
    bucket gathered at the first equation that reads one of its leaves.

    One instance per trace, and one more (:meth:`_region`) for each ``jax.checkpoint`` region
    that reads parameters not gathered yet: their buckets are gathered *inside* the region, so
    the region's backward gathers them again rather than keeping them (the model's own remat
    decides). The gather order and the first uses are shared across regions.
    """

    def __init__(self, sync: ChainedSync, refs: Sequence[tuple[BucketChain, int]], shards: Sequence[jax.Array],
                 dummies: Sequence[jax.Array], *, depth: int, reshard: bool):
        self.refs, self.reshard = list(refs), reshard
        self.shards, self.dummies, self.depth = list(shards), list(dummies), depth
        self.gathers = [_make_gather(sync, chain, k) for chain, k in self.refs]
        # Which of ``refs`` hold each parameter leaf (by its index in the full tree).
        self.leaf_buckets: dict[int, list[int]] = {}
        for b, (chain, k) in enumerate(self.refs):
            for p in chain.layout.buckets[k].pieces:
                holders = self.leaf_buckets.setdefault(chain.leaves[p.leaf], [])
                if b not in holders:
                    holders.append(b)
        self.gathered: dict[int, tuple[jax.Array, ...]] = {}  # this region's gathered buckets
        # Per gather, in order: the first value computed from its bucket (None until used).
        self.uses: list[Any] = []
        self.pending: list[int] = []  # gathers whose first use is the equation being evaluated

    def run(self, jaxpr: Any, consts: Sequence[Any], invals: Sequence[Any]) -> list:
        """``jaxpr``'s outputs; an input given as :class:`ParamRef` is that parameter leaf,
        gathered where it is first read."""
        return self._eval(jaxpr, consts, invals)

    # -- gathers ------------------------------------------------------------------------------
    def _leaf(self, i: int) -> jax.Array:
        """Parameter leaf ``i`` (its local block), gathering the buckets that hold it."""
        pieces = []
        for b in self.leaf_buckets[i]:
            chain, k = self.refs[b]
            j = chain.leaves.index(i)
            for p, value in zip(chain.layout.buckets[k].pieces, self._bucket(b)):
                if p.leaf == j:
                    pieces.append((p.start, value))
        if len(pieces) == 1:  # a whole leaf, shaped in the gather (global along gspmd's model axes)
            return pieces[0][1]
        pieces.sort(key=lambda item: item[0])
        return jnp.concatenate([v for _, v in pieces]).reshape(chain.layout.slots[j].shape)

    def _bucket(self, b: int) -> tuple[jax.Array, ...]:
        if b not in self.gathered:
            i = len(self.uses)
            fence = self.uses[i - self.depth] if self.depth is not None and i >= self.depth else None
            self.gathered[b] = self.gathers[b](self.shards[b], self.dummies[b], fence)
            self.uses.append(None)
            self.pending.append(i)
        return self.gathered[b]

    # -- evaluation ---------------------------------------------------------------------------
    def _eval(self, jaxpr: Any, consts: Sequence[Any], invals: Sequence[Any]) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, invals))

        def read(v, gather: bool = True):
            if isinstance(v, _compat.Literal):
                return v.val
            x = env[v]
            if gather and isinstance(x, ParamRef):
                x = env[v] = self._leaf(x.index)
            return x

        for eqn in jaxpr.eqns:
            raw = [read(v, gather=False) for v in eqn.invars]
            if self.reshard and eqn.primitive.name in REMAT and any(isinstance(x, ParamRef) for x in raw):
                outs = self._region(eqn, raw)
            else:
                invals = [_as_traced(v, read(v)) for v in eqn.invars]
                with _compat.eqn_context(eqn):
                    outs = _compat.bind_eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
            self._used([x for x in outs if hasattr(x, "aval")])
        return [read(v) for v in jaxpr.outvars]

    def _used(self, outputs: list) -> None:
        """Records ``outputs[0]`` as the first use of the buckets gathered for this equation."""
        if outputs and self.pending:
            for i in self.pending:
                self.uses[i] = outputs[0]
            self.pending = []

    def _region(self, eqn: Any, raw: list) -> list:
        """A ``jax.checkpoint`` region reading parameters not gathered yet: re-run under
        ``jax.checkpoint`` (same policy), its buckets gathered inside it."""
        body = call_body(eqn, REMAT)
        if body is None:  # pragma: no cover - every jax version's remat maps inputs one to one
            return _compat.bind_eqn(eqn, [self._leaf(x.index) if isinstance(x, ParamRef) else x for x in raw])
        jaxpr, consts = body
        carried = [i for i, x in enumerate(raw) if not isinstance(x, ParamRef)]
        before = len(self.uses)
        made: list[int] = []

        def region(uses: list, values: list) -> list:
            inner = _GatherReplay.__new__(_GatherReplay)
            inner.__dict__.update(self.__dict__)
            inner.gathered, inner.uses, inner.pending = {}, list(uses), []
            full = list(raw)
            for i, x in zip(carried, values):
                full[i] = x
            outs = inner._eval(jaxpr, consts, full)
            made.append(len(inner.uses) - before)
            return outs

        policy = eqn.params.get("policy")
        checkpointed = jax.checkpoint(region, policy=policy, prevent_cse=eqn.params.get("prevent_cse", True))
        outs = checkpointed(self.uses, [raw[i] for i in carried])
        # Values inside the region stay inside (leaving it, they would be kept for backward): a
        # later gather waiting on the use of a bucket gathered in here waits on the region's output.
        self.uses.extend([None] * made[-1])
        self.pending.extend(range(before, before + made[-1]))
        self._used([x for x in outs if hasattr(x, "aval")])
        return list(outs)

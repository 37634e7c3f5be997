"""``DistributedOptimizer``: sharded fp32 master weights and optimizer state (ZeRO-1/2).

Megatron-LM's ``DistributedOptimizer`` on top of a gradient sync's bucket chains
(:class:`~jax_drain.GradSync`, :class:`~jax_drain.ScanGradSync`): each device keeps the float32
master copy of *its slice* of every gradient bucket and the optax state of that slice only, so
optimizer memory per device is ~``1 / axis_size`` of a replicated optax setup. One step, inside
``jax.shard_map``:

1. the sync reduce-scatters the gradients bucket by bucket (drained, fp32-accumulated);
2. the optax transform ``tx`` updates this device's float32 master shards;
3. the new master shards are cast to each bucket's parameter dtype and all-gathered bucket by
   bucket in *forward* order (the reverse of the reduce-scatter's backward order), each gather
   fenced behind the previous one's result -- Megatron's ``next_param_gather_bucket_group``
   chain -- so at most ``gather_max_in_flight`` gathered buckets are in flight.

Every mesh the sync supports works: tensor-parallel ``param_specs`` (each model rank keeps the
shards of its own blocks' buckets), ``outer_axis`` (shards replicated along it) and expert chains.

``tx`` sees a :class:`FlatShards` as its "params": this device's float32 shards, one per bucket,
plus (static) how their elements map back to parameters. Element-wise transforms (``sgd``,
``adam``, ``adamw`` without a mask, ``lion``, schedules, ``scale_by_*``...) give exactly what they
give on the parameter tree. What optax expresses through the tree needs the flat-aware versions
here, which also work unchanged on an ordinary parameter tree (one ``tx`` serves both):

* :func:`masked` -- a mask over the *parameter tree*, applied element-wise through the layout;
* :func:`clip_by_global_norm` / :func:`global_norm` -- the norm over all shards of all devices,
  an element replicated over a tensor-parallel or outer axis counted once.

At construction the optimizer runs ``tx`` on a shrunken copy of the parameter tree (same paths,
same ndim, sizes <= 2) both ways -- on the tree, and on flat shards split over two simulated
devices -- and refuses ``tx`` if the results differ: ``optax.adamw(mask=...)``, ``optax.masked``,
``optax.multi_transform`` and ``optax.clip_by_global_norm`` see flat shards, not the tree, and
would silently train differently. The error names the flat-aware replacement.

Example (AdamW without decay on biases and norm scales, with clipping)::

    import optax, jax_drain as jd
    from jax.sharding import PartitionSpec as P

    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)        # kernels only
    tx = optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        jd.masked(optax.add_decayed_weights(0.1), decay),
        optax.scale_by_learning_rate(3e-4),
    )                                             # or: jd.adamw(3e-4, weight_decay=0.1, mask=decay)
    sync = jd.GradSync(params, mesh, axis="data", bucket_size=40_000_000)
    opt = jd.DistributedOptimizer(tx, sync)
    opt_state = opt.init_sharded(params)          # sharded over "data"

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(sync.param_specs, opt.state_specs(), sync.batch_spec),
                   out_specs=(sync.param_specs, opt.state_specs(), P()))
    def step(params, opt_state, batch):
        loss, shards = sync.value_and_grad(loss_fn)(params, batch)
        params, opt_state = opt.update(shards, opt_state)
        return params, opt_state, loss
"""

from __future__ import annotations

import collections

import dataclasses
import functools
import json
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_drain import _compat
from jax_drain._blocks import BlockStack
from jax_drain._jaxpr import call_body, is_literal
from jax_drain._tx_check import Verdict, first_difference, host_unflatten, once_per_tx, random_steps, stepped, updates_on_tree
from jax_drain.chain import GATHER_SCOPE, BucketChain, ChainedSync, check_flag
from jax_drain.drain import check_max_in_flight
from jax_drain.layout import BucketLayout, leaf_paths
from jax_drain.mesh import broadcast_prefix
from jax_drain.ownership import OwnedParams, check_per_parameter

__all__ = [
    "GATHER_SCOPE", "DistState", "DistributedOptimizer", "FlatShards", "UpdateReport", "adamw", "clip_by_global_norm",
    "global_norm", "masked",
]

PyTree = Any
Mask = PyTree | Callable[[PyTree], PyTree]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where every parameter element sits in a :class:`DistState`'s shards: the sync's
    :attr:`~jax_drain.chain.ChainedSync.description` (JSON text) and its fingerprint; with
    whole-parameter ownership, ``packing`` (JSON text) says where each owner's ``tx`` state sits
    in the packed state arrays."""

    fingerprint: str
    description: str
    packing: str = ""

    @classmethod
    def of(cls, sync: ChainedSync) -> "StateLayout":
        return cls(sync.fingerprint, json.dumps(sync.description, sort_keys=True))


@functools.partial(jax.tree_util.register_dataclass, data_fields=("master", "inner"), meta_fields=("layout",))
@dataclasses.dataclass(frozen=True)
class DistState:
    """A :class:`DistributedOptimizer`'s state; a pytree.

    ``master[i]``: float32 master weights of bucket ``i`` in the sync's flat order (every chain
    in turn, buckets in dispatch order); inside ``shard_map`` this device's shard (``[num_layers,
    size]`` for a scanned stack's layer bucket), outside the whole padded bucket sharded like the
    gradient shards. ``inner``: ``tx``'s state on the :class:`FlatShards` of the master shards.
    ``layout``: static pytree metadata (:class:`StateLayout`) naming the bucket layout the shards
    belong to, so a state built for another model, bucket size or mesh is refused instead of
    silently mis-applied, and a checkpoint can move it to another layout.
    """

    master: tuple[jax.Array, ...]
    inner: PyTree
    layout: StateLayout

    @property
    def fingerprint(self) -> str:
        return self.layout.fingerprint


class UpdateReport(NamedTuple):
    """What :meth:`DistributedOptimizer.update_and_report` saw: the global float32 gradient
    norm (every element counted once), the number of buckets with a non-finite gradient
    element, and whether the update was skipped."""

    grad_norm: jax.Array
    nonfinite_buckets: jax.Array
    skipped: jax.Array


# -- what tx sees: flat shards that know where their elements come from ------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class FlatView:
    """How flat shard elements map back to parameters (static metadata of :class:`FlatShards`).

    ``refs[i]``: the chain and bucket of shard ``i``; ``params``: the parameter tree as
    ``jax.ShapeDtypeStruct``s (what masks are evaluated on); ``norm_axes``: the mesh axes a global
    norm sums over; ``manual``: they are ``shard_map`` axes, whose values carry varying-axis types
    (``False`` for the ``vmap`` axis of :func:`check_transform`). Compared by ``key`` only: two
    views with one key describe the same shards.
    """

    key: str
    refs: tuple[tuple[BucketChain, int], ...]
    params: PyTree
    norm_axes: tuple[str, ...]
    manual: bool = True
    #: A list of the model's blocks that ``params`` holds stacked: masks are the model's, read
    #: on its own tree.
    stacking: BlockStack | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatView) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def leaf_mask(self, mask: Mask) -> list[bool]:
        """One Python bool per parameter leaf (``jax.tree.leaves`` order)."""
        if self.stacking is None:
            return _leaf_mask(mask, self.params)
        own = self.stacking.unstack(self.params)
        flags = jax.tree.unflatten(jax.tree.structure(own), _leaf_mask(mask, own))
        return jax.tree.leaves(self.stacking.stack(flags, combine=_one_flag))

    def runs(self, i: int, selected: Sequence[bool]) -> list[int]:
        """Boundaries ``[start, end, start, end, ...)`` of the runs of shard ``i``'s bucket held
        by the leaves for which ``selected[leaf]`` is True (full-tree leaf index)."""
        chain, k = self.refs[i]
        boundaries: list[int] = []
        for piece in chain.layout.buckets[k].pieces:
            if not selected[chain.leaves[piece.leaf]]:
                continue
            if boundaries and boundaries[-1] == piece.offset:
                boundaries[-1] = piece.offset + piece.size  # extend the open run
            else:
                boundaries += [piece.offset, piece.offset + piece.size]
        return boundaries

    def shard_masks(self, mask: Mask) -> tuple[jax.Array, ...]:
        """This device's boolean mask of each shard; padding is always False. A mask is
        ``[size]``: a layer shard's rows (layers) share it, and it broadcasts."""
        per_leaf = self.leaf_mask(mask)
        return tuple(
            _inside_runs(chain.positions(k), self.runs(i, per_leaf)) for i, (chain, k) in enumerate(self.refs)
        )

    def sum_of_squares(self, shards: Sequence[jax.Array]) -> jax.Array:
        """Sum of squares of every parameter element over all devices, each counted once."""
        total = jnp.zeros((), jnp.float32)
        num_leaves = len(jax.tree.leaves(self.params))
        for i, ((chain, k), shard) in enumerate(zip(self.refs, shards)):
            square = jnp.square(shard.astype(jnp.float32))
            replicas = {chain.leaves[j]: chain.replicas[j] for j in chain.layout.buckets[k].leaves}
            for r in sorted(set(replicas.values())):
                if len(set(replicas.values())) == 1:
                    part = jnp.sum(square)  # padding is zero and adds nothing
                else:
                    selected = [replicas.get(leaf) == r for leaf in range(num_leaves)]
                    inside = _inside_runs(chain.positions(k), self.runs(i, selected))
                    part = jnp.sum(jnp.where(inside, square, 0.0))
                total = total + part / r
        if self.manual:
            # Copies along the axes a shard is replicated on are summed too, then divided out by
            # ``replicas``: the psum needs the sum typed as varying along every axis.
            total = _compat.mark_varying(total, self.norm_axes)
        return jax.lax.psum(total, self.norm_axes)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("shards",), meta_fields=("view",))
@dataclasses.dataclass(frozen=True)
class FlatShards:
    """What ``tx`` sees under a :class:`DistributedOptimizer`: this device's float32 shards, one
    per bucket (a pytree of them), and the static :class:`FlatView` that maps their elements back
    to parameters, which :func:`masked` and :func:`global_norm` use."""

    shards: tuple[jax.Array, ...]
    view: FlatView


def _one_flag(*flags: bool) -> bool:
    if len(set(flags)) > 1:
        raise ValueError(f"the mask tells the model's identical blocks apart ({list(flags)}); a stage axis runs them "
                         "stacked, one mask entry for all: mask every block alike")
    return flags[0]


def _shard_view(updates: Any) -> FlatView | None:
    return updates.view if isinstance(updates, FlatShards) else None


def _inside_runs(index: jax.Array, boundaries: Sequence[int]) -> jax.Array:
    # Inside a run iff an odd number of boundaries are <= index: a few fused compares per element,
    # no mask constant the size of the model in the program.
    if not boundaries:
        return jnp.zeros(index.shape, bool)
    crossed = sum((index >= b).astype(jnp.int32) for b in boundaries)
    return (crossed & 1) == 1


def _check_static_mask(mask: Mask) -> None:
    """Refuses a mask that is an array, or holds arrays: a mask says which parameters (whole
    leaves) an optimizer applies to, one Python bool per leaf or sub-tree."""
    for path, m in jax.tree_util.tree_leaves_with_path(mask):
        if isinstance(m, (bool, np.bool_)) or (
                np.ndim(m) == 0 and np.dtype(getattr(m, "dtype", object)) == np.bool_ and not isinstance(m, jax.core.Tracer)):
            continue
        where = f"mask entry {jax.tree_util.keystr(path)!r}" if path else "the mask"
        kind = f"an array of shape {np.shape(m)}" if hasattr(m, "shape") else f"a {type(m).__name__}"
        raise TypeError(
            f"masked(inner, mask): {where} is {kind}, not a Python bool. A mask holds one bool "
            "per parameter leaf (or sub-tree), with the params' structure, or is a callable params -> such a "
            "tree, e.g. lambda p: jax.tree.map(lambda x: x.ndim > 1, p); it selects whole parameters, not elements")


def _leaf_mask(mask: Mask, params: PyTree) -> list[bool]:
    tree = mask(params) if callable(mask) else mask
    _check_static_mask(tree)
    entries = broadcast_prefix(tree, params, "the mask", lambda x: isinstance(x, (bool, np.bool_)) or x is None)
    return [bool(m) for m in entries]


# -- flat-aware optax transforms --------------------------------------------------------------


def masked(inner: optax.GradientTransformation, mask: Mask) -> optax.GradientTransformationExtraArgs:
    """``optax.masked`` that also works on a :class:`DistributedOptimizer`'s flat shards.

    ``mask`` is over the *parameter tree*: a pytree of bools with the params' structure (or a
    prefix of it), or a callable ``params -> such a pytree`` (it receives
    ``jax.ShapeDtypeStruct`` leaves under a ``DistributedOptimizer``, so decide from shapes and
    paths, not values). Updates of masked-out elements pass through unchanged.

    On an ordinary parameter tree this *is* ``optax.masked(inner, mask)``. On flat shards
    ``inner`` runs on every element and the result is selected element-wise, so ``inner`` must be
    element-wise (``add_decayed_weights``, ``scale``, ``scale_by_adam``...): its state for
    masked-out elements is kept but never used.

    Example (decoupled weight decay on matrices only, biases and norm scales excluded)::

        decay = jd.masked(optax.add_decayed_weights(0.1), lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"masked(inner, mask): inner must be an optax GradientTransformation, got "
                        f"{type(inner).__name__}")
    if not callable(mask):
        _check_static_mask(mask)
    plain = optax.masked(inner, mask)
    inner = optax.with_extra_args_support(inner)

    def init(params: PyTree) -> optax.MaskedState:
        if _shard_view(params) is None:
            return plain.init(params)
        return optax.MaskedState(inner_state=inner.init(params))

    def update(updates, state, params=None, **extra_args):
        view = _shard_view(updates)
        if view is None:
            return plain.update(updates, state, params, **extra_args)
        new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        masks = view.shard_masks(mask)
        selected = tuple(jnp.where(m, n, u) for m, n, u in zip(masks, new_updates.shards, updates.shards))
        return FlatShards(selected, view), optax.MaskedState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm spans all shards of all devices.

    On flat shards the squared norms of this device's shards are summed and ``psum``-ed over the
    mesh (one scalar all-reduce), every element counted once (:func:`global_norm`); padding
    elements are zero and add nothing. On an ordinary parameter tree this is
    ``optax.clip_by_global_norm(max_norm)``. Same rule as optax: ``u * max_norm / norm`` when
    ``norm >= max_norm``.

    Example::

        tx = optax.chain(jd.clip_by_global_norm(1.0), optax.adam(3e-4))
    """
    plain = optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        if _shard_view(updates) is None:
            return plain.update(updates, state, params)
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(plain.init, update)


def global_norm(updates: PyTree) -> jax.Array:
    """L2 norm of ``updates``; on a ``DistributedOptimizer``'s :class:`FlatShards`, of the whole
    (global) parameter-shaped tree: sharded elements summed over devices, an element replicated
    over a tensor-parallel or outer axis counted once.

    Usable inside any ``tx`` given to :class:`DistributedOptimizer` (e.g. to log the gradient
    norm from a custom transform) and on ordinary trees (``optax.tree.norm``).
    """
    view = _shard_view(updates)
    if view is None:
        return optax.tree.norm(updates)
    return jnp.sqrt(view.sum_of_squares(updates.shards))


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    *,
    mask: Mask | None = None,
    max_norm: float | None = None,
) -> optax.GradientTransformation:
    """``optax.adamw`` (with ``mask=``) that works under :class:`DistributedOptimizer` too, with
    optional global-norm clipping first (``max_norm``).

    Example (the usual LLM recipe: no decay on biases and norm scales)::

        tx = jd.adamw(3e-4, b2=0.95, weight_decay=0.1, max_norm=1.0,
                      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    """
    decay = optax.add_decayed_weights(weight_decay)
    parts = [] if max_norm is None else [clip_by_global_norm(max_norm)]
    parts += [
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        decay if mask is None else masked(decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    ]
    return optax.chain(*parts)


# -- the check that tx means the same on flat shards --------------------------------------------

_CHECK_AXIS = "jax_drain_check"  # the simulated devices' axis name
_CHECK_DEVICES = 2


def check_transform(tx: optax.GradientTransformation, params: PyTree, *, rtol: float = 1e-4) -> None:
    """Raises ``ValueError`` if ``tx`` gives a different result on flat shards than on the tree.

    Runs ``tx`` for a few steps on a shrunken copy of ``params`` (same paths and ndim, every
    dimension at most 2, random float32 values, gradients of very different scales so that
    thresholds such as a clip's are crossed) both ways: on the tree, and on the flat shards of a
    small bucket layout split over two simulated devices (``jax.vmap`` with an axis name); each
    step's updates must agree leaf by leaf, relative to that leaf's largest update. First, traced
    abstractly at the real shapes, ``tx`` must keep state shaped like the parameters and compute
    with the same operations as on the shrunken copy; a transform that acts only above a size
    (Adafactor's factored moments) is refused, since the shrunken check could not see it.
    """
    transform_check(tx, params, rtol=rtol)()


def transform_check(tx: optax.GradientTransformation, params: PyTree, *, rtol: float = 1e-4,
                    stacking: BlockStack | None = None) -> Callable[[], None]:
    """:func:`check_transform` prepared: traced and lowered, on any thread, with nothing run on a
    device. Calling the result compiles and runs the check on the calling thread, raising
    ``ValueError`` if ``tx`` is refused (a pass is remembered). What needs no run (the abstract
    trace at the real shapes, a ``tx`` that cannot be traced) is refused here. The same ``tx``
    object on the same shapes is prepared once. ``stacking``: a list of the model's blocks that
    ``params`` holds stacked (:class:`FlatView`); the tree ``tx`` must agree with is then the
    model's own, block by block."""
    leaves, treedef = jax.tree.flatten(params)
    return _flat_check(tx, treedef, tuple(tuple(int(d) for d in np.shape(x)) for x in leaves), rtol, stacking)


@once_per_tx
def _flat_check(tx: optax.GradientTransformation, treedef: Any, shapes: tuple, rtol: float,
                stacking: BlockStack | None = None) -> Verdict:
    real = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    shrunk = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(_shrink(x.shape), jnp.float32), tree)  # noqa: E731
    if difference := _shape_dependence(tx, real, shrunk(real)):
        raise ValueError(_transform_hint(
            "tx computes differently at the parameters' real shapes than on the shrunken copy the check "
            "runs, so flat shards (whose shapes are neither) would not mean the same", difference))
    # Stacked blocks keep a row per block: the model's tree, shrunken, stacked again.
    own, back = (lambda t: t, lambda t: t) if stacking is None else (stacking.unstack, stacking.stack)
    abstract = back(shrunk(own(real)))
    start, grads = random_steps(abstract)
    try:
        on_tree = updates_on_tree(tx, own(start), [own(g) for g in grads])
    except Exception as e:  # noqa: BLE001 - tx must first work on the tree it is written for
        raise ValueError(f"tx fails on the parameter tree ({type(e).__name__}: {e})") from e

    layout = BucketLayout.build(abstract, bucket_size=3, shard_multiple=_CHECK_DEVICES)
    try:
        on_shards = _updates_on_shards(tx, abstract, layout, start, grads, stacking)
    except Exception as e:  # noqa: BLE001 - any failure on flat shards means tx cannot run there
        raise ValueError(_transform_hint("tx fails on flat shards", f"{type(e).__name__}: {e}")) from e

    def run() -> None:
        flat_updates = [host_unflatten(layout, step) for step in on_shards()]
        for step, (want_tree, got_tree) in enumerate(zip(map(back, on_tree()), flat_updates)):
            if differs := first_difference(leaf_paths(abstract), want_tree, got_tree, rtol):
                path, want, got = differs
                raise ValueError(_transform_hint(
                    "tx gives a different result on flat shards than on the parameter tree",
                    f"leaf {path!r}, step {step + 1} of a check on a shrunken copy: update "
                    f"{got.ravel()[:4]} instead of {want.ravel()[:4]}"))

    return Verdict(run)


def needs_whole_parameters(tx: optax.GradientTransformation, params: PyTree) -> bool:
    """Whether ``tx`` needs each parameter whole, which flat shards cannot give it (abstract,
    cheap; the same ``tx`` object on the same shapes is answered from a cache):

    - it computes differently at the parameters' real shapes than on a copy with every
      dimension at most 2 (Muon's orthogonalisation, Adafactor's factored moments); or
    - some leaf's update depends on a reduction over that leaf's own values and no other's (a
      per-parameter quantity such as LAMB's and LARS's trust ratios; a reduction over every
      leaf, a global norm, is not one).
    """
    leaves, treedef = jax.tree.flatten(params)
    return _probe_whole_parameters(tx, treedef, tuple(tuple(int(d) for d in np.shape(x)) for x in leaves))


@once_per_tx
def _probe_whole_parameters(tx: optax.GradientTransformation, treedef: Any, shapes: tuple) -> bool:
    real = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    shrunk = jax.tree.map(lambda x: jax.ShapeDtypeStruct(_shrink(x.shape), jnp.float32), real)
    try:
        real_state = jax.eval_shape(tx.init, real)
        real_update = jax.make_jaxpr(lambda state, p: tx.update(p, state, p))(real_state, real)
    except Exception:  # noqa: BLE001 - the checks on arrays report a tx that cannot trace
        return False
    if _shape_dependence(tx, real, shrunk, real_state=real_state, real_update=real_update) is not None:
        return True
    # update(g=p, state, params=p) gives every leaf's gradient and parameter one tag.
    n = len(shapes)
    tags = [(frozenset({i}), frozenset()) for i in range(n)]
    inputs = [(frozenset(), frozenset())] * len(jax.tree.leaves(real_state)) + tags
    outputs = _reduction_tags(real_update.jaxpr, inputs)
    return any(reduced == {i} for i, (_, reduced) in enumerate(outputs[:n]))


_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin",
                         "dot_general", "cumsum", "cumprod", "cummax", "cumlogsumexp"})


def _reduction_tags(jaxpr: Any, inputs: Sequence[tuple[frozenset, frozenset]]) -> list[tuple[frozenset, frozenset]]:
    env = dict(zip(jaxpr.invars, inputs))
    none = (frozenset(), frozenset())
    read = lambda v: none if is_literal(v) else env.get(v, none)  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = call_body(eqn)
        if body is not None:
            outs = _reduction_tags(body[0], ins)
        else:
            leaves = frozenset().union(*(t for t, _ in ins))
            reduced = frozenset().union(*(r for _, r in ins))
            if eqn.primitive.name in _REDUCTIONS:
                reduced = reduced | leaves
            outs = [(leaves, reduced)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _shrink(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The check's copy of a leaf's shape: same ndim, every dimension at most 2."""
    return tuple(min(int(d), 2) for d in shape)


# Operations that only move, shape or select values: which of them a transform traces depends on
# the shapes themselves (a reshape to the same shape is elided), not on what it computes.
_SHAPE_OPS = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "convert_element_type", "copy", "copy_p",
    "slice", "concatenate", "pad", "select_n", "iota",
})


def _primitives(jaxpr) -> collections.Counter:
    """How often each computing primitive occurs in ``jaxpr``, its sub-jaxprs included."""
    counts = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _SHAPE_OPS:
            counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    counts += _primitives(sub)
    return counts


def _shape_dependence(tx: optax.GradientTransformation, real: PyTree, shrunk: PyTree, *,
                      real_state: PyTree | None = None, real_update: Any = None) -> str | None:
    """How ``tx`` at the real shapes differs from ``tx`` at the check's shrunken ones, or None.

    Traced abstractly (no arrays are made, so any model size is cheap): the state must have the
    same structure with every leaf shaped as the parameters shrink (a factored second moment
    above a size threshold, Adafactor's, has row and column statistics instead), and one update
    must compute with the same operations (a branch on a dimension's size traces others).
    """
    try:
        real_state = jax.eval_shape(tx.init, real) if real_state is None else real_state
        shrunk_state = jax.eval_shape(tx.init, shrunk)
    except Exception:  # noqa: BLE001 - a tx that cannot init abstractly is checked on arrays below
        return None
    real_leaves, real_def = jax.tree_util.tree_flatten_with_path(real_state)
    shrunk_leaves, shrunk_def = jax.tree_util.tree_flatten_with_path(shrunk_state)
    if real_def != shrunk_def:
        return f"its state's structure depends on the shapes: {real_def} at the real shapes, {shrunk_def} shrunken"
    for (path, a), (_, b) in zip(real_leaves, shrunk_leaves):
        if _shrink(np.shape(a)) != tuple(np.shape(b)):
            return (f"state leaf {jax.tree_util.keystr(path)} is {tuple(np.shape(a))} at the real shapes but "
                    f"{tuple(np.shape(b))} on the shrunken copy: it is not shaped like the parameters (e.g. "
                    "factored moments: optax.adafactor(factored=False) keeps them element-wise)")
    update = lambda state, params: tx.update(params, state, params)
    try:
        real_update = jax.make_jaxpr(update)(real_state, real) if real_update is None else real_update
        real_ops = _primitives(real_update.jaxpr)
        shrunk_ops = _primitives(jax.make_jaxpr(update)(shrunk_state, shrunk).jaxpr)
    except Exception:  # noqa: BLE001 - as above: the check on arrays reports it
        return None
    if real_ops != shrunk_ops:
        more, fewer = real_ops - shrunk_ops, shrunk_ops - real_ops
        return (f"one update at the real shapes computes with other operations ({dict(more)} more, "
                f"{dict(fewer)} fewer than on the shrunken copy)")
    return None


def _updates_on_shards(tx: optax.GradientTransformation, abstract: PyTree, layout: BucketLayout, start: PyTree,
                       grads: Sequence[PyTree], stacking: BlockStack | None = None) -> Callable[[], list]:
    """Each step's updates of ``tx`` run on the flat shards of ``layout``, split over
    ``_CHECK_DEVICES`` simulated devices (a ``vmap``), as ``[devices, shard]`` buckets
    (:func:`~jax_drain._tx_check.stepped`). The shards are cut on the host."""
    num_leaves = len(layout.slots)
    chain = BucketChain("dense", "check", layout, tuple(range(num_leaves)), (_CHECK_AXIS,), (),
                        _CHECK_DEVICES, (), (1,) * num_leaves)
    refs = tuple((chain, k) for k in range(layout.num_buckets))
    view = FlatView(f"check-{id(tx)}", refs, abstract, (_CHECK_AXIS,), manual=False, stacking=stacking)

    def init(start_shards: tuple[jax.Array, ...]) -> tuple[Any, FlatShards]:
        master = FlatShards(start_shards, view)
        return tx.init(master), master

    def step(carry: tuple[Any, FlatShards], grad_shards: tuple[jax.Array, ...]) -> tuple[tuple, tuple]:
        state, master = carry
        updates, state = tx.update(FlatShards(grad_shards, view), state, master)
        return updates.shards, (state, optax.apply_updates(master, updates))

    return stepped(jax.vmap(init, axis_name=_CHECK_AXIS), jax.vmap(step, axis_name=_CHECK_AXIS),
                   _device_shards(layout, start), [_device_shards(layout, g) for g in grads])


def _device_shards(layout: BucketLayout, tree: PyTree) -> tuple[np.ndarray, ...]:
    """``layout.flatten(tree)`` on the host, each bucket as ``[_CHECK_DEVICES, shard]``: row
    ``r`` is device ``r``'s shard (``BucketChain.shard``)."""
    leaves = [np.ravel(x) for x in jax.tree.leaves(tree)]
    out = []
    for bucket in layout.buckets:
        whole = np.zeros((bucket.padded_size,), np.float32)
        for p in bucket.pieces:
            whole[p.offset:p.offset + p.size] = leaves[p.leaf][p.start:p.start + p.size]
        out.append(whole.reshape(_CHECK_DEVICES, -1))
    return tuple(out)


def _transform_hint(what: str, details: str) -> str:
    return (
        f"{what}. Under a DistributedOptimizer tx sees FlatShards (this device's float32 bucket "
        "shards), not the parameter tree: masks or labels over the tree (optax.masked, "
        "optax.adamw(mask=...), optax.multi_transform) and per-device norms "
        "(optax.clip_by_global_norm) would silently change training. Use jax_drain.masked(inner, "
        "mask), jax_drain.adamw(..., mask=...) and jax_drain.clip_by_global_norm(max_norm) "
        "instead. Transforms that need whole parameters (optax.contrib.muon, adafactor, lamb, lars) run "
        "with whole-parameter ownership: GradSync(..., ownership='param') or TrainConfig(ownership='param'). "
        f"DistributedOptimizer(check_tx=False) skips this check. ({details})"
    )


# -- the optimizer ----------------------------------------------------------------------------


class DistributedOptimizer:
    """Sharded fp32 master weights + optax state over ``sync``'s buckets; see the module doc.

    Args:
        tx: an optax ``GradientTransformation`` that means the same on flat shards as on the
            tree: element-wise transforms, :func:`masked`, :func:`clip_by_global_norm`.
        sync: the gradient sync (:class:`~jax_drain.GradSync` on any mesh it supports, or
            :class:`~jax_drain.ScanGradSync`) whose reduce-scattered shards ``update`` takes.
        gather_max_in_flight: depth of the parameter all-gather chain: gather ``k + depth`` (in
            forward order) waits for gather ``k``'s result. ``"sync"`` (default) uses the sync's
            ``max_in_flight``, or 1 when the sync is not drained; ``None`` leaves the gathers
            unchained (XLA may then combine them into one).
        check_tx: run :func:`check_transform` once, here (see the module doc); with
            whole-parameter ownership :func:`~jax_drain.ownership.check_per_parameter`.
        max_grad_norm: clip the gradient to this global norm before ``tx`` (optax's rule: times
            ``max_grad_norm / norm`` when ``norm >= max_grad_norm``), the norm over every
            element of every device once; what ``jax_drain.clip_by_global_norm`` in ``tx`` does,
            for a ``tx`` that runs per owner (``ownership="param"``), where a clip inside would
            see one owner's parameters only. ``None``: no clip.
        stacking: set by :func:`~jax_drain.make_train_step` where a stage axis stacked a list
            of the model's blocks: the masks in ``tx`` are the model's, read on its own tree,
            and ``tx`` is checked against that tree.

    Inside ``jax.shard_map``: :meth:`init`, :meth:`update`, :meth:`gather_params`. Outside:
    :meth:`init_sharded`, :meth:`state_specs`, :meth:`abstract_state`, :meth:`check_state`,
    :meth:`memory_summary`.
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        sync: ChainedSync,
        *,
        gather_max_in_flight: int | str | None = "sync",
        check_tx: bool = True,
        max_grad_norm: float | None = None,
        stacking: BlockStack | None = None,
    ):
        if not isinstance(sync, ChainedSync):
            raise TypeError(f"sync must be a jax_drain.GradSync or jax_drain.ScanGradSync, got {type(sync).__name__}")
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.sync = sync
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(
                max_grad_norm, (int, float, np.integer, np.floating)) or not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        if isinstance(gather_max_in_flight, str) and gather_max_in_flight == "sync":
            gather_max_in_flight = sync.max_in_flight or 1
        elif isinstance(gather_max_in_flight, str):
            raise ValueError(f"gather_max_in_flight must be 'sync', an int >= 1 or None, got {gather_max_in_flight!r}")
        self.gather_max_in_flight = check_max_in_flight(gather_max_in_flight)
        self.layout = StateLayout.of(sync)
        self.fingerprint = self.layout.fingerprint
        self._refs = sync.flat_chains
        self._view = FlatView(self.fingerprint, self._refs, sync.abstract_params, tuple(sync.mesh.axis_names),
                              stacking=stacking)
        # Whole-parameter ownership: tx runs on each device's own whole parameters.
        self._owned = OwnedParams.of(self._refs, sync.abstract_params) if sync.chains[0].layout.owners else None
        self._packed = None if self._owned is None else self._owned.state_layout(tx)
        if self._owned is not None:
            self.layout = dataclasses.replace(
                self.layout, packing=json.dumps(self._owned.packing(tx, self._packed), sort_keys=True))
        if check_flag(check_tx, "check_tx"):
            if self._owned is not None:
                check_per_parameter(tx, sync.abstract_params)
            else:
                transform_check(tx, sync.abstract_params, stacking=stacking)()

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer(num_shards={len(self._refs)}, gather_max_in_flight="
            f"{self.gather_max_in_flight}, fingerprint={self.fingerprint!r})"
        )

    # -- inside shard_map -------------------------------------------------------------------
    def init(self, params: PyTree) -> DistState:
        """This device's state from ``params`` (replicated, or local blocks); call inside
        ``jax.shard_map``. Master shards are this device's slices of the float32-cast buckets."""
        master = self.sync.flat_shards(self.sync.init_master(params))
        return DistState(master, self._init_inner(master), self.layout)

    def _init_inner(self, master: tuple[jax.Array, ...], owner: int | None = None) -> PyTree:
        """``tx``'s state for the master shards (``owner``: whole-parameter ownership's shapes,
        outside ``shard_map``)."""
        if self._owned is not None:
            return self._owned.init(self.tx, self._packed, master, owner)
        return self.tx.init(FlatShards(master, self._view))

    def update(self, grads: Any, state: DistState) -> tuple[PyTree, DistState]:
        """One optimizer step on this device's shards; call inside ``jax.shard_map``.

        Args:
            grads: the float32 gradient shards from ``sync.reduce_scatter`` /
                ``sync.value_and_grad`` (the sync's output type).
            state: this device's :class:`DistState`.

        Returns:
            ``(params, state)``: the updated parameters (local blocks, their own dtypes;
            gathered bucket by bucket, forward order) and the new state.
        """
        params, state, _ = self.update_and_report(grads, state)
        return params, state

    def update_and_report(
        self, grads: Any, state: DistState, *, skip_nonfinite: bool = False,
        skip_grad_norm_above: float | None = None, gather: bool = True,
    ) -> tuple[PyTree, DistState, "UpdateReport"]:
        """:meth:`update` that also reports the gradient and may skip the step.

        Each gradient shard is checked for non-finite elements (one reduction on the shard; the
        per-bucket flags combined over the mesh with one small ``pmax``), and the global norm is
        computed as :func:`global_norm` does. With ``skip_nonfinite`` a step with a non-finite
        bucket (or, with ``skip_grad_norm_above``, a gradient norm above it: Megatron's check for
        large gradients) leaves the master shards and ``tx`` state unchanged, bit for bit, and
        gathers the unchanged parameters; the decision is the same on every device.

        Returns ``(params, state, report)``, ``report`` an :class:`UpdateReport`. With
        ``gather=False`` (ZeRO-3) ``params`` are this device's parameter shards in each bucket's
        dtype (:meth:`~jax_drain.chain.ChainedSync.cast_shards`) instead of the gathered tree.

        With ``tensor_parallel="gspmd"`` it may be called in the step's data-parallel region
        (:meth:`ChainedSync.shard_map <jax_drain.GradSync.shard_map>`): the update runs in the
        sync's :meth:`~jax_drain.GradSync.manual_region` on this device's shards, and the
        parameters come back whole along the model axes (sharded there by XLA).
        """
        if self.sync.in_data_region():
            sync = self.sync
            specs, shards = self.state_specs(), sync.shard_specs()
            run = lambda g, s: self.update_and_report(g, s, skip_nonfinite=skip_nonfinite,
                                                      skip_grad_norm_above=skip_grad_norm_above, gather=gather)
            out_specs = (sync.param_specs if gather else shards, specs, UpdateReport(P(), P(), P()))
            return sync.manual_region(run, (shards, specs), out_specs)(grads, state)
        self.sync.require_inside_shard_map("DistributedOptimizer.update")
        self._check_local_state(state)
        grads = self._check_grads(self.sync.flat_shards(grads))
        grad_norm = jnp.sqrt(self._view.sum_of_squares(grads))
        if self.max_grad_norm is not None:
            clip = grad_norm >= self.max_grad_norm
            grads = tuple(jnp.where(clip, (g / grad_norm) * self.max_grad_norm, g) for g in grads)
        nonfinite = self._nonfinite_buckets(grads)
        skip = jnp.zeros((), bool)
        if skip_nonfinite:
            skip = nonfinite > 0
        if skip_grad_norm_above is not None:
            skip = skip | (grad_norm > skip_grad_norm_above)
        if self._owned is not None:
            updates, inner = self._owned.update(self.tx, self._packed, grads, state.inner, state.master)
        else:
            flat, inner = self.tx.update(FlatShards(grads, self._view), state.inner, FlatShards(state.master, self._view))
            updates = flat.shards
        self._check_shared_state(inner)
        updates = self._zero_padding(updates)
        # optax.apply_updates, in float32.
        master = tuple((m + u.astype(jnp.float32)).astype(jnp.float32) for m, u in zip(state.master, updates))
        if skip_nonfinite or skip_grad_norm_above is not None:
            keep = lambda old, new: jnp.where(skip, old, new)
            master = tuple(keep(o, n) for o, n in zip(state.master, master))
            inner = jax.tree.map(keep, state.inner, inner)
        report = UpdateReport(grad_norm, nonfinite, skip)
        params = self.gather_params(master) if gather else self.sync.cast_shards(self.sync.pack_shards(master))
        return params, DistState(master, inner, self.layout), report

    def _check_shared_state(self, inner: PyTree) -> None:
        """Refuses ``tx`` state kept once for all devices (not shaped like the shards: counts,
        flags, scalar estimates) that ``tx`` computed from this device's shards alone."""
        _, owners = self._inner_sharding
        for (path, leaf), owner in zip(jax.tree_util.tree_leaves_with_path(inner), owners):
            if owner is None and (varying := sorted(_compat.varying_axes(leaf) & set(self.sync.data_axes))):
                raise ValueError(
                    f"tx's state {jax.tree_util.keystr(path)} is one value for all devices, but tx computed it from "
                    f"this device's gradient shards alone (it differs along {varying}): each device would keep its "
                    "own. Non-finite gradients need no optax.zero_nans or optax.apply_if_finite here: the step "
                    "skips them itself (TrainConfig(skip_nonfinite=True), the default); estimates over the whole "
                    "gradient (optax.contrib.prodigy, d-adaptation) are not supported")

    def _nonfinite_buckets(self, grads: Sequence[jax.Array]) -> jax.Array:
        """How many buckets hold a non-finite gradient element on some device (int32)."""
        flags = jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(g))) for g in grads]).astype(jnp.int32)
        axes = tuple(self.sync.mesh.axis_names)
        return jnp.sum(jax.lax.pmax(_compat.mark_varying(flags, axes), axes))

    def gather_params(self, master: Sequence[jax.Array]) -> PyTree:
        """The parameter tree (local blocks) from flat master shards; call inside ``shard_map``.
        Gathers run in forward order, chained with depth ``gather_max_in_flight``."""
        return self.sync.gather_params(self.sync.pack_shards(master), max_in_flight=self.gather_max_in_flight)

    def unflatten_master(self, master: Sequence[jax.Array]) -> PyTree:
        """The float32 master weights as a params-shaped tree, from a *global* state's master.

        Example::

            master = opt.unflatten_master(state.master)   # outside shard_map
        """
        return self.sync.unflatten_buckets(tuple(master))

    # -- outside shard_map ------------------------------------------------------------------
    def abstract_state(self) -> DistState:
        """The global state as ``jax.ShapeDtypeStruct``s with their ``NamedSharding``s.

        Sharded leaves (master shards, ``tx`` state that scales with them) are split like the
        gradient shards; the rest (step counts) is replicated. A restore target for orbax.
        """
        mesh = self.sync.mesh
        master = tuple(
            jax.ShapeDtypeStruct(chain.global_shard_shape(k), jnp.float32,
                                 sharding=NamedSharding(mesh, chain.shard_spec))
            for chain, k in self._refs
        )
        local, owners = self._inner_sharding
        leaves, treedef = jax.tree.flatten(local)
        inner = []
        for leaf, owner in zip(leaves, owners):
            if owner is None:
                inner.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, P())))
                continue
            chain, _ = self._refs[owner]
            split = chain.shard_spec[-1]
            spec = P(*([None] * (len(leaf.shape) - 1)), split)
            shape = (*leaf.shape[:-1], leaf.shape[-1] * chain.axis_size * chain.spec_size)
            inner.append(jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(mesh, spec)))
        return DistState(master, jax.tree.unflatten(treedef, inner), self.layout)

    def state_specs(self) -> DistState:
        """``PartitionSpec``s of the state, for ``shard_map``'s ``in_specs``/``out_specs``."""
        return jax.tree.map(lambda s: s.sharding.spec, self.abstract_state())

    def init_sharded(self, params: PyTree) -> DistState:
        """The global state for ``params`` (global arrays), sharded like the gradient shards."""
        fn = _compat.shard_map(
            self.init, mesh=self.sync.mesh, in_specs=(self.sync.param_specs,), out_specs=self.state_specs()
        )
        return jax.jit(fn)(params)

    def check_state(self, state: Any) -> DistState:
        """Returns ``state`` if it is a global state of this optimizer's layout, else raises.

        Checks the layout fingerprint, the ``tx`` state structure, and every shape and dtype.
        """
        if not isinstance(state, DistState):
            raise TypeError(f"expected a DistState from DistributedOptimizer.init_sharded, got {type(state).__name__}")
        if state.fingerprint != self.fingerprint:
            raise ValueError(layout_mismatch(state.fingerprint, self.fingerprint))
        expected = self.abstract_state()
        got_leaves, got_def = jax.tree.flatten(state)
        want_leaves, want_def = jax.tree.flatten(expected)
        if got_def != want_def:
            raise ValueError(
                "optimizer state structure differs from this optimizer's (a different tx?):\n"
                f"  expected {want_def}\n  got      {got_def}"
            )
        for path, got, want in zip(leaf_paths(expected), got_leaves, want_leaves):
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise ValueError(
                    f"optimizer state leaf {path!r} is {np.dtype(got.dtype)}{list(got.shape)}, this "
                    f"optimizer expects {np.dtype(want.dtype)}{list(want.shape)}"
                )
        return state

    def memory_summary(self) -> dict[str, int | float]:
        """Optimizer bytes per device: this optimizer vs. replicated fp32 master + optax state.

        ``distributed``: master shards plus ``tx`` state per device (padding included).
        ``replicated``: a float32 copy of this device's parameter blocks plus ``tx.init`` on it.

        Example::

            >>> opt.memory_summary()  # doctest: +SKIP
            {'distributed': 1245184, 'replicated': 9830412, 'ratio': 0.1267}
        """
        mesh = self.sync.mesh
        distributed = 0
        for leaf in jax.tree.leaves(self.abstract_state()):
            nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
            split = math.prod(int(mesh.shape[a]) for e in leaf.sharding.spec if e is not None
                              for a in ((e,) if isinstance(e, str) else e))
            distributed += nbytes // split
        params32 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), self.sync.local_shapes)
        replicated_state = jax.eval_shape(self.tx.init, params32)
        replicated = sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(params32) + jax.tree.leaves(replicated_state)
        )
        return {"distributed": distributed, "replicated": replicated, "ratio": round(distributed / replicated, 4)}

    # -- internals --------------------------------------------------------------------------
    @functools.cached_property
    def _inner_sharding(self) -> tuple[PyTree, list[int | None]]:
        # A tx state leaf is sharded iff its shape follows a shard's: evaluate init with shard i
        # scaled by the i-th prime and read which shard each leaf's last dimension follows.
        primes = _primes(len(self._refs))

        def shapes(scaled: bool) -> PyTree:
            shards = []
            for (chain, k), p in zip(self._refs, primes):
                *rows, size = chain.shard_shape(k)
                shards.append(jax.ShapeDtypeStruct((*rows, size * (p if scaled else 1)), jnp.float32))
            return jax.eval_shape(lambda m: self._init_inner(tuple(m), owner=0), shards)

        base, scaled = shapes(False), shapes(True)
        owners: list[int | None] = []
        for path, a, b in zip(leaf_paths(base), jax.tree.leaves(base), jax.tree.leaves(scaled)):
            if a.shape == b.shape:
                owners.append(None)
                continue
            ratio = b.shape[-1] // max(a.shape[-1], 1) if a.shape else 0
            owner = primes.index(ratio) if ratio in primes and b.shape[:-1] == a.shape[:-1] else None
            if owner is None or a.shape != self._refs[owner][0].shard_shape(self._refs[owner][1]):
                raise ValueError(
                    f"tx state leaf {path!r} has shape {a.shape} for the shards, which neither "
                    "matches one shard element-wise nor is independent of them; DistributedOptimizer "
                    "supports element-wise transforms only"
                )
            owners.append(owner)
        return base, owners

    def _check_local_state(self, state: Any) -> None:
        if not isinstance(state, DistState):
            raise TypeError(f"expected a DistState from DistributedOptimizer.init, got {type(state).__name__}")
        if state.fingerprint != self.fingerprint:
            raise ValueError(layout_mismatch(state.fingerprint, self.fingerprint))
        shapes = [tuple(m.shape) for m in state.master]
        want = [chain.shard_shape(k) for chain, k in self._refs]
        if shapes != want:
            raise ValueError(f"master shards have shapes {shapes}, this optimizer's shards are {want} per device")

    def _check_grads(self, grads: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        want = [chain.shard_shape(k) for chain, k in self._refs]
        got = [tuple(g.shape) for g in grads]
        if got != want:
            raise ValueError(
                f"gradient shards have shapes {got}, expected {want}: pass the shards returned by "
                "this optimizer's sync (sync.reduce_scatter or sync.value_and_grad)"
            )
        return tuple(g.astype(jnp.float32) for g in grads)

    def _zero_padding(self, updates: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        # Padding elements get zero gradients, so element-wise transforms keep them at zero
        # already; this also holds for transforms that add something (noise, constants).
        out = []
        every_leaf = [True] * len(self.sync.placements)
        for i, ((chain, k), u) in enumerate(zip(self._refs, updates)):
            if chain.layout.buckets[k].padding:
                u = jnp.where(_inside_runs(chain.positions(k), self._view.runs(i, every_leaf)), u, jnp.zeros_like(u))
            out.append(u)
        return tuple(out)


def _primes(n: int) -> list[int]:
    out: list[int] = []
    candidate = 2
    while len(out) < n:
        if all(candidate % p for p in out):
            out.append(candidate)
        candidate += 1
    return out


def layout_mismatch(got: str, want: str) -> str:
    """The error text for an optimizer state of another bucket layout."""
    return (
        f"optimizer state was built for a different bucket layout (fingerprint {got!r}; this "
        f"optimizer's is {want!r}): another model, bucket_size, order or mesh. Build the state "
        "with this optimizer (init / init_sharded) or restore a checkpoint saved with the same layout."
    )

"""``DistributedOptimizer``: sharded fp32 master weights and optimizer state (ZeRO-1/2).

Megatron-LM's ``DistributedOptimizer`` on top of :class:`~jax_drain.GradSync`: each device of the
data axis keeps the float32 master copy of *its slice* of every gradient bucket and the optax
state of that slice only, so optimizer memory per device is ~``1 / axis_size`` of a replicated
optax setup. One step, inside ``jax.shard_map``:

1. ``GradSync`` reduce-scatters the gradients bucket by bucket (drained, fp32-accumulated);
2. the optax transform ``tx`` updates this device's float32 master shards;
3. the new master shards are cast to each bucket's parameter dtype and all-gathered bucket by
   bucket in *forward* order (the reverse of the reduce-scatter's backward order), each gather
   fenced behind the previous one's result -- Megatron's ``next_param_gather_bucket_group``
   chain -- so at most ``gather_max_in_flight`` gathered buckets are in flight.

``tx`` sees a *tuple of 1-D float32 shards* (one per bucket) as its "params", not the parameter
tree. Element-wise transforms (``sgd``, ``adam``, ``adamw``, ``lion``, ``rmsprop``, schedules,
``scale_by_*``...) therefore give exactly what they give on the replicated tree. Two things
optax expresses through the tree need the flat-aware versions here, which also work unchanged
on an ordinary parameter tree (so one ``tx`` serves both a replicated reference and this):

* :func:`masked` -- a mask over the *parameter tree* (pytree of bools or a callable on params,
  as for ``optax.masked``), applied element-wise to the flat shards via the bucket layout;
* :func:`clip_by_global_norm` -- the norm sums squares over all shards of all buckets (a
  scalar ``psum`` over the data axis).

Example (AdamW without decay on biases and LayerNorm scales, with clipping)::

    import optax, jax_drain as jd
    from jax.sharding import PartitionSpec as P

    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)        # kernels only
    tx = optax.chain(
        jd.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        jd.masked(optax.add_decayed_weights(0.1), decay),
        optax.scale_by_learning_rate(3e-4),
    )
    sync = jd.GradSync(params, mesh, axis="data", bucket_size=40_000_000)
    opt = jd.DistributedOptimizer(tx, sync)
    opt_state = opt.init_sharded(params)          # sharded over "data"

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), opt.state_specs(), P("data")),
                   out_specs=(P(), opt.state_specs(), P()))
    def step(params, opt_state, batch):
        loss, shards = sync.value_and_grad(loss_fn)(params, batch)
        params, opt_state = opt.update(shards, opt_state)
        return params, opt_state, loss

Scanned layer stacks: ``sync`` may be a :class:`~jax_drain.ScanGradSync`. The master shards
are then its :class:`~jax_drain.ScanShards` layout, flattened to one tuple ``(*layers, *rest)``:
a layer bucket's shard is float32 ``[num_layers, shard]`` (row ``l``: layer ``l``), so ``tx``
sees 2-D shards next to 1-D ones. ``update`` takes the ``ScanShards`` from
``sync.value_and_grad``; masks and the global norm cover every layer's rows::

    sync = jd.ScanGradSync(params, mesh, stacked=lambda path: path.startswith("blocks/"))
    opt = jd.DistributedOptimizer(tx, sync)     # same tx, same state_specs / init_sharded

``optax.adamw(..., mask=...)`` and ``optax.clip_by_global_norm`` must *not* be used here: the
former's mask is matched against the tuple of shards, the latter computes a per-shard norm.
``update`` traces ``tx`` once to catch the second kind of mistake (any reduction over shard
elements that is not combined across the data axis) and raises.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_drain import _compat
from jax_drain.collectives import all_gather_bucket
from jax_drain.drain import check_max_in_flight, sequenced_map
from jax_drain.layout import BucketLayout, leaf_paths
from jax_drain.mesh import require_bound_axes
from jax_drain.scan import ScanGradSync, ScanShards
from jax_drain.sync import SCOPE_PREFIX, GradSync

PyTree = Any
Mask = PyTree | Callable[[PyTree], PyTree]

#: Prefix of the ``jax.named_scope`` around each bucket's parameter all-gather
#: (``jax_drain/gather/bucket<k>``, ``k`` in dispatch order); distinct from the reduce-scatter's
#: ``jax_drain/bucket<k>`` so schedule checks can tell them apart.
GATHER_SCOPE = f"{SCOPE_PREFIX}/gather"


@functools.partial(jax.tree_util.register_dataclass, data_fields=("master", "inner"), meta_fields=("fingerprint",))
@dataclasses.dataclass(frozen=True)
class DistState:
    """A :class:`DistributedOptimizer`'s state; a pytree.

    ``master[k]``: float32 master weights of bucket ``k`` (dispatch order); inside ``shard_map``
    this device's ``shard_sizes[k]`` elements, outside the whole padded bucket sharded over the
    data axis. With a :class:`~jax_drain.ScanGradSync` the layer buckets come first, each
    ``[num_layers, shard]`` (``[num_layers, bucket]`` outside), then the other buckets. ``inner``: ``tx``'s state on the tuple of master shards. ``fingerprint``: static
    pytree metadata naming the bucket layout the shards belong to, so a state built for another
    model, bucket size or axis size is refused instead of silently mis-applied.
    """

    master: tuple[jax.Array, ...]
    inner: PyTree
    fingerprint: str


def layout_fingerprint(sync: GradSync | ScanGradSync) -> str:
    """A short hash of ``sync``'s bucket layout: leaf paths, shapes, dtypes, offsets, axis size.

    Two syncs with equal fingerprints put every parameter element at the same place in the same
    shard, so their optimizer states are interchangeable. For a :class:`~jax_drain.ScanGradSync`
    it covers the per-layer layout, the number of layers and the other leaves' layout.

    Example::

        >>> layout_fingerprint(sync)  # doctest: +SKIP
        '3f9c0e1a8b7d2c45'
    """
    if isinstance(sync, ScanGradSync):
        description: dict[str, Any] = {
            "axis_size": sync.axis_size,
            "num_layers": sync.num_layers,
            "layer_buckets": _describe_buckets(sync.layer_layout),
            "buckets": [] if sync.rest_sync is None else _describe_buckets(sync.rest_sync.layout),
        }
    else:
        description = {"axis_size": sync.axis_size, "buckets": _describe_buckets(sync.layout)}
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def _describe_buckets(layout: BucketLayout) -> list:
    return [
        [str(b.dtype), b.padded_size,
         [[layout.slots[i].path, list(layout.slots[i].shape), str(layout.slots[i].dtype),
           layout.slots[i].offset] for i in b.leaves]]
        for b in layout.buckets
    ]


# -- the master shards of either sync kind -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One master shard: this device's slice of one bucket (of every layer, for a layer bucket)."""

    layout: BucketLayout  # the layout the bucket belongs to
    bucket: int  # its index in ``layout.buckets``
    leaves: tuple[int, ...]  # index in the *full* params' leaves of each of ``layout``'s leaves
    rows: int | None  # num_layers for a ``[num_layers, size]`` layer shard, None for a 1-D one
    size: int  # shard elements (per row) one device holds
    spec: P  # its global PartitionSpec
    scope: str  # jax.named_scope of its all-gather

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.size,) if self.rows is None else (self.rows, self.size)

    def global_shape(self, axis_size: int) -> tuple[int, ...]:
        return (self.size * axis_size,) if self.rows is None else (self.rows, self.size * axis_size)


class _ShardPlan:
    """How a sync's buckets become master shards; the one interface DistributedOptimizer uses.

    ``pieces`` are in dispatch order (a ScanGradSync's layer buckets, reduced inside the backward
    scan, first); ``split`` is the PartitionSpec entry the shards' last axis is split by.
    """

    def __init__(self, sync: GradSync | ScanGradSync):
        self.sync = sync
        if isinstance(sync, ScanGradSync):
            self.split = P(sync.axis)
            spec_2d = P(None, *self.split)
            layers = tuple(
                _Piece(sync.layer_layout, k, sync._stacked, sync.num_layers, size, spec_2d,
                       f"{GATHER_SCOPE}/layers/bucket{k}")
                for k, size in enumerate(sync.layer_shard_sizes)
            )
            rest = () if sync.rest_sync is None else tuple(
                _Piece(sync.rest_sync.layout, j, sync._rest, None, size, self.split, f"{GATHER_SCOPE}/bucket{j}")
                for j, size in enumerate(sync.rest_shard_sizes)
            )
            self.pieces, self.num_layer_pieces = layers + rest, len(layers)
            self.params = jax.tree.unflatten(
                sync._treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in sync._shapes]
            )
        else:
            self.split = _shard_spec(sync)
            everything = tuple(range(len(sync.layout.slots)))
            self.pieces = tuple(
                _Piece(sync.layout, k, everything, None, size, self.split, f"{GATHER_SCOPE}/bucket{k}")
                for k, size in enumerate(sync.shard_sizes)
            )
            self.num_layer_pieces = 0
            self.params = jax.tree.unflatten(
                sync.layout.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in sync.layout.slots]
            )
        self.fingerprint = layout_fingerprint(sync)

    @property
    def axis_size(self) -> int:
        """Devices one bucket is split over."""
        return self.sync.axis_size

    def init_master(self, params: PyTree) -> tuple[jax.Array, ...]:
        """This device's float32 slices of ``params`` (inside ``shard_map``)."""
        if isinstance(self.sync, ScanGradSync):
            master = self.sync.init_master(params)
            return (*master.layers, *master.rest)
        buckets = self.sync.flatten(params, jnp.float32)
        rank = jax.lax.axis_index(self.sync.axis)
        return tuple(
            jax.lax.dynamic_slice_in_dim(b, rank * n, n) for b, n in zip(buckets, self.sync.shard_sizes)
        )

    def flat(self, shards: Sequence[jax.Array] | ScanShards) -> tuple[jax.Array, ...]:
        """The sync's gradient shards as one tuple in ``pieces`` order."""
        if isinstance(shards, ScanShards):
            return (*shards.layers, *shards.rest)
        return tuple(shards)

    def gather(self, piece: _Piece, shard: jax.Array) -> jax.Array:
        """The whole bucket (``[num_layers, bucket]`` for a layer shard) in its params' dtype."""
        dtype = piece.layout.buckets[piece.bucket].dtype
        if piece.rows is None:
            return all_gather_bucket(shard, self.sync.axis, dtype=dtype)
        # One 1-D gather of every layer's slice: [L, s] -> [n * L * s] -> [n, L, s] -> [L, n * s].
        whole = all_gather_bucket(shard.reshape(-1), self.sync.axis, dtype=dtype)
        n = self.axis_size
        return whole.reshape(n, piece.rows, piece.size).transpose(1, 0, 2).reshape(piece.rows, n * piece.size)

    def unflatten(self, buckets: Sequence[jax.Array]) -> PyTree:
        """The params-shaped tree from whole buckets in ``pieces`` order."""
        if isinstance(self.sync, ScanGradSync):
            k = self.num_layer_pieces
            return self.sync.unflatten(ScanShards(tuple(buckets[:k]), tuple(buckets[k:])))
        return self.sync.unflatten(tuple(buckets))

    def state_spec(self, ndim: int) -> P:
        """Spec of a sharded ``tx`` state leaf: split along its last axis, like the shards."""
        return P(*([None] * (ndim - 1)), *self.split)


# -- the flat view that DistributedOptimizer exposes to `masked` / `clip_by_global_norm` ----------


@dataclasses.dataclass(frozen=True)
class _FlatView:
    """Set while ``tx`` runs on flat shards: how shard elements map back to parameters."""

    pieces: tuple[_Piece, ...]  # one per shard ``tx`` sees, in order
    params: PyTree  # the full parameter tree as ShapeDtypeStructs (what masks are called on)
    axis: Any  # the sync's (inner) data axis or axes: shards are split over it
    inside_shard_map: bool  # False while only shapes are being evaluated (no axis bound)

    def abstract_params(self) -> PyTree:
        return self.params

    def leaf_mask(self, mask: Mask) -> list[bool]:
        """One Python bool per parameter leaf (``jax.tree.leaves`` order)."""
        return _leaf_mask(mask, self.params)

    def shard_masks(self, mask: Mask) -> tuple[jax.Array, ...]:
        """This device's boolean mask of each shard; padding is always False.

        A mask is ``[size]``: a layer shard's rows (layers) share it, and it broadcasts.
        """
        per_leaf = self.leaf_mask(mask)
        out = []
        for piece in self.pieces:
            layout = piece.layout
            boundaries: list[int] = []  # the mask flips at each boundary; runs are [start, end)
            for i in layout.buckets[piece.bucket].leaves:
                if not per_leaf[piece.leaves[i]]:
                    continue
                slot = layout.slots[i]
                if boundaries and boundaries[-1] == slot.offset:
                    boundaries[-1] = slot.offset + slot.size  # extend the open run
                else:
                    boundaries += [slot.offset, slot.offset + slot.size]
            out.append(_inside_runs(_shard_indices(self.axis, piece.size), boundaries))
        return tuple(out)


_FLAT: contextvars.ContextVar[_FlatView | None] = contextvars.ContextVar("jax_drain_flat", default=None)


@contextlib.contextmanager
def _flat_view(view: _FlatView) -> Iterator[None]:
    token = _FLAT.set(view)
    try:
        yield
    finally:
        _FLAT.reset(token)


def _shard_indices(axis: str, size: int) -> jax.Array:
    """Bucket positions of this device's shard elements: ``rank * size + [0, size)``."""
    return jax.lax.axis_index(axis) * size + jax.lax.iota(jnp.int32, size)


def _inside_runs(index: jax.Array, boundaries: Sequence[int]) -> jax.Array:
    # Inside a run iff an odd number of boundaries are <= index: a few fused compares per element,
    # no mask constant the size of the model in the program.
    if not boundaries:
        return jnp.zeros(index.shape, bool)
    crossed = sum((index >= b).astype(jnp.int32) for b in boundaries)
    return (crossed & 1) == 1


def _leaf_mask(mask: Mask, params: PyTree) -> list[bool]:
    tree = mask(params) if callable(mask) else mask
    try:
        # A mask may be a prefix of the params tree (optax's rule): broadcast each entry.
        full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params)
    except ValueError as e:
        raise ValueError(
            "the mask does not match the parameter tree (it must have the same structure, or a "
            f"prefix of it, with bool leaves): {e}"
        ) from None
    out = []
    for path, m in zip(leaf_paths(params), jax.tree.leaves(full)):
        if isinstance(m, jax.core.Tracer) or not np.ndim(m) == 0:
            raise TypeError(
                f"mask entry for {path!r} must be a Python bool (masks are static), got {m!r}"
            )
        out.append(bool(m))
    return out


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
    plain = optax.masked(inner, mask)
    inner = optax.with_extra_args_support(inner)

    def init(params: PyTree) -> optax.MaskedState:
        if _FLAT.get() is None:
            return plain.init(params)
        return optax.MaskedState(inner_state=inner.init(params))

    def update(updates, state, params=None, **extra_args):
        view = _FLAT.get()
        if view is None:
            return plain.update(updates, state, params, **extra_args)
        new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        masks = view.shard_masks(mask)
        selected = tuple(jnp.where(m, n, u) for m, n, u in zip(masks, new_updates, updates))
        return selected, optax.MaskedState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm spans all shards of all buckets.

    On flat shards the squared norms of this device's shards are summed and ``psum``-ed over the
    data axis (one scalar all-reduce); padding elements are zero and add nothing. On an ordinary
    parameter tree this is ``optax.clip_by_global_norm(max_norm)``. Same clipping rule as optax:
    ``u * max_norm / norm`` when ``norm >= max_norm``.

    Example::

        tx = optax.chain(jd.clip_by_global_norm(1.0), optax.adam(3e-4))
    """
    plain = optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        view = _FLAT.get()
        if view is None:
            return plain.update(updates, state, params)
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(plain.init, update)


def global_norm(updates: PyTree) -> jax.Array:
    """L2 norm of ``updates``; on a ``DistributedOptimizer``'s flat shards, over all devices.

    Usable inside any ``tx`` given to :class:`DistributedOptimizer` (e.g. to log the gradient
    norm from a custom transform) and on ordinary trees (``optax.tree.norm``).
    """
    view = _FLAT.get()
    if view is None:
        return optax.tree.norm(updates)
    if not view.inside_shard_map:
        raise ValueError("global_norm on flat shards needs the data axis: call it from tx.update")
    local = sum(jnp.sum(jnp.square(u.astype(jnp.float32))) for u in jax.tree.leaves(updates))
    return jnp.sqrt(jax.lax.psum(local, view.axis))


# -- the element-wise check -------------------------------------------------------------------

# Primitives that combine several elements of one operand into one value.
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "dot_general", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "reduce",
})
# Collectives after which a value no longer depends on how the buckets are sharded.
_COMBINING = frozenset({
    "psum", "psum2", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
})


def _local_reductions(jaxpr: Any, tainted_inputs: Sequence[frozenset] | None = None) -> list[frozenset]:
    """For each output of ``jaxpr``: the reductions over array elements that reach it without a
    cross-device combine in between (names of the primitives)."""
    taint: dict[Any, frozenset] = {}
    for v, t in zip(jaxpr.invars, tainted_inputs or ()):
        taint[v] = t

    def of(v: Any) -> frozenset:
        return frozenset() if isinstance(v, _compat.Literal) else taint.get(v, frozenset())

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = frozenset().union(*(of(v) for v in eqn.invars))
        if name in _COMBINING:
            out = frozenset()
        else:
            out = ins
            if name in _REDUCTIONS and any(
                getattr(getattr(v, "aval", None), "size", 1) > 1 for v in eqn.invars
            ):
                out |= {name}
            for sub in _sub_jaxprs(eqn):
                mapped = [of(v) for v in eqn.invars] if len(sub.invars) == len(eqn.invars) else None
                out |= frozenset().union(*_local_reductions(sub, mapped))
        for v in eqn.outvars:
            taint[v] = out
    return [of(v) for v in jaxpr.outvars]


def _sub_jaxprs(eqn: Any) -> list[Any]:
    subs = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(item, "eqns") and hasattr(item, "outvars"):
                subs.append(item)
    return subs


# -- the optimizer ----------------------------------------------------------------------------


class DistributedOptimizer:
    """Sharded fp32 master weights + optax state over ``sync``'s buckets; see the module doc.

    Args:
        tx: any element-wise optax ``GradientTransformation`` (see the module doc for masks and
            clipping: :func:`masked`, :func:`clip_by_global_norm`).
        sync: the :class:`~jax_drain.GradSync` or :class:`~jax_drain.ScanGradSync` whose
            reduce-scattered shards ``update`` takes; its layout, mesh and data axis define the
            shards.
        gather_max_in_flight: depth of the parameter all-gather chain: gather ``k + depth`` (in
            forward order) waits for gather ``k``'s result. ``"sync"`` (default) uses the sync's
            ``max_in_flight``, or 1 when the sync is not drained; ``None`` leaves the gathers
            unchained (XLA may then combine them into one).
        check_elementwise: trace ``tx`` in ``update`` and refuse reductions over shard elements
            that are not combined across the data axis (they would make the result depend on
            the sharding, e.g. ``optax.clip_by_global_norm``).

    Inside ``jax.shard_map``: :meth:`init`, :meth:`update`, :meth:`gather_params`. Outside:
    :meth:`init_sharded`, :meth:`state_specs`, :meth:`abstract_state`, :meth:`check_state`,
    :meth:`memory_summary`.
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        sync: GradSync | ScanGradSync,
        *,
        gather_max_in_flight: int | str | None = "sync",
        check_elementwise: bool = True,
    ):
        if not isinstance(sync, (GradSync, ScanGradSync)):
            raise TypeError(
                f"sync must be a jax_drain.GradSync or jax_drain.ScanGradSync, got {type(sync).__name__}"
            )
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
        _check_supported(sync)
        self.tx = tx
        self.sync = sync
        self.axis = sync.axis  # a mesh axis name or a tuple of them (shards split over all)
        # Every data-parallel axis the shards live on: the inner axes they are split over and
        # the outer (HSDP) axes they are replicated along.
        self._axes = tuple(getattr(sync, "axes", (sync.axis,))) + tuple(getattr(sync, "outer_axes", ()))
        if gather_max_in_flight == "sync":
            gather_max_in_flight = sync.max_in_flight or 1
        elif isinstance(gather_max_in_flight, str):
            raise ValueError(f"gather_max_in_flight must be 'sync', an int >= 1 or None, got {gather_max_in_flight!r}")
        self.gather_max_in_flight = check_max_in_flight(gather_max_in_flight)
        self.check_elementwise = bool(check_elementwise)
        self._plan = _ShardPlan(sync)
        self.fingerprint = self._plan.fingerprint

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer(axis={self.axis!r}, num_shards={len(self._plan.pieces)}, "
            f"gather_max_in_flight={self.gather_max_in_flight}, fingerprint={self.fingerprint!r})"
        )

    # -- inside shard_map -------------------------------------------------------------------
    def init(self, params: PyTree) -> DistState:
        """This device's state from the replicated ``params``; call inside ``jax.shard_map``.

        Master shards are this device's slices of the float32-cast buckets (padding zero).
        """
        self._check_inside_shard_map("init")
        master = self._plan.init_master(params)
        return DistState(master, self._init_inner(master, inside_shard_map=True), self.fingerprint)

    def update(self, grads: Sequence[jax.Array] | ScanShards, state: DistState) -> tuple[PyTree, DistState]:
        """One optimizer step on this device's shards; call inside ``jax.shard_map``.

        Args:
            grads: the float32 gradient shards from ``sync.reduce_scatter`` /
                ``sync.value_and_grad`` (one per bucket, dispatch order; a
                :class:`~jax_drain.ScanShards` for a ``ScanGradSync``).
            state: this device's :class:`DistState`.

        Returns:
            ``(params, state)``: the updated parameters as a replicated tree in their own dtypes
            (gathered bucket by bucket, forward order) and the new state.
        """
        self._check_inside_shard_map("update")
        self._check_local_state(state)
        grads = self._check_grads(grads)
        with _flat_view(self._view(inside_shard_map=True)):
            if self.check_elementwise:
                self._check_tx_elementwise(grads, state)
            updates, inner = self.tx.update(grads, state.inner, state.master)
        updates = self._zero_padding(updates)
        # optax.apply_updates, in float32.
        master = tuple(
            (m + u.astype(jnp.float32)).astype(jnp.float32) for m, u in zip(state.master, updates)
        )
        return self.gather_params(master), DistState(master, inner, self.fingerprint)

    def gather_params(self, master: Sequence[jax.Array]) -> PyTree:
        """The replicated parameter tree from master shards; call inside ``jax.shard_map``.

        Each shard is cast to its bucket's dtype, then all-gathered; the gathers run in forward
        order (last dispatched bucket first: it holds the first layers), chained by
        :func:`jax_drain.sequenced_map` with depth ``gather_max_in_flight``.
        """
        self._check_inside_shard_map("gather_params")
        pieces = self._plan.pieces
        master = tuple(master)
        if [tuple(m.shape) for m in master] != [p.local_shape for p in pieces]:
            raise ValueError(
                f"master shards have shapes {[tuple(m.shape) for m in master]}, expected "
                f"{[p.local_shape for p in pieces]} per device"
            )
        forward = list(reversed(range(len(pieces))))

        def gather(j: int, shard: jax.Array) -> jax.Array:
            piece = pieces[forward[j]]
            with jax.named_scope(piece.scope):
                return self._plan.gather(piece, shard)

        gathered = sequenced_map(gather, [master[k] for k in forward], self.gather_max_in_flight)
        return self._plan.unflatten(tuple(reversed(gathered)))

    def unflatten_master(self, master: Sequence[jax.Array]) -> PyTree:
        """The float32 master weights as a params-shaped tree, from a *global* state's master.

        Example::

            master = opt.unflatten_master(state.master)   # outside shard_map
        """
        return self._plan.unflatten(tuple(master))

    # -- outside shard_map ------------------------------------------------------------------
    def abstract_state(self) -> DistState:
        """The global state as ``jax.ShapeDtypeStruct``s with their ``NamedSharding``s.

        Sharded leaves (master shards, ``tx`` state that scales with them) are split over the
        data axis; the rest (step counts) is replicated. A restore target for orbax.
        """
        mesh, n, plan = self.sync.mesh, self._plan.axis_size, self._plan
        whole = NamedSharding(mesh, P())
        master = tuple(
            jax.ShapeDtypeStruct(p.global_shape(n), jnp.float32, sharding=NamedSharding(mesh, p.spec))
            for p in plan.pieces
        )
        local, sharded = self._inner_sharding
        leaves, treedef = jax.tree.flatten(local)
        inner = [
            jax.ShapeDtypeStruct((*leaf.shape[:-1], leaf.shape[-1] * n), leaf.dtype,
                                 sharding=NamedSharding(mesh, plan.state_spec(len(leaf.shape))))
            if is_sharded else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=whole)
            for leaf, is_sharded in zip(leaves, sharded)
        ]
        return DistState(master, jax.tree.unflatten(treedef, inner), self.fingerprint)

    def state_specs(self) -> DistState:
        """``PartitionSpec``s of the state, for ``shard_map``'s ``in_specs``/``out_specs``."""
        return jax.tree.map(lambda s: s.sharding.spec, self.abstract_state())

    def init_sharded(self, params: PyTree) -> DistState:
        """The global state for ``params``, sharded over the data axis (runs a jitted init)."""
        fn = _compat.shard_map(
            self.init, mesh=self.sync.mesh, in_specs=(P(),), out_specs=self.state_specs()
        )
        return jax.jit(fn)(params)

    def check_state(self, state: Any) -> DistState:
        """Returns ``state`` if it is a global state of this optimizer's layout, else raises.

        Checks the layout fingerprint, the ``tx`` state structure, and every shape and dtype.
        """
        if not isinstance(state, DistState):
            raise TypeError(
                f"expected a DistState from DistributedOptimizer.init_sharded, got {type(state).__name__}"
            )
        if state.fingerprint != self.fingerprint:
            raise ValueError(_layout_mismatch(state.fingerprint, self.fingerprint))
        expected = self.abstract_state()
        got_leaves, got_def = jax.tree.flatten(state)
        want_leaves, want_def = jax.tree.flatten(expected)
        if got_def != want_def:
            raise ValueError(
                "optimizer state structure differs from this optimizer's (a different tx?):\n"
                f"  expected {want_def}\n  got      {got_def}"
            )
        paths = leaf_paths(expected)
        for path, got, want in zip(paths, got_leaves, want_leaves):
            if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
                raise ValueError(
                    f"optimizer state leaf {path!r} is {np.dtype(got.dtype)}{list(got.shape)}, this "
                    f"optimizer expects {np.dtype(want.dtype)}{list(want.shape)}"
                )
        return state

    def memory_summary(self) -> dict[str, int | float]:
        """Optimizer bytes per device: this optimizer vs. replicated fp32 master + optax state.

        ``distributed``: master shards plus ``tx`` state per device (padding included).
        ``replicated``: a float32 copy of the params plus ``tx.init`` on it, on every device.

        Example::

            >>> opt.memory_summary()  # doctest: +SKIP
            {'distributed': 1245184, 'replicated': 9830412, 'ratio': 0.1267}
        """
        n = self._plan.axis_size
        distributed = 0
        for leaf in jax.tree.leaves(self.abstract_state()):
            nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
            split = any(entry is not None for entry in leaf.sharding.spec)
            distributed += nbytes // n if split else nbytes
        params32 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), self._plan.params)
        replicated_state = jax.eval_shape(self.tx.init, params32)
        replicated = sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(params32) + jax.tree.leaves(replicated_state)
        )
        return {"distributed": distributed, "replicated": replicated, "ratio": round(distributed / replicated, 4)}

    # -- internals --------------------------------------------------------------------------
    def _view(self, inside_shard_map: bool) -> _FlatView:
        return _FlatView(self._plan.pieces, self._plan.params, self.axis, inside_shard_map)

    def _init_inner(self, master: Sequence[Any], inside_shard_map: bool) -> PyTree:
        try:
            with _flat_view(self._view(inside_shard_map)):
                return self.tx.init(tuple(master))
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"tx.init failed on the flat master shards ({type(e).__name__}: {e}).\n"
                "Under a DistributedOptimizer tx sees a tuple of float32 shards, one per "
                "bucket (1-D, or [num_layers, shard] for a ScanGradSync's layer buckets), not the "
                "parameter tree. Masks or labels over the parameter tree "
                "(optax.masked, optax.adamw(mask=...), optax.multi_transform) cannot match it: "
                "use jax_drain.masked(inner, mask) with the same mask instead."
            ) from e

    @functools.cached_property
    def _inner_sharding(self) -> tuple[PyTree, list[bool]]:
        # A tx state leaf is sharded iff its shape follows the shards': evaluate init at two
        # shard sizes and see which leaves double along their last dimension (the split one).
        def shapes(scale: int) -> PyTree:
            shards = tuple(
                jax.ShapeDtypeStruct((*p.local_shape[:-1], p.size * scale), jnp.float32)
                for p in self._plan.pieces
            )
            return jax.eval_shape(lambda m: self._init_inner(m, inside_shard_map=False), shards)

        one, two = shapes(1), shapes(2)
        paths = leaf_paths(one)
        sharded = []
        for path, a, b in zip(paths, jax.tree.leaves(one), jax.tree.leaves(two)):
            if a.shape == b.shape:
                sharded.append(False)
            elif len(a.shape) >= 1 and b.shape == (*a.shape[:-1], 2 * a.shape[-1]):
                sharded.append(True)
            else:
                raise ValueError(
                    f"tx state leaf {path!r} has shape {a.shape} for the shards, which neither "
                    "matches them element-wise nor is independent of them; DistributedOptimizer "
                    "supports element-wise transforms only"
                )
        return one, sharded

    def _check_inside_shard_map(self, method: str) -> None:
        require_bound_axes(f"DistributedOptimizer.{method}", self.sync.mesh, self._axes,
                           hint="; outside shard_map use init_sharded(params)")

    def _check_local_state(self, state: Any) -> None:
        if not isinstance(state, DistState):
            raise TypeError(f"expected a DistState from DistributedOptimizer.init, got {type(state).__name__}")
        if state.fingerprint != self.fingerprint:
            raise ValueError(_layout_mismatch(state.fingerprint, self.fingerprint))
        shapes = [tuple(m.shape) for m in state.master]
        want = [p.local_shape for p in self._plan.pieces]
        if shapes != want:
            raise ValueError(f"master shards have shapes {shapes}, this optimizer's shards are {want} per device")

    def _check_grads(self, grads: Sequence[jax.Array] | ScanShards) -> tuple[jax.Array, ...]:
        if isinstance(self.sync, ScanGradSync) and not isinstance(grads, ScanShards):
            raise TypeError(
                f"a ScanGradSync's optimizer takes the ScanShards from sync.value_and_grad / "
                f"sync.reduce_scatter, got {type(grads).__name__}"
            )
        grads = self._plan.flat(grads)
        want = [p.local_shape for p in self._plan.pieces]
        got = [tuple(g.shape) for g in grads]
        if got != want:
            raise ValueError(
                f"gradient shards have shapes {got}, expected {want}: pass the shards returned by "
                "this optimizer's sync (sync.reduce_scatter or sync.value_and_grad)"
            )
        return tuple(g.astype(jnp.float32) for g in grads)

    def _check_tx_elementwise(self, grads: tuple[jax.Array, ...], state: DistState) -> None:
        traced = jax.make_jaxpr(lambda g, s, p: self.tx.update(g, s, p))(grads, state.inner, state.master)
        leaks = frozenset().union(*_local_reductions(traced.jaxpr))
        if leaks:
            raise ValueError(
                f"tx reduces over shard elements ({', '.join(sorted(leaks))}) without combining the "
                f"result across {self.axis!r}: on sharded buckets its output would depend on how "
                "parameters are split into shards. optax.clip_by_global_norm -> use "
                "jax_drain.clip_by_global_norm; other per-leaf or global transforms (lamb, lars, "
                "adafactor, apply_if_finite, scale_by_trust_ratio) are not element-wise and are "
                "not supported. Pass check_elementwise=False if the reduction is intended."
            )

    def _zero_padding(self, updates: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        # Padding elements get zero gradients, so element-wise transforms keep them at zero
        # already; this also holds for transforms that add something (noise, constants).
        # A layer shard's rows share one [size] condition (broadcast).
        out = []
        for piece, u in zip(self._plan.pieces, updates):
            bucket = piece.layout.buckets[piece.bucket]
            if bucket.padding:
                u = jnp.where(_shard_indices(self.axis, piece.size) < bucket.num_elements, u, jnp.zeros_like(u))
            out.append(u)
        return tuple(out)


def _shard_spec(sync: GradSync) -> P:
    """How a bucket's shards are laid out globally: split over the sync's data axes."""
    spec = getattr(sync, "shard_spec", None)
    return spec if spec is not None else P(sync.axis)


def _check_supported(sync: GradSync) -> None:
    # Tensor-parallel blocks and expert chains need a global norm that counts TP-replicated
    # elements once and a second shard chain; refuse them rather than clip wrongly.
    if getattr(sync, "num_expert_buckets", 0):
        raise ValueError(
            "DistributedOptimizer does not support syncs with expert params (a second bucket "
            "chain) yet; use it with a dense data-parallel GradSync"
        )
    sharded = [pl.path for pl in getattr(sync, "placements", ()) if pl.spec_axes]
    if sharded:
        raise ValueError(
            f"DistributedOptimizer does not support tensor-parallel param_specs yet ({sharded[:3]} "
            "are sharded over non-data axes); use it with data-parallel syncs (axis, outer_axis)"
        )


def _layout_mismatch(got: str, want: str) -> str:
    return (
        f"optimizer state was built for a different bucket layout (fingerprint {got!r}; this "
        f"optimizer's is {want!r}): another model, bucket_size, order or data-axis size. Build the "
        "state with this optimizer (init / init_sharded) or restore a checkpoint saved with the "
        "same layout."
    )

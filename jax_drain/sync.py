"""``GradSync``: bucketed, drained, fp32-accumulated gradient reduce-scatter over mesh axes.

Put together from the layout (:mod:`jax_drain.layout`), the per-bucket collectives
(:mod:`jax_drain.collectives`), the drain (:mod:`jax_drain.drain`) and the mesh declarations
(:mod:`jax_drain.mesh`).

Example (pure data parallel)::

    import jax, jax_drain as jd
    from jax.sharding import PartitionSpec as P

    order = jd.grad_ready_order(loss_fn, params, batch)
    sync = jd.GradSync(params, mesh, axis="data", bucket_size=40_000_000,
                       reduce="fp32_accum", drain=True, order=order)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    def step(params, batch):
        loss, shards = sync.value_and_grad(loss_fn)(params, batch)
        return loss, shards   # shards[i]: this device's float32 slice of bucket i

Example (2 hosts x 4 GPUs x tensor parallel 2: HSDP over ``replica``, TP over ``model``)::

    specs = {"w_in": P(None, "model"), "w_out": P("model", None), "norm": None}
    sync = jd.GradSync(params, mesh, axis="data", outer_axis="replica", param_specs=specs)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(sync.param_specs, sync.batch_spec),
                   out_specs=(P(), sync.shard_spec))
    def step(params, batch):            # params: local blocks (w_in: [d, h / 2])
        return sync.value_and_grad(loss_fn)(params, batch)

Example (MoE on ``("data", "expert")``: experts sharded over ``expert``)::

    sync = jd.GradSync(params, mesh, axis=("data", "expert"), param_specs=specs,
                       expert=lambda path: "/experts/" in path, expert_axis="data")
    loss, shards = sync.value_and_grad(loss_fn)(params, batch)   # inside shard_map
    shards.dense, shards.expert   # two independent bucket chains
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jax_drain import _compat
from jax_drain.collectives import all_reduce_shard, check_mode, reduce_scatter_bucket
from jax_drain.drain import drain_depth, sequenced_map
from jax_drain.layout import BucketLayout
from jax_drain.mesh import (
    AxisSpec, ExpertSpec, LeafPlacement, as_axes, axes_size, mesh_order, place_leaves, require_bound_axes,
)

PyTree = Any

#: Prefix of the ``jax.named_scope`` around each bucket's collectives; the planner finds the
#: sync's collectives in compiled HLO by this name. Dense bucket ``k``: ``jax_drain/bucket{k}``.
SCOPE_PREFIX = "jax_drain"

#: Scope of the expert chain's buckets: ``jax_drain/expert/bucket{k}`` (``k`` numbers the expert
#: chain's own buckets). It does not contain ``jax_drain/bucket``, so dense-chain filters skip it.
EXPERT_SCOPE = f"{SCOPE_PREFIX}/expert"


class Shards(NamedTuple):
    """Gradient shards of a sync with expert params: one tuple per bucket chain.

    ``dense[k]``: this device's float32 slice of dense bucket ``k`` (``shard_sizes[k]``
    elements); ``expert[k]``: of expert bucket ``k`` (``expert_shard_sizes[k]``).
    """

    dense: tuple[jax.Array, ...]
    expert: tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class _Chain:
    """One drained bucket chain: its layout, the leaves it holds and the axes it reduces over."""

    scope: str  # bucket k's collectives run under f"{scope}/bucket{k}"
    layout: BucketLayout
    leaves: tuple[int, ...]  # full-tree leaf index of the layout's leaf i
    axes: tuple[str, ...]  # inner reduce-scatter axes
    size: int  # devices along ``axes``


class GradSync:
    """Reduce-scatters a gradient pytree in buckets over data-parallel mesh axes.

    Args:
        params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``) with *global* shapes;
            only shapes and dtypes are read.
        mesh: the device mesh the step runs on under ``jax.shard_map`` (over all its axes).
        axis: the data-parallel mesh axis (or tuple of axes) to reduce-scatter over. Shards
            are split over these axes, the first one major.
        bucket_size: a bucket closes once it holds at least this many elements (Megatron's
            unit); ``None`` gives one bucket per dtype (per chain).
        reduce: ``"bf16"``, ``"fp32"``, ``"fp32_accum"`` or ``"fp32_accum_streamed"`` (see
            :mod:`jax_drain.collectives`).
        drain: chain the buckets so at most one bucket's collectives (and scratch) are in flight.
        average: divide the sum by the number of data-parallel devices (the mean gradient):
            ``size(axis) * size(outer_axis)``, for expert params too.
        order: leaf indices in gradient-ready order (:func:`jax_drain.grad_ready_order`);
            ``None`` is reverse ``jax.tree.leaves`` order.
        max_in_flight: the drain depth: bucket ``k + max_in_flight`` waits for bucket ``k``.
            ``None`` means 1 with ``drain=True`` and no chain with ``drain=False``.
        param_specs: how each parameter is sharded over the *non*-data axes (tensor/expert
            parallel), as for ``shard_map``'s ``in_specs``: a pytree of ``PartitionSpec`` or
            ``None`` (replicated) with the params' structure or a prefix of it. Inside
            ``shard_map`` a leaf is its local block; buckets are laid out from local shapes.
            Data axes (``axis``, ``outer_axis``) must not appear (no FSDP).
        outer_axis: hierarchical reduction (HSDP, Megatron's
            ``num_distributed_optimizer_instances > 1``): after the reduce-scatter over
            ``axis`` each shard is all-reduced over this axis (or axes), in float32 (in the
            gradient dtype for ``reduce="bf16"``). The all-reduce belongs to its bucket's link
            of the chain: bucket ``k + 1``'s reduce-scatter waits for bucket ``k``'s all-reduce.
            Shards are then identical along ``outer_axis``.
        expert: which params are expert (MoE) weights: a pytree of bools (params' structure or
            a prefix) or a predicate on leaf paths (``lambda path: "/experts/" in path``). They
            get their own layout and their own drained chain, independent of the dense one
            (Megatron links dense and expert bucket groups separately).
        expert_axis: the axis (or axes) expert gradients are reduce-scattered over, a subset of
            ``axis`` (Megatron's expert-data-parallel group). Every axis of ``axis`` not in it
            must shard the expert params (expert parallel, in ``param_specs``). ``average``
            divides expert sums by the *dense* data-parallel size too: with expert parallel
            token dispatch, an expert's local gradient already sums the tokens of all its
            expert-parallel ranks, so this gives the same mean as for dense params.

    Outputs of :meth:`reduce_scatter` / :meth:`value_and_grad`: without expert params a tuple
    of float32 shards (one per bucket, dispatch order); with them a :class:`Shards`
    ``(dense, expert)`` of two such tuples. Leave ``shard_map`` with ``out_specs=
    sync.shard_spec`` (dense) / ``sync.expert_shard_spec``.
    """

    def __init__(
        self,
        params: PyTree,
        mesh: Mesh,
        axis: AxisSpec = "data",
        bucket_size: int | None = 40_000_000,
        reduce: str = "fp32_accum",
        drain: bool = True,
        average: bool = True,
        order: Sequence[int] | None = None,
        max_in_flight: int | None = None,
        *,
        param_specs: PyTree | None = None,
        outer_axis: AxisSpec = None,
        expert: ExpertSpec = None,
        expert_axis: AxisSpec = None,
    ):
        axes = as_axes(axis, "axis")
        if len(axes) == 1 and axes[0] not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {axes[0]!r}; its axes are {tuple(mesh.axis_names)}")
        self.mesh = mesh
        self.axis = axis if isinstance(axis, str) else axes  # a str stays a str (HLO unchanged)
        self.axes = axes
        self.outer_axes = as_axes(outer_axis, "outer_axis", allow_empty=True)
        self.outer_axis = outer_axis if isinstance(outer_axis, str) or outer_axis is None else self.outer_axes
        expert_axes = None if expert_axis is None else as_axes(expert_axis, "expert_axis", allow_empty=True)
        self.placements: tuple[LeafPlacement, ...] = tuple(
            place_leaves(params, mesh, axes, self.outer_axes, param_specs, expert, expert_axes)
        )
        self.axis_size = axes_size(mesh, axes)
        self.outer_size = axes_size(mesh, self.outer_axes)
        self.expert_axes: tuple[str, ...] = expert_axes or ()
        self.expert_axis = expert_axis
        self.reduce = check_mode(reduce)
        self.average = bool(average)
        self.drain = bool(drain)
        self.max_in_flight = drain_depth(drain, max_in_flight)

        self._treedef = jax.tree.structure(params)
        local = jax.tree.unflatten(
            self._treedef, [jax.ShapeDtypeStruct(pl.local_shape, pl.dtype) for pl in self.placements]
        )
        self.local_shapes: PyTree = local  #: ``jax.ShapeDtypeStruct`` tree of per-device blocks
        expert_idx = tuple(i for i, pl in enumerate(self.placements) if pl.expert)
        # With expert params: a one-bucket layout of the whole tree, to check grads trees (and
        # to validate ``order``) before they are split between the two chains.
        self._whole = None if not expert_idx else BucketLayout.build(local, None, 1, order)
        if not expert_idx:
            layout = BucketLayout.build(
                local, bucket_size, shard_multiple=math.lcm(self.axis_size, 128), order=order
            )
            self._dense = _Chain(SCOPE_PREFIX, layout, tuple(range(len(self.placements))), axes, self.axis_size)
            self._expert: _Chain | None = None
        else:
            dense_idx = tuple(i for i, pl in enumerate(self.placements) if not pl.expert)
            expert_size = axes_size(mesh, self.expert_axes)
            self._dense = self._sub_chain(SCOPE_PREFIX, dense_idx, axes, self.axis_size, bucket_size, order)
            self._expert = self._sub_chain(
                EXPERT_SCOPE, expert_idx, self.expert_axes, expert_size, bucket_size, order
            )

    def _sub_chain(
        self, scope: str, indices: tuple[int, ...], axes: tuple[str, ...], size: int,
        bucket_size: int | None, order: Sequence[int] | None,
    ) -> _Chain:
        """A chain over some leaves: a layout of the list of their local shapes, real paths kept."""
        local = jax.tree.leaves(self.local_shapes)
        position = {leaf: j for j, leaf in enumerate(indices)}
        full_order = tuple(reversed(range(len(local)))) if order is None else tuple(order)
        sub_order = [position[i] for i in full_order if i in position]
        layout = BucketLayout.build(
            [local[i] for i in indices], bucket_size, shard_multiple=math.lcm(size, 128), order=sub_order
        )
        # Slots keep their index into `indices` (the layout's own tree) but show the real path.
        slots = tuple(dataclasses.replace(s, path=self.placements[indices[s.index]].path) for s in layout.slots)
        return _Chain(scope, dataclasses.replace(layout, slots=slots), indices, axes, size)

    # -- layout ---------------------------------------------------------------------------
    @property
    def layout(self) -> BucketLayout:
        """The dense chain's layout. Without expert params it covers the whole params tree;
        with them it is a layout of the list of dense leaves (``dense_leaves``)."""
        return self._dense.layout

    @property
    def expert_layout(self) -> BucketLayout | None:
        """The expert chain's layout (of the list of ``expert_leaves``), or ``None``."""
        return None if self._expert is None else self._expert.layout

    @property
    def dense_leaves(self) -> tuple[int, ...]:
        """``jax.tree.leaves`` indices of the dense params, in ``layout``'s leaf order."""
        return self._dense.leaves

    @property
    def expert_leaves(self) -> tuple[int, ...]:
        """``jax.tree.leaves`` indices of the expert params, in ``expert_layout``'s leaf order."""
        return () if self._expert is None else self._expert.leaves

    @property
    def num_buckets(self) -> int:
        return self._dense.layout.num_buckets

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each (dense) bucket, dispatch order."""
        return self._dense.layout.bucket_sizes

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Elements of each (dense) bucket held by one device after the reduce-scatter."""
        return tuple(size // self.axis_size for size in self.bucket_sizes)

    @property
    def expert_axis_size(self) -> int:
        """Devices along ``expert_axis`` (1 without experts)."""
        return 1 if self._expert is None else self._expert.size

    @property
    def num_expert_buckets(self) -> int:
        return 0 if self._expert is None else self._expert.layout.num_buckets

    @property
    def expert_bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each expert bucket, dispatch order (``()`` without experts)."""
        return () if self._expert is None else self._expert.layout.bucket_sizes

    @property
    def expert_shard_sizes(self) -> tuple[int, ...]:
        """Elements of each expert bucket held by one device after the reduce-scatter."""
        return tuple(size // self.expert_axis_size for size in self.expert_bucket_sizes)

    @property
    def param_specs(self) -> PyTree:
        """The ``PartitionSpec`` of every param (``P()`` if replicated): ``shard_map`` in_specs."""
        return jax.tree.unflatten(self._treedef, [pl.spec for pl in self.placements])

    @property
    def batch_spec(self) -> PartitionSpec:
        """A batch split over all data-parallel devices: ``P((*outer_axes, *axes))``."""
        axes = self.outer_axes + self.axes
        return PartitionSpec(axes[0] if len(axes) == 1 else axes)

    @property
    def shard_spec(self) -> PartitionSpec:
        """``out_specs`` for the dense shards: split over ``axis``, after the non-data axes that
        shard params (tensor parallel ranks hold different buckets), mesh order, major first.

        Example: mesh ``("replica", "data", "model")`` with TP params -> ``P(("model", "data"))``:
        the global array of bucket ``k`` is model rank 0's whole bucket, then rank 1's.
        """
        return self._chain_spec(self._dense)

    @property
    def expert_shard_spec(self) -> PartitionSpec | None:
        """``out_specs`` for the expert shards (see :attr:`shard_spec`), or ``None``."""
        return None if self._expert is None else self._chain_spec(self._expert)

    def _chain_spec(self, chain: _Chain) -> PartitionSpec:
        sharded = [a for i in chain.leaves for a in self.placements[i].spec_axes]
        axes = mesh_order(self.mesh, [a for a in sharded if a not in chain.axes]) + chain.axes
        return PartitionSpec(axes[0] if len(axes) == 1 else (axes or None))

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...] | Shards:
        """Packs a params/grads-shaped tree (local blocks) into padded 1-D buckets (see
        ``BucketLayout.flatten``); a :class:`Shards` of both chains' buckets with expert params."""
        if self._expert is None:
            return self._dense.layout.flatten(tree, dtype)
        leaves = self._whole.check_tree(tree, check_dtypes=dtype is None)
        return Shards(
            self._dense.layout.flatten([leaves[i] for i in self._dense.leaves], dtype),
            self._expert.layout.flatten([leaves[i] for i in self._expert.leaves], dtype),
        )

    def unflatten(self, buckets: Sequence[jax.Array] | Shards) -> PyTree:
        """Inverse of :meth:`flatten` (takes whole buckets; a ``(dense, expert)`` pair with experts)."""
        if self._expert is None:
            return self._dense.layout.unflatten(buckets)
        if len(buckets) != 2:
            raise ValueError("this sync has expert params: pass Shards(dense_buckets, expert_buckets)")
        dense, expert = buckets
        leaves: list[Any] = [None] * len(self.placements)
        for chain, part in ((self._dense, dense), (self._expert, expert)):
            for i, leaf in zip(chain.leaves, chain.layout.unflatten(part)):
                leaves[i] = leaf
        return jax.tree.unflatten(self._treedef, leaves)

    def table(self) -> str:
        """The bucket layout as a readable table (both chains with expert params)."""
        if self._expert is None:
            return self._dense.layout.table()
        return (f"dense chain ({SCOPE_PREFIX}/bucket*):\n{self._dense.layout.table()}\n\n"
                f"expert chain ({EXPERT_SCOPE}/bucket*):\n{self._expert.layout.table()}")

    def __repr__(self) -> str:
        extra = ""
        if self.outer_axes:
            extra += f", outer_axis={self.outer_axis!r}"
        if self._expert is not None:
            extra += f", expert_axis={self.expert_axis!r}, num_expert_buckets={self.num_expert_buckets}"
        return (
            f"GradSync(axis={self.axis!r}, axis_size={self.axis_size}, reduce={self.reduce!r}, "
            f"drain={self.drain}, max_in_flight={self.max_in_flight}, num_buckets={self.num_buckets}{extra})"
        )

    # -- inside shard_map -----------------------------------------------------------------
    def reduce_scatter(self, grads: PyTree) -> tuple[jax.Array, ...] | Shards:
        """Reduce-scatters per-device ``grads`` bucket by bucket; call inside ``jax.shard_map``.

        ``grads`` has the params' structure with local (per-device block) shapes. Returns one
        1-D float32 array per bucket (dispatch order): this device's ``bucket_sizes[i] //
        axis_size`` elements of the summed (or averaged) bucket, all-reduced over
        ``outer_axis`` if given. With expert params: :class:`Shards` ``(dense, expert)``.
        """
        self._check_inside_shard_map("reduce_scatter")
        whole = self._dense.layout if self._expert is None else self._whole
        leaves = whole.check_tree(grads, what="grads")
        self._check_varying(leaves)
        if self._expert is None:
            return self._run_chain(self._dense, self._dense.layout.flatten(grads))
        buckets = self.flatten(grads)
        return Shards(self._run_chain(self._dense, buckets.dense), self._run_chain(self._expert, buckets.expert))

    def _run_chain(self, chain: _Chain, buckets: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """Reduces ``chain``'s buckets in dispatch order, drained to ``max_in_flight``."""

        def reduce_one(k: int, bucket: jax.Array) -> jax.Array:
            with jax.named_scope(f"{chain.scope}/bucket{k}"):
                return self._reduce_bucket(bucket, chain)

        return sequenced_map(reduce_one, buckets, self.max_in_flight)

    def _reduce_bucket(self, bucket: jax.Array, chain: _Chain) -> jax.Array:
        dp_size = self.axis_size * self.outer_size  # the mean is over every data-parallel device
        if not self.outer_axes and chain.size == dp_size and chain.axes == self.axes:
            # The plain data-parallel case, exactly as before: one collective per bucket.
            return reduce_scatter_bucket(bucket, self.axis, mode=self.reduce, average=self.average)
        if chain.axes:
            axis = chain.axes[0] if len(chain.axes) == 1 else chain.axes
            shard = reduce_scatter_bucket(bucket, axis, mode=self.reduce, average=False)
        else:  # experts sharded along every data axis: nothing to reduce-scatter
            shard = bucket.astype(jnp.float32)
        if self.outer_axes:
            outer = self.outer_axes[0] if len(self.outer_axes) == 1 else self.outer_axes
            # bf16 mode: the outer sum on the wire in the gradient dtype too (Megatron's baseline).
            wire = bucket.dtype if self.reduce == "bf16" else jnp.float32
            shard = all_reduce_shard(shard, outer, wire_dtype=wire)
        return shard / dp_size if self.average and dp_size > 1 else shard

    def local_params(self, params: PyTree) -> PyTree:
        """Per-device views of ``params`` (local blocks) for ``jax.grad`` inside ``shard_map``:
        each leaf marked varying along the data axes its gradient is reduced over (no
        communication), so differentiating gives local gradients instead of all-reduced ones.
        Tensor-parallel axes are left alone: jax's own transpose sums what must be summed there.
        """
        leaves = self._treedef.flatten_up_to(params)
        marked = [
            _compat.mark_varying(p, pl.reduce_axes + self.outer_axes) for p, pl in zip(leaves, self.placements)
        ]
        return jax.tree.unflatten(self._treedef, marked)

    def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
        """Like ``jax.value_and_grad``, returning reduce-scattered gradient shards.

        Call the result inside ``jax.shard_map`` with ``params`` first (replicated, or local
        blocks per ``param_specs``). Gradients are taken w.r.t. :meth:`local_params`, so no
        hidden all-reduce is inserted. Returns ``(loss, shards)`` (``((loss, aux), shards)``
        with ``has_aux``), where ``loss`` is the mean (``average=True``) or sum of the
        per-device losses over the data-parallel axes (``outer_axis`` and ``axis``).
        """
        loss_axes: Any = self.axis if not self.outer_axes else self.outer_axes + self.axes

        def wrapped(params: PyTree, *args: Any, **kwargs: Any):
            self._check_inside_shard_map("value_and_grad")
            out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(
                self.local_params(params), *args, **kwargs
            )
            loss, aux = out if has_aux else (out, None)
            loss = jax.lax.pmean(loss, loss_axes) if self.average else jax.lax.psum(loss, loss_axes)
            shards = self.reduce_scatter(grads)
            return ((loss, aux) if has_aux else loss), shards

        return wrapped

    def _check_varying(self, leaves: list) -> None:
        if not _compat.vma_checked():
            return
        missing: dict[str, list[str]] = {}
        for pl, g in zip(self.placements, leaves):
            varying = _compat.varying_axes(g) or ()
            for a in pl.reduce_axes + self.outer_axes:
                if a not in varying:
                    missing.setdefault(a, []).append(pl.path)
        if missing:
            axis, paths = next(iter(missing.items()))
            raise ValueError(
                f"grads {paths[:4]}{'...' if len(paths) > 4 else ''} do not vary along {axis!r}: "
                "they were already all-reduced (jax.grad w.r.t. replicated params inside shard_map "
                "inserts a psum), or the batch is not split along it. Use "
                "sync.value_and_grad(loss_fn), or differentiate w.r.t. sync.local_params(params), "
                f"with the batch split over {self.batch_spec}."
            )

    def _check_inside_shard_map(self, method: str) -> None:
        spec_axes = tuple(a for pl in self.placements for a in pl.spec_axes)
        needed = mesh_order(self.mesh, self.axes + self.outer_axes + self.expert_axes + spec_axes)
        # The data axes first: outside shard_map, the error names them rather than every axis.
        require_bound_axes(f"GradSync.{method}", self.mesh, self.axes)
        require_bound_axes(f"GradSync.{method}", self.mesh, needed)

def local_params(params: PyTree, axis: AxisSpec) -> PyTree:
    """A per-device view of replicated ``params`` inside ``shard_map`` (no communication).

    ``jax.grad`` with respect to these gives each device's local gradient instead of the
    all-reduced one that differentiating the replicated ``params`` directly would give.
    ``axis`` may be a tuple of axes (e.g. ``("replica", "data")``). With tensor-parallel or
    expert params prefer :meth:`GradSync.local_params`, which knows each leaf's axes.
    """
    axes = as_axes(axis, "axis")
    return jax.tree.map(lambda p: _compat.mark_varying(p, axes), params)

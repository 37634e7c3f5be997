"""Bucket chains: the one concept the sync, the optimizer, the train step, checkpoints and planner share.

A :class:`BucketChain` is a :class:`~jax_drain.BucketLayout` of some parameter leaves, the mesh
axes its buckets are reduce-scattered over (the shards are split over them), the outer axes each
shard is then all-reduced over, and the ``jax.named_scope`` its collectives run under. Dense,
expert and scanned-layer buckets are all chains; they differ only in which leaves they hold,
which axes they reduce over and, for a scanned layer stack, that a shard has one row per layer.

:class:`ChainedSync` is the protocol a gradient sync offers on top of its chains, written once
here: shard specs, the float32 master shards of a distributed optimizer and their gather,
``unflatten``, the layout fingerprint, the per-device parameter view and the varying check.
:class:`~jax_drain.GradSync` and :class:`~jax_drain.ScanGradSync` implement only how gradients
reach the chains (after backward, or inside the backward scan).

Example::

    sync = jd.GradSync(params, mesh, axis="data", bucket_size=10_000_000)
    for chain in sync.chains:                       # dispatch order
        print(chain.name, chain.scope, chain.axes, chain.layout.num_buckets)
    master = sync.init_master(params)               # inside shard_map: one float32 shard per bucket
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from jax_drain import _compat
from jax_drain.collectives import (
    QUANTIZED_MODES, all_gather_bucket, all_reduce_shard, mean_predivisor, pmean, reduce_scatter_bucket,
    wire_values,
)
from jax_drain.drain import sequenced_map
from jax_drain.layout import BucketLayout, Piece, check_leaves
from jax_drain.losses import LocalStep
from jax_drain.mesh import LeafPlacement, mesh_order, require_bound_axes, split_specs

PyTree = Any

#: Prefix of every chain's named scopes; the planner finds the sync's collectives in compiled HLO
#: by it. Dense bucket ``k``: ``jax_drain/bucket{k}``.
SCOPE_PREFIX = "jax_drain"


@dataclasses.dataclass(frozen=True)
class BucketChain:
    """One drained chain of buckets: what they hold, where they are reduced, how shards lie.

    Attributes:
        name: ``"dense"``, ``"expert"`` or ``"layers"`` (a scanned stack's per-layer buckets).
        scope: bucket ``k``'s collectives run under ``f"{scope}/bucket{k}"``.
        layout: the buckets, laid out from per-device (local) leaf shapes; for a layer chain,
            one layer's slice of the stacked leaves.
        leaves: index in the full parameter tree's ``jax.tree.leaves`` of each layout leaf.
        axes: the mesh axes a bucket is reduce-scattered over, major first (the shards are split
            over them); empty when every data axis shards these parameters.
        outer_axes: axes each shard is all-reduced over afterwards (HSDP); shards are replicated
            along them.
        spec_axes: the other mesh axes that shard some of these leaves (tensor or expert
            parallel), mesh order: ranks along them hold different buckets.
        spec_size: devices along ``spec_axes``.
        replicas: per layout leaf, how many devices hold each element of a shard (the outer axes
            and the non-data axes the leaf is replicated along); global norms divide by it.
        num_layers: a layer chain's shards are ``[num_layers, size]``; ``None`` for 1-D shards.
        wire_dtype: the dtype buckets are cast to before the collective (e.g. bfloat16 for a
            float32 model: bf16 wire, float32 accumulation); ``None``: the gradients' own.
        bucket_axes: the mesh axes a device's whole (local) bucket differs along, mesh order:
            the data axes its gradient is summed over and ``spec_axes``. An error-feedback
            residual is one whole bucket per device, laid out over them.
        data_major: the global shard array is split over ``axes`` first, then ``spec_axes``
            (``tensor_parallel="gspmd"``: the data-parallel region's view of a shard is then one
            contiguous piece, every model rank's shard of it). ``False``: ``spec_axes`` first,
            each model rank's whole bucket in turn.
    """

    name: str
    scope: str
    layout: BucketLayout
    leaves: tuple[int, ...]
    axes: tuple[str, ...]
    outer_axes: tuple[str, ...]
    axis_size: int
    spec_axes: tuple[str, ...]
    replicas: tuple[int, ...]
    spec_size: int = 1
    num_layers: int | None = None
    wire_dtype: Any = None
    bucket_axes: tuple[str, ...] = ()
    data_major: bool = False

    # -- shapes and specs -------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.layout.num_buckets

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Elements (per row) of each bucket one device holds after the reduce-scatter."""
        return tuple(size // self.axis_size for size in self.layout.bucket_sizes)

    @property
    def loop_dispatch(self) -> tuple[int, ...]:
        """The order a layer chain sends one layer's buckets in, inside the backward scan: the
        fewest bytes first, ties in the layout's (gradient-ready) order.

        Every layer bucket must finish within its iteration and the drain sends them one at a
        time, so the buckets sent last wait for all the others. Sent last, the large weight
        matrices' gradients can be computed last, just before they go, instead of waiting
        finished while the chain works through the rest. Measured (``benchmarks/memory.py``,
        compile-only 8xH100, ``gpt-blocks-scan``): 170 MiB of temp at 33 and 66 buckets, ZeRO-1
        and ZeRO-3 alike, against 196 and 200 (ZeRO-3: 190 and 200) in layout order, which
        sends the MLP's first; 6-10% less on a tied-embedding and a 16-layer d=1024 variant."""
        sizes = [n * jnp.dtype(b.dtype).itemsize for n, b in zip(self.layout.bucket_sizes, self.layout.buckets)]
        return tuple(sorted(range(len(sizes)), key=lambda k: sizes[k]))

    def bucket_scope(self, k: int) -> str:
        return f"{self.scope}/bucket{k}"

    def shard_shape(self, k: int) -> tuple[int, ...]:
        """Shape of this device's shard of bucket ``k`` inside ``shard_map``."""
        size = self.shard_sizes[k]
        return (size,) if self.num_layers is None else (self.num_layers, size)

    def global_shard_shape(self, k: int) -> tuple[int, ...]:
        """Shape of bucket ``k``'s shards as one global array outside ``shard_map``: every
        rank's shard along ``spec_axes`` and ``axes``, split by :attr:`shard_spec`."""
        *rows, size = self.shard_shape(k)
        return (*rows, size * self.axis_size * self.spec_size)

    @property
    def shard_spec(self) -> PartitionSpec:
        """``PartitionSpec`` of a shard outside ``shard_map``: split over the ranks that hold
        different buckets (``spec_axes``), then over ``axes``, major first (``axes`` first with
        :attr:`data_major`)."""
        axes = self.axes + self.spec_axes if self.data_major else self.spec_axes + self.axes
        entry = axes[0] if len(axes) == 1 else (axes or None)
        return PartitionSpec(entry) if self.num_layers is None else PartitionSpec(None, entry)

    def bucket_shape(self, k: int) -> tuple[int, ...]:
        """Shape of whole bucket ``k`` on one device (an error-feedback residual's shape)."""
        size = self.layout.bucket_sizes[k]
        return (size,) if self.num_layers is None else (self.num_layers, size)

    def global_bucket_shape(self, k: int, mesh: Mesh) -> tuple[int, ...]:
        """Shape of every device's whole bucket ``k`` as one global array, split by
        :attr:`bucket_spec`."""
        *rows, size = self.bucket_shape(k)
        return (*rows, size * math.prod(int(mesh.shape[a]) for a in self.bucket_axes))

    @property
    def bucket_spec(self) -> PartitionSpec:
        """``PartitionSpec`` of per-device whole buckets (error-feedback residuals) outside
        ``shard_map``: split over :attr:`bucket_axes` (the data axes first with :attr:`data_major`,
        as :attr:`shard_spec`: the data-parallel region sees one contiguous piece)."""
        axes = self.bucket_axes
        if self.data_major:
            axes = tuple(a for a in axes if a not in self.spec_axes) + self.spec_axes
        entry = axes[0] if len(axes) == 1 else (axes or None)
        return PartitionSpec(entry) if self.num_layers is None else PartitionSpec(None, entry)

    def lossy_wire(self, mode: str) -> bool:
        """Whether ``mode`` (with :attr:`wire_dtype`) rounds what a device sends: a quantized
        mode, or a wire narrower than float32. Only then has error feedback anything to feed back."""
        if mode in QUANTIZED_MODES:
            return True
        return any(jnp.finfo(self.wire_dtype or b.dtype).bits < 32 for b in self.layout.buckets)

    @property
    def reduce_axis(self) -> str | tuple[str, ...]:
        """``axes`` as collectives take it: one name stays a name."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def describe(self, placements: Sequence[LeafPlacement], mesh: Mesh) -> dict[str, Any]:
        """Everything that decides where a parameter element lands in a shard (JSON-able): per
        bucket its dtype, padded size and pieces ``[path, local shape, dtype, offset, spec,
        global shape, start, size]`` (``spec``: per dimension ``None`` or the mesh axes splitting
        it; ``start``/``size``: the run of the leaf's flat local elements)."""
        layout = self.layout

        def slot(piece: Piece) -> list:
            s, pl = layout.slots[piece.leaf], placements[self.leaves[piece.leaf]]
            spec = [None if e is None else ([e] if isinstance(e, str) else list(e)) for e in pl.spec]
            return [s.path, list(s.shape), str(s.dtype), piece.offset, spec, list(pl.global_shape),
                    piece.start, piece.size]

        out = {
            "name": self.name, "axes": list(self.axes), "axis_size": self.axis_size,
            "spec_axes": list(self.spec_axes), "spec_sizes": [int(mesh.shape[a]) for a in self.spec_axes],
            "num_layers": self.num_layers,
            "buckets": [[str(b.dtype), b.padded_size, [slot(p) for p in b.pieces]] for b in layout.buckets],
        }
        if self.data_major:  # only then: the manual layouts' fingerprints stay what they were
            out["data_major"] = True
        if layout.owners:  # likewise: whole-parameter ownership
            out["owners"] = layout.owners
        return out

    # -- buckets ----------------------------------------------------------------------------
    def flatten(self, leaves: Sequence[Any], dtype: Any = None) -> tuple[jax.Array, ...]:
        """Whole buckets from the full tree's ``leaves`` (local blocks): 1-D, or
        ``[num_layers, size]`` for a layer chain. ``dtype`` casts every bucket."""
        mine = [leaves[i] for i in self.leaves]
        if self.num_layers is None:
            return self.layout.flatten(mine, dtype)
        return tuple(jax.vmap(lambda layer: self.layout.flatten(layer, dtype))(mine))

    def unflatten(self, buckets: Sequence[jax.Array]) -> list[jax.Array]:
        """The chain's leaves (layout order) from whole buckets."""
        if self.num_layers is None:
            return jax.tree.leaves(self.layout.unflatten(tuple(buckets)))
        return jax.tree.leaves(jax.vmap(self.layout.unflatten)(tuple(buckets)))

    def check_buckets(self, buckets: Sequence[jax.Array], what: str) -> None:
        want = [
            (size,) if self.num_layers is None else (self.num_layers, size) for size in self.layout.bucket_sizes
        ]
        got = [tuple(b.shape) for b in buckets]
        if got != want:
            raise ValueError(
                f"{what}: the {self.name} chain expects whole buckets of shapes {want}, got {got}; pass "
                "the global shards (out_specs=sync.shard_specs()), not one device's"
            )

    # -- inside shard_map -------------------------------------------------------------------
    def positions(self, k: int) -> jax.Array:
        """Bucket positions of this device's shard elements of bucket ``k``: ``rank * s + [0, s)``."""
        size = self.shard_sizes[k]
        rank = jax.lax.axis_index(self.reduce_axis) if self.axes else 0
        return rank * size + jax.lax.iota(jnp.int32, size)

    def shard(self, bucket: jax.Array, k: int) -> jax.Array:
        """This device's slice of whole bucket ``k`` (along its last axis)."""
        if not self.axes:
            return bucket
        size = self.shard_sizes[k]
        rank = jax.lax.axis_index(self.reduce_axis)
        return jax.lax.dynamic_slice_in_dim(bucket, rank * size, size, axis=bucket.ndim - 1)

    def reduce_bucket(
        self, bucket: jax.Array, k: int, *, mode: str, divisor: int, residual: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Reduce-scatters whole bucket ``k`` over ``axes``, all-reduces over ``outer_axes``,
        divides by ``divisor``; returns this device's float32 shard. A mean divides each device's
        values by :func:`~jax_drain.collectives.mean_predivisor` of the devices summed as they
        enter the sums (exact), the rest in float32 after them: neither stage overflows where the
        mean does not.
        Quantized modes start a scale block at every piece (leaf) of the bucket, so a small leaf
        never shares a scale with a large one.

        Error feedback: with ``residual`` (this device's rounding error of the previous step,
        whole-bucket shaped) the device sends ``bucket + residual`` and returns ``(shard,
        new_residual)``, the new residual being what the wire rounded off this time (in
        ``residual``'s dtype), so the compression error does not accumulate over steps."""
        # One model rank's bucket even where its leaves are all replicated along the model axes.
        bucket = _compat.mark_varying(bucket, self.spec_axes)
        if residual is not None:
            compensated = bucket.astype(jnp.float32) + residual.astype(jnp.float32)
            bucket = compensated.astype(self.wire_dtype or bucket.dtype)
        elif self.wire_dtype is not None:
            bucket = bucket.astype(self.wire_dtype)
        extra = {}
        if mode in QUANTIZED_MODES:
            extra["block_starts"] = tuple(p.offset for p in self.layout.buckets[k].pieces)
        outer = self.outer_axes[0] if len(self.outer_axes) == 1 else self.outer_axes
        summed = (self.axis_size if self.axes else 1) * (_compat.axis_size(outer) if self.outer_axes else 1)
        predivide = mean_predivisor(summed) if divisor > 1 else 1
        if self.axes:
            shard = reduce_scatter_bucket(bucket, self.reduce_axis, mode=mode, average=False, predivide=predivide,
                                          **extra)
        else:  # every data axis shards these params: nothing to reduce-scatter
            shard = bucket.astype(jnp.float32)
            shard = shard / predivide if predivide > 1 else shard
        if self.outer_axes:
            # bf16 mode keeps the gradient dtype on the outer wire too (Megatron's baseline).
            shard = all_reduce_shard(shard, outer, wire_dtype=bucket.dtype if mode == "bf16" else jnp.float32)
        # divisor / predivide is dyadic: one rounding, the same as dividing the undivided sum.
        shard = shard / (divisor / predivide) if divisor != predivide else shard
        if residual is None:
            return shard
        sent = wire_values(bucket, self.axis_size if self.axes else 1, mode=mode, **extra)
        return shard, (compensated - sent).astype(residual.dtype)

    def reduce_scatter(
        self, buckets: Sequence[jax.Array], *, mode: str, divisor: int, max_in_flight: int | None,
        bucket_ids: Callable[[int], int] | None = None, residuals: Sequence[jax.Array] | None = None,
        dispatch: Sequence[int] | None = None,
    ) -> Any:
        """Reduces ``buckets`` in order, at most ``max_in_flight`` unfinished (the drain).

        ``bucket_ids(i)`` names input ``i``'s bucket (default ``i``), for chains that send one
        bucket several times (each layer's bucket ``k`` after backward). ``dispatch``: the input
        positions in the order they are sent (default: as given); the shards come back in input
        order either way. With ``residuals`` (one per input, see :meth:`reduce_bucket`) returns
        ``(shards, new_residuals)``.
        """
        ids = bucket_ids or (lambda i: i)

        def reduce_one(i: int, item: tuple) -> Any:
            bucket, residual = item
            with jax.named_scope(self.bucket_scope(ids(i))):
                return self.reduce_bucket(bucket, ids(i), mode=mode, divisor=divisor, residual=residual)

        return _with_residuals(reduce_one, list(buckets), residuals, max_in_flight, dispatch)

    def reduce_scatter_leaves(
        self, leaves: Sequence[jax.Array], *, mode: str, divisor: int, max_in_flight: int | None,
        residuals: Sequence[jax.Array] | None = None, dispatch: Sequence[int] | None = None,
    ) -> Any:
        """Reduces the buckets of the chain's ``leaves`` (its layout's leaves, in order) in
        bucket order (or ``dispatch``'s, as :meth:`reduce_scatter`), at most ``max_in_flight``
        unfinished. The fence holds each bucket's source leaves and the bucket is assembled
        after it, so a leaf split over several buckets is sliced just in time rather than copied
        into every bucket up front. With ``residuals`` (one per bucket) returns ``(shards,
        new_residuals)``."""
        leaves = list(leaves)
        sources = [tuple(leaves[j] for j in bucket.leaves) for bucket in self.layout.buckets]

        def reduce_one(k: int, item: tuple) -> Any:
            mine, residual = item
            by_leaf = dict(zip(self.layout.buckets[k].leaves, mine))
            bucket = self.layout.bucket(k, [by_leaf.get(j) for j in range(len(leaves))])
            with jax.named_scope(self.bucket_scope(k)):
                return self.reduce_bucket(bucket, k, mode=mode, divisor=divisor, residual=residual)

        return _with_residuals(reduce_one, sources, residuals, max_in_flight, dispatch)

    def as_leaf(self, value: jax.Array, placement: Any) -> jax.Array:
        """``value``, a gathered piece of ``placement``'s leaf, invariant along the model axes
        the leaf is replicated along (the chain's spec axes, and any other its type varies
        along): equal on every rank there, a ``pmax`` (exact) lets it leave a region manual over
        them as that leaf."""
        replicated = [a for a in self.spec_axes if a not in placement.spec_axes]
        # A gather fenced after another chain's bucket is typed varying along that chain's axes
        # too (the barrier joins the types); it is just as equal along them.
        replicated += [a for a in sorted(_compat.varying_axes(value)) if a not in placement.spec_axes
                       and a not in replicated and a not in self.axes + self.outer_axes]
        return jax.lax.pmax(value, tuple(replicated)) if replicated else value

    def gather(self, k: int, shard: jax.Array) -> jax.Array:
        """Whole bucket ``k`` in its parameters' dtype from every device's float32 shard."""
        dtype = self.layout.buckets[k].dtype
        if not self.axes:
            return shard.astype(dtype)
        if self.num_layers is None:
            return all_gather_bucket(shard, self.reduce_axis, dtype=dtype)
        # One 1-D gather of every layer's slice: [L, s] -> [n * L * s] -> [n, L, s] -> [L, n * s].
        whole = all_gather_bucket(shard.reshape(-1), self.reduce_axis, dtype=dtype)
        n, size = self.axis_size, self.shard_sizes[k]
        return whole.reshape(n, self.num_layers, size).transpose(1, 0, 2).reshape(self.num_layers, n * size)


def build_chain(
    name: str,
    scope: str,
    mesh: Mesh,
    placements: Sequence[LeafPlacement],
    leaves: Sequence[int],
    axes: tuple[str, ...],
    outer_axes: tuple[str, ...],
    *,
    bucket_size: int | None,
    order: Sequence[int] | None,
    num_layers: int | None = None,
    split_leaves: bool = False,
    wire_dtype: Any = None,
    data_major: bool = False,
    owned: bool = False,
    groups: Sequence[Any] | None = None,
) -> BucketChain:
    """A chain over the full-tree ``leaves`` (their local shapes; without the layer axis for a
    layer chain), in the gradient-ready ``order`` of the full tree filtered to them; ``groups``:
    a label per full-tree leaf that no bucket crosses (:meth:`BucketLayout.build`)."""
    leaves = tuple(leaves)
    axis_size = math.prod(int(mesh.shape[a]) for a in axes)
    position = {leaf: j for j, leaf in enumerate(leaves)}
    full_order = tuple(reversed(range(len(placements)))) if order is None else tuple(order)
    sub_order = [position[i] for i in full_order if i in position]
    shapes = [placements[i].local_shape[(0 if num_layers is None else 1):] for i in leaves]
    layout = BucketLayout.build(
        [jax.ShapeDtypeStruct(s, placements[i].dtype) for s, i in zip(shapes, leaves)],
        bucket_size, shard_multiple=math.lcm(axis_size, 128), order=sub_order, split_leaves=split_leaves,
        owners=axis_size if owned else None, groups=None if groups is None else [groups[i] for i in leaves],
    )
    # Slots keep their index into the chain's own list but show the parameter's real path.
    slots = tuple(dataclasses.replace(s, path=placements[leaves[s.index]].path) for s in layout.slots)
    layout = dataclasses.replace(layout, slots=slots)
    spec_axes = mesh_order(mesh, [a for i in leaves for a in placements[i].spec_axes if a not in axes])
    replicas = tuple(
        math.prod(int(mesh.shape[a]) for a in mesh.axis_names
                  if a not in axes and a not in placements[i].spec_axes)
        for i in leaves
    )
    spec_size = math.prod(int(mesh.shape[a]) for a in spec_axes)
    bucket_axes = mesh_order(mesh, tuple(outer_axes) + axes + spec_axes)
    wire = None if wire_dtype is None else jnp.dtype(wire_dtype)
    if wire is not None and not jnp.issubdtype(wire, jnp.floating):
        raise ValueError(f"wire_dtype must be a floating dtype (e.g. jnp.bfloat16) or None, got {wire}")
    return BucketChain(name, scope, layout, leaves, axes, tuple(outer_axes), axis_size, spec_axes, replicas,
                       spec_size, num_layers, wire, bucket_axes, data_major and bool(spec_axes))


def _with_residuals(reduce_one: Callable, items: list, residuals: Sequence[Any] | None,
                    max_in_flight: int | None, dispatch: Sequence[int] | None = None) -> Any:
    """``sequenced_map`` of ``reduce_one(i, (item, residual))`` over the inputs in ``dispatch``
    order (default: as given), returned in input order: the shards, or ``(shards, residuals)``
    when ``residuals`` are given (each residual travels with its bucket through the fence)."""
    if residuals is not None:
        residuals = list(residuals)
        if len(residuals) != len(items):
            raise ValueError(f"expected {len(items)} error-feedback residuals, one per bucket, got {len(residuals)}")
    order = list(range(len(items))) if dispatch is None else list(dispatch)
    if sorted(order) != list(range(len(items))):
        raise ValueError(f"dispatch must be a permutation of range({len(items)}), got {order}")
    pairs = [(items[i], None if residuals is None else residuals[i]) for i in order]
    sent = sequenced_map(lambda n, pair: reduce_one(order[n], pair), pairs, max_in_flight)
    out: list[Any] = [None] * len(items)
    for i, result in zip(order, sent):
        out[i] = result
    if residuals is None:
        return tuple(out)
    return tuple(shard for shard, _ in out), tuple(residual for _, residual in out)


class ChainedSync:
    """The protocol of a gradient sync over bucket chains, written once.

    Subclasses set ``mesh``, ``placements`` (one :class:`~jax_drain.mesh.LeafPlacement` per
    parameter leaf), ``chains`` (dispatch order), ``axes``/``outer_axes`` (the data axes),
    ``reduce``, ``average``, ``max_in_flight`` and ``_treedef``, and implement
    ``reduce_scatter``/``value_and_grad`` and the conversion between their output type and one
    flat tuple of shards (:meth:`flat_shards`, :meth:`pack_shards`).

    The flat order, used by the optimizer's master shards: every chain in ``chains`` order, and
    within a chain its buckets in dispatch order.
    """

    mesh: Mesh
    placements: tuple[LeafPlacement, ...]
    chains: tuple[BucketChain, ...]
    axes: tuple[str, ...]
    outer_axes: tuple[str, ...]
    reduce: str
    average: bool
    max_in_flight: int | None
    _treedef: Any
    #: ``"manual"`` (every mesh axis manual in the step's ``shard_map``; the loss runs on local
    #: blocks) or ``"gspmd"`` (only the data axes manual; the loss runs on global shapes along the
    #: others, and the chains in a nested region manual over them): see :mod:`jax_drain.mesh`.
    tensor_parallel: str = "manual"

    # -- output type <-> flat tuple (per sync kind) -------------------------------------------
    def flat_shards(self, shards: Any) -> tuple[jax.Array, ...]:  # pragma: no cover - abstract
        """The sync's output (as ``reduce_scatter`` returns it) as one flat tuple of shards."""
        raise NotImplementedError

    def pack_shards(self, flat: Sequence[Any]) -> Any:  # pragma: no cover - abstract
        """Inverse of :meth:`flat_shards`: one entry per bucket -> the sync's output type."""
        raise NotImplementedError

    def sharded_grad(self, loss_fn: Callable, has_aux: bool, has_state: bool, shards: Sequence[jax.Array],
                     state: Any, args: tuple, kwargs: dict, *, gather_max_in_flight: int,
                     reshard_after_forward: bool,
                     residuals: Sequence[jax.Array] | None = None) -> tuple[Any, list, Any]:  # pragma: no cover
        """ZeRO-3, per sync kind: one micro-batch's ``(LocalStep, flat float32 gradient shards,
        new residuals)`` from this device's parameter shards ``shards`` (flat order), gathering
        the parameters as the loss needs them (:mod:`jax_drain.zero3`). ``residuals``: error
        feedback's, flat (one whole local bucket per bucket); ``None`` without (and then
        ``None`` is returned for them)."""
        raise NotImplementedError

    # -- layout -----------------------------------------------------------------------------
    @property
    def treedef(self) -> Any:
        """The parameter tree's structure."""
        return self._treedef

    @property
    def abstract_params(self) -> PyTree:
        """The parameters as global-shape ``jax.ShapeDtypeStruct``s."""
        return jax.tree.unflatten(
            self._treedef, [jax.ShapeDtypeStruct(pl.global_shape, pl.dtype) for pl in self.placements]
        )

    @property
    def local_shapes(self) -> PyTree:
        """``jax.ShapeDtypeStruct`` tree of the per-device parameter blocks inside ``shard_map``."""
        return jax.tree.unflatten(
            self._treedef, [jax.ShapeDtypeStruct(pl.local_shape, pl.dtype) for pl in self.placements]
        )

    @property
    def param_specs(self) -> PyTree:
        """The ``PartitionSpec`` of every param (``P()`` if replicated): ``shard_map`` in_specs."""
        return jax.tree.unflatten(self._treedef, [pl.spec for pl in self.placements])

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Every data-parallel axis, mesh order: the batch is split and the loss averaged over them."""
        return mesh_order(self.mesh, self.outer_axes + self.axes)

    @property
    def data_size(self) -> int:
        """Data-parallel devices: the mean gradient divides the sum by this."""
        return math.prod(int(self.mesh.shape[a]) for a in self.data_axes)

    @property
    def batch_spec(self) -> PartitionSpec:
        """A batch split over all data-parallel devices: ``P((*outer_axes, *axes))``."""
        axes = self.outer_axes + self.axes
        return PartitionSpec(axes[0] if len(axes) == 1 else axes)

    # -- the step's regions ----------------------------------------------------------------
    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes the step's ``shard_map`` makes manual (mesh order): every axis with
        ``tensor_parallel="manual"``, the data axes with ``"gspmd"``."""
        if self.tensor_parallel == "gspmd":
            return self.data_axes
        return tuple(self.mesh.axis_names)

    @property
    def auto_axes(self) -> tuple[str, ...]:
        """The mesh axes left to XLA in the step's ``shard_map`` (``"gspmd"``): the loss runs on
        global shapes along them. Empty with ``tensor_parallel="manual"``."""
        manual = set(self.manual_axes)
        return tuple(a for a in self.mesh.axis_names if a not in manual)

    def region_axes(self, axes: Sequence[str]) -> tuple[str, ...]:
        """Those of ``axes`` that the step's ``shard_map`` makes manual: what a value there can be
        typed as varying along (with ``"manual"`` a model-sharded block varies along its model
        axes too; with ``"gspmd"`` they are XLA's)."""
        manual = set(self.manual_axes)
        return tuple(a for a in axes if a in manual)

    def shard_map(self, f: Callable, *, in_specs: Any, out_specs: Any) -> Callable:
        """``jax.shard_map`` of ``f`` over the sync's mesh, for the step that calls the sync's
        ``value_and_grad``: manual over :attr:`manual_axes`. The specs are the global arrays'
        own (``sync.param_specs``, ``sync.shard_specs()``, ``opt.state_specs()``...); with
        ``"gspmd"`` they are cut to the data axes (:func:`jax_drain.mesh.split_spec`) and ``f``
        sees every array whole along the other axes (sharded there by XLA).

        Example::

            step = jax.jit(sync.shard_map(grad_step, in_specs=(sync.param_specs, sync.batch_spec),
                                          out_specs=(P(), sync.shard_specs())))
        """
        if not self.auto_axes:
            return _compat.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
        outer_in, _ = split_specs(in_specs, self.manual_axes)
        outer_out, _ = split_specs(out_specs, self.manual_axes)
        return _compat.shard_map(f, mesh=self.mesh, in_specs=outer_in, out_specs=outer_out,
                                 axis_names=frozenset(self.manual_axes))

    def reduce_scatter_in_data_region(self, grads: Any, residuals: Any = None) -> Any:
        """``reduce_scatter`` called in the ``"gspmd"`` step's data-parallel region, on
        gradients whole along the model axes: they, and the error-feedback residuals if given,
        enter :meth:`manual_region` as their local blocks."""
        if residuals is None:
            return self.manual_region(self.reduce_scatter, (self.param_specs,), self.shard_specs())(grads)
        specs = self.bucket_specs()
        fed = lambda g, r: self.reduce_scatter(g, residuals=r)  # noqa: E731
        return self.manual_region(fed, (self.param_specs, specs), (self.shard_specs(), specs))(grads, residuals)

    def manual_region(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``f`` in a nested ``shard_map`` that makes :attr:`auto_axes` manual too: from inside
        the ``"gspmd"`` step's data-parallel region, where arrays are whole along those axes, to
        their local blocks, where the chains run as they do with ``"manual"``. The specs are the
        global arrays' own (cut to the other axes here). Call inside :meth:`shard_map`'s ``f``."""
        _, inner_in = split_specs(in_specs, self.manual_axes)
        _, inner_out = split_specs(out_specs, self.manual_axes)
        return _compat.shard_map(f, in_specs=inner_in, out_specs=inner_out, axis_names=frozenset(self.auto_axes))

    def on_local_blocks(self, f: Callable, in_specs: Any, out_specs: Any) -> Callable:
        """``f``, which runs on local blocks, callable from where the caller is: through
        :meth:`manual_region` from the ``"gspmd"`` step's data-parallel region (the specs are the
        global arrays' own), ``f`` itself where every mesh axis is manual already."""
        return self.manual_region(f, in_specs, out_specs) if self.in_data_region() else f

    def region_shape(self, shape: Sequence[int], spec: PartitionSpec) -> tuple[int, ...]:
        """The per-device shape, inside the step's :meth:`shard_map`, of a global array of
        ``shape`` split by ``spec``: split along :attr:`manual_axes` only; whole along
        :attr:`auto_axes` (``"gspmd"``), where XLA shards it."""
        manual = set(self.manual_axes)
        entries = list(spec) + [None] * (len(shape) - len(spec))
        return tuple(
            d // math.prod(int(self.mesh.shape[a]) for a in ((e,) if isinstance(e, str) else (e or ())) if a in manual)
            for d, e in zip(shape, entries))

    def region_shard_shape(self, chain: BucketChain, k: int) -> tuple[int, ...]:
        """Shape of ``chain``'s shard of bucket ``k`` inside the step's :meth:`shard_map`: this
        device's shard, or with ``"gspmd"`` every model rank's shard of this data rank's."""
        return self.region_shape(chain.global_shard_shape(k), chain.shard_spec)

    def bucket_zeros(self, chain: BucketChain, k: int) -> jax.Array:
        """Zeros shaped and typed as this device's local gradient of ``chain``'s bucket ``k``
        inside the step's :meth:`shard_map` (every model rank's with ``"gspmd"``; one layer's
        for a layer chain): what ZeRO-3's gathers return their bucket's gradient as the
        cotangent of."""
        shape = self.region_shape(chain.global_bucket_shape(k, self.mesh), chain.bucket_spec)
        zeros = jnp.zeros(shape if chain.num_layers is None else shape[1:], chain.layout.buckets[k].dtype)
        return _compat.mark_varying(zeros, self.region_axes(chain.axes + chain.outer_axes + chain.spec_axes))

    def in_data_region(self) -> bool:
        """Whether this runs in the ``"gspmd"`` step's data-parallel region: the data axes bound
        (manual), the others not (automatic); then :meth:`manual_region` leads to local blocks."""
        if not self.auto_axes:
            return False
        bound = _compat.bound_axis_sizes()
        return all(a in bound for a in self.data_axes) and not any(a in bound for a in self.auto_axes)

    def per_chain(self, flat: Sequence[Any]) -> list[tuple[Any, ...]]:
        """A flat sequence (one entry per bucket, flat order) cut into one tuple per chain."""
        flat, out, start = tuple(flat), [], 0
        for chain in self.chains:
            out.append(flat[start:start + chain.num_buckets])
            start += chain.num_buckets
        return out

    @property
    def flat_chains(self) -> tuple[tuple[BucketChain, int], ...]:
        """``(chain, bucket)`` of every entry of the flat shard tuple."""
        return tuple((chain, k) for chain in self.chains for k in range(chain.num_buckets))

    def shard_specs(self) -> Any:
        """``PartitionSpec``s of the shards (the sync's output type), for ``shard_map`` out_specs."""
        return self.pack_shards([chain.shard_spec for chain, _ in self.flat_chains])

    def bucket_specs(self) -> Any:
        """``PartitionSpec``s of whole buckets (the sync's output type): each device's own bucket,
        as error-feedback residuals hold it."""
        return self.pack_shards([chain.bucket_spec for chain, _ in self.flat_chains])

    @functools.cached_property
    def description(self) -> list[dict[str, Any]]:
        """Every chain's :meth:`BucketChain.describe`, flat order: enough to move shards laid
        out by this sync to and from per-parameter arrays (``jax_drain._host_layout``)."""
        return [chain.describe(self.placements, self.mesh) for chain in self.chains]

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of :attr:`description`: leaf paths, shapes, specs, offsets, axis sizes.

        Equal fingerprints put every parameter element at the same place in the same shard, so
        optimizer states built for them are interchangeable.
        """
        return description_fingerprint(self.description)

    def check_tree(self, tree: PyTree, what: str = "tree", check_dtypes: bool = True, local: bool = False,
                   region: bool = False) -> list:
        """Returns ``tree``'s leaves after checking its structure, shapes (global, the
        per-device blocks with ``local=True``, or with ``region=True`` the blocks of the step's
        :meth:`shard_map`, whole along :attr:`auto_axes`) and dtypes against the params."""
        if local and region:
            raise ValueError("check_tree: give local=True or region=True, not both")

        def shape(pl: Any) -> tuple[int, ...]:
            if local:
                return pl.local_shape
            return self.region_shape(pl.global_shape, pl.spec) if region else pl.global_shape

        expected = [(pl.path, shape(pl), pl.dtype) for pl in self.placements]
        blocks = " (per-device blocks)" if local else " (blocks of the step's data-parallel region)" if region else ""
        return check_leaves(tree, self._treedef, expected, what, "the params this sync was built with" + blocks,
                            check_dtypes)

    def unflatten_buckets(self, flat: Sequence[jax.Array]) -> PyTree:
        """The params-shaped tree from whole buckets in flat order (see :meth:`flat_shards`)."""
        flat = tuple(flat)
        if len(flat) != len(self.flat_chains):
            raise ValueError(f"expected {len(self.flat_chains)} buckets, got {len(flat)}")
        for chain, part in zip(self.chains, self.per_chain(flat)):
            chain.check_buckets(part, "unflatten")
        return self._cut_leaves(flat)

    @functools.cached_property
    def _cut_leaves(self) -> Callable[[tuple[jax.Array, ...]], PyTree]:
        """Whole buckets -> the params-shaped tree, as one program. Cut eagerly, every slice of
        a sharded bucket is a program of its own with collectives; XLA:CPU deadlocks (and aborts
        after its rendezvous timeout) once more than 32 such programs wait per device behind a
        running one (BUILD.md, "The abort")."""

        def cut(flat: tuple[jax.Array, ...]) -> PyTree:
            flat = tuple(_whole(b) for b in flat)
            leaves: list[Any] = [None] * len(self.placements)
            for chain, part in zip(self.chains, self.per_chain(flat)):
                for i, leaf in zip(chain.leaves, chain.unflatten(part)):
                    leaves[i] = leaf
            return jax.tree.unflatten(self._treedef, leaves)

        return jax.jit(cut)

    def unflatten(self, buckets: Any) -> PyTree:
        """The params-shaped tree (local blocks) from whole buckets in the sync's output type,
        e.g. the mean gradient from a step's global shards."""
        return self.unflatten_buckets(self.flat_shards(buckets))

    # -- inside shard_map -------------------------------------------------------------------
    def local_params(self, params: PyTree) -> PyTree:
        """Per-device views of ``params`` (local blocks) for ``jax.grad`` inside ``shard_map``.

        Each leaf is marked varying along the data axes its gradient is reduced over (no
        communication), so differentiating gives local gradients instead of the all-reduced
        ones that ``jax.grad`` w.r.t. a replicated value gives. Tensor-parallel axes are left
        alone: jax's own transpose sums what must be summed there.
        """
        leaves = self._treedef.flatten_up_to(params)
        marked = [_compat.mark_varying(p, pl.reduce_axes + self.outer_axes) for p, pl in zip(leaves, self.placements)]
        return jax.tree.unflatten(self._treedef, marked)

    def check_varying(self, leaves: Sequence[Any], what: str = "grads", indices: Sequence[int] | None = None) -> None:
        """Refuses gradients that do not vary along the axes they are reduced over: they were
        already all-reduced, and reducing them again would multiply them by the axis size.

        ``leaves`` are the full tree's leaves, or those at ``indices`` of it.
        """
        if not _compat.vma_checked():
            raise ValueError(
                f"{type(self).__name__} cannot tell per-device gradients from already all-reduced "
                "ones inside shard_map(..., check_vma=False); use check_vma=True (the default)"
            )
        missing: dict[str, list[str]] = {}
        placements = self.placements if indices is None else [self.placements[i] for i in indices]
        for pl, g in zip(placements, leaves):
            varying = _compat.varying_axes(g)
            for a in pl.reduce_axes + self.outer_axes:
                if a not in varying:
                    missing.setdefault(a, []).append(pl.path)
        if missing:
            axis, paths = next(iter(missing.items()))
            raise ValueError(
                f"{what} {paths[:4]}{'...' if len(paths) > 4 else ''} do not vary along {axis!r}: "
                "they were already all-reduced (jax.grad w.r.t. replicated params inside shard_map "
                "inserts a psum), or the batch is not split along it. Use "
                "sync.value_and_grad(loss_fn), or differentiate w.r.t. sync.local_params(params), "
                f"with the batch split over {self.batch_spec}."
            )

    def require_inside_shard_map(self, method: str, *, data_region: bool = False) -> None:
        """Raises unless called inside ``shard_map`` over every axis the sync uses; with
        ``data_region`` (``"gspmd"``), inside the step's data-parallel region instead: the data
        axes manual, the others automatic (:meth:`shard_map`)."""
        owner = method if "." in method else f"{type(self).__name__}.{method}"
        hint = (" (with tensor_parallel='gspmd', build the step with sync.shard_map, which makes only the data "
                "axes manual)") if self.auto_axes else ""
        # The data axes first: outside shard_map, the error names them rather than every axis.
        require_bound_axes(owner, self.mesh, self.axes, hint)
        if data_region:
            require_bound_axes(owner, self.mesh, self.data_axes, hint)
            bound = [a for a in self.auto_axes if a in _compat.bound_axis_sizes()]
            if bound:
                raise ValueError(
                    f"{owner} runs the loss on global shapes along {bound} (tensor_parallel='gspmd'), but it is "
                    f"called where {bound} are manual: build the step with sync.shard_map, which leaves them to XLA")
            return
        spec_axes = tuple(a for pl in self.placements for a in pl.spec_axes)
        needed = mesh_order(self.mesh, self.axes + self.outer_axes + spec_axes)
        require_bound_axes(owner, self.mesh, needed, hint)

    def finish(self, total: jax.Array, count: jax.Array | None, shards: Any) -> tuple[jax.Array, Any]:
        """The reported loss and the final shards from this device's loss ``total`` (and, for a
        :class:`~jax_drain.WeightedLoss`, its ``count``) and the reduce-scattered shards.

        A weighted loss's shards hold the sum of the local gradient sums over ``data_size``:
        they are rescaled to the sum over the global count (with ``average``), and the loss is
        the global total over the global count.
        """
        axes = self.data_axes
        if count is None:
            return (pmean(total, axes) if self.average else jax.lax.psum(total, axes)), shards
        if not self.average:
            return jax.lax.psum(total, axes), shards
        global_count = jax.lax.psum(count, axes)
        scale = self.data_size / global_count
        # The mean total over the mean count: a finite per-count mean stays finite (pmean pre-divides).
        loss = pmean(total, axes) / (global_count / self.data_size).astype(total.dtype)
        return loss, self.pack_shards([s * scale for s in self.flat_shards(shards)])

    def init_master(self, params: PyTree) -> Any:
        """This device's float32 slices of ``params`` (local blocks), laid out like the gradient
        shards (the sync's output type): the master shards of a distributed optimizer, padding
        zero. Call inside ``shard_map``; leave it with ``out_specs=sync.shard_specs()``.

        Example (inside ``shard_map``; ZeRO-1 with any element-wise ``tx``)::

            master = sync.init_master(params)
            loss, grads = sync.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, master)
            params = sync.gather_params(optax.apply_updates(master, updates))
        """
        self.require_inside_shard_map("init_master")
        leaves = self.check_tree(params, "params", check_dtypes=False, local=True)
        out = []
        for chain in self.chains:
            buckets = chain.flatten(leaves, jnp.float32)
            out.extend(chain.shard(b, k) for k, b in enumerate(buckets))
        return self.pack_shards(out)

    def cast_shards(self, master: Any) -> Any:
        """Parameter shards in each bucket's dtype from float32 master shards (the sync's output
        type): what a ZeRO-3 step keeps instead of the gathered parameters."""
        return self.pack_shards([m.astype(chain.layout.buckets[k].dtype)
                                 for m, (chain, k) in zip(self.flat_shards(master), self.flat_chains)])

    def gather_params(self, master: Any, *, max_in_flight: int | None = 1) -> PyTree:
        """The parameter tree (local blocks, their own dtypes) from float32 master shards laid
        out like the gradient shards (the sync's output type).

        Each shard is cast to its bucket's dtype, then all-gathered over its chain's axes; the
        gathers run in forward order (the last dispatched bucket first: it holds the first
        layers), chained with depth ``max_in_flight``. A leaf replicated along a tensor-parallel
        axis is identical on every rank there; it is made invariant along it with a ``pmax``
        (exact for identical values). Call inside ``shard_map``.
        """
        self.require_inside_shard_map("gather_params")
        refs = self.flat_chains
        master = self.flat_shards(master)
        want = [chain.shard_shape(k) for chain, k in refs]
        if [tuple(m.shape) for m in master] != want:
            raise ValueError(f"master shards have shapes {[tuple(m.shape) for m in master]}, expected {want} per device")
        forward = list(reversed(range(len(refs))))

        def gather(j: int, shard: jax.Array) -> jax.Array:
            chain, k = refs[forward[j]]
            with jax.named_scope(f"{GATHER_SCOPE}{chain.scope.removeprefix(SCOPE_PREFIX)}/bucket{k}"):
                return chain.gather(k, shard)

        gathered = sequenced_map(gather, [master[i] for i in forward], max_in_flight)
        params = self.unflatten_buckets(tuple(reversed(gathered)))
        leaves = jax.tree.leaves(params)
        leaves = [chain.as_leaf(leaf, pl) for leaf, pl, (chain, _) in
                  zip(leaves, self.placements, leaf_chain(self.chains, len(leaves)))]
        return jax.tree.unflatten(self._treedef, leaves)


#: Prefix of the named scope of each bucket's parameter all-gather: ``jax_drain/gather/bucket{k}``
#: (``jax_drain/gather/expert/bucket{k}``, ``jax_drain/gather/layers/bucket{k}`` for the other
#: chains), distinct from the reduce-scatter's so schedule checks can tell them apart.
GATHER_SCOPE = f"{SCOPE_PREFIX}/gather"


def description_fingerprint(description: list[dict[str, Any]]) -> str:
    """The short hash that names a :attr:`ChainedSync.description`."""
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def check_flag(value: Any, name: str) -> bool:
    """``value`` if it is a bool (Python or numpy), else ``TypeError`` naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r:.60}")
    return bool(value)


def check_microbatches(k: Any) -> int:
    """Validates a micro-batch count: an int >= 1."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {k!r}")
    return int(k)


def split_microbatches(x: Any, k: int) -> jax.Array:
    """``[k * b, ...]`` -> ``[k, b, ...]``: the micro-batches of one argument."""
    shape = np.shape(x)
    if not shape or shape[0] % k:
        raise ValueError(
            f"microbatches={k} splits every argument after params along its leading axis; an "
            f"argument of shape {tuple(shape)} does not split into {k} equal parts"
        )
    return jnp.reshape(x, (k, shape[0] // k, *shape[1:]))


def accumulate_shards(sync: "ChainedSync", run: Callable, state: Any, carried: Any, args: Any, kwargs: Any,
                      k: int) -> tuple[Any, list, Any]:
    """``k`` micro-batches in a loop, each reduce-scattered on its own (a scanned stack in its
    own backward scan, ZeRO-3 with its own gathers): ``run(state, carried, args, kwargs) ->
    (LocalStep, flat float32 shards, carried)``. The shards, the local loss and count are summed
    in the loop carry; ``state`` and ``carried`` (error-feedback residuals) pass from one
    micro-batch to the next. Returns ``(LocalStep, flat shards, carried)``: sums for a weighted
    loss (``finish`` divides by the global count), else means over the micro-batches."""
    args, kwargs = jax.tree.map(lambda x: split_microbatches(x, k), (args, kwargs))
    # The carry has the loop outputs' type: the loss varies along every data axis, a shard along
    # its chain's axes (the outer all-reduce makes it equal along the outer axes).
    zeros = [_compat.mark_varying(jnp.zeros(sync.region_shard_shape(chain, b), jnp.float32),
                                  sync.region_axes(chain.axes + chain.spec_axes)) for chain, b in sync.flat_chains]
    scalar = lambda: _compat.mark_varying(jnp.zeros((), jnp.float32), sync.data_axes)
    weighted: list[bool] = []  # filled while the loop body is traced

    def one(carry, micro):
        total, count, acc, state, carried = carry
        step, shards, carried = run(state, carried, *micro)
        weighted.append(step.count is not None)
        # Every term enters pre-divided (exactly, by a power of two): no partial sum overflows. A weighted
        # loss's count is divided alike, so its total / count and the gradients it rescales are unchanged.
        scale = mean_predivisor(k)
        acc = [a + s / scale for a, s in zip(acc, shards)]
        count = count + (1.0 if step.count is None else step.count / scale)
        return (total + step.total / scale, count, acc, step.state, carried), step.aux

    (total, count, acc, state, carried), aux = jax.lax.scan(
        one, (scalar(), scalar(), zeros, state, carried), (args, kwargs))
    if weighted[0]:
        return LocalStep(total, count, aux, state), acc, carried
    rest = k / mean_predivisor(k)
    return LocalStep(total / rest, None, aux, state), [a / rest for a in acc], carried


def _whole(bucket: jax.Array) -> jax.Array:
    """``bucket`` replicated when it is sharded over Explicit mesh axes (``jax.make_mesh``'s
    default), where slicing a sharded array must name its result's sharding: cutting a whole
    bucket into leaves reads all of it anyway."""
    sharding = jax.typeof(bucket).sharding
    mesh = getattr(sharding, "mesh", None)
    explicit = mesh is not None and any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    if explicit and any(entry is not None for entry in sharding.spec):
        return jax.sharding.reshard(bucket, jax.sharding.NamedSharding(mesh, PartitionSpec()))
    return bucket


def check_state_replicated(old: Any, new: Any, axes: Sequence[str]) -> None:
    """Refuses a loss function's new state that differs across the data-parallel devices: it is
    kept once for all of them (e.g. BatchNorm statistics need ``axis_name`` set to the data axes)."""
    if new is None:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(new):
        varying = [a for a in axes if a in _compat.varying_axes(leaf)]
        if varying:
            raise ValueError(
                f"the model state {jax.tree_util.keystr(path)} differs across the data-parallel devices "
                f"(it varies along {varying}), but it is kept once for all of them. Batch statistics: "
                f"give the BatchNorm axis_name={tuple(axes) if len(axes) > 1 else axes[0]!r} so they "
                "are averaged over the whole batch"
            )


def leaf_chain(chains: Sequence[BucketChain], num_leaves: int) -> list[tuple[BucketChain, int]]:
    """For each parameter leaf: its chain and its index in that chain's layout."""
    out: list[Any] = [None] * num_leaves
    for chain in chains:
        for j, i in enumerate(chain.leaves):
            out[i] = (chain, j)
    return out

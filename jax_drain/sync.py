"""``GradSync``: bucketed, drained, fp32-accumulated gradient reduce-scatter over a mesh axis.

Put together from the layout (:mod:`jax_drain.layout`), the per-bucket collectives
(:mod:`jax_drain.collectives`) and the drain (:mod:`jax_drain.drain`).

Example::

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
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh

from jax_drain import _compat
from jax_drain.collectives import check_mode, reduce_scatter_bucket
from jax_drain.drain import check_max_in_flight, sequenced_map
from jax_drain.layout import BucketLayout

PyTree = Any

#: Prefix of the ``jax.named_scope`` around each bucket's collective; the planner finds the
#: sync's collectives in compiled HLO by this name.
SCOPE_PREFIX = "jax_drain"


class GradSync:
    """Reduce-scatters a gradient pytree in buckets over one data-parallel mesh axis.

    Args:
        params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``), replicated over
            ``mesh``; only shapes and dtypes are read.
        mesh: the device mesh the step runs on under ``jax.shard_map``.
        axis: the data-parallel mesh axis to reduce over.
        bucket_size: a bucket closes once it holds at least this many elements (Megatron's
            unit); ``None`` gives one bucket per dtype.
        reduce: ``"bf16"``, ``"fp32"`` or ``"fp32_accum"`` (see :mod:`jax_drain.collectives`).
        drain: chain the buckets so at most one collective (and its scratch) is in flight.
        average: divide the sum by the axis size (the mean gradient).
        order: leaf indices in gradient-ready order (:func:`jax_drain.grad_ready_order`);
            ``None`` is reverse ``jax.tree.leaves`` order.
        max_in_flight: the drain depth: bucket ``k + max_in_flight`` waits for bucket ``k``.
            ``None`` means 1 with ``drain=True`` and no chain with ``drain=False``.
    """

    def __init__(
        self,
        params: PyTree,
        mesh: Mesh,
        axis: str = "data",
        bucket_size: int | None = 40_000_000,
        reduce: str = "fp32_accum",
        drain: bool = True,
        average: bool = True,
        order: Sequence[int] | None = None,
        max_in_flight: int | None = None,
    ):
        if axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)}")
        self.mesh = mesh
        self.axis = axis
        self.axis_size = int(mesh.shape[axis])
        self.reduce = check_mode(reduce)
        self.average = bool(average)
        self.drain = bool(drain)
        max_in_flight = check_max_in_flight(max_in_flight)
        if max_in_flight is not None and not drain:
            raise ValueError("max_in_flight bounds the drain chain; it needs drain=True")
        self.max_in_flight = (1 if max_in_flight is None else max_in_flight) if drain else None
        self.layout = BucketLayout.build(
            params, bucket_size, shard_multiple=math.lcm(self.axis_size, 128), order=order
        )

    # -- layout ---------------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        return self.layout.num_buckets

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each bucket, dispatch order."""
        return self.layout.bucket_sizes

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Elements of each bucket held by one device after the reduce-scatter."""
        return tuple(size // self.axis_size for size in self.bucket_sizes)

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...]:
        """Packs a params/grads-shaped tree into padded 1-D buckets (see ``BucketLayout.flatten``)."""
        return self.layout.flatten(tree, dtype)

    def unflatten(self, buckets: Sequence[jax.Array]) -> PyTree:
        """Inverse of :meth:`flatten`."""
        return self.layout.unflatten(buckets)

    def table(self) -> str:
        """The bucket layout as a readable table."""
        return self.layout.table()

    def __repr__(self) -> str:
        return (
            f"GradSync(axis={self.axis!r}, axis_size={self.axis_size}, reduce={self.reduce!r}, "
            f"drain={self.drain}, max_in_flight={self.max_in_flight}, num_buckets={self.num_buckets})"
        )

    # -- inside shard_map -----------------------------------------------------------------
    def reduce_scatter(self, grads: PyTree) -> tuple[jax.Array, ...]:
        """Reduce-scatters per-device ``grads`` bucket by bucket; call inside ``jax.shard_map``.

        Returns one 1-D float32 array per bucket (dispatch order): this device's
        ``bucket_sizes[i] // axis_size`` elements of the summed (or averaged) bucket.
        """
        self._check_inside_shard_map("reduce_scatter")
        leaves = self.layout.check_tree(grads, what="grads")
        if _compat.vma_checked():
            invariant = [s.path for s, g in zip(self.layout.slots, leaves)
                         if self.axis not in (_compat.varying_axes(g) or ())]
            if invariant:
                raise ValueError(
                    f"grads {invariant[:4]}{'...' if len(invariant) > 4 else ''} do not vary along "
                    f"{self.axis!r}: they were already all-reduced (jax.grad w.r.t. replicated params "
                    "inside shard_map inserts a psum). Use sync.value_and_grad(loss_fn), or "
                    "differentiate w.r.t. jax_drain.local_params(params, axis)."
                )
        buckets = self.layout.flatten(grads)

        def reduce_one(k: int, bucket: jax.Array) -> jax.Array:
            with jax.named_scope(f"{SCOPE_PREFIX}/bucket{k}"):
                return reduce_scatter_bucket(bucket, self.axis, mode=self.reduce, average=self.average)

        return sequenced_map(reduce_one, buckets, self.max_in_flight)

    def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
        """Like ``jax.value_and_grad``, returning reduce-scattered gradient shards.

        Call the result inside ``jax.shard_map`` with the replicated ``params`` first. Gradients
        are taken w.r.t. a per-device (varying) view of ``params``, so no hidden all-reduce is
        inserted. Returns ``(loss, shards)`` (``((loss, aux), shards)`` with ``has_aux``), where
        ``loss`` is the mean (``average=True``) or sum of the per-device losses over ``axis``.
        """

        def wrapped(params: PyTree, *args: Any, **kwargs: Any):
            self._check_inside_shard_map("value_and_grad")
            out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(
                local_params(params, self.axis), *args, **kwargs
            )
            loss, aux = out if has_aux else (out, None)
            loss = jax.lax.pmean(loss, self.axis) if self.average else jax.lax.psum(loss, self.axis)
            shards = self.reduce_scatter(grads)
            return ((loss, aux) if has_aux else loss), shards

        return wrapped

    def _check_inside_shard_map(self, method: str) -> None:
        bound = _compat.bound_axis_sizes()
        if self.axis not in bound:
            raise ValueError(
                f"GradSync.{method} must be called inside jax.shard_map over a mesh with axis "
                f"{self.axis!r} (currently bound axes: {sorted(map(str, bound)) or 'none'})"
            )
        if bound[self.axis] != self.axis_size:
            raise ValueError(
                f"axis {self.axis!r} has size {bound[self.axis]} here but {self.axis_size} in the "
                "mesh GradSync was built with"
            )


def local_params(params: PyTree, axis: str) -> PyTree:
    """A per-device view of replicated ``params`` inside ``shard_map`` (no communication).

    ``jax.grad`` with respect to these gives each device's local gradient instead of the
    all-reduced one that differentiating the replicated ``params`` directly would give.
    """
    return jax.tree.map(lambda p: _compat.mark_varying(p, (axis,)), params)

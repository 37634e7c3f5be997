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

Example (tensor parallel by XLA: a loss written for global shapes, no collectives in it)::

    specs = {"w_in": P(None, "model"), "w_out": P("model", None), "norm": None}
    sync = jd.GradSync(params, mesh, axis="data", param_specs=specs, tensor_parallel="gspmd")

    @jax.jit
    @functools.partial(sync.shard_map, in_specs=(sync.param_specs, sync.batch_spec),
                       out_specs=(P(), sync.shard_specs()))
    def step(params, batch):            # params: whole (w_in: [d, h]), sharded over "model" by XLA
        return sync.value_and_grad(loss_fn)(params, batch)

Example (MoE on ``("data", "expert")``: experts sharded over ``expert``)::

    sync = jd.GradSync(params, mesh, axis=("data", "expert"), param_specs=specs,
                       expert=lambda path: "/experts/" in path, expert_axis="data")
    loss, shards = sync.value_and_grad(loss_fn)(params, batch)   # inside shard_map
    shards.dense, shards.expert   # two independent bucket chains
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jax_drain import _compat, zero3
from jax_drain.chain import (
    SCOPE_PREFIX, BucketChain, ChainedSync, build_chain, check_flag, check_microbatches, check_state_replicated,
    split_microbatches,
)
from jax_drain.collectives import check_float_dtype, check_mode, check_wire_dtype, mean_predivisor
from jax_drain.drain import drain_depth
from jax_drain.feedback import check_error_feedback
from jax_drain.layout import BucketLayout, check_order
from jax_drain.losses import LocalStep, check_loss_varies, local_value_and_grad, pack_value
from jax_drain.mesh import (
    AxisSpec, ExpertSpec, LeafPlacement, as_axes, auto_mesh, axes_size, check_mesh, check_ownership, check_tensor_parallel,
    place_leaves,
)

PyTree = Any

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


class GradSync(ChainedSync):
    """Reduce-scatters a gradient pytree in buckets over data-parallel mesh axes.

    Args:
        params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``) with *global* shapes;
            only shapes and dtypes are read.
        mesh: the device mesh the step runs on under ``jax.shard_map`` (over all its axes).
        axis: the data-parallel mesh axis (or tuple of axes) to reduce-scatter over. Shards
            are split over these axes, the first one major.
        bucket_size: a bucket closes once it holds at least this many elements (Megatron's
            unit); ``None`` gives one bucket per dtype (per chain).
        reduce: ``"bf16"``, ``"fp32"``, ``"fp32_accum"``, ``"fp32_accum_streamed"``, or a
            quantized wire with float32 sums: ``"int8_accum"``, ``"fp8_accum"``,
            ``"fp16_accum"``, ``"int8_accum_streamed"`` (per-block scales, blocks aligned to the bucket's leaves;
            see :mod:`jax_drain.collectives`).
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
        split_leaves: split leaves at bucket boundaries so every bucket holds exactly
            ``bucket_size`` elements (:meth:`BucketLayout.build <jax_drain.BucketLayout.build>`):
            one large leaf (a tied embedding) then costs one bucket of scratch, not the whole
            leaf. Default ``False``: Megatron's whole-leaf buckets.
        wire_dtype: the dtype a bucket travels in (the all-to-all of ``fp32_accum``, the
            reduce-scatter of ``bf16``); the sum is still float32 where the mode says so.
            ``None`` (default): the gradients' own dtype. ``jnp.bfloat16`` gives a float32 model
            bf16 wire cost with float32 accumulation, like FSDP2's ``reduce_dtype``.
        tensor_parallel: how the loss sees the axes of ``param_specs``. ``"manual"`` (default):
            the step's ``shard_map`` makes every mesh axis manual, the loss runs on local blocks
            and does its own ``psum`` over the model axis. ``"gspmd"``: the step's ``shard_map``
            (build it with :meth:`shard_map`) makes only the data axes (``axis``,
            ``outer_axis``) manual, so a loss written for global shapes (GSPMD style: MaxText,
            EasyLM, Flax's partitioned examples) runs unchanged and XLA inserts the
            tensor-parallel collectives; the buckets are still laid out over every device's
            local blocks and reduced in a nested ``shard_map`` manual over the other axes
            (:meth:`manual_region`), so no model-sharded gradient is gathered. The mesh's axes
            are used as ``Auto`` (:attr:`mesh`; GSPMD partitioning), the shards are laid out data
            axes first (:attr:`BucketChain.data_major <jax_drain.BucketChain>`). Expert params
            are split over their expert axes, which are data axes and so manual: an expert loss
            does its own collectives over them, and XLA partitions the rest over the model axes.
        ownership: which elements a device's shard holds. ``"element"`` (default): a contiguous
            ``1 / size(axis)`` of every bucket. ``"param"``: whole parameters (Megatron's
            layer-wise distributed optimizer): each bucket's leaves are spread over the devices
            along ``axis`` (:meth:`BucketLayout.build <jax_drain.BucketLayout.build>`'s
            ``owners``), so the same drained reduce-scatter delivers every parameter whole to
            one device, and an optimizer that needs whole tensors (Muon, Adafactor, LAMB) runs
            there; :class:`TrainConfig <jax_drain.TrainConfig>` picks it from the optimizer.
            Not with ``param_specs`` that shard a parameter, expert params or ``split_leaves``.
        bucket_groups: a label per leaf (``jax.tree.leaves`` order) that no bucket crosses: a
            bucket closes early where the label changes. :func:`jax_drain.remat_groups` labels
            each leaf with the remat block that reads it, so each block's buckets are complete
            when its backward ends (less gradient waiting in memory) and ZeRO-3 gathers each
            bucket in one block only. ``None`` (default): bucket sizes alone decide.

    Outputs of :meth:`reduce_scatter` / :meth:`value_and_grad`: without expert params a tuple
    of float32 shards (one per bucket, dispatch order); with them a :class:`Shards`
    ``(dense, expert)`` of two such tuples. Leave ``shard_map`` with ``out_specs=
    sync.shard_spec`` (dense) / ``sync.expert_shard_spec``.
    """

    def __init__(
        self,
        params: PyTree,
        mesh: Mesh,
        *,
        axis: AxisSpec = "data",
        bucket_size: int | None = 40_000_000,
        reduce: str = "fp32_accum",
        drain: bool = True,
        average: bool = True,
        order: Sequence[int] | None = None,
        max_in_flight: int | None = None,
        param_specs: PyTree | None = None,
        outer_axis: AxisSpec = None,
        expert: ExpertSpec = None,
        expert_axis: AxisSpec = None,
        split_leaves: bool = False,
        wire_dtype: Any = None,
        tensor_parallel: str = "manual",
        ownership: str = "element",
        bucket_groups: Sequence[Hashable] | None = None,
    ):
        check_mesh(mesh)
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)
        self.ownership = check_ownership(ownership)
        gspmd = self.tensor_parallel == "gspmd"
        if gspmd:
            mesh = auto_mesh(mesh)
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
        check_wire_dtype(self.reduce, wire_dtype)
        self.average = check_flag(average, "average")
        self.drain = check_flag(drain, "drain")
        self.max_in_flight = drain_depth(drain, max_in_flight)
        self._treedef = jax.tree.structure(params)
        order = None if order is None else check_order(order, len(self.placements))
        if bucket_groups is not None and len(bucket_groups) != len(self.placements):
            raise ValueError(f"bucket_groups must give one label per parameter leaf ({len(self.placements)}), "
                             f"got {len(bucket_groups)}: use jax_drain.remat_groups(loss_fn, params, batch)")

        dense = tuple(i for i, pl in enumerate(self.placements) if not pl.expert)
        expert_idx = tuple(i for i, pl in enumerate(self.placements) if pl.expert)
        self.split_leaves = check_flag(split_leaves, "split_leaves")
        owned = self.ownership == "param"
        if owned:
            split = [pl.path for pl in self.placements if pl.spec_axes or pl.expert]
            if split or self.split_leaves:
                raise ValueError(
                    "ownership='param' hands each parameter whole to one device along the data axes; "
                    + (f"{split[:4]} are split over other mesh axes (tensor or expert parallel), so no device "
                       "holds them whole: use ownership='element'" if split else
                       "split_leaves=True cuts parameters over buckets: use split_leaves=False"))
        chain = lambda name, scope, leaves, axes: build_chain(
            name, scope, mesh, self.placements, leaves, axes, self.outer_axes, bucket_size=bucket_size, order=order,
            split_leaves=self.split_leaves, wire_dtype=wire_dtype, data_major=gspmd, owned=owned,
            groups=bucket_groups)
        chains = [chain("dense", SCOPE_PREFIX, dense, axes)]
        if expert_idx:
            chains.append(chain("expert", EXPERT_SCOPE, expert_idx, self.expert_axes))
        #: The bucket chains, dispatch order: dense, then expert (if any).
        self.chains: tuple[BucketChain, ...] = tuple(chains)

    # -- the sync's output type -------------------------------------------------------------
    @property
    def _dense(self) -> BucketChain:
        return self.chains[0]

    @property
    def _expert(self) -> BucketChain | None:
        return self.chains[1] if len(self.chains) > 1 else None

    def flat_shards(self, shards: Sequence[jax.Array] | Shards) -> tuple[jax.Array, ...]:
        if not isinstance(shards, (tuple, list)):
            raise TypeError(f"expected the shards this sync returned (a tuple of arrays, out_specs=sync.shard_specs()), "
                            f"got {type(shards).__name__}")
        if self._expert is None:
            return tuple(shards)
        if not (isinstance(shards, tuple) and len(shards) == 2):
            raise ValueError("this sync has expert params: pass Shards(dense, expert)")
        dense, expert = shards
        return (*dense, *expert)

    def pack_shards(self, flat: Sequence[Any]) -> tuple[Any, ...] | Shards:
        parts = self.per_chain(flat)
        return parts[0] if len(parts) == 1 else Shards(*parts)

    # -- layout -----------------------------------------------------------------------------
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
        return self._dense.num_buckets

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each (dense) bucket, dispatch order."""
        return self._dense.layout.bucket_sizes

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Elements of each (dense) bucket held by one device after the reduce-scatter."""
        return self._dense.shard_sizes

    @property
    def expert_axis_size(self) -> int:
        """Devices along ``expert_axis`` (1 without experts)."""
        return 1 if self._expert is None else self._expert.axis_size

    @property
    def num_expert_buckets(self) -> int:
        return 0 if self._expert is None else self._expert.num_buckets

    @property
    def expert_bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each expert bucket, dispatch order (``()`` without experts)."""
        return () if self._expert is None else self._expert.layout.bucket_sizes

    @property
    def expert_shard_sizes(self) -> tuple[int, ...]:
        """Elements of each expert bucket held by one device after the reduce-scatter."""
        return () if self._expert is None else self._expert.shard_sizes

    @property
    def shard_spec(self) -> PartitionSpec:
        """``out_specs`` for the dense shards: split over ``axis``, after the non-data axes that
        shard params (tensor parallel ranks hold different buckets), mesh order, major first.

        Example: mesh ``("replica", "data", "model")`` with TP params -> ``P(("model", "data"))``:
        the global array of bucket ``k`` is model rank 0's whole bucket, then rank 1's.
        """
        return self._dense.shard_spec

    @property
    def expert_shard_spec(self) -> PartitionSpec | None:
        """``out_specs`` for the expert shards (see :attr:`shard_spec`), or ``None``."""
        return None if self._expert is None else self._expert.shard_spec

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...] | Shards:
        """Packs a params/grads-shaped tree (local blocks) into padded 1-D buckets (see
        ``BucketLayout.flatten``); a :class:`Shards` of both chains' buckets with expert params."""
        leaves = self.check_tree(tree, check_dtypes=dtype is None, local=True)
        return self.pack_shards([b for chain in self.chains for b in chain.flatten(leaves, dtype)])

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
        if self.tensor_parallel != "manual":
            extra += f", tensor_parallel={self.tensor_parallel!r}"
        if self.ownership != "element":
            extra += f", ownership={self.ownership!r}"
        return (
            f"GradSync(axis={self.axis!r}, axis_size={self.axis_size}, reduce={self.reduce!r}, "
            f"drain={self.drain}, max_in_flight={self.max_in_flight}, num_buckets={self.num_buckets}{extra})"
        )

    # -- inside shard_map -----------------------------------------------------------------
    def reduce_scatter(self, grads: PyTree, *, residuals: Any = None) -> Any:
        """Reduce-scatters per-device ``grads`` bucket by bucket; call inside ``jax.shard_map``.

        ``grads`` has the params' structure with local (per-device block) shapes. Returns one
        1-D float32 array per bucket (dispatch order): this device's ``bucket_sizes[i] //
        axis_size`` elements of the summed (or averaged) bucket, all-reduced over
        ``outer_axis`` if given. With expert params: :class:`Shards` ``(dense, expert)``.
        Each chain is drained on its own (Megatron links dense and expert buckets separately).

        ``residuals``: error feedback (:mod:`jax_drain.feedback`): this device's residual of every
        bucket (the sync's output type, whole local buckets); each bucket is sent with its
        residual added, and ``(shards, new_residuals)`` is returned.

        With ``tensor_parallel="gspmd"`` it may also be called in the step's data-parallel region
        (:meth:`shard_map`) on gradients whole along the model axes: they enter
        :meth:`manual_region` as their local blocks, and so do the residuals.
        """
        if self.in_data_region():
            self.check_tree(grads, what="grads", region=True)
            return self.reduce_scatter_in_data_region(grads, residuals)
        self.require_inside_shard_map("reduce_scatter")
        leaves = self.check_tree(grads, what="grads", local=True)
        self.check_varying(leaves)
        # The mean is over every data-parallel device, for expert params too (see ``average``).
        divisor = self.data_size if self.average else 1
        per_chain = [None] * len(self.chains) if residuals is None else self.per_chain(self.flat_shards(residuals))
        shards, new_residuals = [], []
        for chain, mine in zip(self.chains, per_chain):
            out = chain.reduce_scatter_leaves([leaves[i] for i in chain.leaves], mode=self.reduce, divisor=divisor,
                                              max_in_flight=self.max_in_flight, residuals=mine)
            shards.extend(out if mine is None else out[0])
            new_residuals.extend(() if mine is None else out[1])
        if residuals is None:
            return self.pack_shards(shards)
        return self.pack_shards(shards), self.pack_shards(new_residuals)

    def value_and_grad(
        self, loss_fn: Callable[..., Any], has_aux: bool = False, *, microbatches: int = 1,
        accum_dtype: Any = jnp.float32, has_state: bool = False, error_feedback: bool = False,
    ) -> Callable[..., Any]:
        """Like ``jax.value_and_grad``, returning reduce-scattered gradient shards.

        Call the result inside ``jax.shard_map`` with ``params`` first (replicated, or local
        blocks per ``param_specs``). Gradients are taken w.r.t. :meth:`local_params`, so no
        hidden all-reduce is inserted. Returns ``(loss, shards)`` (``((loss, aux), shards)``
        with ``has_aux``), where ``loss`` is the mean (``average=True``) or sum of the
        per-device losses over the data-parallel axes (``outer_axis`` and ``axis``).

        ``loss_fn`` may return a :class:`~jax_drain.WeightedLoss` ``(total, count)``: the
        gradient is then that of the global total divided by the global count, over every
        device and micro-batch, and ``loss`` the global per-count mean.

        ``microbatches=k`` splits every argument after ``params`` (and ``state``) along its
        leading axis into ``k`` micro-batches, run one after another in a loop; the local
        gradients are summed in ``accum_dtype`` (``None``: the gradients' own dtype), their mean
        is cast to the parameter dtype and reduce-scattered once. The loss is the mean over
        micro-batches; with ``has_aux`` the aux outputs come back stacked ``[k, ...]``.

        ``has_state``: ``loss_fn(params, state, *args)`` returns ``(output, new_state)`` (e.g.
        Flax batch statistics, RNG counters); the state is threaded through the micro-batches,
        never split, and the value becomes ``(loss_value, new_state)``.

        ``error_feedback``: the function takes this device's residuals second,
        ``(params, residuals, *args)``, and returns ``(value, shards, new_residuals)``; see
        :mod:`jax_drain.feedback` (the summed local gradient of all micro-batches is sent once,
        with the residual added).
        """
        check_microbatches(microbatches)
        accum_dtype = check_float_dtype(accum_dtype, "accum_dtype")
        local_step = local_value_and_grad(loss_fn, has_aux, has_state)
        if error_feedback:
            check_error_feedback(self)

        def wrapped(params: PyTree, *args: Any, **kwargs: Any):
            self.require_inside_shard_map("value_and_grad", data_region=bool(self.auto_axes))
            residuals, args = (args[0], args[1:]) if error_feedback else (None, args)
            local = self.local_params(params)
            state, args = (args[0], args[1:]) if has_state else (None, args)
            if microbatches == 1:
                out, grads = local_step(local, state, args, kwargs)
                check_state_replicated(state, out.state, self.data_axes)
                check_loss_varies(out.total, self.data_axes)
            else:
                out, grads = self._accumulate(local_step, local, state, args, kwargs, microbatches, accum_dtype)
            reduced = self.reduce_scatter(grads, residuals=residuals)
            shards, residuals = reduced if error_feedback else (reduced, None)
            loss, shards = self.finish(out.total, out.count, shards)
            value = pack_value(loss, out.aux, out.state, has_aux, has_state)
            return (value, shards, residuals) if error_feedback else (value, shards)

        return wrapped

    def sharded_grad(self, loss_fn, has_aux, has_state, shards, state, args, kwargs, *,
                     gather_max_in_flight: int, reshard_after_forward: bool, residuals=None):
        """ZeRO-3 (:func:`jax_drain.zero3.value_and_grad`): one micro-batch's
        :class:`~jax_drain.losses.LocalStep`, flat gradient shards and new error-feedback
        residuals from parameter shards, each bucket gathered where the loss first reads it."""
        return zero3.replay_value_and_grad(self, loss_fn, has_aux, has_state, shards, state, args, kwargs,
                                           gather_max_in_flight=gather_max_in_flight,
                                           reshard_after_forward=reshard_after_forward, residuals=residuals)

    def _accumulate(self, local_step, local, state, args, kwargs, k, accum_dtype):
        """``k`` micro-batches in a loop: the summed (weighted) or mean local gradient and loss,
        no communication; ``state`` is carried from one micro-batch to the next."""
        args, kwargs = jax.tree.map(lambda x: split_microbatches(x, k), (args, kwargs))
        leaves = jax.tree.leaves(local)
        # The carry has the loop outputs' type: a local gradient varies along the axes it is
        # reduced over and the (manual) axes its parameter is sharded along; the loss along the data axes.
        manual = set(self.manual_axes)
        axes = [tuple(a for a in pl.reduce_axes + self.outer_axes + pl.spec_axes if a in manual)
                for pl in self.placements]
        zeros = [_compat.mark_varying(jnp.zeros(p.shape, accum_dtype or p.dtype), a) for p, a in zip(leaves, axes)]
        scalar = lambda: _compat.mark_varying(jnp.zeros((), jnp.float32), self.data_axes)
        weighted: list[bool] = []  # filled while the loop body is traced

        def one(carry, micro):
            total, count, acc, state = carry
            a, kw = micro
            out, grads = local_step(local, state, a, kw)
            check_state_replicated(state, out.state, self.data_axes)
            check_loss_varies(out.total, self.data_axes)
            weighted.append(out.count is not None)
            grads = [_compat.mark_varying(g, ax) for g, ax in zip(jax.tree.leaves(grads), axes)]
            # Every term enters pre-divided (exactly, by a power of two): no partial sum overflows. A weighted
            # loss's count is divided alike, so its total / count and the gradients it rescales are unchanged.
            scale = mean_predivisor(k)
            acc = [s + g.astype(s.dtype) / scale for s, g in zip(acc, grads)]
            count = count + (1.0 if out.count is None else out.count / scale)
            return (total + out.total / scale, count, acc, out.state), out.aux

        (total, count, acc, state), aux = jax.lax.scan(one, (scalar(), scalar(), zeros, state), (args, kwargs))
        if weighted[0]:  # sums: finish() divides by the global count
            grads, out = acc, LocalStep(total, count, aux, state)
        else:  # the mean, in the accumulator's precision
            rest = k / mean_predivisor(k)
            grads, out = [s / rest for s in acc], LocalStep(total / rest, None, aux, state)
        grads = [g.astype(p.dtype) for g, p in zip(grads, leaves)]
        return out, jax.tree.unflatten(self._treedef, grads)


def local_params(params: PyTree, axis: AxisSpec) -> PyTree:
    """A per-device view of replicated ``params`` inside ``shard_map`` (no communication).

    ``jax.grad`` with respect to these gives each device's local gradient instead of the
    all-reduced one that differentiating the replicated ``params`` directly would give.
    ``axis`` may be a tuple of axes (e.g. ``("replica", "data")``). With tensor-parallel or
    expert params prefer :meth:`GradSync.local_params`, which knows each leaf's axes.
    """
    axes = as_axes(axis, "axis")
    return jax.tree.map(lambda p: _compat.mark_varying(p, axes), params)

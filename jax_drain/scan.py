"""Scan-over-layers models: reduce-scatter each layer's gradient inside the backward scan.

Large models run their blocks under ``jax.lax.scan`` (Flax ``nnx.scan``/``nn.scan``, MaxText's
``scan_layers``) so compile time stays flat in depth. Every block parameter then lives in one
*stacked* leaf ``[num_layers, ...]``, whose gradient is complete only when the backward scan
ends: bucketing whole leaves (:class:`~jax_drain.GradSync`) materialises the stacked gradient of
all layers before the first collective runs. :class:`ScanGradSync` instead reduce-scatters each
layer's gradient *inside* the backward loop, one layer at a time:

* one layer's slice of the stacked leaves is laid out in buckets (a per-layer
  :class:`~jax_drain.BucketLayout`); the other leaves (embeddings, final norm) get an ordinary
  :class:`~jax_drain.GradSync`;
* ``value_and_grad`` traces the loss, finds the ``scan`` whose scanned inputs (``xs``) are the
  stacked leaves -- through ``jit`` calls, whichever library built it -- and replays the loss with
  that scan's body wrapped: the layer's parameters pass through a ``jax.custom_vjp`` identity
  whose backward rule reduce-scatters the layer's local gradient (drained bucket chain, chosen
  reduce mode) and returns the float32 shards as the cotangent of a shard-shaped zero input
  scanned along with the parameters. The scan's transpose stacks those cotangents into
  ``[num_layers, shard]``: the stacked gradient itself is never formed. The model needs no change.

Output layout (:class:`ScanShards`, inside ``shard_map``): ``layers[k]`` is float32
``[num_layers, layer_shard_sizes[k]]``, row ``l`` this device's slice of layer ``l``'s bucket
``k``, and ``rest[j]`` the 1-D shard of the non-stacked bucket ``j``; device ``r`` holds elements
``[r * s, (r + 1) * s)`` of every bucket, as with :class:`~jax_drain.GradSync`. With
``out_specs=sync.shard_specs()`` the global arrays are the whole reduced buckets (``layers[k]``:
``[num_layers, layer_bucket_sizes[k]]``), and :meth:`ScanGradSync.unflatten` turns them back
into a gradient tree.

Example (the ``nnx.scan`` GPT of :mod:`jax_drain.models`)::

    import jax, jax_drain as jd
    from jax.sharding import PartitionSpec as P
    from jax_drain import models

    config = models.GPTConfig(num_layers=8, scan_layers=True)
    params, loss_fn = models.init_params(config, jax.random.key(0)), models.make_loss(config)
    sync = jd.ScanGradSync(params, mesh, axis="data", stacked=lambda path: path.startswith("blocks/"),
                           bucket_size=20_000_000, reduce="fp32_accum")

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), sync.shard_specs()))
    def step(params, batch):
        return sync.value_and_grad(loss_fn)(params, batch)

    loss, shards = step(params, batch)
    grads = sync.unflatten(shards)      # the mean gradient, shaped like params

Micro-batches: ``value_and_grad(loss_fn, microbatches=k)`` reduce-scatters every micro-batch's
gradient inside its own backward scan and accumulates the float32 *shards*. Accumulating the
local gradient instead (communicating once, as GradSync does) is not possible without the very
buffer this module avoids: layer ``l``'s gradients of the ``k`` micro-batches come from ``k``
different backward loops, so a local sum needs a full-size accumulator for every layer -- the
stacked ``[num_layers, ...]`` gradient. The price is ``k`` reduce-scatters instead of one, and
one float32 accumulator of the shards (``1 / axis_size`` of the parameters, in float32) next to
the current micro-batch's shards.

Tensor parallel by XLA (``tensor_parallel="gspmd"`` with ``param_specs``): the step's
``shard_map`` is manual over the data axes only and the loss runs on global shapes along the model
axes, stacked weights split over them past their layer dimension (``P(None, None, "model")``).
The hook's backward rule runs in the backward scan body there, where a layer's gradient is whole
along the model axes: it enters the sync's nested region manual over them
(:meth:`~jax_drain.chain.ChainedSync.on_local_blocks`) as this device's blocks, and the layer's
chain reduce-scatters them over the data axis, so no model-sharded gradient or weight is
gathered. The shards are laid out data axes first (:attr:`BucketChain.data_major
<jax_drain.BucketChain>`), as :class:`~jax_drain.GradSync` lays them out with ``"gspmd"``.
Hand-written tensor parallel (``"manual"``, the loss on local blocks with its own ``psum``) needs
no nested region: a layer's gradient is already this model rank's blocks.

Limits (each refused with an error naming the leaf): one scan over one
stack per loss (not an encoder and a decoder stack); the stacked leaves must enter that scan
unchanged, as its scanned inputs -- not through a cast (cast inside the body instead), a slice,
or a ``jax.checkpoint`` around the whole scan (put remat inside the body, as ``nnx.remat`` on the
block does); a stacked leaf used outside the scan is refused, because its gradient there would
be lost. The scan may sit inside ``jit``-ed functions. The rewrite reads the traced loss, so any
wrapper that hands the stacked leaves to ``jax.lax.scan`` as ``xs`` is seen the same way (tested:
``nnx.scan`` and plain ``jax.lax.scan``). A stacked leaf's layer dimension must not be split
over a mesh axis. ZeRO-3 (:mod:`jax_drain.zero3`) gathers each layer's buckets from their rows
in the scan body, on a tensor-parallel mesh too (over the data axes, on local blocks).

Optimizer: :class:`~jax_drain.DistributedOptimizer` takes a ScanGradSync as its ``sync``
(fp32 master shards in this layout, ``jax_drain.masked`` / ``jax_drain.clip_by_global_norm``
over every layer's rows), and ``jax_drain.TrainConfig(scan_layers=True)`` builds the whole
step. :meth:`ScanGradSync.init_master` and :meth:`ScanGradSync.gather_params` are the minimal
ZeRO-1 helpers it builds on: any element-wise optax transform applied to the
:class:`ScanShards` directly.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import Mesh, PartitionSpec

from jax_drain import _compat
from jax_drain._jaxpr import PLAIN_CALLS, REMAT, LAYERWISE, call_body, layerwise_outputs
from jax_drain.chain import (
    SCOPE_PREFIX, BucketChain, ChainedSync, accumulate_shards, build_chain, check_flag, check_microbatches,
    check_state_replicated,
)
from jax_drain.collectives import check_mode, check_wire_dtype
from jax_drain.drain import drain_depth, fence, sequenced_map
from jax_drain.feedback import check_error_feedback
from jax_drain import zero3
from jax_drain.layout import BucketLayout, check_order
from jax_drain.losses import check_loss_varies, pack_value, split_output
from jax_drain.mesh import as_axes, auto_mesh, check_mesh, check_tensor_parallel, place_leaves

__all__ = ["LAYER_SCOPE", "ScanGradSync", "ScanShards", "stacked_leaves"]

PyTree = Any
Stacked = PyTree | Callable[[str], bool]

#: ``jax.named_scope`` of the per-layer buckets' collectives: ``jax_drain/layers/bucket<k>``
#: (the non-stacked buckets keep GradSync's ``jax_drain/bucket<j>``).
LAYER_SCOPE = f"{SCOPE_PREFIX}/layers"



class ScanShards(NamedTuple):
    """Reduce-scattered gradients of a :class:`ScanGradSync`; a pytree.

    ``layers[k]``: float32 ``[num_layers, layer_shard_sizes[k]]`` inside ``shard_map``, row
    ``l`` this device's slice of layer ``l``'s bucket ``k`` (whole buckets outside, with
    ``shard_specs()``). ``rest[j]``: float32 ``[rest_shard_sizes[j]]``, the non-stacked leaves'
    bucket ``j`` (dispatch order, as :class:`~jax_drain.GradSync` returns them).
    """

    layers: tuple[jax.Array, ...]
    rest: tuple[jax.Array, ...]


class ScanGradSync(ChainedSync):
    """Reduce-scatters a scanned model's gradients layer by layer inside the backward scan.

    Args:
        params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``), replicated over
            ``mesh``; only shapes and dtypes are read.
        mesh: the device mesh the step runs on under ``jax.shard_map``.
        axis: the data-parallel mesh axis to reduce over.
        stacked: which leaves are stacked over layers: a predicate on ``"a/b/kernel"`` leaf paths
            (``lambda path: path.startswith("blocks/")``), or a pytree of bools with the
            structure of ``params`` or a prefix of it (``{"blocks": True, "ln_f": False}``).
            :func:`stacked_leaves` finds them from the loss.
        num_layers: the scan length; ``None`` takes the stacked leaves' leading dimension. Every
            stacked leaf must have it as its leading dimension.
        bucket_size: a bucket closes once it holds at least this many elements; it applies to
            one layer's slice of the stacked leaves and, separately, to the other leaves.
        reduce, drain, average, max_in_flight: as for :class:`~jax_drain.GradSync`. The drain
            chains one layer's buckets inside the loop body (each iteration's collectives finish
            in that iteration), smallest first (:attr:`BucketChain.loop_dispatch
            <jax_drain.BucketChain.loop_dispatch>`), and the non-stacked buckets after backward.
        order: leaf indices of ``params`` in gradient-ready order
            (:func:`jax_drain.grad_ready_order`); it is filtered to the stacked leaves (their
            order within a layer's buckets) and to the others. ``None``: reverse leaf order.
        outer_axis: hierarchical reduction as for :class:`~jax_drain.GradSync`: each shard,
            per layer inside the loop too, is all-reduced over these axes in float32.
        param_specs, tensor_parallel: tensor parallel, as for :class:`~jax_drain.GradSync`. With
            ``"gspmd"`` the loss runs on global shapes along the model axes, and each layer's
            gradient, in its backward iteration, enters the nested region manual over them as
            its local blocks, where the layer's chain reduce-scatters it over the data axis;
            with ``"manual"`` the loss runs on local blocks with its own model-axis collectives
            and the layer's buckets hold this model rank's blocks. A stacked leaf's spec leaves
            its layer (leading) dimension unsplit, e.g. ``P(None, None, "model")``.

    Example::

        # models.GPTConfig(num_layers=8, scan_layers=True): d=2048, 50M parameters per block
        sync = ScanGradSync(params, mesh, stacked={"blocks": True, "ln_f": False}, bucket_size=20_000_000)
        sync.num_layers, sync.layer_bucket_sizes    # (8, (33554432, 16785408)): MLP | attention
    """

    def __init__(
        self,
        params: PyTree,
        mesh: Mesh,
        *,
        axis: str = "data",
        stacked: Stacked,
        num_layers: int | None = None,
        bucket_size: int | None = 40_000_000,
        reduce: str = "fp32_accum",
        drain: bool = True,
        average: bool = True,
        order: Sequence[int] | None = None,
        max_in_flight: int | None = None,
        outer_axis: str | Sequence[str] | None = None,
        split_leaves: bool = False,
        wire_dtype: Any = None,
        param_specs: PyTree | None = None,
        tensor_parallel: str = "manual",
    ):
        check_mesh(mesh)
        self.tensor_parallel = check_tensor_parallel(tensor_parallel)
        gspmd = self.tensor_parallel == "gspmd"
        if gspmd:
            mesh = auto_mesh(mesh)  # GSPMD partitions the loss over the Auto axes
        if not isinstance(axis, str):
            raise TypeError(f"ScanGradSync reduces over one mesh axis (axis='data'), got {axis!r}")
        if axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)}")
        self.mesh = mesh
        self.axis = axis
        self.axes = (axis,)
        self.outer_axes = as_axes(outer_axis, "outer_axis", allow_empty=True)
        self.outer_axis = outer_axis
        self.axis_size = int(mesh.shape[axis])
        self.reduce = check_mode(reduce)
        check_wire_dtype(self.reduce, wire_dtype)
        self.average = check_flag(average, "average")
        self.drain = check_flag(drain, "drain")
        self.max_in_flight = drain_depth(drain, max_in_flight)
        self.placements = tuple(place_leaves(params, mesh, self.axes, self.outer_axes, param_specs))
        self._treedef = jax.tree.structure(params)
        mask = _stacked_mask(params, stacked, [pl.path for pl in self.placements])
        self._stacked = tuple(i for i, m in enumerate(mask) if m)
        self._rest = tuple(i for i, m in enumerate(mask) if not m)
        if not self._stacked:
            raise ValueError(
                "no leaf is marked as stacked over layers; pass stacked= (a predicate on leaf "
                "paths such as lambda path: path.startswith('blocks/'), or a pytree of bools), "
                "or use jax_drain.GradSync for a model without a scanned layer stack"
            )
        self.num_layers = _check_num_layers(
            [(self.placements[i].path, self.placements[i].global_shape) for i in self._stacked], num_layers
        )
        _check_layer_axis_unsplit([self.placements[i] for i in self._stacked])
        order = None if order is None else check_order(order, len(self.placements))
        chain = lambda name, scope, leaves, layers: build_chain(
            name, scope, mesh, self.placements, leaves, self.axes, self.outer_axes,
            bucket_size=bucket_size, order=order, num_layers=layers,
            split_leaves=check_flag(split_leaves, "split_leaves"),
            wire_dtype=wire_dtype, data_major=gspmd)
        #: The bucket chains, dispatch order: one layer's buckets (reduced inside the backward
        #: scan, shards ``[num_layers, size]``), then the other leaves' (after the loop).
        self.chains = (chain("layers", LAYER_SCOPE, self._stacked, self.num_layers),) + (
            (chain("dense", SCOPE_PREFIX, self._rest, None),) if self._rest else ()
        )
        self._hook = _make_hook(self._reduce_layer)
        self._bucket_hook = _make_hook(self._reduce_layer_buckets)

    # -- the sync's output type -------------------------------------------------------------
    @property
    def _layers(self) -> BucketChain:
        return self.chains[0]

    @property
    def _others(self) -> BucketChain | None:
        return self.chains[1] if len(self.chains) > 1 else None

    def flat_shards(self, shards: ScanShards) -> tuple[jax.Array, ...]:
        if not isinstance(shards, ScanShards):
            raise TypeError(
                f"a ScanGradSync's shards are the ScanShards from sync.value_and_grad / "
                f"sync.reduce_scatter, got {type(shards).__name__}"
            )
        return (*shards.layers, *shards.rest)

    def pack_shards(self, flat: Sequence[Any]) -> ScanShards:
        layers, *rest = self.per_chain(flat)
        return ScanShards(layers, rest[0] if rest else ())

    # -- layout ---------------------------------------------------------------------------
    @property
    def stacked_paths(self) -> tuple[str, ...]:
        """Paths of the leaves stacked over layers, in ``jax.tree.leaves`` order."""
        return tuple(self.placements[i].path for i in self._stacked)

    @property
    def layer_layout(self) -> BucketLayout:
        """Layout of one layer's slice of the stacked leaves (leaf paths as in ``params``)."""
        return self._layers.layout

    @property
    def rest_layout(self) -> BucketLayout | None:
        """Layout of the non-stacked leaves (``None`` if every leaf is stacked)."""
        return None if self._others is None else self._others.layout

    @property
    def layer_bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each bucket of one layer, dispatch order."""
        return self.layer_layout.bucket_sizes

    @property
    def layer_shard_sizes(self) -> tuple[int, ...]:
        """Elements of each layer bucket one device holds, per layer."""
        return self._layers.shard_sizes

    @property
    def rest_bucket_sizes(self) -> tuple[int, ...]:
        """Padded element count of each non-stacked bucket, dispatch order."""
        return () if self._others is None else self._others.layout.bucket_sizes

    @property
    def rest_shard_sizes(self) -> tuple[int, ...]:
        return () if self._others is None else self._others.shard_sizes

    def flatten(self, tree: PyTree, dtype: Any = None) -> ScanShards:
        """Packs a params-shaped tree into whole buckets: the global layout of the shards.

        ``layers[k]`` is ``[num_layers, layer_bucket_sizes[k]]``, ``rest[j]`` is 1-D; ``dtype``
        casts every bucket (e.g. ``jnp.float32`` for master weights), ``None`` keeps leaf dtypes.
        """
        leaves = self.check_tree(tree, "tree", check_dtypes=dtype is None)
        return self.pack_shards([b for chain in self.chains for b in chain.flatten(leaves, dtype)])

    def table(self) -> str:
        """One layer's bucket layout and the other leaves' layout, as readable tables."""
        text = f"per layer (x{self.num_layers}, leading axis stripped):\n{self.layer_layout.table()}"
        if self._others is not None:
            text += f"\nother leaves:\n{self._others.layout.table()}"
        return text

    def __repr__(self) -> str:
        return (
            f"ScanGradSync(axis={self.axis!r}, axis_size={self.axis_size}, reduce={self.reduce!r}, "
            f"drain={self.drain}, max_in_flight={self.max_in_flight}, num_layers={self.num_layers}, "
            f"layer_buckets={len(self.layer_bucket_sizes)}, rest_buckets={len(self.rest_bucket_sizes)}"
            + (f", tensor_parallel={self.tensor_parallel!r})" if self.tensor_parallel != "manual" else ")")
        )

    # -- inside shard_map -----------------------------------------------------------------
    def value_and_grad(
        self, loss_fn: Callable[..., Any], has_aux: bool = False, *, microbatches: int = 1,
        accum_dtype: Any = jnp.float32, has_state: bool = False, error_feedback: bool = False,
    ) -> Callable[..., Any]:
        """Like ``jax.value_and_grad``, returning :class:`ScanShards`; each layer is
        reduce-scattered inside the backward scan.

        Call the result inside ``jax.shard_map`` with the replicated ``params`` first:
        ``loss, shards = sync.value_and_grad(loss_fn)(params, batch)``. Gradients are taken
        w.r.t. a per-device view of ``params`` (no hidden all-reduce). ``loss`` is the mean
        (``average=True``) or sum over the data axes of the per-device losses; a
        :class:`~jax_drain.WeightedLoss` and ``has_state`` work as for
        :meth:`GradSync.value_and_grad <jax_drain.GradSync.value_and_grad>`.

        ``microbatches=k`` splits every array argument after ``params`` along its leading axis
        into ``k`` micro-batches, run one after another; the float32 shards are accumulated and
        divided by ``k`` (the loss is the mean over micro-batches), and with ``has_aux`` the aux
        outputs come back stacked ``[k, ...]``. ``accum_dtype`` is accepted for the protocol's
        sake and must be float32: the shards are accumulated in float32.

        ``error_feedback``: the function takes this device's residuals second (a
        :class:`ScanShards` of whole local buckets, ``[num_layers, size]`` per layer bucket) and
        returns ``(value, shards, new_residuals)``; each layer's residual rows go through the
        backward scan with its gradient (:mod:`jax_drain.feedback`). With micro-batches every
        micro-batch's send is compensated by the residual the previous one left.
        """
        check_microbatches(microbatches)
        if error_feedback:
            check_error_feedback(self)
        if accum_dtype is not None and jnp.dtype(accum_dtype) != jnp.float32:
            raise ValueError("ScanGradSync accumulates the float32 shards of each micro-batch; accum_dtype "
                             f"must be float32, got {jnp.dtype(accum_dtype)}")

        def wrapped(params: PyTree, *args: Any, **kwargs: Any):
            self.require_inside_shard_map("value_and_grad", data_region=bool(self.auto_axes))
            self.check_tree(params, "params", region=True)
            local = jax.tree.leaves(self.local_params(params))
            residuals, args = (args[0], args[1:]) if error_feedback else (None, args)
            state, args = (args[0], args[1:]) if has_state else (None, args)
            run = lambda state, residuals, a, kw: self._value_and_grad_once(
                loss_fn, has_aux, has_state, local, state, residuals, a, kw)
            if microbatches == 1:
                out, shards, residuals = run(state, residuals, args, kwargs)
            else:
                def flat_run(st, res, a, kw):
                    step, shards, res = run(st, res, a, kw)
                    return step, list(self.flat_shards(shards)), res

                out, flat, residuals = accumulate_shards(self, flat_run, state, residuals, args, kwargs, microbatches)
                shards = self.pack_shards(flat)
            loss, shards = self.finish(out.total, out.count, shards)
            value = pack_value(loss, out.aux, out.state, has_aux, has_state)
            return (value, shards, residuals) if error_feedback else (value, shards)

        return wrapped

    def reduce_scatter(self, grads: PyTree, *, residuals: ScanShards | None = None) -> Any:
        """Reduce-scatters a complete local gradient tree *after* backward; same output as
        :meth:`value_and_grad`.

        The reference and fallback: the stacked gradients already exist, so this saves no
        memory. Layer buckets are sent last layer first (backward order), all ``num_layers x
        buckets`` collectives in one drain chain, then the non-stacked buckets. ``residuals``:
        error feedback, as for :meth:`value_and_grad`; returns ``(shards, new_residuals)``.
        With ``tensor_parallel="gspmd"`` it may be called in the step's data-parallel region, on
        gradients whole along the model axes: they enter :meth:`manual_region` as their local blocks.
        """
        if self.in_data_region():
            return self.reduce_scatter_in_data_region(grads, residuals)
        self.require_inside_shard_map("reduce_scatter")
        leaves = self.check_tree(grads, "grads", local=True)
        self.check_varying(leaves)
        stacked, rest = self._split(leaves)
        layers_chain = self._layers
        backward = list(reversed(range(self.num_layers)))
        per_layer = [layers_chain.layout.flatten([g[l] for g in stacked]) for l in backward]
        num_buckets = layers_chain.num_buckets
        rows = None if residuals is None else [residuals.layers[k][l] for l in backward for k in range(num_buckets)]
        reduced = layers_chain.reduce_scatter(
            [bucket for layer in per_layer for bucket in layer], mode=self.reduce, divisor=self._divisor,
            max_in_flight=self.max_in_flight, bucket_ids=lambda i: i % num_buckets, residuals=rows,
        )
        reduced, new_rows = reduced if residuals is not None else (reduced, None)

        def by_layer(flat: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
            return tuple(
                jnp.stack([flat[(self.num_layers - 1 - l) * num_buckets + k] for l in range(self.num_layers)])
                for k in range(num_buckets)
            )

        layers = by_layer(reduced)
        if residuals is None:
            return ScanShards(layers, self._reduce_rest(rest, layers))
        rest_shards, rest_residuals = self._reduce_rest(rest, layers, residuals.rest)
        return ScanShards(layers, rest_shards), ScanShards(by_layer(new_rows), rest_residuals)

    # -- internals --------------------------------------------------------------------------
    @property
    def _divisor(self) -> int:
        return self.data_size if self.average else 1

    def _value_and_grad_once(self, loss_fn, has_aux, has_state, local, state, residuals, args, kwargs,
                             rows=None, reshard=True, gather_depth=1):
        """This device's :class:`~jax_drain.losses.LocalStep`, the shards and (with
        ``residuals``) the new residuals, the layer scan rewritten (module doc).

        ``rows`` (ZeRO-3): this device's parameter shards of every layer bucket,
        ``[num_layers, size]``; the stacked entries of ``local`` are then only traced, and each
        layer's parameters are gathered from its rows inside the scan body (again in backward
        with ``reshard``)."""
        flat_args, args_tree = jax.tree.flatten((state, args, kwargs))
        num_params = len(local)

        def flat_loss(*flat):
            params = jax.tree.unflatten(self._treedef, flat[:num_params])
            st, a, kw = jax.tree.unflatten(args_tree, flat[num_params:])
            return loss_fn(params, st, *a, **kw) if has_state else loss_fn(params, *a, **kw)

        closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*local, *flat_args)
        out_tree = jax.tree.structure(out_shape)
        stacked_values = [local[i] for i in self._stacked]
        tracked = {closed.jaxpr.invars[i]: j for j, i in enumerate(self._stacked)}
        # Shaped like the layer shards where the loss runs (with gspmd: every model rank's shard).
        dummies = tuple(
            _compat.mark_varying(jnp.zeros(self.region_shard_shape(self._layers, k), jnp.float32),
                                 self.region_axes((self.axis,) + self._layers.spec_axes))
            for k in range(self._layers.num_buckets)
        )
        layer_residuals = () if residuals is None else tuple(residuals.layers)
        rewriters = []

        def differentiable(rest_leaves, dummies, layer_residuals):
            inputs = self._merge_leaves(stacked_values, rest_leaves)
            rewriter = _ScanRewriter(self, stacked_values, dummies, layer_residuals, rows, reshard, gather_depth)
            rewriters.append(rewriter)
            outs = rewriter.eval(closed.jaxpr, closed.consts, [*inputs, *flat_args], tracked)
            step = split_output(jax.tree.unflatten(out_tree, outs), has_aux, has_state)
            return step.total, step

        rest_local = [local[i] for i in self._rest]
        # The layer residuals' "gradient" is their new value: the hook's backward returns it.
        (_, step), (rest_grads, layer_shards, new_layer_residuals) = jax.value_and_grad(
            differentiable, argnums=(0, 1, 2), has_aux=True
        )(rest_local, dummies, layer_residuals)
        if not any(r.found for r in rewriters):
            raise ValueError(
                f"loss_fn has no jax.lax.scan over the stacked leaves {list(self.stacked_paths)[:4]}"
                f"{'...' if len(self._stacked) > 4 else ''}: nothing to reduce inside a loop. Mark "
                "the leaves the layer scan takes as its scanned inputs (see jax_drain.scan."
                "stacked_leaves), or use jax_drain.GradSync for an unrolled model"
            )
        check_state_replicated(state, step.state, self.data_axes)
        check_loss_varies(step.total, self.data_axes)
        if residuals is None:
            return step, ScanShards(tuple(layer_shards), self._reduce_rest(rest_grads, layer_shards)), None
        rest_shards, rest_residuals = self._reduce_rest(rest_grads, layer_shards, residuals.rest)
        return (step, ScanShards(tuple(layer_shards), rest_shards),
                ScanShards(tuple(new_layer_residuals), rest_residuals))

    def sharded_grad(self, loss_fn, has_aux, has_state, shards, state, args, kwargs, *,
                     gather_max_in_flight: int, reshard_after_forward: bool, residuals=None):
        """ZeRO-3 (:func:`jax_drain.zero3.value_and_grad`): one micro-batch's
        :class:`~jax_drain.losses.LocalStep` and flat gradient shards from parameter shards.
        Each layer is gathered from its rows inside the scan body and reduce-scattered in its
        backward (with ``residuals`` added there: error feedback); the other leaves are gathered
        once, before the loss."""
        zero3.check_shardable(self)
        parts = self.per_chain(shards)
        rows, rest = parts[0], (parts[1] if len(parts) > 1 else ())
        local: list[Any] = [None] * len(self.placements)
        for i in self._stacked:  # traced only: the scan takes the rows instead
            pl = self.placements[i]
            local[i] = _compat.mark_varying(jnp.zeros(self.region_shape(pl.global_shape, pl.spec), pl.dtype),
                                            pl.reduce_axes + self.outer_axes + self.region_axes(pl.spec_axes))
        if self._others is not None:
            for i, leaf in zip(self._others.leaves, self._gather_rest(rest)):
                local[i] = _compat.mark_varying(leaf, self.placements[i].reduce_axes + self.outer_axes)
        fed = None if residuals is None else self.pack_shards(residuals)
        step, out, new = self._value_and_grad_once(loss_fn, has_aux, has_state, local, state, fed, args, kwargs,
                                                   rows=rows, reshard=reshard_after_forward,
                                                   gather_depth=gather_max_in_flight)
        return step, list(self.flat_shards(out)), None if new is None else list(self.flat_shards(new))

    def _gather_rest(self, rest: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The non-stacked leaves, gathered (one bucket at a time) from their ZeRO-3 shards. With
        ``tensor_parallel="gspmd"`` they are gathered on local blocks in the nested region and
        leave it as the model-sharded global leaves the loss reads."""
        others = self._others
        placements = [self.placements[i] for i in others.leaves]

        def gather(shards):
            leaves = others.unflatten(sequenced_map(lambda k, shard: others.gather(k, shard), shards, 1))
            return tuple(others.as_leaf(x, pl) for x, pl in zip(leaves, placements))

        in_specs = ((others.shard_spec,) * others.num_buckets,)
        return self.on_local_blocks(gather, in_specs, tuple(pl.spec for pl in placements))(tuple(rest))

    def _reduce_layer(self, layer_grads: Sequence[jax.Array], residuals: Sequence[jax.Array] | None) -> Any:
        """One layer's local gradient (stacked-leaf order) -> its float32 bucket shards (and,
        with this layer's ``residuals``, the new ones). With ``tensor_parallel="gspmd"``, called
        in the backward scan body in the data-parallel region, where the gradients are whole
        along the model axes: the chain runs on their local blocks in the nested region manual
        over them, so no model-sharded gradient is gathered."""
        self.check_varying(list(layer_grads), indices=self._stacked)
        grad_specs = tuple(_layer_spec(self.placements[i].spec) for i in self._stacked)
        return self._run_layer_chain(self._layers.reduce_scatter_leaves, layer_grads, grad_specs, residuals)

    def _reduce_layer_buckets(self, buckets: Sequence[jax.Array], residuals: Sequence[jax.Array] | None) -> Any:
        """:meth:`_reduce_layer` for one layer's gradient already laid out in its whole buckets
        (ZeRO-3: each gather's backward lays its bucket's pieces back)."""
        grad_specs = (_layer_spec(self._layers.bucket_spec),) * self._layers.num_buckets
        return self._run_layer_chain(self._layers.reduce_scatter, buckets, grad_specs, residuals)

    def _run_layer_chain(self, reduce_scatter: Callable, grads: Sequence[jax.Array], grad_specs: tuple,
                         residuals: Sequence[jax.Array] | None) -> Any:
        """The layer chain's drained ``reduce_scatter`` of one layer's ``grads`` on local blocks."""
        chain = self._layers
        shard_specs = (_layer_spec(chain.shard_spec),) * chain.num_buckets

        def reduce(grads, residuals=None):
            out = reduce_scatter(list(grads), mode=self.reduce, divisor=self._divisor,
                                 max_in_flight=self.max_in_flight, residuals=residuals, dispatch=chain.loop_dispatch)
            return tuple(out) if residuals is None else (tuple(out[0]), tuple(out[1]))

        if residuals is None:
            return self.on_local_blocks(reduce, (grad_specs,), shard_specs)(tuple(grads))
        residual_specs = (_layer_spec(chain.bucket_spec),) * chain.num_buckets
        return self.on_local_blocks(reduce, (grad_specs, residual_specs), (shard_specs, residual_specs))(
            tuple(grads), tuple(residuals))

    def _reduce_rest(
        self, rest_grads: Sequence[jax.Array], layer_shards: Sequence[jax.Array],
        residuals: Sequence[jax.Array] | None = None,
    ) -> Any:
        """The non-stacked buckets' shards (``(shards, new_residuals)`` with ``residuals``)."""
        others = self._others
        if others is None:
            return () if residuals is None else ((), ())
        rest_grads = list(rest_grads)
        self.check_varying(rest_grads, indices=self._rest)
        if self.drain:
            # Start the non-stacked buckets only once the layer loop's shards exist, so no
            # collective stays in flight across the loop (the drain's one-at-a-time bound).
            rest_grads = fence(tuple(layer_shards), rest_grads)
        grad_specs = tuple(self.placements[i].spec for i in self._rest)
        shard_specs = (others.shard_spec,) * others.num_buckets
        if residuals is None:
            reduce = lambda g: tuple(others.reduce_scatter_leaves(  # noqa: E731
                g, mode=self.reduce, divisor=self._divisor, max_in_flight=self.max_in_flight))
            return self.on_local_blocks(reduce, (grad_specs,), shard_specs)(tuple(rest_grads))
        residual_specs = (others.bucket_spec,) * others.num_buckets
        fed = lambda g, r: others.reduce_scatter_leaves(  # noqa: E731
            g, mode=self.reduce, divisor=self._divisor, max_in_flight=self.max_in_flight, residuals=r)
        return self.on_local_blocks(fed, (grad_specs, residual_specs), (shard_specs, residual_specs))(
            tuple(rest_grads), tuple(residuals))

    def _split(self, leaves: Sequence[Any]) -> tuple[list, list]:
        return [leaves[i] for i in self._stacked], [leaves[i] for i in self._rest]

    def _merge_leaves(self, stacked: Sequence[Any], rest: Sequence[Any]) -> list:
        out: list[Any] = [None] * (len(stacked) + len(rest))
        for i, x in zip(self._stacked, stacked):
            out[i] = x
        for i, x in zip(self._rest, rest):
            out[i] = x
        return out


def stacked_leaves(loss_fn: Callable[..., Any], params: PyTree, *example_args: Any) -> PyTree:
    """Which leaves of ``params`` a ``scan`` in ``loss_fn`` takes as scanned inputs (``xs``).

    Traces ``loss_fn(params, *example_args)`` (arrays or ``jax.ShapeDtypeStruct``s; nothing
    runs) and marks the leaves that enter a scan, directly or through ``jit`` calls, as scanned
    inputs. Pass the result as ``ScanGradSync(stacked=...)``. A loss that uses collectives must
    be traced inside ``shard_map``.

    Example::

        >>> config = models.GPTConfig(num_layers=2, d_model=64, num_heads=2, seq_len=8, scan_layers=True)
        >>> mask = stacked_leaves(models.make_loss(config), models.abstract_params(config),
        ...                       models.example_batch(config, 2))
        >>> mask["blocks"]["attn"]["qkv"]["kernel"], mask["ln_f"]["scale"]
        (True, False)
    """
    leaves, treedef = jax.tree.flatten(params)
    closed = jax.make_jaxpr(loss_fn)(params, *example_args)  # inputs: params' leaves, then the args'
    position = {v: i for i, v in enumerate(closed.jaxpr.invars[:len(leaves)])}
    found: set[int] = set()
    _find_scanned(closed.jaxpr, position, found)
    return jax.tree.unflatten(treedef, [i in found for i in range(len(leaves))])


# -- the hook and the scan rewrite ---------------------------------------------------------------


def _make_hook(reduce_layer: Callable[[Sequence[jax.Array], Sequence[jax.Array] | None], Any]):
    """``hook(layer, layer_dummies, layer_residuals) -> layer``: an identity whose backward rule
    reduce-scatters the layer's gradient (``reduce_layer`` of ``layer``'s cotangent: its leaves',
    or with ZeRO-3 its whole buckets') and returns the shards as the dummies' cotangent and,
    with error feedback (``layer_residuals`` not empty), the new residuals as the residuals'
    cotangent."""

    @jax.custom_vjp
    def hook(layer: list, dummies: tuple, residuals: tuple) -> list:
        return layer

    def fwd(layer, dummies, residuals):
        return layer, residuals

    def bwd(residuals, layer_grads):
        # No cotangent for the parameters: their gradient leaves the loop as shards only.
        if not residuals:
            return None, tuple(reduce_layer(layer_grads, None)), ()
        shards, new_residuals = reduce_layer(layer_grads, residuals)
        return None, tuple(shards), tuple(new_residuals)

    hook.defvjp(fwd, bwd)
    return hook


class _ScanRewriter:
    """Evaluates a traced loss, replacing the scan over the stacked leaves by one whose body
    passes each layer's parameters through the sync's hook (one instance per evaluation)."""

    def __init__(self, sync: ScanGradSync, stacked_values: Sequence[jax.Array], dummies: Sequence[jax.Array],
                 residuals: Sequence[jax.Array], rows: Sequence[jax.Array] | None = None, reshard: bool = True,
                 gather_depth: int = 1):
        self.sync = sync
        self.stacked_values = list(stacked_values)
        self.dummies = tuple(dummies)
        self.residuals = tuple(residuals)  # per layer bucket [num_layers, size]; () without feedback
        self.rows = None if rows is None else tuple(rows)  # ZeRO-3: parameter shards per layer bucket
        self.reshard, self.gather_depth = reshard, gather_depth
        self.found = False

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], tracked: dict) -> list:
        """``jax.core.eval_jaxpr`` that routes equations touching ``tracked`` vars (var ->
        stacked-leaf index) to :meth:`_rewrite`."""
        env: dict[Any, Any] = {}
        read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            hits = [(k, tracked[v]) for k, v in enumerate(eqn.invars)
                    if not isinstance(v, _compat.Literal) and v in tracked]
            with _compat.eqn_context(eqn):
                if hits:
                    outs = self._rewrite(eqn, invals, hits, tracked)
                else:
                    outs = _compat.bind_eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _rewrite(self, eqn: Any, invals: list, hits: list, tracked: dict) -> list:
        name = eqn.primitive.name
        paths = self.sync.stacked_paths
        if name == "scan":
            return self._scan(eqn, invals, hits)
        body = call_body(eqn, PLAIN_CALLS)
        if body is not None:
            jaxpr, consts = body
            inner_tracked = {jaxpr.invars[k]: j for k, j in hits}
            outs = self.eval(jaxpr, consts, invals, inner_tracked)
            for outer, v in zip(eqn.outvars, jaxpr.outvars):
                if v in inner_tracked:  # a call that returns a stacked leaf unchanged
                    tracked[outer] = inner_tracked[v]
            return outs
        leaf = paths[hits[0][1]]
        is_remat = name in REMAT
        hint = (
            "put the remat inside the scan body (e.g. nnx.remat / jax.checkpoint on the block), not "
            "around the whole scan" if is_remat else
            "the stacked leaves must reach the layer scan unchanged, as its scanned inputs (xs), "
            "and be used nowhere else: their gradient outside the scan would be lost"
        )
        used_by = f"jax.checkpoint ({name!r})" if is_remat else repr(name)
        raise ValueError(f"stacked leaf {leaf!r} is used by {used_by} outside the layer scan; {hint}")

    def _scan(self, eqn: Any, invals: list, hits: list) -> list:
        paths = self.sync.stacked_paths
        params = eqn.params
        num_consts, num_carry = _compat.scan_counts(params)
        first_xs = num_consts + num_carry
        if self.found:
            raise ValueError(
                f"stacked leaf {paths[hits[0][1]]!r} is used by a second scan; ScanGradSync "
                "supports one scan over the layer stack per loss"
            )
        for k, j in hits:
            if k < first_xs:
                raise ValueError(
                    f"stacked leaf {paths[j]!r} is passed to a scan as a loop-invariant constant or "
                    "carry, not as a scanned input (xs): mark only leaves the layer scan iterates over"
                )
        leaves_at = [k - first_xs for k, _ in hits]
        owners = [j for _, j in hits]
        if len(set(owners)) != len(owners):
            dup = next(j for j in owners if owners.count(j) > 1)
            raise ValueError(f"stacked leaf {paths[dup]!r} is scanned twice by the same scan")
        if params["length"] != self.sync.num_layers:
            raise ValueError(
                f"the scan over the stacked leaves has length {params['length']}, but the sync was "
                f"built for num_layers={self.sync.num_layers}"
            )
        self.found = True
        body = params["jaxpr"]
        consts, init, xs = invals[:num_consts], invals[num_consts:first_xs], invals[first_xs:]
        position = dict(zip(owners, leaves_at))  # stacked-leaf index -> its position in xs
        # Stacked leaves the body does not read still pass through the hook (zero gradient), so
        # every layer bucket is complete.
        if self.rows is not None:
            return self._sharded_scan(eqn, consts, init, xs, position, num_carry)
        unused = [j for j in range(len(self.stacked_values)) if j not in position]
        extra = [self.stacked_values[j] for j in unused]
        hook = self.sync._hook

        def body_fn(carry, x):
            xs_layer, extra_layer, dummies_layer, residuals_layer = x
            layer = [None] * len(self.stacked_values)
            for j, pos in position.items():
                layer[j] = xs_layer[pos]
            for j, value in zip(unused, extra_layer):
                layer[j] = value
            layer = hook(layer, dummies_layer, residuals_layer)
            xs_layer = list(xs_layer)
            for j, pos in position.items():
                xs_layer[pos] = layer[j]
            outs = jex_core.jaxpr_as_fun(body)(*consts, *carry, *xs_layer)
            return list(outs[:num_carry]), list(outs[num_carry:])

        carry, ys = jax.lax.scan(
            body_fn, list(init), (list(xs), extra, self.dummies, self.residuals), length=params["length"],
            reverse=params["reverse"], unroll=params["unroll"],
            _split_transpose=params.get("_split_transpose", False),
        )
        return [*carry, *ys]

    def _sharded_scan(self, eqn, consts, init, xs, position, num_carry) -> list:
        """The layer scan of a ZeRO-3 step: the stacked leaves' place in ``xs`` is taken by the
        layers' parameter rows; the body is replayed with each layer bucket gathered from its row
        where the body first reads it (inside the block's remat region, with ``reshard``, so the
        backward iteration gathers it again), its gradient reduce-scattered in the backward
        iteration (:func:`jax_drain.zero3.replay_gathered`)."""
        params = eqn.params
        body = params["jaxpr"]
        stacked_at = set(position.values())
        others = [x for k, x in enumerate(xs) if k not in stacked_at]
        position_of = {pos: self.sync._stacked[j] for j, pos in position.items()}  # xs position -> leaf
        chain = self.sync._layers
        refs = [(chain, k) for k in range(chain.num_buckets)]
        sync = self.sync

        def body_fn(carry, x):
            others_layer, rows_layer, dummies_layer, residuals_layer = x
            rest = iter(others_layer)
            xs_layer = [zero3.ParamRef(position_of[k]) if k in position_of else next(rest) for k in range(len(xs))]
            # The gathers return the layer's bucket gradients as these zeros' cotangents; the hook's
            # backward reduces them through the layer chain, drained like the in-scan sync's.
            zeros = tuple(sync.bucket_zeros(chain, k) for k in range(chain.num_buckets))
            buckets = sync._bucket_hook(zeros, dummies_layer, residuals_layer)
            outs = zero3.replay_gathered(sync, body.jaxpr, body.consts, [*consts, *carry, *xs_layer], refs, rows_layer,
                                         buckets, depth=self.gather_depth, reshard=self.reshard)
            return list(outs[:num_carry]), list(outs[num_carry:])

        carry, ys = jax.lax.scan(
            body_fn, list(init), (others, self.rows, self.dummies, self.residuals), length=params["length"],
            reverse=params["reverse"], unroll=params["unroll"], _split_transpose=params.get("_split_transpose", False),
        )
        return [*carry, *ys]

def _find_scanned(jaxpr: Any, position: dict, found: set) -> None:
    """Adds to ``found`` the input positions that reach a scan's xs (through inline calls)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        operands = [(k, position[v]) for k, v in enumerate(eqn.invars)
                    if not isinstance(v, _compat.Literal) and v in position]
        if not operands:
            continue
        if name == "scan":
            first_xs = sum(_compat.scan_counts(eqn.params))
            found.update(i for k, i in operands if k >= first_xs)
        elif name in LAYERWISE:
            position.update(layerwise_outputs(eqn, operands))
        elif (body := call_body(eqn, PLAIN_CALLS)) is not None:
            inner = body[0]
            _find_scanned(inner, {inner.invars[k]: i for k, i in operands}, found)


# -- small helpers -------------------------------------------------------------------------------


def _stacked_mask(params: PyTree, stacked: Stacked, paths: Sequence[str]) -> list[bool]:
    if callable(stacked):
        return [bool(stacked(path)) for path in paths]
    try:
        # A prefix of params' structure is broadcast: {"blocks": True} marks every leaf below.
        full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), stacked, params)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "stacked must be a predicate on leaf paths or a pytree of bools with the structure of "
            f"params (or a prefix of it); it does not match params: {e}"
        ) from None
    mask = jax.tree.leaves(full)
    if len(mask) != len(paths):  # pragma: no cover - tree.map guarantees it
        raise ValueError("stacked does not match params")
    return mask


def _layer_spec(spec: PartitionSpec) -> PartitionSpec:
    """The spec of one layer's slice of an array stacked over layers (its leading entry dropped)."""
    return PartitionSpec(*tuple(spec)[1:])


def _check_layer_axis_unsplit(placements: Sequence[Any]) -> None:
    """Refuses a stacked leaf whose layer (leading) dimension is split over a mesh axis: each
    scan iteration must see its whole layer."""
    for pl in placements:
        if len(pl.spec) and pl.spec[0] is not None:
            raise ValueError(
                f"stacked leaf {pl.path!r} has spec {pl.spec}, splitting its layer (leading) dimension over "
                f"{pl.spec[0]!r}; a scanned stack's layer dimension must stay unsplit (e.g. P(None, None, 'model'))"
            )


def _check_num_layers(stacked: Sequence[tuple[str, tuple[int, ...]]], num_layers: int | None) -> int:
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"num_layers must be a positive int or None, got {num_layers!r}")
    for path, shape in stacked:
        if not shape:
            raise ValueError(
                f"stacked leaf {path!r} is a scalar; a leaf stacked over layers has the layer "
                "axis first. Unmark it (stacked=...)"
            )
    if num_layers is None:
        # The most common leading dimension: a wrongly marked leaf is then the one named below.
        leading = [shape[0] for _, shape in stacked]
        num_layers = max(leading, key=leading.count)
    for path, shape in stacked:
        if shape[0] != num_layers:
            raise ValueError(
                f"stacked leaf {path!r} has shape {shape}: its leading dimension {shape[0]} is not "
                f"the number of layers (the scan length) {num_layers}. Stack it over layers "
                "first, or leave it out of stacked="
            )
    return num_layers

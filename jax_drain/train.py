"""A sharded train step for ``flax.nnx`` models (or any params pytree), in a few lines.

:func:`make_train_step` puts a gradient sync (:class:`~jax_drain.GradSync`, or
:class:`~jax_drain.ScanGradSync` for a scanned layer stack) and
:class:`~jax_drain.DistributedOptimizer` together into one jitted ``shard_map`` step over a
mesh: the global batch is split over the data-parallel axes, each device accumulates its local
gradients over ``microbatches`` micro-batches (float32 by default), the buckets are
reduce-scattered once per step, the optimizer updates this device's shards and the new
parameters are all-gathered. The bucket order is the traced gradient-ready order
(:func:`jax_drain.grad_ready_order`): from ``example_batch``, or else from the first batch the
step is called with.

Example (``flax.nnx``, data parallel)::

    import optax, jax_drain as jd
    from jax_drain.models import GPT, GPTConfig

    model = GPT(GPTConfig(num_layers=2, d_model=128, num_heads=4, seq_len=64, vocab_size=96),
                rngs=nnx.Rngs(0))
    step = jd.make_train_step(model, lambda m, b: m.loss(b), optax.adam(1e-3), mesh,
                              jd.TrainConfig(bucket_size=200_000, microbatches=4),
                              example_batch=first_batch)
    state = step.init()
    for batch in batches:                 # global batches, e.g. numpy arrays
        state, metrics = step(state, batch)   # metrics.loss, .grad_norm, .skipped, .nonfinite_buckets
    step.update_model(model, state)       # copy the trained parameters back into the model

Every mesh :class:`~jax_drain.GradSync` supports: ``TrainConfig(axis=..., outer_axis=...,
param_specs=..., expert=..., expert_axis=...)`` mean what they mean there. ``loss_fn`` then runs
inside ``shard_map`` on local parameter blocks, so a tensor-parallel loss does its own ``psum``
over the model axis::

    mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
    specs = {"w_in": P(None, "model"), "w_out": P("model", None), "norm": None}

    def loss_fn(p, batch):                # p["w_in"]: [d, h / 2] on each model rank
        h = jax.nn.relu(batch["x"] @ p["w_in"])
        y = jax.lax.psum(h @ p["w_out"], "model")
        return jnp.mean((y * p["norm"] - batch["y"]) ** 2)

    step = jd.make_train_step(params, loss_fn, jd.adamw(1e-3, mask=decay_mask), mesh,
                              jd.TrainConfig(axis="data", outer_axis="replica", param_specs=specs))

A loss written for global shapes (GSPMD style: no collectives in the model, shardings declared on
the parameters) trains tensor parallel with ``TrainConfig(tensor_parallel="gspmd")``: the step's
``shard_map`` makes only the data axes manual and XLA partitions the model over the others. The
shardings are read from where they are declared when ``param_specs`` is not given (the
parameters' ``NamedSharding``, nnx ``Param`` metadata, linen logical partitioning with
``logical_axis_rules``; :mod:`jax_drain.shardings`), and then ``"gspmd"`` is the default::

    with jax.set_mesh(mesh):                   # nnx.with_partitioning(init, (None, "model")) in the model
        model = Transformer(config, rngs=nnx.Rngs(0))
    step = jd.make_train_step(model, loss_fn, tx, mesh, jd.TrainConfig(axis="data"))  # gspmd, specs read

Scanned layer stacks (``nnx.scan`` / ``jax.lax.scan`` over stacked block parameters): pass
``TrainConfig(scan_layers=True)`` and an ``example_batch``; a :class:`~jax_drain.ScanGradSync`
reduce-scatters each layer's gradient inside the backward scan. A stack written for GSPMD (its
stacked weights split over the model axis, e.g. ``P(None, None, "model")``, as MaxText lays out
its scanned decoder) does so with ``tensor_parallel="gspmd"``, each layer's chain on its local
blocks.

``flax.linen``: pass the variables ``module.init`` returns and the collections the loss updates,
as ``module.apply(..., mutable=[...])`` takes them; the loss returns ``(loss, updates)``. Only
``variables["params"]`` is trained; the other collections live in ``TrainState.model_state``::

    variables = module.init(jax.random.key(0), x, train=False)   # {"params", "batch_stats"}

    def loss_fn(variables, batch):
        logits, updates = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), updates

    step = jd.make_train_step(variables, loss_fn, optax.sgd(0.1, momentum=0.9), mesh,
                              mutable=["batch_stats"])
    state = step.init()
    ...
    logits = module.apply(step.variables(state), x, train=False)

The model's ``BatchNorm(axis_name=...)`` names the mesh's data axis (``TrainConfig(axis=...)``),
so that the statistics are those of the global batch. Without model state, a params pytree and
``loss_fn(params, batch)`` do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.core import unfreeze
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_drain import _compat, pipeline, zero3
from jax_drain._blocks import BlockStack, NotRerolled, find_block_stack, rerolled
from jax_drain._host_layout import host_to_params
from jax_drain.chain import ChainedSync, check_flag, check_microbatches
from jax_drain.collectives import check_float_dtype, check_wire_dtype
from jax_drain.feedback import (
    FEEDBACK_MODES, ErrorFeedback, abstract_error_feedback, check_error_feedback, error_feedback_specs,
    init_error_feedback,
)
from jax_drain.layout import check_bucket_size, check_leaves, leaf_paths
from jax_drain.losses import WeightedLoss, split_output
from jax_drain.mesh import (
    AxisSpec, ExpertSpec, as_axes, auto_mesh, axes_size, check_array_leaves, check_mesh, check_mesh_axes,
    check_ownership, check_tensor_parallel, leaf_specs, place_leaves,
)
from jax_drain.optimizer import (
    DistributedOptimizer, DistState, layout_mismatch, needs_whole_parameters, transform_check,
)
from jax_drain.ownership import check_per_parameter, per_parameter_check
from jax_drain.order import grad_ready_order, remat_groups
from jax_drain.scan import ScanGradSync, stacked_leaves
from jax_drain.shardings import declared_specs, has_boxes, shards_any, unboxed, without_manual_axes
from jax_drain.sync import GradSync

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How :func:`make_train_step` syncs, accumulates and updates.

    Attributes:
        axis, outer_axis, param_specs, expert, expert_axis: the mesh declarations, as for
            :class:`~jax_drain.GradSync`: the data-parallel axis (or axes) buckets are
            reduce-scattered over, the outer (HSDP) axes shards are then all-reduced over, the
            tensor/expert-parallel ``PartitionSpec`` of each parameter, and which parameters are
            experts with the axes their gradients are reduced over. The batch is split over
            ``outer_axis`` and ``axis``. Without ``param_specs`` the specs are read from where
            the model declares them (:func:`jax_drain.shardings.declared_specs`: the
            parameters' ``NamedSharding``, nnx ``Param`` sharding metadata, linen
            ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` boxes).
        tensor_parallel: ``"manual"``: the loss runs on local blocks and does its own ``psum``
            over the model axes (every mesh axis manual); ``"gspmd"``: the loss is written for
            global shapes and XLA partitions it over the non-data axes (only the data axes
            manual; see :class:`~jax_drain.GradSync`). ``None`` (default): ``"manual"`` when
            ``param_specs`` is given (the hand-written tensor-parallel loss it is for),
            ``"gspmd"`` when the specs are read from the model and shard something (code that
            declares shardings on its parameters is written for GSPMD), else ``"manual"``.
        logical_axis_rules: ``((logical name, mesh axis or axes or None), ...)``, mapping the
            logical axis names of ``nn.with_logical_partitioning`` (or of nnx metadata) to mesh
            axes, as for :func:`flax.linen.logical_to_mesh_axes`. Inside the step they are also the
            rules Flax's activation constraints (``nn.with_logical_constraint``) read, over any
            ``nn.logical_axis_rules`` context of the caller's.
        bucket_size, reduce, drain, max_in_flight, split_leaves, wire_dtype: passed to the sync.
        bucket_boundaries: ``"remat"``: no bucket holds parameters of two remat
            (``jax.checkpoint``) blocks of the loss (:func:`jax_drain.remat_groups`); a bucket
            closes early at each block's end, so each block's buckets are complete when its
            backward ends. ``None``: bucket sizes alone. ``"auto"`` (default): ``"remat"``
            unless whole-parameter ownership (whose buckets balance over the owners instead):
            at one bucket size the drained step's temp memory is lower with it (compile-only
            8xH100, ``gpt-blocks``: 432 against 468 MiB at 40M-element buckets, 160 against 198
            at 10M), and so is ZeRO-3's, whose rematerialised backward then gathers each bucket
            in one block only (464 against 516 at 40M, 250 against 296 at 10M; ``gpt-tied``
            504 against 632, 288 against 354). A loss without remat blocks has none to follow,
            and a scanned stack's layer buckets hold one layer each already.
        ownership: ``"element"``: each device updates a contiguous slice of every bucket (``tx``
            must be element-wise, :class:`~jax_drain.DistributedOptimizer`); ``"param"``: each
            device updates whole parameters (:mod:`jax_drain.ownership`: Muon, Adafactor, LAMB,
            LARS; ``tx`` must treat parameters independently). ``None`` (default): ``"param"``
            when ``tx`` needs whole parameters (it computes differently at their real shapes than
            on a shrunken copy, as Muon's orthogonalisation and Adafactor's factored moments do,
            or reduces over a parameter's own values, as LAMB's and LARS's trust ratios do;
            both read from ``tx`` traced abstractly) and the mesh has no tensor-parallel or
            expert leaves, else ``"element"``.
        param_dtype: a precision policy independent of the model's dtype (FSDP2's
            ``MixedPrecisionPolicy(param_dtype=...)``): the working parameters the loss runs on
            (and the all-gather carries) are cast to this dtype, e.g. ``jnp.bfloat16`` for a
            float32 Flax model, while the master shards stay float32 from the model's own
            values; gradients then travel in it too. ``None``: the model's dtypes.
        microbatches: local gradient accumulation steps per optimizer step; the per-device batch
            is split into this many equal micro-batches and the buckets are synced once.
        accum_dtype: dtype of the local gradient accumulator (``None``: the gradients' own dtype,
            e.g. bf16). The mean gradient is cast to the parameter dtype before the sync. Not
            used with ``scan_layers``: there the float32 shards are accumulated. With
            ``stage_axis`` it is also what each stage's gradient is summed in over the
            pipeline's micro-batches.
        scan_layers: ``True``: the model runs its blocks under a scan over stacked parameters;
            use a :class:`~jax_drain.ScanGradSync` (the stacked leaves are found by tracing the
            loss). With ``microbatches=k`` every micro-batch is reduce-scattered inside its own
            backward scan and the float32 shards are accumulated (see :mod:`jax_drain.scan`).
            ``None``: do so iff the loss scans over parameters. ``False``: whole leaves. With
            ``tensor_parallel="gspmd"`` each layer's buckets are reduced on their local blocks
            in the nested region manual over the model axes; with hand-written (``"manual"``)
            tensor parallel they hold each model rank's blocks. Not with expert params or several
            data axes (``None`` then keeps whole leaves).
        max_grad_norm: clip the gradient to this global norm before ``tx``
            (:class:`~jax_drain.DistributedOptimizer`'s ``max_grad_norm``): for a ``tx`` run per
            owner (``ownership="param"``), where a clip inside ``tx`` is refused. ``None``: none.
        gather_max_in_flight: the parameter all-gather chain depth
            (see :class:`~jax_drain.DistributedOptimizer`).
        donate: donate the input state's buffers to the step (the old state becomes unusable).
        skip_nonfinite: skip the update of a step whose gradient has a non-finite element on any
            device: parameters, optimizer state and step count stay as they were, bit for bit,
            inside the same jitted step (so donation stays on). On by default: one NaN in one
            device's batch would otherwise make every parameter NaN through the clip and the
            shared update, with the previous state already donated; the check costs one
            reduction per shard and a scalar all-reduce. ``StepMetrics.skipped`` reports it.
        skip_grad_norm_above: also skip when the global gradient norm exceeds this (Megatron's
            check for large gradients); ``None``: never.
        shard_params: ZeRO-3 (:mod:`jax_drain.zero3`): each device keeps only its shard of every
            parameter bucket (in the working dtype; ``TrainState.params`` is a
            :class:`~jax_drain.zero3.ParamShards`), and the forward gathers each bucket just
            before its first use, at most ``gather_max_in_flight`` ahead (as the optimizer
            resolves it: ``"sync"`` is the drain depth; ``None`` leaves the gathers unfenced); a
            scanned stack gathers each layer inside the scan body. Over the data axes and
            ``outer_axis``; on a tensor-parallel mesh (``"gspmd"`` or ``"manual"``) each device
            holds its shard of its own model blocks (1/(data x model) of the parameters),
            gathered over the data axes only; expert params over ``expert_axis``.
            Gradients equal ZeRO-1's (with error feedback and micro-batches, each micro-batch is
            sent with the residual its predecessor left).
        reshard_after_forward: with ``shard_params``, gather each bucket again in backward inside
            the model's remat (``jax.checkpoint``) regions instead of keeping it from forward.
        error_feedback: keep each device's wire rounding error and add it to its next gradient
            (:mod:`jax_drain.feedback`), so a quantized wire's error does not accumulate over
            steps. Needs a lossy wire (``reduce="int8_accum"``, ``"fp8_accum"``, ``"fp16_accum"``,
            ``"int8_accum_streamed"``, or ``fp32_accum`` with a narrower ``wire_dtype`` or bf16
            gradients). The residuals live in ``TrainState.error_feedback`` (one local gradient
            copy per device, with ``shard_params`` too) and stay unchanged on a skipped step.
        stage_axis, pipeline_microbatches, pipeline_schedule: pipeline parallelism
            (:mod:`jax_drain.pipeline`): the model's scanned layer stack (found in its traced loss,
            as ``scan_layers`` finds it) is split into equal stages along ``stage_axis``, each
            device holding its stage's layers, and runs as a pipeline of
            ``pipeline_microbatches`` micro-batches (``None``: twice the stages) in the
            ``pipeline_schedule``. ``"gpipe"``: every forward, then every backward; what runs
            before and after the stack runs data parallel over ``axis`` and ``stage_axis``
            together. ``"1f1b"`` (:func:`jax_drain.pipeline.one_f_one_b`): each micro-batch's
            backward starts as soon as its forward ends, the loss after the stack taken on the
            last stage per micro-batch (the mean of the micro-batches' means, as with
            ``microbatches``), so a stage holds at most ``stages`` micro-batches' inputs however
            many there are (Megatron's bound), a tick running one forward or one backward per
            stage; the loss must not update model state. ``"1f1b_lockstep"``: the same, a forward
            and a backward every tick on every stage: GPipe's time, about ``2/3`` of
            ``"1f1b"``'s, for up to ``2 * stages - 1`` inputs held. All sum the stage's
            gradients over the micro-batches in ``accum_dtype``. The batch is split over
            ``axis`` and ``stage_axis`` both. Each stage's layers are reduced over ``axis``
            only, in their own chain; the other parameters over both (where every parameter is
            in the stack, the smallest stacked leaf stays whole on every stage and is one of
            those). Needs ``example_batch`` (the loss is traced to find the stack). Tensor
            parallelism composes with it, hand-written (``param_specs``, the loss does its own
            ``psum`` over the model axes) or GSPMD (declared shardings or
            ``tensor_parallel="gspmd"``: the loss on global shapes, XLA partitions each stage's
            layers over the model axes); a stacked leaf's layer axis is left to the stage axis.
            With ``shard_params`` (ZeRO-3) each device holds its shard of its stage's layers.
            Per-layer model state the layers only read (running statistics in evaluation
            mode, dropout keys) goes with its layers. Split leaves and error feedback work per
            stage's chain. ``microbatches=k`` runs the pipeline ``k`` times per step, each on
            ``1 / k`` of the batch, its gradients summed. Not yet with ``expert``,
            ``scan_layers=True`` or ``ownership="param"``.

    Example::

        TrainConfig(bucket_size=10_000_000, reduce="fp32_accum", microbatches=4)
        TrainConfig(axis="data", stage_axis="stage", pipeline_microbatches=8, pipeline_schedule="1f1b")
        TrainConfig(axis="data", outer_axis="replica", param_specs={"w": P(None, "model")})
    """

    axis: AxisSpec = "data"
    bucket_size: int | None = 40_000_000
    reduce: str = "fp32_accum"
    drain: bool = True
    max_in_flight: int | None = None
    microbatches: int = 1
    accum_dtype: Any = jnp.float32
    gather_max_in_flight: int | str | None = "sync"
    max_grad_norm: float | None = None
    donate: bool = True
    scan_layers: bool | None = False
    outer_axis: AxisSpec = None
    param_specs: PyTree | None = None
    expert: ExpertSpec = None
    expert_axis: AxisSpec = None
    skip_nonfinite: bool = True
    skip_grad_norm_above: float | None = None
    split_leaves: bool = False
    param_dtype: Any = None
    wire_dtype: Any = None
    error_feedback: bool = False
    shard_params: bool = False
    reshard_after_forward: bool = True
    tensor_parallel: str | None = None
    logical_axis_rules: Any = None
    ownership: str | None = None
    bucket_boundaries: str | None = "auto"
    stage_axis: str | None = None
    pipeline_microbatches: int | None = None
    pipeline_schedule: str = "gpipe"

    def __post_init__(self) -> None:
        if self.bucket_boundaries not in ("auto", "remat", None):
            raise ValueError(f"bucket_boundaries must be 'auto', 'remat' or None, got {self.bucket_boundaries!r}")
        for name in ("skip_grad_norm_above", "max_grad_norm"):
            limit = getattr(self, name)
            if limit is not None and (isinstance(limit, bool) or not isinstance(
                    limit, (int, float, np.integer, np.floating)) or not limit > 0):
                raise ValueError(f"{name} must be a positive number or None, got {limit!r}")
        if isinstance(self.scan_layers, np.bool_):
            object.__setattr__(self, "scan_layers", bool(self.scan_layers))
        if not any(self.scan_layers is v for v in (True, False, None)):
            raise ValueError(f"scan_layers must be True, False or None (auto), got {self.scan_layers!r}")
        check_microbatches(self.microbatches)
        object.__setattr__(self, "bucket_size", check_bucket_size(self.bucket_size))
        for name in ("drain", "donate", "skip_nonfinite", "split_leaves", "error_feedback", "shard_params",
                     "reshard_after_forward"):
            check_flag(getattr(self, name), name)
        for name in ("param_dtype", "wire_dtype", "accum_dtype"):
            object.__setattr__(self, name, check_float_dtype(getattr(self, name), name))
        axes = as_axes(self.axis, "axis")
        outer = as_axes(self.outer_axis, "outer_axis", allow_empty=True)
        if set(axes) & set(outer):
            raise ValueError(f"outer_axis {self.outer_axis!r} repeats axis {self.axis!r}: the outer (replica) axes are "
                             "other mesh axes than the data axes, e.g. axis='data', outer_axis='replica'")
        check_wire_dtype(self.reduce, self.wire_dtype)
        if self.error_feedback and self.reduce not in FEEDBACK_MODES:
            raise ValueError(
                f"error_feedback=True needs a wire whose rounding happens on the sending device; "
                f"reduce={self.reduce!r} has none. Use one of {', '.join(FEEDBACK_MODES)} (e.g. 'int8_accum')"
            )
        if self.scan_layers is True:
            self.check_scannable()
        if self.tensor_parallel is not None:
            check_tensor_parallel(self.tensor_parallel)
        if self.ownership is not None:
            check_ownership(self.ownership)
            if self.ownership == "param" and (self.scan_layers is True or self.split_leaves):
                raise ValueError("ownership='param' hands each parameter whole to one device: not with a scanned "
                                 "stack's per-layer sync (scan_layers=True; use scan_layers=False) nor split_leaves=True")
        if self.logical_axis_rules is not None:
            rules = self.logical_axis_rules
            ok = isinstance(rules, (tuple, list)) and all(
                isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) for r in rules)
            if not ok:
                raise ValueError(f"logical_axis_rules must be ((logical name, mesh axis or None), ...), got {rules!r}")
            object.__setattr__(self, "logical_axis_rules", tuple((r[0], _axis_entry(r[1])) for r in rules))
        self._check_stage_axis(axes + outer)

    def _check_stage_axis(self, data_axes: tuple[str, ...]) -> None:
        if self.pipeline_schedule not in pipeline.SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {', '.join(pipeline.SCHEDULES)}, got "
                             f"{self.pipeline_schedule!r}")
        if self.stage_axis is None:
            if self.pipeline_microbatches is not None or self.pipeline_schedule != "gpipe":
                raise ValueError("pipeline_microbatches and pipeline_schedule set how a stage axis pipelines: give "
                                 "stage_axis too (e.g. stage_axis='stage')")
            return
        if not isinstance(self.stage_axis, str) or self.stage_axis in data_axes:
            raise ValueError(f"stage_axis must be one mesh axis name besides the data axes {data_axes}, got "
                             f"{self.stage_axis!r}")
        m = self.pipeline_microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"pipeline_microbatches must be a positive integer or None, got {m!r}")
        unsupported = [name for name, on in (
            ("expert", self.expert is not None), ("scan_layers=True", self.scan_layers is True),
            ("ownership='param'", self.ownership == "param"),
            ) if on]
        if unsupported:
            raise ValueError(f"stage_axis does not work with {', '.join(unsupported)} yet: leave "
                             f"{'it' if len(unsupported) == 1 else 'them'} out (pipeline_microbatches sets the "
                             "micro-batches a stage axis pipelines)")

    def check_scannable(self) -> None:
        """Raises unless a scanned stack can sync in its backward scan: ScanGradSync reduces over
        one data axis (and ``outer_axis``) and takes no expert params."""
        if self.expert is not None or not isinstance(self.axis, str):
            raise ValueError(
                "scan_layers=True syncs with ScanGradSync, which reduces over one data axis (and "
                "outer_axis) and does not support expert params yet: use scan_layers=None or False on such "
                "a mesh (whole-leaf buckets)"
            )

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: ``outer_axis`` then ``axis``."""
        return as_axes(self.outer_axis, "outer_axis", allow_empty=True) + as_axes(self.axis, "axis")


def _axis_entry(entry: Any) -> Any:
    return tuple(entry) if isinstance(entry, list) else entry


class TrainState(NamedTuple):
    """Everything a step reads and writes: parameters (replicated over the data axes, sharded by
    ``param_specs``; with ``TrainConfig(shard_params=True)`` a :class:`~jax_drain.zero3.ParamShards`
    of this device's bucket shards), sharded optimizer state, step count, and an nnx model's
    other state.

    ``opt_state`` is ``None`` from :meth:`TrainStep.init` only when the step was built without
    ``example_batch``: the first call traces the bucket order from its batch, then fills it in.
    ``model_state``: an nnx model's non-``nnx.Param`` state (batch statistics, RNG counters
    and keys, as raw key data), or a linen variables dict's collections other than ``params``
    (``{"batch_stats": ...}``), replicated and updated by every step that is not skipped (a
    skipped step keeps it bit for bit); ``None`` for a pytree.
    ``error_feedback``: each device's wire rounding residuals with
    ``TrainConfig(error_feedback=True)`` (:class:`~jax_drain.feedback.ErrorFeedback`), else ``None``.
    """

    params: PyTree
    opt_state: DistState | None
    step: jax.Array  # int32 scalar: optimizer steps taken (skipped steps do not count)
    model_state: PyTree = None
    error_feedback: ErrorFeedback | None = None


class StepMetrics(NamedTuple):
    """What one step reports (float32 / int32 / bool scalars, identical on every device).

    ``loss``: the mean loss over the global batch (the global per-count mean for a
    :class:`~jax_drain.WeightedLoss`); ``grad_norm``: the global gradient norm (an element
    replicated over a tensor-parallel or outer axis counted once); ``skipped``: the update was
    skipped (``TrainConfig.skip_nonfinite`` / ``skip_grad_norm_above``); ``nonfinite_buckets``:
    buckets whose gradient had a non-finite element.
    """

    loss: jax.Array
    grad_norm: jax.Array
    skipped: jax.Array
    nonfinite_buckets: jax.Array


def _own_mesh_context(mesh: Mesh) -> contextlib.AbstractContextManager:
    """``mesh`` as the context mesh, where the caller's is another one (e.g. ``jax.set_mesh`` of
    the ``Explicit`` mesh of which the step runs an ``Auto`` copy): jax refuses a ``shard_map``
    or a sharding whose mesh is not the context's."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context == mesh.abstract_mesh:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _on_own_mesh(method: Callable) -> Callable:
    """A :class:`TrainStep` method run with the step's mesh as the context mesh."""
    @functools.wraps(method)
    def wrapped(self: "TrainStep", *args: Any, **kwargs: Any) -> Any:
        with _own_mesh_context(self.mesh):
            return method(self, *args, **kwargs)

    return wrapped


class TrainStep:
    """The jitted step built by :func:`make_train_step`; call it as ``step(state, batch)``.

    Attributes: ``sync`` (:class:`~jax_drain.GradSync`, or :class:`~jax_drain.ScanGradSync` for
    a scanned model), ``optimizer`` (:class:`~jax_drain.DistributedOptimizer`), ``mesh``,
    ``config``. ``sync`` and ``optimizer`` exist once the bucket order is known: at
    construction with ``example_batch``, else after the first call.
    """

    def __init__(
        self,
        params: PyTree,
        loss: Callable[..., tuple[Any, PyTree]],
        model_state: PyTree,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: TrainConfig,
        example_batch: PyTree | None,
        model: nnx.Module | None,
        *,
        linen: bool = False,
        declared: PyTree | None = None,
    ):
        check_mesh(mesh)
        check_array_leaves(params)
        #: The stage axis, its micro-batches and schedule (``TrainConfig.stage_axis``); ``None``:
        #: no pipeline.
        self.stage_axis, self.pipeline_microbatches = config.stage_axis, None
        self.pipeline_schedule = None if config.stage_axis is None else config.pipeline_schedule
        # The specs: param_specs if given, else those the model declares; the mode from them.
        specs = config.param_specs if config.param_specs is not None else declared
        mode = config.tensor_parallel
        if mode is None:
            mode = "gspmd" if config.param_specs is None and shards_any(declared) else "manual"
        #: A list of identical blocks the stage axis stacked (the step holds the stacked tree,
        #: init and the model see their own); ``None`` otherwise.
        self._blocks: BlockStack | None = None
        own_params = params
        if config.stage_axis is not None:
            staged = _staged(config, loss, params, model_state, mesh, example_batch, specs=specs,
                             tensor_parallel=mode)
            config, loss, self.pipeline_microbatches = staged.config, staged.loss, staged.microbatches
            params, self._blocks, specs = staged.params, staged.blocks, staged.config.param_specs
        #: ``"manual"`` or ``"gspmd"`` (:attr:`TrainConfig.tensor_parallel`, resolved).
        self.tensor_parallel = mode
        if mode == "gspmd":
            mesh = auto_mesh(mesh)  # GSPMD partitions the loss over the Auto axes
        self._specs = specs
        self.mesh, self.config, self.tx = mesh, config, tx
        # loss(params, model_state, batch, device) -> (loss output, new model_state); `device`
        # (this device's index along the data axes, or None outside shard_map) keys the RNGs.
        self._loss, self._model_state = loss, model_state
        # init() reads the model's params when it is called (or the given pytree's); the step
        # itself only needs their shapes.
        self._model, self._source = model, (own_params if model is None else None)
        self._linen = linen  # model_state holds a linen variables dict's collections other than params
        self._model_params = _abstract(params)  # the model's own dtypes: the master shards' source
        _check_floating(self._model_params)
        self._abstract_params = _working(self._model_params, config.param_dtype)
        # What state.params must be (structure, leaf shapes), checked before every step.
        self._params_signature = (jax.tree.structure(self._abstract_params),
                                  [tuple(x.shape) for x in jax.tree.leaves(self._abstract_params)])
        check_mesh_axes(mesh, config.data_axes, "TrainConfig axis / outer_axis")
        if config.param_specs is not None:  # before any array is placed by them: the rules, by parameter
            place_leaves(self._abstract_params, mesh, as_axes(config.axis, "axis"),
                         as_axes(config.outer_axis, "outer_axis", allow_empty=True), config.param_specs,
                         config.expert, None if config.expert_axis is None else as_axes(config.expert_axis, "expert_axis"))
        #: ``"element"`` or ``"param"`` (:attr:`TrainConfig.ownership`, resolved).
        self.ownership = self._choose_ownership()
        self.data_size = axes_size(mesh, config.data_axes)
        self._batch_spec = P(config.data_axes[0] if len(config.data_axes) == 1 else config.data_axes)
        self._param_specs = jax.tree.unflatten(
            jax.tree.structure(self._abstract_params), leaf_specs(self._abstract_params, specs)
        )
        self.sync: ChainedSync | None = None
        self.optimizer: DistributedOptimizer | None = None
        self._jitted = None
        self._tx_check: _Background | None = None  # check_transform of tx, until the first step has run
        self._tx_signature: tuple | None = None  # _tx_state_signature of this tx's state, once asked for
        self._call_lock = threading.Lock()
        if example_batch is not None:
            with _own_mesh_context(self.mesh):
                self._build(example_batch)

    def __repr__(self) -> str:
        return f"TrainStep({self.config}, {self.sync!r}, {self.optimizer!r})"

    # -- public -----------------------------------------------------------------------------
    @property
    def scan_layers(self) -> bool:
        """True iff the step reduces a scanned layer stack inside its backward scan (a
        :class:`~jax_drain.ScanGradSync`; known once built)."""
        return self.sync is not None and any(chain.num_layers for chain in self.sync.chains)

    @property
    def _accum_dtype(self) -> Any:
        # A scanned stack accumulates its float32 shards, whatever the local accumulator's dtype.
        return jnp.float32 if self.scan_layers else self.config.accum_dtype

    @_on_own_mesh
    def init(self, params: PyTree | nnx.Module | None = None) -> TrainState:
        """A fresh state: the model's current (or the given) params placed on the mesh by their
        specs, optimizer state sharded. The caller's arrays are copied, never donated. A linen
        step (``mutable=``) takes a whole variables dict, whose other collections start the
        model state."""
        model_state = self._model_state
        if params is None:
            params = self._model if self._model is not None else self._source
        elif self._linen:
            if not isinstance(params, Mapping) or set(params) != {"params", *self._model_state}:
                raise ValueError(f"a linen step's init takes a variables dict with the collections "
                                 f"{['params', *self._model_state]}, like the one the step was built from")
            params, model_state = params["params"], {k: unfreeze(v) for k, v in params.items() if k != "params"}
            _check_like(model_state, _abstract(self._model_state), what="model state")
        if isinstance(params, nnx.Module):
            params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
        if self._blocks is not None:  # the model's own tree, as the step holds it
            params = self._blocks.stack(params)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            raise ValueError("init needs concrete parameters; this step was built from abstract ones")
        _check_like(params, self._model_params)
        if model_state is not None:
            model_state = _model_state(self._model) if self._model is not None else model_state
        if self.optimizer is None:  # built by the first call, which also casts the params
            source, step, model_state = self._placed_copies(params, model_state)
            return TrainState(source, None, step, model_state)
        with self._tx_explains():
            (params, opt_state), step, model_state = self._placed_copies(params, model_state, fresh=True)
        return TrainState(params, opt_state, step, model_state, self._init_error_feedback())

    def _placed_copies(self, params: PyTree, model_state: PyTree, *, fresh: bool = False) -> tuple[Any, jax.Array, Any]:
        """``(params, step 0, model_state)`` copied onto the mesh, in one compiled program; with
        ``fresh``, ``(working params, optimizer state)`` (:meth:`_fresh`) in place of ``params``.

        Copies, never aliases: the step donates its input state, which must not delete the
        caller's (or the nnx model's) arrays. (device_put may alias a device's buffer even with
        may_alias=False when it reshards; a jitted copy never does.) Placed by a ``shard_map``
        with the step's own specs, as the step places its outputs: the state gets the shardings
        the step returns (``P(None, None)``, not ``P()``), so its second call finds the compiled
        step instead of tracing and lowering it again for an equivalent sharding."""
        first, first_specs = (self._fresh, self._fresh_specs()) if fresh else (_copy, self._param_specs)

        def copies(params: PyTree, model_state: PyTree) -> tuple[Any, jax.Array, Any]:
            return first(params), jnp.zeros((), jnp.int32), _copy(model_state)

        placed = _compat.shard_map(copies, mesh=self.mesh, in_specs=(self._param_specs, P()),
                                   out_specs=(first_specs, P(), P()))
        # On an Explicit mesh shard_map checks each input's sharding against its spec, so the
        # sources go to their specs first (this may alias them; the jitted copy never does).
        on_mesh = lambda spec: NamedSharding(self.mesh, spec)
        params = jax.device_put(params, jax.tree.map(on_mesh, self._param_specs))
        model_state = jax.device_put(model_state, on_mesh(P()))
        return jax.jit(placed)(params, model_state)

    def _fresh(self, params: PyTree) -> tuple[PyTree, DistState]:
        """Inside ``shard_map``: the working parameters (cast to ``param_dtype``; with
        ``shard_params`` this device's bucket shards, a :class:`~jax_drain.zero3.ParamShards`) and
        this device's optimizer state, both from the model's own ``params`` (local blocks): the
        master shards never come from a narrower working copy."""
        working = _working(_copy(params), self.config.param_dtype)
        if self.config.shard_params:
            working = zero3.ParamShards(zero3.shard_params(self.sync, working), self.optimizer.layout)
        return working, self.optimizer.init(params)

    def _fresh_specs(self) -> tuple[PyTree, DistState]:
        """``shard_map`` specs of :meth:`_fresh`'s outputs: the step's own."""
        if self.config.shard_params:
            params = zero3.ParamShards(self.sync.shard_specs(), self.optimizer.layout)
        else:
            params = self.sync.param_specs
        return params, self.optimizer.state_specs()

    def _init_error_feedback(self) -> ErrorFeedback | None:
        return init_error_feedback(self.sync) if self.config.error_feedback else None

    @_on_own_mesh
    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, StepMetrics]:
        """One optimizer step on a global ``batch``; returns ``(new_state, metrics)``.

        With ``TrainConfig(donate=True)`` (the default) ``state`` is consumed: keep using the
        state this call returns. Calls from several threads run one at a time; a second call on
        a state that the first consumed is refused.
        """
        # Donation marks the state's buffers deleted when the step is dispatched: checked and
        # dispatched under one lock, a concurrent call on the same state sees them deleted
        # instead of racing the runtime for them.
        with self._call_lock:
            _check_not_consumed(state)
            if self.config.donate:
                _check_no_aliases(state)
            with self._tx_explains():
                state = self._ready(state, batch)
                batch = self.shard_batch(batch)
                if self._tx_check is not None:
                    # The first compile, on its own, while the tx check is prepared: the call
                    # below reuses it, and a refused tx raises before the state is donated.
                    lowered = self._jitted.lower(state, batch)
                    self._tx_check.start()  # its tracing beside XLA's compile, not the step's
                    lowered.compile()
            self._wait_tx_check()
            return self._jitted(state, batch)

    @_on_own_mesh
    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for arrays or ``jax.ShapeDtypeStruct``s (e.g. to inspect its HLO)."""
        with self._tx_explains():
            if self.optimizer is None:
                self._build(batch)
            if self._tx_check is not None:
                self._tx_check.start()
            self._check_state_fast(state)
            lowered = self._jitted.lower(state, self._check_batch(batch))
        self._wait_tx_check()
        return lowered

    def shard_batch(self, batch: PyTree) -> PyTree:
        """``batch`` (the global batch) placed on the mesh, split over the data axes (checks
        divisibility). In a multi-process run a host (numpy) batch is the global batch, the same
        on every process: each process places the rows its devices take from its own copy,
        without comparing the copies. For per-process rows use :meth:`local_batch`."""
        batch = self._check_batch(batch)
        sharding = NamedSharding(self.mesh, self._batch_spec)
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)

        def place(x):
            if isinstance(x, jax.Array):
                return jax.device_put(x, sharding)
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, batch)

    def local_batch(self, rows: PyTree) -> PyTree:
        """The global batch of a multi-process run from each process's own ``rows`` (every
        process calls it): their concatenation in process order (on a mesh whose data axes run
        over the processes in order, as ``jax.make_mesh`` lays them out), placed on the mesh; what
        ``step(state, ...)`` takes. Every process must pass as many rows, a multiple of its
        share of the data-parallel devices x micro-batches; a mismatch is refused on every
        process, naming the process and the shape expected.

        Example::

            rows = next(my_loader)                      # this host's rows, e.g. 8 of a 16-row batch
            state, metrics = step(state, step.local_batch(rows))
        """
        leaves = jax.tree.leaves(rows)
        if not leaves:
            raise ValueError("the batch has no arrays")
        counts = [int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            every = np.asarray(multihost_utils.process_allgather(np.array(counts, np.int64)))
        else:
            every = np.array([counts])
        first = every[0]
        for process, mine in enumerate(every):
            if not np.array_equal(mine, first) or len(set(mine.tolist())) > 1:
                raise ValueError(
                    f"local_batch: process {process} passed {mine.tolist()} rows (per leaf), process 0 "
                    f"{first.tolist()}: every process passes the same number of rows, {int(first[0])} in every "
                    "leaf (the global batch is their concatenation in process order)")
        global_rows = int(first[0]) * jax.process_count()
        self._check_batch(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((global_rows, *np.shape(x)[1:]), np.asarray(x).dtype), rows))
        sharding = NamedSharding(self.mesh, self._batch_spec)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), rows)

    @_on_own_mesh
    def abstract_state(self) -> TrainState:
        """The state as ``jax.ShapeDtypeStruct``s with shardings (a checkpoint restore target)."""
        if self.optimizer is None:
            raise ValueError(
                "the step's bucket layout is not known yet: pass example_batch= to make_train_step "
                "(or call the step once) before asking for its state layout"
            )
        if self.config.shard_params:
            params = zero3.ParamShards(self.sync.pack_shards([
                jax.ShapeDtypeStruct(chain.global_shard_shape(k), chain.layout.buckets[k].dtype,
                                     sharding=NamedSharding(self.mesh, chain.shard_spec))
                for chain, k in self.sync.flat_chains]), self.optimizer.layout)
        else:
            params = jax.tree.map(
                lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)),
                self._abstract_params, self._param_specs,
            )
        whole = NamedSharding(self.mesh, P())
        model_state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=whole), self._model_state)
        feedback = abstract_error_feedback(self.sync) if self.config.error_feedback else None
        with self._tx_explains():
            opt_state = self.optimizer.abstract_state()
        return TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=whole), model_state, feedback)

    @_on_own_mesh
    def update_model(self, model: nnx.Module, state: TrainState) -> None:
        """Writes ``state``'s parameters and other model state (batch statistics, RNG counters)
        into the nnx ``model`` (in place), as copies: later steps, which donate the state, leave
        the model usable.

        Example::

            step.update_model(model, state)
            logits = model(x)                     # evaluate; training may go on from `state`
        """
        if self._model is None:
            raise ValueError(
                "this step was built from a linen variables dict: use step.variables(state)" if self._linen else
                "this step was built from a params pytree, not an nnx model: use step.master_params(state)")
        if not isinstance(model, nnx.Module):
            raise TypeError(f"update_model writes into the nnx model the step was built from, got {type(model).__name__}")
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a TrainState (from step.init(), a step or a restore), got {type(state).__name__}")
        _check_not_consumed(state)  # before anything is written: a model half updated is worse than none
        param_state = nnx.state(model, nnx.Param)
        exact = self.config.param_dtype is None and not self.config.shard_params
        params = jax.jit(_copy)(state.params) if exact else self.master_params(state)
        if exact and self._blocks is not None:  # master_params gives the model's own tree already
            params = self._blocks.unstack(params)
        nnx.replace_by_pure_dict(param_state, params)
        nnx.update(model, param_state)
        if state.model_state is not None:
            *_, other = nnx.split(model, nnx.Param, nnx.RngKey, ...)
            nnx.replace_by_pure_dict(other, jax.jit(_copy)(state.model_state[1]))
            nnx.update(model, other)

    @_on_own_mesh
    def variables(self, state: TrainState) -> dict[str, PyTree]:
        """A linen step's trained variables as host arrays, for ``module.apply``: ``{"params":
        ..., **other collections}``, the params at master precision (:meth:`master_params`).

        Example::

            variables = step.variables(state)
            logits = module.apply(variables, x, train=False)
        """
        if not self._linen:
            raise ValueError(
                "variables() is for a step built from linen variables (make_train_step(..., mutable=[...])); "
                + ("use step.update_model(model, state)" if self._model is not None else
                   "use step.master_params(state)"))
        params = self.master_params(state)
        return {"params": params, **jax.tree.map(np.asarray, jax.device_get(state.model_state))}

    @_on_own_mesh
    def master_params(self, state: TrainState) -> PyTree:
        """The float32 master weights as a params-shaped tree of host arrays (global shapes), in
        the model's own dtypes: what a ``param_dtype`` policy trains, at full precision. In a
        multi-process run every process calls it and gets the whole tree (the shards other
        processes hold are gathered)."""
        if not isinstance(state, TrainState):
            raise TypeError(f"master_params takes the TrainState from step.init(), a step or a restore, got "
                            f"{type(state).__name__}")
        _check_not_consumed(state)
        if state.opt_state is None:  # not stepped yet (built without example_batch): the model's own
            params = jax.tree.map(_whole_on_host, state.params)
        else:
            description = json.loads(state.opt_state.layout.description)
            by_path = host_to_params(description, [_whole_on_host(m) for m in state.opt_state.master])
            params = jax.tree.unflatten(jax.tree.structure(self._model_params), [
                by_path[path].astype(x.dtype) for path, x in zip(leaf_paths(self._model_params),
                                                                   jax.tree.leaves(self._model_params))
            ])
        return params if self._blocks is None else self._blocks.unstack(params)

    # -- construction -----------------------------------------------------------------------
    def _build(self, batch: PyTree) -> None:
        """The sync, optimizer and jitted step, with the bucket order traced on ``batch``."""
        batch = self._check_batch(batch)
        # tx's check is prepared on a thread once the first step is traced: its tracing and
        # compiles overlap XLA's compile of the step (the traces would contend for the
        # interpreter); it runs when the first step waits for it, and at once where an error
        # raised before then needs its explanation.
        check = per_parameter_check if self.ownership == "param" else self._element_wise_check
        self._tx_check = _Background(check, self.tx, self._abstract_params)
        try:
            self._build_checked(batch)
        except BaseException:
            # A refused build leaves no thread running on: the caller may go on using JAX. The
            # check's own verdict, if any, is still raised first by _tx_explains.
            self._tx_check.join()
            raise

    def _choose_ownership(self) -> str:
        """``TrainConfig.ownership``, resolved (see there)."""
        config = self.config
        owned_possible = (config.expert is None and not shards_any(self._specs) and not config.split_leaves
                          and config.scan_layers is not True)
        if config.ownership == "param" and not owned_possible:
            raise ValueError("ownership='param' hands each parameter whole to one device along the data axes: not "
                             "with tensor-parallel or expert params (no device holds them whole); use "
                             "ownership='element'")
        if config.ownership is not None:
            return config.ownership
        # The probe traces tx.update on the whole tree: only asked where its answer can matter.
        whole = owned_possible and needs_whole_parameters(self.tx, self._abstract_params)
        return "param" if whole else "element"

    def _element_wise_check(self, tx: optax.GradientTransformation, params: PyTree) -> Callable[[], None]:
        """:func:`transform_check`; when it refuses ``tx`` and the ownership was left to the
        step, the error says whether whole-parameter ownership would run it."""
        try:
            verdict, refused_early = transform_check(tx, params, stacking=self._blocks), None
        except ValueError as refused:
            verdict, refused_early = None, refused

        def finish() -> None:
            try:
                if refused_early is not None:
                    raise refused_early
                verdict()
            except ValueError as refused:
                if self.config.ownership is not None:
                    raise
                try:
                    check_per_parameter(tx, params)
                except ValueError:
                    raise refused from None
                raise ValueError(f"{refused}\n\ntx does treat parameters independently: TrainConfig(ownership='param') "
                                 "runs it on whole parameters, each on the device that owns it") from None

        return finish

    def _build_checked(self, batch: PyTree) -> None:
        """:meth:`_build`'s work, while the tx check runs."""
        config, mesh = self.config, self.mesh
        k = config.microbatches
        global_micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // k, *np.shape(x)[1:]), x.dtype),
                                    batch)
        gspmd = self.tensor_parallel == "gspmd"
        try:
            order = grad_ready_order(self._scalar_loss(in_shard_map=True), self._abstract_params, global_micro,
                                     mesh=mesh, in_specs=(self._param_specs, self._batch_spec),
                                     axis_names=config.data_axes if gspmd else None)
        except Exception as error:
            self._explain_local_blocks(error, global_micro)
            raise
        options = dict(
            axis=config.axis, bucket_size=config.bucket_size, reduce=config.reduce, drain=config.drain,
            max_in_flight=config.max_in_flight, order=order, outer_axis=config.outer_axis,
            split_leaves=config.split_leaves, wire_dtype=config.wire_dtype,
        )
        stacked = None if self.ownership == "param" else self._find_stacked(global_micro)
        groups = None
        boundaries = config.bucket_boundaries
        if boundaries == "auto":
            boundaries = None if self.ownership == "param" else "remat"
        if stacked is None and boundaries == "remat":
            groups = remat_groups(self._scalar_loss(in_shard_map=True), self._abstract_params, global_micro,
                                  mesh=mesh, in_specs=(self._param_specs, self._batch_spec),
                                  axis_names=config.data_axes if gspmd else None)
        if stacked is not None:
            sync: ChainedSync = ScanGradSync(self._abstract_params, mesh, stacked=stacked,
                                             param_specs=self._specs,
                                             tensor_parallel=self.tensor_parallel, **options)
        else:
            sync = GradSync(self._abstract_params, mesh, param_specs=self._specs, expert=config.expert,
                            expert_axis=config.expert_axis, tensor_parallel=self.tensor_parallel,
                            ownership=self.ownership, bucket_groups=groups, **options)
        if config.error_feedback:
            check_error_feedback(sync)
        optimizer = DistributedOptimizer(self.tx, sync, gather_max_in_flight=config.gather_max_in_flight,
                                         max_grad_norm=config.max_grad_norm, stacking=self._blocks,
                                         check_tx=False)  # checked on the thread above
        with self._tx_explains():  # the state's layout evaluates tx.init on flat shards
            specs = optimizer.state_specs()
        feedback = error_feedback_specs(sync) if config.error_feedback else None
        if config.shard_params:
            zero3.check_shardable(sync)
            param_specs = zero3.ParamShards(sync.shard_specs(), optimizer.layout)
        else:
            param_specs = sync.param_specs
        # Every mesh axis manual, or (gspmd) the data axes only: the loss on global shapes.
        sharded = sync.shard_map(
            self._sharded_step,
            in_specs=(param_specs, specs, P(), feedback, sync.batch_spec),
            out_specs=(param_specs, specs, P(), feedback, P()),
        )
        shardings = lambda spec_tree: jax.tree.map(lambda spec: NamedSharding(mesh, spec), spec_tree,
                                                   is_leaf=lambda x: isinstance(x, P))

        def step(state: TrainState, batch: PyTree) -> tuple[TrainState, StepMetrics]:
            params, opt_state, model_state, feedback, metrics = sharded(
                state.params, state.opt_state, state.model_state, state.error_feedback, batch)
            if gspmd:  # the data-parallel region's outputs are sharded over the model axes by XLA: say how
                params = jax.lax.with_sharding_constraint(params, shardings(param_specs))
                opt_state = jax.lax.with_sharding_constraint(opt_state, shardings(specs))
            count = state.step + jnp.where(metrics.skipped, 0, 1).astype(jnp.int32)
            return TrainState(params, opt_state, count, model_state, feedback), metrics

        self.sync, self.optimizer = sync, optimizer
        self._jitted = jax.jit(step, donate_argnums=(0,) if config.donate else ())

    def _find_stacked(self, global_micro: PyTree) -> PyTree | None:
        """The stacked-leaf mask for a ScanGradSync, or ``None`` for a GradSync (config.scan_layers)."""
        if jax.sharding.get_abstract_mesh().empty:
            # The loss is traced outside shard_map here: under the step's mesh, which the model's
            # activation constraints are written against (a bare PartitionSpec needs a context mesh).
            with jax.set_mesh(self.mesh):
                return self._find_stacked(global_micro)
        wanted = self.config.scan_layers
        if wanted is False:
            return None
        if wanted is None:
            try:
                self.config.check_scannable()
            except ValueError:  # whole-leaf buckets: a scanned stack still syncs correctly
                return None
        else:
            self.config.check_scannable()  # the mode is known only now
        local_micro = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.data_size, *x.shape[1:]), x.dtype), global_micro)
        loss, params = self._with_bound_axes(self._scalar_loss(in_shard_map=False)), self._loss_view()
        if params is self._abstract_params:
            mask = stacked_leaves(loss, params, local_micro)
        else:  # hand-written tensor parallel: its model-axis collectives run at size 1 here
            try:
                mask = stacked_leaves(loss, params, local_micro)
            except Exception as e:  # noqa: BLE001 - any tracing failure
                if wanted is None:
                    return None  # a loss whose collectives need their real axis sizes: whole-leaf buckets
                raise ValueError(
                    f"scan_layers=True: could not trace the loss on its local blocks, with the model axes bound at "
                    f"size 1, to find its scanned parameters ({type(e).__name__}: {e}); use scan_layers=False") from e
        if not any(jax.tree.leaves(mask)):
            if wanted is None:
                return None
            raise ValueError(
                "TrainConfig(scan_layers=True), but the loss runs no jax.lax.scan / nnx.scan over "
                "parameters (for jax_drain.models.GPT: GPTConfig(scan_layers=True)); use "
                "scan_layers=False for an unrolled model"
            )
        return mask

    def _loss_view(self) -> PyTree:
        """The abstract parameters as the loss sees them: whole, or with hand-written tensor
        parallel each device's blocks."""
        if self.tensor_parallel == "gspmd" or not shards_any(self._specs):
            return self._abstract_params
        config = self.config
        placements = place_leaves(self._abstract_params, self.mesh, as_axes(config.axis, "axis"),
                                  as_axes(config.outer_axis, "outer_axis", allow_empty=True), self._specs)
        return jax.tree.unflatten(jax.tree.structure(self._abstract_params),
                                  [jax.ShapeDtypeStruct(pl.local_shape, pl.dtype) for pl in placements])

    def _with_bound_axes(self, loss: Callable[[PyTree, PyTree], jax.Array]) -> Callable[[PyTree, PyTree], jax.Array]:
        """``loss`` traced outside ``shard_map`` with the names of the axes it runs manual over
        bound (:func:`_bound_axes`): the data axes (``BatchNorm(axis_name="data")``) and, with
        hand-written tensor parallel, every mesh axis."""
        axes = self.config.data_axes
        if self.tensor_parallel != "gspmd":
            axes = axes + tuple(a for a in self.mesh.axis_names if a not in axes)
        return _bound_axes(loss, axes)

    def _ready(self, state: Any, batch: PyTree) -> TrainState:
        if self.optimizer is None:
            self._build(batch)
        if isinstance(state, TrainState) and state.opt_state is None:
            # The master shards come from the model's own values, not from a narrower working copy.
            fresh = _compat.shard_map(self._fresh, mesh=self.mesh, in_specs=(self.sync.param_specs,),
                                      out_specs=self._fresh_specs())
            params, opt_state = jax.jit(fresh)(state.params)
            state = state._replace(params=params, opt_state=opt_state, error_feedback=self._init_error_feedback())
        self._check_state_fast(state)
        return state

    def _wait_tx_check(self) -> None:
        """Waits for the tx check; raises its error (at every call, once it has failed)."""
        if self._tx_check is not None:
            self._tx_check.wait()
            self._tx_check = None

    @contextlib.contextmanager
    def _tx_explains(self) -> Iterator[None]:
        """An error raised while the tx check is still pending (tracing ``tx.init`` or
        ``tx.update`` on flat shards, say) gives way to the check's own error, which says what
        to use instead; chained to it."""
        try:
            yield
        except Exception as error:
            if self._tx_check is not None:
                try:
                    self._tx_check.wait()
                except ValueError as refused:
                    raise refused from error
            raise

    # -- inside shard_map -------------------------------------------------------------------
    def _scalar_loss(self, in_shard_map: bool) -> Callable[[PyTree, PyTree], jax.Array]:
        """``loss(params, batch)`` as a scalar, for tracing the bucket order and the layer scan."""

        def scalar(p: PyTree, b: PyTree) -> jax.Array:
            device = jax.lax.axis_index(self.config.data_axes) if in_shard_map else None
            out, _ = self._loss(p, self._model_state, b, device)
            return split_output(out, has_aux=False, has_state=False).total

        return scalar

    def _sharded_step(
        self, params: PyTree, opt_state: DistState, model_state: PyTree, feedback: ErrorFeedback | None, batch: PyTree,
    ):
        config = self.config
        device = jax.lax.axis_index(self.sync.data_axes)
        loss_fn = lambda p, state, b: self._loss(p, state, b, device)
        old_model_state = model_state
        if config.shard_params:
            grad_fn = zero3.value_and_grad(self.sync, loss_fn, gather_max_in_flight=self.optimizer.gather_max_in_flight,
                                           has_state=True,
                                           reshard_after_forward=config.reshard_after_forward,
                                           microbatches=config.microbatches, error_feedback=feedback is not None)
            if feedback is None:
                (loss, model_state), shards = grad_fn(params.shards, model_state, batch)
            else:
                (loss, model_state), shards, residuals = grad_fn(params.shards, feedback.residuals, model_state, batch)
        else:
            grad_fn = self.sync.value_and_grad(loss_fn, microbatches=config.microbatches, accum_dtype=self._accum_dtype,
                                               has_state=True, error_feedback=feedback is not None)
            if feedback is None:
                (loss, model_state), shards = grad_fn(params, model_state, batch)
            else:
                (loss, model_state), shards, residuals = grad_fn(params, feedback.residuals, model_state, batch)
        new_params, opt_state, report = self.optimizer.update_and_report(
            shards, opt_state, skip_nonfinite=config.skip_nonfinite, skip_grad_norm_above=config.skip_grad_norm_above,
            gather=not config.shard_params)
        params = zero3.ParamShards(new_params, params.layout) if config.shard_params else new_params
        keep = lambda old, new: jnp.where(report.skipped, old, new)
        # A skipped step's batch must leave no trace: its NaN would stay in the running statistics.
        model_state = jax.tree.map(keep, old_model_state, model_state)
        if feedback is not None:
            # A skipped step sent nothing that counts: its rounding must not be fed back either.
            feedback = ErrorFeedback(jax.tree.map(keep, feedback.residuals, residuals), feedback.fingerprint)
        metrics = StepMetrics(loss, report.grad_norm, report.skipped, report.nonfinite_buckets)
        return params, opt_state, model_state, feedback, metrics

    # -- checks -----------------------------------------------------------------------------
    def _explain_local_blocks(self, error: Exception, batch: PyTree) -> None:
        """Raises a ``ValueError`` that names ``tensor_parallel='gspmd'`` when the loss failed
        on local blocks (``"manual"``, chosen by default from ``param_specs``) but runs on the
        global shapes: a model written for GSPMD (pjit), whose own error (a shape mismatch deep
        in Flax or ``dot_general``) would not say so."""
        if self.tensor_parallel != "manual" or self.config.tensor_parallel is not None or not shards_any(self._specs):
            return
        try:
            jax.eval_shape(self._scalar_loss(in_shard_map=False), self._abstract_params, batch)
        except Exception:  # noqa: BLE001 - fails on global shapes too: the loss's own error stands
            return
        raise ValueError(
            "the loss fails on local blocks but runs on the parameters' global shapes: it is written for GSPMD "
            "(pjit), not for tensor_parallel='manual', which param_specs selects by default (each device's loss "
            "sees its own slice of every sharded parameter and does its own psum). Give "
            "TrainConfig(tensor_parallel='gspmd', param_specs=...), and XLA partitions the loss over the model "
            f"axes. The loss's error on local blocks: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        ) from error

    def _check_batch(self, batch: PyTree) -> PyTree:
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("the batch has no arrays")
        need = self.data_size * self.config.microbatches
        for path, x in zip(leaf_paths(batch), leaves):
            shape = np.shape(x)
            if isinstance(x, (bool, int, float, complex)):
                parts = path.split("/")
                while parts and parts[-1].isdigit():
                    parts.pop()
                container = "/".join(parts) or "the batch"
                raise ValueError(
                    f"batch leaf {path!r} is a Python number: JAX takes a list or tuple as a pytree, so a list "
                    f"of numbers is a tree of scalar leaves, not an array. Pass arrays: np.asarray of {container!r} "
                    f"(a list of rows becomes one [batch, ...] array)")
            if not shape or shape[0] % need:
                raise ValueError(
                    f"batch leaf {path!r} has shape {shape}: its leading (example) dimension must "
                    f"split over the {self.data_size} data-parallel devices ({self.config.data_axes}) "
                    f"x {self.config.microbatches} micro-batches; use a global batch size that is a "
                    f"multiple of {need}"
                )
        if len({np.shape(x)[0] for x in leaves}) > 1:
            raise ValueError(f"batch leaves disagree on the batch size: {[np.shape(x)[0] for x in leaves]}")
        return batch

    def _check_state_fast(self, state: Any) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"expected the TrainState from step.init() or a restore, got {type(state).__name__}")
        opt_state = state.opt_state
        if not isinstance(opt_state, DistState):
            raise TypeError(f"state.opt_state must be a DistState, got {type(opt_state).__name__}")
        if opt_state.fingerprint != self.optimizer.fingerprint:
            raise ValueError(layout_mismatch(opt_state.fingerprint, self.optimizer.fingerprint))
        self._check_tx_state(opt_state.inner)
        if self.config.shard_params != isinstance(state.params, zero3.ParamShards):
            raise ValueError(
                f"this step was built with TrainConfig(shard_params={self.config.shard_params}) but the state's "
                f"params are {'replicated' if self.config.shard_params else 'ZeRO-3 shards'}; restore the checkpoint "
                "into step.abstract_state(), which converts between the two"
            )
        if not self.config.shard_params:
            self._check_state_params(state.params)
        feedback = state.error_feedback
        if self.config.error_feedback != (feedback is not None):
            raise ValueError(
                f"this step was built with TrainConfig(error_feedback={self.config.error_feedback}) but the "
                f"state {'has no' if feedback is None else 'has'} error-feedback residuals; use step.init() or "
                "restore a checkpoint into step.abstract_state() (residuals missing there start from zero)"
            )
        if feedback is not None and feedback.fingerprint != self.sync.fingerprint:
            raise ValueError("the state's error-feedback residuals belong to another bucket layout; "
                             "restore it through jd.restore_checkpoint(dir, step.abstract_state()), which resets them")

    def _check_state_params(self, params: PyTree) -> None:
        """Refuses params of another structure or shape than this step's model: the loss would
        fail deep inside with a shape error that names no parameter."""
        want_def, expected = self._params_signature
        leaves, treedef = jax.tree.flatten(params)
        if treedef != want_def:
            raise ValueError(
                f"state.params has {len(leaves)} leaves in another structure than this step's model "
                f"({len(expected)} leaves): use this step's init(), or restore into step.abstract_state()")
        shapes = [np.shape(x) for x in leaves]
        if shapes != expected:  # the paths only for the error: this runs before every step
            path, got, shape = next((p, g, e) for p, g, e in zip(leaf_paths(self._abstract_params), shapes, expected)
                                    if g != e)
            raise ValueError(
                f"state.params leaf {path!r} has shape {got}, but this step's model has {shape}: the state "
                "belongs to another model (or was edited). Use this step's init(), or restore a checkpoint into "
                "step.abstract_state()")

    def _check_tx_state(self, inner: PyTree) -> None:
        """Refuses a tx state made by another optimizer (another ``tx``): its structure or shapes
        differ from what this step's ``tx`` keeps."""
        if self._tx_signature is None:
            with self._tx_explains():
                self._tx_signature = _tx_state_signature(self.optimizer.abstract_state().inner)
        (want_def, want_shapes), (got_def, got_shapes) = self._tx_signature, _tx_state_signature(inner)
        if got_def != want_def or got_shapes != want_shapes:
            shown = lambda d: (str(d)[:160] + "...") if len(str(d)) > 160 else str(d)
            raise ValueError(
                f"state.opt_state was made by another optimizer: its tx state is {shown(got_def)} but this step's "
                f"tx keeps {shown(want_def)}. Use this step's init(), or restore a checkpoint saved with the same "
                "tx into step.abstract_state()")


def _tx_state_signature(inner: PyTree) -> tuple:
    """What identifies the optimizer a tx state belongs to: its tree structure and leaf shapes."""
    return jax.tree.structure(inner), tuple(np.shape(x) for x in jax.tree.leaves(inner))


def _check_floating(params: PyTree) -> None:
    """Refuses integer and boolean leaves among the trained params: they have no gradient."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(
                f"params leaf {jax.tree_util.keystr(path)} has dtype {leaf.dtype}: only floating-point "
                "parameters are trained (an integer or boolean leaf has no gradient). Keep counters, "
                "indices and masks out of the params: in the batch, in a closure, or as nnx non-Param state")


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _working(tree: PyTree, dtype: Any) -> PyTree:
    """``tree`` with its floating leaves in ``dtype`` (``None``: unchanged); arrays are cast,
    ``jax.ShapeDtypeStruct`` s retyped."""
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)

    return jax.tree.map(cast, tree)


def _check_like(tree: PyTree, abstract: PyTree, what: str = "params") -> None:
    expected = [(path, tuple(x.shape), np.dtype(x.dtype)) for path, x in zip(leaf_paths(abstract), jax.tree.leaves(abstract))]
    check_leaves(tree, jax.tree.structure(abstract), expected, what, f"the {what} the step was built with")


def _copy(tree: PyTree) -> PyTree:
    """``tree``'s arrays copied (jit it): new buffers, which no donation of the state can delete."""
    return jax.tree.map(jnp.copy, tree)


def global_batch_shape(rows: PyTree) -> PyTree:
    """The global batch's shapes from this process's own ``rows``: every leaf as a
    ``jax.ShapeDtypeStruct`` whose leading (example) dimension is ``rows``' times the number of
    processes. What ``make_train_step(..., example_batch=...)`` takes in a multi-process run
    whose processes each read their own rows (then fed as ``step.local_batch(rows)``); in one
    process, the rows' own shapes.

    Example::

        rows = next(my_loader)   # this process's rows
        step = jd.make_train_step(model, loss_fn, tx, mesh, example_batch=jd.global_batch_shape(rows))
        state, metrics = step(step.init(), step.local_batch(rows))
    """
    leaves = jax.tree.leaves(rows)
    if not leaves or any(np.ndim(x) == 0 or not hasattr(x, "dtype") for x in leaves):
        raise ValueError("global_batch_shape: rows must be a pytree of arrays with a leading (example) dimension, got "
                         f"{jax.tree.map(np.shape, rows)}")
    processes = jax.process_count()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] * processes, *np.shape(x)[1:]), x.dtype), rows)


def _staged(config: TrainConfig, loss: Callable[..., tuple[Any, PyTree]], params: PyTree, model_state: PyTree,
            mesh: Mesh, example_batch: PyTree | None, *, specs: PyTree | None,
            tensor_parallel: str) -> "_StageLayout":
    """A stage axis as the layout the rest of the step already runs: the config with the stage
    axis among the data axes, the stacked leaves split over it along their layer axis and
    reduced over the data axes alone (an expert-style chain), the loss with its layer scan piped
    (:func:`jax_drain.pipeline.pipelined`); and the micro-batches. ``specs``: the parameters'
    tensor-parallel specs (given or declared), ``tensor_parallel`` the resolved mode: the stage
    axis is manual in both, so with ``"gspmd"`` XLA partitions each stage's layers over the
    model axes. A list of identical blocks is stacked first (the step then holds the stacked
    tree; the model's own is the stack's ``jax_drain._blocks.BlockStack.unstack``)."""
    stage = config.stage_axis
    if example_batch is None:
        raise ValueError("stage_axis: give make_train_step an example_batch, so that the loss is traced to find the "
                         "layer stack the stages split")
    check_mesh_axes(mesh, config.data_axes + (stage,), "TrainConfig axis / outer_axis / stage_axis")
    stages = int(mesh.shape[stage])
    data_axes = config.data_axes + (stage,)
    devices = axes_size(mesh, data_axes)
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else 0 for x in jax.tree.leaves(example_batch)}
    if len(sizes) != 1 or min(sizes) == 0 or min(sizes) % (devices * config.microbatches):
        raise ValueError(f"stage_axis: the batch's leading dimensions {sorted(sizes)} must be one size that splits over "
                         f"the {devices} devices of {data_axes}"
                         + (f" x {config.microbatches} micro-batches (microbatches)" if config.microbatches > 1 else ""))
    rows = sizes.pop() // devices // config.microbatches  # what each accumulation step pipes
    microbatches = config.pipeline_microbatches or 2 * stages
    if (stages * rows) % microbatches:
        raise ValueError(f"stage_axis: {microbatches} micro-batches (pipeline_microbatches) do not divide the "
                         f"{stages * rows} rows a stage axis pipes ({stages} stages x {rows} rows each); pick a "
                         f"divisor of {stages * rows}")
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)[1:]), x.dtype), example_batch)
    # Traced with the model's other state as an input too: per-layer state is scanned with the layers.
    scalar = lambda ps, b: split_output(loss(ps[0], ps[1], b, None)[0], has_aux=False, has_state=False).total  # noqa: E731
    try:
        # Every mesh axis bound, as a loss on local blocks sees them.
        bound = data_axes + tuple(a for a in mesh.axis_names if a not in data_axes)
        mask, state_mask = stacked_leaves(_bound_axes(scalar, bound), (_abstract(params), _abstract(model_state)),
                                          local)
    except Exception as e:
        raise ValueError(f"stage_axis: could not trace the loss to find its layer stack: {type(e).__name__}: {e}") from e
    stacked = [path for path, m in zip(leaf_paths(params), jax.tree.leaves(mask)) if m]
    blocks = None
    if not stacked:
        # A list of identical blocks, run one after another: stacked, and the loss rerolled into a scan of them.
        neither = ("stage_axis splits a layer stack: a scanned one (nnx.scan, nn.scan or jax.lax.scan over stacked "
                   "parameters) or a list of identical blocks the loss runs one after another, each reading its own "
                   "parameters and the block before it; the loss has neither")
        try:
            blocks = find_block_stack(lambda p, st, b: _bound_axes(scalar, bound)((p, st), b), _abstract(params),
                                      _abstract(model_state), local)
        except NotRerolled as e:
            raise ValueError(f"{neither}: its largest group of identical blocks, {e}") from None
        except Exception as e:
            raise ValueError(f"stage_axis: could not trace the loss to find its blocks: {type(e).__name__}: {e}") from e
        if blocks is None:
            raise ValueError(f"{neither} (no two of its parameter subtrees are alike)")
        params, specs = blocks.stack(_abstract(params)), _stacked_specs(blocks, specs, params)
        loss = rerolled(loss, blocks)
        # The rerolled loss scans the stacked blocks' leaves and nothing else (no per-block state).
        mask = blocks.stack(jax.tree.map(lambda _: False, blocks.unstack(params)), combine=lambda *_: True)
        state_mask = jax.tree.map(lambda _: False, model_state)
    split = _split_over_stages(params, mask)
    layers = sorted({int(np.shape(x)[0]) for x, m in zip(jax.tree.leaves((params, model_state)),
                                                          jax.tree.leaves((mask, state_mask))) if m})
    if len(layers) != 1 or layers[0] % stages:
        raise ValueError(f"stage_axis: the stack has {' or '.join(map(str, layers))} layers, which {stages} stages do "
                         f"not split equally (the stacked leaves: {stacked[:3]}{'...' if len(stacked) > 3 else ''})")
    axis = as_axes(config.axis, "axis")
    derived = dataclasses.replace(
        config, axis=axis + (stage,), expert=split, expert_axis=axis if len(axis) > 1 else axis[0],
        param_specs=_stage_specs(split, specs, params, stage), tensor_parallel=tensor_parallel,
        scan_layers=False, stage_axis=None, pipeline_microbatches=None, pipeline_schedule="gpipe")
    per_layer = [path for path, m in zip(leaf_paths(model_state), jax.tree.leaves(state_mask)) if m]

    def piped_fn(p: PyTree, state: PyTree, b: PyTree, device: Any) -> tuple[Any, PyTree]:
        # Each stage reads its own layers' share of the per-layer model state (running
        # statistics, RNG counters); the state stays whole on every device.
        local = jax.tree.map(lambda x, m: _stage_rows(x, stage) if m else x, state, state_mask)
        # A stacked leaf kept whole on every stage: each stage reads its own rows; the sum of the
        # stages' gradients (its chain's, over the stage axis too) puts each row's in place.
        p = jax.tree.map(lambda x, m, mine: _stage_rows(x, stage) if m and not mine else x, p, mask, split)
        out, new = pipeline.pipelined(lambda ps, b_: loss(ps[0], ps[1], b_, device), (mask, state_mask), axis=stage,
                                      microbatches=microbatches, schedule=config.pipeline_schedule,
                                      has_state=True, accum_dtype=config.accum_dtype)((p, local), b)
        if new is None:
            return out, new
        kept = []
        for path, full, mine, updated, m in zip(leaf_paths(state), jax.tree.leaves(state), jax.tree.leaves(local),
                                                jax.tree.leaves(new), jax.tree.leaves(state_mask)):
            if m and updated is not mine:
                raise ValueError(f"stage_axis: the loss updates per-layer model state {path!r} (training-mode "
                                 "batch statistics or RNG counters); each stage holds only its layers' share, "
                                 f"which is not supported yet: run the layers in evaluation mode (per-layer state "
                                 f"{per_layer[:3]}{'...' if len(per_layer) > 3 else ''})")
            kept.append(full if m else updated)
        return out, jax.tree.unflatten(jax.tree.structure(new), kept)

    return _StageLayout(derived, piped_fn, microbatches, params, blocks)


class _StageLayout(NamedTuple):
    """What :func:`_staged` makes of a stage axis: the derived config, the piped loss, the
    micro-batches, the params the step holds (stacked where the model has a list of blocks) and
    that stacking (``None``: the model's own tree)."""

    config: TrainConfig
    loss: Callable[..., tuple[Any, PyTree]]
    microbatches: int
    params: PyTree
    blocks: BlockStack | None


def _stacked_specs(blocks: BlockStack, specs: PyTree | None, params: PyTree) -> PyTree | None:
    """``specs`` (for the model's tree) for the tree with ``blocks`` stacked: each block's spec,
    which every block must share, behind the new (layer) axis."""
    if specs is None:
        return None

    def one(*block_specs: P) -> P:
        if len(set(block_specs)) > 1:
            raise ValueError(f"stage_axis: the blocks {blocks.describe()} are sharded unalike ({list(block_specs)}); "
                             "the stage axis stacks them, which must then be sharded alike")
        return P(None, *block_specs[0])

    return blocks.stack(jax.tree.unflatten(jax.tree.structure(params), leaf_specs(params, specs)), combine=one)


def _split_over_stages(params: PyTree, stacked: PyTree) -> PyTree:
    """Which stacked leaves the stage axis splits: all of them, but where every parameter is in
    the stack, the smallest stays whole on every stage (the step's stage-replicated chain needs
    one leaf; it costs that leaf's bytes once per stage)."""
    flags = jax.tree.leaves(stacked)
    if not all(flags):
        return stacked
    sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
    whole = sizes.index(min(sizes))
    return jax.tree.unflatten(jax.tree.structure(stacked), [i != whole for i in range(len(flags))])


def _stage_rows(x: jax.Array, stage: str) -> jax.Array:
    """This stage's equal share of ``x``'s leading (layer) axis."""
    share = np.shape(x)[0] // _compat.axis_size(stage)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(stage) * share, share)


def _stage_specs(mask: PyTree, param_specs: PyTree | None, params: PyTree, stage: str) -> PyTree:
    """Each stacked leaf's spec with ``stage`` on its layer axis, over the hand-written
    tensor-parallel split ``param_specs`` gives it (which must leave that axis whole); the
    other leaves' specs as given."""
    out = []
    for path, spec, stacked in zip(leaf_paths(params), leaf_specs(params, param_specs), jax.tree.leaves(mask)):
        if stacked:
            if len(spec) and spec[0] is not None:
                raise ValueError(f"stage_axis: the spec of stacked leaf {path!r} ({spec}, from param_specs or the "
                                 "model's declared sharding) splits its layer axis, which the stage axis splits: "
                                 "leave its first entry None")
            spec = P(stage, *tuple(spec)[1:])
        out.append(spec)
    return jax.tree.unflatten(jax.tree.structure(params), out)


def _bound_axes(loss: Callable[[PyTree, PyTree], jax.Array], axes: Sequence[str]) -> Callable[[PyTree, PyTree], jax.Array]:
    """``loss`` traced outside ``shard_map`` with the names of ``axes`` bound (size-1 ``vmap``
    axes), so that its collectives over them trace."""

    def bound(p: PyTree, b: PyTree) -> jax.Array:
        fn = lambda b: loss(p, b)  # noqa: E731
        for name in reversed(tuple(axes)):
            fn = jax.vmap(fn, axis_name=name)
        ones = (1,) * len(axes)
        return fn(jax.tree.map(lambda x: jnp.reshape(x, ones + x.shape), b))

    return bound


def make_train_step(
    model: nnx.Module | PyTree,
    loss_fn: Callable[[Any, PyTree], Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    config: TrainConfig | None = None,
    *,
    example_batch: PyTree | None = None,
    mutable: Sequence[str] = (),
) -> TrainStep:
    """Builds a jitted sharded train step; see the module docstring for examples.

    Args:
        model: an ``nnx.Module`` (its ``nnx.Param``s are trained; its other state -- batch
            statistics, RNG counters -- is carried in ``TrainState.model_state`` and updated every
            step; RNG keys are folded with the device index, so each data-parallel device draws
            its own dropout masks, reproducibly across a checkpoint resume); with ``mutable``, a
            Flax linen variables dict (``module.init(...)``: ``{"params": ..., "batch_stats":
            ...}``), whose ``params`` are trained and whose other collections are carried in
            ``TrainState.model_state``; or a params pytree (arrays, or ``jax.ShapeDtypeStruct``s
            to only :meth:`~TrainStep.lower` the step). Global shapes.
        loss_fn: ``loss_fn(model, batch)`` for an nnx model, ``loss_fn(variables, batch)`` with
            ``mutable``, ``loss_fn(params, batch)`` for a pytree: the mean loss over the examples
            it is given (a micro-batch of one device's share of the batch), a scalar or a
            :class:`~jax_drain.WeightedLoss`; with ``mutable``, ``(loss, updates)``, ``updates``
            being the collections ``module.apply(variables, x, mutable=mutable)`` returns. It runs
            inside ``shard_map`` on local parameter blocks.
        tx: an optax transform that means the same on flat shards as on the tree; masks and
            clipping via :func:`jax_drain.masked`, :func:`jax_drain.adamw` and
            :func:`jax_drain.clip_by_global_norm` (see :class:`~jax_drain.DistributedOptimizer`).
            Checked once (:func:`~jax_drain.optimizer.check_transform`): prepared on a thread while
            init and the first step compile, run by the first step before it: a refused ``tx``
            raises before the first step runs (its state is not donated), or where ``tx`` first
            fails on flat shards.
        mesh: the device mesh; the batch is split over ``config.outer_axis`` and ``config.axis``.
            Collectives in the model (``BatchNorm(axis_name=...)``) name these axes.
        config: :class:`TrainConfig` (defaults if ``None``).
        example_batch: a global batch (arrays or ``jax.ShapeDtypeStruct``s) to trace the loss
            on for the gradient-ready bucket order now; without it the first call's batch is
            traced (and ``abstract_state`` is available only after that call).
        mutable: the linen collections the loss updates, as for ``module.apply(...,
            mutable=[...])`` (e.g. ``["batch_stats"]``); given, ``model`` is the variables dict.
            Each step replaces these collections by the loss's ``updates`` (cross-device
            statistics need ``BatchNorm(axis_name=<the data axis>)``), keeps them on a skipped
            step, and checkpoints them with the state; :meth:`TrainStep.variables` returns the
            trained variables.

    Returns:
        A :class:`TrainStep`: ``state = step.init()``, then ``state, metrics = step(state, batch)``
        (:class:`StepMetrics`: ``metrics.loss``, ``grad_norm``, ``skipped``, ``nonfinite_buckets``).

    Example (Flax linen with batch statistics)::

        variables = module.init(jax.random.key(0), x[:1], train=False)

        def loss_fn(variables, batch):
            logits, updates = module.apply(variables, batch["x"], train=True, mutable=["batch_stats"])
            return cross_entropy(logits, batch["y"]), updates

        step = jd.make_train_step(variables, loss_fn, optax.adam(1e-3), mesh, mutable=["batch_stats"])
    """
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a jax_drain.TrainConfig, got {type(config).__name__}"
                        + (": use jd.TrainConfig(**config)" if isinstance(config, Mapping) else ""))
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of (model or params, batch) returning the loss, got "
                        f"{type(loss_fn).__name__} {loss_fn!r:.40}")
    check_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError("make_train_step runs on devices: mesh must be a jax.sharding.Mesh, got an AbstractMesh (no "
                        "devices). To compile without running, build the step on compile-only devices "
                        "(jax_drain.planner.targets.gpu_mesh) and call step.lower(...)")
    collections = _check_mutable(model, mutable)
    # Shardings declared on the model (read when param_specs is not given), before anything is traced.
    declare = lambda source: None if config.param_specs is not None else declared_specs(
        source, mesh, config.logical_axis_rules, data_axes=config.data_axes)
    gspmd = config.tensor_parallel == "gspmd"
    if collections:
        boxed = unfreeze(model["params"])
        declared, params = declare(boxed), unboxed(boxed)
        others = {name: unboxed(unfreeze(value)) for name, value in model.items() if name != "params"}
        call = _AxisContext(mesh, config.data_axes, _model_axes(config, declared, gspmd),
                            rules=config.logical_axis_rules).call

        def linen_loss(p: PyTree, state: PyTree, batch: PyTree, device: jax.Array | None) -> tuple[Any, PyTree]:
            del device
            out = call(loss_fn, {"params": p, **state}, batch)
            return _linen_output(out, state, collections)

        return TrainStep(params, linen_loss, others, tx, mesh, config, example_batch, None, linen=True,
                         declared=declared)

    if isinstance(model, nnx.Module):
        graphdef, param_state, key_state, _ = nnx.split(model, nnx.Param, nnx.RngKey, ...)
        declared = declare(param_state)
        call = _AxisContext(mesh, config.data_axes, _model_axes(config, declared, gspmd),
                            rules=config.logical_axis_rules).call
        params = nnx.to_pure_dict(param_state)
        impls = [jax.random.key_impl(k) for k in jax.tree.leaves(key_state)]

        def loss(p: PyTree, state: PyTree, batch: PyTree, device: jax.Array | None) -> tuple[Any, PyTree]:
            key_data, other = state
            keys = [jax.random.wrap_key_data(d, impl=impl) for d, impl in zip(jax.tree.leaves(key_data), impls)]
            if device is not None:  # a dropout mask of its own on every data-parallel device
                keys = [_fold_in(k, device) for k in keys]
            merged = nnx.merge(graphdef, p, jax.tree.unflatten(jax.tree.structure(key_data), keys), other)
            out = call(loss_fn, merged, batch)
            *_, new_other = nnx.split(merged, nnx.Param, nnx.RngKey, ...)
            return out, (key_data, nnx.to_pure_dict(new_other))

        return TrainStep(params, loss, _model_state(model), tx, mesh, config, example_batch, model, declared=declared)

    declared = declare(model)
    call = _AxisContext(mesh, config.data_axes, _model_axes(config, declared, gspmd),
                            rules=config.logical_axis_rules).call

    def plain_loss(p: PyTree, state: PyTree, batch: PyTree, device: jax.Array | None) -> tuple[Any, PyTree]:
        del device
        return call(loss_fn, p, batch), state

    return TrainStep(unboxed(model) if has_boxes(model) else model, plain_loss, None, tx, mesh, config, example_batch,
                     None, declared=declared)


def _model_axes(config: TrainConfig, declared: PyTree | None, gspmd: bool) -> tuple[str, ...]:
    """The axes a gspmd step leaves to XLA, for the error about a loss with collectives over them
    (the step's mode is resolved later; this is what the declarations already say)."""
    if not (gspmd or (config.tensor_parallel is None and config.param_specs is None and shards_any(declared))):
        return ()
    return tuple(a for spec in jax.tree.leaves(declared, is_leaf=lambda x: isinstance(x, P))
                 for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


def _check_mutable(model: Any, mutable: Sequence[str]) -> tuple[str, ...]:
    """``mutable`` as a tuple of collection names, checked against the linen variables ``model``."""
    names = (mutable,) if isinstance(mutable, str) else mutable
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"mutable must list collection names, e.g. mutable=['batch_stats'], got {mutable!r}")
    names = tuple(dict.fromkeys(names))
    if not names:
        return ()
    if isinstance(model, nnx.Module):
        raise ValueError("mutable= is for Flax linen variables; an nnx model's state (batch statistics, RNG "
                         "counters) is carried and updated without it: drop mutable=")
    if not isinstance(model, Mapping) or "params" not in model:
        raise ValueError(
            f"with mutable={list(names)} the model is a linen variables dict, {{'params': ..., "
            f"'{names[0]}': ...}} as module.init(...) returns it; got {type(model).__name__}"
            + (f" with collections {sorted(model)}" if isinstance(model, Mapping) else ""))
    if "params" in names:
        raise ValueError("'params' are trained by the optimizer, not updated by the loss: leave it out of mutable=")
    missing = [n for n in names if n not in model]
    if missing:
        raise ValueError(
            f"mutable={list(names)}: the variables have no collection {', '.join(map(repr, missing))} (they have "
            f"{sorted(model)}); pass the variables module.init(...) returns, which include every collection "
            "the model creates")
    return names


def _linen_output(out: Any, state: dict, mutable: tuple[str, ...]) -> tuple[Any, dict]:
    """A linen loss's ``(loss, updates)`` as ``(loss, new model state)``: the collections in
    ``updates`` replace those in ``state``, the others are passed through."""
    shape = f"(loss, updates), updates being what module.apply(variables, x, mutable={list(mutable)}) returns"
    if isinstance(out, WeightedLoss) or not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ValueError(f"with mutable={list(mutable)} loss_fn must return {shape}; got {_describe(out)}")
    value, updates = out
    if not isinstance(updates, Mapping):
        raise ValueError(f"with mutable={list(mutable)} loss_fn must return {shape}; its second element is "
                         f"{_describe(updates)}, not a dict of collections")
    unexpected = [name for name in updates if name not in mutable]
    if unexpected:
        raise ValueError(f"loss_fn returned updates of {unexpected}, which are not in mutable={list(mutable)}; "
                         "list every collection the loss updates in make_train_step(..., mutable=[...])")
    new = dict(state)
    for name, collection in updates.items():
        collection = unfreeze(collection)
        old_leaves, old_tree = jax.tree.flatten(state[name])
        leaves, tree = jax.tree.flatten(collection)
        if tree != old_tree or any(np.shape(a) != np.shape(b) for a, b in zip(leaves, old_leaves)):
            raise ValueError(
                f"the updated collection {name!r} differs in structure or shapes from the one the step was "
                f"built with: {jax.tree.map(np.shape, collection)} against {jax.tree.map(np.shape, state[name])}. "
                "Build the step from the variables module.init(...) returns")
        # The state keeps its types from step to step (the jitted step donates and reuses it).
        new[name] = jax.tree.unflatten(old_tree, [jnp.asarray(a, b.dtype) for a, b in zip(leaves, old_leaves)])
    return value, new


def _describe(value: Any) -> str:
    if isinstance(value, WeightedLoss):
        return "a WeightedLoss alone"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} alone"
    return type(value).__name__


class _Background:
    """Prepares a check on a thread of its own, from :meth:`start`: ``prepare(*args)`` returns
    the check to finish with (a call that compiles and runs it). :meth:`wait` starts it if need
    be, joins the thread, raises what it raised, then finishes the check on the waiting thread:
    preparing runs nothing on a device, so nothing the caller runs beside it meets a program of
    this thread's.

    Not a daemon: an interpreter that exits first waits for it rather than tearing the JAX
    runtime down under it."""

    def __init__(self, prepare: Callable[..., Callable[[], None]], *args: Any):
        self._error: BaseException | None = None
        self._finish: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, args=(prepare, args),
                                        name=f"jax_drain {getattr(prepare, '__name__', 'check')}")
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts preparing (once; :meth:`wait` starts it too)."""
        with self._lock:
            if not self._started():
                self._thread.start()

    def _started(self) -> bool:
        return self._thread.ident is not None

    def _run(self, prepare: Callable[..., Callable[[], None]], args: tuple) -> None:
        try:
            self._finish = prepare(*args)
        except BaseException as e:  # noqa: BLE001 - raised again by the thread that waits
            self._error = e

    def join(self) -> None:
        """Waits for a started preparation to end, raising nothing and finishing nothing."""
        if self._started():
            self._thread.join()

    def wait(self) -> None:
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        self._finish()


class _AxisContext:
    """Calls the user's loss inside the step.

    * The model's own activation constraints keep their model axes: the data axes, manual in
      the step, are dropped from each (:func:`jax_drain.shardings.without_manual_axes`), and
      ``TrainConfig.logical_axis_rules`` are the rules Flax's logical constraints read, over any
      rules context of the caller's.
    * A collective over an axis name the mesh lacks becomes a ``ValueError`` that names it and
      the mesh's axes (JAX raises a bare ``AssertionError`` or ``NameError`` from deep inside
      ``psum``).
    """

    def __init__(self, mesh: Mesh, data_axes: tuple[str, ...], auto_axes: Sequence[str] = (), *,
                 rules: Sequence[tuple[str, Any]] | None = None):
        self.mesh_axes, self.data_axes = tuple(mesh.axis_names), data_axes
        self.auto_axes = tuple(dict.fromkeys(auto_axes))
        self.rules = rules
        self.constraint_in_step = functools.partial(without_manual_axes, data_axes=data_axes)

    def call(self, loss_fn: Callable[[Any, PyTree], Any], model: Any, batch: PyTree) -> Any:
        rules = nn.logical_axis_rules(self.rules) if self.rules is not None else contextlib.nullcontext()
        try:
            with _compat.rewritten_constraints(self.constraint_in_step), rules:
                return loss_fn(model, batch)
        except (AssertionError, NameError) as e:
            auto = [a for a in self.collective_axes(e) if a in self.auto_axes]
            if auto:
                raise ValueError(
                    f"the loss uses a collective over {', '.join(map(repr, auto))}, which tensor_parallel='gspmd' "
                    "leaves to XLA: the loss runs on global shapes there. Drop the collective (XLA inserts the "
                    "tensor-parallel ones), or train with TrainConfig(tensor_parallel='manual', param_specs=...) "
                    "on local blocks"
                ) from e
            missing = self.unbound_axes(e)
            if not missing:
                raise
            axes = self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes
            raise ValueError(
                f"the model's collectives use the axis name {', '.join(map(repr, missing))} (e.g. "
                f"BatchNorm(axis_name={missing[0]!r})), which the mesh does not have: its axes are "
                f"{self.mesh_axes}, the step's data axes {self.data_axes}. The model's axis_name and the mesh "
                f"must agree: give the model axis_name={axes!r}, or name the mesh's data axis {missing[0]!r} "
                f"and build the step with TrainConfig(axis={missing[0]!r})"
            ) from e

    def unbound_axes(self, error: BaseException) -> tuple[str, ...]:
        """The axis names that the collective ``error`` was raised in was called with and the
        mesh does not have; empty when ``error`` comes from somewhere else."""
        return tuple(a for a in self.collective_axes(error) if a not in self.mesh_axes)

    @staticmethod
    def collective_axes(error: BaseException) -> tuple[str, ...]:
        """The axis names of the collective ``error`` was raised in; empty when it comes from
        somewhere else."""
        names_seen: list[str] = []
        tb = error.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_globals.get("__name__") == _COLLECTIVES_MODULE and "axis_name" in frame.f_locals:
                names = frame.f_locals["axis_name"]
                for name in names if isinstance(names, (tuple, list)) else (names,):
                    if isinstance(name, str) and name not in names_seen:
                        names_seen.append(name)
            tb = tb.tb_next
        return tuple(names_seen)


#: Where ``jax.lax.psum``, ``pmean``, ``all_gather``, ``axis_index`` ... are defined: their
#: ``axis_name`` argument is what an unbound-axis error is about.
_COLLECTIVES_MODULE = jax.lax.psum.__module__


def _fold_in(keys: jax.Array, data: jax.Array) -> jax.Array:
    """``jax.random.fold_in`` for a key array of any shape (a scanned stack splits its keys)."""
    flat = keys.reshape(-1)
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(flat).reshape(keys.shape)


def _model_state(model: nnx.Module) -> PyTree:
    """An nnx model's non-Param state as plain arrays in pure dicts: ``(RNG keys as raw key
    data, everything else)``. Pure dicts, not ``nnx.State``s: the variables are created anew
    inside each trace that merges them."""
    _, _, key_state, other_state = nnx.split(model, nnx.Param, nnx.RngKey, ...)
    return nnx.to_pure_dict(jax.tree.map(jax.random.key_data, key_state)), nnx.to_pure_dict(other_state)


def _check_no_aliases(state: Any) -> None:
    """A donated state must hold each array once: the runtime cannot donate one buffer twice."""
    seen: dict[int, str] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array):
            name = jax.tree_util.keystr(path)
            if (first := seen.setdefault(id(leaf), name)) != name:
                raise ValueError(
                    f"the state holds one array twice ({first} and {name}); its buffers are donated to the step, "
                    "and one buffer cannot be donated twice. Give each leaf its own array (jnp.copy), or build the "
                    "step with TrainConfig(donate=False)")


def _whole_on_host(x: Any) -> np.ndarray:
    """A global array's whole value on this host, gathered from the other processes if it spans
    them (every process must call it then)."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _check_not_consumed(state: Any) -> None:
    """A donated state's buffers are gone; running on them would crash the runtime."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"this TrainState was consumed by an earlier step call (its buffers were donated; "
                f"{jax.tree_util.keystr(path)} is deleted): keep using the state that call returned, "
                "e.g. state, metrics = step(state, batch), or build the step with TrainConfig(donate=False)"
            )

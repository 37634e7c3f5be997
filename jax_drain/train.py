"""A data-parallel train step for ``flax.nnx`` models (or any params pytree), in a few lines.

:func:`make_train_step` puts :class:`~jax_drain.GradSync` and
:class:`~jax_drain.DistributedOptimizer` together into one jitted step over a mesh: the global
batch is split over the data axis, each device accumulates its local gradients over
``microbatches`` micro-batches (float32 by default), the buckets are reduce-scattered once per
step, the optimizer updates this device's shards and the new parameters are all-gathered.

Example (``flax.nnx``)::

    import optax, jax_drain as jd
    from jax_drain.models import GPT, GPTConfig

    model = GPT(GPTConfig(num_layers=2, d_model=128, num_heads=4, seq_len=64, vocab_size=96),
                rngs=nnx.Rngs(0))
    step = jd.make_train_step(model, lambda m, b: m.loss(b), optax.adam(1e-3), mesh,
                              jd.TrainConfig(bucket_size=200_000, microbatches=4),
                              example_batch=first_batch)
    state = step.init()
    for batch in batches:                 # global batches, e.g. numpy arrays
        state, loss = step(state, batch)
    step.update_model(model, state)       # copy the trained parameters back into the model

Scanned layer stacks (``nnx.scan`` / ``jax.lax.scan`` over stacked block parameters): pass
``TrainConfig(scan_layers=True)`` and an ``example_batch``; the stacked leaves are found from
the loss (:func:`jax_drain.stacked_leaves`) and a :class:`~jax_drain.ScanGradSync`
reduce-scatters each layer's gradient inside the backward scan::

    step = jd.make_train_step(scanned_model, lambda m, b: m.loss(b), tx, mesh,
                              jd.TrainConfig(scan_layers=True, microbatches=2), example_batch=first_batch)

For ``flax.linen`` (or plain functions) pass the params pytree and ``loss_fn(params, batch)``::

    step = jd.make_train_step(variables["params"],
                              lambda p, b: loss(module.apply({"params": p}, b["x"]), b["y"]),
                              optax.sgd(0.1), mesh)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_drain import _compat
from jax_drain.layout import leaf_paths
from jax_drain.optimizer import DistributedOptimizer, DistState, _layout_mismatch
from jax_drain.order import grad_ready_order
from jax_drain.scan import ScanGradSync, stacked_leaves
from jax_drain.sync import GradSync, local_params

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How :func:`make_train_step` syncs, accumulates and updates.

    Attributes:
        axis: the data-parallel mesh axis (the batch is split over it).
        bucket_size, reduce, drain, max_in_flight: passed to :class:`~jax_drain.GradSync`.
        microbatches: local gradient accumulation steps per optimizer step; the per-device batch
            is split into this many equal micro-batches and the buckets are synced once.
        accum_dtype: dtype of the local gradient accumulator (``None``: the gradients' own dtype,
            e.g. bf16). The mean gradient is cast to the parameter dtype before the sync. Not
            used with ``scan_layers``: there the float32 shards are accumulated.
        scan_layers: ``True``: the model runs its blocks under a scan over stacked parameters;
            use a :class:`~jax_drain.ScanGradSync` (needs ``example_batch`` to find the stacked
            leaves). With ``microbatches=k`` every micro-batch is reduce-scattered inside its
            own backward scan and the float32 shards are accumulated (``k`` syncs per step;
            see :mod:`jax_drain.scan`). ``None``: do so iff the loss scans over parameters
            (traced from ``example_batch``; without one, ``False``). ``False``: a
            :class:`~jax_drain.GradSync` over whole leaves.
        gather_max_in_flight: the parameter all-gather chain depth
            (see :class:`~jax_drain.DistributedOptimizer`).
        donate: donate the input state's buffers to the step (the old state becomes unusable).

    Example::

        TrainConfig(bucket_size=10_000_000, reduce="fp32_accum", microbatches=4)
    """

    axis: str = "data"
    bucket_size: int | None = 40_000_000
    reduce: str = "fp32_accum"
    drain: bool = True
    max_in_flight: int | None = None
    microbatches: int = 1
    accum_dtype: Any = jnp.float32
    gather_max_in_flight: int | str | None = "sync"
    donate: bool = True
    scan_layers: bool | None = False

    def __post_init__(self) -> None:
        if self.scan_layers not in (True, False, None):
            raise ValueError(f"scan_layers must be True, False or None (auto), got {self.scan_layers!r}")
        k = self.microbatches
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {k!r}")
        if self.accum_dtype is not None:
            dtype = jnp.dtype(self.accum_dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"accum_dtype must be a floating dtype or None, got {dtype}")
            object.__setattr__(self, "accum_dtype", dtype)


class TrainState(NamedTuple):
    """Everything a step reads and writes: replicated params, sharded optimizer state, step."""

    params: PyTree
    opt_state: DistState
    step: jax.Array  # int32 scalar: optimizer steps taken


class TrainStep:
    """The jitted step built by :func:`make_train_step`; call it as ``step(state, batch)``.

    Attributes: ``sync`` (:class:`~jax_drain.GradSync`, or :class:`~jax_drain.ScanGradSync`
    for a scanned model), ``optimizer``
    (:class:`~jax_drain.DistributedOptimizer`), ``mesh``, ``config``.
    """

    def __init__(
        self,
        params: PyTree,
        loss: Callable[[PyTree, PyTree, PyTree], jax.Array],
        rest: PyTree,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: TrainConfig,
        example_batch: PyTree | None,
        model: nnx.Module | None,
    ):
        self.mesh, self.config = mesh, config
        self._loss, self._rest = loss, rest
        # init() reads the model's params when it is called (or the given pytree's); the step
        # itself only needs their shapes.
        self._model, self._source = model, (params if model is None else None)
        self._abstract_params = _abstract(params)
        if config.axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {config.axis!r}; its axes are {tuple(mesh.axis_names)}")
        self.axis_size = int(mesh.shape[config.axis])
        order, micro = None, None
        if example_batch is not None:
            micro = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((self._local_examples(x) // config.microbatches, *np.shape(x)[1:]), x.dtype),
                self._check_batch(example_batch),
            )
            order = grad_ready_order(lambda p, b: loss(p, rest, b), self._abstract_params, micro)
        stacked = self._find_stacked(micro)
        sync_kwargs = dict(
            axis=config.axis, bucket_size=config.bucket_size, reduce=config.reduce, drain=config.drain,
            max_in_flight=config.max_in_flight, order=order,
        )
        #: True iff the step uses a :class:`~jax_drain.ScanGradSync`.
        self.scan_layers = stacked is not None
        if self.scan_layers:
            self.sync = ScanGradSync(params, mesh, stacked=stacked, **sync_kwargs)
        else:
            self.sync = GradSync(params, mesh, **sync_kwargs)
        self.optimizer = DistributedOptimizer(tx, self.sync, gather_max_in_flight=config.gather_max_in_flight)
        specs = self.optimizer.state_specs()
        sharded = _compat.shard_map(
            self._sharded_step, mesh=mesh,
            in_specs=(P(), specs, P(), P(config.axis)), out_specs=(P(), specs, P()),
        )

        def step(state: TrainState, rest: PyTree, batch: PyTree) -> tuple[TrainState, jax.Array]:
            params, opt_state, loss = sharded(state.params, state.opt_state, rest, batch)
            return TrainState(params, opt_state, state.step + 1), loss

        self._jitted = jax.jit(step, donate_argnums=(0,) if config.donate else ())

    def __repr__(self) -> str:
        return f"TrainStep({self.config}, {self.sync!r}, {self.optimizer!r})"

    # -- public -----------------------------------------------------------------------------
    def init(self, params: PyTree | nnx.Module | None = None) -> TrainState:
        """A fresh state: the model's current (or the given) params replicated over the mesh,
        optimizer state sharded. The caller's arrays are copied, never donated."""
        if params is None:
            params = self._model if self._model is not None else self._source
        if isinstance(params, nnx.Module):
            params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            raise ValueError("init needs concrete parameters; this step was built from abstract ones")
        if self.scan_layers:
            self.sync.check_tree(params, what="params")
        else:
            self.sync.layout.check_tree(params, what="params")
        # A copy, never an alias: the step donates its input state, which must not delete the
        # caller's (or the nnx model's) arrays. (device_put may alias a device's buffer even
        # with may_alias=False when it reshards; a jitted copy never does.)
        whole = NamedSharding(self.mesh, P())
        params = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=whole)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), whole)
        return TrainState(params, self.optimizer.init_sharded(params), step)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, jax.Array]:
        """One optimizer step on a global ``batch``; returns ``(new_state, mean_loss)``."""
        self._check_state_fast(state)
        return self._jitted(state, self._rest, self.shard_batch(batch))

    def lower(self, state: PyTree, batch: PyTree) -> jax.stages.Lowered:
        """Lowers the step for arrays or ``jax.ShapeDtypeStruct``s (e.g. to inspect its HLO)."""
        self._check_state_fast(state)
        return self._jitted.lower(state, self._rest, self._check_batch(batch))

    def shard_batch(self, batch: PyTree) -> PyTree:
        """``batch`` placed on the mesh, split over the data axis (checks divisibility)."""
        batch = self._check_batch(batch)
        return jax.device_put(batch, NamedSharding(self.mesh, P(self.config.axis)))

    def abstract_state(self) -> TrainState:
        """The state as ``jax.ShapeDtypeStruct``s with shardings (a checkpoint restore target)."""
        whole = NamedSharding(self.mesh, P())
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), self._abstract_params
        )
        return TrainState(
            params, self.optimizer.abstract_state(), jax.ShapeDtypeStruct((), jnp.int32, sharding=whole)
        )

    def update_model(self, model: nnx.Module, state: TrainState) -> None:
        """Writes ``state``'s parameters into the nnx ``model`` (in place)."""
        if self._model is None:
            raise ValueError("this step was built from a params pytree, not an nnx model")
        param_state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(param_state, state.params)
        nnx.update(model, param_state)

    # -- inside shard_map -------------------------------------------------------------------
    def _sharded_step(self, params: PyTree, opt_state: DistState, rest: PyTree, batch: PyTree):
        if self.scan_layers:
            # Closes over `rest`: value_and_grad splits every argument after params into
            # micro-batches, and the non-param model state must not be split.
            loss_fn = lambda p, b: self._loss(p, rest, b).astype(jnp.float32)
            loss, shards = self.sync.value_and_grad(loss_fn, microbatches=self.config.microbatches)(params, batch)
            params, opt_state = self.optimizer.update(shards, opt_state)
            return params, opt_state, loss
        loss, grads = self._local_value_and_grad(params, rest, batch)
        shards = self.sync.reduce_scatter(grads)
        loss = jax.lax.pmean(loss, self.config.axis)
        params, opt_state = self.optimizer.update(shards, opt_state)
        return params, opt_state, loss

    def _local_value_and_grad(self, params: PyTree, rest: PyTree, batch: PyTree):
        """This device's mean loss and mean gradient over its micro-batches (no communication)."""
        axis, k = self.config.axis, self.config.microbatches
        # Gradients w.r.t. a per-device view: no hidden all-reduce (see GradSync.value_and_grad).
        local = local_params(params, axis)
        value_and_grad = jax.value_and_grad(lambda p, b: self._loss(p, rest, b).astype(jnp.float32))
        if k == 1:
            return value_and_grad(local, batch)

        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
        acc_dtype = self.config.accum_dtype
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, acc_dtype or p.dtype), params)
        # The carry must have the loop outputs' type: varying along the data axis.
        carry = jax.tree.map(lambda x: _compat.mark_varying(x, (axis,)), (jnp.zeros((), jnp.float32), zeros))

        def accumulate(carry, mb):
            total, acc = carry
            loss, grads = value_and_grad(local, mb)
            return (total + loss, jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)), None

        (total, acc), _ = jax.lax.scan(accumulate, carry, micro)
        # Mean in the accumulator's precision, then the parameter dtype the buckets expect.
        grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
        return total / k, grads

    # -- construction -----------------------------------------------------------------------
    def _find_stacked(self, micro: PyTree | None) -> PyTree | None:
        """The stacked-leaf mask for a ScanGradSync, or ``None`` for a GradSync (config.scan_layers)."""
        wanted = self.config.scan_layers
        if wanted is False:
            return None
        if micro is None:
            if wanted is None:
                return None
            raise ValueError(
                "TrainConfig(scan_layers=True) finds the stacked layer parameters by tracing the "
                "loss: pass example_batch=... to make_train_step"
            )
        mask = stacked_leaves(lambda p, b: self._loss(p, self._rest, b), self._abstract_params, micro)
        if not any(jax.tree.leaves(mask)):
            if wanted is None:
                return None
            raise ValueError(
                "TrainConfig(scan_layers=True), but the loss runs no jax.lax.scan / nnx.scan over "
                "parameters (for jax_drain.models.GPT: GPTConfig(scan_layers=True)); use "
                "scan_layers=False for an unrolled model"
            )
        return mask

    # -- checks -----------------------------------------------------------------------------
    def _local_examples(self, x: Any) -> int:
        return np.shape(x)[0] // self.axis_size

    def _check_batch(self, batch: PyTree) -> PyTree:
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("the batch has no arrays")
        need = self.axis_size * self.config.microbatches
        for path, x in zip(leaf_paths(batch), leaves):
            shape = np.shape(x)
            if not shape or shape[0] % need:
                raise ValueError(
                    f"batch leaf {path!r} has shape {shape}: its leading (example) dimension must "
                    f"split over the {self.axis_size} devices of axis {self.config.axis!r} x "
                    f"{self.config.microbatches} micro-batches; use a global batch size that is a "
                    f"multiple of {need}"
                )
        if len({np.shape(x)[0] for x in leaves}) > 1:
            raise ValueError(
                f"batch leaves disagree on the batch size: {[np.shape(x)[0] for x in leaves]}"
            )
        return batch

    def _check_state_fast(self, state: Any) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"expected the TrainState from step.init() or a restore, got {type(state).__name__}")
        opt_state = state.opt_state
        if not isinstance(opt_state, DistState):
            raise TypeError(f"state.opt_state must be a DistState, got {type(opt_state).__name__}")
        if opt_state.fingerprint != self.optimizer.fingerprint:
            raise ValueError(_layout_mismatch(opt_state.fingerprint, self.optimizer.fingerprint))


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def make_train_step(
    model: nnx.Module | PyTree,
    loss_fn: Callable[[Any, PyTree], jax.Array],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    config: TrainConfig | None = None,
    *,
    example_batch: PyTree | None = None,
) -> TrainStep:
    """Builds a jitted data-parallel train step; see the module docstring for an example.

    Args:
        model: an ``nnx.Module`` (its ``nnx.Param``s are trained; other state, e.g. RNG counters
            or batch statistics, is passed in unchanged every step and not updated), or a params
            pytree (e.g. linen's ``variables["params"]``; arrays, or ``jax.ShapeDtypeStruct``s
            to only :meth:`~TrainStep.lower` the step).
        loss_fn: ``loss_fn(model, batch)`` for an nnx model, ``loss_fn(params, batch)`` for a
            pytree: a scalar mean loss over the examples it is given (a micro-batch of one
            device's share of the batch).
        tx: an element-wise optax transform; masks and clipping via :func:`jax_drain.masked` and
            :func:`jax_drain.clip_by_global_norm` (see :class:`~jax_drain.DistributedOptimizer`).
        mesh: the device mesh; the batch is split over ``config.axis``.
        config: :class:`TrainConfig` (defaults if ``None``).
        example_batch: a global batch (arrays or ``jax.ShapeDtypeStruct``s) used only to trace
            the loss for the gradient-ready bucket order (:func:`jax_drain.grad_ready_order`);
            without it buckets follow reverse leaf order.

    Returns:
        A :class:`TrainStep`: ``state = step.init()``, then ``state, loss = step(state, batch)``.
    """
    config = config or TrainConfig()
    if isinstance(model, nnx.Module):
        graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(param_state)

        def loss(p: PyTree, rest: PyTree, batch: PyTree) -> jax.Array:
            return loss_fn(nnx.merge(graphdef, p, rest), batch)

        return TrainStep(params, loss, rest, tx, mesh, config, example_batch, model)

    def plain_loss(p: PyTree, rest: PyTree, batch: PyTree) -> jax.Array:
        del rest
        return loss_fn(p, batch)

    return TrainStep(model, plain_loss, None, tx, mesh, config, example_batch, None)

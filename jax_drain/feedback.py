"""Error feedback: each device's wire rounding error, added back into its next gradient.

A lossy wire (``reduce="int8_accum"``/``"fp8_accum"``/``"fp16_accum"``/``"int8_accum_streamed"``, or a
``wire_dtype`` narrower than float32) rounds what every device sends. With error feedback each
device keeps what its wire rounded off (a *residual*, one whole bucket per bucket, in the
gradients' dtype) and sends ``gradient + residual`` the next step, so the rounding errors do
not add up over steps: what reaches the optimizer over ``T`` steps differs from the exact sum
by one step's rounding, not ``T`` of them (1-bit Adam's and PowerSGD's compensation, applied
per bucket before the fp32-accumulated all-to-all).

The residuals are state of the *sync*, not of the optimizer: one whole (local) bucket per
device and bucket, laid out over the axes a device's bucket differs along
(:attr:`~jax_drain.BucketChain.bucket_axes`). :class:`ErrorFeedback` carries them with the
fingerprint of the bucket layout they belong to; a residual moved to another mesh or layout
means nothing, so a checkpoint restored into another layout starts it from zero.

Cost: a residual per bucket on every device, i.e. one more copy of the local gradient in its
own dtype, and one more quantize/dequantize of each bucket.

Example (inside ``shard_map``; ``TrainConfig(error_feedback=True)`` does all of this)::

    sync = jd.GradSync(params, mesh, reduce="int8_accum")
    check_error_feedback(sync)
    value, shards, residuals = sync.value_and_grad(loss_fn, error_feedback=True)(params, residuals, batch)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

if TYPE_CHECKING:  # pragma: no cover - typing only
    from jax_drain.chain import ChainedSync

#: Reduce modes whose rounding happens on the sending device only, so a residual can hold it.
#: ``"bf16"`` sums in bf16 on the wire (the error is not any one device's) and ``"fp32"`` sends
#: float32.
FEEDBACK_MODES = ("fp32_accum", "fp32_accum_streamed", "int8_accum", "fp8_accum", "fp16_accum", "int8_accum_streamed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ErrorFeedback:
    """The error-feedback residuals of a sync; a pytree.

    ``residuals``: the sync's output type (a tuple of buckets, :class:`~jax_drain.sync.Shards`
    or :class:`~jax_drain.ScanShards`) holding, instead of float32 shards, each device's whole
    bucket in its gradients' dtype (``[num_layers, size]`` for a scanned stack's layer bucket);
    global arrays outside ``shard_map``, split over each chain's ``bucket_axes``.
    ``fingerprint`` (static): the bucket layout's fingerprint.
    """

    residuals: Any
    fingerprint: str = dataclasses.field(metadata={"static": True})


def check_error_feedback(sync: "ChainedSync") -> None:
    """Raises unless error feedback means something for ``sync`` (its reduce mode and wire)."""
    mode = sync.reduce
    if mode not in FEEDBACK_MODES:
        raise ValueError(
            f"error feedback needs a wire whose rounding happens on the sending device; reduce={mode!r} "
            f"has none to feed back. Use one of {', '.join(FEEDBACK_MODES)} (e.g. reduce='int8_accum')"
        )
    if not any(chain.lossy_wire(mode) for chain in sync.chains):
        raise ValueError(
            f"error feedback: reduce={mode!r} sends float32 gradients unrounded, so there is no error "
            "to feed back. Use a quantized mode (reduce='int8_accum' or 'fp8_accum') or a narrower "
            "wire (wire_dtype=jnp.bfloat16), or leave error_feedback off"
        )


def abstract_error_feedback(sync: "ChainedSync") -> ErrorFeedback:
    """The residuals as global ``jax.ShapeDtypeStruct``s with shardings (a restore target)."""
    mesh = sync.mesh
    return ErrorFeedback(sync.pack_shards([
        jax.ShapeDtypeStruct(chain.global_bucket_shape(k, mesh), chain.layout.buckets[k].dtype,
                             sharding=NamedSharding(mesh, chain.bucket_spec))
        for chain, k in sync.flat_chains
    ]), sync.fingerprint)


def init_error_feedback(sync: "ChainedSync") -> ErrorFeedback:
    """Zero residuals, placed on the sync's mesh (outside ``shard_map``)."""
    abstract = abstract_error_feedback(sync)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                   out_shardings=shardings)()


def error_feedback_specs(sync: "ChainedSync") -> ErrorFeedback:
    """``shard_map`` specs of an :class:`ErrorFeedback` of ``sync``."""
    return ErrorFeedback(sync.bucket_specs(), sync.fingerprint)

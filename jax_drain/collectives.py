"""Per-bucket collectives: reduce-scatter one flat bucket over a mesh axis, fp32 result.

Call these inside ``jax.shard_map``. Device ``r`` along ``axis`` receives elements
``[r * n, (r + 1) * n)`` of the reduced bucket, where ``n = bucket.size // axis_size``.

Modes (``REDUCE_MODES``):

* ``"bf16"`` -- ``psum_scatter`` in the gradient's own dtype; the sum is rounded to that dtype.
* ``"fp32"`` -- upcast to float32, then ``psum_scatter``: exact-ish sums, twice the wire bytes.
* ``"fp32_accum"`` -- Megatron's ``reduce_scatter_with_fp32_accumulation``: an ``all_to_all``
  in the gradient dtype (the same wire bytes as ``"bf16"``), then a local float32 sum over the
  ``axis_size`` received chunks. Costs one full-bucket scratch buffer (the all-to-all output)
  until the sum has consumed it -- the buffer the drain bounds.

Example (inside ``shard_map`` over a mesh with a ``"data"`` axis of size 8)::

    shard = reduce_scatter_bucket(bucket_bf16, "data", mode="fp32_accum", average=True)
    # shard: float32[bucket.size // 8]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_drain._compat import AxisName, axis_size

REDUCE_MODES = ("bf16", "fp32", "fp32_accum")


def check_mode(mode: str) -> str:
    """Returns ``mode`` if it is a known reduce mode, else raises ``ValueError``."""
    if mode not in REDUCE_MODES:
        raise ValueError(f"unknown reduce mode {mode!r}; choose one of {', '.join(REDUCE_MODES)}")
    return mode


def reduce_scatter_bucket(bucket: jax.Array, axis: AxisName, *, mode: str, average: bool) -> jax.Array:
    """Reduce-scatters a 1-D bucket over ``axis`` and returns this device's float32 shard.

    ``bucket.size`` must be a multiple of the axis size. ``average=True`` divides the sum by
    the axis size (in float32, after the sum, so ``"fp32_accum"`` keeps its precision).
    """
    check_mode(mode)
    if bucket.ndim != 1:
        raise ValueError(f"a bucket is 1-D, got shape {bucket.shape}")
    n = axis_size(axis)
    if bucket.shape[0] % n:
        raise ValueError(f"bucket of {bucket.shape[0]} elements does not split over {n} devices")
    if n == 1:
        shard = bucket.astype(jnp.float32)
    elif mode == "bf16":
        shard = jax.lax.psum_scatter(bucket, axis, scatter_dimension=0, tiled=True).astype(jnp.float32)
    elif mode == "fp32":
        shard = jax.lax.psum_scatter(bucket.astype(jnp.float32), axis, scatter_dimension=0, tiled=True)
    else:  # fp32_accum
        chunks = bucket.reshape(n, bucket.shape[0] // n)
        # Row j of `received` is device j's copy of the chunk this device owns.
        received = jax.lax.all_to_all(chunks, axis, split_axis=0, concat_axis=0, tiled=True)
        shard = jnp.sum(received.astype(jnp.float32), axis=0)
    return shard / n if average and n > 1 else shard

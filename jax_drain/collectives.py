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
* ``"fp32_accum_streamed"`` -- the same wire bytes and float32 accumulation without the
  full-bucket scratch: the all-to-all is decomposed into ``axis_size - 1`` ``ppermute`` steps
  and each received chunk is added into the float32 accumulator as it arrives
  (:func:`streamed_reduce_scatter`). Scratch is O(bucket / axis_size).

Example (inside ``shard_map`` over a mesh with a ``"data"`` axis of size 8)::

    shard = reduce_scatter_bucket(bucket_bf16, "data", mode="fp32_accum", average=True)
    # shard: float32[bucket.size // 8]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_drain._compat import AxisName, axis_size

REDUCE_MODES = ("bf16", "fp32", "fp32_accum", "fp32_accum_streamed")

# Point-to-point steps of the streamed mode allowed to be unfinished at once: two lets the add
# of step s overlap the transfer of step s + 1 while bounding scratch to two chunks.
STREAM_DEPTH = 2


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
    elif mode == "fp32_accum_streamed":
        shard = streamed_reduce_scatter(bucket, axis)
    else:  # fp32_accum
        chunks = bucket.reshape(n, bucket.shape[0] // n)
        # Row j of `received` is device j's copy of the chunk this device owns.
        received = jax.lax.all_to_all(chunks, axis, split_axis=0, concat_axis=0, tiled=True)
        shard = jnp.sum(received.astype(jnp.float32), axis=0)
    return shard / n if average and n > 1 else shard


def streamed_reduce_scatter(bucket: jax.Array, axis: AxisName) -> jax.Array:
    """fp32-accumulated reduce-scatter as ``axis_size - 1`` point-to-point steps.

    At step ``s`` (1 <= s < n) device ``r`` sends the chunk owned by device ``(r + s) % n`` to
    that device and receives its own chunk from device ``(r - s) % n``, adding it into a float32
    accumulator that starts as its own chunk. The wire bytes equal one all-to-all; the scratch
    is ``STREAM_DEPTH`` chunks instead of a whole bucket, because step ``s + STREAM_DEPTH``'s send
    is fenced behind the accumulator of step ``s``.

    Summation order: own chunk first, then the chunks of devices ``r - 1, r - 2, ...`` one by
    one, left to right in float32; ``"fp32_accum"`` sums all ``n`` chunks in one XLA reduce
    instead, so the two agree to float32 rounding, not bit for bit.
    """
    n = axis_size(axis)
    chunks = bucket.reshape(n, bucket.shape[0] // n)
    rank = jax.lax.axis_index(axis)
    owned = lambda owner: jax.lax.dynamic_index_in_dim(chunks, owner % n, axis=0, keepdims=False)
    accumulators = [owned(rank).astype(jnp.float32)]
    for step in range(1, n):
        with jax.named_scope(f"step{step}"):
            send = owned(rank + step)
            if step > STREAM_DEPTH:
                _, send = jax.lax.optimization_barrier((accumulators[step - STREAM_DEPTH], send))
            received = jax.lax.ppermute(send, axis, perm=[(j, (j + step) % n) for j in range(n)])
            accumulators.append(accumulators[-1] + received.astype(jnp.float32))
    return accumulators[-1]


def all_gather_bucket(shard: jax.Array, axis: AxisName, dtype: jnp.dtype | None = None) -> jax.Array:
    """Gathers every device's 1-D ``shard`` of a bucket over ``axis``: the whole bucket, replicated.

    The inverse of :func:`reduce_scatter_bucket`'s split: device ``r``'s shard lands at elements
    ``[r * n, (r + 1) * n)``. ``dtype`` (e.g. the parameters' bf16) is applied *before* the
    gather, so the wire carries the narrow type. The result is typed as invariant along
    ``axis`` (identical on every device), so it can leave ``shard_map`` with ``out_specs=P()``.

    Example (inside ``shard_map``; ``master``: this device's float32 slice of a bf16 bucket)::

        bucket = all_gather_bucket(master, "data", dtype=jnp.bfloat16)  # bf16[8 * master.size]
    """
    if shard.ndim != 1:
        raise ValueError(f"a bucket shard is 1-D, got shape {shard.shape}")
    if dtype is not None:
        shard = shard.astype(dtype)
    return jax.lax.all_gather(shard, axis, axis=0, tiled=True, to="invarying")


def all_reduce_shard(shard: jax.Array, axis: AxisName, *, wire_dtype: jnp.dtype | None = None) -> jax.Array:
    """Sums a reduce-scattered 1-D ``shard`` over ``axis``: the outer step of a hierarchical reduction.

    After :func:`reduce_scatter_bucket` over the inner (intra-host) axis, the devices holding
    the same shard on different replicas (hosts) all-reduce it over the outer axis -- HSDP, or
    Megatron-LM's ``num_distributed_optimizer_instances > 1``. The all-reduce runs in
    ``wire_dtype`` (float32 by default, keeping an fp32-accumulated shard's precision; pass the
    gradient dtype for a bf16-wire baseline) and the result is float32, invariant along ``axis``.

    Example (inside ``shard_map`` over ``("replica", "data")``)::

        shard = reduce_scatter_bucket(bucket, "data", mode="fp32_accum", average=False)
        shard = all_reduce_shard(shard, "replica") / (4 * 2)   # mean over 8 devices
    """
    if shard.ndim != 1:
        raise ValueError(f"a bucket shard is 1-D, got shape {shard.shape}")
    wire = jnp.float32 if wire_dtype is None else wire_dtype
    # Even over a size-1 axis: the psum is what types the result as invariant along ``axis``.
    return jax.lax.psum(shard.astype(wire), axis).astype(jnp.float32)

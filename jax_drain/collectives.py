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
* ``"int8_accum"`` / ``"fp8_accum"`` -- ``"fp32_accum"`` with a quantized wire: each device
  quantizes its bucket per block (int8 with scale ``absmax / 127``, or float8_e4m3fn with scale
  ``absmax / 448``; one float32 scale per block), sends payload and scales packed into one
  int8 array by one ``all_to_all`` (one collective per bucket; fp8 payloads travel as their
  bytes), and the receiver dequantizes every chunk and sums in float32. No low-precision
  arithmetic happens on the wire: the only loss is each device rounding its own values once.
  Wire bytes: 1 per element plus 4 per block (0.51x ``"fp32_accum"``'s bf16 at
  ``block_size=256``).
* ``"fp16_accum"`` -- the same with a float16 payload: 2 bytes per element plus 4 per block
  (1.01x ``"fp32_accum"``'s bf16 at ``block_size=256``), scaled so each block's absmax maps to
  float16's largest finite value (65504). Three more significand bits than a bf16 wire at the
  same bytes, and none of an unscaled float16 wire's failures: nothing overflows and small
  gradients stay in float16's normal range relative to their block. This is the float16 wire:
  ``wire_dtype=jnp.float16`` (unscaled) is refused.
* ``"int8_accum_streamed"`` -- ``"int8_accum"`` as ``axis_size - 1`` ``ppermute`` steps, like
  ``"fp32_accum_streamed"`` (same ``STREAM_DEPTH`` fencing, scratch O(bucket / axis_size)); each
  step quantizes the chunk it sends, after the fence.

The mean (``average=True``) overflows only where the mean itself does: a sum of ``n`` devices'
finite values can exceed the largest finite float32 (or float16, summed in float16) while
their mean is well inside it, and a step whose gradient is not finite is skipped. So each
device's values are divided by ``p`` (:func:`mean_predivisor`: the smallest power of two
``>= n``) as they enter the sum, and the float32 result by ``n / p`` after it. No partial sum
then exceeds the largest of the values it adds (up to the sum's own rounding), in any order, on
any wire. The rounding costs nothing outside the subnormals: dividing by a power of two only
changes the exponent, so it is exact and commutes with every rounding of the sum (the sums are
the undivided ones times ``2**-k``); ``n / p`` is dyadic, so dividing by it rounds as dividing
by ``n`` did (so does XLA's multiplication by the reciprocal: ``1 / (n / p)`` rounds to ``p``
times the rounded ``1 / n``), for every ``n``, power of two or not. Dividing by ``n`` itself before the sum would round every
value once more where ``n`` is not a power of two. (XLA may still order a reduction of
``"fp32_accum"`` differently once the division is fused into it: float32 rounding, as any
reordered sum.)

Where a divided value falls below the smallest normal of the dtype it is divided in, it is
rounded to that dtype's subnormal grid: by at most ``2**-150`` in float32, ``2**-134`` in
bfloat16 (values below ``p * 2**-126``), but ``2**-25`` in float16 (values below ``p * 2**-14``,
``6.1e-5 * p``). Only ``"bf16"`` divides in the sum's own narrow dtype (the gradients', or
the wire's), so there on float16 each device's contribution to the mean may move by
``p / n * 2**-25`` (``3e-8`` at ``n = p = 8``), beside the float16 sum's own rounding. The
other modes divide in float32 after the wire (where float16 and bfloat16 values stay normal)
or divide their float32 block scales.

Quantization blocks (quantized modes only; :func:`block_partition`): the bucket is split into
``axis_size`` chunks of ``bucket.size // axis_size`` elements; each chunk is cut every
``block_size`` elements from its start (the last piece is shorter when the chunk is not a
multiple of ``block_size``), and cut again at every offset in ``block_starts``. So a block
holds at most ``block_size`` elements and never straddles a chunk boundary or a
``block_starts`` offset. The sync passes the bucket offset of every leaf as ``block_starts``,
so a leaf of small gradients never shares a scale with a large neighbour (which would round it
to zero). Cost: elementwise work per element grows with the most ``block_starts`` offsets that
fall inside one ``block_size`` piece (1 or 2 when leaves hold at least ``block_size``
elements; many tiny leaves packed together make every element of the bucket pay for them).

Error bound per element of the sum, before ``average`` (``s_j``: device ``j``'s scale of the
element's block, ``x_j``: its value): int8 ``|error| <= sum_j s_j / 2``; fp8
``|error| <= sum_j (|x_j| / 16 + s_j / 1024)`` (e4m3fn: 3 mantissa bits, subnormal step
``2**-9``); fp16 ``|error| <= sum_j (|x_j| / 2048 + s_j / 2**25)`` (10 mantissa bits, subnormal
step ``2**-24``); plus float32 rounding; divided by the predivisor with the sum (exact: the scales
are divided). Zeros stay exactly zero. An inf or NaN arrives as NaN in its own element (int8
sends it as the code -128, which no finite value uses; float8_e4m3fn and float16 as their NaN), and the rest
of its block is scaled by the block's finite values: the non-finite check on the float32 shards
sees it, and no finite element is lost with it. Over an axis of size 1 nothing is sent and
nothing is quantized.

Example (inside ``shard_map`` over a mesh with a ``"data"`` axis of size 8)::

    shard = reduce_scatter_bucket(bucket_bf16, "data", mode="fp32_accum", average=True)
    # shard: float32[bucket.size // 8]
    shard = reduce_scatter_bucket(bucket_bf16, "data", mode="int8_accum", average=True,
                                  block_starts=leaf_offsets)   # blocks aligned to leaves
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jax_drain._compat import AxisName, axis_size

QUANTIZED_MODES = ("int8_accum", "fp8_accum", "fp16_accum", "int8_accum_streamed")
REDUCE_MODES = ("bf16", "fp32", "fp32_accum", "fp32_accum_streamed") + QUANTIZED_MODES

# Point-to-point steps of the streamed mode allowed to be unfinished at once: two lets the add
# of step s overlap the transfer of step s + 1 while bounding scratch to two chunks.
STREAM_DEPTH = 2

# The int8 payload's code for an inf or NaN: symmetric quantization maps values to [-127, 127],
# so -128 is free.
_INT8_NON_FINITE = -128

# Quantized wire formats: (payload dtype, largest magnitude a block's absmax is mapped to).
_WIRE = {
    "int8_accum": (jnp.int8, 127.0),
    "int8_accum_streamed": (jnp.int8, 127.0),
    "fp8_accum": (jnp.float8_e4m3fn, 448.0),
    "fp16_accum": (jnp.float16, 65504.0),
}


def check_mode(mode: str) -> str:
    """Returns ``mode`` if it is a known reduce mode, else raises ``ValueError``."""
    if not isinstance(mode, str) or mode not in REDUCE_MODES:
        raise ValueError(f"unknown reduce mode {mode!r}; choose one of {', '.join(REDUCE_MODES)}")
    return mode


def check_float_dtype(value: Any, name: str) -> Any:
    """``value`` as a floating ``np.dtype`` (``None`` stays ``None``), or a ``ValueError`` naming ``name``."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.float32, 'bfloat16') or None, got {value!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (e.g. jnp.float32, 'bfloat16') or None, got {dtype}")
    return dtype


def check_wire_dtype(mode: str, wire_dtype: Any) -> None:
    """Refuses a ``wire_dtype`` that changes no wire bytes in ``mode`` and only adds rounding:
    ``"fp32"`` sends float32 whatever the bucket's dtype, the quantized modes their own scaled
    payload (quantized from float32 values). Refuses too a wire with less exponent range than
    float32 (float16, the float8s): unscaled, it turns large gradients into inf and small ones
    into zero; its scaled form is a reduce mode."""
    dtype = check_float_dtype(wire_dtype, "wire_dtype")
    if dtype is not None and _narrower_range(dtype):
        scaled = "fp16_accum" if dtype.itemsize == 2 else "fp8_accum"
        raise ValueError(
            f"wire_dtype={dtype} has less range than float32: unscaled, gradients above "
            f"{float(jnp.finfo(dtype).max):.4g} arrive as inf and those below {float(jnp.finfo(dtype).tiny):.3g} "
            f"lose their digits or arrive as zero. Use reduce={scaled!r} (a payload scaled per block, "
            "float32 sums) or wire_dtype=jnp.bfloat16 (float32's range at the same bytes)"
        )
    if wire_dtype is not None and (mode == "fp32" or mode in QUANTIZED_MODES):
        raise ValueError(
            f"wire_dtype={jnp.dtype(wire_dtype)} with reduce={mode!r} rounds the gradients without "
            f"sending fewer bytes ({mode!r} sends {'float32' if mode == 'fp32' else 'its own 1-byte payload'}). "
            "Leave wire_dtype=None, or use reduce='fp32_accum' for a narrower wire with float32 sums"
        )


def _narrower_range(dtype: Any) -> bool:
    """Whether ``dtype`` overflows or leaves the normals where float32 does not."""
    info, full = jnp.finfo(dtype), jnp.finfo(jnp.float32)
    return int(info.maxexp) < int(full.maxexp) or int(info.minexp) > int(full.minexp)


def mean_predivisor(count: int) -> int:
    """The power of two a mean over ``count`` devices divides each device's values by as they
    enter the sum: the smallest one ``>= count`` (1 for one device).

    ``count`` finite values each divided by it sum to at most the largest of them, whatever the
    order, so no partial sum overflows where the mean does not. The rest of the mean is a
    division by ``count / mean_predivisor(count)`` (exact, dyadic) after the sum. Example::

        mean_predivisor(8), mean_predivisor(6)   # 8, 8: a mean over 6 divides the sum by 0.75 after
    """
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"a mean is over a positive int count of devices, got {count!r}")
    return 1 << (int(count) - 1).bit_length()


def pmean(x: jax.Array, axes: AxisName) -> jax.Array:
    """``jax.lax.pmean(x, axes)`` that is finite wherever the mean is: each device's value is
    divided by :func:`mean_predivisor` of the devices as it enters the ``psum`` (exact: a power
    of two), the rest of the mean after it; a dtype narrower than float32 is summed in float32
    and the mean cast back. For the reported loss and every metric averaged over devices.

    Example (inside ``shard_map`` over a ``"data"`` axis of size 2)::

        pmean(jnp.float32(3e38), "data")   # 3e38, where jax.lax.pmean gives inf
    """
    n = axis_size(axes)
    p = mean_predivisor(n)
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    total = jax.lax.psum(_predivided(wide, p), axes)
    return (total / (n / p) if n != p else total).astype(x.dtype)


def _sum_over_senders(received: jax.Array) -> jax.Array:
    """``received.sum(axis=0)`` as one add per sender (row), in sender order.

    Why not ``jnp.sum``: XLA:CPU turns a sum over an all-to-all's result into adds of the received
    pieces, but a sum over the *predivided* result becomes a reduce fusion over a concatenated copy,
    about 7x slower (a 1M-element float32 bucket on 8 devices: 45 against 6 ms), which made the
    default train step 1.4x slower. Written as adds it is one elementwise pass on XLA:CPU and
    XLA:GPU alike, with or without the division.
    """
    total = received[0]
    for row in range(1, received.shape[0]):
        total = total + received[row]
    return total


def _check_predivide(predivide: int) -> int:
    """Returns ``predivide`` if it is a power of two (the only divisors that round nothing)."""
    if isinstance(predivide, bool) or not isinstance(predivide, (int, np.integer)) or predivide < 1 \
            or predivide & (predivide - 1):
        raise ValueError(f"predivide must be a power of two (dividing by it is exact), got {predivide!r}")
    return int(predivide)


def _predivided(x: jax.Array, predivide: int) -> jax.Array:
    """``x / predivide`` in ``x``'s dtype (a power of two: exact outside the subnormals)."""
    return x if predivide == 1 else x / jnp.asarray(predivide, x.dtype)


def reduce_scatter_bucket(
    bucket: jax.Array,
    axis: AxisName,
    *,
    mode: str,
    average: bool,
    block_size: int = 256,
    block_starts: Iterable[int] | None = None,
    predivide: int = 1,
) -> jax.Array:
    """Reduce-scatters a 1-D bucket over ``axis`` and returns this device's float32 shard.

    ``bucket.size`` must be a multiple of the axis size. ``average=True`` divides the sum by
    the axis size: each device's values by :func:`mean_predivisor` of it as they are summed,
    the rest in float32 after the sum (so ``"fp32_accum"`` keeps its precision, and a finite
    mean stays finite; see the module docstring).

    ``predivide`` (keyword-only, with ``average=False``): a power of two each device's values
    are divided by as they are summed, so the result is the sum divided by it; for a caller
    that finishes a mean over more devices itself (an outer :func:`all_reduce_shard`, then the
    rest of the divisor), with ``predivide=mean_predivisor(all the devices summed)``.

    ``block_size`` and ``block_starts`` (keyword-only) apply to the quantized modes
    (``QUANTIZED_MODES``) and are ignored by the others: each chunk is cut into blocks every
    ``block_size`` elements from its start and again at every offset in ``block_starts``
    (element offsets within the bucket, ``0 <= offset <= bucket.size``; order and duplicates
    do not matter; static Python ints). Pass the offset of every leaf in the bucket, so that
    each block belongs to one leaf. See the module docstring for the rule and the error bound.
    """
    check_mode(mode)
    if bucket.ndim != 1:
        raise ValueError(f"a bucket is 1-D, got shape {bucket.shape}")
    n = axis_size(axis)
    if bucket.shape[0] % n:
        raise ValueError(f"bucket of {bucket.shape[0]} elements does not split over {n} devices")
    predivide = _check_predivide(predivide)
    if average and predivide != 1:
        raise ValueError("predivide is for a caller that finishes the mean itself: pass average=False with it")
    if average:
        predivide = mean_predivisor(n)
    if mode in QUANTIZED_MODES:
        blocks = block_partition(bucket.shape[0], n, block_size, block_starts)
    if n == 1:
        shard = _predivided(bucket.astype(jnp.float32), predivide)
    elif mode == "bf16":
        # Summed in the bucket's dtype, so divided in it: the only mode that must.
        shard = jax.lax.psum_scatter(_predivided(bucket, predivide), axis, scatter_dimension=0,
                                     tiled=True).astype(jnp.float32)
    elif mode == "fp32":
        shard = jax.lax.psum_scatter(_predivided(bucket.astype(jnp.float32), predivide), axis,
                                     scatter_dimension=0, tiled=True)
    elif mode == "fp32_accum_streamed":
        shard = streamed_reduce_scatter(bucket, axis, predivide=predivide)
    elif mode == "int8_accum_streamed":
        shard = _quantized_streamed_reduce_scatter(bucket, axis, blocks, mode, predivide)
    elif mode in QUANTIZED_MODES:
        shard = _quantized_reduce_scatter(bucket, axis, blocks, mode, predivide)
    else:  # fp32_accum
        chunks = bucket.reshape(n, bucket.shape[0] // n)
        # Row j of `received` is device j's copy of the chunk this device owns.
        received = jax.lax.all_to_all(chunks, axis, split_axis=0, concat_axis=0, tiled=True)
        # Divided after the wire, in float32: no narrow dtype's subnormals are involved.
        shard = _sum_over_senders(_predivided(received.astype(jnp.float32), predivide))
    # n / predivide is dyadic: this one rounding is dividing the undivided sum by n.
    return shard / (n / predivide) if average and n != predivide else shard


def wire_values(
    bucket: jax.Array,
    axis_size: int,
    *,
    mode: str,
    block_size: int = 256,
    block_starts: Iterable[int] | None = None,
) -> jax.Array:
    """The float32 values the receivers of :func:`reduce_scatter_bucket` sum for this device's
    ``bucket``: what survives the wire. ``bucket - wire_values(bucket, ...)`` is the device's
    rounding error, which error feedback adds to its next gradient.

    Quantized modes quantize and dequantize every chunk in its blocks (the same blocks, so the
    same values, as the collective); the other modes send the bucket's own elements, so the
    values are the bucket in float32 (cast the bucket to a narrower wire dtype first to see that
    rounding). Over an axis of size 1 nothing is sent and nothing is rounded.

    Example::

        sent = wire_values(bucket, 8, mode="int8_accum", block_starts=leaf_offsets)
        residual = bucket - sent   # float32, the int8 rounding of every block
    """
    check_mode(mode)
    if bucket.ndim != 1 or bucket.shape[0] % axis_size:
        raise ValueError(f"a bucket is 1-D and splits over {axis_size} devices, got shape {bucket.shape}")
    if mode not in QUANTIZED_MODES or axis_size == 1:
        return bucket.astype(jnp.float32)
    blocks = block_partition(bucket.shape[0], axis_size, block_size, block_starts)
    splits, compact = jnp.asarray(blocks.splits), jnp.asarray(blocks.compact)
    wire = _quantize(bucket.reshape(axis_size, blocks.chunk), blocks, splits, compact, mode)
    values = jax.vmap(lambda w, s, c: _dequantize(w, blocks, s, c, mode))(wire, splits, compact)
    return values.reshape(-1)


def streamed_reduce_scatter(bucket: jax.Array, axis: AxisName, *, predivide: int = 1) -> jax.Array:
    """fp32-accumulated reduce-scatter as ``axis_size - 1`` point-to-point steps; every chunk is
    divided by the power of two ``predivide`` in float32 as it is added (the sum divided by it).

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
    predivide = _check_predivide(predivide)
    chunks = bucket.reshape(n, bucket.shape[0] // n)
    rank = jax.lax.axis_index(axis)
    owned = lambda owner: jax.lax.dynamic_index_in_dim(chunks, owner % n, axis=0, keepdims=False)
    term = lambda chunk: _predivided(chunk.astype(jnp.float32), predivide)
    accumulators = [term(owned(rank))]
    for step in range(1, n):
        with jax.named_scope(f"step{step}"):
            send = owned(rank + step)
            if step > STREAM_DEPTH:
                _, send = jax.lax.optimization_barrier((accumulators[step - STREAM_DEPTH], send))
            received = jax.lax.ppermute(send, axis, perm=[(j, (j + step) % n) for j in range(n)])
            accumulators.append(accumulators[-1] + term(received))
    return accumulators[-1]


# -- quantized wire ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class BlockPartition:
    """The static quantization blocks of a bucket split into ``axis_size`` chunks.

    Each chunk is viewed as ``num_cells`` cells of ``block_size`` elements (the last one padded
    with zeros when ``chunk`` is not a multiple of ``block_size``); a cell holds one block, or
    several where ``block_starts`` cut it. ``splits[k, c]``: the cut points inside cell ``c`` of
    chunk ``k`` (offsets in ``(0, block_size)``, increasing, padded with ``block_size``), so the
    sub-block of an element at offset ``t`` of its cell is the number of cut points ``<= t``.
    ``compact[k]``: for each block of chunk ``k`` in order, its index in the flattened
    ``[num_cells, max_cuts + 1]`` table of (cell, sub-block), padded past the table's end.
    """

    axis_size: int
    chunk: int
    block_size: int
    splits: np.ndarray  # int16 (int32 for block_size >= 2**15) [axis_size, num_cells, max_cuts]
    compact: np.ndarray  # int32[axis_size, num_blocks]
    blocks_per_chunk: tuple[int, ...]

    @property
    def num_cells(self) -> int:
        return self.splits.shape[1]

    @property
    def max_cuts(self) -> int:
        """The most ``block_starts`` cut points inside one cell (0: blocks are plain cells)."""
        return self.splits.shape[2]

    @property
    def num_blocks(self) -> int:
        """Blocks per chunk (the most any chunk has): the float32 scales sent per chunk."""
        return self.compact.shape[1]

    def wire_bytes(self, payload_itemsize: int = 1) -> int:
        """Bytes one device sends (itself included) for one bucket: payload (``payload_itemsize``
        bytes an element: 2 for ``"fp16_accum"``) plus scales."""
        return self.axis_size * (self.chunk * payload_itemsize + 4 * self.num_blocks)

    def bucket_starts(self) -> np.ndarray:
        """Every block's first element as an offset in the bucket, in order."""
        out = []
        for k in range(self.axis_size):
            cells = np.arange(self.num_cells) * self.block_size
            cuts = (cells[:, None] + self.splits[k])[self.splits[k] < self.block_size]
            out.append(k * self.chunk + np.unique(np.concatenate([cells, cuts])))
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def block_partition(
    size: int, axis_size: int, block_size: int = 256, block_starts: Iterable[int] | None = None
) -> BlockPartition:
    """The blocks :func:`reduce_scatter_bucket` quantizes a ``size``-element bucket in.

    Each chunk (``size // axis_size`` elements) is cut every ``block_size`` elements from its
    start, and again at every offset in ``block_starts`` (offsets in the bucket). Example:
    ``block_partition(16, 2, 4, (3, 13)).bucket_starts()`` is ``[0, 3, 4, 8, 12, 13]``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    starts = () if block_starts is None else tuple(sorted({int(b) for b in block_starts}))
    if starts and (starts[0] < 0 or starts[-1] > size):
        raise ValueError(f"block_starts must lie in [0, {size}] (the bucket), got {starts[0]}..{starts[-1]}")
    return _partition(int(size), int(axis_size), int(block_size), starts)


@functools.lru_cache(maxsize=256)
def _partition(size: int, n: int, block_size: int, block_starts: tuple[int, ...]) -> BlockPartition:
    chunk = size // n
    cells = -(-chunk // block_size)
    cuts = np.asarray(block_starts, np.int64)
    # (chunk, cell, offset in cell) of every cut strictly inside a cell.
    inside = cuts[(cuts % chunk != 0) & (cuts < size)] if chunk else cuts[:0]
    inside = inside[(inside % chunk) % block_size != 0]
    k, local = inside // max(chunk, 1), inside % max(chunk, 1)
    cell, offset = local // block_size, local % block_size
    per_cell = np.zeros((n, cells), np.int64)
    np.add.at(per_cell, (k, cell), 1)
    m = int(per_cell.max(initial=0))
    splits = np.full((n, cells, m), block_size, np.int64)
    rank = np.arange(len(inside)) - np.searchsorted(inside, inside - offset)  # cut's rank in its cell
    splits[k, cell, rank] = offset
    exists = np.arange(m + 1)[None, None, :] <= per_cell[:, :, None]  # [n, cells, m + 1]
    counts = exists.reshape(n, -1).sum(axis=1)
    width = int(counts.max(initial=0))
    compact = np.full((n, width), cells * (m + 1), np.int64)
    for row in range(n):  # one pass per chunk, vectorised over its blocks
        flat = np.flatnonzero(exists[row].reshape(-1))
        compact[row, : len(flat)] = flat
    splits = splits.astype(np.int16 if block_size < 2**15 else np.int32)
    return BlockPartition(n, chunk, block_size, splits, compact.astype(np.int32), tuple(int(c) for c in counts))


def _cell_offsets(splits: jax.Array, block_size: int) -> jax.Array:
    """Offset of every element in its cell: ``int32[..., num_cells, block_size]`` (an iota)."""
    return jax.lax.broadcasted_iota(jnp.int32, (*splits.shape[:-1], block_size), splits.ndim - 1)


def _sub_block_masks(splits: jax.Array, block_size: int) -> jax.Array:
    """``bool[..., num_cells, block_size, max_cuts + 1]``: whether each element of a cell is in
    its sub-block ``m`` (between cut ``m - 1`` and cut ``m``), given the cut points ``splits``."""
    offsets = _cell_offsets(splits, block_size)[..., None]
    zero = jnp.zeros((*splits.shape[:-1], 1), splits.dtype)
    end = jnp.full((*splits.shape[:-1], 1), block_size, splits.dtype)
    lo, hi = jnp.concatenate([zero, splits], axis=-1), jnp.concatenate([splits, end], axis=-1)
    return (offsets >= lo[..., None, :]) & (offsets < hi[..., None, :])


def _per_element(table: jax.Array, splits: jax.Array, block_size: int) -> jax.Array:
    """Broadcasts per-(cell, sub-block) values ``table[..., num_cells, max_cuts + 1]`` to the
    elements ``[..., num_cells, block_size]``: elementwise selects (cuts are increasing, so the
    last cut at or before an element names its sub-block), nothing per element materialized."""
    shape = (*table.shape[:-1], block_size)
    values = jnp.broadcast_to(table[..., :1], shape)
    if splits.shape[-1]:
        offsets = _cell_offsets(splits, block_size)
        for m in range(splits.shape[-1]):
            values = jnp.where(offsets >= splits[..., m : m + 1], table[..., m + 1 : m + 2], values)
    return values


def _as_cells(x: jax.Array, blocks: BlockPartition) -> jax.Array:
    """``x[..., chunk]`` as ``[..., num_cells, block_size]``, zero-padded at the end."""
    pad = blocks.num_cells * blocks.block_size - blocks.chunk
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], blocks.num_cells, blocks.block_size)


def _quantize(x: jax.Array, blocks: BlockPartition, splits: jax.Array, compact: jax.Array, mode: str) -> jax.Array:
    """Quantizes chunks ``x[..., chunk]`` in their blocks; returns the wire bytes
    ``int8[..., chunk * width + 4 * num_blocks]`` (``width``: the payload dtype's bytes): the
    payload, then each block's float32 scale.

    ``splits``/``compact``: the chunks' rows of ``blocks`` (constants, or chosen by rank).
    """
    dtype, qmax = _WIRE[mode]
    x = _as_cells(x.astype(jnp.float32), blocks)
    splits = jnp.asarray(splits, jnp.int32)  # stored narrow; compared as int32
    finite = jnp.isfinite(x)
    # The scale comes from the block's finite values only: an inf or NaN travels as the
    # payload's non-finite code and comes out as NaN in its own element, the rest of its block
    # as if it were absent.
    magnitude = jnp.where(finite, jnp.abs(x), 0.0)
    if not blocks.max_cuts:
        absmax = magnitude.max(axis=-1, keepdims=True)
    else:
        masks = _sub_block_masks(splits, blocks.block_size)
        absmax = jnp.where(masks, magnitude[..., None], 0.0).max(axis=-2)
    scale = absmax / qmax
    scale = jnp.where(scale > 0, scale, 1.0)  # zero (or absent) blocks: zeros stay exactly zero
    divisor = _per_element(scale, splits, blocks.block_size)
    scaled = jnp.clip(jnp.where(finite, x, 0.0) / divisor, -qmax, qmax)
    scaled = jnp.where(finite, scaled, jnp.nan)
    scaled = scaled.reshape(*scaled.shape[:-2], -1)[..., : blocks.chunk]
    if dtype == jnp.int8:
        payload = jnp.where(jnp.isnan(scaled), _INT8_NON_FINITE, jnp.round(scaled)).astype(jnp.int8)
    else:  # float8_e4m3fn and float16 have a NaN; a float16 payload travels as 2 bytes
        payload = jax.lax.bitcast_convert_type(scaled.astype(dtype), jnp.int8)
        payload = payload.reshape(*scaled.shape[:-1], -1)
    flat = scale.reshape(*scale.shape[:-2], -1)
    scales = jnp.take_along_axis(flat, compact, axis=-1, mode="clip") if blocks.max_cuts else flat
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.int8)
    return jnp.concatenate([payload, scale_bytes.reshape(*scales.shape[:-1], -1)], axis=-1)


def _dequantize(wire: jax.Array, blocks: BlockPartition, splits: jax.Array, compact: jax.Array, mode: str,
                predivide: int = 1) -> jax.Array:
    """float32 values ``[..., chunk]`` of received wire bytes ``int8[..., chunk * width + 4 * num_blocks]``
    (leading axes: senders) of the chunk whose rows of ``blocks`` are ``splits``/``compact``,
    divided by the power of two ``predivide``."""
    dtype, _ = _WIRE[mode]
    splits = jnp.asarray(splits, jnp.int32)  # stored narrow; compared as int32
    width = jnp.dtype(dtype).itemsize
    payload, scale_bytes = wire[..., : blocks.chunk * width], wire[..., blocks.chunk * width :]
    if width > 1:
        payload = payload.reshape(*payload.shape[:-1], blocks.chunk, width)
    if dtype != jnp.int8:
        payload = jax.lax.bitcast_convert_type(payload, dtype)
    lead = wire.shape[:-1]
    scales = jax.lax.bitcast_convert_type(scale_bytes.reshape(*lead, blocks.num_blocks, 4), jnp.float32)
    # The scales are divided, not the values: payload * scale may round past float32's largest
    # finite value at the top of its range, payload * (scale / predivide) cannot.
    scales = _predivided(scales, predivide)
    if blocks.max_cuts:  # block scales -> the (cell, sub-block) table: compact's inverse
        table_size = blocks.num_cells * (blocks.max_cuts + 1)
        expand = jnp.zeros((table_size,), jnp.int32).at[compact].set(
            jnp.arange(blocks.num_blocks, dtype=jnp.int32), mode="drop")
        scales = jnp.take(scales, expand, axis=-1)
    table = scales.reshape(*lead, blocks.num_cells, blocks.max_cuts + 1)
    values = _as_cells(payload.astype(jnp.float32), blocks) * _per_element(table, splits, blocks.block_size)
    values = values.reshape(*lead, -1)[..., : blocks.chunk]
    if dtype == jnp.int8:
        values = jnp.where(payload == _INT8_NON_FINITE, jnp.nan, values)
    return values


def _row(table: np.ndarray, index: jax.Array) -> jax.Array:
    """Row ``index`` (traced) of a static table."""
    return jax.lax.dynamic_index_in_dim(jnp.asarray(table), index, axis=0, keepdims=False)


def _quantized_reduce_scatter(bucket: jax.Array, axis: AxisName, blocks: BlockPartition, mode: str,
                              predivide: int) -> jax.Array:
    """Quantize every chunk, one all-to-all of the bytes, dequantize (divided by ``predivide``)
    and sum in float32."""
    n = axis_size(axis)
    rank = jax.lax.axis_index(axis)
    with jax.named_scope("quantize"):
        wire = _quantize(bucket.reshape(n, blocks.chunk), blocks, jnp.asarray(blocks.splits),
                         jnp.asarray(blocks.compact), mode)
    # Row j of `received` is device j's quantized copy of the chunk this device owns.
    received = jax.lax.all_to_all(wire, axis, split_axis=0, concat_axis=0, tiled=True)
    with jax.named_scope("dequantize"):
        values = _dequantize(received, blocks, _row(blocks.splits, rank), _row(blocks.compact, rank), mode,
                             predivide)
        return _sum_over_senders(values)


def _quantized_streamed_reduce_scatter(bucket: jax.Array, axis: AxisName, blocks: BlockPartition, mode: str,
                                       predivide: int) -> jax.Array:
    """:func:`streamed_reduce_scatter` with each sent chunk quantized just before its step.

    The own chunk is quantized and dequantized too, so the values summed are those of the
    all-to-all form; only the float32 summation order differs (see
    :func:`streamed_reduce_scatter`). Step ``s``'s chunk is fenced behind the accumulator of
    step ``s - STREAM_DEPTH`` *before* it is quantized, so quantized chunks do not pile up.
    """
    n = axis_size(axis)
    chunks = bucket.reshape(n, blocks.chunk)
    rank = jax.lax.axis_index(axis)
    owned = lambda owner: jax.lax.dynamic_index_in_dim(chunks, owner % n, axis=0, keepdims=False)
    own_splits, own_compact = _row(blocks.splits, rank), _row(blocks.compact, rank)

    def quantize(x, owner):
        with jax.named_scope("quantize"):
            return _quantize(x, blocks, _row(blocks.splits, owner % n), _row(blocks.compact, owner % n), mode)

    def dequantize(wire):
        with jax.named_scope("dequantize"):
            return _dequantize(wire, blocks, own_splits, own_compact, mode, predivide)

    accumulators = [dequantize(quantize(owned(rank), rank))]
    for step in range(1, n):
        with jax.named_scope(f"step{step}"):
            send = owned(rank + step)
            if step > STREAM_DEPTH:
                _, send = jax.lax.optimization_barrier((accumulators[step - STREAM_DEPTH], send))
            received = jax.lax.ppermute(quantize(send, rank + step), axis,
                                        perm=[(j, (j + step) % n) for j in range(n)])
            accumulators.append(accumulators[-1] + dequantize(received))
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

    A mean over both axes divides before the sums (:func:`mean_predivisor` of all the devices
    summed), so neither stage overflows where the mean does not.

    Example (inside ``shard_map`` over ``("replica", "data")`` of sizes 2 and 4)::

        shard = reduce_scatter_bucket(bucket, "data", mode="fp32_accum", average=False,
                                      predivide=mean_predivisor(2 * 4))
        shard = all_reduce_shard(shard, "replica")   # the mean over 8 devices (8 / 8: no more division)
    """
    if shard.ndim != 1:
        raise ValueError(f"a bucket shard is 1-D, got shape {shard.shape}")
    wire = jnp.float32 if wire_dtype is None else wire_dtype
    # Even over a size-1 axis: the psum is what types the result as invariant along ``axis``.
    return jax.lax.psum(shard.astype(wire), axis).astype(jnp.float32)

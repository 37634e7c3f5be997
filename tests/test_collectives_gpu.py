"""The quantized wire on XLA's real GPU compiler, without a GPU: compile-only 8xH100 devices.

One bf16 bucket reduce-scattered with each mode: the quantized modes send 1-byte elements (the
payload and the float32 scales' bytes packed into one int8 array, one collective per bucket)
and sum in float32 after the collective; bytes are compared with ``fp32_accum``'s bf16
all-to-all of the same bucket.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_drain import _compat
from jax_drain.collectives import STREAM_DEPTH, block_partition, reduce_scatter_bucket
from jax_drain.planner.schedule import parse_schedule
from jax_drain.planner.targets import gpu_mesh

pytestmark = pytest.mark.gpu_compile  # skips without the CUDA PJRT plugin (tests/conftest.py)

N = 8
SIZE = N * 131072  # elements of one device's bucket: 2 MiB of bf16
# Leaf offsets as the sync would pass them: leaves of odd sizes, none aligned to a block.
LEAF_STARTS = tuple(int(x) for x in np.cumsum([0, 1000, 333, 400_000, 77, 250_001, 12_345]))

_cache = {}


@pytest.fixture(scope="module")
def mesh():
    return gpu_mesh((N,), ("data",))


def compile_bucket(mesh, mode, block_starts=None):
    """(schedule, temp bytes) of one bf16 bucket reduce-scattered with ``mode``."""
    key = (mode, block_starts)
    if key not in _cache:
        fn = jax.jit(_compat.shard_map(
            lambda b: reduce_scatter_bucket(b, "data", mode=mode, average=True, block_size=256,
                                            block_starts=block_starts),
            mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        compiled = fn.lower(jax.ShapeDtypeStruct((N * SIZE,), jnp.bfloat16)).compile()
        _cache[key] = (parse_schedule(compiled.as_text()), compiled.memory_analysis().temp_size_in_bytes)
    return _cache[key]


def f32_sum_after(sched, index, scope="dequantize"):
    """Whether a float32 value is computed in ``scope`` after schedule ``index``."""
    return any(i > index and scope in ins.op_name and ins.dtype == "f32"
               and not ins.opcode.endswith(("start", "done"))
               for i, ins in enumerate(sched.computations[sched.entry]))


@pytest.mark.parametrize("mode", ["int8_accum", "fp8_accum"])
@pytest.mark.parametrize("block_starts", [None, LEAF_STARTS])
def test_quantized_all_to_all_moves_bytes_then_sums_in_f32(mesh, mode, block_starts):
    bf16_sched, bf16_temp = compile_bucket(mesh, "fp32_accum")
    (bf16,) = bf16_sched.collectives
    assert (bf16.kind, bf16.dtype, bf16.bytes) == ("all-to-all", "bf16", SIZE * 2)
    sched, temp = compile_bucket(mesh, mode, block_starts)
    (c,) = sched.collectives  # payload and scales in one collective
    blocks = block_partition(SIZE, N, 256, block_starts)
    assert (c.kind, c.dtype, c.bytes) == ("all-to-all", "s8", blocks.wire_bytes())
    assert c.bytes <= 0.55 * bf16.bytes, (c.bytes, bf16.bytes)
    assert f32_sum_after(sched, c.done)
    if mode == "fp8_accum":  # the payload is float8_e4m3fn, carried as its bytes
        assert any("f8e4m3fn" in ins.shape for comp in sched.computations.values() for ins in comp)
    # No per-element float32 scratch the size of the bucket beyond fp32_accum's.
    assert temp <= 1.1 * bf16_temp, (temp, bf16_temp)


@pytest.mark.parametrize("block_starts", [None, LEAF_STARTS])
def test_int8_streamed_is_point_to_point_bytes_with_small_scratch(mesh, block_starts):
    sched, temp = compile_bucket(mesh, "int8_accum_streamed", block_starts)
    bf16_sched, bf16_temp = compile_bucket(mesh, "fp32_accum_streamed")
    blocks = block_partition(SIZE, N, 256, block_starts)
    steps = sched.collectives
    assert [(c.kind, c.dtype, c.bytes) for c in steps] == [("collective-permute", "s8", blocks.wire_bytes() // N)] * (N - 1)
    assert sum(c.bytes for c in steps) <= 0.55 * sum(c.bytes for c in bf16_sched.collectives)
    assert sched.max_in_flight() <= STREAM_DEPTH
    assert temp <= bf16_temp
    assert f32_sum_after(sched, steps[-1].done, f"step{N - 1}/dequantize")

"""What is live at XLA's memory peak (:mod:`jax_drain.planner.peak`): the parser on a hand-written
dump, and on XLA's GPU compiler the drain's claim read from XLA's own liveness: drained, the
peak holds one bucket's collective scratch; undrained, every bucket's."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from helpers import remat_block_stack
from jax_drain import _compat
from jax_drain.planner.peak import parse_peak
from jax_drain.planner.schedule import parse_schedule

_MODULE = """HloModule m, is_scheduled=true

ENTRY %main (param.0: bf16[1024], param.1: f32[256]) -> f32[128] {
  %param.0 = bf16[1024]{0} parameter(0), metadata={op_name="p"}
  %param.1 = f32[256]{0} parameter(1), metadata={op_name="x"}
  %fusion.1 = f32[256]{0} fusion(%param.1), kind=kLoop, calls=%f, metadata={op_name="jit(s)/shard_map/jvp(mlp)/tanh"}
  %fusion.2 = f32[256]{0} fusion(%fusion.1), kind=kLoop, calls=%f, metadata={op_name="jit(s)/shard_map/transpose(jvp(mlp))/mul"}
  %all_to_all.3 = bf16[8,128]{1,0} all-to-all(%param.0), dimensions={0}, metadata={op_name="jit(s)/shard_map/jax_drain/bucket3/all_to_all"}
  %all-gather.4 = bf16[1024]{0} all-gather(%param.0), dimensions={0}, metadata={op_name="jit(s)/shard_map/jax_drain/gather/bucket5/all_gather"}
  %copy.5 = f32[256]{0} copy(%fusion.2)
  ROOT %fusion.6 = f32[128]{0} fusion(%copy.5), kind=kLoop, calls=%f, metadata={op_name="jit(s)/shard_map/jax_drain/bucket3/reduce_sum"}
}
"""

_LIVE_RANGES = """HloLiveRange (max 9):
  InstructionSequence:
    0:param.0
  BufferLiveRange:
    param.0{}:0-9
    param.1{}:0-9
    fusion.1{}:2-4
    fusion.2{}:3-6
    all_to_all.3{}:4-7
    all-gather.4{}:4-6
    copy.5{}:5-7
    fusion.6{}:7-9
  Live ranges at 5 (peak):
    param.0{}: 2048 bytes (cumulative: 2048 bytes)
    param.1{}: 1024 bytes (cumulative: 3072 bytes)
    fusion.2{}: 1024 bytes (cumulative: 4096 bytes)
    all_to_all.3{}: 2048 bytes (cumulative: 6144 bytes)
    all-gather.4{}: 2048 bytes (cumulative: 8192 bytes)
    copy.5{}: 1024 bytes (cumulative: 9216 bytes)
    fusion.6{}: 512 bytes (cumulative: 9728 bytes)
  Stack trace breakdown for peak usage: 9 728 bytes
"""


def test_each_buffer_at_the_peak_gets_its_kind_from_its_instruction():
    module = parse_schedule(_MODULE)
    instructions = {ins.name: ins for comp in module.computations.values() for ins in comp}
    peak = parse_peak(_LIVE_RANGES, instructions, {"param.0", "param.1"})
    assert peak.index == 5
    kinds = {b.name: b.kind for b in peak.buffers}
    assert kinds == {"param.0{}": "argument", "param.1{}": "argument", "fusion.2{}": "backward",
                     "all_to_all.3{}": "sync", "all-gather.4{}": "gather", "copy.5{}": "other",
                     "fusion.6{}": "output"}  # fusion.6 lives to the end: the step's result
    assert peak.bytes_by_kind() == {"argument": 3072, "output": 512, "sync": 2048, "gather": 2048,
                                    "backward": 1024, "forward": 0, "other": 1024}
    assert peak.temp_bytes == 2048 + 2048 + 1024 + 1024
    assert peak.sync_buckets() == [3]
    assert [b.bytes for b in peak.buffers] == sorted((b.bytes for b in peak.buffers), reverse=True)
    assert "| 2.0 KiB" not in peak.table() and "backward" in peak.table()
    with pytest.raises(ValueError, match="no 'Live ranges at N"):
        parse_peak("HloLiveRange (max 1):\n", instructions, set())


# -- on XLA's GPU compiler ------------------------------------------------------------------------

D, N = 512, 8
PARAMS, BATCH, _loss = remat_block_stack(6, D, N * 256)


@pytest.mark.gpu_compile
def test_the_drained_peak_holds_one_buckets_scratch_the_undrained_every_buckets():
    from jax_drain.planner.peak import peak_contents
    from jax_drain.planner.targets import gpu_mesh

    mesh = gpu_mesh((N,), ("data",))
    order = jd.grad_ready_order(_loss, PARAMS, BATCH)
    peaks = {}
    for drain in (True, False):
        sync = jd.GradSync(PARAMS, mesh, bucket_size=4 * D * D, reduce="fp32_accum", drain=drain, order=order)
        step = jax.jit(_compat.shard_map(sync.value_and_grad(_loss), mesh=mesh, in_specs=(P(), P("data")),
                                         out_specs=(P(), P("data"))))
        compiled, peaks[drain] = peak_contents(step.lower(PARAMS, BATCH))
        assert peaks[drain].temp_bytes <= compiled.memory_analysis().temp_size_in_bytes
    assert sync.num_buckets == 12
    bucket_bf16 = 2 * 4 * D * D  # one bucket's all-to-all buffer (bf16 wire)
    drained, undrained = peaks[True], peaks[False]
    # One bucket's buffer, and the async collective's few bytes of tuple header.
    assert len(drained.sync_buckets()) == 1 and drained.bytes_by_kind()["sync"] < 2 * bucket_bf16
    assert len(undrained.sync_buckets()) >= sync.num_buckets - 2
    assert undrained.bytes_by_kind()["sync"] >= (sync.num_buckets - 2) * bucket_bf16

"""The drain on XLA's real GPU compiler, without a GPU: compile-only 8xH100 devices.

Memory and scheduling claims come from here, never from the CPU backend (which upcasts bf16
collectives and schedules differently).
"""


import jax
import pytest
from jax.sharding import PartitionSpec as P

import jax_drain as jd
from jax_drain import _compat
from helpers import remat_block_stack
from jax_drain.collectives import STREAM_DEPTH
from jax_drain.planner.schedule import parse_schedule
from jax_drain.planner.targets import gpu_mesh

pytestmark = pytest.mark.gpu_compile  # skips without the CUDA PJRT plugin (tests/conftest.py)

LAYERS, D, N = 6, 512, 8
PARAMS, BATCH, _loss = remat_block_stack(LAYERS, D, N * 256)
# Lets XLA keep more than one async collective in flight (its default is one), so that a
# drain depth above one is visible in the schedule.
OVERLAP_4 = {"xla_gpu_experimental_parallel_collective_overlap_limit": 4}


@pytest.fixture(scope="module")
def mesh():
    return gpu_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def order():
    return jd.grad_ready_order(_loss, PARAMS, BATCH)


_cache = {}


def compile_sync(mesh, order, reduce, drain, max_in_flight=None, options=None):
    key = (reduce, drain, max_in_flight, tuple(sorted((options or {}).items())))
    if key not in _cache:
        sync = jd.GradSync(PARAMS, mesh, bucket_size=4 * D * D, reduce=reduce, drain=drain,
                           order=order, max_in_flight=max_in_flight)
        step = jax.jit(_compat.shard_map(sync.value_and_grad(_loss), mesh=mesh,
                                         in_specs=(P(), P("data")), out_specs=(P(), P("data"))))
        lowered = step.lower(PARAMS, BATCH)
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        _cache[key] = (sync, compiled.memory_analysis().temp_size_in_bytes, parse_schedule(compiled.as_text()))
    return _cache[key]


def bucket_collectives(sched, k):
    return [c for c in sched.collectives if c.in_scope(f"jax_drain/bucket{k}/")]


def f32_result_index(sched, k, after, *, collective_is_result=False):
    """Schedule index of the first float32 value computed in bucket k's scope after ``after``
    (its collective's done). With ``collective_is_result`` (a float32 wire whose mean is
    pre-divided by the device count, a power of two: nothing is left to compute) the done is the
    result when nothing follows it."""
    for i, ins in enumerate(sched.computations[sched.entry]):
        if i > after and f"jax_drain/bucket{k}/" in ins.op_name and ins.dtype == "f32" and not ins.opcode.endswith(("start", "done")):
            return i
    if collective_is_result:
        return after
    raise AssertionError(f"no f32 result for bucket {k}")


def results_before_next_start(sync, sched):
    """For each bucket k, is its f32 result computed before bucket k+1's collective starts?"""
    firsts = [min(c.start for c in bucket_collectives(sched, k)) for k in range(sync.num_buckets)]
    lasts = [max(c.done for c in bucket_collectives(sched, k)) for k in range(sync.num_buckets)]
    whole = sync.reduce == "fp32" and sync.axis_size & (sync.axis_size - 1) == 0
    return [f32_result_index(sched, k, lasts[k], collective_is_result=whole) < firsts[k + 1]
            for k in range(sync.num_buckets - 1)]


@pytest.mark.parametrize("reduce", ["bf16", "fp32", "fp32_accum"])
def test_drain_issues_one_collective_per_bucket_after_the_previous_result(mesh, order, reduce):
    sync, _, sched = compile_sync(mesh, order, reduce, drain=True)
    assert sync.num_buckets == 12
    for k in range(sync.num_buckets):
        (c,) = bucket_collectives(sched, k)  # exactly one, never merged with another bucket
        assert len(c.op_names) == 1 and c.computation == sched.entry
    assert all(results_before_next_start(sync, sched))
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) == 1
    # The chain overlaps backward: compute runs while each bucket's collective is in flight.
    assert sum(c.overlapped for c in sched.collectives if c.in_scope("jax_drain/bucket")) >= sync.num_buckets - 1


def test_without_the_drain_results_wait_and_temp_grows(mesh, order):
    sync, drained_temp, _ = compile_sync(mesh, order, "fp32_accum", drain=True)
    _, undrained_temp, sched = compile_sync(mesh, order, "fp32_accum", drain=False)
    assert not all(results_before_next_start(sync, sched))
    assert drained_temp < 0.6 * undrained_temp, (drained_temp, undrained_temp)


def test_wire_dtypes(mesh, order):
    sync, _, fp32 = compile_sync(mesh, order, "fp32", drain=True)
    _, _, accum = compile_sync(mesh, order, "fp32_accum", drain=True)
    _, _, bf16 = compile_sync(mesh, order, "bf16", drain=True)
    for k, size in enumerate(sync.bucket_sizes):
        (c,) = bucket_collectives(fp32, k)
        assert (c.kind, c.dtype, c.bytes) == ("reduce-scatter", "f32", size // N * 4)  # convert not moved after
        (c,) = bucket_collectives(accum, k)
        assert (c.kind, c.dtype, c.bytes) == ("all-to-all", "bf16", size * 2)  # bf16 wire cost
        assert f32_result_index(accum, k, c.done) > c.done  # then the local f32 sum
        (c,) = bucket_collectives(bf16, k)
        assert (c.kind, c.dtype, c.bytes) == ("reduce-scatter", "bf16", size // N * 2)


def test_no_gradient_all_reduce_on_gpu(mesh, order):
    _, _, sched = compile_sync(mesh, order, "fp32_accum", drain=True)
    all_reduces = [c for c in sched.collectives if c.kind == "all-reduce"]
    assert [(c.dtype, c.bytes) for c in all_reduces] == [("f32", 4)]  # the loss mean only


def test_streamed_mode_is_point_to_point_with_small_scratch(mesh, order):
    sync, streamed_temp, sched = compile_sync(mesh, order, "fp32_accum_streamed", drain=True)
    _, accum_temp, _ = compile_sync(mesh, order, "fp32_accum", drain=True)
    for k, size in enumerate(sync.bucket_sizes):
        steps = bucket_collectives(sched, k)
        assert [(c.kind, c.dtype, c.bytes) for c in steps] == [("collective-permute", "bf16", size // N * 2)] * (N - 1)
    assert sched.max_in_flight(lambda c: c.in_scope("jax_drain/bucket")) <= STREAM_DEPTH
    assert streamed_temp < accum_temp


def test_drain_depth(mesh, order):
    _, _, drained = compile_sync(mesh, order, "fp32_accum", drain=True)
    _, _, depth1 = compile_sync(mesh, order, "fp32_accum", drain=True, max_in_flight=1)
    describe = lambda s: [(c.kind, c.bytes, c.op_name) for c in s.collectives]
    assert describe(depth1) == describe(drained) and depth1.max_in_flight() == drained.max_in_flight()
    in_scope = lambda c: c.in_scope("jax_drain/bucket")
    for k in (1, 2, 3):
        _, _, sched = compile_sync(mesh, order, "fp32_accum", drain=True, max_in_flight=k, options=OVERLAP_4)
        assert sched.max_in_flight(in_scope) == k
    _, _, free = compile_sync(mesh, order, "fp32_accum", drain=False, options=OVERLAP_4)
    assert free.max_in_flight(in_scope) > 3


def test_backward_order_saves_memory_on_a_tied_model_with_keys_out_of_forward_order(mesh):
    """The nnx GPT with a tied embedding sorts as blocks/..., embed, ln_f: reverse pytree order
    puts the embedding (ready last) early in the chain, and every bucket after it waits."""
    from jax_drain import models
    from jax_drain.planner import plan

    config = plan.preset_config("tiny-tied", layers=4, d_model=512)
    params, batch = models.abstract_params(config), models.example_batch(config, N)
    loss_fn = models.make_loss(config)
    traced = jd.grad_ready_order(loss_fn, params, batch)
    bucket_size = plan.bucket_size_for(params, 12, N, traced)

    def temp(order):
        sync = jd.GradSync(params, mesh, bucket_size=bucket_size, order=order)
        step = jax.jit(_compat.shard_map(sync.value_and_grad(loss_fn), mesh=mesh,
                                         in_specs=(P(), P("data")), out_specs=(P(), P("data"))))
        return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp(traced) < 0.8 * temp(None)

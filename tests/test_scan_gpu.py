"""ScanGradSync on XLA's real GPU compiler, without a GPU: compile-only 8xH100 devices.

The claims of the scan issue that only the GPU pipeline can show: each layer bucket's collective
sits in the backward while body (one per bucket, not merged by XLA's combiners, followed by its
float32 sum in the same body), no gradient is all-reduced, and less temp memory than reducing
the stacked gradient after the scan.
"""

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jax_drain import _compat, models
from jax_drain.planner.schedule import parse_schedule
from jax_drain.planner.targets import gpu_mesh
from jax_drain.scan import LAYER_SCOPE, ScanGradSync
from jax_drain.sync import local_params

pytestmark = pytest.mark.gpu_compile  # skips without the CUDA PJRT plugin (tests/conftest.py)

CONFIG = models.GPTConfig(num_layers=4, d_model=256, num_heads=4, seq_len=64, scan_layers=True)
BUCKET = 300_000  # two buckets per layer: the MLP kernels, then attention and the norms


@pytest.fixture(scope="module")
def compiled():
    mesh = gpu_mesh((8,), ("data",))
    params = models.abstract_params(CONFIG)
    batch = models.example_batch(CONFIG, 8)
    loss_fn = models.make_loss(CONFIG)
    sync = ScanGradSync(params, mesh, stacked=lambda path: path.startswith("blocks/"), bucket_size=BUCKET)

    def after(p, b):
        loss, grads = jax.value_and_grad(loss_fn)(local_params(p, "data"), b)
        return jax.lax.pmean(loss, "data"), sync.reduce_scatter(grads)

    out = {}
    for name, fn in (("in_scan", sync.value_and_grad(loss_fn)), ("after", after)):
        step = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), sync.shard_specs())))
        c = step.lower(params, batch).compile()
        out[name] = (c.memory_analysis().temp_size_in_bytes, parse_schedule(c.as_text()))
    return sync, out


def test_one_collective_per_layer_bucket_inside_the_while_body(compiled):
    sync, out = compiled
    _, sched = out["in_scan"]
    assert len(sync.layer_bucket_sizes) == 2
    layer = [c for c in sched.collectives if c.in_scope(LAYER_SCOPE)]
    assert layer and all(c.computation != sched.entry for c in layer)  # all inside a loop body
    assert len({c.computation for c in layer}) == 1
    buckets = [int(re.search(r"/layers/bucket(\d+)/", c.op_names[0]).group(1)) for c in layer]
    assert sorted(buckets) == [0, 1]  # one each: nothing merged, nothing split
    assert all(len(c.op_names) == 1 for c in layer)
    assert {(c.kind, c.dtype) for c in layer} == {("all-to-all", "bf16")}  # fp32_accum: bf16 wire
    assert all(sched.feeds_f32_reduce(c) for c in layer)  # ...and the f32 sum in the same body
    assert sched.max_in_flight(lambda c: c.in_scope(LAYER_SCOPE)) == 1  # drained inside the body
    # No gradient all-reduce anywhere: only the scalar loss mean.
    assert [(c.dtype, c.bytes) for c in sched.collectives if c.kind == "all-reduce"] == [("f32", 4)]


def test_less_temp_than_reducing_the_stacked_gradient(compiled):
    _, out = compiled
    in_scan, after = out["in_scan"][0], out["after"][0]
    assert in_scan < 0.6 * after, (in_scan, after)
    # After the scan every layer's buckets run in the ENTRY computation instead.
    _, sched = out["after"]
    assert all(c.computation == sched.entry for c in sched.collectives if c.in_scope(LAYER_SCOPE))

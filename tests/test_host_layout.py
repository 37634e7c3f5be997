"""Where a described layout puts each parameter element on the host: per-parameter runs that
read and write exactly that parameter's stored positions, on every kind of chain (data-parallel,
split leaves, tensor-parallel, data-major, a scanned stack's layer rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from jax_drain._host_layout import (
    host_from_params, host_to_params, param_placements, read_param, shard_array_shapes, write_param,
)

SDS = jax.ShapeDtypeStruct
PARAMS = {"w1": SDS((32, 64), jnp.float32), "b": SDS((64,), jnp.float32), "w2": SDS((64, 32), jnp.float32)}
SPECS = {"w1": P(None, "model"), "b": P("model"), "w2": P("model", None)}
STACK = {"embed": SDS((13, 11), jnp.float32), "head": SDS((11, 5), jnp.float32),
         "blocks": {"w": SDS((3, 11, 12), jnp.float32), "g": SDS((3, 11), jnp.float32)}}
STACK_SPECS = {"embed": None, "head": None, "blocks": {"w": P(None, None, "model"), "g": None}}


def _mesh(cpu_devices, shape, names):
    return Mesh(np.array(cpu_devices).reshape(shape), names)


SYNCS = {
    "data": lambda d: jd.GradSync(PARAMS, _mesh(d, (8,), ("data",)), bucket_size=1000),
    "split_leaves": lambda d: jd.GradSync(PARAMS, _mesh(d, (8,), ("data",)), bucket_size=1000, split_leaves=True),
    "tensor_parallel": lambda d: jd.GradSync(PARAMS, _mesh(d, (4, 2), ("data", "model")), bucket_size=700,
                                             param_specs=SPECS),
    "gspmd_data_major": lambda d: jd.GradSync(PARAMS, _mesh(d, (4, 2), ("data", "model")), bucket_size=700,
                                              param_specs=SPECS, tensor_parallel="gspmd"),
    "scanned_gspmd": lambda d: jd.ScanGradSync(STACK, _mesh(d, (4, 2), ("data", "model")), bucket_size=20,
                                               stacked=lambda path: path.startswith("blocks/"),
                                               param_specs=STACK_SPECS, tensor_parallel="gspmd"),
}


@pytest.mark.parametrize("kind", list(SYNCS))
def test_parameters_go_to_their_runs_and_come_back(kind, cpu_devices):
    """Random parameters written into the shard arrays and read back, each from its own runs
    alone: the same values; every stored position is some parameter's or padding (zero), and
    no two parameters share one."""
    description = SYNCS[kind](cpu_devices).description
    if kind == "gspmd_data_major":
        assert description[0].get("data_major")
    placements = param_placements(description)
    rng = np.random.default_rng(0)
    params = {path: rng.normal(size=p.global_shape).astype(np.float32) for path, p in placements.items()}
    arrays = host_from_params(description, params, np.float32)
    assert [a.shape for a in arrays] == shard_array_shapes(description)
    owner = [np.full(a.shape, -1) for a in arrays]
    for k, placement in enumerate(placements.values()):
        for block in placement.blocks:
            for run in block.runs:
                taken = owner[run.array][..., run.lo:run.hi]
                assert np.all((taken == -1) | (taken == k)), f"{kind}: parameters share stored positions"
                owner[run.array][..., run.lo:run.hi] = k
    for a, o in zip(arrays, owner):
        assert np.all(a[o == -1] == 0)  # padding
    for path, placement in placements.items():
        reads = []

        def read(i, lo, hi):
            reads.append(hi - lo)
            return arrays[i][..., lo:hi]

        np.testing.assert_array_equal(read_param(placement, read), params[path])
        distinct = {tuple((s.start, s.stop) for s in b.index) for b in placement.blocks}
        rows = int(np.prod(placement.global_shape[:placement.rows]))
        block_size = int(np.prod(placement.blocks[0].shape))
        assert rows * sum(reads) == len(distinct) * block_size, f"{path}: read more than its blocks"
    assert host_to_params(description, arrays).keys() == params.keys()


def test_write_param_refuses_another_shape(cpu_devices):
    placement = param_placements(SYNCS["data"](cpu_devices).description)["w1"]
    with pytest.raises(ValueError, match=r"shape \(32, 64\)"):
        write_param(placement, np.zeros((64, 32), np.float32), lambda *a: None)

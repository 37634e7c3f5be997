"""Per-bucket reduce-scatter modes against a float64 reference, on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import data_mesh
from jax_drain import _compat
from jax_drain.collectives import REDUCE_MODES, reduce_scatter_bucket


def _run(mode: str, stacked: jax.Array, n: int, average: bool) -> np.ndarray:
    mesh = data_mesh(n)
    fn = jax.jit(
        _compat.shard_map(
            lambda x: reduce_scatter_bucket(x[0], "data", mode=mode, average=average),
            mesh=mesh, in_specs=P("data"), out_specs=P("data"),
        )
    )
    out = fn(stacked)
    assert out.dtype == jnp.float32
    return np.asarray(out)


def _stacked(n: int, size: int, seed: int = 0) -> jax.Array:
    rng = np.random.default_rng(seed)
    # Mixed magnitudes, so a bf16-rounded sum visibly differs from an fp32-accumulated one.
    values = rng.normal(size=(n, size)) * np.exp(rng.uniform(-3, 3, size=(n, size)))
    return jnp.asarray(values, jnp.bfloat16)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", REDUCE_MODES)
@pytest.mark.parametrize("average", [True, False])
def test_fp32_modes_match_float64_reference(mode, n, average):
    stacked = _stacked(n, 1024 * n)
    ref = np.asarray(stacked, np.float64).sum(axis=0) / (n if average else 1)
    out = _run(mode, stacked, n, average)
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    if mode.startswith("fp32") or n == 1:
        assert err <= 1e-6, f"{mode}: relative error {err:.2e}"
    else:
        # bf16 rounds the sum to 8 mantissa bits: far from the reference.
        assert err > 1e-4, f"bf16 unexpectedly exact ({err:.2e}); the test data is too easy"
        assert err < 2e-2


@pytest.mark.parametrize("mode", ["fp32_accum", "fp32_accum_streamed"])
def test_fp32_accumulating_modes_agree_with_fp32(mode):
    stacked = _stacked(8, 8192, seed=3)
    a = _run("fp32", stacked, 8, True)
    b = _run(mode, stacked, 8, True)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.max(np.abs(a)))


def test_device_r_holds_chunk_r():
    # Distinct values per position: a wrong chunk assignment cannot pass.
    n, size = 8, 8 * 128
    stacked = jnp.asarray(np.arange(n * size).reshape(n, size) % 251 + 1.5, jnp.float32)
    for mode in REDUCE_MODES:
        out = _run(mode, stacked, n, average=False)
        np.testing.assert_array_equal(out, np.asarray(stacked, np.float64).sum(axis=0))


def test_rejects_unknown_mode_and_bad_shapes():
    mesh = data_mesh(8)
    with pytest.raises(ValueError, match="unknown reduce mode 'fp16'"):
        reduce_scatter_bucket(jnp.ones(8), "data", mode="fp16", average=True)

    def call(x):
        return reduce_scatter_bucket(x[0], "data", mode="fp32", average=True)

    fn = _compat.shard_map(call, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match="does not split over 8 devices"):
        jax.jit(fn).lower(jax.ShapeDtypeStruct((8, 12), jnp.float32))
    with pytest.raises(ValueError, match="a bucket is 1-D"):
        jax.jit(fn).lower(jax.ShapeDtypeStruct((8, 4, 8), jnp.float32))

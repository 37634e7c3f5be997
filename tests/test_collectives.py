"""Per-bucket reduce-scatter modes against a float64 reference, on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import data_mesh
from helpers import assert_tree_close
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


# A bucket is laid out as leaves of odd sizes and very different scales, then a long tail of
# mixed magnitudes; each part is checked on its own, never against the bucket's largest value.
PARTS = (("norm", 7, 1e-3), ("bias", 13, 1.0), ("head", 97, 30.0), ("cube", 3 * 5 * 7, 1e-2), ("rest", None, None))


def _parts(bucket) -> dict[str, np.ndarray]:
    """Splits the last axis of ``bucket`` into the named parts of ``PARTS``."""
    out, start = {}, 0
    for name, size, _ in PARTS:
        stop = bucket.shape[-1] if size is None else start + size
        out[name] = bucket[..., start:stop]
        start = stop
    return out


def _stacked(n: int, size: int, seed: int = 0, dtype=jnp.bfloat16) -> jax.Array:
    rng = np.random.default_rng(seed)
    parts = []
    for _, part, scale in PARTS:
        if part is None:  # mixed magnitudes, so a bf16-rounded sum visibly differs from an fp32 one
            part = size - sum(p for _, p, _ in PARTS if p)
            parts.append(rng.normal(size=(n, part)) * np.exp(rng.uniform(-3, 3, size=(n, part))))
        else:
            parts.append(rng.normal(size=(n, part)) * scale)
    return jnp.asarray(np.concatenate(parts, axis=1), dtype)


def _reference(stacked: jax.Array, average: bool):
    """float64 sum (mean) over devices, per part, and the per-element error scale (the sum of
    |x| over devices: a float32 sum that cancels to near zero keeps errors of that size)."""
    x = np.asarray(stacked, np.float64)
    divisor = x.shape[0] if average else 1
    return _parts(x.sum(axis=0) / divisor), _parts(np.abs(x).sum(axis=0) / divisor)


def _assert_parts_close(out, ref, magnitude, rtol, what, atol=None):
    """Each part within ``rtol`` of its norm; per element ``rtol`` of itself plus ``atol``
    (default ``rtol``) times the sum of |x| over devices."""
    atol = rtol if atol is None else atol
    return assert_tree_close(_parts(out), ref, rtol,
                             atol={k: atol * m for k, m in magnitude.items()}, what=what)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", REDUCE_MODES)
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp32_modes_match_float64_reference(mode, n, average, dtype):
    stacked = _stacked(n, 1024 * n, dtype=dtype)
    ref, magnitude = _reference(stacked, average)
    out = _run(mode, stacked, n, average)
    if mode.startswith("fp32") or n == 1 or dtype == jnp.float32:
        # float32 sums (bf16 mode sums a float32 bucket in float32 too): 1e-6 of each part.
        _assert_parts_close(out, ref, magnitude, 1e-6, f"{mode}, n={n}, {jnp.dtype(dtype)}")
    else:
        # bf16 rounds the sum to 8 mantissa bits: every part far from the reference, each
        # within bf16's precision (per element: rounded at each step of a ring on GPUs).
        errors = _assert_parts_close(out, ref, magnitude, 1e-2, f"{mode}, n={n}", atol=2e-2)
        easy = {k: e for k, e in errors.items() if e <= 1e-4}
        assert not easy, f"bf16 unexpectedly exact on {easy}; the test data is too easy"


@pytest.mark.parametrize("mode", ["fp32_accum", "fp32_accum_streamed"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp32_accumulating_modes_agree_with_fp32(mode, dtype):
    stacked = _stacked(8, 8192, seed=3, dtype=dtype)
    _, magnitude = _reference(stacked, True)
    a = _run("fp32", stacked, 8, True)
    b = _run(mode, stacked, 8, True)
    _assert_parts_close(b, _parts(a), magnitude, 1e-6, f"{mode} vs fp32")


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

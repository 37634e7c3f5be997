"""Per-bucket reduce-scatter modes against a float64 reference, on 8 virtual CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import data_mesh
from helpers import EPS32, assert_bf16_sum_close, assert_tree_close, part_slices
from jax_drain import _compat
from jax_drain.collectives import QUANTIZED_MODES, REDUCE_MODES, reduce_scatter_bucket

# The modes whose only rounding is float32's (and bf16's); the quantized ones are tested below.
EXACT_MODES = tuple(m for m in REDUCE_MODES if m not in QUANTIZED_MODES)


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


def _assert_parts_close(out, ref, magnitude, rtol, what):
    """Each part within ``rtol`` of its norm; per element ``rtol`` of itself plus ``rtol`` times
    the sum of |x| over devices."""
    return assert_tree_close(_parts(out), ref, rtol, atol={k: rtol * m for k, m in magnitude.items()}, what=what)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp32_modes_match_float64_reference(mode, n, average, dtype):
    stacked = _stacked(n, 1024 * n, dtype=dtype)
    ref, magnitude = _reference(stacked, average)
    out = _run(mode, stacked, n, average)
    if mode.startswith("fp32") or n == 1 or dtype == jnp.float32:
        # float32 sums of n devices' terms (bf16 mode sums a float32 bucket in float32 too) and
        # the mean's division: n + 1 roundings of the terms' magnitude.
        _assert_parts_close(out, ref, magnitude, (n + 1) * EPS32, f"{mode}, n={n}, {jnp.dtype(dtype)}")
    else:
        # bf16 rounds the sum to 8 significant bits: every part far from the reference, each
        # within bf16's precision (the terms' cast, each step of a ring on GPUs, the mean).
        errors = assert_bf16_sum_close(_parts(out), ref, magnitude, roundings=n + 1, what=f"{mode}, n={n}")
        easy = {k: e for k, e in errors.items() if e <= 1e-4}
        assert not easy, f"bf16 unexpectedly exact on {easy}; the test data is too easy"


@pytest.mark.parametrize("mode", ["fp32_accum", "fp32_accum_streamed"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp32_accumulating_modes_agree_with_fp32(mode, dtype):
    stacked = _stacked(8, 8192, seed=3, dtype=dtype)
    _, magnitude = _reference(stacked, True)
    a = _run("fp32", stacked, 8, True)
    b = _run(mode, stacked, 8, True)
    _assert_parts_close(b, _parts(a), magnitude, 9 * EPS32, f"{mode} vs fp32")  # 8 additions and the mean


def test_device_r_holds_chunk_r():
    # Distinct values per position: a wrong chunk assignment cannot pass.
    n, size = 8, 8 * 128
    stacked = jnp.asarray(np.arange(n * size).reshape(n, size) % 251 + 1.5, jnp.float32)
    for mode in EXACT_MODES:
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


# -- quantized wire: int8_accum, fp8_accum, fp16_accum, int8_accum_streamed ----------------------

from jax_drain._jaxpr import collective_dependencies  # noqa: E402
from jax_drain.collectives import STREAM_DEPTH, block_partition  # noqa: E402

# The largest magnitude a block's absmax maps to (the scale is absmax / QMAX), per mode.
QMAX = {"int8_accum": 127.0, "int8_accum_streamed": 127.0, "fp8_accum": 448.0, "fp16_accum": 65504.0}
# Per-leaf relative error allowed (against the leaf's own norm): about each payload's relative
# rounding (int8: 1/254 of the block's absmax; fp8: 2**-4; fp16: 2**-11).
LEAF_RTOL = {"int8_accum": 1e-2, "int8_accum_streamed": 1e-2, "fp8_accum": 5e-2, "fp16_accum": 2.0**-11}

# One bucket of leaves of very different scales laid out back to back, as the sync lays them
# out: (name, size, scale). Leaves start mid-block and straddle chunk boundaries; "outlier"
# holds one value 1e4 times its scale; "mid" fills the rest.
LEAVES = (("tiny", 300, 1e-4), ("huge", 1000, 1e2), ("odd", 77, 1.0), ("small", 513, 1e-3),
          ("outlier", 1100, 1.0), ("mid", None, 1e-1))
OUTLIER_AT = 1890 + 400  # an element of "outlier" (which starts at 1890)


def _leaf_slices(size: int) -> dict[str, slice]:
    return part_slices(LEAVES, size)


def _leaf_offsets(size: int) -> tuple[int, ...]:
    """What the sync passes as ``block_starts``: every leaf's offset in the bucket."""
    return tuple(s.start for s in _leaf_slices(size).values())


def _leaf_bucket(n: int, size: int, seed: int = 0, dtype=jnp.bfloat16, outlier: bool = True) -> jax.Array:
    """Per-device buckets ``[n, size]`` of LEAVES: normal values times the leaf's scale times a
    per-device factor in [0.5, 2), so devices' scales differ."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, size))
    for name, s in _leaf_slices(size).items():
        scale = dict((k, v) for k, _, v in LEAVES)[name]
        x[:, s] = rng.normal(size=(n, s.stop - s.start)) * scale * rng.uniform(0.5, 2.0, size=(n, 1))
    if outlier:
        x[n // 2, OUTLIER_AT] = 1e4
    return jnp.asarray(x, dtype)


def _run_q(mode: str, stacked: jax.Array, average: bool = False, **options) -> np.ndarray:
    """``reduce_scatter_bucket`` over the first ``stacked.shape[0]`` CPU devices: the whole
    reduced bucket (device r's shard at its chunk r)."""
    mesh = data_mesh(stacked.shape[0])
    fn = jax.jit(_compat.shard_map(
        lambda x: reduce_scatter_bucket(x[0], "data", mode=mode, average=average, **options),
        mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    out = fn(stacked)
    assert out.dtype == jnp.float32 and out.shape == stacked.shape[1:]
    return np.asarray(out)


def _reference_blocks(size: int, n: int, block_size: int, block_starts=()) -> list[tuple[int, int]]:
    """The documented rule, written out the slow way: a block starts at every chunk start,
    every block_size elements from it, and at every block_starts offset; it ends at the next."""
    chunk = size // n
    starts = {k * chunk + t for k in range(n) for t in range(0, chunk, block_size)} | {
        b for b in block_starts if b < size}
    starts = sorted(starts)
    return list(zip(starts, starts[1:] + [size]))


def _device_scales(stacked, mode, blocks) -> np.ndarray:
    """float64 ``[n, size]``: each device's scale of each element's block (the absmax of its
    finite values / QMAX)."""
    x = np.abs(np.asarray(stacked, np.float64))
    x[~np.isfinite(x)] = 0.0
    out = np.zeros_like(x)
    for a, b in blocks:
        out[:, a:b] = x[:, a:b].max(axis=1, keepdims=True) / QMAX[mode]
    return out


def _error_bound(x: np.ndarray, scales: np.ndarray, mode: str) -> np.ndarray:
    """The documented per-element error bound of the sum over devices of ``x`` ``[n, size]``,
    given each device's block scales: int8 ``sum_j s_j / 2``, fp8 ``sum_j (|x_j| / 16 + s_j /
    1024)``, fp16 ``sum_j (|x_j| / 2048 + s_j * 2**-25)``, plus float32 rounding."""
    if mode.startswith("int8"):
        bound = (scales * (0.5 + 1e-5)).sum(axis=0)
    elif mode == "fp16_accum":
        bound = (np.abs(x) / 2048 + scales * 2.0**-25).sum(axis=0) * (1 + 1e-5)
    else:
        bound = (np.abs(x) / 16 + scales / 1024).sum(axis=0) * (1 + 1e-5)
    return bound + 1e-6 * (np.abs(x) + scales).sum(axis=0)


def _leaf_errors(out, ref, size: int) -> dict[str, float]:
    return {name: float(np.linalg.norm(out[s] - ref[s]) / np.linalg.norm(ref[s]))
            for name, s in _leaf_slices(size).items()}


def test_block_partition_follows_the_documented_rule():
    assert block_partition(16, 2, 4, (3, 13)).bucket_starts().tolist() == [0, 3, 4, 8, 12, 13]
    rng = np.random.default_rng(0)
    for n, chunk, block_size in [(1, 37, 8), (2, 64, 16), (4, 100, 32), (8, 1000, 256), (8, 1024, 256), (3, 9, 10)]:
        size = n * chunk
        for cuts in (0, 1, 5, 40):
            starts = tuple(int(b) for b in rng.integers(0, size + 1, size=cuts))
            got = block_partition(size, n, block_size, starts)
            want = _reference_blocks(size, n, block_size, starts)
            assert got.bucket_starts().tolist() == [a for a, _ in want], (n, chunk, block_size, starts)
            assert max(got.blocks_per_chunk) == got.num_blocks
            assert got.wire_bytes() == n * (chunk + 4 * got.num_blocks)
            assert got.wire_bytes(2) == n * (2 * chunk + 4 * got.num_blocks)
            assert all(b - a <= block_size for a, b in want)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        block_partition(16, 2, 0)
    with pytest.raises(ValueError, match=r"block_starts must lie in \[0, 16\]"):
        block_partition(16, 2, 4, (3, 17))
    with pytest.raises(ValueError, match=r"block_starts must lie in \[0, 16\]"):
        block_partition(16, 2, 4, (-1,))


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("block_size", [256, 100])
def test_quantized_leaves_of_very_different_scales_within_their_own_norms(mode, n, block_size):
    size = 8192
    stacked = _leaf_bucket(n, size, seed=n)
    ref = np.asarray(stacked, np.float64).sum(axis=0)
    out = _run_q(mode, stacked, block_size=block_size, block_starts=_leaf_offsets(size))
    errors = _leaf_errors(out, ref, size)
    bad = {k: e for k, e in errors.items() if not e <= LEAF_RTOL[mode]}
    assert not bad, f"{mode}, n={n}, block_size={block_size}: leaves over {LEAF_RTOL[mode]}: {bad}"
    # The blocks around the outlier keep their precision: the rest of its leaf, on its own norm.
    blocks = _reference_blocks(size, n, block_size, _leaf_offsets(size))
    a, b = next((a, b) for a, b in blocks if a <= OUTLIER_AT < b)
    rest = np.r_[_leaf_slices(size)["outlier"]]
    rest = rest[(rest < a) | (rest >= b)]
    rel = np.linalg.norm(out[rest] - ref[rest]) / np.linalg.norm(ref[rest])
    assert rel <= LEAF_RTOL[mode], (mode, rel)
    # Not float32-exact: the data exercises the quantization.
    assert max(errors.values()) > 1e-4


def test_fp16_wire_keeps_gradients_from_1e_7_to_1e6_within_its_bound():
    """The float16 wire is scaled per block: leaves from 1e-7 to 1e6 (float16's range is
    6e-8 to 65504) all arrive within the documented bound, relative error about 2**-11, where an
    unscaled float16 cast would give inf for one and zero or a few digits for others."""
    n, size = 8, 8 * 1024
    rng = np.random.default_rng(9)
    magnitudes = np.repeat([1e-7, 1e-5, 1e-2, 1e2, 1e6], -(-size // 5))[:size]
    x = rng.normal(size=(n, size)) * magnitudes * rng.uniform(0.5, 2.0, size=(n, 1))
    stacked = jnp.asarray(x, jnp.float32)
    starts = tuple(np.flatnonzero(np.diff(magnitudes, prepend=0)))
    out = _run_q("fp16_accum", stacked, block_starts=starts)
    ref = np.asarray(stacked, np.float64).sum(axis=0)
    bound = _error_bound(np.asarray(stacked, np.float64), _device_scales(stacked, "fp16_accum",
                                                                       _reference_blocks(size, n, 256, starts)), "fp16_accum")
    assert np.all(np.abs(out - ref) <= bound)
    for m in np.unique(magnitudes):
        part = magnitudes == m
        rel = np.linalg.norm(out[part] - ref[part]) / np.linalg.norm(ref[part])
        assert 1e-6 < rel <= 2.0**-11, (m, rel)  # float16's rounding, not float32's, and no more
    unscaled = np.asarray(jnp.asarray(stacked, jnp.float16), np.float64)  # what an unscaled float16 wire sends
    assert np.any(np.isinf(unscaled)) and np.any((unscaled == 0) & (np.asarray(stacked) != 0))


@pytest.mark.parametrize("mode", ["int8_accum", "fp8_accum"])
def test_without_leaf_aligned_blocks_a_small_leaf_is_lost(mode):
    """A 1e-4-scale leaf inside blocks shared with a 1e2-scale leaf rounds to nothing: the
    reason the sync passes its leaves' offsets as ``block_starts``."""
    n, size = 8, 8 * 512
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, size)) * 1e2
    small = slice(60, 188)  # inside the first 256-element block of chunk 0
    x[:, small] = rng.normal(size=(n, 128)) * 1e-4
    stacked = jnp.asarray(x, jnp.bfloat16)
    ref = np.asarray(stacked, np.float64).sum(axis=0)
    rel = lambda out: np.linalg.norm(out[small] - ref[small]) / np.linalg.norm(ref[small])
    unaligned = rel(_run_q(mode, stacked))
    aligned = rel(_run_q(mode, stacked, block_starts=(0, small.start, small.stop)))
    assert unaligned > 0.9, unaligned
    assert aligned <= LEAF_RTOL[mode], aligned


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
@pytest.mark.parametrize("block_size", [256, 100])
def test_quantized_error_bound_per_element(mode, block_size):
    """int8: |error| <= sum_j s_j / 2; fp8: |error| <= sum_j (|x_j| / 16 + s_j / 1024), with
    s_j device j's scale of the element's block; plus float32 rounding."""
    n, size = 8, 8192
    stacked = _leaf_bucket(n, size, seed=11)
    starts = _leaf_offsets(size)
    out = _run_q(mode, stacked, block_size=block_size, block_starts=starts)
    x = np.asarray(stacked, np.float64)
    ref = x.sum(axis=0)
    bound = _error_bound(x, _device_scales(stacked, mode, _reference_blocks(size, n, block_size, starts)), mode)
    ratio = np.abs(out - ref) / bound
    worst = int(np.argmax(ratio))
    assert ratio[worst] <= 1, f"element {worst}: |error| {abs(out[worst] - ref[worst]):.3e} > bound {bound[worst]:.3e}"
    assert ratio.max() > 0.2  # the bound is not vacuous


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_quantized_zeros_stay_zero_and_non_finite_values_stay_in_their_element(mode):
    n, size, block_size = 8, 8 * 512, 128
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, size))
    frozen = slice(600, 900)  # a leaf with zero gradient everywhere
    x[:, frozen] = 0.0
    holes = rng.choice(np.r_[1000:size], size=50, replace=False)  # zero on every device
    x[:, holes] = 0.0
    specials = {1500: (3, np.inf), 3000: (5, np.nan), 200: (0, -np.inf)}
    for at, (device, value) in specials.items():
        x[device, at] = value
    stacked = jnp.asarray(x, jnp.bfloat16)
    starts = (0, frozen.start, frozen.stop)
    out = _run_q(mode, stacked, block_size=block_size, block_starts=starts)

    # Exactly the non-finite elements come out non-finite (NaN: a sum holding one device's inf
    # is inf, but neither wire format carries the sign of an inf); their blocks' other elements
    # are scaled by the finite values alone, so they meet the finite error bound.
    poisoned = np.zeros(size, bool)
    poisoned[list(specials)] = True
    assert np.all(np.isnan(out[poisoned]))
    np.testing.assert_array_equal(~np.isfinite(out), poisoned)
    assert np.all(out[frozen] == 0) and len(holes) > 40 and np.all(out[holes] == 0)
    ref = np.asarray(stacked, np.float64).sum(axis=0)
    ok = ~poisoned
    assert np.linalg.norm(out[ok] - ref[ok]) / np.linalg.norm(ref[ok]) <= LEAF_RTOL[mode]
    # Every block's scale comes from its finite values alone: each finite element, in the
    # blocks of the non-finite ones too, meets the per-element bound of that scale.
    scales = _device_scales(stacked, mode, _reference_blocks(size, n, block_size, starts))
    bound = _error_bound(np.asarray(stacked, np.float64)[:, ok], scales[:, ok], mode)
    assert np.all(np.abs(out[ok] - ref[ok]) <= bound)


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_quantized_device_r_holds_chunk_r_exactly(mode):
    """Values the wire format carries exactly (every block's absmax is QMAX, so its scale is 1):
    the sum is exact, so a wrong chunk or block assignment cannot pass."""
    n, size, block_size = 8, 8 * 1000, 256
    rng = np.random.default_rng(3)
    if mode.startswith("int8"):
        values = np.arange(-127, 128)
    elif mode == "fp16_accum":  # integers are exact in float16 up to 2048, and their sums of 8 in float32
        values = np.arange(-2048, 2049)
    else:  # float8_e4m3fn values up to 448
        values = np.unique(np.asarray(jnp.asarray(np.linspace(-448, 448, 2001), jnp.float8_e4m3fn), np.float64))
    x = rng.choice(values, size=(n, size)).astype(np.float64)
    for a, _ in _reference_blocks(size, n, block_size):
        x[:, a] = QMAX[mode]
    stacked = jnp.asarray(x, jnp.float32)
    np.testing.assert_array_equal(_run_q(mode, stacked, block_size=block_size), x.sum(axis=0))


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_quantized_average_one_device_and_determinism(mode):
    size = 8192
    stacked = _leaf_bucket(8, size, seed=2)
    starts = _leaf_offsets(size)
    total = _run_q(mode, stacked, block_starts=starts)
    np.testing.assert_array_equal(_run_q(mode, stacked, block_starts=starts), total)  # recompiled: same bits
    np.testing.assert_array_equal(_run_q(mode, stacked, average=True, block_starts=starts), total / 8)
    # Over one device nothing is sent, so nothing is quantized.
    one = _leaf_bucket(1, size, seed=2)
    np.testing.assert_array_equal(_run_q(mode, one, block_starts=starts), np.asarray(one[0], np.float32))


@pytest.mark.parametrize("block_size", [256, 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_int8_streamed_agrees_with_all_to_all_to_float32_rounding(block_size, aligned):
    n, size = 8, 8000
    stacked = _leaf_bucket(n, size, seed=4)
    starts = _leaf_offsets(size) if aligned else None
    a = _run_q("int8_accum", stacked, block_size=block_size, block_starts=starts)
    b = _run_q("int8_accum_streamed", stacked, block_size=block_size, block_starts=starts)
    # The same dequantized values summed in another order: float32 rounding of sum |x_j| (+ s_j).
    x = np.asarray(stacked, np.float64)
    s = _device_scales(stacked, "int8_accum", _reference_blocks(size, n, block_size, starts or ()))
    np.testing.assert_array_less(np.abs(a - b), 1e-6 * (np.abs(x) + s).sum(axis=0) + 1e-30)
    assert not np.array_equal(a, b) or n == 1  # a different order, really


def test_int8_streamed_steps_are_fenced_two_deep():
    """Step ``s``'s point-to-point transfer waits for the sum of step ``s - STREAM_DEPTH``."""
    n = 8
    step_of = lambda e: (m.group(1) if (m := re.search(r"step(\d+)", str(e.source_info.name_stack))) else None)
    fn = _compat.shard_map(
        lambda x: reduce_scatter_bucket(x[0], "data", mode="int8_accum_streamed", average=False,
                                        block_starts=(0, 100, 3000)),
        mesh=data_mesh(n), in_specs=P("data"), out_specs=P("data"))
    deps = collective_dependencies(jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n, 8000), jnp.bfloat16)).jaxpr, label=step_of)
    assert set(deps) == {str(s) for s in range(1, n)}
    for s in range(1, n):
        assert deps[str(s)] == {str(t) for t in range(1, s - STREAM_DEPTH + 1)}, (s, deps[str(s)])


def test_quantized_modes_reject_bad_blocks():
    mesh = data_mesh(8)
    for options, match in [({"block_size": 0}, "block_size must be a positive int"),
                           ({"block_starts": (0, 9000)}, r"block_starts must lie in \[0, 8192\]")]:
        fn = _compat.shard_map(lambda x: reduce_scatter_bucket(x[0], "data", mode="int8_accum", average=True, **options),
                               mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        with pytest.raises(ValueError, match=match):
            jax.jit(fn).lower(jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16))

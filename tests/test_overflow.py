"""A finite mean stays finite: at the float32 and float16 range limits, where the sum over the
devices overflows and the mean does not, every reduce mode (and the hierarchical two-stage
reduce) returns the float64 mean within its derived rounding bound, on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_drain as jd
from conftest import data_mesh
from helpers import EPS32, assert_within, leaves_of, part_slices
from jax_drain import _compat
from jax_drain.collectives import QUANTIZED_MODES, REDUCE_MODES, block_partition, mean_predivisor, reduce_scatter_bucket

# float16's subnormal step is 2**-24: a value rounded to the subnormal grid moves by <= 2**-25.
HALF_SUBNORMAL16 = 2.0 ** -25
QMAX = {"int8_accum": 127.0, "int8_accum_streamed": 127.0, "fp8_accum": 448.0, "fp16_accum": 65504.0}

# A bucket's parts, each its own quantization blocks: (name, size, magnitudes as fractions of the
# dtype's largest finite value, or None for ordinary mixed-sign values). "half": every device
# sends the same sign, so the sum of 6 or 8 is 1.5 to 4 times the largest finite value; "top":
# the mean is within 25% of it (further than any mode's rounding can move a mean).
PARTS = (("half", 600, (0.25, 0.5)), ("top", 300, (0.75, 0.875)), ("ordinary", None, None))


def _slices(size: int) -> dict[str, slice]:
    return part_slices(PARTS, size)


def _values(rng: np.random.Generator, n: int, shape: tuple[int, ...], fractions, top: float) -> np.ndarray:
    """``[n, *shape]`` float64: magnitudes in ``fractions`` of ``top`` with one sign per element
    shared by the devices; or, for ``fractions=None``, mixed signs over six orders of magnitude."""
    if fractions is None:
        return rng.normal(size=(n, *shape)) * np.exp(rng.uniform(-3, 3, size=(n, *shape)))
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(*fractions, size=(n, *shape)) * top


def _near_the_top(n: int, size: int, dtype, seed: int = 0) -> jax.Array:
    """Per-device buckets ``[n, size]`` in ``dtype`` laid out as ``PARTS``."""
    rng = np.random.default_rng(seed)
    top = float(jnp.finfo(dtype).max)
    x = np.zeros((n, size))
    for (_, _, fractions), s in zip(PARTS, _slices(size).values()):
        x[:, s] = _values(rng, n, (s.stop - s.start,), fractions, top)
    return jnp.asarray(x, dtype)


def _mean(stacked) -> tuple[np.ndarray, np.ndarray]:
    """float64 mean over the devices and the mean of ``|x|`` (what a sum's rounding scales with)."""
    x = np.asarray(stacked, np.float64)
    return x.mean(axis=0), np.abs(x).mean(axis=0)


def _mean_bound(mode: str, dtype, x: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """Per element, how far ``mode``'s mean over the ``n`` devices of ``x`` (float64 ``[n, ...]``,
    every value already in the summed ``dtype``) may be from the float64 mean, from its roundings
    (``u``: half the summed dtype's epsilon, ``m``: the mean of ``|x|``):

    * a sum in float32, bf16 or float16: ``n - 1`` additions and the mean's division (two
      roundings where XLA multiplies by the rounded reciprocal), ``(n + 1) u m``; in float16 also
      the subnormals: each device's value divided by ``p`` and each partial sum may round to
      the subnormal grid, ``2**-25`` each before the mean's ``p / n`` (the pre-divide's one cost);
    * quantized (``scales``: each device's scale ``s`` of the element's block): each device's
      rounding in its block (int8: ``s / 2``; fp8: ``|x| / 16 + s / 1024``; fp16: ``|x| / 2048 +
      s * 2**-25``) over ``n``, plus the
      float32 sum's ``n + 1`` roundings and the quantizer's three of float32 per value (the
      quotient by the scale, the scale, the product) of ``m + mean(s)``: within ``2 (n + 1) u``.
    """
    n = x.shape[0]
    magnitude = np.abs(x).mean(axis=0)
    if mode in QUANTIZED_MODES:
        if mode.startswith("int8"):
            own = scales / 2
        elif mode == "fp16_accum":
            own = np.abs(x) / 2048 + scales * HALF_SUBNORMAL16
        else:
            own = np.abs(x) / 16 + scales / 1024
        return own.mean(axis=0) + (n + 1) * EPS32 * (magnitude + scales.mean(axis=0))
    summed = jnp.dtype(dtype) if mode == "bf16" else jnp.dtype(jnp.float32)
    bound = (n + 1) * float(jnp.finfo(summed).eps) / 2 * magnitude
    if summed == jnp.float16:
        bound = bound + (2 * n - 1) * mean_predivisor(n) / n * HALF_SUBNORMAL16
    return bound


def _bound(mode: str, stacked, blocks: np.ndarray) -> np.ndarray:
    """:func:`_mean_bound` of a bucket ``stacked`` whose quantization blocks start at ``blocks``."""
    x = np.asarray(stacked, np.float64)
    scales = None
    if mode in QUANTIZED_MODES:
        scales = np.concatenate([np.repeat(np.abs(x[:, a:b]).max(axis=1, keepdims=True) / QMAX[mode], b - a, axis=1)
                                 for a, b in zip(blocks, [*blocks[1:], x.shape[1]])], axis=1)
    return _mean_bound(mode, stacked.dtype, x, scales)


def _run(mode: str, stacked: jax.Array, **options) -> np.ndarray:
    """The mean over the first ``stacked.shape[0]`` CPU devices: the whole reduced bucket."""
    fn = jax.jit(_compat.shard_map(
        lambda x: reduce_scatter_bucket(x[0], "data", mode=mode, **options),
        mesh=data_mesh(stacked.shape[0]), in_specs=P("data"), out_specs=P("data")))
    return np.asarray(fn(stacked))


# float16 buckets overflow only where they are summed in float16 ("bf16"); the other modes sum
# in float32, which 8 float16 values cannot overflow.
CASES = [(m, d) for m in REDUCE_MODES for d in (jnp.float32, jnp.bfloat16)] + [("bf16", jnp.float16)]


@pytest.mark.parametrize("n", [8, 6])
@pytest.mark.parametrize("mode,dtype", CASES, ids=[f"{m}-{jnp.dtype(d).name}" for m, d in CASES])
def test_mean_near_the_largest_finite_value_stays_finite(mode, dtype, n):
    """Each device's values near half (and three quarters of) its dtype's largest finite value:
    the sum over the devices overflows, the mean does not; every element of the mean is finite
    and within its rounding bound of the float64 mean (the ordinary part too: divided once)."""
    size = n * 256
    stacked = _near_the_top(n, size, dtype, seed=n)
    starts = tuple(s.start for s in _slices(size).values())
    options = dict(block_starts=starts) if mode in QUANTIZED_MODES else {}
    out = _run(mode, stacked, average=True, **options)
    x = np.asarray(stacked, np.float64)
    assert np.all(np.abs(x.sum(axis=0)[_slices(size)["half"]]) > 1.5 * float(jnp.finfo(dtype).max))
    assert np.all(np.isfinite(out)), f"{mode}: {np.sum(~np.isfinite(out))} elements of a finite mean not finite"
    blocks = block_partition(size, n, 256, starts).bucket_starts()
    ref, _ = _mean(stacked)
    what = f"{mode}, {jnp.dtype(dtype).name}, n={n}"
    assert_within({k: out[s] for k, s in _slices(size).items()}, {k: ref[s] for k, s in _slices(size).items()},
                  {k: b[s] for b in [_bound(mode, stacked, blocks)] for k, s in _slices(size).items()}, what=what)


@pytest.mark.parametrize("n", [8, 6, 3])
@pytest.mark.parametrize("mode", REDUCE_MODES)
def test_mean_is_the_sums_one_division_bit_for_bit(mode, n):
    """Ordinary values: the mean is bit for bit the float32 sum divided by ``n`` as XLA divides
    by a constant (on CPU: times float32 ``1 / n``), for a power-of-two ``n`` and not: the
    pre-divide by a power of two rounds nothing (dividing by ``n`` before the sum would round
    every term where ``n`` is not a power of two).

    ``"fp32_accum"`` sums with one XLA reduce, whose order XLA picks per program (on CPU the
    fused division makes it another loop): there the two agree to a reordered float32 sum,
    ``n - 1`` roundings of the mean of ``|x|`` each, and the division's one each."""
    stacked = jnp.asarray(_values(np.random.default_rng(n), n, (n * 512,), None, 1.0), jnp.float32)
    total = _run(mode, stacked, average=False)
    mean = _run(mode, stacked, average=True)
    undivided = np.asarray(jax.jit(lambda t: t / n)(total))
    if mode == "fp32_accum":
        _, magnitude = _mean(stacked)
        assert_within(mean, undivided, n * EPS32 * magnitude, what=f"{mode}, n={n}")
    else:
        np.testing.assert_array_equal(mean, undivided)


# -- the hierarchical reduce: reduce-scatter over "data", all-reduce over "replica" -------------

PARAMS = {"half": jax.ShapeDtypeStruct((20, 30), jnp.float32), "top": jax.ShapeDtypeStruct((300,), jnp.float32),
          "ordinary": jax.ShapeDtypeStruct((13, 29), jnp.float32)}
# (reduce mode, gradient dtype): every mode on float32 gradients, and float16 gradients summed in
# float16 by "bf16" (the outer stage too). An unscaled float16 wire is refused (test_precision).
SYNC_CASES = [(m, jnp.float32) for m in REDUCE_MODES] + [("bf16", jnp.float16)]


def _sync_grads(n: int, dtype, seed: int) -> dict[str, jax.Array]:
    """``dtype`` gradients ``[n, *shape]`` per leaf of ``PARAMS``, as ``PARTS`` describes (relative to
    ``dtype``'s largest finite value)."""
    rng = np.random.default_rng(seed)
    top = float(jnp.finfo(dtype).max)
    return {name: jnp.asarray(_values(rng, n, PARAMS[name].shape, fractions, top), dtype) for name, _, fractions in PARTS}


def _sync_bound(mode: str, dtype, g: np.ndarray) -> np.ndarray:
    """:func:`_mean_bound` of one leaf's ``dtype`` gradients ``g`` (float64 ``[n, ...]``); a
    quantized block lies inside a leaf, so its scale is at most the leaf's largest value on that
    device over ``QMAX``."""
    scales = None
    if mode in QUANTIZED_MODES:
        leaf_max = np.abs(g).reshape(g.shape[0], -1).max(axis=1).reshape((-1,) + (1,) * (g.ndim - 1))
        scales = np.broadcast_to(leaf_max / QMAX[mode], g.shape)
    return _mean_bound(mode, dtype, g, scales)


@pytest.mark.parametrize("shape", [(2, 4), (3, 2)], ids=["2x4", "3x2"])
@pytest.mark.parametrize("mode,dtype", SYNC_CASES, ids=[f"{m}-{jnp.dtype(d).name}" for m, d in SYNC_CASES])
def test_hierarchical_mean_near_the_largest_finite_value_stays_finite(mode, dtype, shape):
    """``GradSync`` with an outer axis: the reduce-scatter over ``"data"`` and the all-reduce over
    ``"replica"`` each sum values whose total overflows; the mean over all the devices (6: not a
    power of two) is finite and within its rounding bound of the float64 mean."""
    n = shape[0] * shape[1]
    mesh = Mesh(np.array(jax.devices("cpu")[:n]).reshape(shape), ("replica", "data"))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), PARAMS)
    sync = jd.GradSync(params, mesh, outer_axis="replica", reduce=mode)
    grads = _sync_grads(n, dtype, seed=n)
    fn = jax.jit(_compat.shard_map(lambda g: sync.reduce_scatter(jax.tree.map(lambda x: x[0], g)), mesh=mesh,
                                   in_specs=P(("replica", "data")), out_specs=sync.shard_specs()))
    got = leaves_of(sync, fn(grads))
    x = {k: np.asarray(g, np.float64) for k, g in grads.items()}
    assert np.all(np.abs(x["half"].sum(axis=0)) > 1.5 * float(jnp.finfo(dtype).max))
    for k, g in got.items():
        assert np.all(np.isfinite(g)), f"{mode}: {k} has {np.sum(~np.isfinite(g))} elements of a finite mean not finite"
    assert_within(got, {k: g.mean(axis=0) for k, g in x.items()},
                  {k: _sync_bound(mode, dtype, g) for k, g in x.items()}, what=f"{mode}, {jnp.dtype(dtype).name}, mesh {shape}")


@pytest.mark.parametrize("microbatches", [2, 3])
@pytest.mark.parametrize("shard_params", [False, True], ids=["local_sum", "zero3_shard_sum"])
def test_micro_batch_mean_near_the_largest_finite_value_stays_finite(shard_params, microbatches):
    """Each micro-batch's gradient is near float32's largest value, their sum is not finite,
    their mean is: the step neither skips nor moves by inf. The gradient of ``mean(x @ w)`` is
    the mean of the rows of ``x``: summed per device over its micro-batches (or, ZeRO-3, as
    reduced shards), then over the devices."""
    top = float(jnp.finfo(jnp.float32).max)
    rng = np.random.default_rng(3)
    rows = 8 * microbatches * 2
    sign = rng.choice([-1.0, 1.0], size=(1, 16))
    x = sign * rng.uniform(0.6, 0.9, size=(rows, 16)) * top
    lr = 2.0 ** -125  # the smallest normal float32s: moves w by about its own size
    params = {"w": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}
    step = jd.make_train_step(params, lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(lr), data_mesh(8),
                              jd.TrainConfig(microbatches=microbatches, shard_params=shard_params, bucket_size=8))
    state, metrics = step(step.init(), {"x": np.asarray(x, np.float32)})
    assert not bool(metrics.skipped) and int(metrics.nonfinite_buckets) == 0
    want = np.asarray(params["w"], np.float64) - lr * np.asarray(x, np.float32).astype(np.float64).mean(axis=0)
    got = np.asarray(jax.device_get(step.master_params(state)["w"]), np.float64)
    # The mean of the rows: its additions (rows per micro-batch, micro-batches, devices) and divisions
    # round by EPS32 each, relative to the mean of |x|; the update and the parameter by two more.
    roundings = rows // (8 * microbatches) + microbatches + 8 + 3
    bound = lr * roundings * EPS32 * np.abs(x).mean(axis=0) + 2 * EPS32 * np.abs(want)
    assert np.all(np.isfinite(got))
    assert_within({"w": got}, {"w": want}, {"w": bound}, what="parameters after one step")


# (dtype, micro-batches, weighted): the reported loss's mean over the devices, over micro-batches,
# and the weighted loss's global total over its global count.
LOSS_CASES = [(jnp.float32, 1, False), (jnp.float32, 3, True), (jnp.float16, 1, False), (jnp.float16, 2, False)]


@pytest.mark.parametrize("dtype,microbatches,weighted", LOSS_CASES,
                         ids=[f"{jnp.dtype(d).name}-{k}-{'weighted' if w else 'mean'}" for d, k, w in LOSS_CASES])
def test_reported_loss_is_finite_where_its_mean_is(dtype, microbatches, weighted):
    """Every device's loss near its dtype's largest finite value, one sign: their sum overflows,
    their mean (the reported loss) does not. Each local loss is one batch value exactly (the
    parameters' term is far below its rounding), so the float64 mean of the batch is the
    reference, within the float32 sum's roundings (one per device and micro-batch, and the
    divisions) and, in float16, the mean's own rounding to float16."""
    top = float(jnp.finfo(dtype).max)
    rows = 8 * microbatches  # one row per device and micro-batch
    x = np.asarray(jnp.asarray(np.random.default_rng(4).uniform(0.6, 0.9, size=(rows,)) * top, dtype))
    params = {"w": jnp.asarray(np.random.default_rng(5).normal(size=(4,)) * 1e-3, jnp.float32)}

    def loss_fn(p, b):
        value = b["x"][0] + jnp.sum(p["w"] ** 2).astype(dtype)
        return jd.WeightedLoss(value, jnp.ones((), jnp.float32)) if weighted else value

    step = jd.make_train_step(params, loss_fn, optax.sgd(1e-3), data_mesh(8),
                              jd.TrainConfig(microbatches=microbatches, bucket_size=4))
    _, metrics = step(step.init(), {"x": x})
    loss = np.float64(jax.device_get(metrics.loss))
    assert np.isfinite(loss), f"a mean of {x.astype(np.float64).mean():.4g} reported as {loss}"
    assert np.abs(x.astype(np.float64)).sum() > float(jnp.finfo(dtype).max)
    want = x.astype(np.float64).mean()
    bound = (rows + 3) * EPS32 * abs(want) + float(jnp.finfo(dtype).eps) / 2 * abs(want)
    assert_within({"loss": loss}, {"loss": want}, {"loss": bound}, what=f"{jnp.dtype(dtype).name} loss")

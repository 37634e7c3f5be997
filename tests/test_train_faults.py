"""Runs that survive: non-finite gradients skip the update bit for bit, model state (batch
statistics, RNG counters) included, metrics report it, a consumed (donated) state is refused with
a Python error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from flax import nnx
from flax_models import (
    CNN, LinenResNet, Stack, cnn_loss, image_batches, linen_loss, linen_variables, stack_loss, vector_batches,
)

import jax_drain as jd

D, O, B = 12, 5, 16


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(D, O)) * 0.3, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(O,)) * 0.1, jnp.float32)}


def _loss(p, batch):
    # "b"'s gradient is mean(s): an inf in one example's s poisons "b"'s bucket only.
    fit = jnp.mean(jnp.sum((batch["x"] @ p["w"] - batch["y"]) ** 2, axis=-1))
    return fit + jnp.mean(batch["s"][:, None] * p["b"])


def _batch(seed=1):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B, O)).astype(np.float32),
            "s": rng.normal(size=(B,)).astype(np.float32)}


def _step(tx=None, **config):
    options = dict(bucket_size=O, donate=False) | config  # b, then w: two buckets
    tx = tx or jd.adamw(1e-2, max_norm=1.0)
    return jd.make_train_step(_params(), _loss, tx, data_mesh(8), jd.TrainConfig(**options), example_batch=_batch())


def _same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("poison", [("x",), ("s",), ("x", "s")])
def test_a_nan_in_one_device_batch_skips_the_update_bit_for_bit(poison):
    step = _step()
    assert step.sync.num_buckets == 2
    state, first = step(step.init(), _batch())
    assert not bool(first.skipped) and int(first.nonfinite_buckets) == 0 and int(state.step) == 1
    bad = _batch(2)
    for name in poison:  # example 3: device 1's share of the batch
        bad[name][3] = np.nan if name == "x" else np.inf
    after, metrics = step(state, bad)
    assert bool(metrics.skipped)
    # x poisons w's bucket, s poisons b's.
    assert int(metrics.nonfinite_buckets) == len(poison)
    assert not np.isfinite(float(metrics.grad_norm))
    _same(after.params, state.params)
    _same(after.opt_state, state.opt_state)
    assert int(after.step) == 1  # the optimizer step count did not move either
    healed, metrics = step(after, _batch(3))
    assert not bool(metrics.skipped) and int(healed.step) == 2
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(healed.params)))


def test_without_the_skip_one_nan_destroys_every_parameter():
    step = _step(skip_nonfinite=False)
    state, _ = step(step.init(), _batch())
    bad = _batch(2)
    bad["x"][3] = np.nan
    state, metrics = step(state, bad)  # w's gradient is NaN, the clip spreads it to b
    assert not bool(metrics.skipped) and int(metrics.nonfinite_buckets) == 1
    assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(jax.device_get(state.params)))


def test_large_gradient_threshold_skips():
    step = _step(skip_grad_norm_above=1e-3)
    state = step.init()
    after, metrics = step(state, _batch())
    assert bool(metrics.skipped) and int(metrics.nonfinite_buckets) == 0
    assert float(metrics.grad_norm) > 1e-3
    _same(after.params, state.params)


def test_the_skip_keeps_donation_on_and_a_consumed_state_is_refused():
    step = _step(donate=True)
    state = step.init()
    new, _ = step(state, _batch())
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))  # donated
    with pytest.raises(ValueError, match="consumed by an earlier step call"):
        step(state, _batch())
    bad = _batch(2)
    bad["x"][0] = np.nan
    kept, metrics = step(new, bad)  # a skipped step donates too, and returns the same values
    assert bool(metrics.skipped)
    newer, _ = step(kept, _batch(3))
    assert int(newer.step) == 2


def test_the_skip_works_for_a_scanned_stack_with_micro_batches():
    """ScanGradSync (shards reduced inside the backward scan, accumulated over 2 micro-batches):
    a NaN in one micro-batch of one device still skips the step bit for bit."""
    rng = np.random.default_rng(5)
    params = {"blocks": {"w": jnp.asarray(rng.normal(size=(3, D, D)) * 0.3, jnp.float32)},
              "head": jnp.asarray(rng.normal(size=(D, O)), jnp.float32)}

    def loss(p, batch):
        h, _ = jax.lax.scan(lambda h, b: (jnp.tanh(h @ b["w"]), None), batch["x"], p["blocks"])
        return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

    step = jd.make_train_step(params, loss, jd.adamw(1e-2, max_norm=1.0), data_mesh(8),
                              jd.TrainConfig(bucket_size=O, scan_layers=True, microbatches=2, donate=False),
                              example_batch=_batch())
    assert step.scan_layers
    state, _ = step(step.init(), _batch())
    bad = _batch(2)
    bad["x"][1, 0] = np.nan
    after, metrics = step(state, bad)
    assert bool(metrics.skipped) and int(metrics.nonfinite_buckets) > 0
    _same(after.params, state.params)
    _same(after.opt_state, state.opt_state)


# -- model state on a skipped step ---------------------------------------------------------------


def _stateful(kind: str, shard_params: bool):
    """A step over a model with state besides its parameters, and its batches: an nnx CNN
    (BatchNorm, dropout), a linen ResNet-style block (batch_stats) and an nnx.scan stack with a
    BatchNorm and a dropout stream in every layer (ScanGradSync, 2 micro-batches)."""
    config = dict(bucket_size=300, donate=True, shard_params=shard_params)
    mesh = data_mesh(8)
    if kind == "nnx":
        batches = image_batches(3, seed=4)
        model = CNN(axis_name="data", dropout=0.3, rngs=nnx.Rngs(0, dropout=1))
        step = jd.make_train_step(model, cnn_loss, jd.adamw(1e-2), mesh, jd.TrainConfig(**config),
                                  example_batch=batches[0])
    elif kind == "linen":
        batches = image_batches(3, seed=5)
        module = LinenResNet(axis_name="data")
        step = jd.make_train_step(linen_variables(module), linen_loss(module), jd.adamw(1e-2), mesh,
                                  jd.TrainConfig(**config), example_batch=batches[0], mutable=["batch_stats"])
    else:
        batches = vector_batches(3, seed=6)
        model = Stack(axis_name="data", rngs=nnx.Rngs(0, dropout=1))
        step = jd.make_train_step(model, stack_loss, jd.adamw(1e-2), mesh,
                                  jd.TrainConfig(scan_layers=True, microbatches=2, **config), example_batch=batches[0])
        assert step.scan_layers
    return step, batches


def _host(tree):
    return jax.tree.map(np.array, jax.device_get(tree))


@pytest.mark.parametrize("shard_params", [False, True], ids=["zero1", "zero3"])
@pytest.mark.parametrize("kind", ["nnx", "linen", "nnx_scan"])
def test_a_skipped_step_keeps_batch_statistics_and_rng_counters_bit_for_bit(kind, shard_params):
    """A NaN in one example of one device's batch: the step is skipped and the model state
    (running statistics, RNG counters) is the state from before it, bit for bit, with the
    input state donated; the next healthy step moves it again."""
    step, (first, bad, healthy) = _stateful(kind, shard_params)
    state, _ = step(step.init(), first)
    before = _host(state)
    bad["x"][3] = np.nan  # device 1's share (two examples per device)
    after, metrics = step(state, bad)
    assert bool(metrics.skipped)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.model_state))  # donated
    _same(after.model_state, before.model_state)
    _same(after.params, before.params)
    _same(after.opt_state, before.opt_state)
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(before.model_state)]
    counts = [path for path in paths if "count" in path]
    assert (len(counts) > 0) == (kind != "linen")  # the nnx models' dropout counters are among them
    healed, metrics = step(after, healthy)
    assert not bool(metrics.skipped)
    moved = _host(healed.model_state)
    for path, old, new in zip(paths, jax.tree.leaves(before.model_state), jax.tree.leaves(moved)):
        if "key" not in path:  # RNG keys never change; counters and statistics do
            assert not np.array_equal(old, new), f"{path} did not move"
        assert np.all(np.isfinite(new))

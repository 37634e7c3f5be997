"""Runs that survive: non-finite gradients skip the update bit for bit, metrics report it, a
consumed (donated) state is refused with a Python error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh

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

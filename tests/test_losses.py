"""Per-token losses: ``jd.WeightedLoss(total, count)`` gives the gradient of the global sum over
the global count, across devices and micro-batches with uneven padding, against one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh

import jax_drain as jd
from helpers import assert_within, loss_rounding_bounds, reference_run, rounding_chain, sgd_rounding_bounds

V, D, T, L, B = 11, 8, 6, 3, 32


def _params(rng):
    n = lambda *s: jnp.asarray(rng.normal(size=s) * 0.4, jnp.float32)
    return {"embed": n(V, D), "blocks": {"w": n(L, D, D)}, "head": n(D, V)}


def _nll(p, tokens):
    def layer(h, block):
        return h + jnp.tanh(h @ block["w"]), None

    h, _ = jax.lax.scan(layer, p["embed"][tokens[:, :-1]], p["blocks"])
    logp = jax.nn.log_softmax(h @ p["head"])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def weighted_loss(p, batch):
    mask = batch["mask"][:, 1:]
    return jd.WeightedLoss(jnp.sum(_nll(p, batch["tokens"]) * mask), jnp.sum(mask))


def reference_loss(p, batch):
    mask = batch["mask"][:, 1:]
    return jnp.sum(_nll(p, batch["tokens"]) * mask) / jnp.sum(mask)


def _batches(n):
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        lengths = rng.integers(2, T + 1, size=B)
        lengths[:4] = T        # device 0: no padding; device 1 mostly padding
        lengths[4:8] = 2
        mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
        out.append({"tokens": rng.integers(0, V, size=(B, T)).astype(np.int32), "mask": mask})
    return out


@pytest.mark.parametrize("scan_layers", [False, True], ids=["grad_sync", "scan_grad_sync"])
def test_weighted_loss_is_the_global_per_token_mean(scan_layers):
    rng = np.random.default_rng(0)
    params, batches = _params(rng), _batches(3)
    tx = lambda: optax.sgd(0.5)
    step = jd.make_train_step(params, weighted_loss, tx(), data_mesh(8),
                              jd.TrainConfig(bucket_size=40, microbatches=2, scan_layers=scan_layers),
                              example_batch=batches[0])
    assert step.scan_layers == scan_layers
    state, losses = step.init(), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics.loss))
    ref, ref_losses, gradients = reference_run(reference_loss, params, tx(), batches)
    additions = rounding_chain(jax.grad(reference_loss), params, batches[0]) + 8 + 2
    bounds = sgd_rounding_bounds(gradients, additions=additions, learning_rate=0.5, params=params)
    assert_within(np.asarray(losses), np.asarray(ref_losses),
                  loss_rounding_bounds(ref_losses, gradients, bounds, additions=additions), what="losses")
    assert_within(jax.device_get(state.params), ref, bounds[-1], what="params")


def test_the_mean_of_device_means_would_differ():
    """The uneven padding is real: a mean of per-device, per-micro-batch means is not the
    per-token mean, so the test above tells the two apart."""
    batch = _batches(1)[0]
    params = _params(np.random.default_rng(0))
    parts = [jax.tree.map(lambda x: x[i:i + 2], batch) for i in range(0, B, 2)]
    mean_of_means = np.mean([float(reference_loss(params, part)) for part in parts])
    assert abs(mean_of_means - float(reference_loss(params, batch))) > 1e-3


def _mean_loss(p, batch):
    return reference_loss(p, batch)


@pytest.mark.parametrize("config", [
    {}, {"shard_params": True}, {"scan_layers": True}, {"microbatches": 2},
], ids=["zero1", "zero3", "scanned", "microbatches"])
def test_a_loss_already_averaged_over_the_data_axis_is_refused(config):
    """A loss that ``pmean``s itself over the data axis reports the right value, but every
    device's gradient is then the global loss's and the step's mean of them is off: refused,
    saying what to return instead."""
    params, batch = _params(np.random.default_rng(0)), _batches(1)[0]
    averaged = lambda p, b: jax.lax.pmean(_mean_loss(p, b), "data")
    with pytest.raises(ValueError, match="(?s)same on every device along the data-parallel axes.*WeightedLoss"):
        step = jd.make_train_step(params, averaged, optax.sgd(0.5), data_mesh(8),
                                  jd.TrainConfig(bucket_size=40, **config), example_batch=batch)
        step(step.init(), batch)
    # The device's own loss trains; the refusal is the pmean's.
    step = jd.make_train_step(params, _mean_loss, optax.sgd(0.5), data_mesh(8),
                              jd.TrainConfig(bucket_size=40, **config), example_batch=batch)
    assert np.isfinite(float(step(step.init(), batch)[1].loss))


@pytest.mark.parametrize("value", [
    lambda p, b: jnp.sum(jnp.argmax(_nll(p, b["tokens"]), axis=-1)),
    lambda p, b: jnp.any(_nll(p, b["tokens"]) > 1.0),
    lambda p, b: 3,
], ids=["int_array", "bool", "python_int"])
def test_a_loss_without_a_gradient_is_refused(value):
    """An integer or boolean loss cast to float would train on zero gradients."""
    params, batch = _params(np.random.default_rng(0)), _batches(1)[0]
    step = jd.make_train_step(params, value, optax.sgd(0.5), data_mesh(8), jd.TrainConfig(bucket_size=40))
    with pytest.raises(ValueError, match="(?s)dtype (int|bool).*no gradient.*floating point"):
        step(step.init(), batch)

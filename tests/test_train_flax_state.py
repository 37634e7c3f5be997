"""Real Flax state through the train step: BatchNorm statistics equal a one-device full-batch
reference, dropout masks differ per device and resume reproducibly from a checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import data_mesh
from flax import nnx

import jax_drain as jd

B, HW, C, CLASSES = 16, 6, 3, 5


class CNN(nnx.Module):
    def __init__(self, *, axis_name, dropout, rngs):
        self.conv = nnx.Conv(C, 8, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, axis_name=axis_name, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(8 * HW * HW, CLASSES, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.norm(self.conv(x)))
        return self.head(self.drop(h).reshape(x.shape[0], -1))


def _loss(model, batch):
    logits = model(batch["x"])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=-1))


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(B, HW, HW, C)).astype(np.float32),
             "y": rng.integers(0, CLASSES, size=B).astype(np.int32)} for _ in range(n)]


def test_batchnorm_statistics_equal_a_full_batch_reference():
    batches = _batches(3)
    model = CNN(axis_name="data", dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    reference = CNN(axis_name=None, dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    step = jd.make_train_step(model, _loss, optax.sgd(0.1), data_mesh(8), jd.TrainConfig(bucket_size=500),
                              example_batch=batches[0])
    state = step.init()
    tx = optax.sgd(0.1)
    opt_state = tx.init(nnx.state(reference, nnx.Param))
    for batch in batches:
        state, metrics = step(state, batch)
        loss, grads = nnx.value_and_grad(_loss)(reference, batch)
        params = nnx.state(reference, nnx.Param)
        updates, opt_state = tx.update(grads, opt_state, params)
        nnx.update(reference, optax.apply_updates(params, updates))
        np.testing.assert_allclose(float(metrics.loss), float(loss), rtol=1e-5)
    step.update_model(model, state)
    for name in ("mean", "var"):
        got, want = getattr(model.norm, name)[...], getattr(reference.norm, name)[...]
        assert not np.allclose(want, 0.0 if name == "mean" else 1.0)  # the statistics moved
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.head.kernel[...], reference.head.kernel[...], rtol=1e-4, atol=1e-6)


def test_batchnorm_without_axis_name_is_refused():
    model = CNN(axis_name=None, dropout=0.0, rngs=nnx.Rngs(0, dropout=1))
    with pytest.raises(ValueError, match="differs across the data-parallel devices.*axis_name='data'"):
        step = jd.make_train_step(model, _loss, optax.sgd(0.1), data_mesh(8), jd.TrainConfig(bucket_size=500))
        step(step.init(), _batches(1)[0])


class Masked(nnx.Module):
    """loss = sum(dropout(ones) * w): w's gradient is the dropout mask, averaged over devices."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((256,)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(self.drop(jnp.ones((x.shape[0], 256))) * self.w) / x.shape[0]


def test_dropout_masks_differ_per_device():
    model = Masked(nnx.Rngs(dropout=3))
    step = jd.make_train_step(model, lambda m, b: m(b["x"]), optax.sgd(1.0), data_mesh(8),
                              jd.TrainConfig(bucket_size=None))
    state, _ = step(step.init(), {"x": np.zeros((8, 1), np.float32)})  # one example per device
    moved = -np.asarray(jax.device_get(state.params["w"]))  # the mean over 8 devices of mask / 0.5
    # Identical masks on every device would give only 0 and 2; independent ones, eighths of 2.
    assert len(np.unique(np.round(moved * 4))) > 4
    assert 0.7 < moved.mean() < 1.3


def test_dropout_resumes_reproducibly_from_a_checkpoint(tmp_path):
    batches = _batches(4, seed=1)
    make = lambda: jd.make_train_step(CNN(axis_name="data", dropout=0.3, rngs=nnx.Rngs(0, dropout=1)), _loss,
                                      optax.adam(1e-2), data_mesh(8), jd.TrainConfig(bucket_size=500, microbatches=2),
                                      example_batch=batches[0])
    step = make()
    state = step.init()
    straight = []
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        straight.append(float(metrics.loss))
        if i == 1:
            jd.save_checkpoint(tmp_path / "ckpt", state)
    fresh = make()
    state, _ = jd.restore_checkpoint(tmp_path / "ckpt", fresh.abstract_state())
    resumed = []
    for batch in batches[2:]:
        state, metrics = fresh(state, batch)
        resumed.append(float(metrics.loss))
    assert resumed == straight[2:]
    assert int(jax.device_get(state.model_state[1]["drop"]["rngs"]["count"])) > 0
